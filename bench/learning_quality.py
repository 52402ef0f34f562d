"""Learning quality: does joining the fleet leave each device better off than training alone?

Every strategy (and local-only training) on tasks users run: the three examples, digits and
mnist1d at Dirichlet 0.1 and 0.5 and pathological:2, a task with per-device feature shift
(FedProx's synthetic), and two user models the project was not written for
(bench/quality_models.py), each over several seeds at the run lengths users run.

    python -m bench.learning_quality --quick                 # minutes: a change's check
    python -m bench.learning_quality --workers 2             # the whole grid: hours on 2 cores
    python -m bench.learning_quality --tasks keyword_spotting --strategies local,dadpfl \\
        --set momentum=0.9 --label momentum                  # a variant, in its own file

Per cell (task, strategy), over the seeds: the fleet mean of each device's final metric and
of its last five rounds (mean and spread over seeds), the share of devices worse than their
own local-only model of the same seed and split (by more than one standard error of the
device's test set), the gap to FedAvg, and the busiest device's bytes and training FLOPs.
Then the targets of issue 45, each shown or NOT shown:

* trust: at least 95% of devices at least as good as their local-only model;
* level: each strategy's mean at least max(local only, FedAvg) minus 1 point (an error
  metric: minus 1% of the error of predicting the mean);
* chance: no cell within 10 points of chance (an error metric: below 0.9x that error);
* DA-DPFL: mean at least DisPFL's at no more than 0.8x its busiest bytes and 0.75x FLOPs.

Writes bench/results/learning_quality[-LABEL].json after every cell (a rerun skips the cells
already there, unless --fresh) and a figure, learning_quality[-LABEL].png: each strategy's
metric relative to local-only training, per task. The variants behind the defaults (optimizer,
momentum and clipping, the detection scale, early stopping's patience, `--fallback fleet`, the
grid before the one-standard-error rule) are kept in bench/results/learning_quality_variants/.
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
from collections.abc import Iterable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from multiprocessing import get_context
from typing import Any

from agent.learning.config import CENTRALIZED, DECENTRALIZED
from bench.support import environment, write_json

BENCH = pathlib.Path(__file__).resolve().parent

EXAMPLES = BENCH.parent / "examples"
MODELS = BENCH / "quality_models.py"

STRATEGIES = ("local", *CENTRALIZED[:2], *DECENTRALIZED, *CENTRALIZED[2:])
"""Every preset: local only, FedAvg and FedAvg-FT first, then the decentralized ones."""

TASKS: dict[str, dict[str, Any]] = {
    "keyword_spotting": {"run_file": EXAMPLES / "keyword_spotting" / "run.toml"},
    "sensor_regression": {"run_file": EXAMPLES / "sensor_regression" / "run.toml"},
    "anomaly_autoencoder": {"run_file": EXAMPLES / "anomaly_autoencoder" / "run.toml"},
    **{
        f"{data}-{name}": {
            "dataset": data,
            "partition": partition,
            "agents": 20,
            "rounds": rounds,
            "test_size": test_size,
        }
        for data, rounds, test_size in (("digits", 30, 100), ("mnist1d", 40, 200))
        for name, partition in (
            ("dir0.1", "dirichlet:0.1"),
            ("dir0.5", "dirichlet:0.5"),
            ("path2", "pathological:2"),
        )
    },
    "synthetic-shift": {
        "dataset": "synthetic:0.5,1",
        "partition": "natural",
        "agents": 15,
        "rounds": 30,
    },
    "user-convgru": {
        "dataset": "mnist1d",
        "model": f"{MODELS}:conv_gru",
        "agents": 8,
        "rounds": 20,
        "test_size": 200,
    },
    "user-mlp-regression": {
        "dataset": f"python:{MODELS}:diabetes",
        "model": f"{MODELS}:mlp",
        "task": "regression",
        "loss": "mse",
        "partition": "iid",
        "agents": 3,
        "rounds": 30,
    },
}

QUICK = {
    "tasks": ("keyword_spotting", "sensor_regression", "digits-dir0.1", "user-convgru"),
    "strategies": ("local", "fedavg", "fedavg-ft", "dadpfl", "dispfl"),
    "seeds": (1, 2),
}
FULL_SEEDS = (1, 2, 3)
PERSONAL_TOLERANCE = 0.01
"""1 point of accuracy; for an error metric, 1% of the error of predicting the mean."""
CHANCE_MARGIN = 0.10


# ------------------------------------------------------------------------ one cell


def run_cell(task: str, strategy: str, seed: int, settings: Mapping[str, Any]) -> dict[str, Any]:
    """One simulated run and what the tables need of it: per agent its final metric, its
    last five rounds' mean, its bytes and FLOPs; for local-only runs also each agent's
    standard error on its test set and the error of predicting the mean (chance)."""
    import torch

    import edgefl
    from coordinator.simulate import Simulation

    torch.set_num_threads(1)
    settings = applying(strategy, settings)
    spec = dict(TASKS[task])
    run_file = spec.pop("run_file", None)
    config = edgefl.config(run_file, **{**spec, **settings}, strategy=strategy, seed=seed)
    started = time.perf_counter()
    sim = Simulation(config)
    report = edgefl.Report.of(sim.run())
    metric = report.metric
    rounds = report.rounds
    agents = sorted(rounds[-1]["agents"])
    per_agent = {
        k: {
            "final": rounds[-1]["agents"][k][metric],
            "last5": statistics.fmean(r["agents"][k][metric] for r in rounds[-5:]),
            "bytes": sum(
                r["agents"][k]["bytes_sent"] + r["agents"][k]["bytes_received"] for r in rounds
            ),
            "flops": sum(r["agents"][k]["train_flops"] for r in rounds),
            "last_bytes": rounds[-1]["agents"][k]["bytes_sent"]
            + rounds[-1]["agents"][k]["bytes_received"],
            "last_flops": rounds[-1]["agents"][k]["train_flops"],
            "trained_rounds": sum(1 for r in rounds if r["agents"][k]["train_flops"] > 0),
            "kept": rounds[-1]["agents"][k].get("kept"),
            "own": rounds[-1]["agents"][k].get(f"strategy_{metric}"),
            "fallback_flops": sum(r["agents"][k].get("fallback_flops", 0) for r in rounds),
        }
        for k in agents
    }
    extra: dict[str, Any] = {}
    if strategy == "local":
        for k, figures in per_agent.items():
            figures.update(_spread_and_chance(sim, k))
        if report.higher_is_better:
            extra["chance_accuracy"] = 1 / _classes(sim)
    return {
        **extra,
        "task": task,
        "strategy": strategy,
        "seed": seed,
        "metric": metric,
        "higher_is_better": report.higher_is_better,
        "rounds": len(rounds),
        "t_star": report.summary.get("t_star"),
        "busiest_bytes": report.summary["busiest_agent_bytes"],
        "seconds": round(time.perf_counter() - started, 1),
        "agents": per_agent,
    }


def applying(strategy: str, settings: Mapping[str, Any]) -> dict[str, Any]:
    """The `--set` options that `strategy` reads: one that only some strategies read
    (`agent.options.FLAG_SCOPES`) is left out for the others, as a run file of theirs
    would leave it out."""
    from agent.options import FLAG_SCOPES

    left_out = {name for name, applies, _ in FLAG_SCOPES if not applies(strategy, settings)}
    return {k: v for k, v in settings.items() if k not in left_out}


def _classes(sim: Any) -> int:
    """The classes a classifier tells apart: its output's width."""
    import torch

    data = next(iter(sim.data.values()))
    sim.learner.facts.model.eval()
    with torch.no_grad():
        return int(sim.learner.facts.model(data.x_test[:2]).shape[1])


