"""Which neurons of a model FedSPU can freeze (ALGORITHMS.md section 2), read from the model's
dataflow with ``torch.fx``, so a user's own module is handled like the bundled ones.

A conv/linear layer's output units form a group when its output reaches exactly one next
conv/linear layer through per-channel operations alone (`neuron_groups`); freezing a unit
then means freezing its row, its per-channel entries on the way and the next layer's columns
that read it. `agent.learning.freezing` draws the active units from these groups each round.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch
from torch import fx, nn

from agent.learning.fx_graph import (
    NORM_TENSORS,
    PER_UNIT_MODULES,
    Units,
    call_step,
    module_step,
    reads_only,
    shape_of,
    sole_user,
    traced,
)

# The layers whose output units can form a group: one weight row (and bias entry) per unit.
_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Linear)
# Arithmetic with a constant maps each element to one element at the same place.
_SCALAR_ARITHMETIC: frozenset[Any] = frozenset(
    {operator.add, operator.sub, operator.mul, operator.truediv}
)


@dataclass(frozen=True)
class NeuronGroup:
    """The freezable units of one hidden layer.

    `name` is the producing layer's module name and `size` its n_l output units. Unit u owns
    index u along dim 0 of every tensor in `unit_params`: the layer's weight rows and bias,
    then, in forward order, the tensors of every per-channel module its units pass through
    on the way to the next layer (a norm's affine weight and bias and BatchNorm's running
    mean and variance, a depthwise conv's filters and bias). `consumer` is the next layer's
    weight, whose dim-1 entries u * expansion .. (u + 1) * expansion - 1 read unit u:
    `expansion` is 1 between layers of the same kind and the number of positions per channel
    at a conv -> linear flatten (channel-major, as ``flatten(1)`` lays them out).
    """

    name: str
    size: int
    unit_params: tuple[str, ...]
    consumer: str
    expansion: int = 1


def neuron_groups(model: nn.Module, input_shape: Sequence[int] | None = None) -> list[NeuronGroup]:
    """The hidden layers' units FedSPU may freeze, in forward order.

    A Conv1d/Conv2d/Linear layer's output units form a group when its output reaches exactly
    one next conv/linear layer, which reads it whole (a conv with groups == 1, or a linear
    layer), only through per-channel operations: elementwise activations and dropout,
    pooling, BatchNorm/GroupNorm over its channels and LayerNorm over its features, depthwise
    convs, and one channel-major flatten. Freezing unit u then means freezing its weight row,
    bias and per-channel norm (and depthwise) entries, and the next layer's input columns
    that read u; nothing else depends on u alone. Every other use of the units leaves them
    always active: a residual add or concat (the channel index is shared with other
    layers), several consumers, any other reshape or unknown operation, or the model's
    output, which is why the class neurons never form a group. Input channels belong to no
    group either.

    In ResNet-18 this leaves only the ``conv1`` channels inside each BasicBlock as groups. The
    stem's, every ``conv2``'s and every shortcut's output channels are summed with the skip
    connection into the residual stream, where one channel index is shared by a whole stage:
    freezing one of them would need the same channel chosen in every layer that writes it, so
    they stay always active. A ResNet agent therefore trains more than a fraction p^2 of the
    conv weights: conv1 rows and conv2 columns at p, everything else fully.

    Modules from ``torch.nn`` (a GRU, say) are opaque to the tracer, and a layer called more
    than once (shared weights) belongs to no group. Without `input_shape` no forward pass is
    run and shape-dependent cases are left out (see `freezing_plan`). Raises ValueError when
    ``torch.fx`` cannot trace the model, when it does not run on a batch of `input_shape`,
    or when a consumer's width does not match (the layers do not connect).
    """
    graph = traced(model, input_shape)
    return _Dataflow(model, graph).groups()


@dataclass(frozen=True)
class _Flow(Units):
    """Where a producer's units are in one value on their way to the next layer (`Units`;
    an `expansion` not known yet is taken from the consumer's width). `tensors` are the
    unit's tensors so far and `passed` the depthwise convs the units went through (they are
    claimed by this group)."""

    tensors: tuple[str, ...] = field(kw_only=True)
    passed: tuple[str, ...] = field(default=(), kw_only=True)


_Consumer = tuple[str, int]
"""The consumer's weight name and the expansion it reads each unit with."""


def _with_scalar(user: fx.Node, value: fx.Node) -> bool:
    """Whether `user` is ``value op constant`` (or ``constant op value``)."""
    return (
        len(user.args) == 2
        and not user.kwargs
        and any(a is value for a in user.args)
        and all(
            a is value or (isinstance(a, int | float) and not isinstance(a, bool))
            for a in user.args
        )
    )


def _normalizes_units(module: nn.Module, flow: _Flow, size: int) -> bool:
    """Whether `module` is a norm whose per-channel tensors are indexed by the units."""
    if isinstance(module, nn.BatchNorm1d | nn.BatchNorm2d):
        return flow.channel and module.num_features == size
    if isinstance(module, nn.GroupNorm):
        return flow.channel and module.num_channels == size
    if isinstance(module, nn.LayerNorm):
        return flow.last and flow.expansion == 1 and tuple(module.normalized_shape) == (size,)
    return False


