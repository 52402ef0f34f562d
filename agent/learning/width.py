"""Width reduction: a narrower sub-model extracted, trained and written back (HeteroFL /
FedRolex), the physical form of federated dropout.

Dropping a hidden channel saves time only when the tensors are really smaller, so a channel is
removed from every tensor that reads or writes it. In a residual network one channel index is
shared by every layer that writes into the same stream (the skip connection adds them), so the
channels are grouped into *classes* read from the model's dataflow with ``torch.fx``: each
conv/linear layer's outputs start a class, per-channel operations (activations, pooling,
norms, depthwise convs, a channel-major flatten) carry it, and an elementwise add, sub, mul or
div of two tensors merges the classes it joins. The model's input and output channels, and any
class that reaches an operation not known to keep channels apart (concat, indexing, a reshape
other than a flatten, a view with hard-coded sizes, an unknown module), keep their full width.

`width_plan` finds the classes once per model; each round `rolling_selection` picks the
channels (a window that rolls over rounds, so every channel trains), `narrow_model` and
`narrow_state` give the sub-model and its weights, and `widen_state` writes the trained
sub-model back into the full state; `held_masks` says which entries the sub-model holds.
"""

from __future__ import annotations

import copy
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch
from torch import Tensor, fx, nn

from agent.learning.fx_graph import (
    NORM_TENSORS,
    PER_UNIT_MODULES,
    Units,
    call_step,
    is_metadata,
    module_step,
    reads_only,
    shape_of,
    traced,
)
from agent.learning.sparse import Masks, State, _ceil

# Operations that combine two same-layout tensors element by element: a channel index on one
# side is the same channel index on the other, so their classes must be narrowed alike.
_JOIN_FUNCTIONS: frozenset[Any] = frozenset(
    {
        operator.add,
        operator.sub,
        operator.mul,
        operator.truediv,
        operator.iadd,
        operator.isub,
        operator.imul,
        operator.itruediv,
        torch.add,
        torch.sub,
        torch.mul,
        torch.div,
    }
)
_JOIN_METHODS = frozenset({"add", "sub", "mul", "div", "add_", "sub_", "mul_", "div_"})
_BATCH_NORMS = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
)
_INPUT, _OUTPUT = "the model's input", "the model's output"

Selection = tuple[Tensor, ...]
"""Per class of a plan, the sorted channel indices the sub-model keeps."""


@dataclass(frozen=True)
class ChannelClass:
    """Channels that must be narrowed together: index c of the class is index c (or, with an
    expansion E, indices c * E .. c * E + E - 1) along `dim` of every member tensor.

    `members` are (state-dict name, dim, expansion); `widths` the module attributes that count
    the class's channels, as (module name, attribute, expansion), which `narrow_model` sets.
    `step` is the block the channels are chosen in: the channels per group of the class's
    GroupNorms, so the sub-model's groups are whole groups of the full model.
    """

    size: int
    members: tuple[tuple[str, int, int], ...]
    widths: tuple[tuple[str, str, int], ...] = ()
    step: int = 1


@dataclass(frozen=True)
class WidthPlan:
    """The narrowable channel classes of a model, in forward order, and why any others (besides
    the model's input and output channels, which are never narrowed) keep their full width."""

    classes: tuple[ChannelClass, ...]
    note: str | None


def width_plan(model: nn.Module, input_shape: Sequence[int]) -> WidthPlan:
    """The channel classes of `model` for samples of `input_shape` (channels first).

    Raises ValueError, in one line, when ``torch.fx`` cannot trace the model, when it does not
    run on that shape, or when no class can be narrowed (the note says why).
    """
    plan = channel_classes(model, input_shape)
    if not plan.classes:
        raise ValueError(
            "width reduction has nothing to narrow: "
            + (plan.note or "every channel is the model's input or output")
        )
    return plan


def channel_classes(model: nn.Module, input_shape: Sequence[int]) -> WidthPlan:
    """`width_plan`'s classes, none at all included (ValueError only when the model cannot be
    traced or run on `input_shape`)."""
    return _Dataflow(model).run(traced(model, input_shape))


