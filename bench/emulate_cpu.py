"""emulate's CPU per round against simulate's at 100 agents. Target (issue 50): at most 2x.

    python -m bench.emulate_cpu [--agents 100] [--per-process 25] [--strategies fedavg,dadpfl]
        [--rounds 2,4] [--broker embedded|mosquitto|HOST:PORT]
        [--out bench/results/emulate_cpu.json]

Per strategy, simulate and emulate each run twice, for the two round counts of `--rounds`
(mnist1d, Dirichlet 0.3, seed 1, 5 neighbours), and a round's CPU is the difference of the
two runs' CPU over the difference of their rounds: start-up (processes, imports, the dataset)
cancels out. CPU is this process's and its finished children's (the agents' processes and,
with the embedded broker, the broker in this process). Both must give the same per-agent
accuracies.

Session 33, before and after its speed-ups (bench/results/emulate_cpu.json and
emulate_cpu-s33-before.json), `--rounds 2,6`, two interleaved pairs on a quiet machine:
DA-DPFL 3.34-3.89 s of CPU per round, 1.93-2.35x simulate (before 4.10-4.14 s, 2.25-2.54x);
FedAvg 2.12-2.34 s, 1.63-1.83x (before 2.08-2.10 s, 1.59-1.70x). Simulate's round is 1.3 s
(FedAvg) and 1.7-1.8 s (DA-DPFL) here. Difference runs of a few rounds are noisy: on a
machine at load 30 the same pairs gave DA-DPFL 3.0-4.1 s against 4.9-6.0 and ratios of
0.8-2.0 whichever the code.
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile
from typing import Any

from rich.console import Console
from rich.table import Table

from agent.experiment import ExperimentConfig
from agent.learning import preset
from bench.fleet_overhead import accuracy_gap, cpu_seconds
from bench.support import broker, environment, write_json
from coordinator.emulate import Emulation, EmulationOptions
from coordinator.simulate import Simulation

ROOT = pathlib.Path(__file__).resolve().parents[1]
TARGET = 2.0


def config(agents: int, strategy: str, rounds: int) -> ExperimentConfig:
    return ExperimentConfig(
        dataset="mnist1d",
        agents=agents,
        partition="dirichlet:0.3",
        seed=1,
        learning=preset(strategy, rounds=rounds, neighbours=min(5, agents - 1)),
    )


def simulated(cfg: ExperimentConfig) -> tuple[float, dict[str, Any]]:
    start = cpu_seconds()
    report = Simulation(cfg).run()
    return cpu_seconds() - start, report


def emulated(cfg: ExperimentConfig, per_process: int, spec: str) -> tuple[float, dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="emulate-cpu-") as folder:
        workdir = pathlib.Path(folder)
        with broker(spec, workdir) as address:
            options = EmulationOptions(workdir=workdir / "fleet", agents_per_process=per_process)
            start = cpu_seconds()
            report = Emulation(cfg, address, options).run()
            cpu = cpu_seconds() - start
    if report["summary"]["failed_agents"]:
        raise RuntimeError(f"agents failed: {report['summary']['failed_agents']}")
    return cpu, report


def measure(args: argparse.Namespace, strategy: str) -> dict[str, Any]:
    few, many = args.rounds
    cpu: dict[str, dict[int, float]] = {"simulate": {}, "emulate": {}}
    gaps = []
    for rounds in (few, many):
        cfg = config(args.agents, strategy, rounds)
        cpu["simulate"][rounds], sim = simulated(cfg)
        cpu["emulate"][rounds], emu = emulated(cfg, args.per_process, args.broker)
        gaps.append(accuracy_gap(emu, sim))
    per_round = {kind: (c[many] - c[few]) / (many - few) for kind, c in cpu.items()}
    return {
        "strategy": strategy,
        "cpu_s": cpu,
        "per_round_cpu_s": per_round,
        "ratio": per_round["emulate"] / per_round["simulate"],
        "largest_accuracy_gap": max(gaps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=100)
    parser.add_argument("--per-process", type=int, default=25)
    parser.add_argument("--strategies", default="fedavg,dadpfl")
    parser.add_argument("--rounds", default="2,4")
    parser.add_argument("--broker", default="embedded", help="embedded, mosquitto or HOST:PORT")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench/results/emulate_cpu.json")
    args = parser.parse_args()
    args.rounds = sorted(int(r) for r in args.rounds.split(","))
    if len(args.rounds) != 2 or args.rounds[0] == args.rounds[1]:
        parser.error("--rounds takes two different round counts, e.g. 2,4")
    rows = [measure(args, strategy) for strategy in args.strategies.split(",")]
    table = Table(title=f"CPU per round, {args.agents} agents, {args.per_process} a process")
    for header in ("strategy", "simulate s", "emulate s", f"emulate / simulate (<= {TARGET})"):
        table.add_column(header, justify="right")
    for row in rows:
        per_round = row["per_round_cpu_s"]
        table.add_row(
            row["strategy"],
            f"{per_round['simulate']:.2f}",
            f"{per_round['emulate']:.2f}",
            f"{row['ratio']:.2f}",
        )
    Console(width=120).print(table)
    given = {key: str(value) if key == "out" else value for key, value in vars(args).items()}
    write_json(args.out, {"environment": environment(), "args": given, "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
