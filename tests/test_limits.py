"""Bounded memory against hostile input: limits from the run's model, partial reassembly,
the delivery queue, the inbox's window of rounds, `num_samples`, and requests."""

from __future__ import annotations

import hashlib
import os

import msgpack
import pytest
import torch

from agent.runtime import Expected, Inbox, expected_shapes, model_message
from agent.runtime.inbox import SESSIONS_ANSWERED
from protocol import messages, topics
from protocol.chunking import MAGIC, FrameError, Reassembler, split
from protocol.limits import HEADROOM_BYTES, Limits, dense_model_bytes, limits_for_shapes
from protocol.mqtt import Dispatcher

FLEET, RUN = "lab", "run-1"
WEIGHTS = {
    "fc.weight": torch.randn(64, 100),
    "fc.bias": torch.randn(64),
    "bn.num_batches_tracked": torch.tensor(3),
}
SHAPES = expected_shapes(WEIGHTS)


def first_chunk(total: int, chunk_size: int = 1000) -> bytes:
    """The first chunk of a message that declares `total` bytes and never sends the rest."""
    count = -(-total // chunk_size)
    header = [MAGIC, 1, os.urandom(16), 0, count, chunk_size, total, hashlib.sha256().digest()]
    return msgpack.packb(header) + os.urandom(chunk_size)


def model_payload(sender: str, round_: int, num_samples: int = 5) -> bytes:
    return model_message(
        fleet=FLEET,
        sender=sender,
        run_id=RUN,
        round_=round_,
        weights=WEIGHTS,
        masks=None,
        num_samples=num_samples,
    )


def test_model_limits_admit_the_model_and_little_more() -> None:
    limits = limits_for_shapes(SHAPES, margin=1.5, headroom=0)
    dense = len(model_payload("a", 1))
    assert dense <= dense_model_bytes(SHAPES) <= limits.max_message_bytes
    assert limits.max_message_bytes <= 2 * dense  # tight: not the 2 GiB default
    default = limits_for_shapes(SHAPES, concurrent=3)
    assert default.max_message_bytes < HEADROOM_BYTES + 2 * dense
    assert default.max_partial_bytes == default.max_queued_bytes == 3 * default.max_message_bytes
    assert limits_for_shapes(SHAPES, base=Limits(max_message_bytes=100)).max_message_bytes == 100
    with pytest.raises(ValueError):
        limits_for_shapes(SHAPES, margin=0.5)


def test_a_huge_declared_size_is_dropped_on_its_header() -> None:
    reassembler = Reassembler(Limits(max_message_bytes=10_000, max_partial_bytes=40_000))
    with pytest.raises(FrameError) as err:
        reassembler.feed("t", first_chunk(512 << 20))
    assert err.value.reason == "too_large" and reassembler.pending == 0


def test_a_flood_of_first_chunks_stays_within_the_bounds() -> None:
    limits = Limits(max_message_bytes=10_000, max_partial_bytes=40_000, max_partials=20)
    reassembler = Reassembler(limits)
    for n in range(2000):
        reassembler.feed(f"t/{n % 50}", first_chunk(9000))
        assert reassembler.buffered_bytes <= 40_000 and reassembler.pending <= 20
    assert reassembler.counts["evicted"] > 1900
    # A real message still gets through the flood.
    payload = os.urandom(5000)
    frames = split(payload, 1000)
    got = [reassembler.feed("t/real", frame) for frame in frames]
    assert got[-1] == payload


def test_one_source_cannot_evict_the_partials_of_others() -> None:
    reassembler = Reassembler(Limits(max_partials_per_source=2))
    payload = os.urandom(3000)
    frames = split(payload, 1000)
    reassembler.feed("peer", frames[0])
    for _ in range(100):
        reassembler.feed("hostile", first_chunk(3000))
    assert reassembler.pending == 3 and reassembler.counts["evicted_source"] == 98
    assert [reassembler.feed("peer", f) for f in frames[1:]] == [None, payload]


def test_tightened_limits_drop_partials_above_them() -> None:
    reassembler = Reassembler()
    reassembler.feed("big", first_chunk(50_000))
    reassembler.feed("small", first_chunk(5_000))
    reassembler.set_limits(Limits(max_message_bytes=10_000, max_partial_bytes=10_000))
    assert reassembler.pending == 1 and reassembler.buffered_bytes == 1000
    assert reassembler.max_buffered_bytes == 10_000


def test_the_delivery_queue_is_bounded() -> None:
    counted: list[str] = []
    dispatcher = Dispatcher("test", counted.append, Limits(max_queued_messages=3))
    assert all(dispatcher.put("t", b"x", []) for _ in range(3))
    assert not dispatcher.put("t", b"x", [])
    by_bytes = Dispatcher("test", counted.append, Limits(max_queued_bytes=10))
    assert by_bytes.put("t", b"x" * 6, []) and not by_bytes.put("t", b"x" * 6, [])
    delivered: list[bytes] = []
    by_bytes.start()
    by_bytes.stop(5.0)
    assert by_bytes.put("t", b"y" * 10, [lambda topic, data: delivered.append(data)])


def inbox(**options: object) -> Inbox:
    return Inbox(Expected(FLEET, RUN, frozenset({"a", "b"}), SHAPES), **options)  # type: ignore[arg-type]


def test_models_of_rounds_far_ahead_are_dropped() -> None:
    box = inbox(rounds_ahead=2)
    box.at_round(1)
    for round_ in (1, 4, 5, 1000):
        box.on_model(topics.round_topic(FLEET, round_, "model", "b"), model_payload("b", round_))
    assert box.model(4, "b") is not None
    assert box.model(5, "b") is None and box.model(1000, "b") is None
    assert box.dropped["future_round"] == 2 and box.rejected == 0
    box.forget_before(3)  # round 5 is being run: round 7 is within the window now
    box.on_model(topics.round_topic(FLEET, 7, "model", "b"), model_payload("b", 7))
    assert box.model(7, "b") is not None


def test_a_resumed_agent_keeps_the_rounds_ahead_of_its_checkpoint() -> None:
    box = inbox(rounds_ahead=2)
    box.at_round(1)
    topic = topics.round_topic(FLEET, 12, "model", "b")
    box.on_model(topic, model_payload("b", 12))
    assert box.model(12, "b") is None
    restored = inbox(rounds_ahead=2)
    box.on_model(topics.round_topic(FLEET, 4, "model", "b"), model_payload("b", 4))
    held = box.model(4, "b")
    assert held is not None
    restored.put_model(10, "a", held)  # resuming into round 10 or 11
    restored.on_model(topic, model_payload("b", 12))
    assert restored.model(12, "b") is not None
    unknown = inbox(rounds_ahead=2)  # a resumed agent before it knows its round keeps all
    unknown.on_model(topic, model_payload("b", 12))
    assert unknown.model(12, "b") is not None


@pytest.mark.parametrize("num_samples", [0, 10**15])
def test_num_samples_outside_the_allowed_range_is_rejected(num_samples: int) -> None:
    box = inbox(limits=Limits(max_num_samples=1000))
    topic = topics.round_topic(FLEET, 1, "model", "b")
    box.on_model(topic, model_payload("b", 1, num_samples=num_samples))
    assert box.model(1, "b") is None and box.rejected == 1
    box.on_model(topic, model_payload("b", 1, num_samples=1000))
    assert box.model(1, "b") is not None


def test_a_request_is_answered_once_per_askers_session() -> None:
    box = inbox()

    def request(
        round_: int, layers: list[str] | None = None, since: float = 1.0
    ) -> messages.Request:
        return messages.Request(
            fleet=FLEET,
            sender="b",
            run_id=RUN,
            round=round_,
            target="a",
            layers=layers or [],
            since=since,
        )

    assert box.may_answer(request(1))
    assert not box.may_answer(request(1)) and not box.may_answer(request(1))
    assert box.may_answer(request(2)) and box.may_answer(request(1, ["fc"]))
    # b came back (a new session): what was in flight to it is lost, so it may ask again
    assert box.may_answer(request(1, since=10.0)) and not box.may_answer(request(1, since=10.0))
    assert box.dropped["answered"] == 3
    # a peer claiming a new session with every ask gets a few answers, not one per ask
    answered = sum(box.may_answer(request(3, since=float(s))) for s in range(100))
    assert answered == SESSIONS_ANSWERED


def test_a_vote_history_is_kept_only_when_it_fits_its_round() -> None:
    box = inbox(rounds_ahead=2)
    box.at_round(1)

    def status(round_: int, votes: str) -> bytes:
        message = messages.Status(
            fleet=FLEET,
            sender="b",
            run_id=RUN,
            round=round_,
            state="training",
            metrics={"votes": votes},
        )
        return messages.encode(message)

    box.on_status(topics.status(FLEET, "b"), status(1, "1" * 100_000))  # forged: too long
    assert box.wait_votes(1, ["b"], 0.0) == {}
    box.on_status(topics.status(FLEET, "b"), status(3, "101"))
    assert box.wait_votes(1, ["b"], 0.0) == {"b": True}
    assert box.wait_votes(2, ["b"], 0.0) == {"b": False}
    assert box.wait_votes(3, ["b"], 0.0) == {"b": True}
