"""The one ``torch.fx`` reading of a model's dataflow that FedSPU's neuron groups
(`agent.learning.neuron_groups`) and width reduction's channel classes (`agent.learning.width`)
both walk, so a layer's output units are followed through a user's model by the same rules.

`traced` gives the graph, with shapes when an input shape is known (its tracer, `_OwnTracer`,
leaves the process's other threads alone); `shape_of`,
`is_metadata`, `sole_user` and `reads_only` say what a node is and how a value is used; and
`Units` says where a layer's output units are in one value, which `module_step` and
`call_step` carry through the operations that keep each unit apart (activations, pooling,
global reductions, a channel-major flatten) and end at any other.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Any, TypeVar, cast

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata
from torch.fx.proxy import Proxy
from torch.nn import functional as F

# Operations that map each element to one element at the same place, so a unit's values stay
# its own: activations, dropout, negation.
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
# The modules `module_step` follows units through: every other module is the walker's own
# business (a layer, a norm) or ends the units.
PER_UNIT_MODULES = (*_ELEMENTWISE_MODULES, *_SPATIAL_MODULES, nn.Flatten)
# Reductions over positions (global pooling written as ``x.mean((2, 3))``).
_REDUCTIONS = frozenset({"mean", "sum", "amax", "amin"})
_REDUCTION_FUNCTIONS: frozenset[Any] = frozenset({torch.mean, torch.sum, torch.amax, torch.amin})
# A norm's per-channel tensors, which follow the unit they normalize.
NORM_TENSORS = ("weight", "bias", "running_mean", "running_var")
# What the tracer is told about a value that is not data: its shape, size or type.
_METADATA_METHODS = frozenset({"size", "dim"})
_METADATA_ATTRIBUTES = frozenset({"shape", "ndim", "dtype", "device"})


def traced(model: nn.Module, input_shape: Sequence[int] | None) -> fx.Graph:
    """The model's dataflow graph, with each value's shape for a batch of 2 samples of
    `input_shape` when one is given (2: a batch of one would hide which dim is the batch).

    The forward pass runs in eval mode without gradients, so it neither updates BatchNorm's
    running statistics nor fails on a batch too small for training statistics; every
    module's mode is restored after it. Raises ValueError, in one line, when ``torch.fx``
    cannot trace the model or it does not run on a batch of `input_shape`.
    """
    try:
        graph_module = fx.GraphModule(model, _OwnTracer().trace(model), type(model).__name__)
    except Exception as err:  # whatever stops the tracer (control flow on values, ...)
        raise ValueError(f"torch.fx cannot trace it: {_one_line(err)}") from err
    if input_shape is None:
        return graph_module.graph
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
            ShapeProp(graph_module).propagate(x)
    except Exception as err:  # the model's own error, whatever its type
        raise ValueError(
            f"it does not run on a batch of input shape {tuple(input_shape)}: {_one_line(err)}"
        ) from err
    finally:
        for module, mode in modes.items():
            module.training = mode
    return graph_module.graph


_TRACING: ContextVar[fx.Tracer | None] = ContextVar("edgefl_fx_tracing", default=None)
"""The tracer tracing in this thread (each thread has a context of its own), if any."""


class _OwnTracer(fx.Tracer):
    """``torch.fx``'s tracer, recording the calls of the thread that traces and no other.

    While it traces, torch.fx routes every module call and module attribute read of the whole
    process through the tracer: it patches ``torch.nn.Module.__call__`` and ``__getattr__``.
    Another thread's forward pass meanwhile (agents hosted in one process, agent/host.py: one
    judging its round while another traces for FedSPU's neuron groups) was taken for part of
    the traced model and died with ``NameError: module is not installed as a submodule``.
    Here a call or read from any other thread runs as it would with no trace on. Two traces
    must still not overlap (each one restores the methods it patched when it ends): the
    runtime traces in its compute slots (`agent.workload.compute_slot`), one at a time.
    """

    def trace(
        self, root: nn.Module | Callable[..., Any], concrete_args: dict[str, Any] | None = None
    ) -> fx.Graph:
        token = _TRACING.set(self)
        try:
            return super().trace(root, concrete_args)
        finally:
            _TRACING.reset(token)

    def call_module(
        self,
        m: nn.Module,
        forward: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        if _TRACING.get() is not self:  # another thread's forward pass: not this trace's
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Proxy]) -> Any:
        if _TRACING.get() is not self:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200]}" if text else type(err).__name__


def shape_of(node: fx.Node) -> tuple[int, ...] | None:
    """The shape of `node`'s value; None when it is no tensor or `traced` had no input shape."""
    meta = node.meta.get("tensor_meta")
    return tuple(meta.shape) if isinstance(meta, TensorMetadata) else None


def _arg(node: fx.Node, index: int, name: str, default: object) -> object:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def is_metadata(node: fx.Node) -> bool:
    """Whether `node` reads only a value's shape or type (``x.size(0)``, ``x.shape[1]``),
    which is no use of its data."""
    if node.op == "call_method":
        return node.target in _METADATA_METHODS
    if node.op == "call_function" and node.target is getattr:
        return node.args[1] in _METADATA_ATTRIBUTES
    if node.op == "call_function" and node.target is operator.getitem:
        source = node.args[0]
        return isinstance(source, fx.Node) and is_metadata(source)
    return False


