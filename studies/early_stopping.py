"""Early-stopping rules (issue 17, point 3): agent-rounds cut and accuracy lost, per rule.

    python -m studies.early_stopping [--seeds 1,2,3] [--datasets mnist1d,digits]
        [--strategies fedspu,fedavg-ft,dadpfl] [--agents 20] [--rounds 60] [--epochs 2]
        [--rules paper,paper3,progress,progress25]
        [--out bench/results/early_stopping.json] [--resume]

`--resume` keeps the runs already in --out (same agents, rounds, epochs) and runs the rest;
`--rules` picks the RUNS to run for real (the baselines and the replay always run).

The FedSPU paper stops a client at the first rise of L = 0.7 L_train + 0.3 L_val and reports
25-71% fewer rounds at no real loss (T = 500). Per (strategy, dataset, seed), Dirichlet 0.3:

1. a run without early stopping that records every agent's L after each round (it only
   evaluates, so its figures are the plain run's: fedspu mnist1d seed 1 0.7277, as in
   bench/strategies.py); it is the baseline of that strategy and seed;
2. every candidate rule replayed offline on those L sequences (an agent stopped after round s
   keeps its round-s accuracy), to shortlist: cheap, but a stopped agent changes what its
   neighbours receive, so the results' figures come from
3. real runs with `--early-stop` for the rules in RUNS.

Cut = 1 - agent-rounds trained / the baseline's; change = final-round mean accuracy over all
agents (a stopped agent keeps its model and is still evaluated: the simulator repeats its
last round's figures) minus the baseline's, in points. Target: cut >= 25% at <= 1 point lost.
One simulation at a time, one torch thread.

Results, dated, with the commit, the machine and the command: studies/results/early_stopping.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from agent.learning import EarlyStop, StopWatch
from bench.support import environment, write_json

ROOT = pathlib.Path(__file__).resolve().parents[1]

if TYPE_CHECKING:
    from agent.learning import LocalData, State
    from agent.learning.model_facts import ModelFacts

STRATEGIES = ("fedspu", "fedavg-ft", "dadpfl")
RUNS: dict[str, dict[str, Any]] = {
    "paper": {"stop_rule": "paper"},
    "paper3": {"stop_rule": "paper", "stop_patience": 3},
    "progress": {},
    "progress25": {"stop_patience": 25},
}
"""The real early-stopping runs: the paper's rule as printed, with patience 3, the default,
and the default with a longer window (the more cautious runner-up of the replay)."""
CANDIDATES = {
    **{f"paper{p}": ("paper", p, 0.0) for p in (1, 2, 3, 5)},
    **{f"best{p}": ("progress", p, 0.0) for p in (5, 10, 15, 20)},
    **{
        f"progress{w}d{d}": ("progress", w, d)
        for w in (10, 15, 20, 25, 30)
        for d in (0.05, 0.1, 0.2)
    },
}
"""Rules replayed offline: (rule, patience, delta); best = progress with delta 0."""
MAX_ACCURACY_LOSS = 1.0
MIN_ROUNDS_CUT = 0.25


@dataclasses.dataclass
class Recorder(EarlyStop):
    """Early stopping that never stops and records every L (the baseline runs)."""

    losses: list[float] = dataclasses.field(default_factory=list)
    pruned: list[bool] = dataclasses.field(default_factory=list)

    def after(
        self,
        learner: ModelFacts,
        weights: State,
        train_loss: float,
        data: LocalData,
        restart: bool = False,
    ) -> bool:
        self.losses.append(learner.stopping_loss(weights, train_loss, data))
        self.pruned.append(restart)
        return False


def simulate_one(
    strategy: str, dataset: str, seed: int, args: Any, over: dict[str, Any] | None
) -> dict:
    """One simulation; with `over` None, the baseline that records each agent's L."""
    from agent.experiment import ExperimentConfig
    from agent.learning import preset
    from coordinator.simulate import Simulation

    learning = preset(strategy, rounds=args.rounds, epochs=args.epochs, neighbours=5)
    if over is not None:
        learning = dataclasses.replace(learning, early_stop=True, **over)
    config = ExperimentConfig(
        dataset=dataset, agents=args.agents, partition="dirichlet:0.3", seed=seed, threads=1
    )
    sim = Simulation(dataclasses.replace(config, learning=learning))
    recorders = {k: Recorder(False, sim.early_stops[k].rule) for k in sim.roster}
    if over is None:
        sim.early_stops.update(recorders)
    started = time.perf_counter()
    report = sim.run()
    rounds = report["rounds"]
    out = {
        "accuracy": report["summary"]["mean_accuracy"],
        "agent_rounds": sum(1 for r in rounds for a in r["agents"].values() if a["train_flops"]),
        "rounds": len(rounds),
        "seconds": time.perf_counter() - started,
        "final": {k: rounds[-1]["agents"][k]["accuracy"] for k in sim.roster},
        "stopped": dict(sim.stopped),
    }
    if over is None:
        out["losses"] = {k: r.losses for k, r in recorders.items()}
        out["pruned"] = {k: r.pruned for k, r in recorders.items()}
        out["agent_accuracy"] = {
            k: [r["agents"][k]["accuracy"] for r in rounds] for k in sim.roster
        }
    return out


