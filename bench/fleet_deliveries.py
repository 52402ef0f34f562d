"""Deliveries per agent and round: MQTT messages each agent receives in a steady round, as the
fleet grows. Target (issue 16): at most M + 5 at K = 1,000 (M neighbours a round).

    python -m bench.fleet_deliveries [--sizes 50,200,1000] [--rounds 3] [--neighbours 5]
        [--broker mosquitto|embedded|HOST:PORT] [--out bench/results/fleet_deliveries.json]

Each size K is one `coordinator emulate` run (DA-DPFL, 1 epoch, on `synthetic:1,1,K` with the
`natural` partition: one FedProx synthetic group of 200 samples per agent, an MLP; mnist1d
has too few samples for 1,000 agents; the agents sharing processes as
`--agents-per-process` does by default), with the agents logging
at info level: each logs, per round, the frames its connection received (every MQTT
delivery: models, tallies, presences, re-sends; a model larger than a frame counts once per
frame). Reported over the agents, for the rounds after the first (round 1 also carries the
run's start: the run, the start tally, the keeper's presence): mean and largest deliveries per agent
and round; and the time per round.

Before the tally keeper (coordinator/tallies.py) every agent received every other agent's
status and vote each round: about 2K + M deliveries per agent and round. Before the absence
notice (`messages.Absent`), every agent also received the fleet's K retained presences at
the start, and again after each reconnect.

Measured here (2 cores, 24 GB, mosquitto 2.0.11, nothing else running but these runs; one
run per size, `--sizes 100,300,1000`, bench/results/fleet_deliveries.json). Stragglers:
agent-rounds that went on without a neighbour's model; USS: the peak summed unique memory
of the agent processes:

    agents  per process  done  mean  max  M+5  round 1  s/round  stragglers  USS MB  wall s
       100           13  yes    5.0   11   10        6      1.4           0    1735    12.5
       300           38  yes    4.8   11   10        6      4.1           0    2416    24.3
     1,000          125  yes    5.2   14   10        6     21.6           0    4958    99.2

* The mean meets M + 5 at every size, 1,000 included (2K + M = 2,005 before the keeper); a
  few agent-rounds get more (at most 11-14): an agent whose round-1 neighbours were slow
  asks for their models, and a reconnect brings its retained subscriptions again.
* Round 1 brings about 6 deliveries to each agent at every size (the start tally, the run,
  the keeper's presence, models): K + 6 before the absence notice (329 at 300 agents).
* Memory: 3.4 MB (100 to 300 agents) and 3.6 MB (300 to 1,000) per added agent.
* What it took for 1,000 agents on 2 cores, besides the absence notice (before it, the
  start barrier's tally had not come after 300 s: 10^6 retained presences to deliver and
  check): agents in one process compute one at a time (`agent.workload.share_compute`),
  the host processes run at niceness 10 below the broker and the coordinator, and with a
  thread switch interval of 50 ms instead of Python's 5 ms (agent/host.py). Without the
  last, 8 processes of 375 threads made about 190,000 context switches a second (70-80 %
  system time: every thread waiting for the interpreter lock wakes each switch interval),
  mosquitto was starved and hundreds of connections dropped on keep-alive: of 5 runs at
  1,000 agents, one finished (52 s a round) and 4 stalled or crawled in round 1 or 2; with
  it, 3,300 a second, and all three runs since finished all 3 rounds without a straggler
  (22.0, 21.6 and 25.6 s a round; mean deliveries 5.2, 5.2 and 5.4, at most 15, 14, 16).
"""

from __future__ import annotations

import argparse
import pathlib
import re
import statistics
import tempfile
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from agent.experiment import ExperimentConfig
from agent.learning import preset
from bench.support import (
    MemoryWatch,
    broker,
    environment,
    fleet_round_ends,
    steady_round_s,
    write_json,
)
from coordinator.emulate import Emulation, EmulationOptions, auto_agents_per_process

ROOT = pathlib.Path(__file__).resolve().parents[1]

DELIVERIES = re.compile(r"round (\d+): (\d+) deliveries received")


def deliveries(log: pathlib.Path) -> dict[int, int]:
    """Round -> frames received, from an agent's log."""
    return {int(r): int(n) for r, n in DELIVERIES.findall(log.read_text(errors="replace"))}


def measure(args: argparse.Namespace, agents: int) -> dict[str, Any]:
    learning = preset("dadpfl", rounds=args.rounds, epochs=1, neighbours=args.neighbours)
    config = ExperimentConfig(
        dataset=f"synthetic:1,1,{agents}", partition="natural", agents=agents, learning=learning
    )
    with tempfile.TemporaryDirectory(prefix="deliveries-") as folder:
        workdir = pathlib.Path(folder)
        with broker(args.broker, workdir) as address:
            options = EmulationOptions(
                workdir=workdir / "fleet",
                verbose=1,
                agents_per_process=auto_agents_per_process(agents),
                round_timeout_s=args.round_timeout,
            )
            emulation = Emulation(config, address, options)
            watch = MemoryWatch(emulation)
            watch.start()
            started = time.perf_counter()
            report = emulation.run()
            wall = time.perf_counter() - started
            watch.done.set()
            watch.join()
        per_agent = {a: deliveries(emulation.log_path(a)) for a in emulation.roster}
        ends = fleet_round_ends(options.workdir, emulation.roster)
    steady = [n for rounds in per_agent.values() for r, n in rounds.items() if r >= 2]
    first = [rounds.get(1, 0) for rounds in per_agent.values()]
    done = sum(len(entry["agents"]) for entry in report["rounds"])
    return {
        "agents": agents,
        "neighbours": args.neighbours,
        "agents_per_process": options.agents_per_process,
        "completed": done == agents * args.rounds and not report["summary"].get("failures"),
        "steady_mean": statistics.fmean(steady) if steady else None,
        "steady_max": max(steady) if steady else None,
        "round1_mean": statistics.fmean(first),
        "target": args.neighbours + 5,
        "steady_round_s": steady_round_s(ends),
        "stragglers": sum(
            len(entry["stragglers"]) for r in report["rounds"] for entry in r["agents"].values()
        ),
        "agents_uss_mb": watch.peak_uss / 2**20,
        "wall_s": wall,
        "mean_accuracy": report["summary"]["mean_accuracy"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="50,200,1000")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--neighbours", type=int, default=5)
    parser.add_argument("--broker", default="mosquitto")
    parser.add_argument("--round-timeout", type=float, default=300.0)
    parser.add_argument(
        "--out", type=pathlib.Path, default=ROOT / "bench/results/fleet_deliveries.json"
    )
    args = parser.parse_args()
    table = Table(title=f"deliveries per agent and round (M = {args.neighbours}, {args.broker})")
    columns = (
        "agents",
        "per process",
        "done",
        "mean",
        "max",
        "target",
        "round 1",
        "s/round",
        "stragglers",
        "USS MB",
    )
    for column in columns:
        table.add_column(column, justify="right")
    results = []
    for agents in (int(k) for k in args.sizes.split(",")):
        result = measure(args, agents)
        results.append(result)
        settings = vars(args) | {"out": str(args.out)}
        write_json(args.out, {"environment": environment(), "args": settings, "results": results})
        table.add_row(
            str(agents),
            str(result["agents_per_process"]),
            str(result["completed"]),
            f"{result['steady_mean']:.1f}",
            str(result["steady_max"]),
            str(result["target"]),
            f"{result['round1_mean']:.0f}",
            f"{result['steady_round_s'] or 0:.1f}",
            str(result["stragglers"]),
            f"{result['agents_uss_mb']:.0f}",
        )
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
