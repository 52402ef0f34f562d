"""The examples' numbers: each example's run file under local-only training, FedAvg and the
strategies of the papers, with the task's metric and the bytes on the wire.

    python -m bench.examples                  # every example, every strategy
    python -m bench.examples sensor_regression --rounds 5

Prints a table and writes bench/results/examples.json; the examples' READMEs quote it.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from typing import Any

import edgefl
from bench.support import environment, write_json

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
STRATEGIES = ("local", "fedavg", "dadpfl", "fedspu", "fedldf")


def measure(example: str, strategy: str, rounds: int | None) -> dict[str, Any]:
    overrides: dict[str, Any] = {"strategy": strategy}
    if rounds is not None:
        overrides["rounds"] = rounds
    config = edgefl.config(EXAMPLES / example / "run.toml", **overrides)
    started = time.perf_counter()
    report = edgefl.simulate(config)
    return {
        "example": example,
        "strategy": strategy,
        "rounds": len(report.rounds),
        "metric": report.metric,
        "higher_is_better": report.higher_is_better,
        "mean_metric": report.mean_metric,
        "total_bytes": report.summary["total_bytes"],
        "seconds": round(time.perf_counter() - started, 1),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("examples", nargs="*", help="examples to run [default: all]")
    parser.add_argument("--rounds", type=int, help="override every run file's rounds")
    args = parser.parse_args(argv)
    chosen = args.examples or sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir())
    rows = []
    print(f"{'example':<22} {'strategy':<8} {'metric':<22} {'value':>8} {'MB':>8} {'s':>6}")
    for example in chosen:
        for strategy in STRATEGIES:
            row = measure(example, strategy, args.rounds)
            rows.append(row)
            print(
                f"{example:<22} {strategy:<8} {row['metric']:<22} {row['mean_metric']:>8.4f} "
                f"{row['total_bytes'] / 1e6:>8.2f} {row['seconds']:>6}"
            )
    out = pathlib.Path(__file__).parent / "results" / "examples.json"
    write_json(out, {"environment": environment(), "rows": rows})
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
