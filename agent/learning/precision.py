"""How a model computes a training step on its device: memory format and precision.

On a GPU (a Jetson's) a channels-last layout of 4-D activations and mixed precision
(autocast of convolutions and matrix products to fp16 or bf16, the weights and the update
kept in fp32) can make a step much faster; on a CPU they mostly do not, and fp16 needs its
loss scaled so that small gradients do not underflow. Which format an agent trains in is
measured, never assumed: `agent.device.calibration` times a dense step in each candidate
where CUDA is present and keeps the fastest in the device's cost table; everywhere else,
and by default, a step is plain fp32 and computes exactly what it always did.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
CHANNELS_LAST = "channels-last"


@dataclass(frozen=True)
class ComputeFormat:
    """A training step's memory format and autocast precision (None: fp32 throughout)."""

    channels_last: bool = False
    precision: str | None = None
    """"fp16" or "bf16": the dtype autocast computes convolutions and products in."""

    @classmethod
    def parse(cls, name: str) -> ComputeFormat:
        """The format a cost table names (`name`): "fp32", "channels-last", "fp16", "bf16"
        or "channels-last+fp16" and the like; ValueError for another."""
        parts = name.split("+")
        channels_last = CHANNELS_LAST in parts
        rest = [part for part in parts if part not in (CHANNELS_LAST, "fp32")]
        if len(rest) > 1 or (rest and rest[0] not in _DTYPES) or not parts:
            raise ValueError(f"unknown compute format {name!r}")
        return cls(channels_last, rest[0] if rest else None)

    @property
    def name(self) -> str:
        parts = [CHANNELS_LAST] if self.channels_last else []
        parts += [self.precision] if self.precision else []
        return "+".join(parts) or "fp32"

    @property
    def plain(self) -> bool:
        return not self.channels_last and self.precision is None

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """A batch laid out as the model's convolutions want it (4-D only)."""
        if self.channels_last and x.dim() == 4:
            return x.contiguous(memory_format=torch.channels_last)
        return x

    @contextlib.contextmanager
    def laid_out(self, model: nn.Module) -> Iterator[None]:
        """Within: the model's 4-D weights channels-last (as contiguous again afterwards,
        so that what a round returns and what the next one loads is laid out as always)."""
        if not self.channels_last:
            yield
            return
        model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        try:
            yield
        finally:
            model.to(memory_format=torch.contiguous_format)  # type: ignore[call-overload]

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager[object]:
        """The forward pass's autocast, or nothing for fp32."""
        if self.precision is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=_DTYPES[self.precision])


FP32 = ComputeFormat()
"""A plain fp32 step: the default, and every CPU's."""


class LossScale:
    """fp16's dynamic loss scaling (`torch.amp.GradScaler`'s rule: start at 2^16, halve and
    skip the step on an overflow, double after 2000 clean steps), written out because the
    scaler steps a torch optimizer, and training here steps SGD by hand
    (`training.sgd_step_`). For any other format it leaves the loss and gradients alone."""

    def __init__(self, format_: ComputeFormat) -> None:
        self.enabled = format_.precision == "fp16"
        self.scale = 2.0**16
        self._clean = 0

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self.scale if self.enabled else loss).backward()  # type: ignore[no-untyped-call]

    @torch.no_grad()
    def unscaled(self, model: nn.Module) -> bool:
        """The gradients back at their true size; False (and the scale halved) when one
        overflowed, in which case the step is skipped."""
        if not self.enabled:
            return True
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not all(bool(torch.isfinite(g).all()) for g in grads):
            self.scale /= 2
            self._clean = 0
            return False
        for grad in grads:
            grad.div_(self.scale)
        self._clean += 1
        if self._clean == 2000:
            self.scale *= 2
            self._clean = 0
        return True
