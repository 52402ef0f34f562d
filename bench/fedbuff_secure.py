"""`python -m bench.fedbuff --secure`: FedBuff under secure aggregation against plain FedBuff
(what is measured: `bench.fedbuff`'s docstring)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import statistics
import tempfile
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from agent.experiment import ExperimentConfig
from agent.learning.buffering import buffer_size
from bench.fedbuff import config, mean_accuracy, spread
from bench.support import broker, environment, fleet_round_ends, seeds, steady_round_s, write_json
from coordinator.emulate import Emulation, EmulationOptions, auto_agents_per_process
from coordinator.simulate import simulate

STRATEGY = "fedbuff"
KINDS = (("plain", False), ("secure", True))


def sized(cfg: ExperimentConfig) -> ExperimentConfig:
    """`cfg` with the K of a secure run (at least 3) whether secure or not: one K for both."""
    size = buffer_size(0, cfg.agents, secure=True)
    return dataclasses.replace(cfg, learning=dataclasses.replace(cfg.learning, buffer_size=size))


def whole(values: list[float]) -> str:
    return f"{statistics.fmean(values):.0f} ({min(values):.0f}-{max(values):.0f})"


def taken(record: dict[str, Any], size: int) -> int:
    """Updates a version took: its `applied` (simulate), else its participants (emulate: a
    secure cohort's are distinct) or, for a plain version, K."""
    if "applied" in record:
        return len(record["applied"])
    return len(record.get("participants", [])) if record.get("secure") else size


def per_update_bytes(report: dict[str, Any], size: int, secure: bool) -> float:
    """What the devices sent over the run (statuses and all), per update a version took."""
    rounds = report["rounds"]
    sent = sum(a["bytes_sent"] for r in rounds for a in r["agents"].values())
    return sent / sum(taken(r | {"secure": secure}, size) for r in rounds)


def simulated(args: argparse.Namespace, dataset: str, seed: int) -> dict[str, Any]:
    """Plain and secure FedBuff on one seed, each with the versions that make twice FedAvg's
    updates (`bench.fedbuff.buffered`), and the secure run's virtual seconds to the plain
    one's final accuracy."""
    size = buffer_size(0, args.agents, secure=True)
    versions = 2 * args.rounds * args.agents // size
    out: dict[str, Any] = {"dataset": dataset, "seed": seed, "versions": versions, "k": size}
    records = {}
    for name, secure in KINDS:
        cfg = sized(config(dataset, args.agents, seed, STRATEGY, versions, args.epochs, secure))
        report = simulate(cfg)
        records[name] = report["rounds"]
        stale = [e["staleness"] for r in report["rounds"] for e in r["applied"]]
        out[name] = {
            "accuracy": mean_accuracy(report["rounds"][-1]),
            "seconds": report["rounds"][-1]["finished_at"],
            "bytes_per_update": per_update_bytes(report, size, secure),
            "mean_staleness": statistics.fmean(stale),
        }
    target = out["plain"]["accuracy"]
    out["secure"]["seconds_to_plain"] = next(
        (r["finished_at"] for r in records["secure"] if mean_accuracy(r) >= target), None
    )
    return out


def emulated(args: argparse.Namespace, dataset: str, seed: int, secure: bool) -> dict[str, Any]:
    """One emulated run of `--emulate` versions: seconds per version after the first, bytes
    per update, final accuracy, and the load average once it ended."""
    cfg = sized(config(dataset, args.agents, seed, STRATEGY, args.emulate, args.epochs, secure))
    with tempfile.TemporaryDirectory(prefix="fedbuff-secure-") as folder:
        workdir = pathlib.Path(folder)
        with broker(args.broker, workdir) as address:
            options = EmulationOptions(
                workdir=workdir / "fleet",
                agents_per_process=auto_agents_per_process(cfg.agents),
                linger_s=5.0,
            )
            emulation = Emulation(cfg, address, options)
            started = time.monotonic()
            report = emulation.run()
            wall = time.monotonic() - started
            ends = fleet_round_ends(workdir / "fleet", emulation.roster)
    size = buffer_size(0, args.agents, secure=True)
    return {
        "kind": "secure" if secure else "plain",
        "versions": args.emulate,
        "wall_s": wall,
        "seconds_per_version": steady_round_s(ends),
        "accuracy": mean_accuracy(report["rounds"][-1]),
        "curve": [
            (ends[r["round"]] - ends[min(ends)], mean_accuracy(r))
            for r in report["rounds"]
            if r["round"] in ends
        ],
        "bytes_per_update": per_update_bytes(report, size, secure),
        "failed": report["summary"]["failed_agents"],
        "load_average": os.getloadavg(),
    }


def seconds_to(curve: list[tuple[float, float]], target: float) -> float | None:
    """The seconds (after the first version) at which `curve` first reaches `target`."""
    return next((at for at, accuracy in curve if accuracy >= target), None)


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> Table:
    """Secure against plain FedBuff per dataset: mean and min-max over seeds."""
    out = Table(title=f"secure vs plain fedbuff, {args.agents} mixed boards (mean, min-max)")
    for column in (
        "dataset",
        "K, versions",
        "plain acc",
        "secure acc",
        "plain s",
        "secure s to plain acc / plain s",
        "plain B/update",
        "secure B/update",
        "staleness plain / secure",
    ):
        out.add_column(column)
    for dataset in args.datasets.split(","):
        mine = [r for r in rows if r["dataset"] == dataset]
        reached = [r for r in mine if r["secure"]["seconds_to_plain"] is not None]
        ratios = [r["secure"]["seconds_to_plain"] / r["plain"]["seconds"] for r in reached]
        out.add_row(
            dataset,
            f"{mine[0]['k']}, {mine[0]['versions']}",
            spread([r["plain"]["accuracy"] for r in mine]),
            spread([r["secure"]["accuracy"] for r in mine]),
            spread([r["plain"]["seconds"] for r in mine]),
            f"{spread(ratios)}, {len(reached)}/{len(mine)} reached" if ratios else "never",
            whole([r["plain"]["bytes_per_update"] for r in mine]),
            whole([r["secure"]["bytes_per_update"] for r in mine]),
            f"{spread([r['plain']['mean_staleness'] for r in mine])} / "
            f"{spread([r['secure']['mean_staleness'] for r in mine])}",
        )
    return out


def emulated_table(runs: list[dict[str, Any]]) -> Table:
    out = Table(
        title="one emulated run each (embedded broker, this machine; seconds after version 1)"
    )
    columns = ("kind", "versions", "s/version", "wall s", "s to plain acc", "acc", "B/update")
    for column in (*columns, "load avg"):
        out.add_column(column)
    target = runs[0]["accuracy"]
    for run in runs:
        per_version, reached = run["seconds_per_version"], seconds_to(run["curve"], target)
        out.add_row(
            run["kind"],
            str(run["versions"]),
            "-" if per_version is None else f"{per_version:.2f}",
            f"{run['wall_s']:.0f}",
            "never" if reached is None else f"{reached:.1f}",
            f"{run['accuracy']:.3f}",
            f"{run['bytes_per_update']:.0f}",
            " ".join(f"{x:.1f}" for x in run["load_average"]),
        )
    return out


def compare(args: argparse.Namespace) -> None:
    """The `--secure` comparison: simulated per dataset and seed, then (`--emulate`) one
    emulated run of each on the first dataset and seed."""
    rows = [
        simulated(args, dataset, seed)
        for dataset in args.datasets.split(",")
        for seed in seeds(args.seeds)
    ]
    console = Console(width=200)
    console.print(table(rows, args))
    runs = []
    if args.emulate:
        dataset, seed = args.datasets.split(",")[0], seeds(args.seeds)[0]
        runs = [emulated(args, dataset, seed, secure) for _, secure in KINDS]
        console.print(emulated_table(runs))
    write_json(
        args.out,
        {
            "environment": environment(),
            "args": vars(args) | {"out": str(args.out)},
            "rows": rows,
            "emulated": runs,
        },
    )
    print(f"wrote {args.out}")
