"""Real budgets: does p_k cut a round's measured seconds and memory, and does the device's cost
table predict by how much? (issue 32, first "Done when" bullet)

    python -m bench.real_budgets [--models mlp,cnn2d,resnet18] [--quick] [--no-rss]
        [--out bench/results/real_budgets.json]

For each model (mlp on 64 features, cnn2d on 1x28x28, resnet18 on 3x32x32; 10 classes, batch 64,
one thread, random data drawn here), on a dadpfl learner (ERK masks at its initial density):

1. Calibrate: `measure_costs` gives the cost table an agent keeps; its figures are the
   *predicted* side.
2. For each reduction at p_k 0.5 and 0.2, the reduction the rule picks: prune caps the masked
   model's density at p_k (masked dense, the paper's DA-DPFL); freeze trains an active
   fraction a = p_k of the neurons (FedSPU's rule); prefix and width are what
   `measured_reduction` picks from the table (round 0, no memory limit); channels is prune
   with `--mask-unit channel` (whole channels dropped, the narrower model trained), its
   density capped by the agent's rule (`capped_density`) and predicted from its own table
   (prune measured at several densities); checkpoint is the dense model with its blocks
   checkpointed (the memory option, at p_k 1 only: it cuts memory, not time). Freeze,
   prefix and width train the dense model, as the calibration does.
3. Measure it again, independently of the calibration: a timed unit is one call of
   `reduced_training` over enough minibatches for `--min-call` seconds of dense work (and
   at least `--min-steps`: resnet18's 2.4 s step makes one minibatch a call, whose per-round
   setup a round of many steps spreads thin: before that setup was cut from 122 to 48 ms,
   exact freezing measured 0.90-0.95x at active 0.5 in one-step calls, 0.79x in four-step
   ones; after it, 0.81-0.86x and 0.85x)
   (per-round work included, as in a round; a "+steps" row is timed at full steps and scaled
   by its step fraction); dense and reduced calls alternate (2 warm-ups,
   then at least 5 timed each) so drift and neighbours hit both alike, and the minimum of
   each is kept. Time x dense = reduced minimum / dense minimum.
   Memory x dense: what the agent counts (`ActivationMeter` over one step plus
   `working_set_mb`), and as a cross-check the peak RSS growth of one step in a fresh
   process (`--no-rss` skips it): the process resets its high-water mark
   (/proc/self/clear_refs) after a warm-up step and reads VmHWM - VmRSS over a second one,
   with glibc's mmap threshold pinned so large tensors go back to the system when freed. That
   figure also holds what the count leaves out (the backward pass's temporaries, the trained
   state copied out).

Targets (resnet18, this CPU): prefix <= 0.6x / 0.45x time and <= 0.35x / 0.25x memory at
p_k 0.5 / 0.2; width <= 0.35x time and <= 0.5x memory at 0.5; freeze (exact) <= 0.92x /
0.85x time. Every row: predicted time within 20% of measured.

Timings are minimums on a shared machine: other work on the same cores inflates both sides
of a ratio alike only while it lasts; the load average is in the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from agent.device.calibration import ActivationMeter, measure_costs, working_set_mb
from agent.learning import Learner, LocalData, channels, preset, rigl
from agent.learning.costs import CostTable, Row
from agent.learning.freezing import active_masks
from agent.learning.models import build_model, prunable_names
from agent.learning.reduced import reduced_training
from agent.learning.reduction import (
    NO_REDUCTION,
    Reduction,
    active_fraction,
    capped_density,
    measured_reduction,
)
from agent.learning.sparse import Masks
from bench.support import environment, write_json

ROOT = pathlib.Path(__file__).resolve().parents[1]

MODELS: dict[str, tuple[int, ...]] = {"mlp": (64,), "cnn2d": (1, 28, 28), "resnet18": (3, 32, 32)}
QUICK_MODELS = ("mlp", "cnn2d")
CLASSES = 10
BATCH = 64
KINDS = ("prune", "channels", "freeze", "prefix", "suffix", "width", "checkpoint")
BUDGETS = (0.5, 0.2)
MAX_CALL_STEPS = 200
PREDICTION_TOLERANCE = 0.2
TARGETS: dict[tuple[str, str, float], tuple[float | None, float | None]] = {
    ("resnet18", "suffix", 0.5): (0.6, 0.35),
    ("resnet18", "suffix", 0.2): (0.45, 0.25),
    ("resnet18", "width", 0.5): (0.35, 0.5),
    ("resnet18", "freeze", 0.5): (0.92, None),
    ("resnet18", "freeze", 0.2): (0.85, None),
}
"""(model, kind, p_k) -> (time x dense, memory x dense) at most; None: no target."""
MIB = 2**20


@dataclass(frozen=True)
class Settings:
    warmups: int = 2
    repeats: int = 5
    min_call_s: float = 0.3
    min_steps: int = 1
    rss: bool = True


QUICK = Settings(warmups=1, repeats=2, min_call_s=0.02, rss=False)


@dataclass(frozen=True)
class Plan:
    """One row's round: the reduction, the masks and active neurons it trains with, and what
    the cost table predicts for it."""

    kind: str
    p_k: float
    reduction: Reduction
    masks: Masks | None
    active: Masks | None
    level: str
    predicted_time: float | None
    predicted_memory: float | None


def build(name: str, mask_unit: str = "weight") -> tuple[Learner, LocalData]:
    """The model's dadpfl learner (batch 64) and random data: enough for the longest call."""
    shape = MODELS[name]
    model = build_model(name, shape, CLASSES, seed=0)
    config = preset("dadpfl", batch_size=BATCH, epochs=1, rounds=10, mask_unit=mask_unit)
    learner = Learner(model, shape, prunable_names(model), config, seed=0)
    generator = torch.Generator().manual_seed(0)
    count = BATCH * MAX_CALL_STEPS
    x = torch.randn(count, *shape, generator=generator)
    y = torch.randint(0, CLASSES, (count,), generator=generator)
    return learner, LocalData(x, y, x[:8], y[:8], x[:8], y[:8])


