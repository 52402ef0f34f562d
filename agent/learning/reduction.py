"""How a budgeted agent cuts a round to p_k (ALGORITHMS.md 5).

Two kinds of budget. The paper's reductions count FLOPs: `prune` caps a sparse model's
density (DA-DPFL's way) and `freeze` trains a p_k fraction of the neurons (FedSPU's way).
With masked-dense kernels a lower density saves counted FLOPs and bytes on the wire, not
seconds or memory, so for `prune` p_k is a FLOP and byte budget, and it stays the default
because it is the paper's algorithm. The physical reductions are chosen by the device's
measured costs (`agent.learning.costs`): `prefix` trains a window of layers (the rest frozen,
the layers before it without a backward pass), `width` trains a narrower sub-model, and
`auto` takes, of those that fit the time and memory budget, the one of least expected
accuracy cost. Below every measured floor a round trains fewer minibatches; when the
configured batch does not fit the memory, the model's blocks are checkpointed
(`agent.learning.checkpointing`: the same numbers in less memory, for more time) where the
time still fits, else a smaller batch trains.

The rules here are shared by every kind; what is a kind's own (its levels, its FLOP rule,
the reduction a measured level trains with) is in its file of `agent.learning.reductions`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from agent.learning import reductions
from agent.learning.costs import CostTable, Row
from agent.learning.reductions import AUTO, CHECKPOINT, KINDS, MEASURED_KINDS, MEASURED_MODES, NONE
from agent.learning.sparse import Masks

if TYPE_CHECKING:
    from agent.learning.model_facts import ModelFacts


def measured_kinds(mode: str) -> tuple[str, ...]:
    """The reductions whose costs an agent measures under `--reduce mode`: auto's choices,
    or the mode's own kind (prune and freeze for their prediction); with checkpointing for
    the modes that choose by measurement (what fits the memory at the configured batch)."""
    kinds = MEASURED_KINDS if mode == AUTO else (mode,)
    return (*kinds, CHECKPOINT) if mode in MEASURED_MODES else kinds


def sends_parts(mode: str) -> bool:
    """Whether a round under `--reduce mode` may publish only what it trained (a kind of
    `measured_kinds(mode)` that `sends_part`s, such as a window of layers)."""
    return any(KINDS[k].sends_part for k in measured_kinds(mode) if k in KINDS)


def capped_density(learner: ModelFacts, p_k: float | None, masks: Masks | None) -> float | None:
    """The density the budget allows this round's sparse model (None: no cap applies)."""
    if p_k is None or masks is None:
        return None
    return density_cap(p_k, learner.config.density, learner.flops_per_density(masks))


@dataclass(frozen=True)
class Reduction:
    """How an agent cuts this round to its budget, and why (ALGORITHMS.md 5): the kind that
    cuts it, that kind's own setting, and what any kind may add (fewer steps, a smaller
    batch, checkpointed blocks)."""

    kind: str = NONE
    """The kind that cuts the round (`agent.learning.reductions`), whose `setting` it is:
    none, prune, freeze, prefix, width, checkpoint (the dense model checkpointed)."""
    setting: Any = None
    """The kind's own parameter, which only its class reads (`ReductionKind.setting`):
    prune's density cap, freeze's active fraction, prefix's window of layers, width's
    fraction of every hidden channel."""
    step_fraction: float | None = None
    """Train only this fraction of the round's minibatches: the last resort."""
    batch_size: int | None = None
    """A smaller batch than configured, so that the round fits the memory."""
    checkpoint: bool = False
    """Checkpoint the model's blocks (`agent.learning.checkpointing`): the configured batch
    in less memory, for more time."""
    predicted: float | None = None
    """The measured share of a dense round's time this reduction takes (None unmeasured)."""
    why: str = ""
    """One line for the status: what was chosen and what it was chosen over."""

    @property
    def label(self) -> str:
        """What the round did, for its record and status: the kind, with "+steps" when it
        trains fewer minibatches."""
        return self.kind + ("+steps" if self.step_fraction is not None else "")

    def figures(self) -> dict[str, Any]:
        """The round record's fields its kind fills (`ReductionKind.figures`)."""
        return reductions.kind(self.kind).figures(self)

    def published(self, learner: ModelFacts) -> set[str] | None:
        """The state entries a round cut this way publishes: what it trained, for a kind
        that `sends_part` (None: the whole model)."""
        if not KINDS[self.kind].sends_part:
            return None
        return reductions.kind(self.kind).trainable(learner, self)


NO_REDUCTION = Reduction()
"""A round trained whole."""


