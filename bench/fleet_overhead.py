"""Fleet overhead: time per round of `coordinator emulate` (real agent processes over MQTT)
against `coordinator simulate` (one process) on the same configuration. Target: emulate <=
1.25x simulate.

    python -m bench.fleet_overhead [--agents 8] [--rounds 20] [--strategy dadpfl]
        [--dataset mnist1d] [--broker embedded|mosquitto|HOST:PORT] [--repeat 2]
        [--out bench/results/fleet_overhead.json]

Both run as their commands do by default: simulate in this process with one torch thread,
emulate with one process per agent (one torch thread each) and the embedded amqtt broker in
this process. Figures, best of `--repeat`:

* time per round, steady state (the target's figure): from the end of round 1 to the end of
  the last round, divided by the rounds in between. A round ends when its last agent has
  finished it (emulate: the agents' `finished_at` in their round logs; simulate: the progress
  callback after its last agent).
* start-up: from the call to the end of round 1, minus one steady round. Emulate pays process
  start, imports and connecting here once per run; simulate, building the workload.
* whole run per round: wall time of the call / rounds, start-up and shutdown included.
* CPU seconds of each (emulate: this process plus its finished children).

The run also checks that both give the same per-agent accuracies (they must; see
tests/test_emulate.py), so the comparison is of the same learning.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import resource
import tempfile
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from agent.experiment import ExperimentConfig
from agent.learning import PRESETS, preset
from bench.support import (
    broker,
    environment,
    fleet_round_ends,
    steady_round_s,
    write_json,
)
from coordinator.emulate import Emulation, EmulationOptions
from coordinator.simulate import Simulation

ROOT = pathlib.Path(__file__).resolve().parents[1]

TARGET = 1.25


def cpu_seconds() -> float:
    own, children = (
        resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def timing(wall: float, ends: dict[int, float], started: float, cpu: float) -> dict[str, Any]:
    steady = steady_round_s(ends)
    rounds = max(ends)
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "steady_round_s": steady,
        "startup_s": ends[min(ends)] - started - (steady or 0.0),
        "whole_run_round_s": wall / rounds,
    }


def run_simulate(config: ExperimentConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    ends: dict[int, float] = {}
    done: dict[int, int] = {}

    def advance(round_: int, _agent: str) -> None:
        done[round_] = done.get(round_, 0) + 1
        if done[round_] == config.agents:
            ends[round_] = time.time()

    cpu, started, clock = cpu_seconds(), time.time(), time.perf_counter()
    report = Simulation(config).run(advance)
    wall = time.perf_counter() - clock
    return report, timing(wall, ends, started, cpu_seconds() - cpu)


def run_emulate(
    config: ExperimentConfig, broker_spec: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="fleet-overhead-") as folder:
        workdir = pathlib.Path(folder)
        with broker(broker_spec, workdir) as address:
            emulation = Emulation(config, address, EmulationOptions(workdir=workdir / "fleet"))
            cpu, started, clock = cpu_seconds(), time.time(), time.perf_counter()
            report = emulation.run()
            wall = time.perf_counter() - clock
            cpu = cpu_seconds() - cpu
        if report["summary"]["failed_agents"]:
            raise RuntimeError(f"agents failed: {report['summary']['failed_agents']}")
        ends = fleet_round_ends(workdir / "fleet", emulation.roster)
    return report, timing(wall, ends, started, cpu)


def accuracy_gap(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max(
        abs(x["accuracy"] - b_round["agents"][agent]["accuracy"])
        for a_round, b_round in zip(a["rounds"], b["rounds"], strict=True)
        for agent, x in a_round["agents"].items()
    )


def best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return min(runs, key=lambda r: r["steady_round_s"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--strategy", default="dadpfl", choices=PRESETS)
    parser.add_argument("--dataset", default="mnist1d")
    parser.add_argument("--partition", default="dirichlet:0.3")
    parser.add_argument("--broker", default="embedded", help="embedded, mosquitto or HOST:PORT")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--out", type=pathlib.Path, default=ROOT / "bench/results/fleet_overhead.json"
    )
    args = parser.parse_args(argv)
    if args.agents < 2 or args.rounds < 2 or args.repeat < 1:
        parser.error("need --agents >= 2, --rounds >= 2 and --repeat >= 1")
    config = ExperimentConfig(
        dataset=args.dataset,
        agents=args.agents,
        partition=args.partition,
        seed=args.seed,
        learning=preset(args.strategy, rounds=args.rounds, neighbours=min(5, args.agents - 1)),
    )
    console = Console()
    simulated, emulated = [], []
    for attempt in range(1, args.repeat + 1):
        console.print(f"[{attempt}/{args.repeat}] simulate ...")
        sim_report, sim = run_simulate(config)
        simulated.append(sim)
        console.print(f"[{attempt}/{args.repeat}] emulate ({args.broker} broker) ...")
        emu_report, emu = run_emulate(config, args.broker)
        emulated.append(emu)
        gap = accuracy_gap(emu_report, sim_report)
    sim, emu = best(simulated), best(emulated)
    ratio = emu["steady_round_s"] / sim["steady_round_s"]
    table = Table(
        title=f"{args.agents} agents, {args.rounds} rounds, {args.strategy} on {args.dataset}"
    )
    for column in ("figure", "simulate", "emulate", "emulate / simulate"):
        table.add_column(column, justify="right" if column != "figure" else "left")
    for key, label in (
        ("steady_round_s", "time per round, steady (s)"),
        ("startup_s", "start-up (s)"),
        ("whole_run_round_s", "whole run / rounds (s)"),
        ("wall_s", "wall (s)"),
        ("cpu_s", "CPU (s)"),
    ):
        table.add_row(label, f"{sim[key]:.3f}", f"{emu[key]:.3f}", f"{emu[key] / sim[key]:.2f}x")
    console.print(table)
    met = ratio <= TARGET
    console.print(
        f"steady time per round, emulate / simulate: {ratio:.2f}x (target <= {TARGET}x: "
        f"{'met' if met else 'NOT met'}); largest per-agent accuracy difference {gap:.1e}"
    )
    write_json(
        args.out,
        {
            "config": dataclasses.asdict(config),
            "broker": args.broker,
            "repeat": args.repeat,
            "simulate": sim,
            "emulate": emu,
            "all_simulate": simulated,
            "all_emulate": emulated,
            "ratio_steady": ratio,
            "ratio_whole_run": emu["whole_run_round_s"] / sim["whole_run_round_s"],
            "target": TARGET,
            "target_met": met,
            "max_accuracy_difference": gap,
            "machine": environment(),
        },
    )
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