def rotation(table: CostTable, p_k: float) -> list[dict[str, Any]]:
    """The prefix windows the rule turns through over rounds at `p_k`, each with the table's
    time and memory against dense: a budget has to hold in every round, not only round 0."""
    turns: list[dict[str, Any]] = []
    for round_ in range(len(table.rows)):
        reduction = measured_reduction(table, ("prefix",), p_k, round_, None, BATCH)
        if turns and list(reduction.setting or ()) == turns[0]["window"]:
            break
        row = _table_row(table, "prefix", reduction, 0.0)
        memory = None if row is None else table.memory_fraction(row)
        turns.append(
            {
                "window": list(reduction.setting or ()),
                "predicted_time_x": reduction.predicted,
                "predicted_memory_x": memory,
            }
        )
    return turns


def _table_row(table: CostTable, kind: str, reduction: Reduction, level: float) -> Row | None:
    """The table's row for this reduction: a prefix row by its window, others by level (prune
    has one, at the initial density: the agent's only figure for any cap)."""
    rows = table.of_kind("prefix" if kind == "suffix" else kind)
    if kind in ("prefix", "suffix"):
        return next((row for row in rows if row.window == reduction.setting), None)
    if kind in ("prune", "checkpoint"):
        return rows[0] if rows else None
    return next((row for row in rows if math.isclose(row.level, level)), None)


def rule_reduction(
    learner: Learner, table: CostTable | None, kind: str, p_k: float
) -> tuple[Reduction, Masks | None, Masks | None]:
    """The reduction the rule picks for `kind` at `p_k` (module docstring) and the masks and
    active neurons it trains with; prefix and width need the cost `table`."""
    start = learner.init_agent("bench")
    if kind == "prune":
        assert start.masks is not None
        masks = rigl.prune_to_density(start.weights, start.masks, p_k)
        return Reduction("prune", p_k), masks, None
    if kind == "channels":
        assert start.masks is not None
        cap = capped_density(learner.facts, p_k, start.masks) or 1.0
        masks = channels.prune_to_density(
            learner.facts.channel_plan, start.weights, start.masks, cap
        )
        return Reduction("prune", cap), masks, None
    if kind == "freeze":
        a = active_fraction(p_k)
        generator = torch.Generator().manual_seed(0)
        active = active_masks(learner.facts.freezing_plan, start.weights, a, generator)
        return Reduction("freeze", a), None, active
    if kind == "checkpoint":
        return Reduction("checkpoint", checkpoint=True), None, None
    assert table is not None
    if kind == "suffix":
        return suffix_reduction(learner, table, p_k), None, None
    return measured_reduction(table, (kind,), p_k, 0, None, BATCH), None, None


