"""Step formats: how fast a dense training step runs in each memory format and precision on
this device, what each changes in the numbers, and which one an agent's calibration trains in
(issue 32, point 4).

    python -m bench.compute_formats [--models mlp,cnn2d,resnet18] [--device auto|cpu|cuda]
        [--precisions fp32,fp16,bf16] [--repeats 5] [--out bench/results/compute_formats.json]

For each model (those of bench/real_budgets.py: mlp on 64 features, cnn2d on 1x28x28, resnet18
on 3x32x32; 10 classes, batch 64, random data drawn here), every format
`agent.learning.precision.ComputeFormat` names is timed (`--precisions`): fp32, fp16 and bf16
autocast, and channels-last with each for the models with 4-D weights. The timed unit is the
calibration's own dense call (`_Calibration.call_s`: as many minibatch steps as the
calibration takes, enough for 0.1 s of dense work, per-round work included); fp32 and the
format alternate (one warm-up pair, discarded: cuDNN picks its kernels there), and the fastest
of `--repeats` of each is kept. Time x fp32 = format minimum / fp32 minimum. A format over 5x
fp32 on the warm-up pair is timed no further (its figure is that pair's) and its numbers are
not compared.

What the format changes: the same steps from the same start and batches in fp32 and in the
format; the largest difference of a trained weight and the difference of the mean loss.

What the agent would train in: `candidate_formats` (the formats it times on this device; fp32
alone on a CPU) and `fastest_format`'s rule over this run's times (the fastest candidate when it
beats fp32 by FORMAT_GAIN). On a CPU the answer is fp32 by design; the other rows say whether
that design holds on this CPU. On a GPU this is the measurement the agent's calibration makes.

CPU runs use one thread, as bench/real_budgets.py does.
"""

from __future__ import annotations

import argparse
import pathlib
from dataclasses import replace
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from agent.device.calibration import (
    FORMAT_GAIN,
    _Calibration,
    _sample,
    _steps,
    candidate_formats,
    chosen_format,
)
from agent.learning import Learner, LocalData, preset
from agent.learning.models import build_model, prunable_names
from agent.learning.precision import CHANNELS_LAST, ComputeFormat
from agent.learning.reduced import reduced_training
from agent.learning.reduction import NO_REDUCTION
from bench.real_budgets import BATCH, CLASSES, MODELS
from bench.support import environment, write_json

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Samples drawn: enough for the calibration's longest call (`_steps`: 0.1 s of dense work).
SAMPLES = BATCH * 100
SLOW = 5.0
"""A format over SLOW times fp32 on its warm-up pair is timed no further."""


def all_formats(learner: Learner, precisions: tuple[str, ...]) -> list[str]:
    """Every format of `precisions` worth timing: each, and each channels-last for a model
    with 4-D weights (the only tensors channels-last lays out)."""
    formats = list(precisions)
    if any(p.dim() == 4 for p in learner.facts.model.parameters()):
        formats += [CHANNELS_LAST if p == "fp32" else f"{CHANNELS_LAST}+{p}" for p in precisions]
    return formats


def build(name: str, device: torch.device) -> tuple[Learner, LocalData]:
    """A dense learner of `name` computing on `device`, and data for its timed calls."""
    shape = MODELS[name]
    model = build_model(name, shape, CLASSES, seed=0)
    config = preset("fedavg", batch_size=BATCH, epochs=1, rounds=10)
    learner = Learner(model, shape, prunable_names(model), config, seed=0).to(device)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, *shape, generator=generator)
    y = torch.randint(0, CLASSES, (SAMPLES,), generator=generator)
    return learner, LocalData(x, y, x[:8], y[:8], x[:8], y[:8])


def _call_in(timing: _Calibration, name: str) -> float:
    """Seconds of one timed call in format `name` (the learner is left in fp32)."""
    timing.facts.compute_format = ComputeFormat.parse(name)
    try:
        return timing.call_s(NO_REDUCTION, None)
    finally:
        timing.facts.compute_format = ComputeFormat.parse("fp32")


def interleaved(timing: _Calibration, name: str, repeats: int) -> tuple[float, float]:
    """(format, fp32) seconds of a call: the fastest of `repeats`, the two alternating after
    a warm-up pair. A format over SLOW times fp32 on the warm-up pair is timed no further
    (fp16 on a CPU runs at 3-40x): that pair is its figure."""
    warm_fp32, warm = _call_in(timing, "fp32"), _call_in(timing, name)
    if warm > SLOW * warm_fp32:
        return warm, warm_fp32
    fp32, other = [], []
    for _ in range(repeats):
        fp32.append(_call_in(timing, "fp32"))
        other.append(_call_in(timing, name))
    return min(other), min(fp32)


