"""Per-block activation checkpointing (agent/learning/checkpointing.py): the same numbers in
less memory, chosen by the budget rule when the configured batch does not fit otherwise."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from agent.device.calibration import ActivationMeter, measure_costs
from agent.learning.checkpointing import blocks, checkpointed
from agent.learning.config import SGDConfig, StrategyConfig
from agent.learning.costs import Cost, CostTable, Row
from agent.learning.learner import Learner, LocalData
from agent.learning.models import build_model, prunable_names
from agent.learning.reduction import measured_kinds, measured_reduction
from agent.learning.training import train_local


@pytest.mark.parametrize(("name", "shape"), [("cnn2d", (1, 16, 16)), ("resnet18", (3, 16, 16))])
def test_a_checkpointed_round_trains_the_same_weights_in_less_memory(name, shape) -> None:
    model = build_model(name, shape, 10, seed=1)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(32, *shape), torch.randint(0, 10, (32,))
    results = {}
    for checkpoint in (False, True):
        meter = ActivationMeter()
        with meter.measuring():
            trained = train_local(
                model,
                start,
                None,
                x,
                y,
                SGDConfig(batch_size=16, epochs=1),
                0,
                torch.Generator().manual_seed(0),
                checkpoint=checkpoint,
            )
        results[checkpoint] = (trained, meter.megabytes)
    (plain, plain_mb), (kept, kept_mb) = results[False], results[True]
    assert all(torch.equal(plain.state[n], kept.state[n]) for n in plain.state)
    assert plain.mean_loss == kept.mean_loss
    assert kept_mb < 0.6 * plain_mb
    # afterwards the model computes as before, and evaluation never checkpoints
    assert not any("forward" in vars(m) for m in model.modules())


class WithBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.ReLU()
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(4 * 4 * 4, 8), nn.ReLU(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def test_blocks_are_the_outermost_containers_and_never_hold_batchnorm() -> None:
    resnet = blocks(build_model("resnet18", (3, 16, 16), 10, seed=1))
    assert resnet["layers"] == [(i, i + 1) for i in range(8)]  # one basic block each
    assert not any(name.startswith("layers.") for name in resnet)
    user = blocks(WithBatchNorm())
    assert list(user) == ["head"]  # the body's BatchNorm would count its statistics twice
    with checkpointed(nn.Sequential(nn.Linear(3, 3))) as any_found:
        assert not any_found


def table(checkpoint_share: float) -> CostTable:
    """Dense: 1 s a step, 10 MiB fixed and 100 MiB of activations at batch 16; checkpointing
    keeps 30 MiB of them for `checkpoint_share` of the time; width 0.5 half of both."""
    return CostTable(
        key="test",
        batch_size=16,
        dense=Cost(1.0, 10.0, 100.0),
        forward_s=0.001,
        rows=(
            Row("checkpoint", 1.0, Cost(checkpoint_share, 10.0, 30.0)),
            Row("width", 0.5, Cost(0.5, 5.0, 50.0)),
        ),
    )


def test_the_rule_checkpoints_rather_than_shrinks_the_batch_when_the_time_allows() -> None:
    kinds = ("width",)
    # a whole round fits the time but not the memory: checkpointed, at the configured batch
    chosen = measured_reduction(table(1.3), kinds, 2.0, 0, 50.0, 16)
    assert chosen.checkpoint and chosen.kind == "checkpoint" and chosen.batch_size is None
    assert chosen.predicted == pytest.approx(1.3)
    assert "checkpointed" in chosen.why
    # at p_k 0.5 the narrower model fits the time; checkpointed it fits 30 MiB at batch 16
    narrow = measured_reduction(table(1.2), kinds, 0.7, 0, 30.0, 16)
    assert narrow.label == "width"
    assert (narrow.setting, narrow.checkpoint, narrow.batch_size) == (0.5, True, None)
    assert narrow.predicted == pytest.approx(0.6)
    # when checkpointing's extra time does not fit p_k, a smaller batch does it
    smaller = measured_reduction(table(1.2), kinds, 0.55, 0, 30.0, 16)
    assert smaller.label == "width"
    assert (smaller.setting, smaller.checkpoint, smaller.batch_size) == (0.5, False, 8)


def test_the_measured_modes_measure_checkpointing_too() -> None:
    assert "checkpoint" in measured_kinds("auto") and "checkpoint" in measured_kinds("width")
    assert "checkpoint" not in measured_kinds("prune")
    model = build_model("cnn2d", (1, 12, 12), 10, seed=1)
    cfg = StrategyConfig(strategy="dfedavgm", batch_size=16, reduce="width")
    learner = Learner(model, (1, 12, 12), prunable_names(model), cfg, seed=1)
    x, y = torch.randn(32, 1, 12, 12), torch.randint(0, 10, (32,))
    costs = measure_costs(
        learner.facts, LocalData(x, y, x[:2], y[:2], x[:2], y[:2]), kinds=("checkpoint",)
    )
    (row,) = costs.of_kind("checkpoint")
    assert row.cost.activation_mb < 0.6 * costs.dense.activation_mb
