"""Channel-level (structured) DA-DPFL: masks that keep or drop whole neurons, so that a
lower density is a smaller model to train, not a dense one with zeros in it.

DA-DPFL's masks (ALGORITHMS.md 1.1-1.9) keep single weights; on dense kernels a model at
density 0.2 trains as long as a dense one. With `--mask-unit channel` every rule of the
algorithm acts on whole channels instead (a conv's output channel, a linear layer's output
neuron, and everything that reads it), and an agent trains the narrower sub-model its mask
leaves (`agent.learning.width` cuts it out and writes it back), so its density is real.

The masks stay per-weight bool tensors, so mask-based aggregation (1.4), the wire, the
checkpoints and the FLOP count work unchanged: a weight is kept when every channel it
connects is kept. Channels are grouped as width reduction groups them (`width.width_plan`):
one *class* per set of channels that must go together (a residual stream's channels across
its blocks), in *blocks* of a GroupNorm's channels per group, so that a dropped block is a
whole group and the kept groups normalize as before. The model's input and output channels,
classes that reach an operation not known to keep channels apart, and classes normalized
across their channels (LayerNorm) are never dropped; nor are classes without a prunable
weight. A dropped channel then has no effect on the output: every weight that reads it is
zero, so the full (masked) model computes exactly what the narrow one does.

The rules, block for weight (each a decision, recorded here and in the proposed
ALGORITHMS.md text):

- Initial masks (1.1): one fraction s of every class's blocks, s the largest with the
  prunable density at most the target, each agent drawing its blocks at random (ERK's
  per-layer densities have no per-channel form: a hidden weight's density is the product of
  its two channels' fractions; a uniform width is HeteroFL's choice).
- RigL (1.6): per class, drop floor(alpha n) of the n kept blocks with the smallest weight
  norm (over every weight that writes or reads them), and regrow as many dropped ones with
  the largest gradient norm on the weights that would read them. A regrown neuron whose
  weights were all zero would never train (no input makes it fire, no weight passes its
  output on, so both gradients are zero): it starts afresh, its weights at their initial
  values w0. Growth gradients are taken with the dropped neurons' incoming weights at w0
  and their outgoing ones zero, which changes nothing downstream. Measured on digits (10
  agents, 30 rounds, mean accuracy): zero outgoing weights at regrowth (ReDo's reset) 0.851,
  w0 0.924, both with 1.6's ceil count; floor 0.958, beside 0.956 for weight masks.
- PQI (1.9): per class, the PQ index of the kept blocks' norms says how many blocks to drop;
  a step that would take the sparsity past s* is trimmed, largest cut first, block by block.
- The budget's density cap: every class keeps the same fraction of its kept blocks, the
  largest with the density at most the cap, by norm.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from agent.learning.pqi import pqi_prune_count
from agent.learning.sparse import Masks, State, _floor, smallest_active

if TYPE_CHECKING:  # width traces with torch.fx: imported where a plan is made
    from agent.learning.width import ChannelClass, Selection, WidthPlan

Kept = tuple[Tensor, ...]
"""Per class of a `ChannelPlan`, a bool tensor over its blocks: True where kept."""


@dataclass(frozen=True)
class _Slot:
    """Dim `dim` of a prunable tensor reads or writes class `cls`, each channel covering
    `expansion` consecutive entries (positions, after a flatten)."""

    cls: int
    dim: int
    expansion: int


@dataclass(frozen=True)
class ChannelPlan:
    """The classes of channels a structured mask drops in blocks, and where each prunable
    tensor's dims meet them."""

    classes: tuple[ChannelClass, ...]
    shapes: dict[str, tuple[int, ...]]
    """The prunable tensors' shapes."""
    slots: dict[str, tuple[_Slot, ...]]
    """Per prunable tensor, its dims that belong to a class."""

    def blocks(self, cls: int) -> int:
        return self.classes[cls].size // self.classes[cls].step

    @property
    def width(self) -> WidthPlan:
        """The plan as width reduction reads it, to cut out and write back the sub-model."""
        from agent.learning.width import WidthPlan

        return WidthPlan(self.classes, None)