def _spread_and_chance(sim: Any, agent: str) -> dict[str, float]:
    """A local-only agent's standard error of its test metric, and the metric of the best
    constant guess learned from its training data (the error metrics' chance)."""
    from agent.learning.training import per_sample_metric

    data, learner = sim.data[agent], sim.learner
    values = per_sample_metric(
        learner.facts.model,
        sim.states[agent].weights,
        data.x_test,
        data.y_test,
        task=learner.facts.task,
    )
    n = len(data.y_test)
    se = float(values.std() / math.sqrt(n)) if values is not None and n > 1 else 0.0
    if learner.facts.task.kind == "classification":
        majority = int(data.y_train.bincount().argmax())
        return {"se": se, "n_test": n, "constant": float((data.y_test == majority).double().mean())}
    target = learner.facts.task.target(data.x_train, data.y_train)
    guess = target.float().mean(0, keepdim=True)
    test = learner.facts.task.target(data.x_test, data.y_test).float()
    errors = learner.facts.task.per_sample(guess.expand_as(test).reshape(len(test), -1), test)
    chance = float(errors.mean()) if errors is not None else math.nan
    return {"se": se, "n_test": n, "chance": chance, "constant": chance}


# ------------------------------------------------------------------------ the grid


def cell_key(task: str, strategy: str, seed: int) -> str:
    return f"{task}|{strategy}|{seed}"


