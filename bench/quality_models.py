"""Models and data the project was not written for, as a user brings them (import paths in
bench/learning_quality.py's tasks): a convolution + BatchNorm + GRU classifier for signals,
and a small regression MLP on scikit-learn's diabetes table (shipped with the package)."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn


class ConvGRU(nn.Module):
    """A 1-D convolution with BatchNorm, then a GRU over its output's time steps and a linear
    head on the last one: a common shape for sensor and audio signals."""

    def __init__(self, channels: int, classes: int) -> None:
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv1d(channels, 16, 5, padding=2), nn.BatchNorm1d(16), nn.ReLU()
        )
        self.gru = nn.GRU(16, 32, batch_first=True)
        self.head = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps, _ = self.gru(self.conv(x).transpose(1, 2))
        return self.head(steps[:, -1])


def conv_gru(input_shape: tuple[int, ...], num_outputs: int) -> nn.Module:
    return ConvGRU(input_shape[0], num_outputs)


def mlp(input_shape: tuple[int, ...], num_outputs: int) -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(input_shape), 32),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.ReLU(),
        nn.Linear(32, num_outputs),
    )


def diabetes() -> dict[str, np.ndarray]:
    """scikit-learn's 442 diabetes patients: 10 features as scikit-learn ships them (centred,
    each scaled to unit norm over the patients: values of about 0.05), and the disease
    progression a year later, standardized as a user would."""
    from sklearn.datasets import load_diabetes

    data = load_diabetes()
    y = (data.target - data.target.mean()) / data.target.std()
    return {"x": data.data.astype(np.float32), "y": y.astype(np.float32)}
