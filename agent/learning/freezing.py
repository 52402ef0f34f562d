"""FedSPU neuron freezing (ALGORITHMS.md section 2) and the federated-dropout baseline.

Each round an agent trains only a random fraction p of every hidden layer's neurons (output
units or channels); the rest are frozen: they still take part in the forward pass but keep
their personal values bit for bit. Only the active part is exchanged, and the aggregator
averages each element over the agents that had it active.

Which units can be frozen is read from the model's dataflow with ``torch.fx``
(`freezing_plan`), so a user's own module is handled like the bundled ones; a model where no
unit can be mapped onto its weights freezes whole layers instead, and the plan says so.

Pure functions over state dicts and bool masks (True = active: trained and exchanged), like
``sparse``: random draws take an explicit ``torch.Generator``, inputs are never modified,
and aggregation visits agents in sorted-id order in float64.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from agent.learning import ldf
from agent.learning.neuron_groups import NeuronGroup, neuron_groups
from agent.learning.sparse import Masks, State, _floor, apply_masks, averaged

__all__ = [
    "FreezingPlan",
    "NeuronGroup",
    "active_masks",
    "active_unit_count",
    "aggregate_active",
    "freezing_plan",
    "neuron_groups",
    "overwrite_active",
    "submodel",
]

_NO_GROUPS = (
    "no conv/linear layer's outputs reach a single next conv/linear layer "
    "through per-channel operations alone"
)


@dataclass(frozen=True)
class FreezingPlan:
    """What FedSPU freezes in one model: inferred once (`freezing_plan`), drawn from every
    round (`active_masks`).

    `groups` are the neuron groups of the paper's rule. A model without any freezes whole
    `layers` instead: (layer name, its state-dict names) of every layer but the last in
    module order (the output layer of a model that registers its modules in forward order),
    which stays always active like the class neurons. `note` is one sentence saying so (None
    when the groups were found), for the caller to say once.
    """

    groups: tuple[NeuronGroup, ...] = ()
    layers: tuple[tuple[str, tuple[str, ...]], ...] = ()
    note: str | None = None


def freezing_plan(model: nn.Module, input_shape: Sequence[int] | None = None) -> FreezingPlan:
    """The neuron groups of `model` (`neuron_groups`), or when it has none, or cannot be
    traced or run, whole layers (``ldf.layer_groups``, the last one always active) with a
    note giving the reason.

    Pass the sample's `input_shape` (no batch dimension): with it, shapes come from one
    forward pass, which finds groups that depend on them (a linear layer applied to 2-D
    input followed by BatchNorm1d, a reshape that is a flatten) and reads flatten expansions
    exactly.
    """
    try:
        groups = neuron_groups(model, input_shape)
        reason = _NO_GROUPS
    except ValueError as err:
        groups, reason = [], str(err)
    if groups:
        return FreezingPlan(groups=tuple(groups))
    layers = [(name, tuple(names)) for name, names in ldf.layer_groups(model).items()]
    return FreezingPlan(
        layers=tuple(layers[:-1]),
        note=f"model has no neuron groups FedSPU can infer ({reason}); "
        "freezing whole layers instead",
    )


def active_unit_count(size: int, fraction: float) -> int:
    """max(1, floor(fraction * size)) (ALGORITHMS.md 2), with sparse's float slack so that
    0.29 * 100 counts as 29."""
    return max(1, _floor(fraction * size))


def _along(mask: torch.Tensor, dim: int, ndim: int) -> torch.Tensor:
    """A 1-D mask shaped to broadcast along `dim` of an `ndim`-D tensor."""
    shape = [1] * ndim
    shape[dim] = -1
    return mask.view(shape)


def _as_plan(plan: FreezingPlan | nn.Module | Sequence[NeuronGroup]) -> FreezingPlan:
    if isinstance(plan, FreezingPlan):
        return plan
    if isinstance(plan, nn.Module):
        return freezing_plan(plan)
    return FreezingPlan(groups=tuple(plan))


def active_masks(
    plan: FreezingPlan | nn.Module | Sequence[NeuronGroup],
    state: State,
    fraction: float,
    generator: torch.Generator,
) -> Masks:
    """This round's active masks: one bool tensor per tensor of `state`, True = trained and
    exchanged.

    `plan` is a `freezing_plan` (what callers should pass: inferred once, with the input
    shape), a list of neuron groups, or a model (its plan is inferred here, without shapes).

    Per group, in the given (forward) order, a uniform random subset of
    `active_unit_count(n_l, fraction)` units is drawn with ``torch.randperm``, so the masks
    depend only on (groups, fraction, generator state). A weight entry is active only when
    both neurons it connects are active: its row's unit and, where its input is a group, its
    column's unit. Biases, norm parameters and running statistics follow their channel.
    Tensors no group touches (input side of the first layer, class neurons, residual-stream
    channels, BatchNorm's ``num_batches_tracked``) are fully active; group tensors absent
    from `state` are skipped. A whole-layer plan draws its layers (`_mask_layers`).
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    plan = _as_plan(plan)
    masks = {name: torch.ones_like(t, dtype=torch.bool) for name, t in state.items()}
    for group in plan.groups:
        units = torch.zeros(group.size, dtype=torch.bool)
        chosen = torch.randperm(group.size, generator=generator)
        units[chosen[: active_unit_count(group.size, fraction)]] = True
        for name in group.unit_params:
            if name in masks:
                masks[name] &= _along(units, 0, masks[name].dim())
        if group.consumer in masks:
            columns = units.repeat_interleave(group.expansion)
            masks[group.consumer] &= _along(columns, 1, masks[group.consumer].dim())
    if plan.layers:
        _mask_layers(masks, plan.layers, fraction, generator)
    return masks


def _mask_layers(
    masks: dict[str, torch.Tensor],
    layers: Sequence[tuple[str, Sequence[str]]],
    fraction: float,
    generator: torch.Generator,
) -> None:
    """Whole-layer freezing: floor(fraction * n + u) of the n layers active, u uniform in
    [0, 1) and the layers a uniform random subset, so each layer trains in a fraction
    `fraction` of the rounds on average. A model with one or two freezable layers (a GRU and
    its head) would otherwise never freeze them (max(1, floor)) or never train them
    (floor). Frozen layers' masks are all False, in place."""
    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    count = min(len(layers), math.floor(fraction * len(layers) + u))
    chosen = set(torch.randperm(len(layers), generator=generator)[:count].tolist())
    for index, (_, names) in enumerate(layers):
        if index not in chosen:
            for name in names:
                if name in masks:
                    masks[name] = torch.zeros_like(masks[name])


def overwrite_active(personal: State, global_: State, active: Masks) -> State:
    """The model an agent trains from: global values where active, its personal values
    (kept from earlier rounds) where frozen. New tensors; the inputs are untouched."""
    return {name: torch.where(active[name], global_[name], t) for name, t in personal.items()}


def aggregate_active(
    previous: State,
    updates: Mapping[str, tuple[State, Masks]],
    weights: Mapping[str, float],
) -> State:
    """Per element, the weighted mean over the agents that had it active (weights = sample
    counts); an element nobody trained keeps `previous`'s value exactly.

    `updates` maps agent id -> (state, active masks); values at an agent's inactive positions
    are ignored, whatever they are. Agents are summed in sorted-id order in float64 (as
    ``sparse.aggregate_weighted``, which this equals bit for bit when every mask is all True
    and the weights are integers), so arrival order never changes the result. Each result
    tensor has `previous`'s dtype. Integer entries (BatchNorm's ``num_batches_tracked``) are
    copied, as ``sparse`` does: from the first agent by id that had them active.
    """
    ids = sorted(updates)
    if any(weights[i] < 0 for i in ids):
        raise ValueError("weights must be non-negative")
    out: State = {}
    for name, old in previous.items():
        if not averaged(old):
            kept = old.clone()
            for i in reversed(ids):  # the first agent by id wins
                state, mask = updates[i]
                kept = torch.where(mask[name], state[name].to(old.dtype), kept)
            out[name] = kept
            continue
        total = torch.zeros(old.shape, dtype=torch.float64)
        weight = torch.zeros(old.shape, dtype=torch.float64)
        for i in ids:
            state, mask = updates[i]
            active = mask[name]
            total += torch.where(active, state[name].to(torch.float64) * weights[i], 0.0)
            weight += active.to(torch.float64) * weights[i]
        # 0 / 0 = nan where nobody trained the element; `where` keeps the old value there.
        out[name] = torch.where(weight > 0, (total / weight).to(old.dtype), old)
    return out


def submodel(state: State, active: Masks) -> State:
    """Federated dropout's sub-model: inactive entries set to +0.0 (new tensors).

    Training it with ``train_local(..., masks=active)`` is the dropout baseline. A dropped
    conv channel outputs exactly 0 after GroupNorm only because its norm weight and bias are
    masked too: GroupNorm maps the zero channel to (0 - mean) / std * gamma + beta, which is 0
    only for gamma = beta = 0. It still counts in its group's mean and variance, so the kept
    channels differ slightly from those of a truly narrower network.
    """
    return apply_masks(state, active)
