"""FedSPU on a user's own module: neuron groups read from the dataflow (torch.fx), the
whole-layer fallback with its note, and frozen entries kept bit for bit by training."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from agent.learning.config import SGDConfig
from agent.learning.freezing import (
    FreezingPlan,
    NeuronGroup,
    active_masks,
    aggregate_active,
    freezing_plan,
    neuron_groups,
)
from agent.learning.sparse import Masks, State
from agent.learning.tasks import Task
from agent.learning.training import train_local

CLASSIFICATION = Task()


def _state(model: nn.Module) -> State:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _bn(name: str) -> tuple[str, ...]:
    return tuple(f"{name}.{k}" for k in ("weight", "bias", "running_mean", "running_var"))


def _summary(groups: Sequence[NeuronGroup]) -> list[tuple[str, str, int]]:
    return [(g.name, g.consumer, g.expansion) for g in groups]


def _check_frozen_training(
    model: nn.Module,
    state: State,
    active: Masks,
    x: torch.Tensor,
    y: torch.Tensor,
    task: Task = CLASSIFICATION,
) -> None:
    """FedSPU's promise: after local training every frozen entry is bit-identical to where
    it started, and every active one moved (weight decay moves even a zero-gradient one)."""
    assert any(not bool(m.all()) for m in active.values()), "nothing is frozen"
    config = SGDConfig(lr=0.05, momentum=0.9, weight_decay=0.01, batch_size=8, epochs=1)
    seed = torch.Generator().manual_seed(1)
    out = train_local(model, state, None, x, y, config, 1, seed, frozen=active, task=task).state
    for name, mask in active.items():
        assert torch.equal(_bits(out[name][~mask]), _bits(state[name][~mask])), name
        assert bool((out[name][mask] != state[name][mask]).all()), name


def _draw(plan: FreezingPlan, state: State, seed: int = 0, fraction: float = 0.5) -> Masks:
    return active_masks(plan, state, fraction, torch.Generator().manual_seed(seed))


def _data(shape: tuple[int, ...], classes: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(24, *shape, generator=g), torch.randint(0, classes, (24,), generator=g)


# ----------------------------------------------------------------------------- user models


class FunctionalMLP(nn.Module):
    """Activations as functions, a LayerNorm and a dropout between the layers."""

    def __init__(self, input_shape: Sequence[int], num_outputs: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(math.prod(input_shape), 32)
        self.fc2 = nn.Linear(32, 16)
        self.norm = nn.LayerNorm(16)
        self.drop = nn.Dropout(0.1)
        self.out = nn.Linear(16, num_outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return self.out(self.drop(F.gelu(self.norm(self.fc2(x)))))


class BatchNormNet(nn.Module):
    def __init__(self, input_shape: Sequence[int], num_outputs: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(input_shape[0], 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(16)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, num_outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(self.pool(x).flatten(1))


class DSCNN(nn.Module):
    """A keyword-spotting depthwise-separable CNN: a stem, then depthwise 3x3 and pointwise
    1x1 convs, each with BatchNorm and ReLU, global average pooling, a classifier."""

    def __init__(self, input_shape: Sequence[int], num_outputs: int, width: int = 12) -> None:
        super().__init__()
        self.stem = nn.Conv2d(input_shape[0], width, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.Conv2d(width, width, 3, padding=1, groups=width, bias=False),
                nn.BatchNorm2d(width),
                nn.ReLU(),
                nn.Conv2d(width, width, 1, bias=False),
                nn.BatchNorm2d(width),
                nn.ReLU(),
            )
            for _ in range(2)
        )
        self.fc = nn.Linear(width, num_outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.stem(x)))
        for block in self.blocks:
            x = block(x)
        return self.fc(x.mean((2, 3)))


class Residual(nn.Module):
    """A custom residual block (not the bundled BasicBlock)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm1 = nn.GroupNorm(2, channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm2 = nn.GroupNorm(2, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.norm1(self.conv1(x)))
        return F.relu(self.norm2(self.conv2(out)) + x)


class ResidualNet(nn.Module):
    def __init__(self, input_shape: Sequence[int], num_outputs: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(input_shape[0], 8, 3, padding=1)
        self.blocks = nn.Sequential(Residual(8), Residual(8))
        self.fc = nn.Linear(8, num_outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(F.relu(self.stem(x)))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


class FlattenNet(nn.Module):
    """Conv1d, pooling and a flatten written three ways, then a two-layer head."""

    def __init__(self, input_shape: Sequence[int], num_outputs: int, how: str = "view") -> None:
        super().__init__()
        self.how = how
        self.conv = nn.Conv1d(input_shape[0], 6, 3, padding=1)
        self.pool = nn.MaxPool1d(2)
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(6 * (input_shape[1] // 2), 10)
        self.fc2 = nn.Linear(10, num_outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv(x)))
        if self.how == "view":
            x = x.view(x.size(0), -1)
        elif self.how == "module":
            x = self.flatten(x)
        else:
            x = torch.flatten(x, 1)
        return self.fc2(torch.tanh(self.fc1(x)))


class GRURegressor(nn.Module):
    def __init__(self, input_shape: Sequence[int], num_outputs: int) -> None:
        super().__init__()
        self.gru = nn.GRU(input_shape[-1], 16, batch_first=True)
        self.head = nn.Linear(16, num_outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(x)
        return self.head(out[:, -1])


class DataDependent(nn.Module):
    """Python control flow on a tensor's value, which torch.fx cannot trace."""

    def __init__(self, input_shape: Sequence[int], num_outputs: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(input_shape[0], 8)
        self.fc2 = nn.Linear(8, num_outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc1(x))
        if h.sum() > 0:
            h = h * 2
        return self.fc2(h)


class ConvAutoencoder(nn.Module):
    def __init__(self, input_shape: Sequence[int], num_outputs: int) -> None:
        super().__init__()
        c = input_shape[0]
        self.enc1 = nn.Conv2d(c, 8, 3, stride=2, padding=1)
        self.enc2 = nn.Conv2d(8, 4, 3, stride=2, padding=1)
        self.dec1 = nn.ConvTranspose2d(4, 8, 2, stride=2)
        self.dec2 = nn.ConvTranspose2d(8, c, 2, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.enc2(F.relu(self.enc1(x))))
        return torch.sigmoid(self.dec2(F.relu(self.dec1(x))))


# ------------------------------------------------------------------------------ the groups


@pytest.mark.parametrize("with_shape", [False, True])
def test_functional_mlp_groups_its_hidden_layers_and_their_layernorm(with_shape: bool) -> None:
    model = FunctionalMLP((1, 20), 3)
    plan = freezing_plan(model, (1, 20) if with_shape else None)
    assert plan.note is None and plan.layers == ()
    assert list(plan.groups) == [
        NeuronGroup("fc1", 32, ("fc1.weight", "fc1.bias"), "fc2.weight"),
        NeuronGroup(
            "fc2", 16, ("fc2.weight", "fc2.bias", "norm.weight", "norm.bias"), "out.weight"
        ),
    ]
    state = _state(model)
    active = _draw(plan, state)
    assert torch.equal(active["norm.weight"], active["fc2.bias"])
    assert bool(active["out.weight"].any(dim=1).all())  # class neurons always active
    _check_frozen_training(model, state, active, *_data((1, 20)))


def test_batchnorm_running_statistics_follow_their_unit() -> None:
    model = BatchNormNet((3, 8, 8), 3)
    plan = freezing_plan(model, (3, 8, 8))
    assert list(plan.groups) == [
        NeuronGroup("conv1", 8, ("conv1.weight", "conv1.bias", *_bn("bn1")), "conv2.weight"),
        NeuronGroup("conv2", 16, ("conv2.weight", *_bn("bn2")), "fc.weight"),
    ]
    active = _draw(plan, _state(model), fraction=0.25)
    units = active["conv1.bias"]
    assert int(units.sum()) == 2
    for name in _bn("bn1"):
        assert torch.equal(active[name], units), name
    # The 0-d int64 counter is in the state dict too; it is no unit's.
    counter = active["bn1.num_batches_tracked"]
    assert counter.dim() == 0 and bool(counter)
    assert torch.equal(active["conv2.weight"].any(dim=(0, 2, 3)), units)


def test_aggregation_copies_integer_buffers_from_the_first_agent_that_had_them() -> None:
    model = BatchNormNet((3, 8, 8), 3)
    state = _state(model)
    previous = {**state, "bn1.num_batches_tracked": torch.tensor(5)}
    mine = {**state, "bn1.num_batches_tracked": torch.tensor(9)}
    theirs = {**state, "bn1.num_batches_tracked": torch.tensor(7)}
    active = _draw(freezing_plan(model, (3, 8, 8)), state)
    out = aggregate_active(
        previous, {"b": (mine, active), "a": (theirs, active)}, {"a": 1.0, "b": 3.0}
    )
    assert out["bn1.num_batches_tracked"].dtype == torch.int64
    assert int(out["bn1.num_batches_tracked"]) == 7  # agent a's, not a mean


def test_batchnorm_net_keeps_frozen_units_and_their_statistics_when_trained() -> None:
    model = BatchNormNet((3, 8, 8), 3)
    state = _state(model)
    _check_frozen_training(
        model, state, _draw(freezing_plan(model, (3, 8, 8)), state), *_data((3, 8, 8))
    )


def test_depthwise_convs_pass_units_on_and_pointwise_convs_produce_them() -> None:
    model = DSCNN((1, 10, 6), 4)
    plan = freezing_plan(model, (1, 10, 6))
    # The depthwise outputs are no group of their own: a depthwise conv filters each
    # channel alone, so its filters join the units of the layer before it.
    assert list(plan.groups) == [
        NeuronGroup(
            "stem",
            12,
            ("stem.weight", *_bn("bn"), "blocks.0.0.weight", *_bn("blocks.0.1")),
            "blocks.0.3.weight",
        ),
        NeuronGroup(
            "blocks.0.3",
            12,
            ("blocks.0.3.weight", *_bn("blocks.0.4"), "blocks.1.0.weight", *_bn("blocks.1.1")),
            "blocks.1.3.weight",
        ),
        NeuronGroup("blocks.1.3", 12, ("blocks.1.3.weight", *_bn("blocks.1.4")), "fc.weight"),
    ]
    assert freezing_plan(model).groups == plan.groups
    active = _draw(plan, _state(model))
    depthwise = active["blocks.0.0.weight"]
    assert torch.equal(depthwise, active["bn.weight"][:, None, None, None].expand_as(depthwise))


def test_dscnn_keeps_frozen_entries_when_trained() -> None:
    model = DSCNN((1, 10, 6), 4)
    state = _state(model)
    active = _draw(freezing_plan(model, (1, 10, 6)), state)
    _check_frozen_training(model, state, active, *_data((1, 10, 6), 4))


def test_grouped_convs_produce_units_but_only_a_plain_conv_consumes_them() -> None:
    model = nn.Sequential(
        nn.Conv2d(4, 4, 3, padding=1, groups=4),  # depthwise on the input: a producer
        nn.ReLU(),
        nn.Conv2d(4, 8, 1),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1, groups=8),  # multiplier 2: channels do not pass on
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1, groups=2),  # grouped: reads a part of the channels
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 9, 3),
    )
    assert _summary(neuron_groups(model, (4, 3, 3))) == [
        ("0", "2.weight", 1),
        ("6", "9.weight", 9),
    ]


def test_only_the_inner_conv_of_a_residual_block_forms_a_group() -> None:
    model = ResidualNet((2, 6, 6), 3)
    plan = freezing_plan(model, (2, 6, 6))
    # The stem's and every conv2's channels are summed into the residual stream.
    assert list(plan.groups) == [
        NeuronGroup(
            f"blocks.{i}.conv1",
            8,
            tuple(
                f"blocks.{i}.{n}"
                for n in ("conv1.weight", "conv1.bias", "norm1.weight", "norm1.bias")
            ),
            f"blocks.{i}.conv2.weight",
        )
        for i in (0, 1)
    ]
    state = _state(model)
    active = _draw(plan, state)
    assert bool(active["stem.weight"].all()) and bool(active["blocks.0.conv2.bias"].all())
    _check_frozen_training(model, state, active, *_data((2, 6, 6)))


@pytest.mark.parametrize("how", ["view", "module", "function"])
def test_a_flatten_expands_each_channel_to_its_positions(how: str) -> None:
    model = FlattenNet((2, 10), 3, how)
    plan = freezing_plan(model, (2, 10))
    assert _summary(plan.groups) == [("conv", "fc1.weight", 5), ("fc1", "fc2.weight", 1)]
    state = _state(model)
    active = _draw(plan, state)
    columns = active["fc1.weight"].any(dim=0)
    assert torch.equal(columns, active["conv.bias"].repeat_interleave(5))
    _check_frozen_training(model, state, active, *_data((2, 10)))
    # Without shapes a view cannot be told from another reshape; a flatten can.
    without = _summary(neuron_groups(model))
    assert without == _summary(plan.groups)[(1 if how == "view" else 0) :]


def test_a_transposed_conv_ends_the_encoders_groups() -> None:
    model = ConvAutoencoder((1, 8, 8), 0)
    plan = freezing_plan(model, (1, 8, 8))
    assert _summary(plan.groups) == [("enc1", "enc2.weight", 1)]
    state = _state(model)
    x, _ = _data((1, 8, 8))
    _check_frozen_training(model, state, _draw(plan, state), x, x, Task("reconstruction"))


class _Concat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 3), nn.Linear(4, 3), nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(torch.cat([self.a(x), self.b(x)], 1)))


class _TwoConsumers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(4, 4) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.a(x))
        return self.d(F.relu(self.b(h) * self.c(h)))