def run_grid(
    cells: list[tuple[str, str, int]],
    settings: Mapping[str, Any],
    workers: int,
    results: dict[str, Any],
    save: Any,
) -> None:
    """Run the cells not in `results` (in `workers` processes), saving after each one; a
    cell that fails is recorded with its error and the grid goes on."""
    todo = [c for c in cells if "error" in results.get(cell_key(*c), {"error": ""})]
    print(f"{len(cells) - len(todo)} of {len(cells)} cells already measured; {len(todo)} to run")
    started = time.perf_counter()
    context = get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        running: dict[Future[dict[str, Any]], tuple[str, str, int]] = {}
        queue = list(todo)
        while queue or running:
            while queue and len(running) < workers:
                cell = queue.pop(0)
                running[pool.submit(run_cell, *cell, dict(settings))] = cell
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                cell = running.pop(future)
                try:
                    results[cell_key(*cell)] = future.result()
                except Exception as exc:  # a failed cell is a finding, not the end
                    results[cell_key(*cell)] = {
                        "task": cell[0],
                        "strategy": cell[1],
                        "seed": cell[2],
                        "error": f"{type(exc).__name__}: {exc}",
                    }
                finished = len(todo) - len(queue) - len(running)
                elapsed = time.perf_counter() - started
                print(
                    f"[{finished}/{len(todo)} {elapsed / 60:.1f} min] {cell[0]} {cell[1]} "
                    f"seed {cell[2]}: {_cell_line(results[cell_key(*cell)])}",
                    flush=True,
                )
                save()


def _cell_line(cell: Mapping[str, Any]) -> str:
    if "error" in cell:
        return f"FAILED {cell['error']}"
    finals = [a["final"] for a in cell["agents"].values()]
    return f"{cell['metric']} {statistics.fmean(finals):.4f} ({cell['seconds']} s)"


# ------------------------------------------------------------------------ tables


@dataclasses.dataclass
class Cell:
    """A (task, strategy) over its seeds."""

    task: str
    strategy: str
    metric: str
    higher: bool
    finals: list[float]
    """Fleet mean of the final metric, per seed."""
    last5: list[float]
    worse: int
    devices: int
    busiest_bytes: float
    busiest_flops: float
    final_bytes: float
    """The busiest device's bytes in the last round (the DA-DPFL paper's measure)."""
    final_flops: float
    gap_fedavg: float | None
    chance: float
    constant: float
    """The fleet mean of each device's best constant guess from its own training data
    (its majority label; the mean target)."""
    trained_share: float
    kept: dict[str, int]
    own: float
    """The fleet mean of the strategy's own models (before each device's choice)."""
    fallback_share: float
    """The local-only models' training FLOPs over the strategy's."""

    @property
    def mean(self) -> float:
        return statistics.fmean(self.finals)

    @property
    def spread(self) -> float:
        return statistics.stdev(self.finals) if len(self.finals) > 1 else 0.0


def better(a: float, b: float, higher: bool) -> float:
    """How much better a is than b, in the metric's good direction."""
    return a - b if higher else b - a


