"""The model every device trains: a small dense autoencoder. It squeezes a window through 8
numbers and rebuilds it; trained on normal operation only, it rebuilds normal windows well
and anomalies badly, so its reconstruction error is an anomaly score.

edgefl calls `build` with one window's shape and its number of values; return any
torch.nn.Module that maps a batch (batch, *input_shape) to (batch, num_outputs).
"""

from __future__ import annotations

import math

from torch import nn


def build(input_shape: tuple[int, ...], num_outputs: int) -> nn.Module:
    """A window in, the window rebuilt (flat) out."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(input_shape), 32),
        nn.ReLU(),
        nn.Linear(32, 8),
        nn.ReLU(),
        nn.Linear(8, 32),
        nn.ReLU(),
        nn.Linear(32, num_outputs),
    )
