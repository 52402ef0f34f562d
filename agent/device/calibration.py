"""Measuring what a round costs on this device: the cost table of `agent.learning.costs`.

On its first run, and whenever the model, batch size, thread count, compute device, torch
or processor changes (the table's `key`), an agent times a few minibatches of its own model
at every reduction level it can use, through the same `reduced_training` its rounds train
with, and keeps the table in its state folder (`costs.json`). Each row is timed right after
a dense call, `REPEATS` times, and kept as its share of the dense time (the fastest of
each): a load that rises while a table is measured (other processes, a thermal throttle)
then shifts both sides of a share alike, where timing every row against one dense figure
taken first read some rows as dearer than dense. A call trains enough steps for
`MIN_TIMED_S` of dense work, so a small model's per-round work (loading weights, copying
the state out) weighs little.

Memory is measured too: what autograd keeps for the backward pass (`ActivationMeter`, the
storages of the saved tensors of one step, parameters aside; on CUDA the allocator's peak)
plus the weights, gradients and optimizer state of the model that trains
(`working_set_mb`). The agent's other copies of the model (its state, its neighbours'
models) are the same whatever the reduction and are not in this figure.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from agent.files import DiskFullError, atomic_write
from agent.learning import reductions
from agent.learning.config import round_steps
from agent.learning.costs import Cost, CostTable
from agent.learning.facts import LocalData
from agent.learning.model_facts import ModelFacts
from agent.learning.precision import CHANNELS_LAST, ComputeFormat
from agent.learning.reduced import reduced_training
from agent.learning.reduction import NO_REDUCTION, Reduction
from agent.learning.reductions.base import Start, started
from agent.learning.sparse import Masks

if TYPE_CHECKING:
    from agent.learning.reductions.base import Level, Narrow, ReductionKind

log = logging.getLogger(__name__)

MIB = 2**20
MAX_STEPS = 100
MIN_TIMED_S = 0.1
REPEATS = 3
FORMAT_GAIN = 0.95
"""A format other than fp32 is taken when its dense step is at least 5% faster."""
COSTS_FILE = "costs.json"
KINDS = reductions.CALIBRATED


class ActivationMeter:
    """Bytes autograd keeps for the backward pass of the first step run inside it.

    A saved-tensors hook adds up the distinct storages saved during the forward pass,
    parameters aside (they are counted with the weights); the first unpack means the
    backward pass has begun, the point of peak activation memory, and the count stops.
    """

    def __init__(self) -> None:
        self._storages: dict[int, int] = {}
        self._backward = False

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self._backward and not isinstance(tensor, nn.Parameter):
            storage = tensor.untyped_storage()
            self._storages.setdefault(storage.data_ptr(), storage.nbytes())
        return tensor

    def _unpack(self, tensor: torch.Tensor) -> torch.Tensor:
        self._backward = True
        return tensor

    @contextlib.contextmanager
    def measuring(self) -> Iterator[ActivationMeter]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self

    @property
    def megabytes(self) -> float:
        return sum(self._storages.values()) / MIB


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def working_set_mb(facts: ModelFacts, reduction: Reduction, masks: Masks | None = None) -> float:
    """Weights, gradients and momentum of the model a round with `reduction` (and `masks`)
    trains: the whole model's weights, and gradients for what trains as the first kind
    that cuts it says (a window's layers, the narrow model's entries: a width's or channel
    masks'; freezing's gradients are dense-shaped)."""
    from agent.learning import width

    params = dict(facts.model.named_parameters())
    weights = _bytes(params.values())
    grads = weights
    names, narrow = _trained_part(facts, reduction, masks)
    if names is not None:
        grads = _bytes(p for name, p in params.items() if name in names)
    if narrow is not None:
        held = width.held_masks({n: p.detach() for n, p in params.items()}, *narrow)
        weights = grads = sum(int(held[n].sum()) * p.element_size() for n, p in params.items())
    copies = 2 if facts.config.momentum != 0 else 1
    return (weights + copies * grads) / MIB


def _trained_part(
    facts: ModelFacts, reduction: Reduction, masks: Masks | None
) -> tuple[set[str] | None, Narrow | None]:
    """What of the model a round with `reduction` trains, as the first kind in the table
    that cuts it says: the entries of the full model (None: all), or a narrower model."""
    for cut in reductions.kinds():
        names = cut.trainable(facts, reduction)
        narrow = cut.narrowed(facts, reduction, masks, 0)
        if names is not None or narrow is not None:
            return names, narrow
    return None, None


def table_key(facts: ModelFacts, batch_size: int, kinds: Sequence[str] = ()) -> str:
    """What a cost table holds for: the model's layout, the batch, threads, device, torch and
    processor. Another key measures again."""
    layout = [(name, tuple(t.shape)) for name, t in facts.initial.items()]
    model = hashlib.sha256(repr((type(facts.model).__name__, layout)).encode()).hexdigest()
    processor = platform.processor() or platform.machine()
    return (
        f"model {model[:16]} input {facts.input_shape} batch {batch_size} "
        f"threads {torch.get_num_threads()} device {facts.device} torch {torch.__version__} "
        f"cpu {processor} x{os.cpu_count()} kinds {','.join(sorted(kinds))}"
    )


def _sample(data: LocalData, count: int) -> LocalData:
    """`count` training samples (repeated if there are fewer): what the timed steps train on."""
    index = torch.arange(count) % len(data.y_train)
    x, y = data.x_train[index], data.y_train[index]
    return LocalData(x, y, x[:1], y[:1], x[:1], y[:1])


def _seeded() -> torch.Generator:
    """A generator seeded 0: a calibration's draws and training are alike for every row."""
    return torch.Generator().manual_seed(0)