def summarize_cells(results: Mapping[str, Any]) -> dict[tuple[str, str], Cell]:
    """Every (task, strategy) with all its seeds' local-only runs measured, as a `Cell`."""
    runs: dict[tuple[str, str], dict[int, Any]] = {}
    for cell in results.values():
        if "error" not in cell:
            runs.setdefault((cell["task"], cell["strategy"]), {})[cell["seed"]] = cell
    out = {}
    for (task, strategy), by_seed in runs.items():
        local = runs.get((task, "local"), {})
        fedavg = runs.get((task, "fedavg"), {})
        seeds = sorted(s for s in by_seed if s in local)
        if not seeds:
            continue
        first = by_seed[seeds[0]]
        higher = first["higher_is_better"]
        worse = devices = 0
        finals, last5, busiest_flops, gaps, chances, constants = [], [], [], [], [], []
        kept: dict[str, int] = {}
        trained = total = 0
        owns: list[float] = []
        spent = fallback = 0
        for seed in seeds:
            cell, base = by_seed[seed], local[seed]
            for k, a in cell["agents"].items():
                own = base["agents"][k]
                devices += 1
                worse += better(own["final"], a["final"], higher) > own["se"]
                trained += a["trained_rounds"]
                total += cell["rounds"]
                if a.get("kept"):
                    kept[a["kept"]] = kept.get(a["kept"], 0) + 1
                owns.append(a["final"] if a.get("own") is None else a["own"])
                spent += a["flops"]
                fallback += a.get("fallback_flops", 0)
            finals.append(statistics.fmean(a["final"] for a in cell["agents"].values()))
            last5.append(statistics.fmean(a["last5"] for a in cell["agents"].values()))
            busiest_flops.append(max(a["flops"] for a in cell["agents"].values()))
            if seed in fedavg:
                gaps.append(finals[-1] - _fleet_mean(fedavg[seed]))
            chances.append(_chance(base))
            constants.append(
                statistics.fmean(a.get("constant", math.nan) for a in base["agents"].values())
            )
        out[(task, strategy)] = Cell(
            task=task,
            strategy=strategy,
            metric=first["metric"],
            higher=higher,
            finals=finals,
            last5=last5,
            worse=worse,
            devices=devices,
            busiest_bytes=statistics.fmean(by_seed[s]["busiest_bytes"] for s in seeds),
            busiest_flops=statistics.fmean(busiest_flops),
            final_bytes=_busiest_last(by_seed, seeds, "last_bytes"),
            final_flops=_busiest_last(by_seed, seeds, "last_flops"),
            gap_fedavg=statistics.fmean(gaps) if gaps else None,
            chance=statistics.fmean(chances),
            constant=statistics.fmean(constants),
            trained_share=trained / max(total, 1),
            kept=kept,
            own=statistics.fmean(owns),
            fallback_share=fallback / max(spent, 1),
        )
    return out


def _busiest_last(by_seed: Mapping[int, Any], seeds: list[int], figure: str) -> float:
    """The busiest device's figure in the last round, the mean over seeds (NaN for results
    recorded before it was)."""
    return statistics.fmean(
        max(a.get(figure, math.nan) for a in by_seed[s]["agents"].values()) for s in seeds
    )


def _fleet_mean(cell: Mapping[str, Any]) -> float:
    return statistics.fmean(a["final"] for a in cell["agents"].values())


def _chance(local: Mapping[str, Any]) -> float:
    """Chance level of a task: 1 / classes for accuracy, else the mean error of each
    device's best constant guess (the mean of its training targets)."""
    if local["higher_is_better"]:
        return float(local.get("chance_accuracy", math.nan))
    return statistics.fmean(a["chance"] for a in local["agents"].values())


def tolerance(cell: Cell) -> float:
    """1 point of accuracy, or 1% of the chance-level error."""
    return PERSONAL_TOLERANCE if cell.higher else PERSONAL_TOLERANCE * cell.chance


def verdicts(cell: Cell, cells: Mapping[tuple[str, str], Cell]) -> dict[str, bool | None]:
    """The issue's targets for one cell: True (shown), False (NOT shown), None (not
    applicable)."""
    local = cells.get((cell.task, "local"))
    fedavg = cells.get((cell.task, "fedavg"))
    out: dict[str, bool | None] = {"trust": None, "level": None, "chance": None}
    if cell.strategy not in ("local", "fedavg"):
        out["trust"] = cell.worse <= 0.05 * cell.devices
        if local is not None and fedavg is not None:
            best = local.mean if better(local.mean, fedavg.mean, cell.higher) > 0 else fedavg.mean
            out["level"] = better(cell.mean, best, cell.higher) >= -tolerance(cell)
    if not math.isnan(cell.chance):
        if cell.higher:
            out["chance"] = cell.mean >= cell.chance + CHANCE_MARGIN
        else:
            out["chance"] = cell.mean <= (1 - CHANCE_MARGIN) * cell.chance
    return out


