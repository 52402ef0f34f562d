"""Exact FedSPU freezing: weight gradients for the active block only (ALGORITHMS.md 2).

FedSPU trains, in every conv/linear layer, the weights whose output unit and input unit are
both active: the trainable mask is an outer product of a row set and a column set. Training
with ``train_local(..., frozen=active)`` computes the full weight gradient and then puts the
frozen entries back, so a device frozen to 20% spends nearly the dense time.
`active_block_gradients` makes backward compute each such layer's weight gradient for the
active rows x columns only (none at all for a whole-layer-frozen weight), while the input
gradient still flows through every unit, as freezing requires.

The results stay those of restore-after-step bit for bit: each active entry's gradient must
be summed in the same order as the dense kernel sums it. BLAS and oneDNN pick their kernels
by shape, and some sum a narrow block in another order (measured with one thread, MKL and
oneDNN on AVX2: sgemm results with fewer than 4 rows or 12 columns; oneDNN on 1x1 and 2x2
maps, on a single sample, on 3 input channels). So each block shape is checked once per
process against the dense kernel on random data of the same shapes and strides
(`_Layer.plan`), and the first of: the block itself, the block widened with frozen units to
`_PAD_TO`, the dense gradient, that agrees bit for bit is used from then on. The dense
gradient is autograd's own call, so correctness never rests on which kernel a library chose.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from agent.learning.sparse import Masks

__all__ = ["MIN_WEIGHT_GRAD_MACS", "active_block_gradients"]

Plan = Literal["block", "padded", "dense"]
Grads = tuple[Tensor | None, Tensor | None, Tensor | None]
# Below this many multiply-accumulates in a layer's dense weight gradient (weights x output
# positions) the layer is left dense: the saving is smaller than the cost of a Python
# autograd Function and of building the dense-shaped gradient (measured on this CPU, one
# thread, batch 64: an MLP step with its 784x128 layer, 6.4M, took 1.4-1.5x as long; a
# 16->32 3x3 conv on 4x4 maps, 4.7M, 1.05x; a 32->32 conv on 8x8 maps, 38M, 0.76-0.85x).
MIN_WEIGHT_GRAD_MACS = 16_000_000
# A block narrower than this many units per side is also tried widened to it: the narrow
# sgemm and oneDNN kernels sum in another order (see the module docstring).
_PAD_TO = 16
# Fewest gradient entries a shape check compares: when two kernels sum in different orders,
# about half their results differ in the last bit, so agreement on 256 random entries is not
# chance.
_MIN_CHECKED = 256
# The plan per (layer geometry, shapes, strides, block size, threads): kernel choice depends
# on nothing else, so it is checked once per process.
_PLANS: dict[tuple[object, ...], Plan] = {}


@dataclass(frozen=True)
class _Ops:
    """The forward pass and the gradients of one Linear or (groups 1, zero-padded) Conv
    layer, as the calls autograd makes for ``F.linear`` and ``F.conv*d``."""

    conv_dims: int  # 0 for a Linear
    stride: tuple[int, ...] = ()
    padding: tuple[int, ...] = ()
    dilation: tuple[int, ...] = ()

    def forward(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        if not self.conv_dims:
            return F.linear(x, weight, bias)
        conv = F.conv1d if self.conv_dims == 1 else F.conv2d
        return conv(x, weight, bias, self.stride, self.padding, self.dilation, 1)

    def weight_grad_macs(self, x: Tensor, weight: Tensor) -> int:
        """Multiply-accumulates of the dense weight gradient for input `x`: the weight's
        size times the output positions it is applied at."""
        if not self.conv_dims:
            return weight.numel() * (x.numel() // x.shape[-1])
        positions = x.shape[0]
        for size, k, s, p, d in zip(
            x.shape[2:], weight.shape[2:], self.stride, self.padding, self.dilation, strict=True
        ):
            positions *= max(0, (size + 2 * p - d * (k - 1) - 1) // s + 1)
        return weight.numel() * positions

    def grads(
        self, grad: Tensor, x: Tensor, weight: Tensor, needed: tuple[bool, bool, bool]
    ) -> Grads:
        """The (input, weight, bias) gradients that `needed` asks for, as autograd computes
        them: ``grad @ W``, ``grad^T @ x`` and the sum over positions on flattened leading
        dims (Linear), one ``convolution_backward`` (Conv). With `weight` cut to a block
        and `grad`, `x` to its rows and columns, the weight gradient is the block's."""
        need_x, need_weight, need_bias = needed
        if self.conv_dims:
            grads = torch.ops.aten.convolution_backward(
                grad,
                x,
                weight,
                [weight.shape[0]] if need_bias else None,
                list(self.stride),
                list(self.padding),
                list(self.dilation),
                False,
                [0] * self.conv_dims,
                1,
                list(needed),
            )
            return cast(Grads, tuple(grads))
        flat = grad.reshape(-1, grad.shape[-1])
        return (
            flat.mm(weight).reshape(x.shape) if need_x else None,
            flat.t().mm(x.reshape(-1, x.shape[-1])) if need_weight else None,
            flat.sum(0) if need_bias else None,
        )


