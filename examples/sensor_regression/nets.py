"""A GRU regressor over sensor windows: two recurrent layers read a window step by step, and
a linear head maps the last hidden state to the remaining useful life."""

from __future__ import annotations

import torch
from torch import nn


class WindowRegressor(nn.Module):
    def __init__(self, features: int, outputs: int, hidden: int = 24) -> None:
        super().__init__()
        self.gru = nn.GRU(features, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps, _ = self.gru(x)  # (batch, time, hidden)
        return self.head(steps[:, -1])


def build(input_shape: tuple[int, ...], num_outputs: int) -> nn.Module:
    """edgefl calls this with one window's shape (time steps, sensors) and 1 output."""
    _steps, features = input_shape
    return WindowRegressor(features, num_outputs)
