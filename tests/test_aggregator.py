"""The coordinator's aggregator: what it does with bad uploads from the network."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from agent.experiment import ExperimentConfig
from agent.learning import preset
from agent.runtime import decode_state, encode_state, expected_shapes
from coordinator.aggregator import Aggregator
from protocol import MemoryBroker, MemoryTransport, messages, topics

ROSTER = ["agent-000", "agent-001", "agent-002"]
SETTLED = "test/settled"


class Recorder:
    """A subscriber to every topic: what the aggregator published; handlers of the
    aggregator's own subscriptions are called by the test."""

    def __init__(self, broker: MemoryBroker) -> None:
        self.transport = MemoryTransport(broker, "recorder")
        self.messages: list[tuple[str, bytes]] = []
        self._settled = threading.Event()
        self.transport.subscribe("#", self._on_message)
        self.transport.start()

    def _on_message(self, topic: str, payload: bytes) -> None:
        if topic == SETTLED:
            self._settled.set()
        else:
            self.messages.append((topic, payload))

    @property
    def published(self) -> list[tuple[str, bytes]]:
        """Everything published so far, once it arrived (one dispatcher thread, in arrival
        order: a marker published now comes after it)."""
        self._settled.clear()
        self.transport.publish(SETTLED, b"")
        assert self._settled.wait(5), "the marker never came"
        return list(self.messages)


Make = Callable[..., tuple[Aggregator, Recorder]]


@pytest.fixture
def aggregator() -> Iterator[Make]:
    """Makes an aggregator on an in-memory broker, with a recorder of what it publishes."""
    broker, transports = MemoryBroker(), []

    def make(strategy: str, **learning: Any) -> tuple[Aggregator, Recorder]:
        config = ExperimentConfig(
            dataset="mnist1d",
            agents=len(ROSTER),
            seed=1,
            learning=preset(strategy, rounds=2, epochs=1, **learning),
        )
        transport, recorder = MemoryTransport(broker, "coordinator"), Recorder(broker)
        transport.start()
        transports.extend([transport, recorder.transport])
        agg = Aggregator(
            fleet="f",
            run_id="r",
            roster=ROSTER,
            config=config,
            transport=transport,
            round_timeout_s=0.3,
        )
        return agg, recorder

    yield make
    for transport in transports:
        transport.stop()


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


def test_bad_uploads_are_left_out_and_the_round_goes_on(aggregator: Make) -> None:
    agg, transport = aggregator("fedavg", aggregation="mean")  # the lone upload, unclipped
    initial = agg.learner.facts.initial
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


def test_a_divergence_vector_that_does_not_cover_every_layer_is_refused(aggregator: Make) -> None:
    agg, _ = aggregator("fedldf", ldf_n=1)
    layers = list(agg.learner.facts.layer_groups)
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
def test_a_round_nobody_delivers_to_still_ends_with_a_global(
    aggregator: Make, strategy: str
) -> None:
    agg, transport = aggregator(strategy)
    agg.intake.offline = set(ROSTER)
    agg._missed = set(ROSTER)
    assert agg.run_round(1)
    ((topic, data),) = [p for p in transport.published if p[0].endswith("/global")]
    assert messages.decode(data).participants == []