def sole_user(value: fx.Node) -> fx.Node | None:
    """The one operation that uses `value`'s data, None when several (or none) do."""
    users = [user for user in value.users if not is_metadata(user)]
    return users[0] if len(users) == 1 else None


def reads_only(user: fx.Node, value: fx.Node) -> bool:
    """Whether `user` takes `value` as its first argument and no other data."""
    first = user.args[0] if user.args else None
    return first is value and all(n is value or is_metadata(n) for n in user.all_input_nodes)


@dataclass(frozen=True)
class Units:
    """Where a layer's output units (a conv's channels, a linear layer's features) are in one
    value on their way through the graph.

    `dim` is the unit axis (-1: the last one, for a value of unknown rank) and `rank` the
    value's number of dims, batch included (None: unknown, no shapes were given). After a
    flatten each unit covers `expansion` consecutive features (None: not known yet, for want
    of shapes). Each walker subclasses it with what it tracks along.
    """

    dim: int
    rank: int | None
    expansion: int | None = 1

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


U = TypeVar("U", bound=Units)


def module_step(units: U, value: fx.Node, module: nn.Module) -> U | None:
    """Where `units`, in `value`, are after `module`, one of `PER_UNIT_MODULES`; None when it
    mixes them (pooling across channels that are not along dim 1, another flatten)."""
    if isinstance(module, _ELEMENTWISE_MODULES):
        return units
    if isinstance(module, _SPATIAL_MODULES):
        return units if units.spatial else None
    if isinstance(module, nn.Flatten):
        return _flattened(units, module.start_dim, module.end_dim, value)
    return None


def call_step(units: U, value: fx.Node, user: fx.Node, *, narrowing: bool) -> U | None:
    """Where `units`, in `value`, are after `user`, a function or method call that reads
    `value` alone; None when it may mix them (or is no call).

    `narrowing`: the units are to be cut out of the tensors (width reduction), so a view or
    reshape that writes their count as a number (``x.view(-1, 512)``) ends them too.
    """
    if user.op == "call_function":
        return _function_step(units, value, user)
    if user.op == "call_method":
        return _method_step(units, value, user, narrowing)
    return None


def _function_step(units: U, value: fx.Node, user: fx.Node) -> U | None:
    target = user.target
    if target in _ELEMENTWISE_FUNCTIONS:
        return units
    if target in _SPATIAL_FUNCTIONS:
        return units if units.spatial else None
    if target is torch.flatten:
        return _flattened(units, _arg(user, 1, "start_dim", 0), _arg(user, 2, "end_dim", -1), value)
    if target in _REDUCTION_FUNCTIONS:
        return _reduced(units, user)
    return None


def _method_step(units: U, value: fx.Node, user: fx.Node, narrowing: bool) -> U | None:
    target = user.target
    if target in _ELEMENTWISE_METHODS:
        return units
    if target == "flatten":
        return _flattened(units, _arg(user, 1, "start_dim", 0), _arg(user, 2, "end_dim", -1), value)
    if target in ("view", "reshape"):
        return _reshaped(units, value, user, narrowing)
    if target in _REDUCTIONS:
        return _reduced(units, user)
    return None


def _flattened(units: U, start: object, end: object, value: fx.Node) -> U | None:
    """The units after ``flatten(1)``: channel c becomes features c * P .. c * P + P - 1 for
    P positions per channel (channel-major). Any other flatten mixes units and batch."""
    if not units.channel:
        return None
    rank = cast(int, units.rank)
    if start != 1 or end not in (-1, rank - 1):
        return None
    if rank == 2:
        return units
    shape = shape_of(value)
    return replace(units, rank=2, expansion=math.prod(shape[2:]) if shape else None)


def _reshaped(units: U, value: fx.Node, user: fx.Node, narrowing: bool) -> U | None:
    """A view or reshape: kept when it is a no-op or exactly ``flatten(1)`` (such as
    ``x.view(x.size(0), -1)``), which only the shapes can tell, and, when `narrowing`, its
    size along the units is not written as a number."""
    before, after = shape_of(value), shape_of(user)
    if before is None or after is None or units.rank is None:
        return None
    if narrowing and _count_written(units, before, after, user):
        return None
    if after == before:
        return units
    if units.spatial and after == (before[0], math.prod(before[1:])):
        return replace(units, rank=2, expansion=math.prod(before[2:]))
    return None


def _count_written(
    units: Units, before: tuple[int, ...], after: tuple[int, ...], user: fx.Node
) -> bool:
    """Whether view or reshape `user` writes its size along the units as a number (or its
    sizes cannot be told apart), which no longer holds once they are narrowed."""
    sizes = user.args[1:]
    if len(sizes) == 1 and isinstance(sizes[0], tuple | list):
        sizes = tuple(sizes[0])
    if len(sizes) != len(after):
        return True
    written = sizes[units.dim if after == before else 1]
    return isinstance(written, int) and written != -1


def _reduced(units: U, user: fx.Node) -> U | None:
    """A mean, sum, max or min over positions only (global pooling) keeps each channel."""
    rank = _pooled_rank(units.spatial, cast(int, units.rank), user)
    return None if rank is None else replace(units, rank=rank)


def _pooled_rank(spatial: bool, rank: int, user: fx.Node) -> int | None:
    """The rank after `user`, a mean, sum, max or min, when it reduces over positions only
    (global pooling, which keeps each channel) of channels along dim 1 with positions
    after them (`spatial`); None for any other reduction."""
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