def dadpfl_verdict(cells: Mapping[tuple[str, str], Cell], task: str) -> dict[str, Any] | None:
    """DA-DPFL against DisPFL on one task: accuracy, busiest bytes and FLOPs ratios."""
    ours, theirs = cells.get((task, "dadpfl")), cells.get((task, "dispfl"))
    if ours is None or theirs is None:
        return None
    bytes_ratio = ours.busiest_bytes / theirs.busiest_bytes
    flops_ratio = ours.busiest_flops / theirs.busiest_flops
    gain = better(ours.mean, theirs.mean, ours.higher)
    return {
        "task": task,
        "gain": gain,
        "bytes_ratio": bytes_ratio,
        "flops_ratio": flops_ratio,
        "final_bytes_ratio": ours.final_bytes / theirs.final_bytes,
        "final_flops_ratio": ours.final_flops / theirs.final_flops,
        "shown": gain >= 0 and bytes_ratio <= 0.8 and flops_ratio <= 0.75,
    }


def _mark(value: bool | None) -> str:
    return "-" if value is None else "yes" if value else "NO"


def print_tables(cells: Mapping[tuple[str, str], Cell]) -> list[dict[str, Any]]:
    """The grid per task, with each cell's verdicts; returns the rows as data."""
    rows = []
    tasks = list(dict.fromkeys(t for t, _ in sorted(cells, key=_order)))
    for task in tasks:
        chosen = [cells[key] for key in sorted(cells, key=_order) if key[0] == task]
        head = chosen[0]
        print(
            f"\n{task} ({head.metric}, {'higher' if head.higher else 'lower'} is better; "
            f"chance {head.chance:.3f}; best constant guess {head.constant:.3f}; "
            f"{len(head.finals)} seeds)"
        )
        print(
            f"{'strategy':<12} {'final':>7} {'+-':>6} {'last5':>7} {'own':>7} {'worse':>7} "
            f"{'vsFedAvg':>8} {'MB':>7} {'GFLOP':>8} {'fb':>5} {'trained':>7}  "
            "trust level chance  kept"
        )
        for cell in chosen:
            verdict = verdicts(cell, cells)
            gap = "" if cell.gap_fedavg is None else f"{cell.gap_fedavg:+.4f}"
            print(
                f"{cell.strategy:<12} {cell.mean:>7.4f} {cell.spread:>6.4f} "
                f"{statistics.fmean(cell.last5):>7.4f} {cell.own:>7.4f} "
                f"{cell.worse:>3}/{cell.devices:<3} {gap:>8} {cell.busiest_bytes / 1e6:>7.2f} "
                f"{cell.busiest_flops / 1e9:>8.2f} {cell.fallback_share:>5.0%} "
                f"{cell.trained_share:>7.2f}  "
                f"{_mark(verdict['trust']):>5} {_mark(verdict['level']):>5} "
                f"{_mark(verdict['chance']):>6}  {_kept(cell.kept)}"
            )
            rows.append({**dataclasses.asdict(cell), "verdicts": verdict})
    return rows


def markdown(cells: Mapping[tuple[str, str], Cell]) -> str:
    """The grid as one markdown table: a row per task and strategy, with its verdicts."""
    lines = [
        "| task | strategy | final (sd) | last 5 | own model | worse than local | vs FedAvg "
        "| busiest MB | busiest GFLOPs | local-only FLOPs | kept | trust | level | chance |",
        "|" + "---|" * 14,
    ]
    for key in sorted(cells, key=_order):
        cell = cells[key]
        verdict = verdicts(cell, cells)
        gap = "" if cell.gap_fedavg is None else f"{cell.gap_fedavg:+.4f}"
        lines.append(
            f"| {cell.task} | {cell.strategy} | {cell.mean:.4f} ({cell.spread:.4f}) | "
            f"{statistics.fmean(cell.last5):.4f} | {cell.own:.4f} | "
            f"{cell.worse}/{cell.devices} | {gap} | {cell.busiest_bytes / 1e6:.2f} | "
            f"{cell.busiest_flops / 1e9:.2f} | {cell.fallback_share:.0%} | "
            f"{_kept(cell.kept)} | {_mark(verdict['trust'])} | {_mark(verdict['level'])} | "
            f"{_mark(verdict['chance'])} |"
        )
    return "\n".join(lines) + "\n"


