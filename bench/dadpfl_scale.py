"""DA-DPFL's simulator cost per agent-round as the fleet grows. Target: the CPU time per
agent-round at the largest fleet within 1.2x of the smallest's.

mnist1d's 4,000 training samples stop at about 1,000 agents (min_samples 3); the figure at
10,000 agents, on a synthetic set that gives every agent the same 20 samples at every size,
is `bench.sim_scale`'s CPU ms / agent-round (docs/scaling.md).

    python -m bench.dadpfl_scale [--agents 100,300,1000] [--seeds 1,2] [--rounds 3]
        [--out bench/results/dadpfl_scale.json]

Each (fleet size, seed) is one `coordinator simulate --strategy dadpfl --dataset mnist1d`
run (min_samples 3, so 1,000 agents fit mnist1d's 4,000 training samples), in its own
process with one torch thread. Its CPU time (the process's, user + system) is read when each
round's first agent is done (the progress callback's first call of a round; a round's span is
its agents but the first, plus the next round's first: the same count) and when the run
returns, so:

* setup: the dataset, the partition, the model and every agent's state, before round 1;
* round 1: the first round's CPU per agent (what a fleet pays once, e.g. the first draws);
* steady: rounds 2..R's CPU per agent-round, the figure the target compares;
* topology: of that, what the round's reuse order, neighbour draws and prior/posterior
  splits cost per agent-round, timed alone after the run (the part that grows with K).

The fleet shares mnist1d's samples, so an agent's data, and its training, shrink as the fleet
grows: a steady figure that rises with the fleet is the simulator's own per-round work
(topology, inboxes, traffic, votes, records) growing faster than the fleet.

Measured here (2 cores shared with other jobs, seeds 1 and 2, ms of CPU per agent-round;
bench/results/dadpfl_scale-before.json and dadpfl_scale.json):

    agents   steady before   steady after   topology before   topology after
       100       22.2-22.6      17.7-26.3         0.19              0.04
       300       21.2-25.2      16.5-21.9         0.55-0.57         0.09-0.10
     1,000       19.9-24.7      16.9-20.2         1.79-1.82         0.27-0.29

The topology is the one part that grows with the fleet: a neighbour draw hashes every other
agent (the m smallest of K - 1 keys), so drawing everyone's is K^2 hashes a round, now about
0.27 microseconds of CPU each (1.8 before: a JSON encoding a key). It stays quadratic: at
10,000 agents about 2.7 ms per agent-round, unless the draw's definition changes (which
changes every fleet's neighbours).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.support import environment, seeds, write_json

ROOT = pathlib.Path(__file__).resolve().parents[1]
TARGET = 1.2


def one_run(agents: int, seed: int, rounds: int) -> dict[str, Any]:
    """One simulate run in this process: its CPU time before round 1 and at each round's end."""
    start = time.process_time()
    from agent.experiment import ExperimentConfig
    from agent.learning import preset
    from coordinator.simulate import Simulation

    config = ExperimentConfig(
        dataset="mnist1d",
        agents=agents,
        seed=seed,
        min_samples=3,
        learning=preset("dadpfl", rounds=rounds),
    )
    marks: list[float] = []

    def progress(t: int, _agent: str) -> None:
        if len(marks) < t:  # the first agent of round t: round t-1 (or the setup) ended
            marks.append(time.process_time())

    run = Simulation(config)
    report = run.run(progress)
    marks.append(time.process_time())
    return {
        "agents": agents,
        "seed": seed,
        "rounds": len(report["rounds"]),
        "setup_cpu_s": marks[0] - start,
        "round_cpu_s": [b - a for a, b in zip(marks, marks[1:], strict=False)],
        "mean_accuracy": report["summary"]["mean_accuracy"],
        "draw_cpu_s": draw_cpu_s(agents, seed, rounds),
    }


def draw_cpu_s(agents: int, seed: int, rounds: int) -> float:
    """CPU seconds of the run's topology alone: every round's reuse order, everyone's
    neighbour draw and prior/posterior split, as the simulator's round asks for them."""
    from agent.learning import preset
    from agent.learning.rounds import RoundTopology

    cfg = preset("dadpfl", rounds=rounds)
    roster = [f"agent-{i:04d}" for i in range(agents)]
    start = time.process_time()
    for t in range(1, rounds + 1):
        topology = RoundTopology(seed, t, roster, cfg)
        for k in topology.order:
            topology.needs(k)
            topology.prior_posterior(k)
    return time.process_time() - start


def measure(agents: int, seed: int, rounds: int) -> dict[str, Any]:
    """`one_run` in a fresh process, so no size inherits another's caches or allocator."""
    out = subprocess.run(
        [sys.executable, "-m", "bench.dadpfl_scale", "--one", f"{agents},{seed},{rounds}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.splitlines()[-1])


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per fleet size: the setup, first-round and steady CPU per agent-round over the seeds."""
    rows = []
    for agents in sorted({r["agents"] for r in runs}):
        mine = [r for r in runs if r["agents"] == agents]
        first = [r["round_cpu_s"][0] / agents * 1e3 for r in mine]
        steady = [statistics.mean(r["round_cpu_s"][1:]) / agents * 1e3 for r in mine]
        rows.append(
            {
                "agents": agents,
                "setup_s": [r["setup_cpu_s"] for r in mine],
                "first_round_ms_per_agent": first,
                "steady_ms_per_agent_round": steady,
                "first_round_s": [r["round_cpu_s"][0] for r in mine],
                "draw_ms_per_agent_round": [
                    r["draw_cpu_s"] / r["rounds"] / agents * 1e3 for r in mine
                ],
            }
        )
    base = statistics.mean(rows[0]["steady_ms_per_agent_round"])
    for row in rows:
        row["steady_vs_smallest"] = statistics.mean(row["steady_ms_per_agent_round"]) / base
    return rows


def span(values: list[float], digits: int = 1) -> str:
    low, high = min(values), max(values)
    return f"{low:.{digits}f}" if low == high else f"{low:.{digits}f}-{high:.{digits}f}"


def print_table(rows: list[dict[str, Any]], seeds_run: list[int]) -> None:
    table = Table(title=f"DA-DPFL simulate, mnist1d, CPU time, seeds {seeds_run}")
    for header in ("agents", "setup s", "round 1 s", "round 1 ms/agent", "steady ms/agent-round"):
        table.add_column(header, justify="right")
    table.add_column(f"vs smallest (target <= {TARGET})", justify="right")
    table.add_column("of which topology ms", justify="right")
    for row in rows:
        table.add_row(
            f"{row['agents']:,}",
            span(row["setup_s"]),
            span(row["first_round_s"]),
            span(row["first_round_ms_per_agent"]),
            span(row["steady_ms_per_agent_round"]),
            f"{row['steady_vs_smallest']:.2f}",
            span(row["draw_ms_per_agent_round"], 2),
        )
    Console(width=120).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", default="100,300,1000")
    parser.add_argument("--seeds", type=seeds, default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument(
        "--out", type=pathlib.Path, default=ROOT / "bench/results/dadpfl_scale.json"
    )
    args = parser.parse_args()
    if args.one:
        agents, seed, rounds = (int(x) for x in args.one.split(","))
        print(json.dumps(one_run(agents, seed, rounds)))
        return
    sizes = [int(x) for x in args.agents.split(",")]
    runs = [measure(n, seed, args.rounds) for seed in args.seeds for n in sizes]
    rows = summarize(runs)
    print_table(rows, args.seeds)
    write_json(args.out, {"environment": environment(), "rows": rows, "runs": runs})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
