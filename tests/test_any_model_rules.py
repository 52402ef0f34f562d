"""The rules for a user's own nn.Module (ALGORITHMS.md 1 and 4): prunable tensors, FLOPs
from hooks, ERK densities, masked training and RigL on recurrent and depthwise weights,
FedLDF layers, aggregation of states with integer buffers, and `check_supported`; and the
bundled models unchanged by them."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from agent.learning import ldf, sparse
from agent.learning.config import SGDConfig
from agent.learning.models import (
    MODEL_NAMES,
    build_model,
    check_supported,
    forward_flops,
    output_positions,
    prunable_names,
)
from agent.learning.rigl import rigl_update
from agent.learning.training import dense_gradients, train_local
from tests.test_models import DEFAULT_INPUTS

# Computed with the code before user modules were supported; the bundled models must
# keep exactly these prunable names (in order), output positions, FLOPs, ERK densities
# and FedLDF layers.
BUNDLED: dict[str, dict[str, Any]] = {
    "mlp": {
        "positions": {"net.1.weight": 1, "net.3.weight": 1, "net.5.weight": 1},
        "flops": 33024,
        "erk": {
            "net.1.weight": 0.4906140350877193,
            "net.3.weight": 0.4697368421052631,
            "net.5.weight": 1.0,
        },
        "groups": {
            "net.1": ["net.1.weight", "net.1.bias"],
            "net.3": ["net.3.weight", "net.3.bias"],
            "net.5": ["net.5.weight", "net.5.bias"],
        },
    },
    "cnn1d": {
        "positions": {
            "features.0.weight": 20,
            "features.3.weight": 10,
            "features.6.weight": 5,
            "classifier.weight": 1,
        },
        "flops": 101760,
        "erk": {
            "features.0.weight": 1.0,
            "features.3.weight": 0.3567708333333333,
            "features.6.weight": 0.3567708333333333,
            "classifier.weight": 1.0,
        },
        "groups": {
            "features.0": ["features.0.weight", "features.1.weight", "features.1.bias"],
            "features.3": ["features.3.weight", "features.4.weight", "features.4.bias"],
            "features.6": ["features.6.weight", "features.7.weight", "features.7.bias"],
            "classifier": ["classifier.weight", "classifier.bias"],
        },
    },
    "cnn2d": {
        "positions": {"features.0.weight": 64, "features.4.weight": 16, "classifier.weight": 1},
        "flops": 168448,
        "erk": {
            "features.0.weight": 1.0,
            "features.4.weight": 0.3454861111111111,
            "classifier.weight": 1.0,
        },
        "groups": {
            "features.0": ["features.0.weight", "features.1.weight", "features.1.bias"],
            "features.4": ["features.4.weight", "features.5.weight", "features.5.bias"],
            "classifier": ["classifier.weight", "classifier.bias"],
        },
    },
    "resnet18": {
        "positions": {
            "stem.0.weight": 1024,
            "layers.0.conv1.weight": 1024,
            "layers.0.conv2.weight": 1024,
            "layers.1.conv1.weight": 1024,
            "layers.1.conv2.weight": 1024,
            "layers.2.conv1.weight": 256,
            "layers.2.conv2.weight": 256,
            "layers.2.shortcut.0.weight": 256,
            "layers.3.conv1.weight": 256,
            "layers.3.conv2.weight": 256,
            "layers.4.conv1.weight": 64,
            "layers.4.conv2.weight": 64,
            "layers.4.shortcut.0.weight": 64,
            "layers.5.conv1.weight": 64,
            "layers.5.conv2.weight": 64,
            "layers.6.conv1.weight": 16,
            "layers.6.conv2.weight": 16,
            "layers.6.shortcut.0.weight": 16,
            "layers.7.conv1.weight": 16,
            "layers.7.conv2.weight": 16,
            "classifier.weight": 1,
        },
        "flops": 1110845440,
        "erk": {
            "stem.0.weight": 1.0,
            "layers.0.conv1.weight": 1.0,
            "layers.0.conv2.weight": 1.0,
            "layers.1.conv1.weight": 1.0,
            "layers.1.conv2.weight": 1.0,
            "layers.2.conv1.weight": 1.0,
            "layers.2.conv2.weight": 1.0,
            "layers.2.shortcut.0.weight": 1.0,
            "layers.3.conv1.weight": 1.0,
            "layers.3.conv2.weight": 1.0,
            "layers.4.conv1.weight": 1.0,
            "layers.4.conv2.weight": 0.720482886744545,
            "layers.4.shortcut.0.weight": 1.0,
            "layers.5.conv1.weight": 0.720482886744545,
            "layers.5.conv2.weight": 0.720482886744545,
            "layers.6.conv1.weight": 0.5382758246527778,
            "layers.6.conv2.weight": 0.35815510296664155,
            "layers.6.shortcut.0.weight": 1.0,
            "layers.7.conv1.weight": 0.35815510296664155,
            "layers.7.conv2.weight": 0.35815510296664155,
            "classifier.weight": 1.0,
        },
        "groups": {
            "stem.0": ["stem.0.weight", "stem.1.weight", "stem.1.bias"],
            "layers.0.conv1": [
                "layers.0.conv1.weight",
                "layers.0.norm1.weight",
                "layers.0.norm1.bias",
            ],
            "layers.0.conv2": [
                "layers.0.conv2.weight",
                "layers.0.norm2.weight",
                "layers.0.norm2.bias",
            ],
            "layers.1.conv1": [
                "layers.1.conv1.weight",
                "layers.1.norm1.weight",
                "layers.1.norm1.bias",
            ],
            "layers.1.conv2": [
                "layers.1.conv2.weight",
                "layers.1.norm2.weight",
                "layers.1.norm2.bias",
            ],
            "layers.2.conv1": [
                "layers.2.conv1.weight",
                "layers.2.norm1.weight",
                "layers.2.norm1.bias",
            ],
            "layers.2.conv2": [
                "layers.2.conv2.weight",
                "layers.2.norm2.weight",
                "layers.2.norm2.bias",
            ],
            "layers.2.shortcut.0": [
                "layers.2.shortcut.0.weight",
                "layers.2.shortcut.1.weight",
                "layers.2.shortcut.1.bias",
            ],
            "layers.3.conv1": [
                "layers.3.conv1.weight",
                "layers.3.norm1.weight",
                "layers.3.norm1.bias",
            ],
            "layers.3.conv2": [
                "layers.3.conv2.weight",
                "layers.3.norm2.weight",
                "layers.3.norm2.bias",
            ],
            "layers.4.conv1": [
                "layers.4.conv1.weight",
                "layers.4.norm1.weight",
                "layers.4.norm1.bias",
            ],
            "layers.4.conv2": [
                "layers.4.conv2.weight",
                "layers.4.norm2.weight",
                "layers.4.norm2.bias",
            ],
            "layers.4.shortcut.0": [
                "layers.4.shortcut.0.weight",
                "layers.4.shortcut.1.weight",
                "layers.4.shortcut.1.bias",
            ],
            "layers.5.conv1": [
                "layers.5.conv1.weight",
                "layers.5.norm1.weight",
                "layers.5.norm1.bias",
            ],
            "layers.5.conv2": [
                "layers.5.conv2.weight",
                "layers.5.norm2.weight",
                "layers.5.norm2.bias",
            ],
            "layers.6.conv1": [
                "layers.6.conv1.weight",
                "layers.6.norm1.weight",
                "layers.6.norm1.bias",
            ],
            "layers.6.conv2": [
                "layers.6.conv2.weight",
                "layers.6.norm2.weight",
                "layers.6.norm2.bias",
            ],
            "layers.6.shortcut.0": [
                "layers.6.shortcut.0.weight",
                "layers.6.shortcut.1.weight",
                "layers.6.shortcut.1.bias",
            ],
            "layers.7.conv1": [
                "layers.7.conv1.weight",
                "layers.7.norm1.weight",
                "layers.7.norm1.bias",
            ],
            "layers.7.conv2": [
                "layers.7.conv2.weight",
                "layers.7.norm2.weight",
                "layers.7.norm2.bias",
            ],
            "classifier": ["classifier.weight", "classifier.bias"],
        },
    },
    "vgg11": {
        "positions": {
            "features.0.weight": 1024,
            "features.4.weight": 256,
            "features.8.weight": 64,
            "features.11.weight": 64,
            "features.15.weight": 16,
            "features.18.weight": 16,
            "features.22.weight": 4,
            "features.25.weight": 4,
            "classifier.weight": 1,
        },
        "flops": 305539072,
        "erk": {
            "features.0.weight": 1.0,
            "features.4.weight": 1.0,
            "features.8.weight": 1.0,
            "features.11.weight": 0.8489543466564607,
            "features.15.weight": 0.6342573979846531,
            "features.18.weight": 0.4220188113205379,
            "features.22.weight": 0.4220188113205379,
            "features.25.weight": 0.4220188113205379,
            "classifier.weight": 1.0,
        },
        "groups": {
            "features.0": ["features.0.weight", "features.1.weight", "features.1.bias"],
            "features.4": ["features.4.weight", "features.5.weight", "features.5.bias"],
            "features.8": ["features.8.weight", "features.9.weight", "features.9.bias"],
            "features.11": ["features.11.weight", "features.12.weight", "features.12.bias"],
            "features.15": ["features.15.weight", "features.16.weight", "features.16.bias"],
            "features.18": ["features.18.weight", "features.19.weight", "features.19.bias"],
            "features.22": ["features.22.weight", "features.23.weight", "features.23.bias"],
            "features.25": ["features.25.weight", "features.26.weight", "features.26.bias"],
            "classifier": ["classifier.weight", "classifier.bias"],
        },
    },
    "alexnet": {
        "positions": {
            "features.0.weight": 256,
            "features.4.weight": 64,
            "features.8.weight": 16,
            "features.11.weight": 16,
            "features.14.weight": 16,
            "classifier.1.weight": 1,
            "classifier.4.weight": 1,
            "classifier.6.weight": 1,
        },
        "flops": 125485056,
        "erk": {
            "features.0.weight": 1.0,
            "features.4.weight": 1.0,
            "features.8.weight": 0.6685803511914425,
            "features.11.weight": 0.5565759109145256,
            "features.14.weight": 0.6694419238089573,
            "classifier.1.weight": 0.9304984269159251,
            "classifier.4.weight": 0.37219937076637005,
            "classifier.6.weight": 1.0,
        },
        "groups": {
            "features.0": ["features.0.weight", "features.1.weight", "features.1.bias"],
            "features.4": ["features.4.weight", "features.5.weight", "features.5.bias"],
            "features.8": ["features.8.weight", "features.9.weight", "features.9.bias"],
            "features.11": ["features.11.weight", "features.12.weight", "features.12.bias"],
            "features.14": ["features.14.weight", "features.15.weight", "features.15.bias"],
            "classifier.1": ["classifier.1.weight", "classifier.1.bias"],
            "classifier.4": ["classifier.4.weight", "classifier.4.bias"],
            "classifier.6": ["classifier.6.weight", "classifier.6.bias"],
        },
    },
}


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_bundled_models_are_unchanged(name: str) -> None:
    model = build_model(name, DEFAULT_INPUTS[name], 10, seed=0)
    want = BUNDLED[name]
    state = model.state_dict()
    shapes = {n: tuple(state[n].shape) for n in prunable_names(model)}
    assert prunable_names(model) == list(want["positions"])
    assert list(output_positions(model, DEFAULT_INPUTS[name]).items()) == list(
        want["positions"].items()
    )
    assert forward_flops(model, DEFAULT_INPUTS[name]) == want["flops"]
    assert list(sparse.erk_densities(shapes, 0.5).items()) == list(want["erk"].items())
    assert list(ldf.layer_groups(model).items()) == list(want["groups"].items())
    check_supported(model)


# ------------------------------------------------------------------------------ user models

T, FEATURES, HIDDEN, CLASSES = 7, 3, 8, 4


class DepthwiseKWS(nn.Module):
    """Keyword-spotting style: a stem conv, a depthwise-separable block, BatchNorm after
    every conv, global pooling and a Linear head. Input 1 x 6 x 6."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 3, padding=1, bias=False)
        self.bn0 = nn.BatchNorm2d(8)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.pw = nn.Conv2d(8, 16, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(16)
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.relu(self.bn0(self.stem(x)))
        x = torch.relu(self.bn1(self.dw(x)))
        x = torch.relu(self.bn2(self.pw(x)))
        return self.head(x.mean((2, 3)))  # type: ignore[no-any-return]


class Recurrent(nn.Module):
    """A regressor-shaped recurrent model over sensor windows (T x FEATURES, batch first as
    the data comes), with a classification head on the last step's output."""

    def __init__(
        self, kind: type[nn.RNNBase], *, batch_first: bool, bidirectional: bool = False
    ) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.rnn = kind(
            FEATURES, HIDDEN, num_layers=2, batch_first=batch_first, bidirectional=bidirectional
        )
        self.head = nn.Linear(HIDDEN * (2 if bidirectional else 1), CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        if not self.batch_first:
            x = x.transpose(0, 1)  # (T, N, FEATURES)
        out = self.rnn(x)[0]
        return self.head(out[:, -1] if self.batch_first else out[-1])  # type: ignore[no-any-return]


class Tokens(nn.Module):
    """Token ids (length T) -> Embedding(20, 6) -> GRU -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 6)
        self.norm = nn.LayerNorm(6)
        self.rnn = nn.GRU(6, HIDDEN, batch_first=True)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.rnn(self.norm(self.embed(x)))[0][:, -1])  # type: ignore[no-any-return]


class Residual(nn.Module):
    """A custom residual block with a learnable scale of its own."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(()))
        self.conv1 = nn.Conv1d(channels, channels, 3, padding=1)
        self.bn1 = nn.BatchNorm1d(channels)
        self.conv2 = nn.Conv1d(channels, channels, 3, padding=1, groups=2)
        self.bn2 = nn.BatchNorm1d(channels)

    def forward(self, x: Tensor) -> Tensor:
        out = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return torch.relu(x + self.alpha * out)


class ResidualNet(nn.Module):
    """Conv1d stem, two custom residual blocks, a Linear head. Input 2 x 10."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv1d(2, 4, 3, stride=2, padding=1)
        self.blocks = nn.Sequential(Residual(4), Residual(4))
        self.head = nn.Linear(4 * 5, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(self.stem(x)).flatten(1))  # type: ignore[no-any-return]


def autoencoder() -> nn.Module:
    """A linear autoencoder 12 -> 5 -> 12 (output shaped like the input)."""
    return nn.Sequential(nn.Linear(12, 5), nn.Tanh(), nn.Linear(5, 12))


def _gru_macs(sizes: list[tuple[int, int]], gates: int, directions: int = 1) -> int:
    """Per step, sum over layers and directions of numel(W_ih) + numel(W_hh), for
    (input size, hidden) per layer."""
    return directions * sum(gates * h * i + gates * h * h for i, h in sizes)


# name -> (builder, input shape, prunable names, dense FLOPs counted by hand)
USER: dict[str, tuple[Any, tuple[int, ...], list[str], int]] = {
    "kws": (
        DepthwiseKWS,
        (1, 6, 6),
        ["stem.weight", "dw.weight", "pw.weight", "head.weight"],
        # 36 output positions for each conv: 1x3x3x8, depthwise 8x1x3x3, pointwise 16x8.
        2 * (72 * 36 + 72 * 36 + 128 * 36 + 16 * CLASSES),
    ),
    "gru": (
        lambda: Recurrent(nn.GRU, batch_first=True),
        (T, FEATURES),
        ["rnn.weight_ih_l0", "rnn.weight_hh_l0", "rnn.weight_ih_l1", "rnn.weight_hh_l1"]
        + ["head.weight"],
        # GRU: 2 x (numel(W_ih) + numel(W_hh)) x T per layer, plus the head.
        2 * T * _gru_macs([(FEATURES, HIDDEN), (HIDDEN, HIDDEN)], 3) + 2 * HIDDEN * CLASSES,
    ),
    "lstm": (
        lambda: Recurrent(nn.LSTM, batch_first=False),
        (T, FEATURES),
        ["rnn.weight_ih_l0", "rnn.weight_hh_l0", "rnn.weight_ih_l1", "rnn.weight_hh_l1"]
        + ["head.weight"],
        2 * T * _gru_macs([(FEATURES, HIDDEN), (HIDDEN, HIDDEN)], 4) + 2 * HIDDEN * CLASSES,
    ),
    "bigru": (
        lambda: Recurrent(nn.GRU, batch_first=True, bidirectional=True),
        (T, FEATURES),
        [f"rnn.weight_{m}_l{k}{d}" for k in (0, 1) for d in ("", "_reverse") for m in ("ih", "hh")]
        + ["head.weight"],
        # The second layer reads both directions' outputs (2 x HIDDEN).
        2 * T * _gru_macs([(FEATURES, HIDDEN), (2 * HIDDEN, HIDDEN)], 3, directions=2)
        + 2 * 2 * HIDDEN * CLASSES,
    ),
    "tokens": (
        Tokens,
        (5,),
        ["rnn.weight_ih_l0", "rnn.weight_hh_l0", "head.weight"],
        2 * 5 * _gru_macs([(6, HIDDEN)], 3) + 2 * HIDDEN * CLASSES,  # no embedding MACs
    ),
    "residual": (
        ResidualNet,
        (2, 10),
        ["stem.weight"]
        + [f"blocks.{b}.conv{c}.weight" for b in (0, 1) for c in (1, 2)]
        + ["head.weight"],
        # 5 output positions; conv2 has groups=2: 4 x 2 x 3 weights, 2 x 3 MACs per output.
        2 * (4 * 2 * 3 * 5 + 2 * (4 * 4 * 3 + 4 * 2 * 3) * 5 + 20 * CLASSES),
    ),
    "autoencoder": (autoencoder, (12,), ["0.weight", "2.weight"], 2 * (12 * 5 + 5 * 12)),
}


def _build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model: nn.Module = USER[name][0]()
    return model


def _sample(name: str, n: int, generator: torch.Generator) -> Tensor:
    shape = USER[name][1]
    if name == "tokens":
        return torch.randint(0, 20, (n, *shape), generator=generator)
    return torch.randn(n, *shape, generator=generator)


@pytest.mark.parametrize("name", sorted(USER))
def test_user_model_prunable_names_and_hand_counted_flops(name: str) -> None:
    model = _build(name)
    _, shape, names, flops = USER[name]
    check_supported(model)
    assert prunable_names(model) == names
    assert list(output_positions(model, shape)) == names
    assert forward_flops(model, shape) == flops
    assert model.training  # the counting pass leaves the mode alone
    out = model(_sample(name, 2, torch.Generator().manual_seed(0)))
    assert out.shape == ((2, CLASSES) if name != "autoencoder" else (2, 12))


@pytest.mark.filterwarnings("ignore:LSTM with projections")
def test_recurrent_positions_are_time_steps_whatever_the_layout() -> None:
    for batch_first in (True, False):
        model = Recurrent(nn.GRU, batch_first=batch_first)
        positions = output_positions(model, (T, FEATURES))
        assert {n: p for n, p in positions.items() if n.startswith("rnn.")} == dict.fromkeys(
            [f"rnn.weight_{m}_l{k}" for k in (0, 1) for m in ("ih", "hh")], T
        )
    # An LSTM with a projection: weight_hr is a matrix applied at every step too.
    lstm = nn.LSTM(FEATURES, HIDDEN, proj_size=2)
    assert prunable_names(lstm) == ["weight_ih_l0", "weight_hh_l0", "weight_hr_l0"]
    assert output_positions(lstm, (FEATURES,)) == dict.fromkeys(prunable_names(lstm), 1)
    assert forward_flops(lstm, (FEATURES,)) == 2 * (32 * FEATURES + 32 * 2 + 2 * HIDDEN)


class CellLoop(nn.Module):
    """A GRUCell stepped by hand over T steps: each call is one step."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.GRUCell(FEATURES, HIDDEN)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.zeros(x.shape[0], HIDDEN)
        for t in range(x.shape[1]):
            h = self.cell(x[:, t], h)
        return h


def test_a_cell_stepped_by_hand_counts_every_step() -> None:
    model = CellLoop()
    assert prunable_names(model) == ["cell.weight_ih", "cell.weight_hh"]
    assert forward_flops(model, (T, FEATURES)) == 2 * T * (24 * FEATURES + 24 * HIDDEN)


@pytest.mark.parametrize("name", sorted(USER))
def test_erk_densities_are_sensible(name: str) -> None:
    model = _build(name)
    state = model.state_dict()
    shapes = {n: tuple(state[n].shape) for n in prunable_names(model)}
    densities = sparse.erk_densities(shapes, 0.4)
    assert all(0.0 < d <= 1.0 for d in densities.values())
    masks = sparse.random_masks(shapes, densities, torch.Generator().manual_seed(0))
    total = sum(math.prod(s) for s in shapes.values())
    kept = sum(int(m.sum()) for m in masks.values())
    assert abs(kept - 0.4 * total) <= len(shapes) / 2  # each layer rounds by at most 1/2
    positions = output_positions(model, USER[name][1])
    assert forward_flops(model, USER[name][1], masks) == 2 * sum(
        int(masks[n].sum()) * positions[n] for n in masks
    )


def test_erk_on_recurrent_and_depthwise_shapes() -> None:
    # A depthwise kernel holds C k^2 weights (not C^2 k^2): ERK keeps it dense. A (3H x I)
    # recurrent matrix is scored like a Linear of that size, a 1x1 conv like a (C_out x C_in)
    # matrix plus its two unit dims: one eps times sum(dims) / prod(dims) for all of them.
    shapes = {"dw": (64, 1, 3, 3), "pw": (128, 64, 1, 1), "ih": (192, 40), "hh": (192, 64)}
    densities = sparse.erk_densities(shapes, 0.3)
    assert densities["dw"] == 1.0
    eps = {n: densities[n] * math.prod(shapes[n]) / sum(shapes[n]) for n in ("pw", "ih", "hh")}
    assert eps["pw"] == pytest.approx(eps["ih"]) and eps["ih"] == pytest.approx(eps["hh"])
    assert densities["hh"] < densities["pw"] < densities["ih"] < densities["dw"]
    kept = sum(densities[n] * math.prod(s) for n, s in shapes.items())
    assert kept == pytest.approx(0.3 * sum(math.prod(s) for s in shapes.values()))


@pytest.mark.parametrize("name", ["kws", "gru", "lstm", "bigru", "tokens"])
def test_masked_training_and_rigl_keep_pruned_weights_at_zero(name: str) -> None:
    model = _build(name)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    shapes = {n: tuple(state[n].shape) for n in prunable_names(model)}
    gen = torch.Generator().manual_seed(1)
    masks = sparse.random_masks(shapes, sparse.erk_densities(shapes, 0.3), gen)
    start = sparse.apply_masks(state, masks)
    x, y = _sample(name, 24, gen), torch.randint(0, CLASSES, (24,), generator=gen)
    config = SGDConfig(lr=0.2, momentum=0.9, weight_decay=0.01, batch_size=8, epochs=2)
    result = train_local(model, start, masks, x, y, config, 1, gen)
    for n, mask in masks.items():
        assert torch.all(result.state[n][~mask] == 0), n
        assert torch.any(result.state[n][mask] != start[n][mask]), n
    # RigL on the trained model: same shapes, same count per layer, applied masks are exact.
    grads, _ = dense_gradients(model, result.state, list(masks), x, y, 8, 1, gen)
    new = rigl_update(result.state, masks, grads, 0.3)
    assert {n: m.shape for n, m in new.items()} == {n: m.shape for n, m in masks.items()}
    assert all(int(new[n].sum()) == int(masks[n].sum()) for n in masks)
    assert any(not torch.equal(new[n], masks[n]) for n in masks)
    moved = sparse.apply_masks(result.state, new)
    assert all(torch.all(moved[n][~new[n]] == 0) for n in new)


# ---------------------------------------------------------------------------- FedLDF layers


def _bn(name: str) -> list[str]:
    return [f"{name}.{t}" for t in ("weight", "bias", "running_mean", "running_var")] + [
        f"{name}.num_batches_tracked"
    ]


def _rnn(layers: int, directions: int = 1) -> list[str]:
    return [
        f"rnn.{kind}_{m}_l{k}{d}"
        for k in range(layers)
        for d in ("", "_reverse")[:directions]
        for kind in ("weight", "bias")
        for m in ("ih", "hh")
    ]


USER_GROUPS: dict[str, dict[str, list[str]]] = {
    "kws": {
        "stem": ["stem.weight", *_bn("bn0")],
        "dw": ["dw.weight", *_bn("bn1")],
        "pw": ["pw.weight", *_bn("bn2")],
        "head": ["head.weight", "head.bias"],
    },
    "gru": {"rnn": _rnn(2), "head": ["head.weight", "head.bias"]},
    "lstm": {"rnn": _rnn(2), "head": ["head.weight", "head.bias"]},
    "bigru": {"rnn": _rnn(2, 2), "head": ["head.weight", "head.bias"]},
    "tokens": {
        "embed": ["embed.weight"],
        "norm": ["norm.weight", "norm.bias"],  # follows an embedding: a layer of its own
        "rnn": _rnn(1),
        "head": ["head.weight", "head.bias"],
    },
    "residual": {
        "stem": ["stem.weight", "stem.bias"],
        **{
            layer: names
            for b in (0, 1)
            for layer, names in {
                f"blocks.{b}": [f"blocks.{b}.alpha"],
                f"blocks.{b}.conv1": [f"blocks.{b}.conv1.{t}" for t in ("weight", "bias")]
                + _bn(f"blocks.{b}.bn1"),
                f"blocks.{b}.conv2": [f"blocks.{b}.conv2.{t}" for t in ("weight", "bias")]
                + _bn(f"blocks.{b}.bn2"),
            }.items()
        },
        "head": ["head.weight", "head.bias"],
    },
    "autoencoder": {"0": ["0.weight", "0.bias"], "2": ["2.weight", "2.bias"]},
}


@pytest.mark.parametrize("name", sorted(USER))
def test_user_model_layer_groups(name: str) -> None:
    model = _build(name)
    groups = ldf.layer_groups(model)
    assert list(groups.items()) == list(USER_GROUPS[name].items())
    flat = [t for names in groups.values() for t in names]
    assert sorted(flat) == sorted(model.state_dict()) and len(flat) == len(set(flat))


def test_root_module_tensors_are_the_root_layer() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(4))
            self.fc = nn.Linear(4, 2)

        def forward(self, x: Tensor) -> Tensor:
            return self.fc(x * self.scale)  # type: ignore[no-any-return]

    assert ldf.ROOT_LAYER == "(root)"
    assert ldf.layer_groups(Scaled()) == {"(root)": ["scale"], "fc": ["fc.weight", "fc.bias"]}
    linear = nn.Linear(3, 2)
    assert ldf.layer_groups(linear) == {"(root)": ["weight", "bias"]}
    assert prunable_names(linear) == ["weight"]
    assert forward_flops(linear, (3,)) == 2 * 6
    # A child can never take the root layer's name.
    clash = Scaled()
    clash.add_module("(root)", nn.Linear(1, 1))
    with pytest.raises(ValueError, match="root"):
        ldf.layer_groups(clash)


# ------------------------------------------------------------- aggregation with int buffers


def _bn_states() -> dict[str, dict[str, Tensor]]:
    """Three agents' states of the keyword-spotting model, floats perturbed and each with its
    own BatchNorm step count; inserted out of id order."""
    base = _build("kws").state_dict()
    gen = torch.Generator().manual_seed(2)
    states = {}
    for agent, steps in (("c", 9), ("a", 3), ("b", 5)):
        states[agent] = {
            n: t + torch.randn(t.shape, generator=gen)
            if t.is_floating_point()
            else torch.full_like(t, steps)
            for n, t in base.items()
        }
    return states


COUNTERS = ["bn0.num_batches_tracked", "bn1.num_batches_tracked", "bn2.num_batches_tracked"]


def test_aggregation_copies_integer_buffers_from_the_first_agent() -> None:
    states = _bn_states()
    weights = {"a": 1.0, "b": 3.0, "c": 2.0}
    for out in (sparse.aggregate_weighted(states, weights), sparse.aggregate_mean(states)):
        assert list(out) == list(states["a"])
        for n in COUNTERS:
            assert out[n].dtype == torch.int64 and out[n].shape == () and int(out[n]) == 3
            assert out[n] is not states["a"][n]
    mean = sparse.aggregate_weighted(states, weights)
    want = sum(states[i]["bn1.running_var"].double() * w for i, w in weights.items()) / 6
    assert torch.allclose(mean["bn1.running_var"], want.float())
    # Mask-based aggregation: the same rule for the integer buffers, eq. 7 for the weights.
    names = prunable_names(_build("kws"))
    masks = {n: torch.ones_like(states["a"][n], dtype=torch.bool) for n in names}
    masked = sparse.aggregate_masked({i: (s, masks) for i, s in states.items()}, masks)
    assert all(int(masked[n]) == 3 for n in COUNTERS)
    plain = sparse.aggregate_mean(states)
    assert all(torch.equal(masked[n], plain[n]) for n in plain if n not in masks)


def test_fedldf_with_integer_buffers() -> None:
    states = _bn_states()
    model = _build("kws")
    groups = ldf.layer_groups(model)
    received = {n: t.clone() for n, t in model.state_dict().items()}
    weights = {"a": 1.0, "b": 3.0, "c": 2.0}
    # n = K is FedAvg bit for bit, integer buffers included.
    divs = {i: ldf.divergences(s, received, groups) for i, s in states.items()}
    chosen = ldf.select_layers(divs, 3)
    uploads = {i: ldf.partial_state(states[i], chosen[i], groups) for i in states}
    got = ldf.aggregate_layers(uploads, weights, groups, received)
    want = sparse.aggregate_weighted(states, weights)
    assert all(torch.equal(got[n], want[n]) and got[n].dtype == want[n].dtype for n in want)
    # A layer from b and c only takes b's counter; a layer nobody sent keeps the previous one.
    part = {"b": ldf.partial_state(states["b"], ["dw"], groups), "c": states["c"]}
    out = ldf.aggregate_layers(part, weights, groups, received)
    assert int(out["bn1.num_batches_tracked"]) == 5 and int(out["bn0.num_batches_tracked"]) == 9
    alone = ldf.aggregate_layers({"b": part["b"]}, weights, groups, received)
    assert int(alone["bn0.num_batches_tracked"]) == 0
    # Counters are steps taken, not distance moved: they add nothing to a divergence.
    counted = {n: t + 100 if n in COUNTERS else t for n, t in received.items()}
    assert set(ldf.divergences(counted, received, groups).values()) == {0.0}
    # An upload whose counter is a float is refused.
    bad = {n: t.float() if n in COUNTERS else t for n, t in states["a"].items()}
    with pytest.raises(ValueError, match="bad dtype"):
        ldf.aggregate_layers({"a": bad}, weights, groups, received)


def test_aggregation_rejects_complex_and_mismatched_integer_entries() -> None:
    ints = {"a": {"n": torch.tensor(1)}, "b": {"n": torch.tensor(2, dtype=torch.int32)}}
    with pytest.raises(ValueError, match="dtype"):
        sparse.aggregate_mean(ints)
    mixed = {"a": {"n": torch.tensor(1)}, "b": {"n": torch.tensor(2.0)}}
    with pytest.raises(ValueError, match="dtype"):
        sparse.aggregate_mean(mixed)
    with pytest.raises(ValueError, match="complex"):
        sparse.aggregate_mean({"a": {"z": torch.zeros(2, dtype=torch.complex64)}})
    one = {"a": {"n": torch.tensor(4), "flag": torch.tensor([True, False])}}
    out = sparse.aggregate_mean(one)
    assert list(out) == ["n", "flag"] and all(torch.equal(out[n], one["a"][n]) for n in out)
    assert out["flag"].dtype == torch.bool  # aggregating one state returns it unchanged


# --------------------------------------------------------------------------- check_supported


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 4)
        self.decoder = nn.Linear(4, 4)
        self.decoder.weight = self.encoder.weight


