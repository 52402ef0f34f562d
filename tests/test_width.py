"""Width reduction (agent/learning/width.py): a narrower sub-model that really is smaller, runs,
trains only the entries it holds and writes back bit-exactly, on the bundled models and on a
user's own module with a residual add; models it cannot narrow are refused or noted."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from agent.learning.config import SGDConfig
from agent.learning.models import build_model
from agent.learning.training import train_local
from agent.learning.width import (
    held_masks,
    narrow_model,
    narrow_state,
    rolling_selection,
    widen_state,
    width_plan,
)


class Residual(nn.Module):
    """A user's module: a stem, one residual block sharing the stem's channels, a pooled head."""

    def __init__(self, norm: bool = True) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8) if norm else nn.Identity()
        self.a = nn.Conv2d(8, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8 * 4, 10)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.relu(self.norm(self.stem(x)))
        x = x + self.b(torch.relu(self.a(x)))
        return self.head(F.adaptive_avg_pool2d(x, 2).flatten(1))


class Separable(nn.Module):
    """A user's module with a depthwise conv, a one-group GroupNorm and a LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.pointwise = nn.Conv2d(3, 16, 1)
        self.norm = nn.BatchNorm2d(16)
        self.depthwise = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.group = nn.GroupNorm(1, 16)
        self.fc = nn.Linear(16, 12)
        self.layer = nn.LayerNorm(12)
        self.out = nn.Linear(12, 10)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.relu(self.norm(self.pointwise(x)))
        x = torch.relu(self.group(self.depthwise(x))).mean((2, 3))
        return self.out(torch.relu(self.layer(self.fc(x))))


class Concat(nn.Module):
    """Two branches concatenated on channels, then a conv whose own channels are free."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.b = nn.Conv2d(3, 4, 3, padding=1)
        self.c = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 10)

    def forward(self, x: Tensor) -> Tensor:
        y = torch.cat([torch.relu(self.a(x)), torch.relu(self.b(x))], 1)
        return self.head(torch.relu(self.c(y)).mean((2, 3)))


class HardCodedView(nn.Module):
    """A conv whose output is reshaped with its full width written as a number."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.relu(self.conv(x)).view(-1, 512))


def _model(name: str) -> tuple[nn.Module, tuple[int, ...]]:
    if name in ("residual", "separable"):
        torch.manual_seed(0)
        return (Residual() if name == "residual" else Separable()), (3, 8, 8)
    shape = {"mlp": (1, 8, 8), "cnn1d": (1, 40), "cnn2d": (1, 8, 8), "resnet18": (3, 16, 16)}
    return build_model(name, shape[name], 10, seed=0), shape[name]


def _params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# Parameter counts at width 0.5, by hand: mlp 64-64-32-10, cnn2d 1-8-16 convs (GroupNorms of
# 2 channels per group) and a 16*2*2 classifier, the residual module at 4 channels.
EXPECTED_HALF = {
    "mlp": 64 * 64 + 64 + 64 * 32 + 32 + 32 * 10 + 10,
    "cnn2d": 8 * 9 + 2 * 8 + 16 * 8 * 9 + 2 * 16 + 16 * 4 * 10 + 10,
    "residual": (4 * 3 * 9 + 4) + 2 * 4 + 2 * (4 * 4 * 9 + 4) + (10 * 16 + 10),
    "separable": (8 * 3 + 8) + 2 * 8 + (8 * 9 + 8) + 2 * 8 + (6 * 8 + 6) + 2 * 6 + (10 * 6 + 10),
}
MODELS = ("mlp", "cnn1d", "cnn2d", "resnet18", "residual", "separable")


@pytest.mark.parametrize("name", MODELS)
def test_the_narrow_model_runs_is_smaller_and_writes_back_exactly(name: str) -> None:
    model, shape = _model(name)
    plan = width_plan(model, shape)
    selection = rolling_selection(plan, 0.5, 1)
    small = narrow_model(model, plan, selection)
    full = model.state_dict()
    narrow = narrow_state(full, plan, selection)
    small.load_state_dict(narrow)
    assert small(torch.randn(4, *shape)).shape == (4, 10)
    held = held_masks(full, plan, selection)
    params = dict(model.named_parameters())
    assert _params(small) == sum(int(held[n].sum()) for n in params)
    assert _params(small) < (0.26 if name == "resnet18" else 0.5) * _params(model)
    if name in EXPECTED_HALF:
        assert _params(small) == EXPECTED_HALF[name]
    widened = widen_state(full, narrow, plan, selection)
    assert widened.keys() == full.keys()
    assert all(torch.equal(widened[k], v) and widened[k].dtype == v.dtype for k, v in full.items())