def rolling_selection(plan: WidthPlan, fraction: float, round_: int) -> Selection:
    """The channels each class keeps in round `round_` at width `fraction` (FedRolex).

    A class of B blocks (`ChannelClass.step` channels each) keeps k = ceil(fraction * B)
    consecutive blocks from block (round_ * k) mod B, wrapping around, so the windows of
    ceil(1 / fraction) consecutive rounds cover every channel. Ceil, as HeteroFL and FedRolex
    round: a width never falls below `fraction`. Indices are sorted ascending.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"width fraction must be in (0, 1], got {fraction}")
    out = []
    for cls in plan.classes:
        blocks = cls.size // cls.step
        kept = max(1, _ceil(fraction * blocks))
        start = (round_ * kept) % blocks
        chosen = (start + torch.arange(kept)) % blocks
        index = (chosen[:, None] * cls.step + torch.arange(cls.step)).flatten()
        out.append(index.sort().values)
    return tuple(out)


def narrow_state(state: State, plan: WidthPlan, selection: Selection) -> State:
    """The sub-model's state: every member tensor cut to the selected channels (BatchNorm's
    running statistics included), every other entry (a counter, a fixed layer's bias) copied."""
    picks = _picks(plan, selection)
    out = {}
    for name, tensor in state.items():
        for dim, index in picks.get(name, ()):
            tensor = tensor.index_select(dim, index)
        out[name] = tensor if name in picks else tensor.clone()
    return out


def widen_state(full: State, narrow: State, plan: WidthPlan, selection: Selection) -> State:
    """New tensors: `full` with the sub-model's entries written back at their places. Entries
    the sub-model holds whole (those of no class) are taken from `narrow`."""
    picks = _picks(plan, selection)
    return {
        name: _written(tensor, narrow[name], picks[name]) if name in picks else narrow[name].clone()
        for name, tensor in full.items()
    }


def held_masks(state: State, plan: WidthPlan, selection: Selection) -> Masks:
    """For every entry of the full `state`, True where the sub-model holds it: what it trains,
    sends and is averaged on. Entries of no class are held whole."""
    picks = _picks(plan, selection)
    out = {}
    for name, tensor in state.items():
        mask = torch.ones(tensor.shape, dtype=torch.bool)
        for dim, index in picks.get(name, ()):
            kept = torch.zeros(tensor.shape[dim], dtype=torch.bool)
            kept[index] = True
            mask &= kept.view([-1 if d == dim else 1 for d in range(tensor.dim())])
        out[name] = mask
    return out


def narrow_model(model: nn.Module, plan: WidthPlan, selection: Selection) -> nn.Module:
    """A deep copy of `model` whose layers have the sub-model's sizes and weights (its state is
    ``narrow_state(model.state_dict(), ...)``), ready for `narrow_state` of any full state.

    The full weights are cut, never deep-copied first, so it costs about one
    `narrow_state` per round. Raises ValueError when a GroupNorm's narrowed channel count is
    not a whole number of its groups (a selection not drawn in the class's `step`).
    """
    small = narrow_state(model.state_dict(), plan, selection)
    memo: dict[int, Any] = {}
    for name, param in model.named_parameters():
        memo[id(param)] = nn.Parameter(small[name], requires_grad=param.requires_grad)
    for name, buffer in model.named_buffers():
        if name in small:
            memo[id(buffer)] = small[name]
    out = copy.deepcopy(model, memo)
    modules = dict(out.named_modules())
    for cls, index in zip(plan.classes, selection, strict=True):
        for module_name, attribute, expansion in cls.widths:
            _set_width(modules[module_name], module_name, attribute, len(index) * expansion)
    return out


def _set_width(module: nn.Module, name: str, attribute: str, count: int) -> None:
    """Give `module` its narrowed channel count (a GroupNorm keeps its channels per group)."""
    if isinstance(module, nn.GroupNorm) and module.num_groups > 1:
        per_group = module.num_channels // module.num_groups
        if count % per_group:
            raise ValueError(
                f"GroupNorm {name} has {per_group} channels per group, which {count} "
                "narrowed channels cannot keep; draw the channels in whole groups"
            )
        module.num_groups = count // per_group
    setattr(module, attribute, (count,) if attribute == "normalized_shape" else count)


def _picks(plan: WidthPlan, selection: Selection) -> dict[str, list[tuple[int, Tensor]]]:
    """Per member tensor, the (dim, indices) to keep, with each channel's expansion spelled out."""
    if len(selection) != len(plan.classes):
        raise ValueError(f"{len(selection)} selections for {len(plan.classes)} channel classes")
    picks: dict[str, list[tuple[int, Tensor]]] = {}
    for cls, index in zip(plan.classes, selection, strict=True):
        index = index.to(torch.long)
        if index.dim() != 1 or not len(index) or int(index.min()) < 0:
            raise ValueError("each selection must be a non-empty 1-D tensor of channel indices")
        if int(index.max()) >= cls.size or bool((index.diff() <= 0).any()):
            raise ValueError(f"a selection must be sorted, distinct indices below {cls.size}")
        for name, dim, expansion in cls.members:
            spread = (index[:, None] * expansion + torch.arange(expansion)).flatten()
            picks.setdefault(name, []).append((dim, spread))
    return picks


def _written(full: Tensor, narrow: Tensor, picks: list[tuple[int, Tensor]]) -> Tensor:
    """`full` with `narrow` copied to the places `picks` select, one dim at a time."""
    (dim, index), rest = picks[0], picks[1:]
    part = _written(full.index_select(dim, index), narrow, rest) if rest else narrow
    return full.index_copy(dim, index, part.to(full.dtype))


@dataclass(frozen=True)
class _Layout(Units):
    """Where a value's channels are: class `cls` along `dim` of a `rank`-dim value, each
    channel covering `expansion` consecutive entries (positions, after a flatten). The plan
    is always read with shapes, so the rank and the expansion are always known."""

    rank: int
    expansion: int = 1
    cls: int = field(kw_only=True)


@dataclass
class _Class:
    """One union-find element: a tensor dim (a slot) or a value's channels."""

    size: int
    parent: int
    reasons: list[str] = field(default_factory=list)
    members: list[tuple[str, int, int]] = field(default_factory=list)
    widths: list[tuple[str, str, int]] = field(default_factory=list)
    step: int = 1


class _Classes:
    """Union-find over channel dimensions; a class with a reason is fixed (full width)."""

    def __init__(self) -> None:
        self.items: list[_Class] = []
        self.slots: dict[tuple[str, int], int] = {}

    def new(self, size: int, reason: str | None = None) -> int:
        self.items.append(_Class(size, len(self.items)))
        if reason:
            self.items[-1].reasons.append(reason)
        return len(self.items) - 1

    def find(self, i: int) -> int:
        while self.items[i].parent != i:
            self.items[i].parent = self.items[self.items[i].parent].parent
            i = self.items[i].parent
        return i

    def fix(self, i: int, reason: str) -> None:
        self.items[self.find(i)].reasons.append(reason)

    def union(self, i: int, j: int) -> int:
        a, b = sorted((self.find(i), self.find(j)))
        if a != b:
            first, second = self.items[a], self.items[b]
            second.parent = a
            if first.size != second.size:
                first.reasons.append(f"{first.size} and {second.size} channels meet")
            first.reasons += second.reasons
            first.members += second.members
            first.widths += second.widths
            first.step = math.lcm(first.step, second.step)
        return a

    def slot(self, name: str, dim: int, size: int, expansion: int) -> int:
        """The element of dim `dim` of tensor `name` (one per tensor dim, so a layer called
        twice joins what both calls read or write)."""
        key = (name, dim)
        if key not in self.slots:
            self.slots[key] = self.new(size)
            self.items[self.slots[key]].members.append((name, dim, expansion))
        elif (name, dim, expansion) not in self.items[self.find(self.slots[key])].members:
            self.fix(self.slots[key], f"{name} is read with two layouts")
        return self.slots[key]

    def plan(self) -> WidthPlan:
        roots = [c for i, c in enumerate(self.items) if c.parent == i and c.members]
        classes = tuple(
            ChannelClass(c.size, tuple(c.members), tuple(dict.fromkeys(c.widths)), c.step)
            for c in roots
            if not c.reasons
        )
        return WidthPlan(classes, _note([c for c in roots if c.reasons and not _expected(c)]))


def _expected(cls: _Class) -> bool:
    """Whether a class is full width for the obvious reason alone: it is the model's output,
    or its input and no layer writes it (a layer's output added to the input is worth a note)."""
    reasons = set(cls.reasons)
    writes = any(a in ("out_channels", "out_features") for _, a, _ in cls.widths)
    return reasons <= {_OUTPUT} or (reasons <= {_INPUT} and not writes)


def _note(fixed: list[_Class]) -> str | None:
    """One line on the classes left at full width, each by its first tensor and reason."""
    if not fixed:
        return None
    said = []
    for cls in fixed[:3]:
        reason = next((r for r in cls.reasons if r not in (_INPUT, _OUTPUT)), cls.reasons[0])
        said.append(f"{cls.members[0][0]} ({reason})")
    more = f" and {len(fixed) - 3} more" if len(fixed) > 3 else ""
    return f"{len(fixed)} channel class(es) kept at full width: {'; '.join(said)}{more}"


def _what(node: fx.Node) -> str:
    if node.op == "call_module":
        return f"{node.target}"
    if node.op == "call_method":
        return f".{node.target}()"
    return getattr(node.target, "__name__", str(node.target))


class _Dataflow:
    """Walks the traced graph in order, giving each value's channels a class (`_Layout`)."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = dict(model.named_modules())
        self.state = model.state_dict()
        self.classes = _Classes()
        self.layouts: dict[fx.Node, _Layout | None] = {}

    def run(self, graph: fx.Graph) -> WidthPlan:
        read_directly = []
        for node in graph.nodes:
            if node.op == "get_attr":
                read_directly.append(str(node.target))
            self.layouts[node] = self._visit(node)
        for name in read_directly:
            for (tensor, _), i in self.classes.slots.items():
                if tensor == name:
                    self.classes.fix(i, f"{name} is read outside its module")
        return self.classes.plan()

    def _visit(self, node: fx.Node) -> _Layout | None:
        shape = shape_of(node)
        if node.op == "placeholder":
            if shape is None or len(shape) < 2:
                return None
            return _Layout(1, len(shape), cls=self.classes.new(shape[1], _INPUT))
        if node.op == "output":
            return self._unknown(node, _OUTPUT)
        if node.op == "get_attr" or is_metadata(node):
            return None
        if node.op == "call_function" and node.target in _JOIN_FUNCTIONS:
            return self._join(node)
        if node.op == "call_method" and node.target in _JOIN_METHODS:
            return self._join(node)
        source = node.args[0] if node.args else None
        if not isinstance(source, fx.Node) or not reads_only(node, source):
            return self._unknown(node)
        layout = self.layouts.get(source)
        if node.op == "call_module":
            return self._module(node, source, layout)
        if layout is None:
            return None
        kept = call_step(layout, source, node, narrowing=True)
        return kept if kept is not None else self._unknown(node)

    def _unknown(self, node: fx.Node, reason: str | None = None) -> _Layout | None:
        """A use of the channels not known to keep them apart: their classes stay full width,
        and what comes out has no known channels (None)."""
        for value in node.all_input_nodes:
            layout = self.layouts.get(value)
            if layout is not None:
                self.classes.fix(layout.cls, reason or f"{_what(node)} may mix channels")
        return None

    def _join(self, node: fx.Node) -> _Layout | None:
        """An elementwise op of two tensors: one channel index on both sides, one class."""
        values = [
            a
            for a in (*node.args, *node.kwargs.values())
            if isinstance(a, fx.Node) and not is_metadata(a)
        ]
        tracked = [self.layouts.get(v) for v in values]
        out = shape_of(node)
        if len(values) == 1:  # with a constant
            return tracked[0]
        if len(values) != 2 or out is None:
            return self._unknown(node)
        (a, b), (la, lb) = values, tracked
        if la is None and lb is None:
            return None
        if la is not None and lb is not None:
            alike = (la.dim, la.rank, la.expansion) == (lb.dim, lb.rank, lb.expansion)
            exact = la.expansion == 1 or shape_of(a) == shape_of(b) == out
            if alike and exact and la.rank == len(out):
                return replace(la, cls=self.classes.union(la.cls, lb.cls))
            return self._unknown(node, f"{_what(node)} joins channels along other dims")
        layout, other = (la, b) if la is not None else (lb, a)
        if layout is not None and layout.rank == len(out) and _broadcast(shape_of(other), layout):
            return layout
        return self._unknown(node, f"{_what(node)} joins them with a tensor of other channels")

    def _module(self, node: fx.Node, source: fx.Node, layout: _Layout | None) -> _Layout | None:
        name = cast(str, node.target)
        module = self.modules[name]
        if isinstance(module, PER_UNIT_MODULES):
            kept = None if layout is None else module_step(layout, source, module)
            return kept if kept is not None or layout is None else self._unknown(node)
        if isinstance(module, nn.Conv1d | nn.Conv2d):
            return self._conv(node, name, module, layout)
        if isinstance(module, nn.Linear):
            return self._linear(node, name, module, layout)
        if isinstance(module, (*_BATCH_NORMS, nn.GroupNorm, nn.LayerNorm)):
            return self._norm(node, name, module, layout)
        return self._unknown(node)

    def _weight(self, name: str, dim: int, size: int, expansion: int) -> int:
        """The slot of dim `dim` of layer `name`'s weight; fixed when the weight is no
        state-dict entry (a parametrized weight), which `narrow_state` could not cut."""
        slot = self.classes.slot(f"{name}.weight", dim, size, expansion)
        if f"{name}.weight" not in self.state:
            self.classes.fix(slot, f"{name}.weight is not a state-dict entry")
        return slot

    def _read(self, layout: _Layout, name: str, attribute: str, size: int) -> None:
        """`name`.weight reads the channels of `layout` along its dim 1."""
        slot = self._weight(name, 1, size // layout.expansion, layout.expansion)
        self.classes.items[slot].widths.append((name, attribute, layout.expansion))
        self.classes.union(layout.cls, slot)

    def _write(self, node: fx.Node, name: str, attribute: str, size: int) -> _Layout | None:
        """A layer's output channels: its weight rows and bias entries."""
        slot = self._weight(name, 0, size, 1)
        if f"{name}.bias" in self.state:
            self.classes.union(slot, self.classes.slot(f"{name}.bias", 0, size, 1))
        self.classes.items[slot].widths.append((name, attribute, 1))
        shape = shape_of(node)
        if shape is None:
            self.classes.fix(slot, f"{name}'s output is not a tensor")
            return None
        dim = 1 if attribute == "out_channels" else len(shape) - 1
        return _Layout(dim, len(shape), cls=self.classes.find(slot))

    def _conv(
        self, node: fx.Node, name: str, conv: nn.Conv1d | nn.Conv2d, layout: _Layout | None
    ) -> _Layout | None:
        """A conv reads its input channels whole (groups 1) or each on its own (depthwise);
        any other grouping keeps both sides at full width."""
        depthwise = conv.groups == conv.in_channels == conv.out_channels
        if conv.groups == 1:
            if layout is not None and layout.channel:
                self._read(layout, name, "in_channels", conv.in_channels)
            elif layout is not None:
                self.classes.fix(layout.cls, f"{name} reads them along another dim")
            return self._write(node, name, "out_channels", conv.out_channels)
        if depthwise and layout is not None and layout.channel:
            for tensor in (f"{name}.weight", f"{name}.bias"):
                if tensor in self.state:
                    self.classes.union(
                        layout.cls, self.classes.slot(tensor, 0, conv.out_channels, 1)
                    )
            cls = self.classes.find(layout.cls)
            self.classes.items[cls].widths += [
                (name, a, 1) for a in ("in_channels", "out_channels", "groups")
            ]
            return _Layout(1, layout.rank, cls=cls)
        self._unknown(node, f"{name} is a grouped conv")
        out = self._write(node, name, "out_channels", conv.out_channels)
        if out is not None:
            self.classes.fix(out.cls, f"{name} is a grouped conv")
        return out

    def _linear(
        self, node: fx.Node, name: str, linear: nn.Linear, layout: _Layout | None
    ) -> _Layout | None:
        if layout is not None and layout.last:
            self._read(layout, name, "in_features", linear.in_features)
        elif layout is not None:
            self.classes.fix(layout.cls, f"{name} reads them along another dim")
        return self._write(node, name, "out_features", linear.out_features)

    def _norm(
        self, node: fx.Node, name: str, norm: nn.Module, layout: _Layout | None
    ) -> _Layout | None:
        """A norm over each channel (BatchNorm, InstanceNorm, GroupNorm) or over the features
        of a linear layer (LayerNorm): its per-channel tensors join the class."""
        if layout is None:
            return None
        if isinstance(norm, nn.LayerNorm):
            ok = layout.last and layout.expansion == 1 and len(norm.normalized_shape) == 1
            attribute, size = "normalized_shape", norm.normalized_shape[0]
        elif isinstance(norm, nn.GroupNorm):
            ok, attribute, size = layout.channel, "num_channels", norm.num_channels
        else:
            ok, attribute, size = layout.channel, "num_features", cast(int, norm.num_features)
        if not ok:
            return self._unknown(node, f"{name} normalizes across them")
        for kind in NORM_TENSORS:
            if f"{name}.{kind}" in self.state:
                self.classes.union(layout.cls, self.classes.slot(f"{name}.{kind}", 0, size, 1))
        cls = self.classes.find(layout.cls)
        self.classes.items[cls].widths.append((name, attribute, 1))
        if isinstance(norm, nn.GroupNorm) and norm.num_groups > 1:
            step = norm.num_channels // norm.num_groups
            self.classes.items[cls].step = math.lcm(self.classes.items[cls].step, step)
        return _Layout(layout.dim, layout.rank, cls=cls)


def _broadcast(shape: tuple[int, ...] | None, layout: _Layout) -> bool:
    """Whether a tensor of `shape` broadcasts along the channels (size 1 or absent there)."""
    if shape is None:
        return False
    at = layout.dim - (layout.rank - len(shape))
    return at < 0 or shape[at] == 1
