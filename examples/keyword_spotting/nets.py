"""A depthwise-separable keyword-spotting CNN (after DS-CNN, Zhang et al. 2017, "Hello
Edge"), small enough for a microcontroller-class budget: a standard 3x3 convolution, then
blocks of a depthwise 3x3 convolution (one filter per channel) and a pointwise 1x1
convolution, each followed by BatchNorm and ReLU, global average pooling and a classifier.
"""

from __future__ import annotations

from torch import nn


def separable(channels_in: int, channels_out: int) -> list[nn.Module]:
    return [
        nn.Conv2d(channels_in, channels_in, 3, padding=1, groups=channels_in, bias=False),
        nn.BatchNorm2d(channels_in),
        nn.ReLU(),
        nn.Conv2d(channels_in, channels_out, 1, bias=False),
        nn.BatchNorm2d(channels_out),
        nn.ReLU(),
    ]


def build(input_shape: tuple[int, ...], num_outputs: int) -> nn.Module:
    """edgefl calls this with one sample's shape (1, mel bins, frames) and the keyword count."""
    width = 24
    return nn.Sequential(
        nn.Conv2d(input_shape[0], width, 3, padding=1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        *separable(width, width),
        *separable(width, 2 * width),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * width, num_outputs),
    )