def _kept(kept: Mapping[str, int]) -> str:
    total = sum(kept.values())
    return " ".join(f"{k} {v / total:.0%}" for k, v in sorted(kept.items())) if total else ""


def _order(key: tuple[str, str]) -> tuple[int, int]:
    task, strategy = key
    tasks = list(TASKS)
    return (
        tasks.index(task) if task in tasks else len(tasks),
        STRATEGIES.index(strategy) if strategy in STRATEGIES else len(STRATEGIES),
    )


def print_dadpfl(cells: Mapping[tuple[str, str], Cell]) -> list[dict[str, Any]]:
    tasks = list(dict.fromkeys(t for t, _ in sorted(cells, key=_order)))
    found = [v for t in tasks if (v := dadpfl_verdict(cells, t)) is not None]
    if found:
        print(
            "\nDA-DPFL against DisPFL, whole run (target: gain >= 0, bytes <= 0.8x, FLOPs <= "
            "0.75x) and last round (the paper's measure: 0.67x, 0.58x)"
        )
        for v in found:
            print(
                f"{v['task']:<22} gain {v['gain']:+.4f}  bytes {v['bytes_ratio']:.2f}x  "
                f"FLOPs {v['flops_ratio']:.2f}x  {'shown' if v['shown'] else 'NOT shown'}  "
                f"last round: bytes {v['final_bytes_ratio']:.2f}x FLOPs "
                f"{v['final_flops_ratio']:.2f}x"
            )
    return found


def print_against(
    cells: Mapping[tuple[str, str], Cell], base: Mapping[tuple[str, str], Cell], label: str
) -> list[dict[str, Any]]:
    """Each cell against the same cell of another variant (`--against`, e.g. without early
    stopping): the share of agent-rounds it did not train that the other did (cut), and the
    change of its final fleet mean in the metric's good direction."""
    rows = []
    print(f"\nagainst {label}: cut = agent-rounds not trained; change in the good direction")
    for key in sorted(set(cells) & set(base), key=_order):
        cell, other = cells[key], base[key]
        if key[1] == "local" and cell.trained_share == other.trained_share:
            continue
        cut = 1 - cell.trained_share / other.trained_share
        change = better(cell.mean, other.mean, cell.higher)
        rows.append({"task": key[0], "strategy": key[1], "cut": cut, "change": change})
        print(f"{key[0]:<22} {key[1]:<12} cut {cut:>6.1%}  change {change:+.4f}")
    if rows:
        cut = statistics.fmean(r["cut"] for r in rows)
        worst = min(rows, key=lambda r: r["change"])
        print(
            f"mean cut {cut:.1%}; worst change {worst['change']:+.4f} ({worst['task']}, "
            f"{worst['strategy']})"
        )
    return rows