def suffix_reduction(learner: Learner, table: CostTable, p_k: float) -> Reduction:
    """Plain layer-prefix freezing (TinyTL-style, what the issue's targets are for): the
    longest measured window that ends at the output and fits p_k, every round; the rule's
    rotating windows (`prefix`) also train layers near the input, at a higher cost in
    memory. Below every suffix's cost, the cheapest with fewer minibatches."""
    layers = len(learner.facts.forward_layers)
    suffixes = [r for r in table.of_kind("prefix") if r.window and r.window[1] == layers]
    fitting = [r for r in suffixes if table.fraction(r) <= p_k]
    if fitting:
        row = min(fitting, key=lambda r: (r.window or (0, 0))[0])
        return Reduction("prefix", row.window, predicted=table.fraction(row))
    row = min(suffixes, key=table.fraction)
    steps = p_k / table.fraction(row)
    return Reduction("prefix", row.window, step_fraction=steps, predicted=p_k)


def plan(learner: Learner, table: CostTable, kind: str, p_k: float) -> Plan:
    """The rule's reduction for `kind` at `p_k`, with the table's predictions of its time and
    memory against dense (prune and freeze read as the FLOP rule's `_predicted` does)."""
    reduction, masks, active = rule_reduction(learner, table, kind, p_k)
    if kind == "prune":
        level, label, time_share = p_k, f"density {p_k:.2f}", table.interpolated("prune", p_k)
    elif kind == "channels":
        level = reduction.setting or 1.0
        label = f"channel density {level:.2f}"
        time_share = table.interpolated("prune", level)
        memory = table.interpolated("prune", level, table.memory_fraction)
        return Plan(kind, p_k, reduction, masks, active, label, time_share, memory)
    elif kind == "checkpoint":
        level, label = 1.0, "blocks checkpointed"
        row = _table_row(table, kind, reduction, level)
        time_share = None if row is None else table.fraction(row)
    elif kind == "freeze":
        level = reduction.setting or 1.0
        label, time_share = f"active {level:.2f}", table.interpolated("freeze", level)
    else:
        time_share = reduction.predicted
        level = reduction.setting if kind == "width" and reduction.setting else 0.0
        label = f"width {level:.2f}" if kind == "width" else f"layers {reduction.setting}"
    row = _table_row(table, kind, reduction, level)
    if row is not None and kind in ("prefix", "suffix"):
        label = f"{row.level:.2f} of flops, " + label
    if reduction.step_fraction is not None:
        label += f" x{reduction.step_fraction:.2f} steps"
    memory = table.memory_fraction(row) if row is not None else None
    return Plan(kind, p_k, reduction, masks, active, label, time_share, memory)


DENSE = Plan("dense", 1.0, NO_REDUCTION, None, None, "dense", 1.0, 1.0)


def _call_s(learner: Learner, round_plan: Plan, data: LocalData, steps: int) -> float:
    """Seconds of one `reduced_training` call over `steps` minibatches."""
    part = dataclasses.replace(
        data, x_train=data.x_train[: steps * BATCH], y_train=data.y_train[: steps * BATCH]
    )
    start = learner.init_agent("bench").weights
    generator = torch.Generator().manual_seed(0)
    began = time.perf_counter()
    reduced_training(
        learner.facts,
        start,
        round_plan.masks,
        round_plan.active,
        round_plan.reduction,
        part,
        0,
        generator,
    )
    return time.perf_counter() - began


def whole_steps(round_plan: Plan) -> Plan:
    """The plan training every minibatch of a call. A call of a few minibatches cannot show a
    step fraction (a round trains at least one), so a "+steps" row is timed per step like
    this and scaled by its fraction: a long round's steps all cost alike."""
    reduction = dataclasses.replace(round_plan.reduction, step_fraction=None)
    return dataclasses.replace(round_plan, reduction=reduction)


def interleaved_s(
    learner: Learner, round_plan: Plan, data: LocalData, steps: int, settings: Settings
) -> tuple[float, float]:
    """(reduced, dense) seconds of a call of `steps` minibatches: dense and reduced calls
    alternate, warm-ups discarded, the fastest of each kept."""
    reduced, dense = [], []
    for repeat in range(settings.warmups + settings.repeats):
        dense_s = _call_s(learner, DENSE, data, steps)
        reduced_s = _call_s(learner, round_plan, data, steps)
        if repeat >= settings.warmups:
            dense.append(dense_s)
            reduced.append(reduced_s)
    return min(reduced), min(dense)