def replay(base: dict, rule: str, patience: int, delta: float) -> tuple[float, float]:
    """(cut, accuracy change in points) of a rule replayed on a baseline's L sequences."""
    trained, accuracy = 0, 0.0
    for k, losses in base["losses"].items():
        watch, stop = StopWatch(), len(losses)
        pruned = base.get("pruned", {}).get(k, [False] * len(losses))
        for t, loss in enumerate(losses, start=1):
            watch, stops = watch.after(loss, patience, rule, delta, pruned[t - 1])
            if stops:
                stop = t
                break
        trained += stop
        accuracy += base["agent_accuracy"][k][stop - 1]
    n = len(base["losses"])
    return 1 - trained / base["agent_rounds"], (accuracy / n - base["accuracy"]) * 100


def spread(values: list[float], fmt: str) -> str:
    """Mean (min..max), each formatted with `fmt`."""
    low, high = format(min(values), fmt), format(max(values), fmt)
    return f"{format(statistics.mean(values), fmt)} ({low}..{high})"


def cells(args: Any) -> list[tuple[str, str]]:
    return [(d, s) for d in args.datasets for s in args.strategies]


def shortlist(bases: dict, args: Any) -> list[dict]:
    """Every candidate replayed on every baseline: per cell the mean cut and change."""
    out = []
    for name, (rule, patience, delta) in CANDIDATES.items():
        per_cell = {}
        for d, s in cells(args):
            got = [replay(bases[(d, s, seed)], rule, patience, delta) for seed in args.seeds]
            per_cell[f"{d}/{s}"] = (
                statistics.mean(g[0] for g in got),
                statistics.mean(g[1] for g in got),
            )
        met = sum(c >= MIN_ROUNDS_CUT and -a <= MAX_ACCURACY_LOSS for c, a in per_cell.values())
        out.append({"candidate": name, "cells": per_cell, "met": met})
    return sorted(out, key=lambda r: (-r["met"], -min(a for _, a in r["cells"].values())))


def measured(bases: dict, runs: dict, args: Any) -> list[dict]:
    """Per rule and cell: cut and change over the seeds, against the same seed's baseline."""
    rows = []
    for rule in dict.fromkeys([*RUNS, *(k[0] for k in runs)]):  # RUNS first, then older ones
        for d, s in cells(args):
            keys = [(d, s, seed) for seed in args.seeds if (rule, d, s, seed) in runs]
            if not keys:
                continue
            cut = [1 - runs[(rule, *k)]["agent_rounds"] / bases[k]["agent_rounds"] for k in keys]
            change = [(runs[(rule, *k)]["accuracy"] - bases[k]["accuracy"]) * 100 for k in keys]
            met = statistics.mean(cut) >= MIN_ROUNDS_CUT and -statistics.mean(change) <= 1
            rows.append(
                {
                    "rule": rule,
                    "dataset": d,
                    "strategy": s,
                    "cut": cut,
                    "change": change,
                    "seeds": [k[2] for k in keys],
                    "met": met,
                }
            )
    return rows


def split_change(base: dict, run: dict) -> tuple[float | None, float | None]:
    """Final accuracy change in points of the agents that trained to the end, and of those
    that stopped (None for an empty group), each against the same agents in the baseline:
    the first is what stopped neighbours cost the others (and run-to-run noise)."""
    final = {k: accuracy[-1] for k, accuracy in base["agent_accuracy"].items()}
    groups: dict[bool, list[float]] = {True: [], False: []}
    for k, accuracy in run["final"].items():
        groups[k in run["stopped"]].append((accuracy - final[k]) * 100)
    on, stopped = (statistics.mean(groups[g]) if groups[g] else None for g in (False, True))
    return on, stopped


def bystanders(bases: dict, runs: dict, args: Any) -> list[dict]:
    """Per rule and cell (runs that record each agent): `split_change` over the seeds."""
    rows = []
    for rule in RUNS:
        for d, s in cells(args):
            keys = [
                (d, s, seed) for seed in args.seeds if "final" in runs.get((rule, d, s, seed), {})
            ]
            if not keys:
                continue
            split = [split_change(bases[k], runs[(rule, *k)]) for k in keys]
            rows.append(
                {
                    "rule": rule,
                    "dataset": d,
                    "strategy": s,
                    "stopped_agents": [len(runs[(rule, *k)]["stopped"]) for k in keys],
                    "others_change": [o for o, _ in split if o is not None],
                    "stopped_change": [x for _, x in split if x is not None],
                }
            )
    return rows


