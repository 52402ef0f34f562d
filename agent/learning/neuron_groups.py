"""Which neurons of a model FedSPU can freeze (ALGORITHMS.md section 2), read from the model's
dataflow with ``torch.fx``, so a user's own module is handled like the bundled ones.

A conv/linear layer's output units form a group when its output reaches exactly one next
conv/linear layer through per-channel operations alone (`neuron_groups`); freezing a unit
then means freezing its row, its per-channel entries on the way and the next layer's columns
that read it. `agent.learning.freezing` draws the active units from these groups each round.
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata
from torch.nn import functional as F

# The layers whose output units can form a group: one weight row (and bias entry) per unit.
_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Linear)

# Operations that map each element to one element at the same place, so a unit's values stay
# its own: activations, dropout, arithmetic with a constant.
_ELEMENTWISE_MODULES = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.ELU,
    nn.SELU,
    nn.CELU,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Sigmoid,
    nn.Tanh,
    nn.Hardtanh,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Softplus,
    nn.Softsign,
    nn.LogSigmoid,
    nn.Identity,
    nn.Dropout,
    nn.AlphaDropout,
)
_ELEMENTWISE_FUNCTIONS: frozenset[Any] = frozenset(
    (
        torch.relu,
        torch.relu_,
        torch.sigmoid,
        torch.tanh,
        F.relu,
        F.relu_,
        F.relu6,
        F.leaky_relu,
        F.elu,
        F.selu,
        F.celu,
        F.gelu,
        F.silu,
        F.mish,
        F.hardswish,
        F.hardsigmoid,
        F.hardtanh,
        F.softplus,
        F.softsign,
        F.logsigmoid,
        F.sigmoid,
        F.tanh,
        F.dropout,
        F.alpha_dropout,
        operator.neg,
    )
)
_ELEMENTWISE_METHODS = frozenset(
    {"relu", "relu_", "sigmoid", "sigmoid_", "tanh", "tanh_", "contiguous", "clone"}
)
_SCALAR_ARITHMETIC: frozenset[Any] = frozenset(
    {operator.add, operator.sub, operator.mul, operator.truediv}
)
# Operations along the positions of each channel on its own (pooling, resampling, channel
# dropout): channel c of the output is computed from channel c of the input only.
_SPATIAL_MODULES = (
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Upsample,
)
_SPATIAL_FUNCTIONS: frozenset[Any] = frozenset(
    (
        F.max_pool1d,
        F.max_pool2d,
        F.avg_pool1d,
        F.avg_pool2d,
        F.adaptive_avg_pool1d,
        F.adaptive_avg_pool2d,
        F.adaptive_max_pool1d,
        F.adaptive_max_pool2d,
        torch.max_pool1d,
        torch.max_pool2d,
        torch.avg_pool1d,
        torch.adaptive_avg_pool1d,
        F.dropout1d,
        F.dropout2d,
        F.interpolate,
    )
)
# Reductions over positions (global pooling written as ``x.mean((2, 3))``).
_REDUCTIONS = frozenset({"mean", "sum", "amax", "amin"})
_REDUCTION_FUNCTIONS: frozenset[Any] = frozenset({torch.mean, torch.sum, torch.amax, torch.amin})
# A norm's per-channel tensors, which follow the unit they normalize.
_NORM_TENSORS = ("weight", "bias", "running_mean", "running_var")
# What the tracer is told about a value that is not data: its shape, size or type.
_METADATA_METHODS = frozenset({"size", "dim"})
_METADATA_ATTRIBUTES = frozenset({"shape", "ndim", "dtype", "device"})


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
    graph = _traced(model, input_shape)
    return _Dataflow(model, graph).groups()


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200]}" if text else type(err).__name__


def _traced(model: nn.Module, input_shape: Sequence[int] | None) -> fx.Graph:
    """The model's dataflow graph, with each value's shape for a batch of 2 samples of
    `input_shape` when one is given (2: a batch of one would hide which dim is the batch).

    The forward pass runs in eval mode without gradients, so it neither updates BatchNorm's
    running statistics nor fails on a batch too small for training statistics; every
    module's mode is restored after it.
    """
    try:
        traced = fx.symbolic_trace(model)
    except Exception as err:  # whatever stops the tracer (control flow on values, ...)
        raise ValueError(f"torch.fx cannot trace it: {_one_line(err)}") from err
    if input_shape is None:
        return traced.graph
    modes = {module: module.training for module in model.modules()}
    param = next(model.parameters(), None)
    floating = param is not None and param.is_floating_point()
    x = torch.zeros(
        (2, *input_shape),
        dtype=param.dtype if param is not None and floating else None,
        device=param.device if param is not None else None,
    )
    model.eval()
    try:
        with torch.no_grad():
            ShapeProp(traced).propagate(x)
    except Exception as err:  # the model's own error, whatever its type
        raise ValueError(
            f"it does not run on a batch of input shape {tuple(input_shape)}: {_one_line(err)}"
        ) from err
    finally:
        for module, mode in modes.items():
            module.training = mode
    return traced.graph


@dataclass(frozen=True)
class _Flow:
    """Where a producer's units are in one value on their way to the next layer.

    `dim` is the unit axis (-1: the last one, for a value of unknown rank) and `rank` the
    value's number of dims, batch included (None: unknown, no shapes were given). After a
    flatten each unit covers `expansion` consecutive features (None: not known yet, taken
    from the consumer's width). `tensors` are the unit's tensors so far and `passed` the
    depthwise convs the units went through (they are claimed by this group).
    """

    dim: int
    rank: int | None
    tensors: tuple[str, ...]
    expansion: int | None = 1
    passed: tuple[str, ...] = ()

    @property
    def channel(self) -> bool:
        """Units along dim 1, each one feature or channel (what a norm or a conv reads)."""
        return self.rank is not None and self.dim == 1 and self.expansion == 1

    @property
    def spatial(self) -> bool:
        """Channels along dim 1 with positions after them (what pooling acts on)."""
        return self.channel and cast(int, self.rank) >= 3

    @property
    def last(self) -> bool:
        """Units along the last dim (what a linear layer reads)."""
        return self.dim == -1 if self.rank is None else self.dim == self.rank - 1


_Consumer = tuple[str, int]
"""The consumer's weight name and the expansion it reads each unit with."""


def _shape(node: fx.Node) -> tuple[int, ...] | None:
    meta = node.meta.get("tensor_meta")
    return tuple(meta.shape) if isinstance(meta, TensorMetadata) else None


def _arg(node: fx.Node, index: int, name: str, default: object) -> object:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _is_metadata(node: fx.Node) -> bool:
    """Whether `node` reads only a value's shape or type (``x.size(0)``, ``x.shape[1]``),
    which is no use of its data."""
    if node.op == "call_method":
        return node.target in _METADATA_METHODS
    if node.op == "call_function" and node.target is getattr:
        return node.args[1] in _METADATA_ATTRIBUTES
    if node.op == "call_function" and node.target is operator.getitem:
        source = node.args[0]
        return isinstance(source, fx.Node) and _is_metadata(source)
    return False


def _sole_user(value: fx.Node) -> fx.Node | None:
    """The one operation that uses `value`'s data, None when several (or none) do."""
    users = [user for user in value.users if not _is_metadata(user)]
    return users[0] if len(users) == 1 else None


def _reads_only(user: fx.Node, value: fx.Node) -> bool:
    """Whether `user` takes `value` as its first argument and no other data."""
    first = user.args[0] if user.args else None
    return first is value and all(n is value or _is_metadata(n) for n in user.all_input_nodes)


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


def _flattened(flow: _Flow, start: object, end: object, value: fx.Node) -> _Flow | None:
    """The units after ``flatten(1)``: channel c becomes features c * P .. c * P + P - 1 for
    P positions per channel (channel-major). Any other flatten mixes units and batch."""
    if flow.rank is None or flow.dim != 1 or flow.expansion != 1:
        return None
    if start != 1 or end not in (-1, flow.rank - 1):
        return None
    if flow.rank == 2:
        return flow
    shape = _shape(value)
    return replace(flow, rank=2, expansion=math.prod(shape[2:]) if shape else None)


def _reshaped(flow: _Flow, value: fx.Node, user: fx.Node) -> _Flow | None:
    """A view or reshape: kept when it is a no-op or exactly ``flatten(1)`` (such as
    ``x.view(x.size(0), -1)``), which only the shapes can tell."""
    before, after = _shape(value), _shape(user)
    if before is None or after is None or flow.rank is None:
        return None
    if after == before:
        return flow
    if flow.spatial and after == (before[0], math.prod(before[1:])):
        return replace(flow, rank=2, expansion=math.prod(before[2:]))
    return None


def _pooled_rank(spatial: bool, rank: int, user: fx.Node) -> int | None:
    """The rank after `user`, a mean, sum, max or min, when it reduces over positions only
    (global pooling, which keeps each channel) of channels along dim 1 with positions
    after them (`spatial`); None for any other reduction. FedSPU's groups and the width
    reduction's channel classes follow channels through pooling by this one rule."""
    dims, keepdim = _arg(user, 1, "dim", None), _arg(user, 2, "keepdim", False)
    if isinstance(dims, int):
        dims = (dims,)
    if not spatial or not isinstance(dims, tuple | list) or not isinstance(keepdim, bool):
        return None
    if not dims or not all(isinstance(d, int) and -rank <= d < rank for d in dims):
        return None
    axes = {cast(int, d) % rank for d in dims}
    if min(axes) < 2:
        return None
    return rank if keepdim else rank - len(axes)


def _reduced(flow: _Flow, user: fx.Node) -> _Flow | None:
    """A mean, sum, max or min over positions only (global pooling) keeps each channel."""
    rank = _pooled_rank(flow.spatial, cast(int, flow.rank), user)
    return None if rank is None else replace(flow, rank=rank)


def _function_step(flow: _Flow, value: fx.Node, user: fx.Node) -> _Flow | None:
    target = user.target
    if target in _ELEMENTWISE_FUNCTIONS:
        return flow
    if target in _SPATIAL_FUNCTIONS:
        return flow if flow.spatial else None
    if target is torch.flatten:
        return _flattened(flow, _arg(user, 1, "start_dim", 0), _arg(user, 2, "end_dim", -1), value)
    if target in _REDUCTION_FUNCTIONS:
        return _reduced(flow, user)
    return None


def _method_step(flow: _Flow, value: fx.Node, user: fx.Node) -> _Flow | None:
    target = user.target
    if target in _ELEMENTWISE_METHODS:
        return flow
    if target == "flatten":
        return _flattened(flow, _arg(user, 1, "start_dim", 0), _arg(user, 2, "end_dim", -1), value)
    if target in ("view", "reshape"):
        return _reshaped(flow, value, user)
    if target in _REDUCTIONS:
        return _reduced(flow, user)
    return None


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
    shape = _shape(node)
    if isinstance(layer, nn.Linear):
        return _Flow(len(shape) - 1 if shape else -1, len(shape) if shape else None, tensors)
    return _Flow(1, len(shape) if shape else 3 if isinstance(layer, nn.Conv1d) else 4, tensors)


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
            user = _sole_user(value)
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
        if not _reads_only(user, value):
            return None
        if user.op == "call_module":
            return self._module_step(flow, value, user, producer, size)
        if user.op == "call_function":
            return _function_step(flow, value, user)
        if user.op == "call_method":
            return _method_step(flow, value, user)
        return None  # the model's output

    def _module_step(
        self, flow: _Flow, value: fx.Node, user: fx.Node, producer: str, size: int
    ) -> _Flow | _Consumer | None:
        name = cast(str, user.target)
        module = self.modules[name]
        if isinstance(module, _ELEMENTWISE_MODULES):
            return flow
        if isinstance(module, _SPATIAL_MODULES):
            return flow if flow.spatial else None
        if isinstance(module, nn.Flatten):
            return _flattened(flow, module.start_dim, module.end_dim, value)
        if isinstance(module, _LAYERS):
            return self._layer_step(flow, name, module, producer, size)
        if _normalizes_units(module, flow, size):
            tensors = self._tensors(name, _NORM_TENSORS)
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
