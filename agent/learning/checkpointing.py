"""Per-block activation checkpointing: a round's memory cut without cutting its work.

Most of a training step's memory is the activations autograd keeps for the backward pass
(resnet18 at batch 64: 272 of 361 MB). Checkpointing keeps only each block's input and
computes the block's forward pass again when the backward pass reaches it: about 1.25x the
time for about 0.6x the memory (issue 32's measurement). It changes no number a round
computes, which is why the budget rule prefers it to a smaller batch when it fits the time
(`agent.learning.reduction`).

The blocks are read off the model's containers: each `nn.Sequential` (the outermost ones;
none inside a block) whose elements are modules of their own (ResNet's basic blocks) is
checkpointed element by element; one of plain layers (a conv, its norm, its activation) in
ceil(sqrt(n)) runs of consecutive layers, since a single layer's input is all it keeps
anyway. A container holding BatchNorm is left alone: recomputing its forward pass would
update its running statistics twice.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint


class _Kept(torch.autograd.Function):
    """The identity, saving its input for the backward pass: a block's input is what a
    checkpoint keeps, and saved this way it is what saved-tensor hooks (a memory meter) see,
    since inside a checkpoint they see nothing. It keeps no second copy."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad


def _runs(sequence: nn.Sequential) -> list[tuple[int, int]] | None:
    """The [start, stop) runs of `sequence` each checkpointed as one; None when it is not
    worth it (fewer than two elements with weights, or a BatchNorm among them)."""
    elements = list(sequence)
    weighted = [any(True for _ in e.parameters()) for e in elements]
    if sum(weighted) < 2:
        return None
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in sequence.modules()):
        return None
    if all(any(True for _ in e.children()) for e, w in zip(elements, weighted, strict=True) if w):
        return [(i, i + 1) for i in range(len(elements))]
    size = math.ceil(len(elements) / math.ceil(math.sqrt(len(elements))))
    return [(i, min(i + size, len(elements))) for i in range(0, len(elements), size)]


def blocks(model: nn.Module) -> dict[str, list[tuple[int, int]]]:
    """Module name -> the runs of its elements each checkpointed as one block, for the
    outermost `nn.Sequential`s worth checkpointing (module docstring)."""
    found: dict[str, list[tuple[int, int]]] = {}
    for name, module in model.named_modules():
        if any(name.startswith(f"{outer}.") or not outer for outer in found):
            continue
        if isinstance(module, nn.Sequential):
            runs = _runs(module)
            if runs is not None:
                found[name] = runs
    return found


def _checkpointed_forward(
    sequence: nn.Sequential, runs: list[tuple[int, int]]
) -> Callable[[Tensor], Tensor]:
    """`sequence`'s forward pass with each run checkpointed while a graph is recorded."""
    elements = list(sequence)

    def run(start: int, stop: int) -> Callable[[Tensor], Tensor]:
        def part(x: Tensor) -> Tensor:
            for element in elements[start:stop]:
                x = element(x)
            return x

        return part

    def forward(x: Tensor) -> Tensor:
        if not torch.is_grad_enabled():
            return run(0, len(elements))(x)
        for start, stop in runs:
            kept = _Kept.apply(x)  # type: ignore[no-untyped-call]
            x = checkpoint(run(start, stop), kept, use_reentrant=False)
        return x

    return forward


@contextlib.contextmanager
def checkpointed(model: nn.Module) -> Iterator[bool]:
    """Within: the model's `blocks` checkpointed in every forward pass that records a
    graph (evaluation runs as before). Yields whether there was anything to checkpoint."""
    modules = dict(model.named_modules())
    found = blocks(model)
    for name, runs in found.items():
        sequence = modules[name]
        assert isinstance(sequence, nn.Sequential)
        sequence.forward = _checkpointed_forward(sequence, runs)  # type: ignore[method-assign]
    try:
        yield bool(found)
    finally:
        for name in found:
            del modules[name].forward
