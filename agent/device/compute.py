"""Which torch device an agent trains on: `--device auto|cpu|cuda`.

Only the model's compute moves: `Learner.to(device)` puts the model on the device, and the
training functions copy each batch there and every result back to the CPU, so weights,
masks, messages, checkpoints and reports stay CPU tensors whatever the device. The budget
follows the same choice: pass `device.type` as `compute` to `compute_budget`, so that a
Jetson training on its CPU budgets with its CPU's peak, not its GPU's.
"""

from __future__ import annotations

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")
"""What `--device` accepts; "cuda:N" (a GPU by index) is accepted too."""

_NO_CUDA = (
    "--device {spec}: this torch build sees no CUDA device (torch.cuda.is_available() is "
    "False); use --device cpu or auto"
)


def resolve_device(spec: str) -> torch.device:
    """The device `spec` names: "auto" is CUDA where torch sees one, else the CPU.

    Raises ValueError (one line naming --device) for an unknown spec, or for "cuda" /
    "cuda:N" where this torch build sees no CUDA device or no GPU N.
    """
    text = spec.strip().lower()
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if text == "cpu":
        return torch.device("cpu")
    if text == "cuda" or text.startswith("cuda:"):
        return _cuda(spec, text)
    raise ValueError(f"--device {spec}: expected one of {', '.join(DEVICE_CHOICES)} or cuda:N")


def _cuda(spec: str, text: str) -> torch.device:
    """The CUDA device of a "cuda" or "cuda:N" spec, checked against what torch sees."""
    index = text.partition(":")[2]
    if index and not index.isdigit():
        raise ValueError(f"--device {spec}: expected cuda or cuda:N with N a GPU index")
    if not torch.cuda.is_available():
        raise ValueError(_NO_CUDA.format(spec=spec))
    count = torch.cuda.device_count()
    if index and int(index) >= count:
        raise ValueError(f"--device {spec}: torch sees {count} CUDA device(s), numbered from 0")
    return torch.device(text)
