"""Deadlines: do an emulated mixed fleet's boards finish training within their round-time
limit by the measured clock? Issue 32's deadline test: `--reduce auto` (reductions chosen by
measured cost) against today's default `--reduce prune` (masked-dense pruning, which saves
counted FLOPs but no time), the same fleet and seed. Target: >= 95% of agent-rounds in time
under auto.

    python -m studies.deadlines [--agents 6] [--rounds 5] [--round-time-s 1.5,2] [--epochs 2]
        [--width 64] [--per-process 6] [--modes prune,auto] [--out bench/results/deadlines.json]

The fleet: `--profiles mixed` (each bundled board in turn: raspberry-pi-4, -5, jetson-nano,
x86-laptop, xavier-nx, orin-nano), DA-DPFL on digits (iid), with a wider CNN than the
bundled one (conv 1->W, conv W->2W, GroupNorm, ReLU, max-pool, linear; written to a
temporary file and passed as `--model ./file.py:build`), so that a dense round takes
seconds on a Pi 4 while this host takes a fraction of the limit: where the host itself is
slower than the limit, no reduction can meet it. Each agent's budget p_k is the share of a
dense round's training (counted FLOPs at its board's rate, RigL's dense-gradient batch
aside) that fits `--round-time-s`; each limit given is one pair of runs.

Per run and per profile: the fraction of agent-rounds whose `train_s` (host compute plus
the board's throttle sleep, what a real board would see) is within the limit; the worst
`train_s` / limit; the share of host-bound rounds (`train_s` above the board's time for the
round, `predicted_s`: this host's compute, not the board, was the clock); the reductions
chosen; and how long each agent process took to measure its costs (agents log "costs
measured in X s").

Other work may share this machine's cores: host compute times, and so the fast boards'
clocks, are then noisier than on an idle machine. A throttled board's `train_s` is its
modelled time (the throttle sleeps to it), so this measures whether the reduction chosen
and the board's clock agree with p_k; prediction error shows only on host-bound rounds.

Results, dated, with the commit, the machine and the command: studies/results/deadlines.md.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from typing import Any

from rich.console import Console
from rich.table import Table

from agent.experiment import ExperimentConfig, agent_profiles
from agent.learning import preset
from bench.support import broker, environment, write_json
from coordinator.emulate import Emulation, EmulationOptions

ROOT = pathlib.Path(__file__).resolve().parents[1]

TARGET = 0.95
MODES = ("prune", "channels", "auto")
CHANNELS = "channels"
"""`--reduce prune` on channel masks (`--mask-unit channel`): the same FLOP rule's density
cap, whose narrower model saves the seconds it counts."""
MODEL_SOURCE = '''"""A wider CNN for 8x8 digits: seconds a round on a Pi 4 (studies/deadlines)."""
from torch import nn


def build(input_shape, num_outputs):
    channels, height, width = input_shape
    return nn.Sequential(
        nn.Conv2d(channels, {w}, 3, padding=1), nn.GroupNorm(8, {w}), nn.ReLU(),
        nn.Conv2d({w}, {w2}, 3, padding=1), nn.GroupNorm(8, {w2}), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear({w2} * (height // 2) * (width // 2), num_outputs),
    )
'''
CALIBRATION = re.compile(r"costs measured in ([0-9.]+) s")


def fleet_config(
    args: argparse.Namespace, reduce: str, model: str, limit_s: float
) -> ExperimentConfig:
    """The fleet every run shares; only `--reduce` (and for channels the mask unit)
    differs."""
    learning = preset(
        "dadpfl",
        rounds=args.rounds,
        epochs=args.epochs,
        neighbours=min(5, args.agents - 1),
        reduce="prune" if reduce == CHANNELS else reduce,
        mask_unit="channel" if reduce == CHANNELS else "weight",
    )
    return ExperimentConfig(
        dataset="digits",
        agents=args.agents,
        partition="iid",
        seed=args.seed,
        model=model,
        profiles="mixed",
        round_time_s=limit_s,
        learning=learning,
    )


def calibration_s(workdir: pathlib.Path) -> list[float]:
    """Seconds each agent process spent measuring its costs, from the agents' logs."""
    found: list[float] = []
    for log in sorted(workdir.rglob("*.log")):
        found += [float(m) for m in CALIBRATION.findall(log.read_text(errors="replace"))]
    return found


def agent_rounds(report: dict[str, Any], boards: dict[str, str]) -> list[dict[str, Any]]:
    """One row per agent-round: its board, budget, reduction and clock."""
    rows = []
    for record in report["rounds"]:
        for agent, entry in record["agents"].items():
            rows.append(
                {
                    "round": record["round"],
                    "agent": agent,
                    "profile": boards[agent],
                    "p_k": entry.get("p_k"),
                    "reduction": entry.get("reduction"),
                    "train_s": entry.get("train_s"),
                    "predicted_s": entry.get("predicted_s"),
                    "peak_memory_mb": entry.get("peak_memory_mb"),
                }
            )
    return rows