class _Shared(nn.Module):
    """One layer applied twice: its rows serve two different inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.relu(self.a(F.relu(self.a(x)))))


class _Permuted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc, self.out = nn.Conv1d(2, 4, 1), nn.Linear(4, 5), nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(F.relu(self.conv(x)).permute(0, 2, 1))
        return self.out(F.relu(h).mean(1))


@pytest.mark.parametrize(
    "model, shape",
    [
        (_Concat(), (4,)),
        (_TwoConsumers(), (4,)),
        (_Shared(), (4,)),
        (_Permuted(), (2, 3)),
        (nn.Sequential(nn.Linear(4, 4), nn.PReLU(4), nn.Linear(4, 2)), (4,)),
        (nn.Sequential(nn.Linear(4, 4), nn.Softmax(1), nn.Linear(4, 2)), (4,)),
    ],
)
def test_units_used_in_any_other_way_stay_always_active(
    model: nn.Module, shape: tuple[int, ...]
) -> None:
    # A concat, several consumers, a product of two layers, a layer applied twice, a
    # permute, a per-channel parameter or an activation across units: no group, no guess.
    assert neuron_groups(model, shape) == []
    assert freezing_plan(model, shape).note is not None


# ------------------------------------------------------------------ whole-layer fallback


def test_a_gru_regressor_freezes_whole_layers_and_says_why() -> None:
    model = GRURegressor((5, 3), 1)
    plan = freezing_plan(model, (5, 3))
    assert plan.groups == ()
    assert plan.note is not None and plan.note.startswith("model has no neuron groups")
    assert plan.note.endswith("freezing whole layers instead")
    gru = ("gru.weight_ih_l0", "gru.weight_hh_l0", "gru.bias_ih_l0", "gru.bias_hh_l0")
    assert plan.layers == (("gru", gru),)  # the head, the last layer, is always active
    state = _state(model)
    draws = [_draw(plan, state, seed) for seed in range(200)]
    for masks in draws:
        assert all(bool(masks[n].all()) for n in ("head.weight", "head.bias"))
        assert len({bool(masks[n].all()) for n in gru} | {bool(masks[n].any()) for n in gru}) == 1
    trained = sum(bool(masks["gru.weight_ih_l0"].all()) for masks in draws)
    assert 70 < trained < 130  # each round with probability p = 0.5
    assert all(bool(m.all()) for m in _draw(plan, state, 0, fraction=1.0).values())
    frozen = next(m for m in draws if not bool(m["gru.weight_ih_l0"].any()))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(24, 5, 3, generator=g), torch.randn(24, 1, generator=g)
    _check_frozen_training(model, state, frozen, x, y, Task("regression"))


def test_whole_layers_are_drawn_as_a_fraction_of_the_layers() -> None:
    layers = tuple((f"l{i}", (f"l{i}.weight",)) for i in range(10))
    state = {f"l{i}.weight": torch.zeros(2) for i in range(11)}
    plan = FreezingPlan(layers=layers, note="whole layers")
    for seed in range(20):
        masks = _draw(plan, state, seed, fraction=0.3)
        assert sum(bool(masks[f"l{i}.weight"].all()) for i in range(10)) in (3, 4)
        assert bool(masks["l10.weight"].all())


def test_a_model_fx_cannot_trace_freezes_whole_layers() -> None:
    model = DataDependent((4,), 3)
    with pytest.raises(ValueError, match="torch.fx cannot trace it"):
        neuron_groups(model, (4,))
    plan = freezing_plan(model, (4,))
    assert plan.groups == () and plan.layers == (("fc1", ("fc1.weight", "fc1.bias")),)
    assert plan.note is not None and "torch.fx cannot trace it" in plan.note
    state = _state(model)
    frozen = next(
        m for s in range(50) if not bool((m := _draw(plan, state, s))["fc1.weight"].any())
    )
    _check_frozen_training(model, state, frozen, *_data((4,)))


def test_a_model_that_does_not_run_on_its_input_shape_falls_back_with_the_reason() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    plan = freezing_plan(model, (5,))
    assert plan.note is not None and "does not run on a batch of input shape (5,)" in plan.note
    assert plan.layers == (("0", ("0.weight", "0.bias")),)


def test_inference_leaves_the_model_as_it_was() -> None:
    model = BatchNormNet((3, 8, 8), 3)
    model.bn1.eval()
    before = _state(model)
    freezing_plan(model, (3, 8, 8))
    assert model.training and not model.bn1.training and model.bn2.training
    after = _state(model)
    assert all(torch.equal(before[n], after[n]) for n in before)