@dataclass
class _Calibration:
    """Timed calls of `steps` minibatch steps on one sample, for every row of a table."""

    facts: ModelFacts
    data: LocalData
    batch: int
    steps: int

    def call_s(self, reduction: Reduction, masks: Any) -> float:
        """Seconds of one call of `steps` steps of `reduction` (per-round work included,
        spread over enough steps to weigh little)."""
        facts = self.facts
        sgd = replace(facts.sgd, epochs=1, batch_size=self.batch)
        weights, _ = facts.initial_model("calibration")
        start = started(facts, Start(weights, masks), reduction, _seeded)
        generator = _seeded()
        began = time.perf_counter()
        reduced_training(
            facts,
            start.weights,
            start.masks,
            start.active,
            reduction,
            self.data,
            0,
            generator,
            sgd=sgd,
        )
        return time.perf_counter() - began

    def memory(self, reduction: Reduction, masks: Any) -> tuple[float, float, float]:
        """(seconds, fixed MiB, activation MiB) of one call of `reduction` (module
        docstring); the seconds include the meter's bookkeeping."""
        facts = self.facts
        cuda = facts.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(facts.device)
        meter = ActivationMeter()
        with meter.measuring():
            seconds = self.call_s(reduction, masks)
        fixed = working_set_mb(facts, reduction, masks)
        activations = meter.megabytes
        if cuda:
            activations = max(torch.cuda.max_memory_allocated(facts.device) / MIB - fixed, 0.0)
        return seconds, fixed, activations

    def share(self, reduction: Reduction, masks: Any) -> tuple[float, float, float, float]:
        """`reduction`'s time over the dense time, each timed right after the other
        `REPEATS` times (the fastest of each kept), so that a load that comes and goes
        while a table is measured shifts both alike; the dense call's seconds; and the
        memory of `memory`, read on the first of the reduction's calls."""
        dense, reduced = [self.call_s(NO_REDUCTION, None)], []
        seconds, fixed, activations = self.memory(reduction, masks)
        reduced.append(seconds)
        for _ in range(REPEATS - 1):
            dense.append(self.call_s(NO_REDUCTION, None))
            reduced.append(self.call_s(reduction, masks))
        return min(reduced) / min(dense), min(dense), fixed, activations


def _candidates(facts: ModelFacts, kinds: Sequence[str]) -> list[tuple[ReductionKind, Level]]:
    """Every level of `kinds` the model can train with, each kind's own
    (`agent.learning.reductions`), with its kind."""
    return [
        (cut, level)
        for cut in reductions.kinds()
        if cut.name in kinds
        for level in cut.levels(facts)
    ]


def _measured(level: Level) -> tuple[Reduction, float | None]:
    """What a level is timed once for: its reduction (a window may recur at several
    levels), and for a prune row its level (they differ by their masks alone)."""
    return level.reduction, level.level if level.masks is not None else None