def test_check_supported_names_what_it_cannot_handle() -> None:
    with pytest.raises(
        ValueError, match=r"'decoder.weight' is the same tensor as 'encoder.weight'"
    ):
        check_supported(Tied())
    shared = nn.Linear(3, 3)
    with pytest.raises(ValueError, match="tied or shared"):
        check_supported(nn.Sequential(shared, nn.ReLU(), shared))
    with pytest.raises(ValueError, match="no parameters"):
        check_supported(nn.Sequential(nn.ReLU(), nn.Flatten()))
    ints = nn.Linear(2, 2)
    ints.register_parameter("steps", nn.Parameter(torch.zeros(2, dtype=torch.long), False))
    with pytest.raises(ValueError, match="not floating point"):
        check_supported(ints)
    complex_ = nn.Linear(2, 2)
    complex_.weight = nn.Parameter(torch.zeros(2, 2, dtype=torch.complex64))
    with pytest.raises(ValueError, match="complex"):
        check_supported(complex_)
    with pytest.raises(ValueError, match="uninitialized"):
        check_supported(nn.LazyLinear(3))


def test_shared_module_breaks_the_layer_cover() -> None:
    shared = nn.Linear(3, 3)
    with pytest.raises(ValueError, match="exactly once"):
        ldf.layer_groups(nn.Sequential(shared, nn.ReLU(), shared))
