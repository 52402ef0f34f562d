"""Early stopping on the learning-quality grid's tasks (issue 45 point 6): what share of the
agent-rounds a stop rule cuts, and what it costs in each device's final metric, against the
same runs without early stopping.

    python -m bench.early_stopping record --workers 2       # runs without early stopping,
                                                            # each agent's figures per round
    python -m bench.early_stopping replay                   # every candidate rule on them
    python -m bench.early_stopping measure --rule scaled --label scaled   # real runs with
                                                            # a --stop-rule, against them
    python -m bench.early_stopping table --label scaled     # that comparison again

DA-DPFL's cells, on which `scaled` restarts its window only after a prune that raised L
beyond its noise (PRUNING_CANDIDATES replays the alternatives):

    python -m bench.early_stopping record --strategies dadpfl --base dadpfl --workers 2
    python -m bench.early_stopping replay --strategies dadpfl --base dadpfl --rule "scaled restart"
    python -m bench.early_stopping measure --rule scaled --strategies dadpfl --base dadpfl \
        --label scaled-dadpfl --workers 2

`record` runs each cell (task, strategy, seed) without early stopping and keeps, per agent and
round, what a stop rule can read (training loss, validation loss and metric of the trained
model, the validation set's size and the metric's per-sample spread, whether the round pruned
the model and how many weights it kept) beside the metric of the model the agent keeps (its
test figure, what the grid reports). `replay` applies each candidate rule
(`agent.learning.early_stop.StopWatch`, the code the agents run) to those figures: an agent
that stops after round s ends with its round-s metric. It ignores what a stopped agent does to
the others (it leaves the aggregation or its neighbours' inboxes), so it screens rules;
`measure` runs the chosen one for real.

`scaled`'s short window for smooth plateaus (`StopWatch.smooth`, SMOOTH_CANDIDATES) was
screened this way and measured with

    python -m bench.early_stopping measure --rule scaled --tasks digits-dir0.5,mnist1d-dir0.5,\
        synthetic-shift --strategies local,fedavg,fedspu --label smooth --workers 2
    python -m bench.early_stopping measure --rule scaled --tasks digits-dir0.5,mnist1d-dir0.5,\
        synthetic-shift --strategies dadpfl --base dadpfl --label smooth-dadpfl --workers 2

(keyword spotting's cells left out: no agent stops there in the replay, so the runs equal
those without early stopping round for round).

Per (task, strategy), over the seeds: cut (agent-rounds not trained over all) and change
(fleet mean of the final metric against the run without, in the good direction; for an
error metric in points of the error of predicting the mean, like the grid's tolerance),
mean and spread over seeds. Writes bench/results/early_stopping[-LABEL].json (the recorded
runs with their per-round figures: the 36 cells of local, fedavg and fedspu, 4.8 MB, and
DA-DPFL's 12, 1 MB, are committed; the 60-round recording, 6 MB, is not),
early_stopping-replay.json
and early_stopping-LABEL-against.json. The figures are in agent/learning/early_stop.py.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Mapping
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any

from bench.learning_quality import BENCH, TASKS, applying
from bench.support import environment, write_json

GRID_TASKS = ("keyword_spotting", "digits-dir0.5", "mnist1d-dir0.5", "synthetic-shift")
GRID_STRATEGIES = ("local", "fedavg", "fedspu", "dadpfl")
SEEDS = (1, 2, 3)


def _config(task: str, strategy: str, seed: int, settings: Mapping[str, Any]) -> Any:
    import edgefl

    spec = {**TASKS[task], **settings}  # --rounds replaces the task's
    run_file = spec.pop("run_file", None)
    return edgefl.config(run_file, **spec, strategy=strategy, seed=seed)


def run_cell(
    task: str, strategy: str, seed: int, settings: Mapping[str, Any], trace: bool
) -> dict[str, Any]:
    """One simulated run: per agent its metric per round (the kept model's, what the grid
    reports), the rounds it trained and, with `trace`, what a stop rule reads per round."""
    import torch

    import edgefl
    from coordinator.simulate import Simulation

    torch.set_num_threads(1)
    started = time.perf_counter()
    sim = Simulation(_config(task, strategy, seed, applying(strategy, settings)))
    traces: dict[str, list[dict[str, float]]] = {k: [] for k in sim.roster}
    if trace:
        for k in sim.roster:
            sim.early_stops[k] = _Tracer(sim.early_stops[k], traces[k])
    report = edgefl.Report.of(sim.run())
    rounds, metric = report.rounds, report.metric
    agents = {
        k: {
            "metric": [r["agents"][k][metric] for r in rounds],
            "trained": sum(1 for r in rounds if r["agents"][k]["train_flops"] > 0),
            **({"trace": traces[k]} if trace else {}),
        }
        for k in sim.roster
    }
    return {
        "task": task,
        "strategy": strategy,
        "seed": seed,
        "metric": metric,
        "higher_is_better": report.higher_is_better,
        "rounds": sim.config.learning.rounds,
        "scale": _scale(sim),
        "seconds": round(time.perf_counter() - started, 1),
        "agents": agents,
    }


class _Tracer:
    """Stands in for an agent's `EarlyStop` in `record`: never stops, writes down what a
    rule reads after each round."""

    def __init__(self, early: Any, out: list[dict[str, float]]) -> None:
        self.early, self.out = early, out

    def after(
        self, facts: Any, weights: Any, train_loss: float, data: Any, restart: bool = False
    ) -> bool:
        from agent.learning.training import evaluate, per_sample_metric

        val_loss, val_metric = evaluate(
            facts.model, weights, data.x_val, data.y_val, task=facts.task
        )
        values = per_sample_metric(facts.model, weights, data.x_val, data.y_val, task=facts.task)
        spread = float(values.std()) if values is not None and len(values) > 1 else math.nan
        self.out.append(
            {
                "train_loss": train_loss,
                "val_loss": val_loss,
                "val_metric": val_metric,
                "val_std": spread,
                "n_val": len(data.y_val),
                "restart": float(restart),
                "kept": float(_kept(weights)),
            }
        )
        return False


def _kept(weights: Mapping[str, Any]) -> int:
    """How many entries of the model's floating tensors are nonzero: what a pruning round
    (DA-DPFL) lowers, so a replay can tell a small prune from a large one."""
    return sum(int(t.count_nonzero()) for t in weights.values() if t.is_floating_point())


def _scale(sim: Any) -> float:
    """What a point is: 0.01 of accuracy, or 1% of the fleet's error of predicting the mean
    (the grid's tolerance, `learning_quality.tolerance`)."""
    if sim.learner.facts.task.higher_is_better:
        return 0.01
    from bench.learning_quality import _spread_and_chance

    chances = [_spread_and_chance(sim, k)["chance"] for k in sim.roster]
    return 0.01 * statistics.fmean(chances)


# ------------------------------------------------------------------------ running cells


def run_cells(
    cells: list[tuple[str, str, int]],
    settings: Mapping[str, Any],
    workers: int,
    results: dict[str, Any],
    save: Any,
    trace: bool,
) -> None:
    """Run the cells not in `results` in `workers` processes, saving after each one."""
    todo = [c for c in cells if "|".join(map(str, c)) not in results]
    print(f"{len(cells) - len(todo)} of {len(cells)} cells already measured; {len(todo)} to run")
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
        futures = {pool.submit(run_cell, *c, dict(settings), trace): c for c in todo}
        for done, (future, cell) in enumerate(futures.items(), 1):
            results["|".join(map(str, cell))] = future.result()
            elapsed = (time.perf_counter() - started) / 60
            print(f"[{done}/{len(todo)} {elapsed:.1f} min] {cell}", flush=True)
            save()


def progress_rule(patience: int, delta: float = 0.1, floor: float = 0.0, weight: float = -1) -> Any:
    """The `progress` rule as the agents run it (`StopWatch.after`), on recorded figures;
    candidates: not before `floor` of the run, L with `weight` on the training loss."""
    from agent.learning.config import STOP_LAMBDA
    from agent.learning.early_stop import StopWatch

    w = STOP_LAMBDA if weight < 0 else weight

    def stop_round(trace: list[dict[str, float]], rounds: int) -> int:
        watch = StopWatch()
        for t, row in enumerate(trace, 1):
            loss = w * row["train_loss"] + (1 - w) * row["val_loss"]
            watch, stops = watch.after(loss, patience, "progress", delta, bool(row["restart"]))
            if stops and t >= floor * rounds:
                return t
        return rounds

    return stop_round


def plateau_rule(window: int, z: float, floor: float = 0.0) -> Any:
    """Candidate: stop once the best validation metric of the last `window` rounds beats the
    best before them by at most `z` standard errors of the validation set, not before
    `floor` of the run."""

    def stop_round(trace: list[dict[str, float]], rounds: int) -> int:
        best: list[float] = []
        for t, row in enumerate(trace, 1):
            m = row["val_metric"]
            if row["restart"]:
                best = []
            best.append(max(m, best[-1]) if best else m)
            se = row["val_std"] / math.sqrt(row["n_val"])
            if (
                t >= floor * rounds
                and len(best) > window
                and best[-1] - best[-1 - window] <= z * se
            ):
                return t
        return rounds

    return stop_round


def share_rule(share: float, delta: float, least: int = 5) -> Any:
    """Candidate: `progress` with its window a `share` of the run's rounds (at least
    `least`)."""

    def stop_round(trace: list[dict[str, float]], rounds: int) -> int:
        return progress_rule(max(least, round(share * rounds)), delta)(trace, rounds)

    return stop_round


def horizon_rule(window: int, delta: float) -> Any:
    """Candidate: stop once the best L's fall over the last `window` rounds, continued at
    that pace over the rounds left, would lower it by at most `delta` of all it fell since
    round 1 (the gain forgone by stopping, projected)."""
    from agent.learning.config import STOP_LAMBDA

    def stop_round(trace: list[dict[str, float]], rounds: int) -> int:
        first, bests = None, []
        for t, row in enumerate(trace, 1):
            loss = STOP_LAMBDA * row["train_loss"] + (1 - STOP_LAMBDA) * row["val_loss"]
            if row["restart"]:
                first, bests = None, []
            first = loss if first is None else first
            bests.append(min(loss, bests[-1]) if bests else loss)
            if len(bests) > window:
                pace = (bests[-1 - window] - bests[-1]) / window
                if pace * (rounds - t) <= delta * (first - bests[-1]):
                    return t
        return rounds

    return stop_round


def _restarts(trace: list[dict[str, float]], when: str, level: float) -> list[bool]:
    """Which pruning rounds of `trace` restart the window: every one (`always`, and `jump`,
    whose watch reads the rise itself), none (`never`), or those that removed more than
    `level` of the kept weights (`removed`; every one in a recording without `kept`)."""
    out = []
    for t, row in enumerate(trace):
        if not row["restart"] or when in ("always", "jump", "never"):
            out.append(bool(row["restart"]) and when != "never")
        elif "kept" not in row or t == 0:
            out.append(True)
        else:
            out.append(1 - row["kept"] / max(trace[t - 1]["kept"], 1.0) > level)
    return out


def pruning_rule(share: float, delta: float, when: str, level: float = 0.0, grace: int = 0) -> Any:
    """Candidate: `scaled`'s window (`share` of the run, at least 5) and `delta`, with
    pruning rounds restarting it as `_restarts` says `when` (`jump`: those whose L rose by
    more than `level` standard deviations of the window's changes, `StopWatch.jumped`, the
    code the agents run), and no stop within `grace` rounds after a pruning round."""
    from agent.learning.config import STOP_LAMBDA
    from agent.learning.early_stop import StopWatch

    noise = level if when == "jump" else None

    def stop_round(trace: list[dict[str, float]], rounds: int) -> int:
        window = max(5, round(share * rounds))
        watch, pruned = StopWatch(), -grace
        restarts = _restarts(trace, when, level)
        for t, (row, restart) in enumerate(zip(trace, restarts, strict=True), 1):
            pruned = t if row["restart"] else pruned
            loss = STOP_LAMBDA * row["train_loss"] + (1 - STOP_LAMBDA) * row["val_loss"]
            watch, stops = watch.after(loss, window, "progress", delta, restart, noise)
            if stops and t - pruned >= grace:
                return t
        return rounds

    return stop_round


def scaled_rule(
    delta: float = 0.05, smooth_share: float = 0.0, smooth_noise: float = 0.0, share: float = 1 / 3
) -> Any:
    """`scaled` as the agents run it (`StopRule` and `StopWatch`, pruning rounds restarting
    the window only beyond L's noise), with its long window a `share` of the run (at least 5),
    its `delta`, and its short window for smooth plateaus a `smooth_share` of the run (at
    least 5; `StopWatch.smooth`; 0: none) with its `smooth_noise`."""
    from agent.learning.config import SCALED_LEAST, SCALED_PRUNE_NOISE, STOP_LAMBDA
    from agent.learning.early_stop import StopRule, StopWatch

    def stop_round(trace: list[dict[str, float]], rounds: int) -> int:
        window = max(SCALED_LEAST, round(share * rounds))
        smooth = max(SCALED_LEAST, round(smooth_share * rounds)) if smooth_share else 0
        rule = StopRule("scaled", window, delta, SCALED_PRUNE_NOISE, smooth, smooth_noise)
        watch = StopWatch()
        for t, row in enumerate(trace, 1):
            loss = STOP_LAMBDA * row["train_loss"] + (1 - STOP_LAMBDA) * row["val_loss"]
            watch, stops = watch.under(loss, rule, bool(row["restart"]))
            if stops:
                return t
        return rounds

    return stop_round


SMOOTH_CANDIDATES = {
    "scaled without smooth": scaled_rule(),
    **{
        f"scaled smooth {f} k{k} d{d}": scaled_rule(d, f, k)
        for f in (0.15, 0.2, 0.25)
        for k in (0.005, 0.01, 0.02)
        for d in (0.03, 0.05)
    },
}
"""`scaled` with and without its short window for smooth plateaus (`StopWatch.smooth`): an
agent stops once its best L also fell over the last share f of the run's rounds at no more
than the long window's pace (d over a third of the run), with its round-to-round changes
(standard deviation) within k of its fall since round 1 (the rule: f 0.2, k 0.01, d 0.05)."""


PRUNING_CANDIDATES = {
    "scaled restart always": pruning_rule(1 / 3, 0.05, "always"),
    **{f"scaled restart never g{g}": pruning_rule(1 / 3, 0.05, "never", 0, g) for g in (0, 2, 4)},
    **{
        f"scaled restart removed>{s} g{g}": pruning_rule(1 / 3, 0.05, "removed", s, g)
        for s in (0.05, 0.1, 0.2, 0.3)
        for g in (0, 2)
    },
    **{
        f"scaled restart jump>{z}sd g{g}": pruning_rule(1 / 3, 0.05, "jump", z, g)
        for z in (1.0, 2.0, 3.0)
        for g in (0, 2)
    },
}
"""Candidates for DA-DPFL, whose pruning rounds restart `scaled`'s window: which prunes
should (only `restart` rows differ from `scaled`, so the other strategies are unchanged)."""


CANDIDATES = {
    **SMOOTH_CANDIDATES,
    **PRUNING_CANDIDATES,
    **{
        f"share {f:.2f} d{d}": share_rule(f, d)
        for f in (0.25, 0.3, 1 / 3)
        for d in (0.03, 0.05, 0.07)
    },
    **{f"horizon w{w} d{d}": horizon_rule(w, d) for w in (5, 8, 10) for d in (0.02, 0.05, 0.1)},
    **{
        f"progress p{p} d{d}": progress_rule(p, d) for p in (5, 8, 10, 20) for d in (0.05, 0.1, 0.2)
    },
    **{f"progress p{p} d0.1 floor0.5": progress_rule(p, 0.1, 0.5) for p in (5, 8, 10)},
    **{
        f"val-loss progress p{p} d{d}": progress_rule(p, d, 0.0, 0.0)
        for p in (5, 8, 10)
        for d in (0.05, 0.1)
    },
    **{
        f"plateau w{w} z{z} floor{f}": plateau_rule(w, z, f)
        for w in (5, 10)
        for z in (0.0, 1.0)
        for f in (0.0, 0.5)
    },
}


def _frozen(metric: list[float], s: int) -> list[float]:
    """An agent's metric per round had it stopped after round s: its round-s figure from
    then on (a stopped agent's records repeat its last)."""
    return metric[:s] + [metric[s - 1]] * (len(metric) - s)


def replayed(cell: Mapping[str, Any], rule: Any) -> dict[str, Any]:
    """A recorded cell as if each agent had stopped under `rule` (the others unaffected):
    per agent its final metric and rounds trained."""
    out = {}
    for k, a in cell["agents"].items():
        s = rule(a["trace"], cell["rounds"])
        trained = a["trained"] * s / cell["rounds"]
        out[k] = {"metric": _frozen(a["metric"], s), "trained": trained}
    return {**cell, "agents": out}


def compared(base: Mapping[str, Any], run: Mapping[str, Any]) -> tuple[float, float, float]:
    """(cut, change, change5) of `run` against `base`, the same cell: the share of base's
    agent-rounds that run did not train, and the fleet mean of the final metric against
    base's in points (the cell's `scale`), in the good direction; change5 the same of the
    last five rounds' mean, which a round's noise moves less."""
    trained = sum(a["trained"] for a in run["agents"].values())
    total = sum(a["trained"] for a in base["agents"].values())
    sign = 1.0 if base["higher_is_better"] else -1.0

    def change(last: int) -> float:
        ours = statistics.fmean(x for a in run["agents"].values() for x in a["metric"][-last:])
        theirs = statistics.fmean(x for a in base["agents"].values() for x in a["metric"][-last:])
        return sign * (ours - theirs) / base["scale"]

    return 1 - trained / max(total, 1), change(1), change(5)


def table(rows: dict[tuple[str, str], list[tuple[float, float, float]]]) -> dict[str, Any]:
    """Per (task, strategy): cut, change and change5, mean and spread over seeds; and over
    all cells."""
    out: dict[str, Any] = {}
    for (task, strategy), triples in rows.items():
        cell: dict[str, Any] = {"seeds": len(triples)}
        for i, name in enumerate(("cut", "change", "change5")):
            values = [t[i] for t in triples]
            cell[name] = statistics.fmean(values)
            cell[f"{name}_sd"] = statistics.stdev(values) if len(values) > 1 else 0.0
        out[f"{task}|{strategy}"] = cell
    cells = list(out.values())
    if cells:
        out["all"] = {
            "cut": statistics.fmean(c["cut"] for c in cells),
            "mean_change": statistics.fmean(c["change"] for c in cells),
            "worst_change": min(c["change"] for c in cells),
            "mean_change5": statistics.fmean(c["change5"] for c in cells),
            "worst_change5": min(c["change5"] for c in cells),
        }
    return out


def print_table(title: str, summary: Mapping[str, Any], detail: bool) -> None:
    whole = summary.get("all")
    if whole:
        print(
            f"{title:<30} cut {whole['cut']:6.1%}  change mean {whole['mean_change']:+6.2f} "
            f"worst {whole['worst_change']:+6.2f}  last5 mean {whole['mean_change5']:+6.2f} "
            f"worst {whole['worst_change5']:+6.2f}"
        )
    if not detail:
        return
    for key, c in summary.items():
        if key != "all":
            print(
                f"    {key:<30} cut {c['cut']:6.1%} +- {c['cut_sd']:5.1%}  "
                f"change {c['change']:+6.2f} +- {c['change_sd']:5.2f}  "
                f"last5 {c['change5']:+6.2f} +- {c['change5_sd']:5.2f}"
            )


def _by_cell(
    pairs: Mapping[tuple[str, str, int], tuple[float, float, float]],
) -> dict[tuple[str, str], list[tuple[float, float, float]]]:
    rows: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for (task, strategy, _), pair in pairs.items():
        rows.setdefault((task, strategy), []).append(pair)
    return rows


def oracle(cell: Mapping[str, Any], tolerance: float = 0.5) -> tuple[float, float, float]:
    """What no rule beats by stopping every agent at the same round: the earliest round at
    which the fleet's mean metric is within `tolerance` points of its final one, read off
    the run itself (the run's future known)."""
    rounds = cell["rounds"]
    for s in range(1, rounds + 1):
        stopped = {
            k: {"metric": _frozen(a["metric"], s), "trained": a["trained"] * s / rounds}
            for k, a in cell["agents"].items()
        }
        cut, change, change5 = compared(cell, {**cell, "agents": stopped})
        if change5 >= -tolerance:
            return cut, change, change5
    return 0.0, 0.0, 0.0


def replay_main(
    recorded: Mapping[str, Any], cells: list[tuple[str, str, int]], shown: str, label: str
) -> int:
    """Every candidate rule (those whose name contains `shown`, per cell) and the oracle on
    the recorded cells among `cells`, printed and written to early_stopping-replay[-LABEL].json
    (`label`: the recording's)."""
    chosen = [recorded[key] for key in ("|".join(map(str, c)) for c in cells) if key in recorded]
    results = {}
    for name, rule in CANDIDATES.items():
        pairs = {
            (base["task"], base["strategy"], base["seed"]): compared(base, replayed(base, rule))
            for base in chosen
        }
        results[name] = table(_by_cell(pairs))
        print_table(name, results[name], detail=bool(shown) and shown in name)
    pairs = {(base["task"], base["strategy"], base["seed"]): oracle(base) for base in chosen}
    results["oracle"] = table(_by_cell(pairs))
    print_table("oracle: every agent at once", results["oracle"], detail=bool(shown))
    write_json(
        _path("-".join(filter(None, ("replay", label)))),
        {"environment": environment(), "cells": len(chosen), "rules": results},
    )
    return 0


def compare_main(base: Mapping[str, Any], runs: Mapping[str, Any], label: str) -> dict[str, Any]:
    """The measured cells of `runs` against the same cells of `base`, printed and written
    to bench/results/early_stopping-LABEL-against.json."""
    pairs = {
        (r["task"], r["strategy"], r["seed"]): compared(base[key], r)
        for key, r in runs.items()
        if key in base
    }
    summary = table(_by_cell(pairs))
    print_table(f"measured: {label}", summary, detail=True)
    write_json(
        _path(f"{label}-against"),
        {"environment": environment(), "cells": len(pairs), "table": summary},
    )
    return summary


# ------------------------------------------------------------------------ command line


def _path(label: str) -> Any:
    return BENCH / "results" / ("early_stopping" + (f"-{label}" if label else "") + ".json")


def _load(label: str) -> dict[str, Any]:
    import json

    path = _path(label)
    return json.loads(path.read_text()) if path.exists() else {}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("record", "replay", "measure", "table"))
    parser.add_argument("--tasks", default=",".join(GRID_TASKS))
    parser.add_argument("--strategies", default=",".join(GRID_STRATEGIES))
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    parser.add_argument("--rounds", type=int, default=0, help="run length (0: the task's)")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument(
        "--rule", default="", help="measure: the --stop-rule to run; replay: rules shown per cell"
    )
    parser.add_argument("--patience", type=int, default=0, help="measure: --stop-patience")
    parser.add_argument("--label", default="", help="result file suffix")
    parser.add_argument("--base", default="", help="the label of the recorded runs")
    args = parser.parse_args(argv)
    tasks, strategies = args.tasks.split(","), args.strategies.split(",")
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        parser.error(f"unknown task {unknown[0]!r}; known: {', '.join(TASKS)}")
    cells = [(t, s, int(seed)) for t in tasks for s in strategies for seed in args.seeds.split(",")]
    settings: dict[str, Any] = {"rounds": args.rounds} if args.rounds else {}
    if args.mode == "replay":
        return replay_main(_load(args.base)["cells"], cells, args.rule, args.base)
    if args.mode == "table":
        compare_main(_load(args.base)["cells"], _load(args.label)["cells"], args.label)
        return 0
    if args.mode == "measure":
        settings.update(early_stop=True, stop_rule=args.rule, stop_patience=args.patience)
    label = args.label if args.mode == "measure" else args.base
    saved = _load(label)
    results: dict[str, Any] = saved.get("cells", {})

    def save() -> None:
        write_json(
            _path(label), {"environment": environment(), "settings": settings, "cells": results}
        )

    run_cells(cells, settings, args.workers, results, save, trace=args.mode == "record")
    if args.mode == "measure":
        compare_main(_load(args.base)["cells"], results, args.label)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
