"""A new reduction is its class's file and a row of the table (issue 47): its own parameter
rides in `Reduction.setting`, which only its class reads, so the calibration, the measured
rule, the training, the round's label and what a round publishes take it with no field or
name of it anywhere else. `Head` here is a kind the project does not ship."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import ClassVar

import pytest
import torch

from agent.device.calibration import measure_costs
from agent.learning import Learner, reductions
from agent.learning.config import preset
from agent.learning.learner import LocalData
from agent.learning.model_facts import ModelFacts
from agent.learning.models import build_model, prunable_names
from agent.learning.reduction import Reduction, measured_reduction
from agent.learning.reductions import Kind
from agent.learning.reductions.base import Level, ReductionKind


class Head(ReductionKind):
    """Train only the last `setting` fraction of the layers (at least one); its row says a
    round publishes what it trained."""

    name: ClassVar[str] = "head"

    def levels(self, learner: ModelFacts) -> list[Level]:
        return [Level(fraction, self.at(fraction)) for fraction in (0.5, 0.25)]

    def trainable(self, learner: ModelFacts, reduction: Reduction) -> set[str] | None:
        fraction = self.setting(reduction)
        if fraction is None:
            return None
        layers = learner.forward_layers
        count = max(1, math.floor(fraction * len(layers)))
        return {name for layer in layers[-count:] for name in layer.tensors}


@pytest.fixture
def head() -> Iterator[ReductionKind]:
    """`Head` in the table, as its row would put it there, for one test."""
    row = Kind(Head.name, f"{__name__}:Head", sends_part=True)
    table, kinds = reductions.TABLE, dict(reductions.KINDS)
    reductions.TABLE, reductions.KINDS[Head.name] = (*table, row), row
    try:
        yield reductions.kind(Head.name)
    finally:
        reductions.TABLE = table
        reductions.KINDS.clear()
        reductions.KINDS.update(kinds)
        reductions.kind.cache_clear()


def learner_and_data() -> tuple[Learner, LocalData]:
    model = build_model("cnn2d", (1, 8, 8), 10, seed=1)
    config = preset("dfedavgm", reduce=Head.name, wire="full", epochs=1, batch_size=16)
    learner = Learner(model, (1, 8, 8), prunable_names(model), config, seed=1)
    x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))
    return learner, LocalData(x, y, x[:8], y[:8], x[:8], y[:8])


def test_a_new_kind_is_measured_chosen_trained_and_published_by_its_file_alone(
    head: ReductionKind,
) -> None:
    learner, data = learner_and_data()
    table = measure_costs(learner.facts, data, batch_size=16, kinds=(Head.name,))
    assert sorted((row.kind, row.level) for row in table.rows) == [("head", 0.25), ("head", 0.5)]
    half = next(row for row in table.rows if row.level == 0.5)
    chosen = measured_reduction(table, (Head.name,), table.fraction(half), 0, None, 16)
    assert (chosen.kind, chosen.setting, chosen.label) == ("head", 0.5, "head")
    fewer = measured_reduction(table, (Head.name,), 0.001, 0, None, 16)
    assert fewer.label == "head+steps" and fewer.step_fraction is not None

    agent = learner.init_agent("a")
    result = learner.local_round(agent, data, {}, 1, False, chosen)
    trained = head.trainable(learner.facts, chosen)
    assert trained and len(trained) < len(agent.weights)
    changed = {n for n, w in result.state.weights.items() if not torch.equal(w, agent.weights[n])}
    assert changed and changed <= trained
    assert set(result.published.weights) == trained & set(agent.weights)
    assert chosen.figures() == {}  # no field of its own in the round's record