def channel_plan(width: WidthPlan, shapes: Mapping[str, Sequence[int]]) -> ChannelPlan:
    """The classes of `width` a structured mask may drop: those with a prunable weight
    (`shapes` names the prunable tensors) and no LayerNorm (which normalizes across them, so
    a dropped channel would change the kept ones). ValueError, in one line, when none is left.
    """
    classes = []
    for cls in width.classes:
        layer_norm = any(attribute == "normalized_shape" for _, attribute, _ in cls.widths)
        if not layer_norm and any(name in shapes for name, _, _ in cls.members):
            classes.append(cls)
    if not classes:
        note = f" ({width.note})" if width.note else ""
        raise ValueError(
            "channel masks have no channel to drop: every hidden channel is the model's input "
            "or output, normalized across channels, or kept whole" + note
        )
    slots: dict[str, list[_Slot]] = {name: [] for name in shapes}
    for index, cls in enumerate(classes):
        for name, dim, expansion in cls.members:
            if name in slots:
                slots[name].append(_Slot(index, dim, expansion))
    return ChannelPlan(
        tuple(classes),
        {name: tuple(shape) for name, shape in shapes.items()},
        {name: tuple(found) for name, found in slots.items()},
    )


# ------------------------------------------------------------------ masks from kept blocks


def _channels(plan: ChannelPlan, cls: int, kept: Tensor) -> Tensor:
    """A class's kept blocks as one bool per channel."""
    return kept.repeat_interleave(plan.classes[cls].step)


def _along(values: Tensor, dim: int, rank: int) -> Tensor:
    return values.view([-1 if d == dim else 1 for d in range(rank)])


def _tensor_mask(plan: ChannelPlan, name: str, kept: Kept, skip: int | None = None) -> Tensor:
    """The mask of prunable tensor `name`: kept where every class it meets keeps the channel
    (class `skip` left out: as if all its channels were kept)."""
    shape = plan.shapes[name]
    mask = torch.ones(shape, dtype=torch.bool)
    for slot in plan.slots[name]:
        if slot.cls == skip:
            continue
        channels = _channels(plan, slot.cls, kept[slot.cls]).repeat_interleave(slot.expansion)
        mask &= _along(channels, slot.dim, len(shape))
    return mask


def masks_of(plan: ChannelPlan, kept: Kept) -> Masks:
    """The per-weight masks of the prunable tensors when each class keeps its `kept` blocks."""
    return {name: _tensor_mask(plan, name, kept) for name in plan.shapes}


def kept_blocks(plan: ChannelPlan, masks: Mapping[str, Tensor]) -> Kept:
    """The blocks each class keeps, read off structured `masks` (a block is kept where any
    weight of any of its channels is)."""
    out = []
    for index, cls in enumerate(plan.classes):
        kept = torch.zeros(plan.blocks(index), dtype=torch.bool)
        for name, dim, _ in cls.members:
            if name in masks:  # a channel's entries (a flatten's too) are one row here
                mask = masks[name].movedim(dim, 0).reshape(cls.size, -1)
                kept |= mask.any(dim=1).view(-1, cls.step).any(dim=1)
        out.append(kept)
    return tuple(out)


def selection(plan: ChannelPlan, masks: Mapping[str, Tensor]) -> Selection:
    """The channels of every class the sub-model of structured `masks` keeps, for
    `agent.learning.width` to cut it out."""
    kept = kept_blocks(plan, masks)
    return tuple(torch.nonzero(_channels(plan, i, k)).flatten() for i, k in enumerate(kept))


def density(plan: ChannelPlan, counts: Sequence[float]) -> float:
    """The prunable density when class i keeps counts[i] of its blocks (any such blocks:
    every block of a class has as many weights)."""
    total = kept = 0.0
    for name, shape in plan.shapes.items():
        size = math.prod(shape)
        share = math.prod(counts[s.cls] / plan.blocks(s.cls) for s in plan.slots[name])
        total += size
        kept += size * share
    return kept / total if total else 1.0


def _largest_fraction(plan: ChannelPlan, of: Sequence[int], target: float) -> tuple[int, ...]:
    """Per class, max(1, round(s x of[i])) blocks, for the largest s in (0, 1] whose density
    is at most `target` (the smallest s when none is)."""

    def counts(s: float) -> tuple[int, ...]:
        return tuple(max(1, round(s * n)) for n in of)

    if density(plan, counts(1.0)) <= target:
        return counts(1.0)
    low, high = 0.0, 1.0
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (middle, high) if density(plan, counts(middle)) <= target else (low, middle)
    return counts(low)


