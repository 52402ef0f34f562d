"""A small dense autoencoder for sensor windows: it squeezes a window through 8 numbers and
rebuilds it. Trained on normal operation only, it rebuilds normal windows well and anomalies
badly, so its reconstruction error is an anomaly score."""

from __future__ import annotations

import math

from torch import nn


def build(input_shape: tuple[int, ...], num_outputs: int) -> nn.Module:
    """edgefl calls this with one window's shape and, for reconstruction, its value count."""
    size = math.prod(input_shape)
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(size, 32),
        nn.ReLU(),
        nn.Linear(32, 8),
        nn.ReLU(),
        nn.Linear(8, 32),
        nn.ReLU(),
        nn.Linear(32, num_outputs),
    )
