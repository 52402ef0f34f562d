"""The coordinator's aggregator: what it does with bad uploads from the network."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from agent.experiment import ExperimentConfig
from agent.learning import preset
from agent.runtime import decode_state, encode_state, expected_shapes
from coordinator.aggregator import Aggregator
from protocol import messages, topics

ROSTER = ["agent-000", "agent-001", "agent-002"]


class FakeTransport:
    """Records publishes; handlers are called by the test."""

    def __init__(self) -> None:
        self.published: list[tuple[str, bytes]] = []

    def subscribe(self, topic: str, handler: Any) -> None:
        pass

    def publish(self, topic: str, data: bytes, **_: Any) -> None:
        self.published.append((topic, data))


def aggregator(strategy: str, **learning: Any) -> tuple[Aggregator, FakeTransport]:
    config = ExperimentConfig(
        dataset="mnist1d",
        agents=len(ROSTER),
        seed=1,
        learning=preset(strategy, rounds=2, epochs=1, **learning),
    )
    transport = FakeTransport()
    agg = Aggregator(
        fleet="f",
        run_id="r",
        roster=ROSTER,
        config=config,
        transport=transport,  # type: ignore[arg-type]
        round_timeout_s=0.3,
    )
    return agg, transport


def update(sender: str, weights: dict[str, torch.Tensor], num_samples: int = 10) -> bytes:
    message = messages.Update(
        fleet="f",
        sender=sender,
        run_id="r",
        round=1,
        tensors=encode_state(weights),
        num_samples=num_samples,
    )
    return messages.encode(message)


def test_bad_uploads_are_left_out_and_the_round_goes_on() -> None:
    agg, transport = aggregator("fedavg", aggregation="mean")  # the lone upload, unclipped
    initial = agg.learner.initial
    good = {n: t + 1.0 for n, t in reversed(list(initial.items()))}  # the sender's own order
    wrong_shape = {**initial, next(iter(initial)): torch.zeros(3)}
    topic = topics.round_topic("f", 1, "update", "agent-000")
    agg.intake.on_update(topic, update("agent-000", good))
    agg.intake.on_update(
        topics.round_topic("f", 1, "update", "agent-001"), update("agent-001", initial, 0)
    )
    agg.intake.on_update(
        topics.round_topic("f", 1, "update", "agent-002"), update("agent-002", wrong_shape)
    )
    assert agg.intake.rejected == 1, "a zero-weight update is refused at once"
    assert agg.run_round(1)
    record = agg.records[-1]
    assert record.participants == ["agent-000"]
    assert record.stragglers == ["agent-001", "agent-002"]
    assert agg.error is None
    (broadcast_topic, data), *_ = [p for p in transport.published if p[0].endswith("/global")]
    weights, _ = decode_state(messages.decode(data).tensors, expected_shapes(initial))
    for name, t in initial.items():
        assert torch.equal(weights[name], t + 1.0), name
    assert list(weights) == list(initial)


def test_a_divergence_vector_that_does_not_cover_every_layer_is_refused() -> None:
    agg, _ = aggregator("fedldf", ldf_n=1)
    layers = list(agg.learner.layer_groups)
    for sender, names in (("agent-000", layers), ("agent-001", layers[:-1])):
        message = messages.Divergence(
            fleet="f", sender=sender, run_id="r", round=1, layers=names, values=[1.0] * len(names)
        )
        agg.intake.on_divergence(
            topics.round_topic("f", 1, "divergence", sender), messages.encode(message)
        )
    assert agg.intake.rejected == 1
    assert (1, "agent-000") in agg.intake.divergences and (
        1,
        "agent-001",
    ) not in agg.intake.divergences


@pytest.mark.parametrize("strategy", ["fedavg", "fedadam-ssm"])
def test_a_round_nobody_delivers_to_still_ends_with_a_global(strategy: str) -> None:
    agg, transport = aggregator(strategy)
    agg.intake.offline = set(ROSTER)
    agg._missed = set(ROSTER)
    assert agg.run_round(1)
    ((topic, data),) = [p for p in transport.published if p[0].endswith("/global")]
    assert messages.decode(data).participants == []