def random_masks(plan: ChannelPlan, target: float, generator: torch.Generator) -> Masks:
    """An agent's initial structured masks (1.1, module docstring): every class keeps the
    same fraction of its blocks, drawn at random, at the largest density at most `target`."""
    if not 0 < target <= 1:
        raise ValueError(f"density must be in (0, 1], got {target}")
    counts = _largest_fraction(plan, [plan.blocks(i) for i in range(len(plan.classes))], target)
    kept = []
    for index, count in enumerate(counts):
        blocks = torch.zeros(plan.blocks(index), dtype=torch.bool)
        blocks[torch.randperm(plan.blocks(index), generator=generator)[:count]] = True
        kept.append(blocks)
    return masks_of(plan, tuple(kept))


# ----------------------------------------------------------------------- scores of blocks


def _per_block(plan: ChannelPlan, cls: int, squares: Tensor, dim: int) -> Tensor:
    """A tensor's squared entries summed per block of class `cls` along `dim`."""
    c = plan.classes[cls]
    return squares.movedim(dim, 0).reshape(c.size, -1).sum(dim=1).view(-1, c.step).sum(dim=1)


def weight_norms(plan: ChannelPlan, weights: Mapping[str, Tensor]) -> list[Tensor]:
    """Per class, each block's squared norm over every kept weight that writes or reads it
    (the weights are masked, so only kept ones count)."""
    out = [torch.zeros(plan.blocks(i), dtype=torch.float64) for i in range(len(plan.classes))]
    for name, slots in plan.slots.items():
        squares = weights[name].detach().double().square()
        for slot in slots:
            out[slot.cls] += _per_block(plan, slot.cls, squares, slot.dim)
    return out


def growth_norms(plan: ChannelPlan, grads: Mapping[str, Tensor], kept: Kept) -> list[Tensor]:
    """Per class, each block's squared gradient norm over the weights that would read it were
    it kept: a reading dim (not dim 0) of a prunable tensor, on the entries every other
    class of the tensor keeps."""
    out = [torch.zeros(plan.blocks(i), dtype=torch.float64) for i in range(len(plan.classes))]
    for name, slots in plan.slots.items():
        for slot in slots:
            if slot.dim == 0:
                continue
            others = _tensor_mask(plan, name, kept, skip=slot.cls)
            squares = torch.where(others, grads[name].double().square(), 0.0)
            out[slot.cls] += _per_block(plan, slot.cls, squares, slot.dim)
    return out


def _writers(plan: ChannelPlan, name: str, kept: Kept) -> Tensor | None:
    """Where tensor `name`'s dim 0 (the channels it writes) is a class: True on the rows of
    channels not in `kept`; None when its dim 0 is no class."""
    for slot in plan.slots[name]:
        if slot.dim == 0:
            dropped = ~_channels(plan, slot.cls, kept[slot.cls])
            return _along(dropped.repeat_interleave(slot.expansion), 0, len(plan.shapes[name]))
    return None


def revived(
    plan: ChannelPlan,
    weights: Mapping[str, Tensor],
    initial: Mapping[str, Tensor],
    masks: Mapping[str, Tensor],
) -> State:
    """`weights` with every dropped channel's incoming weights from kept channels at their
    initial values `initial`: the model's output is unchanged (every weight that reads a
    dropped channel stays zero), and the gradients on those readers say what each dropped
    neuron, regrown, would be worth (module docstring)."""
    kept = kept_blocks(plan, masks)
    out = dict(weights)
    for name in plan.shapes:
        rows = _writers(plan, name, kept)
        if rows is None:
            continue
        fill = rows & _tensor_mask(plan, name, kept, skip=_dim0_class(plan, name))
        out[name] = torch.where(fill, initial[name], weights[name])
    return out


def _dim0_class(plan: ChannelPlan, name: str) -> int | None:
    return next((slot.cls for slot in plan.slots[name] if slot.dim == 0), None)


# ------------------------------------------------------------------------ the mask updates


def _regrown(
    plan: ChannelPlan,
    weights: Mapping[str, Tensor],
    initial: Mapping[str, Tensor],
    old: Kept,
    new: Kept,
) -> tuple[State, Masks]:
    """Weights and masks for the blocks `new` keeps: newly kept weights (of a regrown channel,
    or connecting one) start at their initial values, dropped ones are zero."""
    masks = masks_of(plan, new)
    out = dict(weights)
    for name, mask in masks.items():
        fresh = mask & ~_tensor_mask(plan, name, old)
        value = torch.where(fresh, initial[name], weights[name])
        out[name] = torch.where(mask, value, torch.zeros_like(value))
    return out, masks


