"""Layer-window training: a budgeted round trains a contiguous window of layers only.

Layers before the window are frozen without a backward pass (their parameters do not
require gradients, so autograd records nothing until the window and keeps none of their
activations: TinyTL's frozen prefix, which is what saves time and memory). Layers after it
are frozen too but pass gradients back to the window, without computing their own weights'
gradients. A window that ends at the output layer is plain prefix freezing, the cheapest
window of its size; windows nearer the input cost more, since the gradient must come back
through every layer after them.

Windows rotate over rounds (`round_window`) among those whose measured cost fits the
budget, so every layer that some window of the budget can reach trains; which ones fit is
measured (`agent.device.calibration`), not counted. The layers are those of
``ldf.layer_groups`` (a weight with its bias and norm) in the order the forward pass calls
them, read once with hooks, so a user's module whose attributes are registered out of
order is cut where its data actually flows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from agent.learning import ldf
from agent.learning.models import flops_from_positions, output_positions


@dataclass(frozen=True)
class Layer:
    """One trainable layer: its module name, its state-dict tensors and its forward FLOPs
    per sample (0 for a layer without a conv/linear weight, such as a lone norm)."""

    name: str
    tensors: tuple[str, ...]
    flops: int


Window = tuple[int, int]
"""Layers [start, stop) of `forward_layers` that train; the others are frozen."""


def _call_order(model: nn.Module, input_shape: Sequence[int]) -> dict[str, int]:
    """Module name -> the position of its first call in one forward pass of a zero sample."""
    order: dict[str, int] = {}
    handles = []
    for name, module in model.named_modules():

        def record(_module: nn.Module, _inputs: object, name: str = name) -> None:
            order.setdefault(name, len(order))

        handles.append(module.register_forward_pre_hook(record))
    was_training = model.training
    try:
        model.eval()
        parameter = next(model.parameters(), None)
        device = parameter.device if parameter is not None else torch.device("cpu")
        with torch.no_grad():
            model(torch.zeros(1, *input_shape, device=device))
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return order


def forward_layers(model: nn.Module, input_shape: Sequence[int]) -> tuple[Layer, ...]:
    """The model's layers (``ldf.layer_groups``) in forward order, each with its forward
    FLOPs per sample. A layer the probe pass never called keeps its module-order place after
    the called ones (it is never on the data's path, so where it sits changes no window's
    cost)."""
    groups = ldf.layer_groups(model)
    order = _call_order(model, input_shape)
    positions = output_positions(model, tuple(input_shape))
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    weight_shapes = {n: shapes[n] for n in positions}
    layers = []
    for name, tensors in groups.items():
        weighted = {n: positions[n] for n in tensors if n in positions}
        flops = flops_from_positions(weighted, {n: weight_shapes[n] for n in weighted})
        layers.append(Layer(name, tuple(tensors), flops if weighted else 0))
    unseen = len(order)
    ranked = sorted(enumerate(layers), key=lambda item: (order.get(item[1].name, unseen), item[0]))
    return tuple(layer for _, layer in ranked)


def windows(layers: Sequence[Layer], level: float) -> list[Window]:
    """The layers split into consecutive windows of about `level` of the forward FLOPs each,
    cut from the output backwards, so the last window is the suffix a frozen prefix leaves.

    A window takes layers while it stays within level x total FLOPs, and always at least
    one weighted layer; FLOP-free layers (lone norms) go with the window after them.
    """
    if not 0 < level <= 1:
        raise ValueError(f"level must be in (0, 1], got {level}")
    total = sum(layer.flops for layer in layers) or 1
    cuts: list[Window] = []
    stop = len(layers)
    while stop > 0:
        start, mass = stop, 0
        while start > 0:
            flops = layers[start - 1].flops
            weighted = any(layer.flops for layer in layers[start:stop])
            if weighted and flops and mass + flops > level * total:
                break
            mass += flops
            start -= 1
        cuts.append((start, stop))
        stop = start
    return cuts[::-1]


def trained_names(layers: Sequence[Layer], window: Window) -> set[str]:
    """The state-dict names a round with `window` trains."""
    return {name for layer in layers[window[0] : window[1]] for name in layer.tensors}


def window_flops(layers: Sequence[Layer], window: Window) -> int:
    """Counted training FLOPs per sample of a window round (1.10's convention of a backward
    pass twice the forward): the forward pass through every layer, the input-gradient pass
    back through the layers after the window's first one, and the weight-gradient pass of
    the window's layers."""
    start, stop = window
    forward = sum(layer.flops for layer in layers)
    back = sum(layer.flops for layer in layers[start + 1 :])
    weights = sum(layer.flops for layer in layers[start:stop])
    return forward + back + weights


def round_window(fitting: Sequence[Window], round_: int) -> Window:
    """The window of round `round_` among those that fit the budget: they take turns, so
    over len(fitting) rounds each trains once."""
    if not fitting:
        raise ValueError("no window fits")
    return fitting[round_ % len(fitting)]
