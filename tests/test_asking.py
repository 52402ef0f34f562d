"""An agent asks its peers again only when something was lost: a model whose sender reported
the round done, everything after its own reconnect, and as a last resort after a long wait;
never every few seconds while a model is merely late (which made busy fleets send each model
again to every asker)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from agent.runtime import Expected, Inbox, expected_shapes
from agent.runtime.asking import FALLBACK_FACTOR, Asking
from protocol import MemoryBroker, MemoryTransport, messages, topics

FLEET, RUN = "lab", "run-1"
EVERY_S = 0.05


@pytest.fixture
def transport() -> Iterator[MemoryTransport]:
    """What `Asking` reads of a transport is its connect count; `reconnect` changes it."""
    with MemoryTransport(MemoryBroker(), "a") as transport:
        yield transport


def status(box: Inbox, agent: str, round_: int, state: str = "training") -> None:
    message = messages.Status(fleet=FLEET, sender=agent, run_id=RUN, round=round_, state=state)
    box.on_status(topics.status(FLEET, agent), messages.encode(message))


def setup(transport: MemoryTransport) -> tuple[Inbox, Asking]:
    box = Inbox(Expected(FLEET, RUN, frozenset({"a", "b", "c"}), expected_shapes({})))
    return box, Asking(transport, EVERY_S, box.reported_done)


def test_a_model_is_asked_for_only_once_its_sender_reported_the_round_done_a_look_ago(
    transport: MemoryTransport,
) -> None:
    box, asking = setup(transport)
    missing = {(2, "b"), (2, "c")}
    assert asking.to_ask(missing) == set()
    status(box, "b", 1)  # b is still in round 2: its model is only late
    status(box, "c", 0, state="ready")
    assert asking.to_ask(missing) == set()
    status(box, "b", 2)  # b finished round 2: its model may still be on its way
    assert asking.to_ask(missing) == set()
    assert asking.to_ask(missing) == {(2, "b")}, "still not here a look later: lost"
    assert asking.to_ask(missing) == set(), "asked once, not again at every look"
    status(box, "c", 3, state="done")
    assert asking.to_ask(missing) == set()
    assert asking.to_ask({(2, "b")}) == set(), "c's model came meanwhile: nothing to ask"


def test_everything_missing_is_asked_for_after_a_reconnect(transport: MemoryTransport) -> None:
    _, asking = setup(transport)
    missing = {(2, "b"), (2, "c")}
    assert asking.to_ask(missing) == set()
    transport.reconnect()  # the broker dropped what was queued for this agent
    assert asking.to_ask(missing) == missing
    assert asking.to_ask(missing) == set()


def test_an_agent_back_from_a_restart_asks_at_once_for_everything_missing(
    transport: MemoryTransport,
) -> None:
    box, _ = setup(transport)
    asking = Asking(transport, EVERY_S, box.reported_done, returned=True)
    missing = {(2, "b"), (3, "c")}  # published while it was gone; nobody reported them done
    assert asking.pause(EVERY_S, time.monotonic() + 10) == 0.0, "its first look comes at once"
    assert asking.to_ask(missing) == missing
    assert asking.pause(EVERY_S, time.monotonic() + 10) > 0.0
    assert asking.to_ask(missing) == set(), "then it asks as any other agent does"


def test_the_last_resort_ask_comes_late_and_ever_later(transport: MemoryTransport) -> None:
    _, asking = setup(transport)
    missing = {(2, "b")}
    first_s = FALLBACK_FACTOR * EVERY_S
    started = time.monotonic()
    while not asking.to_ask(missing):
        assert time.monotonic() - started < 10 * first_s
        time.sleep(asking.pause(EVERY_S, started + 60.0) or 0.001)
    assert time.monotonic() - started >= first_s
    again = time.monotonic()
    while not asking.to_ask(missing):
        time.sleep(asking.pause(EVERY_S, again + 60.0) or 0.001)
    assert time.monotonic() - again >= 2 * first_s


def test_the_pause_never_passes_the_deadline(transport: MemoryTransport) -> None:
    _, asking = setup(transport)
    assert asking.pause(EVERY_S, time.monotonic() + 0.01) <= 0.01
    assert asking.pause(EVERY_S, time.monotonic() - 1.0) == 0.0


def test_nothing_is_asked_while_awaited_models_keep_arriving(transport: MemoryTransport) -> None:
    box, asking = setup(transport)
    status(box, "b", 2)  # b and c reported round 2 done: their models may be queued
    status(box, "c", 2)
    missing = {(2, "a"), (2, "b"), (2, "c")}
    assert asking.to_ask(missing) == set()
    time.sleep(FALLBACK_FACTOR * EVERY_S)  # past the last resort, but the broker delivers
    assert asking.to_ask(missing - {(2, "a")}) == set(), "a's came: b's and c's are late"
    assert asking.to_ask({(2, "b")}) == set(), "c's came too"
    assert asking.to_ask({(2, "b")}) == set(), "nothing came: b is suspect"
    assert asking.to_ask({(2, "b")}) == {(2, "b")}, "still nothing a look later: lost"