def rigl_update(
    plan: ChannelPlan,
    weights: Mapping[str, Tensor],
    masks: Mapping[str, Tensor],
    grads: Mapping[str, Tensor],
    initial: Mapping[str, Tensor],
    alpha: float,
) -> tuple[State, Masks]:
    """RigL over blocks (1.6, module docstring): returns the new weights and masks.

    `grads` are the dense gradients taken at `revived(weights)`. Per class with n kept
    blocks of B: drop k = min(floor(alpha n), B - n) kept blocks of smallest weight norm,
    regrow the k dropped blocks (not those just dropped) of largest growth norm; ties go
    to the lower block index on both sides. Floor, not 1.6's ceil: a class of five kept
    blocks would otherwise swap a fifth of its neurons every round (module docstring).
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    old = kept_blocks(plan, masks)
    norms = weight_norms(plan, weights)
    growth = growth_norms(plan, grads, old)
    new = []
    for index, kept in enumerate(old):
        n = int(kept.sum())
        k = min(_floor(alpha * n), kept.numel() - n)
        changed = kept.clone()
        if k > 0:
            changed[smallest_active(norms[index], kept, k)] = False
            score = torch.where(kept, -math.inf, growth[index])
            changed[torch.sort(score, descending=True, stable=True).indices[:k]] = True
        new.append(changed)
    return _regrown(plan, weights, initial, old, tuple(new))


def _drop_smallest(kept: Kept, norms: Sequence[Tensor], counts: Sequence[int]) -> Kept:
    """Each class's kept blocks without its `counts[i]` of smallest norm."""
    out = []
    for blocks, norm, count in zip(kept, norms, counts, strict=True):
        blocks = blocks.clone()
        blocks[smallest_active(norm, blocks, count)] = False
        out.append(blocks)
    return tuple(out)


def _trimmed(plan: ChannelPlan, kept: Kept, drops: list[int], floor: float) -> list[int]:
    """`drops` cut, one block at a time from the largest, until the density after them is at
    least `floor` (s*'s: further pruning never passes the target sparsity)."""
    left = [int(k.sum()) for k in kept]
    drops = list(drops)
    while any(drops) and density(plan, [n - d for n, d in zip(left, drops, strict=True)]) < floor:
        largest = max(range(len(drops)), key=lambda i: (drops[i], -i))
        drops[largest] -= 1
    return drops


def pqi_prune(
    plan: ChannelPlan,
    weights: Mapping[str, Tensor],
    masks: Mapping[str, Tensor],
    pqi_count: Callable[[Tensor], int],
    target_sparsity: float,
) -> Masks:
    """PQI further pruning over blocks (1.9, module docstring): `pqi_count(norms)` says how
    many of a class's kept blocks to drop (at least one stays), trimmed so the sparsity
    stays at most `target_sparsity`."""
    kept = kept_blocks(plan, masks)
    norms = weight_norms(plan, weights)
    drops = []
    for blocks, norm in zip(kept, norms, strict=True):
        active = norm[blocks].sqrt()
        drops.append(min(pqi_count(active), max(int(blocks.sum()) - 1, 0)))
    drops = _trimmed(plan, kept, drops, 1.0 - target_sparsity)
    return masks_of(plan, _drop_smallest(kept, norms, drops))


def pqi_counter(
    p: float, q: float, eta_c: float, gamma: float, beta: float
) -> Callable[[Tensor], int]:
    """`pqi.pqi_prune_count` with the run's PQI settings, for `pqi_prune`."""
    return lambda x: pqi_prune_count(x, p=p, q=q, eta_c=eta_c, gamma=gamma, beta=beta)


def prune_to_density(
    plan: ChannelPlan, weights: Mapping[str, Tensor], masks: Mapping[str, Tensor], cap: float
) -> Masks:
    """Structured masks at a density of at most `cap` (the budget's cap; at least one block a
    class): every class keeps the same fraction of its kept blocks, those of largest norm.
    The masks unchanged when they are within the cap already."""
    kept = kept_blocks(plan, masks)
    left = [int(k.sum()) for k in kept]
    if density(plan, left) <= cap:
        return {name: mask.clone() for name, mask in masks.items()}
    counts = _largest_fraction(plan, left, cap)
    norms = weight_norms(plan, weights)
    return masks_of(
        plan, _drop_smallest(kept, norms, [n - c for n, c in zip(left, counts, strict=True)])
    )