def local_reduction(
    learner: ModelFacts,
    p_k: float | None,
    masks: Masks | None,
    *,
    costs: CostTable | None = None,
    round_: int = 0,
    memory_mb: float | None = None,
) -> Reduction:
    """The round's reduction under `--reduce`.

    prune and freeze follow the FLOP rule (`flop_reduction`); with a cost table they carry
    its prediction too. prefix, width and auto choose by the measured `costs`, which they
    need (ValueError without); `memory_mb` is what training may take, `round_` turns the
    prefix windows.
    """
    mode = learner.config.reduce
    if mode not in MEASURED_MODES:
        return _predicted(flop_reduction(learner, p_k, masks), costs)
    if p_k is None or (p_k >= 1.0 and memory_mb is None):
        return Reduction()
    if costs is None:
        raise ValueError(f"--reduce {mode} chooses by measured costs, and none were measured")
    return measured_reduction(
        costs, measured_kinds(mode), p_k, round_, memory_mb, learner.config.batch_size
    )


def flop_reduction(learner: ModelFacts, p_k: float | None, masks: Masks | None) -> Reduction:
    """`--reduce prune` (cap the density) or `freeze` (train a fraction of the neurons, the
    rest frozen and kept), by counted FLOPs: the papers' budgets. p_k is the fraction of a
    dense round's FLOPs the agent can afford; the mode's kind says what meets it
    (`ReductionKind.by_flops`)."""
    if p_k is None or masks is None:
        return Reduction()
    return reductions.kind(learner.config.reduce).by_flops(learner, p_k, masks)


def _predicted(reduction: Reduction, costs: CostTable | None) -> Reduction:
    """A FLOP rule's reduction with the table's measured share of a dense round at its
    kind's level (a whole round: 1)."""
    if costs is None:
        return reduction
    cut = reductions.kind(reduction.kind)
    level = cut.level(reduction)
    share = 1.0 if level is None else costs.interpolated(cut.name, level)
    return replace(reduction, predicted=share)


@dataclass(frozen=True)
class _Option:
    kind: str
    row: Row
    share: float
    batch_size: int | None
    checkpoint: bool = False


def _checkpointed(row: Row, costs: CostTable) -> Row | None:
    """`row` with its blocks checkpointed, by the factors the table measured on the dense
    model (time up, activations down); None when it measured none."""
    measured = costs.of_kind(CHECKPOINT)
    if not measured:
        return None
    cost = measured[0].cost
    activations = cost.activation_mb / max(costs.dense.activation_mb, 1e-9)
    return replace(
        row,
        cost=replace(
            row.cost,
            step_s=row.cost.step_s * cost.step_s / costs.dense.step_s,
            activation_mb=row.cost.activation_mb * activations,
        ),
    )


def _sized(
    row: Row, costs: CostTable, batch: int, memory_mb: float | None
) -> list[tuple[Row, int, bool]]:
    """The ways `row` fits the memory: (row as trained, batch, checkpointed). At the
    configured batch if it fits; else checkpointed at that batch where that fits (the same
    numbers, more time), then at the largest smaller batch that fits."""
    size = _fitting_batch(row, costs, batch, memory_mb)
    if size == batch:
        return [(row, batch, False)]
    ways = []
    checkpointed = _checkpointed(row, costs)
    if checkpointed is not None and _fitting_batch(checkpointed, costs, batch, memory_mb) == batch:
        ways.append((checkpointed, batch, True))
    if size:
        ways.append((row, size, False))
    return ways


def _fitting_batch(row: Row, costs: CostTable, batch: int, memory_mb: float | None) -> int | None:
    """The batch this row trains at within `memory_mb`: the configured one if it fits, else
    the largest smaller one; 0 when not even one sample fits."""
    if memory_mb is None or row.cost.peak_at(batch, costs.batch_size) <= memory_mb:
        return batch
    per_sample = row.cost.activation_mb / costs.batch_size
    room = (memory_mb - row.cost.fixed_mb) / per_sample if per_sample > 0 else 0.0
    return min(batch, math.floor(room)) if room >= 1 else 0


def _options(
    costs: CostTable, name: str, p_k: float, round_: int, memory_mb: float | None, batch: int
) -> list[_Option]:
    """Every level of kind `name` that fits the memory (at some batch), best level first in
    the kind's ranking (`ReductionKind.ranked`), each level's rows those that may train this
    round among those of that level that fit p_k (`ReductionKind.taking_turns`: a prefix
    window that alone fits would train the same layers every round)."""
    cut = reductions.kind(name)
    options = []
    levels = sorted({row.level for row in _rows(costs, name)}, reverse=True)
    for level in cut.ranked(costs, levels, p_k):
        rows = [row for row in _rows(costs, name) if row.level == level]
        sized = [way for row in rows for way in _sized(row, costs, batch, memory_mb)]
        fitting = [row for row, _, _ in sized if costs.fraction(row) <= p_k]
        if fitting:
            turn = cut.taking_turns(fitting, round_)
            sized = [way for way in sized if turn(way[0])]
        for row, size, checkpoint in sized:
            share = costs.fraction(row)
            options.append(_Option(name, row, share, None if size == batch else size, checkpoint))
    return options