def _start(layer: nn.Module, node: fx.Node, tensors: tuple[str, ...]) -> _Flow:
    """Where a producer's units are in its output: the channels of a conv (dim 1), the last
    dim of a linear layer (of unknown rank without shapes)."""
    shape = shape_of(node)
    if isinstance(layer, nn.Linear):
        return _Flow(
            len(shape) - 1 if shape else -1, len(shape) if shape else None, tensors=tensors
        )
    rank = len(shape) if shape else 3 if isinstance(layer, nn.Conv1d) else 4
    return _Flow(1, rank, tensors=tensors)


class _Dataflow:
    """Follows each conv/linear layer's output through the traced graph to its consumer."""

    def __init__(self, model: nn.Module, graph: fx.Graph) -> None:
        self.modules = dict(model.named_modules())
        self.keys = set(model.state_dict())
        self.calls = Counter(n.target for n in graph.nodes if n.op == "call_module")
        self.graph = graph
        self.claimed: set[str] = set()  # depthwise convs inside an earlier group

    def groups(self) -> list[NeuronGroup]:
        """Every producer's group, in graph (forward) order."""
        out = []
        for node in self.graph.nodes:
            if node.op != "call_module" or node.target in self.claimed:
                continue
            if isinstance(self.modules[cast(str, node.target)], _LAYERS):
                group = self._follow(node)
                if group is not None:
                    out.append(group)
        return out

    def _tensors(self, name: str, kinds: Sequence[str]) -> tuple[str, ...] | None:
        """The state-dict names of a module's `kinds` of tensors; None when the module is
        called more than once (its tensors would serve several units) or a tensor is not a
        state-dict entry (a parametrized weight)."""
        if self.calls[name] != 1:
            return None
        module = self.modules[name]
        names = tuple(
            f"{name}.{k}" for k in kinds if isinstance(getattr(module, k, None), torch.Tensor)
        )
        return names if all(n in self.keys for n in names) else None

    def _follow(self, node: fx.Node) -> NeuronGroup | None:
        name = cast(str, node.target)
        layer = self.modules[name]
        tensors = self._tensors(name, ("weight", "bias"))
        if tensors is None:
            return None
        size = _out_units(layer)
        flow: _Flow | None = _start(layer, node, tensors)
        value = node
        while flow is not None:
            user = sole_user(value)
            if user is None:
                return None
            step = self._step(flow, value, user, name, size)
            if isinstance(step, tuple):
                self.claimed.update(flow.passed)
                return NeuronGroup(name, size, flow.tensors, *step)
            flow, value = step, user
        return None

    def _step(
        self, flow: _Flow, value: fx.Node, user: fx.Node, producer: str, size: int
    ) -> _Flow | _Consumer | None:
        """Where the units are after `user`, or the consumer `user` is, or None: the units
        are used in a way that is not theirs alone."""
        if user.op == "call_function" and user.target in _SCALAR_ARITHMETIC:
            return flow if _with_scalar(user, value) else None
        if not reads_only(user, value):
            return None
        if user.op == "call_module":
            return self._module_step(flow, value, user, producer, size)
        return call_step(flow, value, user, narrowing=False)  # None: the model's output

    def _module_step(
        self, flow: _Flow, value: fx.Node, user: fx.Node, producer: str, size: int
    ) -> _Flow | _Consumer | None:
        name = cast(str, user.target)
        module = self.modules[name]
        if isinstance(module, PER_UNIT_MODULES):
            return module_step(flow, value, module)
        if isinstance(module, _LAYERS):
            return self._layer_step(flow, name, module, producer, size)
        if _normalizes_units(module, flow, size):
            tensors = self._tensors(name, NORM_TENSORS)
            return None if tensors is None else replace(flow, tensors=flow.tensors + tensors)
        return None

    def _layer_step(
        self, flow: _Flow, name: str, layer: nn.Module, producer: str, size: int
    ) -> _Flow | _Consumer | None:
        """A conv/linear layer reached by the units: the consumer when it reads every unit
        in every output (groups == 1); a depthwise conv (one filter per channel) passes each
        unit on, its filter and bias joining the unit; other grouped convs end the group."""
        if isinstance(layer, nn.Linear):
            return (
                self._consumer(name, layer.in_features, producer, size, flow) if flow.last else None
            )
        conv = cast(nn.Conv1d | nn.Conv2d, layer)
        if not flow.channel:
            return None
        if conv.groups == 1:
            return self._consumer(name, conv.in_channels, producer, size, flow)
        if conv.groups == conv.in_channels == conv.out_channels == size:
            tensors = self._tensors(name, ("weight", "bias"))
            if tensors is None:
                return None
            return replace(flow, tensors=flow.tensors + tensors, passed=(*flow.passed, name))
        return None

    def _consumer(
        self, name: str, inputs: int, producer: str, size: int, flow: _Flow
    ) -> _Consumer | None:
        if self._tensors(name, ("weight",)) is None:
            return None
        expansion = flow.expansion
        if expansion is None and inputs % size == 0:
            expansion = inputs // size  # a flatten without shapes: the width tells
        if expansion is None or inputs != size * expansion:
            each = f" of {expansion} positions each" if expansion and expansion > 1 else ""
            raise ValueError(
                f"{name} reads {inputs} inputs but {producer} produces {size} units{each}: "
                "the layers do not connect"
            )
        return f"{name}.weight", expansion


def _out_units(layer: nn.Module) -> int:
    return layer.out_features if isinstance(layer, nn.Linear) else cast(int, layer.out_channels)