@dataclass(frozen=True)
class _Layer:
    """One layer's ops and trainable block: the sorted `rows` (output units) and `cols`
    (input units) whose outer product is the trainable mask, `frozen` its complement, and
    the two widened with frozen units to at least `_PAD_TO` each (`padded`)."""

    ops: _Ops
    rows: Tensor
    cols: Tensor
    padded: tuple[Tensor, Tensor]
    frozen: Tensor

    def block_grad(self, grad: Tensor, x: Tensor, weight: Tensor, plan: Plan) -> Tensor:
        """The dense-shaped weight gradient from the block `plan` names: the dense kernel's
        values on the trainable block, zeros elsewhere."""
        rows, cols = (self.rows, self.cols) if plan == "block" else self.padded
        out = self._block(grad, x, weight, rows, cols)
        # Into a dense-shaped tensor one dim at a time: index_copy_ copies whole rows where
        # indexing rows and columns at once is a slow scatter.
        if cols.numel() < weight.shape[1]:
            shape = (out.shape[0], weight.shape[1], *out.shape[2:])
            out = out.new_zeros(shape).index_copy_(1, cols, out)
        if rows.numel() < weight.shape[0]:
            out = out.new_zeros(weight.shape).index_copy_(0, rows, out)
        return out.masked_fill_(self.frozen, 0.0) if plan == "padded" else out

    def _block(self, grad: Tensor, x: Tensor, weight: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
        """The weight gradient of rows x cols from `grad`'s rows and `x`'s columns alone
        (dim 1 of a conv's tensors, the last dim of a Linear's)."""
        dim = 1 if self.ops.conv_dims else -1
        if rows.numel() < weight.shape[0]:
            grad = grad.index_select(dim, rows)
        if cols.numel() < weight.shape[1]:
            x = x.index_select(dim, cols)
        # The weight gradient reads only the weight's shape.
        shape = (rows.numel(), cols.numel(), *weight.shape[2:])
        block = self.ops.grads(grad, x, weight.new_empty(shape), (False, True, False))[1]
        return cast(Tensor, block)

    def plan(self, grad: Tensor, x: Tensor, weight: Tensor) -> Plan:
        """How this layer's weight gradient is computed for these shapes (`_check`, once)."""
        key = (
            self.ops,
            weight.shape,
            weight.dtype,
            weight.device.type,
            x.shape,
            x.stride(),
            grad.shape,
            grad.stride(),
            self.rows.numel(),
            self.cols.numel(),
            self.padded[0].numel(),
            self.padded[1].numel(),
            torch.get_num_threads(),
        )
        plan = _PLANS.get(key)
        if plan is None:
            plan = _PLANS[key] = self._check(grad, x, weight)
        return plan

    def _check(self, grad: Tensor, x: Tensor, weight: Tensor) -> Plan:
        """The first candidate whose block gradient equals the dense kernel's bit for bit on
        random tensors shaped and strided like `grad` and `x` (from a private generator: the
        global RNG, which dropout draws from, is left alone)."""
        generator = torch.Generator(device=x.device).manual_seed(0)
        fake_grad, fake_x = _random_like(grad, generator), _random_like(x, generator)
        if fake_grad is None or fake_x is None:
            return "dense"
        dense = self.ops.grads(fake_grad, fake_x, weight, (False, True, False))[1]
        assert dense is not None
        per_pair = math.prod(weight.shape[2:])
        candidates: list[tuple[Plan, Tensor, Tensor]] = [
            ("block", self.rows, self.cols),
            ("padded", *self.padded),
        ]
        for plan, rows, cols in candidates:
            if rows.numel() * cols.numel() * per_pair < _MIN_CHECKED:
                continue
            block = self._block(fake_grad, fake_x, weight, rows, cols)
            if torch.equal(block, dense[rows[:, None], cols[None, :]]):
                return plan
        return "dense"


def _random_like(t: Tensor, generator: torch.Generator) -> Tensor | None:
    """Standard normal values with `t`'s shape, strides, dtype and device; None for a layout
    (overlapping or gapped strides, as an expanded gradient has) that cannot be copied."""
    channels_last = t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)
    if not (t.is_contiguous() or channels_last):
        return None
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return out.normal_(generator=generator)