def measured_reduction(
    costs: CostTable,
    kinds: Sequence[str],
    p_k: float,
    round_: int,
    memory_mb: float | None,
    batch: int,
) -> Reduction:
    """The first of `kinds` (least expected accuracy cost first) with a level whose measured
    cost fits p_k and whose memory fits `memory_mb`, at its highest such level. When none
    fits, the cheapest measured option, training only p_k / its cost of the minibatches."""
    dense_fits = _fitting_batch(_dense_row(costs), costs, batch, memory_mb)
    if p_k >= 1.0 and dense_fits == batch:
        return Reduction(why="a dense round fits the budget")
    passed: list[str] = []
    whole = [o for o in _options(costs, NONE, p_k, round_, memory_mb, batch) if o.checkpoint]
    if whole and whole[0].share <= p_k:
        return _as_reduction(whole[0], p_k, passed, step_fraction=None)
    for kind in kinds:
        options = _options(costs, kind, p_k, round_, memory_mb, batch)
        fitting = [option for option in options if option.share <= p_k]
        if fitting:
            return _as_reduction(fitting[0], p_k, passed, step_fraction=None)
        passed.append(f"{kind} (cheapest {min((o.share for o in options), default=1.0):.2f})")
    every = [o for kind in kinds for o in _options(costs, kind, 1.0, round_, memory_mb, batch)]
    if not every:
        raise ValueError(f"no measured reduction of {', '.join(kinds)} fits {memory_mb} MiB")
    cheapest = min(every, key=lambda option: option.share)
    return _as_reduction(cheapest, p_k, passed, step_fraction=p_k / cheapest.share)


def _dense_row(costs: CostTable) -> Row:
    return Row(NONE, 1.0, costs.dense)


def _rows(costs: CostTable, kind: str) -> list[Row]:
    """The table's rows of `kind`; "none" is the dense model's."""
    return [_dense_row(costs)] if kind == NONE else costs.of_kind(kind)


def _as_reduction(
    option: _Option, p_k: float, passed: list[str], step_fraction: float | None
) -> Reduction:
    row = option.row
    share = option.share if step_fraction is None else option.share * step_fraction
    kind = CHECKPOINT if option.kind == NONE else option.kind
    named = "dense, checkpointed," if option.kind == NONE else f"{kind} {row.level:.2f}"
    why = f"{named} takes {option.share:.2f} of a dense round (p_k {p_k:.2f})"
    if passed:
        why += "; " + ", ".join(passed) + " do not fit"
    if step_fraction is not None:
        why += f"; below every floor: {step_fraction:.2f} of the minibatches"
    if option.batch_size is not None:
        why += f"; batch {option.batch_size} to fit the memory"
    if option.checkpoint and option.kind != NONE:
        why += "; blocks checkpointed to fit the memory"
    return replace(
        reductions.kind(kind).of_row(row),
        step_fraction=step_fraction,
        batch_size=option.batch_size,
        checkpoint=option.checkpoint,
        predicted=share,
        why=why,
    )


def density_cap(p_k: float, initial_density: float, flops_per_density: float = 1.0) -> float:
    """The highest density a pruned (DA-DPFL) model may train at this round.

    cap = min(initial_density, p_k / flops_per_density). A pruned model's training FLOPs are
    its FLOP fraction times the dense ones, so the cap keeps them within p_k of a dense round.
    With p_k = 1 the cap never binds: it is at least the current density (a FLOP fraction is
    at most 1) and DA-DPFL never exceeds its initial density.
    It may go below the target density 1 - s*: s* is where the algorithm's own pruning stops,
    the cap is what the device can afford; a weaker device gets a lower cap, so fewer FLOPs.

    flops_per_density: FLOP fraction / density of the masks the agent trains with, measured
    each round with `forward_flops`. Parameter density is not FLOP density: ERK gives
    ResNet-18's early layers (few parameters, many FLOPs) a higher density, so at density 0.2
    its FLOP fraction is 0.5 (ratio 2.5, 1.6 at density 0.5); for the bundled cnn1d and cnn2d
    the ratio is about 0.85. Pruning to the cap changes the ratio; the next round's cap,
    computed from the new masks, corrects for it.
    """
    if not 0 < p_k <= 1 or not 0 < initial_density <= 1 or not flops_per_density > 0:
        raise ValueError(
            f"need p_k and initial_density in (0, 1] and a positive flops_per_density, got "
            f"{p_k}, {initial_density}, {flops_per_density}"
        )
    return min(initial_density, p_k / flops_per_density)


def active_fraction(p_k: float) -> float:
    """The fraction of neurons a frozen (FedSPU) model trains this round: p_k itself, as
    ALGORITHMS.md section 2 decides (the per-layer floor of one neuron is FedSPU's).

    Freezing saves less than it trains: frozen neurons still run forward and pass gradients
    back to active ones, so only the weight-gradient third of the backward pass shrinks (to
    about a^2 of it between hidden layers). Training FLOPs stay above ~2/3 of dense whatever
    p_k is: freezing alone cannot meet a budget below that.
    """
    if not 0 < p_k <= 1:
        raise ValueError(f"p_k must be in (0, 1], got {p_k}")
    return p_k