def counted_mb(learner: Learner, round_plan: Plan, data: LocalData) -> float:
    """Peak training memory as the agent counts it: one step's saved activations
    (`ActivationMeter`) plus the training working set (`working_set_mb`)."""
    meter = ActivationMeter()
    with meter.measuring():
        _call_s(learner, round_plan, data, 1)
    return meter.megabytes + working_set_mb(learner.facts, round_plan.reduction, round_plan.masks)


def _spec(model: str, round_plan: Plan) -> dict[str, Any]:
    reduction = round_plan.reduction
    return {
        "model": model,
        "kind": round_plan.kind,
        "p_k": round_plan.p_k,
        "reduction": reduction.kind,
        "setting": reduction.setting,
        "checkpoint": reduction.checkpoint,
    }


def rss_growth_mb(model: str, round_plan: Plan) -> float | None:
    """Peak RSS growth of one step in a fresh process (`probe_rss`); None if it failed."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    spec = json.dumps(_spec(model, round_plan))
    done = subprocess.run(
        [sys.executable, "-m", "bench.real_budgets", "--probe-rss", spec],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        print(done.stderr[-2000:], file=sys.stderr)
        return None
    return float(done.stdout.strip().splitlines()[-1])


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1])


def probe_rss(spec: dict[str, Any]) -> float:
    """In a fresh process: the row's learner and round, one warm-up step, the high-water mark
    reset, then MiB the peak RSS rises above the RSS before a second step."""
    torch.set_num_threads(1)
    kind, p_k = spec["kind"], spec["p_k"]
    learner, data = build(spec["model"], "channel" if kind == "channels" else "weight")
    if kind == "dense":
        round_plan = DENSE
    elif kind in ("prune", "channels", "freeze"):
        reduction, masks, active = rule_reduction(learner, None, kind, p_k)
        round_plan = Plan(kind, p_k, reduction, masks, active, "", None, None)
    else:
        setting = spec["setting"]  # a window comes back from JSON as a list
        setting = tuple(setting) if isinstance(setting, list) else setting
        reduction = Reduction(spec["reduction"], setting, checkpoint=spec["checkpoint"])
        round_plan = Plan(kind, p_k, reduction, None, None, "", None, None)
    _ = learner.facts.forward_layers, learner.facts.freezing_plan
    _call_s(learner, round_plan, data, 1)
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    before = _status_kb("VmRSS")
    _call_s(learner, round_plan, data, 1)
    return (_status_kb("VmHWM") - before) / 1024


def verdict(model: str, row: dict[str, Any]) -> tuple[str, bool]:
    """The row's targets as text, and whether all of them are met."""
    time_max, memory_max = TARGETS.get((model, row["kind"], row["p_k"]), (None, None))
    parts, ok = [], True
    if time_max is not None:
        parts.append(f"t<={time_max}")
        ok &= row["time_x"] <= time_max
    if memory_max is not None:
        parts.append(f"m<={memory_max}")
        ok &= row["memory_x"] <= memory_max
    parts.append(f"err<={PREDICTION_TOLERANCE:.0%}")
    error = row["prediction_error"]
    ok &= error is not None and error <= PREDICTION_TOLERANCE
    return " ".join(parts), ok