def trained(learner: Learner, data: LocalData, name: str) -> tuple[dict[str, torch.Tensor], float]:
    """The weights and mean loss of the timed call's steps in format `name`."""
    learner.facts.compute_format = ComputeFormat.parse(name)
    sgd = replace(learner.facts.sgd, epochs=1, batch_size=BATCH)
    start = learner.init_agent("formats").weights
    generator = torch.Generator().manual_seed(0)
    result, _ = reduced_training(
        learner.facts, start, None, None, NO_REDUCTION, data, 0, generator, sgd=sgd
    )
    learner.facts.compute_format = ComputeFormat.parse("fp32")
    return result.state, result.mean_loss


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(
        float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].is_floating_point()
    )


def measure_model(
    name: str, device: torch.device, precisions: tuple[str, ...], repeats: int, console: Console
) -> dict[str, Any]:
    learner, data = build(name, device)
    steps = _steps(learner.facts, data, BATCH)
    data = _sample(data, steps * BATCH)
    timing = _Calibration(learner.facts, data, BATCH, steps)
    reference, reference_loss = trained(learner, data, "fp32")
    rows: dict[str, dict[str, Any]] = {}
    for fmt in all_formats(learner, precisions):
        try:
            seconds, fp32_s = interleaved(timing, fmt, repeats)
            row: dict[str, Any] = {
                "format": fmt,
                "call_s": seconds,
                "fp32_call_s": fp32_s,
                "time_x": seconds / fp32_s,
            }
            if seconds <= SLOW * fp32_s:
                state, loss = trained(learner, data, fmt)
                row["max_weight_difference"] = max_difference(state, reference)
                row["loss_difference"] = loss - reference_loss
        except RuntimeError as error:  # a precision this device's kernels do not have
            rows[fmt] = {"format": fmt, "error": str(error).splitlines()[0]}
            continue
        rows[fmt] = row
        console.print(f"{name} {fmt}: {seconds / fp32_s:.2f}x fp32")
    candidates = candidate_formats(learner.facts)
    times = {f: rows[f]["time_x"] for f in candidates if "time_x" in rows.get(f, {})}
    chosen = chosen_format(times) if times else "fp32"
    fastest = min((r for r in rows.values() if "time_x" in r), key=lambda r: r["time_x"])
    return {
        "model": name,
        "steps_a_call": steps,
        "rows": list(rows.values()),
        "candidates": list(candidates),
        "agent_trains_in": chosen,
        "fastest_measured": fastest["format"],
    }


def print_table(console: Console, device: torch.device, results: list[dict[str, Any]]) -> None:
    table = Table(title=f"step formats on {device.type}: a dense call against fp32 (batch 64)")
    for column in ("model", "format", "time x fp32", "max |dw|", "loss diff", "agent"):
        table.add_column(column, justify="left" if column in ("model", "format") else "right")
    for result in results:
        for row in result["rows"]:
            fmt = row["format"]
            role = "trains in" if fmt == result["agent_trains_in"] else ""
            if "error" in row:
                table.add_row(result["model"], fmt, row["error"][:60], "-", "-", role)
                continue
            table.add_row(
                result["model"],
                fmt,
                f"{row['time_x']:.2f}",
                f"{row['max_weight_difference']:.1e}" if "loss_difference" in row else "-",
                f"{row['loss_difference']:+.1e}" if "loss_difference" in row else "-",
                role if fmt in result["candidates"] else "not a candidate",
            )
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument(
        "--precisions",
        default="",
        help="comma-separated of fp32,fp16,bf16; default: all on a GPU, fp32,bf16 on a CPU "
        "(CPU fp16 autocast ran 25-35x slower than fp32 on cnn2d here)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed calls of each, >= 1")
    parser.add_argument(
        "--out", type=pathlib.Path, default=ROOT / "bench/results/compute_formats.json"
    )
    args = parser.parse_args(argv)
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown or not names:
        parser.error(f"unknown models {unknown}; known: {', '.join(MODELS)}")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    cuda = torch.cuda.is_available()
    if args.device == "cuda" and not cuda:
        parser.error("--device cuda: no CUDA device here")
    device = torch.device(
        "cuda" if args.device == "cuda" or (args.device == "auto" and cuda) else "cpu"
    )
    if device.type == "cpu":
        torch.set_num_threads(1)
    default = "fp32,fp16,bf16" if device.type == "cuda" else "fp32,bf16"
    precisions = tuple(p for p in (args.precisions or default).split(",") if p)
    if not precisions or any(p not in ("fp32", "fp16", "bf16") for p in precisions):
        parser.error(f"--precisions {args.precisions}: choose from fp32, fp16, bf16")
    console = Console(width=160)
    results = [measure_model(n, device, precisions, args.repeats, console) for n in names]
    print_table(console, device, results)
    machine = environment()
    if device.type == "cuda":
        machine["gpu"] = torch.cuda.get_device_name(device)
    write_json(
        args.out,
        {
            "device": device.type,
            "batch_size": BATCH,
            "format_gain": FORMAT_GAIN,
            "threads": torch.get_num_threads(),
            "results": results,
            "machine": machine,
        },
    )
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