@pytest.mark.parametrize("name", MODELS)
def test_training_the_narrow_model_changes_only_the_entries_it_holds(name: str) -> None:
    model, shape = _model(name)
    plan = width_plan(model, shape)
    selection = rolling_selection(plan, 0.5, 3)
    full = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(16, *shape), torch.randint(0, 10, (16,))
    config = SGDConfig(lr=0.05, batch_size=8, epochs=1)
    small = narrow_model(model, plan, selection)
    trained = train_local(
        small, narrow_state(full, plan, selection), None, x, y, config, 0, torch.Generator()
    ).state
    widened = widen_state(full, trained, plan, selection)
    held = held_masks(full, plan, selection)
    for key, before in full.items():
        assert torch.equal(widened[key][~held[key]], before[~held[key]]), key
    assert any(not torch.equal(widened[k], full[k]) for k in dict(model.named_parameters()))


def test_batch_norm_statistics_are_narrowed_per_channel_and_the_counter_copied() -> None:
    model, shape = _model("residual")
    plan = width_plan(model, shape)
    selection = rolling_selection(plan, 0.5, 1)
    full = model.state_dict()
    full["norm.running_mean"] = torch.arange(8.0)
    full["norm.num_batches_tracked"] = torch.tensor(7)
    narrow = narrow_state(full, plan, selection)
    (stream,) = [i for i, c in enumerate(plan.classes) if ("norm.running_mean", 0, 1) in c.members]
    assert torch.equal(narrow["norm.running_mean"], selection[stream].float())
    assert narrow["norm.num_batches_tracked"].item() == 7
    norm = narrow_model(model, plan, selection).get_submodule("norm")
    assert isinstance(norm, nn.BatchNorm2d) and norm.num_features == 4


def test_the_residual_stream_is_one_class_narrowed_alike_in_every_layer() -> None:
    model, shape = _model("residual")
    plan = width_plan(model, shape)
    assert plan.note is None
    members = [{name for name, _, _ in c.members} for c in plan.classes]
    assert {"stem.weight", "norm.weight", "b.weight", "a.weight", "head.weight"} <= members[0]
    assert members[1] == {"a.weight", "a.bias", "b.weight"}  # a's outputs, read by b
    assert ("head.weight", 1, 4) in plan.classes[0].members  # 2x2 positions per channel


@pytest.mark.parametrize("name", ["mlp", "plain_residual"])
def test_without_norms_the_narrow_model_is_the_full_one_with_other_channels_zeroed(
    name: str,
) -> None:
    torch.manual_seed(1)
    model, shape = (Residual(norm=False), (3, 8, 8)) if name != "mlp" else _model("mlp")
    plan = width_plan(model, shape)
    selection = rolling_selection(plan, 0.5, 1)
    full = model.state_dict()
    held = held_masks(full, plan, selection)
    x = torch.randn(5, *shape)
    small = narrow_model(model, plan, selection)
    model.load_state_dict({k: v * held[k] for k, v in full.items()})
    with torch.no_grad():
        torch.testing.assert_close(small(x), model(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fraction", [1.0, 0.7, 0.5, 0.3, 0.25, 0.2, 0.1])
@pytest.mark.parametrize("first", [0, 5])
def test_rolling_selection_trains_every_channel_within_ceil_one_over_fraction_rounds(
    fraction: float, first: int
) -> None:
    model, shape = _model("resnet18")
    plan = width_plan(model, shape)
    rounds = math.ceil(1 / fraction - 1e-9)
    seen: list[set[int]] = [set() for _ in plan.classes]
    for round_ in range(first, first + rounds):
        for cls, index, covered in zip(
            plan.classes, rolling_selection(plan, fraction, round_), seen, strict=True
        ):
            assert torch.equal(index, index.unique())  # sorted, distinct
            assert len(index) % cls.step == 0 and len(index) >= fraction * cls.size - 1e-9
            covered.update(index.tolist())
    assert all(covered == set(range(c.size)) for c, covered in zip(plan.classes, seen, strict=True))


def test_a_selection_that_splits_a_group_norm_group_is_refused() -> None:
    model, shape = _model("cnn2d")
    plan = width_plan(model, shape)
    selection = rolling_selection(plan, 0.5, 0)
    odd = (torch.arange(3), *selection[1:])
    with pytest.raises(ValueError, match="GroupNorm .* channels per group"):
        narrow_model(model, plan, odd)


def test_concatenated_channels_keep_full_width_and_the_note_says_why() -> None:
    model = Concat()
    plan = width_plan(model, (3, 8, 8))
    assert [sorted({n for n, _, _ in c.members}) for c in plan.classes] == [
        ["c.bias", "c.weight", "head.weight"]
    ]
    assert plan.note is not None and "cat" in plan.note and "\n" not in plan.note
    small = narrow_model(model, plan, rolling_selection(plan, 0.5, 0))
    assert small(torch.randn(2, 3, 8, 8)).shape == (2, 10)


def test_a_model_with_nothing_to_narrow_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="nothing to narrow.*view") as raised:
        width_plan(HardCodedView(), (3, 8, 8))
    assert "\n" not in str(raised.value)


def test_a_model_torch_fx_cannot_trace_is_refused() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            return self.fc(x) if x.sum() > 0 else x

    with pytest.raises(ValueError, match="torch.fx cannot trace"):
        width_plan(Branchy(), (4,))
