"""The agent's inbox: what it accepts from the wire, what it ignores, what it rejects."""

from __future__ import annotations

import torch

from agent.runtime import Expected, Inbox, expected_shapes, model_message
from protocol import messages, topics

FLEET, RUN = "lab", "run-1"
WEIGHTS = {"fc.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3)}


def inbox() -> Inbox:
    roster = frozenset({"a", "b"})
    return Inbox(Expected(FLEET, RUN, roster, expected_shapes(WEIGHTS)))


def model_payload(sender: str, round_: int = 1, run_id: str = RUN) -> bytes:
    return model_message(
        fleet=FLEET,
        sender=sender,
        run_id=run_id,
        round_=round_,
        weights=WEIGHTS,
        masks=None,
        num_samples=5,
    )


def test_a_peer_model_is_stored_once() -> None:
    box = inbox()
    box.on_model(topics.round_topic(FLEET, 1, "model", "b"), model_payload("b"))
    box.on_model(topics.round_topic(FLEET, 1, "model", "b"), model_payload("b"))
    got = box.model(1, "b")
    assert got is not None and got.num_samples == 5
    assert torch.equal(got.weights["fc.weight"], WEIGHTS["fc.weight"])
    assert box.rejected == 0


def test_a_model_on_another_senders_topic_is_rejected() -> None:
    box = inbox()
    box.on_model(topics.round_topic(FLEET, 1, "model", "a"), model_payload("b"))
    assert box.model(1, "a") is None and box.model(1, "b") is None
    assert box.rejected == 1


def test_garbage_is_rejected_and_counted() -> None:
    box = inbox()
    box.on_model(topics.round_topic(FLEET, 1, "model", "b"), b"\x93not msgpack")
    assert box.rejected == 1


def test_members_outside_the_roster_are_ignored_quietly(caplog) -> None:
    """The coordinator's presence, or an agent of another run, is not an error."""
    box = inbox()
    presence = messages.Presence(fleet=FLEET, sender="coordinator", online=False, since=1.0)
    with caplog.at_level("WARNING"):
        box.on_presence(topics.presence(FLEET, "coordinator"), messages.encode(presence))
        box.on_model(topics.round_topic(FLEET, 1, "model", "z"), model_payload("z"))
    assert box.rejected == 0 and caplog.records == []
    assert box.offline == set() and box.model(1, "z") is None


def test_models_of_another_run_are_ignored() -> None:
    box = inbox()
    box.on_model(topics.round_topic(FLEET, 1, "model", "b"), model_payload("b", run_id="old"))
    assert box.model(1, "b") is None and box.rejected == 0