def plot(cells: Mapping[tuple[str, str], Cell], path: pathlib.Path) -> None:
    """A heat map: each strategy's metric relative to local-only training, per task (points
    of accuracy; for error metrics, percent of local's error saved)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(t for t, _ in sorted(cells, key=_order)))
    strategies = [s for s in STRATEGIES if any((t, s) in cells for t in tasks) and s != "local"]
    grid = [[math.nan] * len(strategies) for _ in tasks]
    for i, task in enumerate(tasks):
        local = cells.get((task, "local"))
        for j, strategy in enumerate(strategies):
            cell = cells.get((task, strategy))
            if cell is None or local is None:
                continue
            gain = better(cell.mean, local.mean, cell.higher)
            grid[i][j] = 100 * (gain if cell.higher else gain / local.mean)
    fig, ax = plt.subplots(figsize=(1.0 + 0.9 * len(strategies), 1.0 + 0.45 * len(tasks)))
    limit = max((abs(v) for row in grid for v in row if not math.isnan(v)), default=1.0)
    image = ax.imshow(grid, cmap="RdYlGn", vmin=-limit, vmax=limit, aspect="auto")
    ax.set_xticks(range(len(strategies)), strategies, rotation=45, ha="right")
    ax.set_yticks(range(len(tasks)), tasks)
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            if not math.isnan(value):
                ax.text(j, i, f"{value:+.1f}", ha="center", va="center", fontsize=7)
    fig.colorbar(image, label="better than local only (points; error metrics: %)")
    ax.set_title("Each device's final metric against training alone (fleet mean over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------ command line


def parse_settings(pairs: Iterable[str]) -> dict[str, Any]:
    """--set KEY=VALUE pairs, the values read as TOML values (numbers, true/false) or text."""
    import tomllib

    settings: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep:
            raise SystemExit(f"--set takes KEY=VALUE, got {pair!r}")
        try:
            settings[key] = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            settings[key] = text
    return settings


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str], list[str], list[int]]:
    """The command line, and the tasks, strategies (local only first) and seeds it names."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few tasks, strategies, seeds")
    parser.add_argument("--tasks", help=f"comma-separated, of: {', '.join(TASKS)}")
    parser.add_argument("--strategies", help="comma-separated [default: all]")
    parser.add_argument("--seeds", help="comma-separated [default: 1,2,3]")
    parser.add_argument("--workers", type=int, default=1, help="runs at once (processes)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option for every run (a run file's key or a simulate flag; it overrides "
        "the task's own, e.g. rounds=120)",
    )
    parser.add_argument("--label", default="", help="result file suffix for a variant")
    parser.add_argument("--fresh", action="store_true", help="measure every cell again")
    parser.add_argument("--table", action="store_true", help="only print the saved results")
    parser.add_argument(
        "--against", metavar="LABEL", help="compare with another variant's saved results"
    )
    parser.add_argument("--markdown", metavar="PATH", help="also write the table as markdown")
    args = parser.parse_args(argv)
    tasks = args.tasks.split(",") if args.tasks else list(QUICK["tasks"] if args.quick else TASKS)
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        parser.error(f"unknown task {unknown[0]!r}; known: {', '.join(TASKS)}")
    strategies = (
        args.strategies.split(",")
        if args.strategies
        else list(QUICK["strategies"] if args.quick else STRATEGIES)
    )
    if "local" not in strategies:
        strategies.insert(0, "local")  # every comparison is against it
    seeds = (
        [int(s) for s in args.seeds.split(",")]
        if args.seeds
        else list(QUICK["seeds"] if args.quick else FULL_SEEDS)
    )
    return args, tasks, strategies, seeds


def main(argv: list[str]) -> int:
    args, tasks, strategies, seeds = parse_args(argv)
    settings = parse_settings(args.set)
    name = "learning_quality" + (f"-{args.label}" if args.label else "")
    out = BENCH / "results" / f"{name}.json"
    saved = json.loads(out.read_text()) if out.exists() and not args.fresh else {}
    if saved and saved.get("settings", {}) != settings:
        raise SystemExit(
            f"{out} was measured with --set {saved.get('settings')}: use --label or --fresh"
        )
    results: dict[str, Any] = saved.get("cells", {})

    def save() -> None:
        write_json(out, {"environment": environment(), "settings": settings, "cells": results})

    if not args.table:
        cells = [(t, s, seed) for t in tasks for s in strategies for seed in seeds]
        run_grid(cells, settings, args.workers, results, save)
    chosen = {k: v for k, v in results.items() if v["task"] in tasks}
    summary = summarize_cells(chosen)
    rows = print_tables(summary)
    dadpfl = print_dadpfl(summary)
    against = []
    if args.against is not None:
        name_other = "learning_quality" + (f"-{args.against}" if args.against else "")
        other = json.loads((BENCH / "results" / f"{name_other}.json").read_text())["cells"]
        base = summarize_cells(
            {k: v for k, v in other.items() if v["task"] in tasks and v["seed"] in seeds}
        )
        against = print_against(summary, base, args.against or "the default grid")
    failed = [k for k, v in chosen.items() if "error" in v]
    if failed:
        print(
            f"\n{len(failed)} cells failed: "
            + "; ".join(f"{k}: {chosen[k]['error']}" for k in failed[:5])
        )
    write_json(
        out,
        {
            "environment": environment(),
            "settings": settings,
            "cells": results,
            "table": rows,
            "dadpfl": dadpfl,
            "against": against,
        },
    )
    if args.markdown and summary:
        pathlib.Path(args.markdown).write_text(markdown(summary))
    if summary:
        plot(summary, out.with_suffix(".png"))
        print(f"\nwritten to {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