def print_bystanders(console: Console, rows: list[dict]) -> None:
    table = Table(title="final accuracy change (points): agents that trained on vs stopped")
    for column in ("rule", "dataset", "strategy", "agents stopped", "trained on", "stopped"):
        table.add_column(column)
    for r in rows:
        table.add_row(
            r["rule"],
            r["dataset"],
            r["strategy"],
            spread(r["stopped_agents"], ".0f"),
            spread(r["others_change"], "+.2f") if r["others_change"] else "-",
            spread(r["stopped_change"], "+.2f") if r["stopped_change"] else "-",
        )
    console.print(table)


def print_tables(console: Console, rows: list[dict], short: list[dict]) -> None:
    table = Table(title="early stopping: agent-rounds cut and accuracy change (points)")
    for column in ("rule", "dataset", "strategy", "cut", "change", "target met"):
        table.add_column(column)
    for r in rows:
        table.add_row(
            r["rule"],
            r["dataset"],
            r["strategy"],
            spread(r["cut"], ".0%"),
            spread(r["change"], "+.2f"),
            "yes" if r["met"] else "no",
        )
    console.print(table)
    cands = Table(title="offline replay (mean over seeds per cell: cut / change)")
    cands.add_column("candidate")
    cands.add_column("cells met")
    for cell in short[0]["cells"] if short else []:
        cands.add_column(cell)
    for r in short[:12]:
        cands.add_row(
            r["candidate"],
            str(r["met"]),
            *(f"{c:.0%} / {a:+.1f}" for c, a in r["cells"].values()),
        )
    console.print(cands)


def resumed(args: Any) -> tuple[dict, dict]:
    """The baselines and runs of an earlier result file with the same settings."""
    import json

    saved = json.loads(args.out.read_text())
    same = all(saved["args"].get(k) == getattr(args, k) for k in ("agents", "rounds", "epochs"))
    if not same:
        return {}, {}
    bases = {(b.pop("dataset"), b.pop("strategy"), b.pop("seed")): b for b in saved["baselines"]}
    runs = {
        (r.pop("rule"), r.pop("dataset"), r.pop("strategy"), r.pop("seed")): r
        for r in saved["runs"]
    }
    return bases, runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--datasets", default="mnist1d,digits")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--agents", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--rules", default=",".join(RUNS), help="the RUNS to run for real")
    parser.add_argument(
        "--out", type=pathlib.Path, default=ROOT / "bench/results/early_stopping.json"
    )
    parser.add_argument(
        "--resume", action="store_true", help="keep the runs already in --out, run the rest"
    )
    args = parser.parse_args(argv)
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    args.datasets = [d for d in args.datasets.split(",") if d]
    args.strategies = [s for s in args.strategies.split(",") if s]
    args.rules = [r for r in args.rules.split(",") if r in RUNS]
    console = Console(width=None if sys.stdout.isatty() else 160)
    started = time.perf_counter()
    bases, runs = resumed(args) if args.resume and args.out.exists() else ({}, {})

    def save() -> tuple[list[dict], list[dict]]:
        short = shortlist(bases, args) if len(bases) == len(cells(args)) * len(args.seeds) else []
        rows = measured(bases, runs, args)
        write_json(
            args.out,
            {
                "args": {k: v for k, v in vars(args).items() if k != "out"},
                "wall_seconds": time.perf_counter() - started,
                "baselines": [
                    {"dataset": k[0], "strategy": k[1], "seed": k[2], **v} for k, v in bases.items()
                ],
                "runs": [
                    {"rule": k[0], "dataset": k[1], "strategy": k[2], "seed": k[3], **v}
                    for k, v in runs.items()
                ],
                "table": rows,
                "bystanders": bystanders(bases, runs, args),
                "shortlist": short,
                "machine": environment(),
            },
        )
        return rows, short

    for seed in args.seeds:
        for d, s in cells(args):
            if (d, s, seed) in bases:
                continue
            bases[(d, s, seed)] = simulate_one(s, d, seed, args, None)
            console.log(f"baseline {d} {s} seed {seed}: {bases[(d, s, seed)]['accuracy']:.4f}")
            save()
    for seed in args.seeds:
        for d, s in cells(args):
            for rule in args.rules:
                if (rule, d, s, seed) in runs:
                    continue
                runs[(rule, d, s, seed)] = simulate_one(s, d, seed, args, RUNS[rule])
                console.log(
                    f"{rule} {d} {s} seed {seed}: {runs[(rule, d, s, seed)]['accuracy']:.4f}"
                )
                save()
    rows, short = save()
    print_tables(console, rows, short)
    print_bystanders(console, bystanders(bases, runs, args))
    console.print(f"wall time {time.perf_counter() - started:.0f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
