"""`coordinator simulate --workers N`: time per round with the agents trained in N processes.

    python -m bench.sim_workers [--workers 1,2] [--strategies dadpfl,dispfl,fedavg]
        [--agents 20] [--rounds 20] [--epochs 1] [--dataset mnist1d] [--seed 1]
        [--out bench/results/sim_workers.json]

Each (strategy, workers) is one run of the same configuration (Dirichlet 0.3, the strategy's
defaults); the report must be identical whatever the workers (checked here, wall time aside).
s / round is the steady mean (end of the last round - end of the first, over the rounds
between: a round ends when its last agent finished training); whole s is the run, the
workers' start (about a second each, in parallel) included. One run at a time, one torch
thread each.

Measured here (2 cores, nothing else running, mnist1d, 20 agents; the reports identical in
every case):

    20 rounds x 1 epoch (the defaults; bench/results/sim_workers.json)
    strategy  workers  s / round        whole s
    dadpfl          1  0.249            5.1
    dadpfl          2  0.178  0.71x     5.5
    dispfl          1  0.254            5.1
    dispfl          2  0.178  0.70x     5.5
    fedavg          1  0.114            2.3
    fedavg          2  0.103  0.90x     3.9

    60 rounds x 2 epochs (`--rounds 60 --epochs 2 --strategies dadpfl,fedavg`, the setting of
    bench/strategies.py; bench/results/sim_workers_60.json)
    dadpfl          1  0.318           19.2
    dadpfl          2  0.211  0.66x    14.6  0.76x
    fedavg          1  0.191           11.4
    fedavg          2  0.131  0.69x     9.8  0.86x

Two workers do not halve a round on two cores: this process still does, between the agents'
rounds, what the simulator keeps (pickling each job, 270 kB for a DA-DPFL agent with its 5
received models; the traffic count, which encodes every model; early stopping), about 3.6 ms
an agent against 12 ms of training, on the same two cores. DA-DPFL's reuse chains cost
nothing measurable: it gains as much as DisPFL, whose rounds have none. FedAvg's short fits
(1 epoch of about 100 samples) gain least. The workers' start (about 1.5 s, in parallel)
makes `--workers` pay from runs of about 10 s; the default stays 1.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from agent.experiment import ExperimentConfig
from agent.learning import preset
from bench.support import environment, steady_round_s, write_json
from coordinator.simulate import simulate

ROOT = pathlib.Path(__file__).resolve().parents[1]


def without_wall(report: dict[str, Any]) -> str:
    """The report as JSON, its wall time left out: what must not change with the workers."""
    summary = {k: v for k, v in report["summary"].items() if k != "wall_seconds"}
    return json.dumps({**report, "summary": summary}, sort_keys=True)


def run(config: ExperimentConfig, workers: int) -> tuple[dict[str, Any], str]:
    """One simulation; its timings, and its report without wall time."""
    ends: dict[int, float] = {}

    def progress(round_: int, _agent: str) -> None:
        ends[round_] = time.time()

    started = time.perf_counter()
    report = simulate(config, progress, workers)
    figures = {"steady_round_s": steady_round_s(ends), "wall_s": time.perf_counter() - started}
    return figures, without_wall(report)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--strategies", default="dadpfl,dispfl,fedavg")
    parser.add_argument("--agents", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--dataset", default="mnist1d")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench/results/sim_workers.json")
    args = parser.parse_args(argv)
    counts = [int(w) for w in args.workers.split(",")]
    if args.rounds < 3 or min(counts) < 1:
        parser.error("need --rounds >= 3 and workers >= 1")
    rows: list[dict[str, Any]] = []
    for strategy in args.strategies.split(","):
        config = ExperimentConfig(
            dataset=args.dataset,
            agents=args.agents,
            seed=args.seed,
            learning=preset(strategy, rounds=args.rounds, epochs=args.epochs),
        )
        reports: dict[int, str] = {}
        for workers in counts:
            figures, reports[workers] = run(config, workers)
            rows.append(
                {
                    "strategy": strategy,
                    "workers": workers,
                    **figures,
                    "identical": reports[workers] == reports[counts[0]],
                }
            )
            print(f"{strategy} x{workers}: {figures}", flush=True)
    table = Table(title=f"simulate --workers, {args.agents} agents, {args.dataset}")
    for column in ("strategy", "workers", "s / round", "vs 1 worker", "whole s", "identical"):
        table.add_column(column, justify="left" if column == "strategy" else "right")
    base = {r["strategy"]: r for r in rows if r["workers"] == 1}
    for r in rows:
        one = base.get(r["strategy"])
        ratio = f"{r['steady_round_s'] / one['steady_round_s']:.2f}x" if one else "-"
        table.add_row(
            r["strategy"],
            str(r["workers"]),
            f"{r['steady_round_s']:.3f}",
            ratio,
            f"{r['wall_s']:.1f}",
            "yes" if r["identical"] else "NO",
        )
    Console().print(table)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    write_json(args.out, {"config": config, "rows": rows, "machine": environment()})
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
