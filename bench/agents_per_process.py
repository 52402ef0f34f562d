"""Agents per process: what an emulated agent costs in memory and start-up when agents share
a process (`coordinator emulate --agents-per-process K`) against a process each.
Target (issue 16): <= 15 MB per added agent.

    python -m bench.agents_per_process [--runs 32x1,32x8,8x8,32x32] [--rounds 3]
        [--broker embedded|mosquitto|HOST:PORT] [--out bench/results/agents_per_process.json]

Each run AxK is one emulation of A agents, K to a process (mnist1d, Dirichlet 0.3, DA-DPFL
with 5 neighbours, as bench/fleet_scale.py). Per run:

* uss: the agent processes' summed unique memory (USS) at its peak (sampled every 0.5 s),
  and per agent;
* used: the machine's used memory at its peak, less what was used before the run (the
  broker and this process included), per agent;
* start-up: from the call to the end of round 1, less one steady round (interpreters,
  imports, connecting); steady round: seconds per round after the first;
* completed: every agent finished every round, no straggler.

Then, per added agent: between two runs with all agents in one process (A1xA1 and A2xA2),
(uss2 - uss1) / (A2 - A1): what one more agent costs inside a shared process; and between
two runs with one agent per process, the same: what a process of its own costs.

Measured here (2 cores, 24 GB, embedded broker, other work loading the machine: load
average 25-30, so the times are upper bounds; USS is each process's own): 32 agents as 32
processes hold 5,613 MB (175 MB per agent) and start in 101 s; as 4 processes of 8, 836 MB
(26 MB per agent), 18 s; as one process of 32, 296 MB (9.2 MB per agent), 7 s. One more
agent in a shared process: 3.4 MB (8 agents in one process: 214 MB, 32: 296 MB); target
<= 15 MB. All three 32-agent runs end with the same mean accuracy (0.5161). With mosquitto,
128 agents as 8 processes of 16 complete cleanly in 1,836 MB (14.3 MB per agent; as
processes, bench/fleet_scale.py saw 20.8 GB and stragglers), 17.7 s per round (the
all-to-all votes), 62 s start-up.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
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

TARGET_MB = 15.0
MB = 2**20


def run_one(agents: int, per_process: int, rounds: int, broker_spec: str) -> dict[str, Any]:
    config = ExperimentConfig(
        dataset="mnist1d",
        agents=agents,
        partition="dirichlet:0.3",
        seed=1,
        learning=preset("dadpfl", rounds=rounds, neighbours=min(5, agents - 1)),
    )
    with tempfile.TemporaryDirectory(prefix="agents-per-process-") as folder:
        workdir = pathlib.Path(folder)
        with broker(broker_spec, workdir) as address:
            options = EmulationOptions(workdir=workdir / "fleet", agents_per_process=per_process)
            emulation = Emulation(config, address, options)
            watch = MemoryWatch(emulation)
            watch.start()
            started, clock = time.time(), time.perf_counter()
            report = emulation.run()
            wall = time.perf_counter() - clock
            watch.done.set()
            watch.join()
        ends = fleet_round_ends(workdir / "fleet", emulation.roster)
    summary = report["summary"]
    steady = steady_round_s(ends)
    return {
        "agents": agents,
        "agents_per_process": per_process,
        "processes": len({p.pid for p in emulation.processes.values()}),
        "completed": not summary["failed_agents"]
        and not summary["stragglers"]
        and len(ends) == rounds,
        "uss_mb": watch.peak_uss / MB,
        "uss_per_agent_mb": watch.peak_uss / MB / agents,
        "used_mb": (watch.peak_used - watch.baseline) / MB,
        "used_per_agent_mb": (watch.peak_used - watch.baseline) / MB / agents,
        "startup_s": ends[min(ends)] - started - (steady or 0.0) if ends else None,
        "steady_round_s": steady,
        "wall_s": wall,
        "mean_accuracy": summary.get("mean_accuracy"),
    }


def per_added_agent(results: list[dict[str, Any]], shared: bool) -> float | None:
    """USS per added agent between the smallest and largest runs of one kind: all agents
    in one process (`shared`), or a process each."""
    kind = [
        r
        for r in results
        if (r["processes"] == 1 if shared else r["agents_per_process"] == 1) and r["agents"] > 1
    ]
    if len({r["agents"] for r in kind}) < 2:
        return None
    small, large = min(kind, key=lambda r: r["agents"]), max(kind, key=lambda r: r["agents"])
    return float(large["uss_mb"] - small["uss_mb"]) / (large["agents"] - small["agents"])


def show(results: list[dict[str, Any]], added: dict[str, float | None]) -> None:
    table = Table(title="agents per process (peak memory, 3 rounds)")
    for column in (
        "agents",
        "/proc",
        "procs",
        "USS MB",
        "/agent",
        "used MB",
        "/agent",
        "start s",
        "round s",
        "clean",
    ):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(
            str(r["agents"]),
            str(r["agents_per_process"]),
            str(r["processes"]),
            f"{r['uss_mb']:.0f}",
            f"{r['uss_per_agent_mb']:.1f}",
            f"{r['used_mb']:.0f}",
            f"{r['used_per_agent_mb']:.1f}",
            f"{r['startup_s']:.1f}" if r["startup_s"] is not None else "-",
            f"{r['steady_round_s']:.2f}" if r["steady_round_s"] is not None else "-",
            "yes" if r["completed"] else "no",
        )
    console = Console()
    console.print(table)
    for kind, value in added.items():
        if value is not None:
            verdict = "" if kind == "own_process" else f" (target <= {TARGET_MB:g} MB)"
            console.print(f"USS per added agent, {kind.replace('_', ' ')}: {value:.1f} MB{verdict}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="32x1,32x8,8x8,32x32", help="AGENTSxPER_PROCESS,...")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--broker", default="embedded", help="embedded, mosquitto or HOST:PORT")
    parser.add_argument(
        "--out", type=pathlib.Path, default=ROOT / "bench/results/agents_per_process.json"
    )
    args = parser.parse_args(argv)
    runs = [tuple(int(n) for n in run.split("x")) for run in args.runs.split(",")]
    results = []
    for agents, per_process in runs:
        results.append(run_one(agents, per_process, args.rounds, args.broker))
        print(results[-1], flush=True)
    added = {
        "shared_process": per_added_agent(results, shared=True),
        "own_process": per_added_agent(results, shared=False),
    }
    show(results, added)
    write_json(
        args.out,
        {"environment": environment(), "runs": results, "uss_per_added_agent_mb": added},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
