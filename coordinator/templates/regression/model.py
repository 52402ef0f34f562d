"""The model every device trains: a small multilayer perceptron from one sample's features
to its target.

edgefl calls `build` with one sample's shape and the number of targets per sample (1 here);
return any torch.nn.Module that maps a batch (batch, *input_shape) to (batch, num_outputs).
"""

from __future__ import annotations

import math

from torch import nn


def build(input_shape: tuple[int, ...], num_outputs: int) -> nn.Module:
    """Features in, the predicted target out."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(input_shape), 64),
        nn.ReLU(),
        nn.Linear(64, 32),
        nn.ReLU(),
        nn.Linear(32, num_outputs),
    )