def measure_model(name: str, settings: Settings, console: Console) -> dict[str, Any]:
    """Calibrate `name`, then measure every (kind, p_k) row against dense (channels with
    its own learner and table: channel masks, prune measured at several densities)."""
    learner, data = build(name)
    began = time.perf_counter()
    table = measure_costs(learner.facts, data)
    calibration_s = time.perf_counter() - began
    console.print(f"{name}: calibrated in {calibration_s:.1f} s ({len(table.rows)} rows)")
    narrow, _ = build(name, "channel")
    narrow_table = measure_costs(narrow.facts, data, kinds=("prune",))
    steps = math.ceil(settings.min_call_s / table.dense.step_s)
    steps = max(settings.min_steps, min(MAX_CALL_STEPS, steps))
    dense_mb = counted_mb(learner, DENSE, data)
    dense_rss = rss_growth_mb(name, DENSE) if settings.rss else None
    rows = []
    for kind in KINDS:
        kind_learner, kind_table = (
            (narrow, narrow_table) if kind == "channels" else (learner, table)
        )
        for p_k in (1.0,) if kind == "checkpoint" else BUDGETS:
            round_plan = plan(kind_learner, kind_table, kind, p_k)
            reduced_s, dense_s = interleaved_s(
                kind_learner, whole_steps(round_plan), data, steps, settings
            )
            time_x = reduced_s / dense_s * (round_plan.reduction.step_fraction or 1.0)
            rss = rss_growth_mb(name, round_plan) if settings.rss else None
            predicted = round_plan.predicted_time
            row: dict[str, Any] = {
                "kind": kind,
                "p_k": p_k,
                "level": round_plan.level,
                "why": round_plan.reduction.why,
                "steps_per_call": steps,
                "reduced_call_s": reduced_s,
                "dense_call_s": dense_s,
                "time_x": time_x,
                "memory_mb": counted_mb(kind_learner, round_plan, data),
                "predicted_time_x": predicted,
                "predicted_memory_x": round_plan.predicted_memory,
                "prediction_error": None if predicted is None else abs(predicted - time_x) / time_x,
                "rss_growth_mb": rss,
                "rotation": rotation(table, p_k) if kind == "prefix" else None,
            }
            row["memory_x"] = row["memory_mb"] / dense_mb
            row["rss_x"] = None if rss is None or not dense_rss else rss / dense_rss
            row["target"], row["pass"] = verdict(name, row)
            rows.append(row)
            console.print(f"  {kind} {p_k}: {time_x:.2f}x time, {row['memory_x']:.2f}x memory")
    return {
        "model": name,
        "input_shape": MODELS[name],
        "calibration_s": calibration_s,
        "table": table.to_dict(),
        "channel_table": narrow_table.to_dict(),
        "dense_memory_mb": dense_mb,
        "dense_rss_growth_mb": dense_rss,
        "rows": rows,
    }


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def print_table(console: Console, results: list[dict[str, Any]]) -> None:
    table = Table(title="real budgets: measured against dense (batch 64, one thread)")
    for column in (
        "model",
        "reduction",
        "p_k",
        "level chosen",
        "time x",
        "memory x",
        "rss x",
        "pred time x",
        "pred mem x",
        "|pred-meas|/meas",
        "target",
        "pass",
    ):
        table.add_column(
            column, justify="left" if column in ("level chosen", "target") else "right"
        )
    for result in results:
        for row in result["rows"]:
            error = row["prediction_error"]
            table.add_row(
                result["model"],
                row["kind"],
                f"{row['p_k']:.1f}",
                row["level"],
                _x(row["time_x"]),
                _x(row["memory_x"]),
                _x(row["rss_x"]),
                _x(row["predicted_time_x"]),
                _x(row["predicted_memory_x"]),
                "-" if error is None else f"{error:.0%}",
                row["target"],
                "yes" if row["pass"] else "NO",
            )
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="", help="comma-separated; default: all three")
    parser.add_argument("--quick", action="store_true", help="smoke run: mlp and cnn2d, few steps")
    parser.add_argument("--no-rss", action="store_true", help="skip the RSS cross-check")
    parser.add_argument("--min-call", type=float, default=Settings.min_call_s, help="seconds")
    parser.add_argument(
        "--min-steps", type=int, default=Settings.min_steps, help="minibatches a call, >= 1"
    )
    parser.add_argument("--repeats", type=int, default=Settings.repeats, help="timed calls, >= 5")
    parser.add_argument(
        "--out", type=pathlib.Path, default=ROOT / "bench/results/real_budgets.json"
    )
    parser.add_argument("--probe-rss", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe_rss:
        print(probe_rss(json.loads(args.probe_rss)))
        return 0
    torch.set_num_threads(1)
    names = [n for n in args.models.split(",") if n] or list(QUICK_MODELS if args.quick else MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {', '.join(MODELS)}")
    if args.repeats < Settings.repeats and not args.quick:
        parser.error(f"--repeats must be at least {Settings.repeats}")
    settings = QUICK
    if not args.quick:
        settings = Settings(
            repeats=args.repeats,
            min_call_s=args.min_call,
            min_steps=max(1, args.min_steps),
            rss=not args.no_rss,
        )
    console = Console(width=200)
    results = [measure_model(name, settings, console) for name in names]
    print_table(console, results)
    failed = [
        (r["model"], row["kind"], row["p_k"])
        for r in results
        for row in r["rows"]
        if not row["pass"]
    ]
    console.print(f"{len(failed)} rows miss a target" if failed else "every target met")
    write_json(
        args.out,
        {
            "settings": dataclasses.asdict(settings),
            "batch_size": BATCH,
            "threads": torch.get_num_threads(),
            "results": results,
            "missed": failed,
            "machine": environment(),
        },
    )
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
