"""Inflated sample counts: what one member's claim does to a weighted mean, per weighting.

    python -m bench.inflated_claims [--seeds 1,2,3] [--jobs 2]

FedAvg weighs each upload by the sample count its sender claims. An attacker (`--attack
inflate`) sends an update-sized step the wrong way (2 w_global - w_trained) and claims the
protocol's largest count, 10,000,000. Each run: FedAvg under the default `screened` rule, 20
agents (1 attacker, the first of the sorted roster), Dirichlet 0.3, 20 rounds of 2 epochs,
`--fallback off` (the aggregate alone), digits and mnist1d, seeds 1-3. Per weighting of the
uploads (`counts`: the claims as sent, FedAvg's; `cap N`: a claim at most N times the round's
median; `equal`: 1 each, the default since this study) the honest agents' final mean
accuracy with and without the attacker (the same 19 agents), and the clean run's cost
against `counts`, paired per seed. Prints a table and writes
bench/results/inflated_claims.json.

Measured (3 seeds; clean, attacked, clean cost in points):

    dataset  weighting  clean  attacked  clean cost
    digits   counts     0.907     0.089      +0.00
    digits   cap 4      0.907     0.789      +0.00
    digits   cap 2      0.905     0.865      -0.16
    digits   cap 1      0.904     0.869      -0.25
    digits   equal      0.917     0.896      +0.96
    mnist1d  counts     0.365     0.107      +0.00
    mnist1d  cap 4      0.365     0.347      +0.00
    mnist1d  cap 2      0.354     0.370      -1.09
    mnist1d  cap 1      0.365     0.393      -0.06
    mnist1d  equal      0.387     0.379      +2.18

Equal weights: the most robust on digits, within 1.5 points of the best on mnist1d, and the
best clean on both.
"""

from __future__ import annotations

import argparse
import logging
import math
import pathlib
import statistics
import sys
from collections.abc import Mapping
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from agent.experiment import ExperimentConfig
from agent.learning import preset, robust_rules
from bench.support import environment, write_json

BENCH = pathlib.Path(__file__).resolve().parent

WEIGHTINGS: dict[str, float | None] = {
    "counts": math.inf,
    "cap 4": 4.0,
    "cap 2": 2.0,
    "cap 1": 1.0,
    "equal": None,
}
"""Each weighting measured: the bound on a claim in multiples of the round's median count
(inf: none), or None for the default (`sample_weights`: 1 each)."""
DATASETS = ("digits", "mnist1d")
AGENTS, ROUNDS, EPOCHS, PARTITION = 20, 20, 2, "dirichlet:0.3"


def weigh_claims(bound: float | None) -> None:
    """Make FedAvg weigh each upload by its claimed count, at most `bound` times the round's
    median, or (None) as the project does (`sample_weights`): in this process only, for
    every run after (a worker process runs many), a study's variant, not an option."""
    from agent.learning.central import base, fedavg

    def capped(learner: Any, uploads: Mapping[str, Any]) -> dict[str, float]:
        counts = {k: float(u.num_samples) for k, u in uploads.items()}
        ceiling = (bound or math.inf) * statistics.median(counts.values())
        return {k: min(count, ceiling) for k, count in counts.items()}

    setattr(fedavg, "sample_weights", base.sample_weights if bound is None else capped)  # noqa: B010


def run(job: tuple[str, str, bool, int]) -> dict[str, Any]:
    """One FedAvg run under one cap, attacked or clean: the honest agents' mean accuracy."""
    from coordinator.simulate import simulate

    dataset, cap, attacked, seed = job
    logging.getLogger("coordinator.simulate").setLevel(logging.ERROR)
    weigh_claims(WEIGHTINGS[cap])
    config = ExperimentConfig(
        dataset=dataset,
        partition=PARTITION,
        agents=AGENTS,
        seed=seed,
        attackers=1 if attacked else 0,
        attack="inflate",
        learning=preset("fedavg", rounds=ROUNDS, epochs=EPOCHS, fallback="off"),
    )
    final = simulate(config)["rounds"][-1]["agents"]
    left_out = robust_rules.attackers(sorted(final), 1)
    honest = [a["accuracy"] for k, a in final.items() if k not in left_out]
    return {
        "dataset": dataset,
        "cap": cap,
        "attacked": attacked,
        "seed": seed,
        "honest_mean_accuracy": statistics.fmean(honest),
    }


def table(results: list[dict[str, Any]], seeds: list[int]) -> list[dict[str, Any]]:
    """Per dataset and cap: clean and attacked accuracy (means over seeds), and the clean
    run's cost against the uncapped clean run, paired per seed."""

    def accuracy(dataset: str, cap: str, attacked: bool, seed: int) -> float:
        return next(
            r["honest_mean_accuracy"]
            for r in results
            if (r["dataset"], r["cap"], r["attacked"], r["seed"]) == (dataset, cap, attacked, seed)
        )

    rows = []
    print(f"{'dataset':<8} {'weighting':<9} {'clean':>7} {'attacked':>9} {'clean cost':>11}")
    for dataset in DATASETS:
        for cap in WEIGHTINGS:
            clean = [accuracy(dataset, cap, False, s) for s in seeds]
            hit = [accuracy(dataset, cap, True, s) for s in seeds]
            uncapped = [accuracy(dataset, "counts", False, s) for s in seeds]
            cost = [c - u for c, u in zip(clean, uncapped, strict=True)]
            row = {
                "dataset": dataset,
                "cap": cap,
                "clean": statistics.fmean(clean),
                "attacked": statistics.fmean(hit),
                "attacked_min": min(hit),
                "clean_cost_points": 100 * statistics.fmean(cost),
            }
            rows.append(row)
            print(
                f"{dataset:<8} {cap:<9} {row['clean']:>7.3f} {row['attacked']:>9.3f} "
                f"{row['clean_cost_points']:>+10.2f}p"
            )
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1,2,3", help="comma-separated")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (processes)")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    jobs = [
        (d, c, a, s) for d in DATASETS for c in WEIGHTINGS for a in (False, True) for s in seeds
    ]
    with ProcessPoolExecutor(args.jobs) as pool:
        results = list(pool.map(run, jobs))
    rows = table(results, seeds)
    out = BENCH / "results" / "inflated_claims.json"
    write_json(out, {"environment": environment(), "runs": results, "table": rows})
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
