"""DA-DPFL's mechanisms against DisPFL on the learning-quality grid (issue 45, point 5).

DA-DPFL is DisPFL plus two mechanisms: dynamic aggregation (an agent waits for up to N
neighbours that train before it in the round's reuse order) and further pruning (PQI, from
the detected time t* toward s*). This bench measures what each gives and costs, and how
the pruning-time detection's threshold trades accuracy for bytes and FLOPs, per task of the
grid and as the grid's mean:

    python -m bench.dadpfl_mechanisms --workers 2      # measure what is missing, then print
    python -m bench.dadpfl_mechanisms --table          # print the saved results

Each variant's runs are saved as bench/results/learning_quality-dadpfl-NAME.json, in the
learning-quality grid's format (`python -m bench.learning_quality --label dadpfl-NAME
--strategies dadpfl --table` shows them in full). DisPFL and local-only come from the
`default` variant's file, so every variant is compared with DisPFL measured by the same code
on the same splits. The table and figures go to bench/results/dadpfl_mechanisms.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

from bench import learning_quality as lq
from bench.support import environment, write_json

VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "waiting-only": {"target_sparsity": 0.5},
    "detection-0.15": {"delta_pr": 0.15},
    "detection-0.2": {"delta_pr": 0.2},
    "pqi-paper-text": {"pqi_eta_c": 1, "pqi_gamma": 0.9},
}
"""DA-DPFL's variants: the defaults; no further pruning (s* at the initial density 0.5, so
only the waiting differs from DisPFL); an earlier t* (delta_pr 0.15, 0.2 against the
default 0.1 of the peak-relative score); the PQI values of the paper's text (eta_c 1,
gamma 0.9: most of a layer in one event) against the authors' runs' (0, 1)."""

BASELINE = "default"
"""The variant whose file also holds DisPFL's and local-only's runs."""


def results_path(variant: str) -> Any:
    return lq.BENCH / "results" / f"learning_quality-dadpfl-{variant}.json"


def measure(variant: str, tasks: list[str], seeds: list[int], workers: int) -> dict[str, Any]:
    """The variant's cells, running those not yet saved."""
    settings = VARIANTS[variant]
    path = results_path(variant)
    saved = json.loads(path.read_text()) if path.exists() else {}
    if saved and saved.get("settings", {}) != settings:
        raise SystemExit(f"{path} was measured with --set {saved['settings']}: remove it")
    results: dict[str, Any] = saved.get("cells", {})

    def save() -> None:
        write_json(path, {"environment": environment(), "settings": settings, "cells": results})

    strategies = ["local", "dadpfl"] + (["dispfl"] if variant == BASELINE else [])
    cells = [(t, s, seed) for t in tasks for s in strategies for seed in seeds]
    print(f"\n{variant} ({settings or 'the defaults'})")
    lq.run_grid(cells, settings, workers, results, save)
    return results


def compare(variants: dict[str, dict[str, Any]], tasks: list[str]) -> list[dict[str, Any]]:
    """Each variant's DA-DPFL against the baseline file's DisPFL, per task (the grid's
    `dadpfl_verdict`: gain in the metric's good direction, busiest device's bytes and
    FLOPs over the whole run)."""
    dispfl = {k: v for k, v in variants[BASELINE].items() if v.get("strategy") == "dispfl"}
    rows = []
    for variant, cells in variants.items():
        merged = {**dispfl, **{k: v for k, v in cells.items() if v.get("strategy") != "dispfl"}}
        summary = lq.summarize_cells({k: v for k, v in merged.items() if v["task"] in tasks})
        for task in tasks:
            verdict = lq.dadpfl_verdict(summary, task)
            if verdict is not None:
                ours = summary[(task, "dadpfl")]
                rows.append({"variant": variant, **verdict, "worse": ours.worse / ours.devices})
    return rows


def print_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per task, each variant's gain / bytes / FLOPs; then the grid's mean per variant."""
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    print(
        "\nDA-DPFL against DisPFL, whole run: gain (points, good direction; an error metric "
        "x100) / busiest bytes / FLOPs; * = the issue's target met (gain >= 0, bytes <= "
        "0.8x, FLOPs <= 0.75x)"
    )
    print(f"{'task':<22}" + "".join(f"{v:>24}" for v in variants))
    for task in dict.fromkeys(r["task"] for r in rows):
        line = f"{task:<22}"
        for variant in variants:
            r = next((r for r in rows if r["task"] == task and r["variant"] == variant), None)
            line += f"{'-':>24}" if r is None else f"{_cell(r):>24}"
        print(line)
    means = []
    for variant in variants:
        mine = [r for r in rows if r["variant"] == variant]
        means.append(
            {
                "variant": variant,
                "tasks": len(mine),
                "gain": statistics.fmean(100 * r["gain"] for r in mine),
                "bytes_ratio": statistics.fmean(r["bytes_ratio"] for r in mine),
                "flops_ratio": statistics.fmean(r["flops_ratio"] for r in mine),
                "shown": sum(r["shown"] for r in mine),
            }
        )
    print(f"{'mean over tasks':<22}" + "".join(f"{_mean(m):>24}" for m in means))
    print(f"{'tasks met':<22}" + "".join(f"{m['shown']:>21}/{m['tasks']:<2}" for m in means))
    return means


def _cell(row: dict[str, Any]) -> str:
    mark = "*" if row["shown"] else " "
    return f"{100 * row['gain']:+.2f} {row['bytes_ratio']:.2f} {row['flops_ratio']:.2f}{mark}"


def _mean(mean: dict[str, Any]) -> str:
    return f"{mean['gain']:+.2f} {mean['bytes_ratio']:.2f} {mean['flops_ratio']:.2f} "


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", help=f"comma-separated, of: {', '.join(lq.TASKS)}")
    parser.add_argument("--variants", help=f"comma-separated, of: {', '.join(VARIANTS)}")
    parser.add_argument("--seeds", default="1,2,3", help="comma-separated [default: 1,2,3]")
    parser.add_argument("--workers", type=int, default=1, help="runs at once (processes)")
    parser.add_argument("--table", action="store_true", help="only print the saved results")
    args = parser.parse_args(argv)
    tasks = args.tasks.split(",") if args.tasks else list(lq.TASKS)
    chosen = args.variants.split(",") if args.variants else list(VARIANTS)
    for name, known in (*((t, lq.TASKS) for t in tasks), *((v, VARIANTS) for v in chosen)):
        if name not in known:
            parser.error(f"unknown {name!r}; known: {', '.join(known)}")
    if BASELINE not in chosen:
        chosen.insert(0, BASELINE)  # DisPFL's runs are in its file
    seeds = [int(s) for s in args.seeds.split(",")]
    variants = {}
    for variant in chosen:
        if args.table:
            path = results_path(variant)
            variants[variant] = json.loads(path.read_text())["cells"] if path.exists() else {}
        else:
            variants[variant] = measure(variant, tasks, seeds, args.workers)
    rows = compare(variants, tasks)
    means = print_table(rows)
    out = lq.BENCH / "results" / "dadpfl_mechanisms.json"
    write_json(
        out,
        {
            "environment": environment(),
            "variants": {v: VARIANTS[v] for v in chosen},
            "rows": rows,
            "means": means,
        },
    )
    print(f"\nwritten to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