def _steps(facts: ModelFacts, data: LocalData, batch: int) -> int:
    """How many steps a timed call takes: enough for MIN_TIMED_S of dense training, since a
    shorter call of a small model measures the clock's jitter and the per-round work."""
    probe = _Calibration(facts, _sample(data, 2 * batch), batch, 2)
    probe.call_s(NO_REDUCTION, None)
    step_s = probe.call_s(NO_REDUCTION, None) / 2
    return int(min(MAX_STEPS, max(1, MIN_TIMED_S / max(step_s, 1e-6))))


def candidate_formats(facts: ModelFacts) -> tuple[str, ...]:
    """The step formats worth timing (`agent.learning.precision`): on a GPU fp32, fp16, bf16
    where the GPU has it, and each channels-last for a model with 4-D weights; elsewhere fp32
    alone (a CPU's autocast and channels-last rarely pay, and change the numbers)."""
    if facts.device.type != "cuda":
        return ("fp32",)
    precisions = ["fp32", "fp16"]
    if torch.cuda.is_bf16_supported():
        precisions.append("bf16")
    formats = list(precisions)
    if any(p.dim() == 4 for p in facts.model.parameters()):
        formats += [f"{CHANNELS_LAST}+{p}" if p != "fp32" else CHANNELS_LAST for p in precisions]
    return tuple(formats)


def chosen_format(times: Mapping[str, float]) -> str:
    """The format of `times` (seconds, or any measure of them) an agent trains in: the
    fastest, when it beats fp32 by FORMAT_GAIN; else fp32."""
    best = min(times, key=lambda name: times[name])
    return best if times[best] < FORMAT_GAIN * times.get("fp32", math.inf) else "fp32"


def fastest_format(facts: ModelFacts, timing: _Calibration, formats: Sequence[str]) -> str:
    """Of `formats`, the one whose dense step is fastest, when it beats fp32 by FORMAT_GAIN;
    each timed after a warm-up call (cuDNN picks its kernels there), the fastest of REPEATS.
    Leaves the model training in it."""
    times: dict[str, float] = {}
    for name in formats:
        facts.compute_format = ComputeFormat.parse(name)
        timing.call_s(NO_REDUCTION, None)
        times[name] = min(timing.call_s(NO_REDUCTION, None) for _ in range(REPEATS))
    chosen = chosen_format(times)
    facts.compute_format = ComputeFormat.parse(chosen)
    if len(formats) > 1:
        log.info(
            "step formats (s a call): %s; training in %s",
            ", ".join(f"{n} {t:.3f}" for n, t in times.items()),
            chosen,
        )
    return chosen


def measure_costs(
    facts: ModelFacts,
    data: LocalData,
    batch_size: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    kinds: Sequence[str] = KINDS,
    formats: Sequence[str] | None = None,
) -> CostTable:
    """Time every level of the reduction `kinds` of `facts` on a few of `data`'s samples
    (module docstring), in the step format measured fastest of `formats` (by default
    `candidate_formats`), which `facts` then trains in; `progress(done, total)` after
    each row."""
    batch = batch_size or facts.config.batch_size
    steps = _steps(facts, data, batch)
    timing = _Calibration(facts, _sample(data, steps * batch), batch, steps)
    step_format = "fp32"
    if formats is None:
        formats = candidate_formats(facts)
    if list(formats) != ["fp32"]:
        step_format = fastest_format(facts, timing, formats)
    candidates = _candidates(facts, kinds)
    dense_s: list[float] = []
    measured: dict[tuple[Reduction, float | None], tuple[float, float, float]] = {}
    for done, (_, level) in enumerate(candidates, start=1):
        if progress is not None:
            progress(done, len(candidates))
        if _measured(level) not in measured:
            share, dense_call_s, fixed, activations = timing.share(level.reduction, level.masks)
            dense_s.append(dense_call_s)
            measured[_measured(level)] = (share, fixed, activations)
    if not dense_s:
        dense_s.append(timing.call_s(NO_REDUCTION, None))
    step_s = statistics.median(dense_s) / steps
    dense_cost = Cost(step_s, *timing.memory(NO_REDUCTION, None)[1:])
    rows = []
    for cut, level in candidates:
        share, fixed, activations = measured[_measured(level)]
        rows.append(cut.row(level, Cost(share * step_s, fixed, activations)))
    forward_s = _forward_s(facts, timing.data)
    key = table_key(facts, batch, kinds)
    return CostTable(key, batch, dense_cost, forward_s, tuple(rows), step_format)