class _ActiveBlock(torch.autograd.Function):
    """A layer whose backward gives the usual input and bias gradients and the weight
    gradient of the trainable block only (`_Layer.plan`)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, layer: _Layer) -> Tensor:
        ctx.layer = layer
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        return layer.ops.forward(x, weight, bias)

    @staticmethod
    def backward(
        ctx: Any, grad: Tensor
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None, None]:
        x, weight = ctx.saved_tensors
        layer: _Layer = ctx.layer
        need_x, need_weight, need_bias = ctx.needs_input_grad[:3]
        needed = (need_x, need_weight, need_bias and ctx.has_bias)
        plan = layer.plan(grad, x, weight) if need_weight else "dense"
        if plan == "dense":
            grad_x, grad_weight, grad_bias = layer.ops.grads(grad, x, weight, needed)
            if grad_weight is not None:
                grad_weight.masked_fill_(layer.frozen, 0.0)
            return grad_x, grad_weight, grad_bias, None
        grad_x, _, grad_bias = layer.ops.grads(grad, x, weight, (needed[0], False, needed[2]))
        return grad_x, layer.block_grad(grad, x, weight, plan), grad_bias, None


def _ops_of(module: nn.Module) -> _Ops | None:
    """The layer's ops when the module computes the plain layer: a Linear, or a Conv1d or
    Conv2d with groups 1 and zero padding given in numbers, with its class's own forward (a
    subclass that overrides it is left alone)."""
    if isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward:
        return _Ops(0)
    for kind, dims in ((nn.Conv1d, 1), (nn.Conv2d, 2)):
        if isinstance(module, kind) and type(module).forward is kind.forward:
            if module.groups != 1 or module.padding_mode != "zeros":
                return None
            if isinstance(module.padding, str):
                return None
            return _Ops(dims, tuple(module.stride), module.padding, tuple(module.dilation))
    return None


def _outer_factors(mask: Tensor) -> tuple[Tensor, Tensor] | None:
    """(rows, cols): the bool unit masks whose outer product, the same at every kernel
    position, is `mask`; None when it is not one. The candidates are read off the first
    kernel position alone and the whole mask is compared once: a round's setup passes over
    every frozen weight, and on a model of one-step rounds (resnet18 on a Pi) each pass
    shows in the round's time."""
    first = mask.flatten(2)[:, :, 0] if mask.dim() > 2 else mask
    rows, cols = first.any(1), first.any(0)
    kernel = (1,) * (mask.dim() - 2)
    outer = rows.view(-1, 1, *kernel) & cols.view(1, -1, *kernel)
    return (rows, cols) if torch.equal(outer.expand_as(mask), mask) else None


