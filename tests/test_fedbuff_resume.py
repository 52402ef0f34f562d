"""A coordinator restarted in the middle of a FedBuff run goes on from its kept state: the
version, the server's model and the versions a stale update may be trained from
(`Buffer.saved`, kept at the aggregator's `state_path` after every version), so that the run
computes what it would have without the restart."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from agent.experiment import ExperimentConfig
from agent.learning import preset
from agent.runtime import encode_state
from coordinator.aggregator import Aggregator, applied
from protocol import MemoryBroker, MemoryTransport, messages

ROSTER = ["a", "b", "c"]


@pytest.fixture
def transport() -> Iterator[MemoryTransport]:
    transport = MemoryTransport(MemoryBroker(), "coordinator")
    transport.start()
    yield transport
    transport.stop()


def coordinator(transport: MemoryTransport, state_path: Path | None) -> Aggregator:
    config = ExperimentConfig(
        dataset="mnist1d",
        agents=len(ROSTER),
        seed=1,
        learning=preset("fedbuff", rounds=4, epochs=1, buffer_size=2),
    )
    return Aggregator(
        fleet="f",
        run_id="r",
        roster=ROSTER,
        config=config,
        transport=transport,
        state_path=state_path,
    )


def update(agg: Aggregator, sender: str, base: int, shift: float) -> messages.Update:
    """`sender`'s update from version `base`: the initial model shifted by `shift`."""
    weights = {n: t + shift for n, t in agg.learner.facts.initial.items()}
    return messages.Update(
        fleet="f",
        sender=sender,
        run_id="r",
        round=base + 1,
        tensors=encode_state(weights),
        num_samples=10,
        base_version=base,
    )


def offer(agg: Aggregator, message: messages.Update) -> None:
    """What the aggregator's loop does with an update (`BufferedServer.run`)."""
    assert agg.buffered is not None
    taken = agg.buffered.offer(message)
    if taken is not None and taken.version is not None:
        agg.buffered.publish(taken.version, functools.partial(applied, agg))


def test_a_restarted_coordinator_goes_on_with_its_version_and_buffer(
    transport: MemoryTransport, tmp_path: Path
) -> None:
    state = tmp_path / "server.pt"
    first, uninterrupted = coordinator(transport, state), coordinator(transport, None)
    before = [("a", 0, 0.1), ("b", 0, 0.3)]  # version 1
    after = [("c", 0, 0.2), ("a", 1, 0.4), ("b", 1, 0.5), ("c", 1, 0.6)]
    for sender, base, shift in before:
        offer(first, update(first, sender, base, shift))
        offer(uninterrupted, update(uninterrupted, sender, base, shift))
    restarted = coordinator(transport, state)
    assert restarted.buffered is not None and uninterrupted.buffered is not None
    assert restarted.buffered.buffer.version == 1
    for sender, base, shift in after:
        offer(restarted, update(restarted, sender, base, shift))
        offer(uninterrupted, update(uninterrupted, sender, base, shift))
    resumed, reference = restarted.buffered.buffer, uninterrupted.buffered.buffer
    assert resumed.version == reference.version == 3
    # c's update from version 0 is taken 1 stale against version 0's model, kept too.
    assert (
        resumed.applied
        == reference.applied
        == [[("a", 0), ("b", 0)], [("c", 1), ("a", 0)], [("b", 1), ("c", 1)]]
    )
    for name, tensor in reference.server.weights.items():
        assert torch.equal(resumed.server.weights[name], tensor), name
    assert [r.round for r in restarted.records] == [1, 2, 3]
