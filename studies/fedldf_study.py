"""Why FedLDF loses accuracy against FedAvg here (issue 17, point 1): one hypothesis per row.

    python -m studies.fedldf_study [--seeds 1,2,3] [--datasets mnist1d,digits] [--rounds 60]
        [--suite base|main|paper|factors|all] [--only NAME,...]
        [--out bench/results/fedldf_study.json]

The default run is `--suite all` (60 rounds), then `--rounds 240 --suite base` and `--rounds
240 --suite main --only random`; runs already in --out are kept, so a sweep resumes.

Each run goes through the learning core as `coordinator simulate` does (FedLDF's own `fit`,
`ldf.select_layers`, `ldf.aggregate_layers`; tests/test_fedldf_study.py checks that the
fedldf and fedavg rows equal the simulator's), with the selection or weighting of a row
swapped in. Unless a row says otherwise: strategies.py's setting (cnn1d on mnist1d, cnn2d on
digits, 20 agents all taking part, Dirichlet 0.3, 60 rounds, 2 local epochs, lr 0.1, batch
128, n = 4). Columns: accuracy, the global model after the last round on every agent's test
set, mean over agents, then mean over seeds (min..max); gap, points against FedAvg of the
same setting, paired by seed (min..max); same up, points against FedAvg at its first
checkpoint (every 10 rounds) that had uploaded at least as much as the row did in its whole
run (the paper's error-against-upload view); upload, floats sent over FedAvg's (divergence
vectors included); never, agents that uploaded nothing in the whole run.

Rows: fedldf is ALGORITHMS.md 4 as implemented; random, n random agents per layer (the
paper's "random algorithm"); per-step, top-n of divergence / local SGD steps; bottom, the n
least diverged; client-top / client-random, n whole models (the most diverged by whole-model
norm / random, as HDFL); uniform, the plain mean of a layer's n uploads instead of eq. 5's
|D_k| weights; all-weight, eq. 5's denominator over all K (the layer of a non-uploader counts
as the old global layer); n=8, n=12; E=1 and lr=.03 (with their own FedAvg); paper, the
paper's fleet (each round K = 20 agents drawn from N = 50, Dirichlet 1); paper-iid, the same
with iid data; Dir(1) and K=20/50, one of the paper's two fleet changes at a time.

Results, dated, with the commit, the machine and the command: studies/results/fedldf_study.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import statistics
import sys
import time
from collections.abc import Mapping
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from bench.support import environment, write_json

ROOT = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Variant:
    """One FedLDF setting; the defaults are strategies.py's run (ALGORITHMS.md 4 as is)."""

    name: str
    hypothesis: str
    n: int = 4
    select: str = "top"
    """top (eq. 4), random (n random per layer: the paper's random baseline), client-top (the n
    agents of largest whole-model divergence send every layer), client-random, bottom (the n
    least diverged per layer), per-step (top-n of divergence / local SGD steps)."""
    weight: str = "samples"
    """samples (eq. 5: |D_k| over the layer's uploaders), uniform, or all (the non-uploaders'
    share of |D| keeps the previous global layer)."""
    epochs: int = 2
    lr: float = 0.1
    rounds: int = 60
    agents: int = 20
    participants: int = 0
    """K agents drawn per round (0: all), as the paper's K = 20 of N = 50."""
    partition: str = "dirichlet:0.3"


CHECK = 10
"""Rounds between two evaluations of the global model (the accuracy curve)."""


def _pick(
    variant: Variant,
    divs: Mapping[str, dict[str, float]],
    steps: Mapping[str, int],
    gen: torch.Generator,
) -> dict[str, list[str]]:
    """Agent -> the layers it uploads this round, by the variant's selection rule."""
    from agent.learning import ldf

    ids = sorted(divs)
    layers = list(divs[ids[0]])
    n = min(variant.n, len(ids))
    if variant.select == "top":
        return ldf.select_layers(divs, variant.n)
    if variant.select == "per-step":
        return ldf.select_layers(
            {i: {layer: d / steps[i] for layer, d in divs[i].items()} for i in ids}, variant.n
        )
    if variant.select == "bottom":
        return ldf.select_layers({i: {lay: -d for lay, d in divs[i].items()} for i in ids}, n)
    chosen: dict[str, list[str]] = {i: [] for i in ids}
    if variant.select == "random":
        for layer in layers:
            for j in torch.randperm(len(ids), generator=gen)[:n].tolist():
                chosen[ids[j]].append(layer)
        return chosen
    if variant.select == "client-top":
        total = {i: math.sqrt(sum(d * d for d in divs[i].values())) for i in ids}
        picked = sorted(ids, key=lambda i: (-total[i], i))[:n]
    elif variant.select == "client-random":
        picked = [ids[j] for j in torch.randperm(len(ids), generator=gen)[:n].tolist()]
    else:
        raise ValueError(f"unknown selection {variant.select!r}")
    return {i: list(layers) if i in picked else [] for i in ids}


