"""Fleet scale: the largest emulated fleet (real agent processes, real broker) that completes
3 rounds on this machine, and the time per round as the fleet grows. Target: >= 50 agents.

    python -m bench.fleet_scale [--sizes 8,16,32,50,64,96,128] [--rounds 3]
        [--broker embedded|mosquitto|HOST:PORT] [--out bench/results/fleet_scale.json]

Each size is one `coordinator emulate` run (mnist1d, Dirichlet 0.3, DA-DPFL with 5 neighbours,
the defaults otherwise), run in turn until one fails: an agent that exits with an error, a
round not completed by every agent, or the run's timeout. Per size:

* completed: every agent finished every round and nobody was recorded as a straggler;
* start-up: from the call to the end of round 1, minus one steady round (process start and
  imports on two cores dominate it: it grows linearly with the fleet);
* time per round: steady rounds, from the end of round 1 to the end of the last round (a
  round ends when its last agent finishes it), divided by the rounds in between;
* wall: the whole run, agents' start and ONNX export at the end included;
* memory: the machine's used memory at its peak during the run, less what was used before it
  started, and the agents' summed unique memory (USS) at its peak.

Measured here (2 cores, 24 GB): with the embedded amqtt broker 64 agents complete cleanly
(9.3 s per round, 55 s start-up) and 96 do not (its one Python thread cannot keep up with
the all-to-all votes and statuses: 109 s per round, stragglers); with mosquitto
(`--broker mosquitto`) 96 complete (14.3 s per round, 79 s start-up, 16.6 GB) and 128 finish
their rounds only with stragglers (108 s per round, 20.8 GB: memory and the two cores run
out). Each agent process holds ~170 MB of its own (USS), mostly torch's.
"""

from __future__ import annotations

import argparse
import pathlib
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
from coordinator.emulate import Emulation, EmulationOptions

ROOT = pathlib.Path(__file__).resolve().parents[1]

TARGET = 50
MB = 2**20


def run_size(agents: int, rounds: int, broker_spec: str, seed: int) -> dict[str, Any]:
    config = ExperimentConfig(
        dataset="mnist1d",
        agents=agents,
        partition="dirichlet:0.3",
        seed=seed,
        learning=preset("dadpfl", rounds=rounds, neighbours=min(5, agents - 1)),
    )
    with tempfile.TemporaryDirectory(prefix="fleet-scale-") as folder:
        workdir = pathlib.Path(folder)
        with broker(broker_spec, workdir) as address:
            emulation = Emulation(config, address, EmulationOptions(workdir=workdir / "fleet"))
            watch = MemoryWatch(emulation)
            watch.start()
            started, clock = time.time(), time.perf_counter()
            error = None
            try:
                report = emulation.run()
            except TimeoutError as exc:
                report, error = None, str(exc)
            wall = time.perf_counter() - clock
            watch.done.set()
            watch.join()
        ends = fleet_round_ends(workdir / "fleet", emulation.roster)
    summary = report["summary"] if report else {}
    completed = (
        error is None
        and not summary.get("failed_agents")
        and not summary.get("stragglers")
        and len(ends) == rounds
        and all(len(r["agents"]) == agents for r in report["rounds"])
    )
    steady = steady_round_s(ends)
    return {
        "agents": agents,
        "completed": completed,
        "error": error or summary.get("failed_agents") or summary.get("stragglers") or None,
        "rounds_done": len(ends),
        "wall_s": wall,
        "startup_s": ends[min(ends)] - started - (steady or 0.0) if ends else None,
        "steady_round_s": steady,
        "memory_used_mb": (watch.peak_used - watch.baseline) / MB,
        "agents_uss_mb": watch.peak_uss / MB,
        "mean_accuracy": summary.get("mean_accuracy"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8,16,32,50,64,96,128")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--broker", default="embedded", help="embedded, mosquitto or HOST:PORT")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench/results/fleet_scale.json")
    args = parser.parse_args(argv)
    try:
        sizes = sorted({int(s) for s in args.sizes.split(",")})
    except ValueError:
        parser.error(f"--sizes must be a comma-separated list of integers, got {args.sizes!r}")
    if sizes[0] < 2 or args.rounds < 2:
        parser.error("sizes must be >= 2 and --rounds >= 2")
    console = Console()
    rows: list[dict[str, Any]] = []
    for agents in sizes:
        console.print(f"{agents} agents x {args.rounds} rounds ({args.broker} broker) ...")
        row = run_size(agents, args.rounds, args.broker, args.seed)
        rows.append(row)
        console.print(
            f"  {'completed' if row['completed'] else 'FAILED: ' + str(row['error'])} in "
            f"{row['wall_s']:.0f} s"
        )
        write_json(args.out, {"rows": rows, "broker": args.broker, "machine": environment()})
        if not row["completed"]:
            break
    largest = max((r["agents"] for r in rows if r["completed"]), default=0)
    table = Table(title=f"emulated fleets, {args.rounds} rounds, {args.broker} broker")
    for column in (
        "agents",
        "completed",
        "start-up s",
        "s / round",
        "wall s",
        "memory used MB",
        "agents USS MB",
    ):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            str(r["agents"]),
            "yes" if r["completed"] else "no",
            f"{r['startup_s']:.1f}" if r["startup_s"] is not None else "-",
            f"{r['steady_round_s']:.2f}" if r["steady_round_s"] is not None else "-",
            f"{r['wall_s']:.0f}",
            f"{r['memory_used_mb']:.0f}",
            f"{r['agents_uss_mb']:.0f}",
        )
    console.print(table)
    tried_all = len(rows) == len(sizes) and rows[-1]["completed"]
    console.print(
        f"largest fleet that completed: {largest} agents"
        f"{' (the largest size tried; the limit is higher)' if tried_all else ''} "
        f"(target >= {TARGET}: {'met' if largest >= TARGET else 'NOT met'})"
    )
    write_json(
        args.out,
        {
            "config": {"rounds": args.rounds, "sizes": sizes, "seed": args.seed},
            "broker": args.broker,
            "rows": rows,
            "largest_completed": largest,
            "largest_tried_completed": tried_all,
            "target": TARGET,
            "target_met": largest >= TARGET,
            "machine": environment(),
        },
    )
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