def _widened(units: Tensor) -> Tensor:
    """The active indices, with the first frozen ones added up to `_PAD_TO` (or all)."""
    active = units.nonzero().flatten()
    missing = min(_PAD_TO, units.numel()) - active.numel()
    if missing <= 0:
        return active
    extra = (~units).nonzero().flatten()[:missing]
    return torch.cat([active, extra]).sort().values


def _block_forward(
    module: nn.Module, layer: _Layer, original: Callable[..., Any], min_macs: int, x: Tensor
) -> Any:
    """The layer through `_ActiveBlock`; through its own forward for an unbatched input or
    one too small to gain (`MIN_WEIGHT_GRAD_MACS`)."""
    weight = cast(Tensor, module.weight)
    batched = layer.ops.conv_dims + 2
    if x.dim() < batched or (layer.ops.conv_dims and x.dim() != batched):
        return original(x)
    if layer.ops.weight_grad_macs(x, weight) < min_macs:
        return original(x)
    return _ActiveBlock.apply(x, weight, module.bias, layer)  # type: ignore[no-untyped-call]


def _frozen_forward(module: nn.Module, ops: _Ops, x: Tensor) -> Tensor:
    """The layer with its weight detached: autograd computes no weight gradient at all."""
    weight = cast(Tensor, module.weight).detach()
    if not ops.conv_dims:
        return F.linear(x, weight, cast(Tensor | None, module.bias))
    conv = cast(nn.Conv1d | nn.Conv2d, module)
    return cast(Tensor, conv._conv_forward(x, weight, conv.bias))


def _forward_for(
    module: nn.Module, ops: _Ops, mask: Tensor, min_macs: int
) -> Callable[..., Any] | None:
    """The forward to install on `module` for its trainable `mask`, or None to leave the
    layer dense (all True, or not an outer product)."""
    mask = mask.to(cast(Tensor, module.weight).device)
    factors = _outer_factors(mask)
    if factors is None:
        return None
    rows, cols = factors
    if not (bool(rows.any()) and bool(cols.any())):
        return functools.partial(_frozen_forward, module, ops)
    if bool(rows.all()) and bool(cols.all()):
        return None
    padded = (_widened(rows), _widened(cols))
    layer = _Layer(ops, rows.nonzero().flatten(), cols.nonzero().flatten(), padded, ~mask)
    return functools.partial(_block_forward, module, layer, module.forward, min_macs)


@contextlib.contextmanager
def active_block_gradients(
    model: nn.Module, trainable: Masks, *, min_macs: int = MIN_WEIGHT_GRAD_MACS
) -> Iterator[None]:
    """Within the context, backward computes the weight gradient of each Linear, Conv1d and
    Conv2d layer (groups 1) whose ``<module>.weight`` mask in `trainable` is an outer
    product of output and input units for the trainable block only, zeros elsewhere, and
    none for an all-False mask; input and bias gradients are the usual ones. The block's
    values are the dense gradient's bit for bit (module docstring), so training inside the
    context gives what ``train_local(..., frozen=trainable)`` gives outside it.

    Masks that are all True, absent or not an outer product leave their layer as it is, and
    so does a call whose dense weight gradient costs fewer than `min_macs`
    multiply-accumulates. The layers' own forwards are back on exit, also on an exception.
    """
    # Each patched module and its own instance-level forward, if it had one.
    saved: list[tuple[nn.Module, Callable[..., Any] | None]] = []
    try:
        for name, module in model.named_modules():
            ops = _ops_of(module)
            mask = trainable.get(f"{name}.weight" if name else "weight")
            if ops is None or mask is None:
                continue
            forward = _forward_for(module, ops, mask, min_macs)
            if forward is not None:
                saved.append((module, module.__dict__.get("forward")))
                module.forward = forward
        yield
    finally:
        for module, previous in reversed(saved):
            if previous is None:
                del module.forward
            else:
                module.forward = previous