@torch.no_grad()
def _forward_s(facts: ModelFacts, data: LocalData) -> float:
    """Seconds per sample of an evaluation pass (the round's evaluation)."""
    x = data.x_train.to(facts.device)
    facts.model.eval()
    facts.model(x[:8])
    began = time.perf_counter()
    facts.model(x)
    return (time.perf_counter() - began) / len(x)


_MEASURED: dict[str, CostTable] = {}
"""Tables measured by this process: agents sharing a process (emulate) measure once."""


def cached_costs(
    folder: Path,
    facts: ModelFacts,
    data: LocalData,
    kinds: Sequence[str] = KINDS,
    say: Callable[[str], None] = log.info,
) -> CostTable:
    """The cost table for this model from `folder`'s `costs.json`, measured and kept there
    when missing, unreadable or measured for something else (another key). The model
    trains in the step format the table was measured fastest in."""
    path = folder / COSTS_FILE
    key = table_key(facts, facts.config.batch_size, kinds)
    tables: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        tables = dict(json.loads(path.read_text()))
    if key in tables:
        with contextlib.suppress(ValueError):
            kept = CostTable.from_dict(tables[key])
            facts.compute_format = ComputeFormat.parse(kept.format)
            return kept
    table = _MEASURED.get(key)
    if table is None:
        say("measuring this device's training costs (once per model and batch size)")
        began = time.perf_counter()
        table = _MEASURED[key] = measure_costs(facts, data, kinds=kinds)
        say(f"costs measured in {time.perf_counter() - began:.1f} s: {len(table.rows)} levels")
    facts.compute_format = ComputeFormat.parse(table.format)
    tables[key] = table.to_dict()
    text = json.dumps(tables, indent=1).encode()
    with contextlib.suppress(OSError, DiskFullError):  # a full disk costs a measurement next time
        atomic_write(path, lambda handle: handle.write(text))
    return table


def predicted_s(
    table: CostTable,
    reduction: Reduction,
    samples: int,
    epochs: int,
    batch_size: int,
    extra_steps: int = 0,
    eval_samples: int = 0,
) -> float:
    """Seconds a round with `reduction` takes on this device by the table: its steps at the
    reduction's measured step time (per sample, so a smaller batch costs the same per
    sample), `extra_steps` dense steps (RigL's dense gradient) and the evaluation."""
    batch = reduction.batch_size or batch_size
    steps = round_steps(samples, batch, epochs, reduction.step_fraction)
    share = 1.0 if reduction.predicted is None else reduction.predicted
    if reduction.step_fraction is not None and reduction.predicted is not None:
        share = reduction.predicted / reduction.step_fraction
    per_step = share * table.dense.step_s * batch / table.batch_size
    dense_step = table.dense.step_s * batch_size / table.batch_size
    return steps * per_step + extra_steps * dense_step + eval_samples * table.forward_s


@dataclass(frozen=True)
class RoundCosts:
    """An agent's measured cost table with the shape of its rounds: what a round with a
    given reduction is predicted to take on this device."""

    table: CostTable
    samples: int
    epochs: int
    batch_size: int
    extra_steps: int = 0
    """Dense steps beside training (RigL's dense-gradient batches)."""
    eval_samples: int = 0

    def predicted_s(self, reduction: Reduction) -> float:
        return predicted_s(
            self.table,
            reduction,
            self.samples,
            self.epochs,
            self.batch_size,
            self.extra_steps,
            self.eval_samples,
        )

    @property
    def dense_s(self) -> float:
        """A whole round's predicted seconds, unreduced."""
        return self.predicted_s(NO_REDUCTION)

    @property
    def fixed_s(self) -> float:
        """The part of a round no reduction cuts: RigL's dense steps and the evaluation. p_k
        is a share of the rest, as the budget's FLOP rule leaves the fixed FLOPs out."""
        batch = self.batch_size / self.table.batch_size
        dense_steps = self.extra_steps * self.table.dense.step_s * batch
        return dense_steps + self.eval_samples * self.table.forward_s