def _aggregate(
    variant: Variant,
    uploads: Mapping[str, dict[str, torch.Tensor]],
    samples: Mapping[str, float],
    groups: Mapping[str, list[str]],
    previous: dict[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """The new global model from the uploads, by the variant's weighting."""
    from agent.learning import ldf

    if variant.weight == "samples":
        return ldf.aggregate_layers(uploads, samples, groups, previous)
    if variant.weight == "uniform":
        return ldf.aggregate_layers(uploads, dict.fromkeys(samples, 1.0), groups, previous)
    if variant.weight == "all":
        filled = {i: {**previous, **uploads[i]} for i in samples}
        return ldf.aggregate_layers(filled, samples, groups, previous)
    raise ValueError(f"unknown weighting {variant.weight!r}")


def run(dataset: str, seed: int, variant: Variant, threads: int = 1) -> dict[str, Any]:
    """One federated run of `variant` through the learning core (FedLDF's fit, the study's
    selection and aggregation); accuracy is the global model on every agent's test set."""
    from agent.experiment import ExperimentConfig
    from agent.learning import ldf, preset
    from agent.learning.central.base import FitContext, ServerState
    from agent.learning.central.fedldf import FedLDF
    from agent.workload import build_workload

    torch.set_num_threads(threads)
    started = time.perf_counter()
    config = ExperimentConfig(
        dataset=dataset,
        agents=variant.agents,
        partition=variant.partition,
        seed=seed,
        threads=threads,
        learning=preset(
            "fedldf", rounds=variant.rounds, epochs=variant.epochs, lr=variant.lr, ldf_n=4
        ),
    )
    roster = [f"agent-{k:03d}" for k in range(variant.agents)]
    work = build_workload(config, roster)
    learner, data, strategy = work.learner, work.data, FedLDF()
    groups = learner.facts.layer_groups
    size = sum(t.numel() for t in learner.facts.initial.values())
    layer_size = {
        layer: sum(learner.facts.initial[n].numel() for n in ns) for layer, ns in groups.items()
    }
    batch = learner.config.batch_size
    steps = {k: math.ceil(len(d.y_train) / batch) * variant.epochs for k, d in data.items()}
    states = {k: learner.init_agent(k) for k in roster}
    server = ServerState(dict(learner.facts.initial))
    gen = torch.Generator().manual_seed(seed)
    sent = dense = 0
    count = {k: dict.fromkeys(groups, 0) for k in roster}
    curve = []
    for t in range(1, variant.rounds + 1):
        ids = roster
        if 0 < variant.participants < len(roster):
            ids = sorted(
                roster[j]
                for j in torch.randperm(len(roster), generator=gen)[: variant.participants]
            )
        fits = {
            k: strategy.fit(learner.facts, FitContext(states[k], data[k], server, t, 1.0))
            for k in ids
        }
        for k, fit in fits.items():
            states[k] = fit.state
        divs = {k: dict(f.divergence or {}) for k, f in fits.items()}
        chosen = _pick(variant, divs, steps, gen)
        uploads = {k: ldf.partial_state(fits[k].state.weights, chosen[k], groups) for k in ids}
        samples = {k: float(fits[k].num_samples) for k in ids}
        server = ServerState(_aggregate(variant, uploads, samples, groups, server.weights))
        ldf_round = variant.n < len(ids) or variant.select != "top"
        sent += sum(layer_size[lay] for k in ids for lay in chosen[k])
        sent += len(ids) * len(groups) if ldf_round else 0  # the divergence vectors
        dense += len(ids) * size
        for k in ids:
            for layer in chosen[k]:
                count[k][layer] += 1
        if t % CHECK == 0 or t == variant.rounds:
            accs = [learner.facts.evaluate_on(server.weights, data[k])[1] for k in roster]
            curve.append(sum(accs) / len(accs))
    return {
        "dataset": dataset,
        "seed": seed,
        "variant": variant.name,
        "accuracy": curve[-1],
        "curve": curve,
        "upload_ratio": sent / dense,
        "uploads_per_agent": {k: sum(c.values()) for k, c in count.items()},
        "uploads_per_agent_layer": count,
        "train_samples": {k: len(d.y_train) for k, d in data.items()},
        "seconds": time.perf_counter() - started,
    }


Changes = dict[str, Any]
"""Fields of a `Variant` that a row changes."""
AVG: Changes = {"n": 1000}
"""n >= K: every participant uploads every layer, which is FedAvg bit for bit (a test)."""
SELECTIONS: list[tuple[str, str, Changes]] = [
    ("random", "selection starves agents: n random per layer", {"select": "random"}),
    ("per-step", "divergence counts SGD steps: norm / steps", {"select": "per-step"}),
    ("bottom", "diagnostic: the n least diverged per layer", {"select": "bottom"}),
    ("client-top", "layer mixing: n whole models", {"select": "client-top"}),
    ("client-random", "HDFL-like: n random whole models", {"select": "client-random"}),
    ("uniform", "weighting: plain mean of the n uploads", {"weight": "uniform"}),
    ("all-weight", "weighting: non-uploaders keep the old layer", {"weight": "all"}),
    ("n=8", "n: 8 of 20", {"n": 8}),
    ("n=12", "n: 12 of 20", {"n": 12}),
    ("fedavg E=1", "local epochs: 1", {**AVG, "epochs": 1}),
    ("fedldf E=1", "local epochs: 1", {"epochs": 1}),
    ("fedavg lr=.03", "lr: 0.03", {**AVG, "lr": 0.03}),
    ("fedldf lr=.03", "lr: 0.03", {"lr": 0.03}),
]
PAPER: Changes = {"agents": 50, "participants": 20, "partition": "dirichlet:1.0"}
"""The paper's fleet: K = 20 of N = 50 clients drawn each round, Dirichlet 1."""
IID: Changes = {**PAPER, "partition": "iid"}
MILD: Changes = {"partition": "dirichlet:1.0"}
SAMPLED: Changes = {"agents": 50, "participants": 20}
FLEETS: list[tuple[str, str, Changes]] = [
    ("fedavg paper", "paper's fleet: 20 of 50, Dir(1)", {**AVG, **PAPER}),
    ("fedldf paper", "paper's fleet: 20 of 50, Dir(1)", PAPER),
    ("random paper", "paper's fleet: 20 of 50, Dir(1)", {**PAPER, "select": "random"}),
    ("fedavg paper-iid", "paper's fleet, iid", {**AVG, **IID}),
    ("fedldf paper-iid", "paper's fleet, iid", IID),
    ("random paper-iid", "paper's fleet, iid", {**IID, "select": "random"}),
]
FACTORS: list[tuple[str, str, Changes]] = [
    ("fedavg Dir(1)", "heterogeneity alone: Dir(1), 20 of 20", {**AVG, **MILD}),
    ("fedldf Dir(1)", "heterogeneity alone: Dir(1), 20 of 20", MILD),
    ("fedavg K=20/50", "participation alone: 20 of 50, Dir(.3)", {**AVG, **SAMPLED}),
    ("fedldf K=20/50", "participation alone: 20 of 50, Dir(.3)", SAMPLED),
]
SUITES = {"main": SELECTIONS, "paper": FLEETS, "factors": FACTORS}


def _variants(suite: str, rounds: int) -> list[Variant]:
    """The study's rows: FedAvg, FedLDF as is, then one changed factor per row."""
    base = Variant("fedldf", "ALGORITHMS.md 4 as is (n = 4)", rounds=rounds)
    rows = [dataclasses.replace(base, name="fedavg", hypothesis="reference: n >= K", **AVG), base]
    for name, table in SUITES.items():
        if suite in (name, "all"):
            rows += [dataclasses.replace(base, name=n, hypothesis=h, **c) for n, h, c in table]
    return rows


def _summary(results: list[dict], datasets: list[str], variants: list[Variant]) -> list[dict]:
    """Per dataset and variant: accuracy over seeds, paired gap to its FedAvg, upload ratio,
    and how unevenly the uploads fell on the agents."""
    out = []
    for dataset in datasets:
        for v in variants:
            rs = [r for r in results if r["dataset"] == dataset and r["variant"] == v.name]
            if not rs:
                continue
            ref_name = _reference(v, variants)
            ref = {
                r["seed"]: r["curve"]
                for r in results
                if r["dataset"] == dataset and r["variant"] == ref_name
            }
            gaps = [r["accuracy"] - ref[r["seed"]][-1] for r in rs if r["seed"] in ref]
            # FedAvg at its first checkpoint (every CHECK rounds) that uploaded at least as
            # much as this run did in all its rounds: the paper's accuracy-per-upload view.
            same_bytes = [
                r["accuracy"] - ref[r["seed"]][math.ceil(r["upload_ratio"] * v.rounds / CHECK) - 1]
                for r in rs
                if r["seed"] in ref
            ]
            accs = [r["accuracy"] for r in rs]
            never = [sum(1 for c in r["uploads_per_agent"].values() if c == 0) for r in rs]
            out.append(
                {
                    "dataset": dataset,
                    "variant": v.name,
                    "hypothesis": v.hypothesis,
                    "seeds": [r["seed"] for r in rs],
                    "accuracy": statistics.fmean(accs),
                    "min": min(accs),
                    "max": max(accs),
                    "gap": statistics.fmean(gaps) if gaps else None,
                    "gap_min": min(gaps, default=None),
                    "gap_max": max(gaps, default=None),
                    "gap_same_upload": statistics.fmean(same_bytes) if same_bytes else None,
                    "reference": ref_name,
                    "upload_ratio": statistics.fmean(r["upload_ratio"] for r in rs),
                    "never_uploading": statistics.fmean(never),
                }
            )
    return out


def _reference(v: Variant, variants: list[Variant]) -> str:
    """The FedAvg run a variant is compared with: same fleet, epochs, lr and rounds."""
    for ref in variants:
        same = (ref.epochs, ref.lr, ref.rounds, ref.agents, ref.participants, ref.partition)
        if ref.n >= 1000 and same == (
            v.epochs,
            v.lr,
            v.rounds,
            v.agents,
            v.participants,
            v.partition,
        ):
            return ref.name
    return "fedavg"


def _points(mean: float | None, low: float | None, high: float | None) -> str:
    """A paired gap in accuracy points, with its spread over the seeds."""
    if mean is None or low is None or high is None:
        return ""
    return f"{100 * mean:+.1f} ({100 * low:+.1f}..{100 * high:+.1f})"


def _table(rows: list[dict]) -> Table:
    """The summary as printed (and copied into this docstring)."""
    table = Table(title="FedLDF study (gap: points vs FedAvg of the same setting, paired by seed)")
    cols = (
        "dataset",
        "T",
        "variant",
        "hypothesis",
        "seeds",
        "accuracy (min..max)",
        "gap",
        "gap same upload",
        "upload",
        "never up",
    )
    for col in cols:
        table.add_column(col)
    for row in rows:
        table.add_row(
            row["dataset"],
            str(row["rounds"]),
            row["variant"],
            row["hypothesis"],
            str(len(row["seeds"])),
            f"{row['accuracy']:.3f} ({row['min']:.3f}..{row['max']:.3f})",
            _points(row["gap"], row["gap_min"], row["gap_max"]),
            "" if row["gap_same_upload"] is None else f"{100 * row['gap_same_upload']:+.1f}",
            f"{row['upload_ratio']:.3f}",
            f"{row['never_uploading']:.1f}",
        )
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--datasets", default="mnist1d,digits")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument(
        "--suite", default="all", choices=["base", "main", "paper", "factors", "all"]
    )
    parser.add_argument("--only", default="", help="comma-separated variant names to run")
    parser.add_argument(
        "--out", type=pathlib.Path, default=ROOT / "bench/results/fedldf_study.json"
    )
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    datasets = args.datasets.split(",")
    variants = _variants(args.suite, args.rounds)
    if args.only:
        wanted = args.only.split(",")
        variants = [v for v in variants if v.name in wanted]
    console = Console(width=None if sys.stdout.isatty() else 160)
    old = json.loads(args.out.read_text())["runs"] if args.out.exists() else []
    done = {(r["dataset"], r["seed"], r["variant"], r["rounds"]) for r in old}
    results = list(old)
    started = time.perf_counter()
    for seed in seeds:
        for dataset in datasets:
            for v in variants:
                if (dataset, seed, v.name, v.rounds) in done:
                    continue
                r = {**run(dataset, seed, v), "rounds": v.rounds, "config": dataclasses.asdict(v)}
                results.append(r)
                console.print(
                    f"{dataset} seed {seed} {v.name}: {r['accuracy']:.3f} ({r['seconds']:.0f} s)"
                )
                write_json(args.out, {"machine": environment(), "runs": results})
    rows = []
    for rounds in sorted({r["rounds"] for r in results}):
        done_here = [r for r in results if r["rounds"] == rounds]
        rows += [
            {**row, "rounds": rounds}
            for row in _summary(done_here, datasets, _variants("all", rounds))
        ]
    write_json(args.out, {"machine": environment(), "summary": rows, "runs": results})
    console.print(_table(rows))
    console.print(f"wall time {time.perf_counter() - started:.0f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
