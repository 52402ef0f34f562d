"""FedSPU neuron freezing (ALGORITHMS.md section 2) and the federated-dropout baseline.

Each round an agent trains only a random fraction p of every hidden layer's neurons (output
units or channels); the rest are frozen: they still take part in the forward pass but keep
their personal values bit for bit. Only the active part is exchanged, and the aggregator
averages each element over the agents that had it active.

Pure functions over state dicts and bool masks (True = active: trained and exchanged), like
``sparse``: random draws take an explicit ``torch.Generator``, inputs are never modified,
and aggregation visits agents in sorted-id order in float64.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from agent.learning.models import PRUNABLE_TYPES, BasicBlock
from agent.learning.sparse import Masks, State, _floor, apply_masks

# Modules that act on each channel (or feature) on its own, so a unit's identity passes
# through them unchanged from its producing layer to the next conv/linear layer.
_CHANNELWISE = (
    nn.ReLU,
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.Dropout,
    nn.Flatten,
)


@dataclass(frozen=True)
class NeuronGroup:
    """The freezable units of one hidden layer.

    `name` is the producing layer's module name and `size` its n_l output units. Unit u owns
    index u along dim 0 of every tensor in `unit_params`: the layer's weight rows and bias, and
    the affine weight and bias of the GroupNorm that normalizes its output. `consumer` is the
    next layer's weight, whose dim-1 entries u * expansion .. (u + 1) * expansion - 1 read unit
    u: `expansion` is 1 between layers of the same kind and the number of positions per channel
    at a conv -> linear flatten (channel-major, as ``flatten(1)`` lays them out).
    """

    name: str
    size: int
    unit_params: tuple[str, ...]
    consumer: str
    expansion: int = 1


def _out_units(layer: nn.Module) -> int:
    return layer.out_features if isinstance(layer, nn.Linear) else cast(int, layer.out_channels)


def _in_units(layer: nn.Module) -> int:
    return layer.in_features if isinstance(layer, nn.Linear) else cast(int, layer.in_channels)


def _param_names(*modules: tuple[str, nn.Module] | None) -> tuple[str, ...]:
    """State-dict names of the weight and bias of each (name, module) that has them."""
    return tuple(
        f"{name}.{kind}"
        for name, module in filter(None, modules)
        for kind in ("weight", "bias")
        if getattr(module, kind, None) is not None
    )


def _units_in_order(model: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """Leaf modules in registration order, with each BasicBlock yielded whole.

    Registration order is forward order in every bundled model (Sequential stacks, then the
    classifier); the shape checks in `neuron_groups` catch a model where it is not.
    """
    for name, child in model.named_children():
        full = f"{prefix}.{name}" if prefix else name
        if isinstance(child, BasicBlock) or next(child.children(), None) is None:
            yield full, child
        else:
            yield from _units_in_order(child, full)


def _block_group(name: str, block: BasicBlock) -> NeuronGroup:
    return NeuronGroup(
        name=f"{name}.conv1",
        size=block.conv1.out_channels,
        unit_params=_param_names((f"{name}.conv1", block.conv1), (f"{name}.norm1", block.norm1)),
        consumer=f"{name}.conv2.weight",
    )


def _chain_group(
    name: str,
    layer: nn.Module,
    norm: tuple[str, nn.GroupNorm] | None,
    consumer_name: str,
    consumer: nn.Module,
) -> NeuronGroup:
    size, inputs = _out_units(layer), _in_units(consumer)
    flattens = isinstance(consumer, nn.Linear) and not isinstance(layer, nn.Linear)
    if inputs % size or (inputs != size and not flattens):
        raise ValueError(
            f"{consumer_name} reads {inputs} inputs but {name} produces {size} units: "
            "the model is not a chain of layers in registration order"
        )
    return NeuronGroup(
        name=name,
        size=size,
        unit_params=_param_names((name, layer), norm),
        consumer=f"{consumer_name}.weight",
        expansion=inputs // size,
    )


def neuron_groups(model: nn.Module) -> list[NeuronGroup]:
    """The hidden layers' units FedSPU may freeze, in forward order.

    Every conv/linear layer's output units form a group, except the final classifier's (class
    neurons are always active, ALGORITHMS.md 2). Input channels belong to no group, so they
    are always active too.

    In ResNet-18 only the ``conv1`` channels inside each BasicBlock form groups. The stem's,
    every ``conv2``'s and every shortcut's output channels are summed with the skip
    connection into the residual stream, where one channel index is shared by a whole stage:
    freezing one of them would need the same channel chosen in every layer that writes it, so
    they stay always active. A ResNet agent therefore trains more than a fraction p^2 of the
    conv weights: conv1 rows and conv2 columns at p, everything else fully.

    Raises ValueError for structures it cannot map onto channels (grouped convs, a norm that
    does not follow a conv/linear layer, unknown module types), rather than guess.
    """
    groups: list[NeuronGroup] = []
    producer: tuple[str, nn.Module] | None = None  # last layer whose outputs are unconsumed
    norm: tuple[str, nn.GroupNorm] | None = None
    for name, module in _units_in_order(model):
        if isinstance(module, BasicBlock):
            groups.append(_block_group(name, module))
            producer, norm = None, None  # block outputs are residual-stream channels
        elif isinstance(module, PRUNABLE_TYPES):
            if not isinstance(module, nn.Linear) and module.groups != 1:
                raise ValueError(f"{name}: grouped convolutions are not supported")
            if producer is not None:
                groups.append(_chain_group(*producer, norm, name, module))
            producer, norm = (name, module), None
        elif isinstance(module, nn.GroupNorm):
            if producer is None or norm is not None:
                raise ValueError(f"{name}: GroupNorm that does not follow a conv/linear layer")
            if module.num_channels != _out_units(producer[1]):
                raise ValueError(f"{name} normalizes a different channel count than {producer[0]}")
            norm = (name, module)
        elif not isinstance(module, _CHANNELWISE):
            raise ValueError(f"{name}: cannot map {type(module).__name__} onto neuron groups")
    return groups


def active_unit_count(size: int, fraction: float) -> int:
    """max(1, floor(fraction * size)) (ALGORITHMS.md 2), with sparse's float slack so that
    0.29 * 100 counts as 29."""
    return max(1, _floor(fraction * size))


def _along(mask: torch.Tensor, dim: int, ndim: int) -> torch.Tensor:
    """A 1-D mask shaped to broadcast along `dim` of an `ndim`-D tensor."""
    shape = [1] * ndim
    shape[dim] = -1
    return mask.view(shape)


def active_masks(
    model_or_groups: nn.Module | Sequence[NeuronGroup],
    state: State,
    fraction: float,
    generator: torch.Generator,
) -> Masks:
    """This round's active masks: one bool tensor per tensor of `state`, True = trained and
    exchanged.

    Per group, in the given (forward) order, a uniform random subset of
    `active_unit_count(n_l, fraction)` units is drawn with ``torch.randperm``, so the masks
    depend only on (groups, fraction, generator state). A weight entry is active only when
    both neurons it connects are active: its row's unit and, where its input is a group, its
    column's unit. Biases and norm parameters follow their channel. Tensors no group touches
    (input side of the first layer, class neurons, residual-stream channels) are fully
    active; group tensors absent from `state` are skipped.
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    groups = (
        neuron_groups(model_or_groups)
        if isinstance(model_or_groups, nn.Module)
        else model_or_groups
    )
    masks = {name: torch.ones_like(t, dtype=torch.bool) for name, t in state.items()}
    for group in groups:
        units = torch.zeros(group.size, dtype=torch.bool)
        chosen = torch.randperm(group.size, generator=generator)
        units[chosen[: active_unit_count(group.size, fraction)]] = True
        for name in group.unit_params:
            if name in masks:
                masks[name] &= _along(units, 0, masks[name].dim())
        if group.consumer in masks:
            columns = units.repeat_interleave(group.expansion)
            masks[group.consumer] &= _along(columns, 1, masks[group.consumer].dim())
    return masks


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
    tensor has `previous`'s dtype.
    """
    ids = sorted(updates)
    if any(weights[i] < 0 for i in ids):
        raise ValueError("weights must be non-negative")
    out: State = {}
    for name, old in previous.items():
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