def summarize(rows: list[dict[str, Any]], limit_s: float) -> dict[str, Any]:
    """In-time fraction, worst overrun, host-bound share and reductions of some agent-rounds.

    `predicted_s` is the board's time for the round (its throttle sleeps until then), so a
    round whose `train_s` exceeds it was clocked by this host's compute, not by the board."""
    timed = [r for r in rows if r["train_s"] is not None]
    ratios = [r["train_s"] / limit_s for r in timed]
    host_bound = [r for r in timed if r["predicted_s"] and r["train_s"] > r["predicted_s"] + 1e-3]
    return {
        "agent_rounds": len(timed),
        "in_time": sum(ratio <= 1.0 for ratio in ratios) / len(timed) if timed else None,
        "worst_train_over_limit": max(ratios, default=None),
        "median_train_s": statistics.median(r["train_s"] for r in timed) if timed else None,
        "host_bound": len(host_bound) / len(timed) if timed else None,
        "p_k": min((r["p_k"] for r in timed if r["p_k"] is not None), default=None),
        "reductions": dict(Counter(str(r["reduction"]) for r in timed)),
    }


def run_one(args: argparse.Namespace, reduce: str, model: str, limit_s: float) -> dict[str, Any]:
    """One emulated run of the fleet under `--reduce reduce` and a round-time limit."""
    config = fleet_config(args, reduce, model, limit_s)
    with tempfile.TemporaryDirectory(prefix=f"deadlines-{reduce}-") as folder:
        workdir = pathlib.Path(folder)
        with broker("embedded", workdir) as address:
            options = EmulationOptions(
                workdir=workdir / "fleet", agents_per_process=args.per_process, verbose=1
            )
            emulation = Emulation(config, address, options)
            clock = time.perf_counter()
            report = emulation.run()
            wall = time.perf_counter() - clock
        calibrations = calibration_s(workdir / "fleet")
    boards = {a: p.name for a, p in agent_profiles(config, emulation.roster).items()}
    rows = agent_rounds(report, boards)
    profiles = sorted(set(boards.values()), key=list(boards.values()).index)
    return {
        "reduce": reduce,
        "round_time_s": limit_s,
        "wall_s": wall,
        "completed": not report["summary"]["failed_agents"],
        "mean_accuracy": report["summary"].get("mean_accuracy"),
        "calibration_s": calibrations,
        "fleet": summarize(rows, limit_s),
        "profiles": {
            name: summarize([r for r in rows if r["profile"] == name], limit_s) for name in profiles
        },
        "agent_rounds": rows,
    }


def show(results: list[dict[str, Any]]) -> None:
    table = Table(title=f"agent-rounds trained within the limit (target >= {TARGET:.0%})")
    for column in (
        "limit s",
        "reduce",
        "profile",
        "p_k",
        "in time",
        "worst/limit",
        "median s",
        "host-bound",
    ):
        table.add_column(column, justify="right")
    table.add_column("reductions")
    for result in results:
        parts = [*result["profiles"].items(), ("fleet", result["fleet"])]
        for name, s in parts:
            table.add_row(
                f"{result['round_time_s']:g}",
                result["reduce"],
                name,
                f"{s['p_k']:.2f}" if s["p_k"] is not None else "-",
                f"{s['in_time']:.0%}" if s["in_time"] is not None else "-",
                f"{s['worst_train_over_limit']:.2f}",
                f"{s['median_train_s']:.2f}",
                f"{s['host_bound']:.0%}" if s["host_bound"] is not None else "-",
                ", ".join(f"{k} {v}" for k, v in s["reductions"].items()),
            )
    console = Console(width=120)
    console.print(table)
    for result in results:
        measured = ", ".join(f"{s:.1f}" for s in result["calibration_s"]) or "none"
        console.print(
            f"limit {result['round_time_s']:g} s, {result['reduce']}: {result['wall_s']:.0f} s, "
            f"cost measurement {measured} s (per agent process), "
            f"mean accuracy {result['mean_accuracy']:.3f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=6, help="6 or 12: each board once or twice")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--round-time-s", default="1.5,2", help="limits [s], comma-separated")
    parser.add_argument("--width", type=int, default=64, help="the CNN's first conv channels")
    parser.add_argument("--per-process", type=int, default=6, help="agents per process")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--modes", default=",".join(MODES), help="--reduce modes to run")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench/results/deadlines.json")
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="deadlines-model-") as folder:
        path = pathlib.Path(folder) / "wide_cnn.py"
        path.write_text(MODEL_SOURCE.format(w=args.width, w2=2 * args.width))
        for limit_s in (float(limit) for limit in args.round_time_s.split(",")):
            for reduce in args.modes.split(","):
                results.append(run_one(args, reduce, f"{path}:build", limit_s))
                print({k: v for k, v in results[-1].items() if k != "agent_rounds"}, flush=True)
    show(results)
    settings = {k: str(v) if isinstance(v, pathlib.Path) else v for k, v in vars(args).items()}
    write_json(
        args.out,
        {"environment": environment(), "settings": settings, "target": TARGET, "runs": results},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
