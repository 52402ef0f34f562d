"""Accuracy cost of each `--reduce` against the masked-dense equivalent at equal p_k.

    python -m studies.reduction_accuracy [--agents 10] [--rounds 20] [--epochs 2]
        [--seeds 1,2,3] [--datasets digits,mnist1d] [--p-ks 0.5,0.2]
        [--out bench/results/reduction_accuracy.json]

Issue 32 asks what the reductions that save real seconds (prefix, width, auto) cost in
accuracy against DA-DPFL's own masked-dense budget (`prune`, the paper's: cap the sparse
model's density by FLOPs) at the same p_k. Every run is `dadpfl` (ERK density 0.5), Dirichlet
0.3, with every agent given the same p_k; the unreduced run (no budget, p_k 1) is the
reference. Per run the figure is the final round's mean (and median) accuracy over agents.
The table gives, per dataset x p_k x reduction, the mean over seeds and the paired
difference to `prune` (same seed, so same data split, initial weights and neighbours) with its
per-seed values, and the training FLOPs against the reference (counted, not timed).

How p_k is made equal: the bench builds each `coordinator.simulate.Simulation` without
profiles and sets its `budgets` to one `Budget` per agent with the wanted p_k and no memory
limit (`allowed_mb` None), before running it; a CLI run cannot do this (`--profiles` gives
each agent a p_k from its sample count).

The measured modes choose by a cost table. The simulator measures one per run on the host's
clock, which on a shared machine is noisy enough to reorder levels; so that the three seeds
and the three measured modes see the same choices, the bench measures the table once per
dataset with the simulator's own `measured_costs` (kinds freeze, prefix and width, as `auto`
measures) and gives every measured run that table. The table is in the JSON, and so are the
choices each run made (`choices`: agent-rounds per reduction and level, from the
simulator's round records, which carry `reduction` and `reduction_why`).

Results, dated, with the commit, the machine and the command: studies/results/reduction_accuracy.md.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import statistics
import time
from typing import TYPE_CHECKING, Any

import torch

from agent.device.budget import Budget
from agent.experiment import ExperimentConfig
from agent.learning import preset
from agent.learning.reductions import MEASURED_MODES
from agent.workload import build_workload
from bench.support import environment, write_json
from coordinator.simulate import Simulation, measured_costs

REPO = pathlib.Path(__file__).resolve().parent.parent

if TYPE_CHECKING:
    from agent.learning.costs import CostTable
    from agent.report import AgentRound

REDUCTIONS = ("prune", "channels", "freeze", "prefix", "width", "auto")
CHANNELS = "channels"
"""`--reduce prune` with `--mask-unit channel`: the cap by the same FLOP rule, on masks of
whole channels, so that it saves real seconds (agent/learning/channels.py)."""
BASELINE = "prune"
"""The masked-dense equivalent every other reduction is compared with (DA-DPFL's own)."""
REFERENCE = "none"
"""The run without a budget (p_k 1)."""
OUT = REPO / "bench" / "results" / "reduction_accuracy.json"


def config_of(args: argparse.Namespace, dataset: str, seed: int, reduce: str) -> ExperimentConfig:
    """The run's configuration: no profiles (the bench sets p_k itself, `equal_budgets`)."""
    unit = "channel" if reduce == CHANNELS else "weight"
    return ExperimentConfig(
        dataset=dataset,
        agents=args.agents,
        partition="dirichlet:0.3",
        seed=seed,
        learning=preset(
            "dadpfl",
            rounds=args.rounds,
            epochs=args.epochs,
            neighbours=min(5, args.agents - 1),
            reduce=BASELINE if reduce == CHANNELS else reduce,
            mask_unit=unit,
        ),
    )


def equal_budget(p_k: float, batch_size: int) -> Budget:
    """A budget of exactly `p_k` with no memory limit: only p_k reaches the reduction."""
    return Budget(
        p_k=p_k,
        effective_gflops=0.0,
        load_share=0.0,
        time_factor=p_k,
        energy_factor=None,
        battery_factor=1.0,
        memory_factor=1.0,
        batch_size=batch_size,
        fits_memory=True,
        expected_train_s=0.0,
        limited_by="time",
        reason=f"bench: every agent's p_k set to {p_k}",
        allowed_mb=None,
    )


def cost_table(args: argparse.Namespace, dataset: str) -> CostTable:
    """The host's measured costs for `dataset`'s model, as the simulator measures them under
    `--reduce auto` (freeze, prefix and width levels)."""
    config = config_of(args, dataset, args.seeds[0], "auto")
    roster = [f"agent-{k:03d}" for k in range(config.agents)]
    table = measured_costs(config, build_workload(config, roster))
    assert table is not None  # auto in a decentralized run always measures
    return table


def table_summary(table: CostTable) -> list[dict[str, Any]]:
    """Each row's measured share of a dense step's time, for the JSON."""
    return [
        {
            "kind": row.kind,
            "level": row.level,
            "window": list(row.window) if row.window else None,
            "time_fraction": round(table.fraction(row), 3),
        }
        for row in table.rows
    ]


def choice(record: AgentRound) -> str:
    """What one agent-round did, with its level: the measured modes' kind (+steps: fewer
    minibatches) and `reduction_why` up to the budget it names, the FLOP rules' density cap
    or active fraction."""
    if record.reduction_why:
        return f"{record.reduction}: {record.reduction_why.split(' (p_k')[0]}"
    if record.density_cap is not None:
        return f"prune to density {record.density_cap:.3f}"
    if record.active_fraction is not None:
        return f"freeze, active {record.active_fraction:.2f}"
    return record.reduction


def run_one(
    args: argparse.Namespace,
    dataset: str,
    seed: int,
    reduce: str,
    p_k: float | None,
    table: CostTable | None,
) -> dict[str, Any]:
    """One simulation at equal p_k (None: no budget), with its accuracy and its choices."""
    config = config_of(args, dataset, seed, BASELINE if p_k is None else reduce)
    simulation = Simulation(config)
    if p_k is not None:
        budget = equal_budget(p_k, config.learning.batch_size)
        simulation.budgets = {k: budget for k in simulation.data}
        simulation.costs = table if reduce in MEASURED_MODES else None
    records: list[AgentRound] = []

    def progress(t: int, k: str) -> None:  # before round t's record: k's of round t - 1
        if t > 1:
            records.append(simulation.last[k])

    started = time.perf_counter()
    report = simulation.run(progress)
    records += simulation.last.values()
    final = [a["accuracy"] for a in report["rounds"][-1]["agents"].values()]
    return {
        "dataset": dataset,
        "seed": seed,
        "reduce": reduce if p_k is not None else REFERENCE,
        "p_k": p_k if p_k is not None else 1.0,
        "mean_accuracy": statistics.fmean(final),
        "median_accuracy": statistics.median(final),
        "train_flops": sum(
            a["train_flops"] for r in report["rounds"] for a in r["agents"].values()
        ),
        "choices": dict(collections.Counter(choice(r) for r in records).most_common()),
        "wall_s": round(time.perf_counter() - started, 1),
    }


def cells(runs: list[dict[str, Any]], seeds: list[int]) -> list[dict[str, Any]]:
    """Per dataset x p_k x reduction: mean over seeds, and the paired difference to prune
    and the FLOPs against the reference, seed by seed."""
    by = {(r["dataset"], r["p_k"], r["reduce"], r["seed"]): r for r in runs}
    out = []
    for dataset, p_k, reduce in dict.fromkeys((r["dataset"], r["p_k"], r["reduce"]) for r in runs):
        mine = [by.get((dataset, p_k, reduce, s)) for s in seeds]
        base = [by.get((dataset, p_k, BASELINE, s)) for s in seeds]
        ref = [by.get((dataset, 1.0, REFERENCE, s)) for s in seeds]
        pairs = [(m, b) for m, b in zip(mine, base, strict=True) if m and b]
        flops = [(m, f) for m, f in zip(mine, ref, strict=True) if m and f]
        ran = [m for m in mine if m]
        out.append(
            {
                "dataset": dataset,
                "p_k": p_k,
                "reduce": reduce,
                "seeds": [m["seed"] for m in ran],
                "mean_accuracy": statistics.fmean(m["mean_accuracy"] for m in ran),
                "median_accuracy": statistics.fmean(m["median_accuracy"] for m in ran),
                "vs_prune": [round(m["mean_accuracy"] - b["mean_accuracy"], 4) for m, b in pairs],
                "flops_vs_reference": statistics.fmean(
                    m["train_flops"] / f["train_flops"] for m, f in flops
                )
                if flops
                else None,
            }
        )
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table for the note."""
    lines = [
        "| dataset | p_k | reduction | mean acc | median acc | vs prune (mean; per seed) "
        "| FLOPs vs p_k 1 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        diffs = r["vs_prune"]
        versus = (
            f"{100 * statistics.fmean(diffs):+.1f} ({', '.join(f'{100 * d:+.1f}' for d in diffs)})"
            if diffs and r["reduce"] not in (BASELINE, REFERENCE)
            else "-"
        )
        flops = f"{r['flops_vs_reference']:.2f}" if r["flops_vs_reference"] else "-"
        lines.append(
            f"| {r['dataset']} | {r['p_k']:g} | {r['reduce']} | {r['mean_accuracy']:.3f} "
            f"| {r['median_accuracy']:.3f} | {versus} | {flops} |"
        )
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--datasets", default="digits,mnist1d")
    parser.add_argument("--p-ks", default="0.5,0.2")
    parser.add_argument("--reductions", default=",".join(REDUCTIONS))
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    args = parser.parse_args(argv)
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.datasets = args.datasets.split(",")
    args.p_ks = [float(p) for p in args.p_ks.split(",")]
    args.reductions = args.reductions.split(",")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(1)
    result: dict[str, Any] = {
        "environment": environment(),
        "args": {
            k: v if not isinstance(v, pathlib.Path) else str(v) for k, v in vars(args).items()
        },
        "cost_tables": {},
        "runs": [],
    }
    for dataset in args.datasets:
        table = cost_table(args, dataset)
        result["cost_tables"][dataset] = table_summary(table)
        plan = [(None, REFERENCE)] + [(p, r) for p in args.p_ks for r in args.reductions]
        for seed in args.seeds:
            for p_k, reduce in plan:
                run = run_one(args, dataset, seed, reduce, p_k, table)
                print(
                    f"{dataset} seed {seed} p_k {run['p_k']:g} {run['reduce']}: "
                    f"mean {run['mean_accuracy']:.4f} median {run['median_accuracy']:.4f} "
                    f"({run['wall_s']} s) {run['choices']}",
                    flush=True,
                )
                result["runs"].append(run)
                result["table"] = cells(result["runs"], args.seeds)
                write_json(args.out, result)
    print(markdown(result["table"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
