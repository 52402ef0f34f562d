"""The in-memory transport keeps MQTT's semantics as MqttTransport presents them: topic
wildcards, retained messages set, cleared and delivered on subscribe, unsubscribing,
handlers on a dispatcher thread, traffic counted in frames, and duplicates on request."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import pytest

from protocol import DEFAULT_CHUNK_SIZE, MemoryBroker, MemoryTransport, TransportOptions
from protocol.chunking import split

WAIT_S = 5.0


class Received:
    """A handler that queues (topic, payload) and the thread it ran on."""

    def __init__(self) -> None:
        self.queue: queue.Queue[tuple[str, bytes, str]] = queue.Queue()

    def __call__(self, topic: str, payload: bytes) -> None:
        self.queue.put((topic, payload, threading.current_thread().name))

    def take(self, n: int) -> list[tuple[str, bytes]]:
        return [self.queue.get(timeout=WAIT_S)[:2] for _ in range(n)]

    def none_left(self) -> bool:
        """Nothing more comes (a marker published last arrives after anything before it)."""
        return self.queue.empty()


@pytest.fixture
def broker() -> MemoryBroker:
    return MemoryBroker()


@pytest.fixture
def pair(broker: MemoryBroker) -> Iterator[tuple[MemoryTransport, MemoryTransport]]:
    with MemoryTransport(broker, "a") as a, MemoryTransport(broker, "b") as b:
        yield a, b


def settle(transport: MemoryTransport, received: Received) -> None:
    """Wait until what was published before has been handled: a marker sent last comes last
    (one dispatcher thread, in arrival order)."""
    marker = Received()
    transport.subscribe("settle/#", marker)
    transport.publish("settle/now", b"")
    marker.take(1)
    transport.unsubscribe("settle/#")


def test_wildcards_match_as_a_broker_matches_them(
    pair: tuple[MemoryTransport, MemoryTransport],
) -> None:
    a, b = pair
    plus, hash_, exact = Received(), Received(), Received()
    b.subscribe("fl/+/status", plus)
    b.subscribe("fl/#", hash_)
    b.subscribe("fl/x/status", exact)
    for topic in ("fl/x/status", "fl/y/status", "fl/x/status/deeper", "other/x/status"):
        a.publish(topic, topic.encode())
    settle(b, plus)
    assert plus.take(2) == [("fl/x/status", b"fl/x/status"), ("fl/y/status", b"fl/y/status")]
    assert [t for t, _ in hash_.take(3)] == ["fl/x/status", "fl/y/status", "fl/x/status/deeper"]
    assert exact.take(1) == [("fl/x/status", b"fl/x/status")]
    assert plus.none_left() and hash_.none_left() and exact.none_left()


def test_a_new_subscription_gets_the_retained_message_first_and_an_empty_one_clears_it(
    pair: tuple[MemoryTransport, MemoryTransport], broker: MemoryBroker
) -> None:
    a, b = pair
    a.publish("fl/run", b"old", retain=True)
    a.publish("fl/run", b"new", retain=True)
    a.publish("fl/live", b"not retained")
    early = Received()
    b.subscribe("fl/#", early)
    a.publish("fl/run", b"after")
    assert early.take(2) == [("fl/run", b"new"), ("fl/run", b"after")]
    a.clear_retained("fl/run")
    settle(b, early)
    assert early.none_left(), "a clearing publish is no message for the handlers"
    with MemoryTransport(broker, "c") as c:
        late = Received()
        c.subscribe("fl/#", late)
        settle(c, late)
        assert late.none_left(), "cleared: nothing retained on the topic any more"
        assert c.stats["received_frames"] == 1  # the settle marker


def test_a_retained_message_must_fit_one_frame_and_plain_ones_never_reach_handlers(
    pair: tuple[MemoryTransport, MemoryTransport],
) -> None:
    a, b = pair
    with pytest.raises(ValueError, match="exceeds one frame"):
        a.publish("fl/big", bytes(DEFAULT_CHUNK_SIZE + 1), retain=True)
    got = Received()
    b.subscribe("fl/#", got)
    a.publish_plain("fl/telemetry", b'{"json": 1}')  # for readers outside the fleet
    settle(b, got)
    assert got.none_left()
    assert b.stats["dropped.malformed"] == 1


def test_unsubscribed_topics_deliver_nothing_and_a_stopped_transport_publishes_nothing(
    pair: tuple[MemoryTransport, MemoryTransport],
) -> None:
    a, b = pair
    got = Received()
    b.subscribe("fl/x", got)
    a.publish("fl/x", b"1")
    assert got.take(1) == [("fl/x", b"1")]
    b.unsubscribe("fl/x")
    a.publish("fl/x", b"2")
    settle(b, got)
    assert got.none_left()
    a.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        a.publish("fl/x", b"3")


def test_handlers_run_on_the_receivers_dispatcher_thread_in_order(
    pair: tuple[MemoryTransport, MemoryTransport],
) -> None:
    a, b = pair
    got = Received()
    b.subscribe("fl/+", got)
    for k in range(20):
        a.publish(f"fl/{k}", str(k).encode())
    seen = [got.queue.get(timeout=WAIT_S) for _ in range(20)]
    assert [p for _, p, _ in seen] == [str(k).encode() for k in range(20)]
    assert {name for _, _, name in seen} == {"memory-dispatch-b"}


def test_duplicates_hand_every_message_to_the_handlers_twice(broker: MemoryBroker) -> None:
    with MemoryTransport(broker, "a") as a, MemoryTransport(broker, "b", duplicates=True) as b:
        got = Received()
        b.subscribe("fl/x", got)
        a.publish("fl/x", b"once")
        assert got.take(2) == [("fl/x", b"once")] * 2
        assert b.stats["received_messages"] == 1, "one message, handed out twice"


def test_traffic_is_counted_in_frames_as_mqtt_transport_counts_it(broker: MemoryBroker) -> None:
    options = TransportOptions(chunk_size=1000)
    with MemoryTransport(broker, "a", options) as a, MemoryTransport(broker, "b", options) as b:
        got = Received()
        b.subscribe("fl/model", got)
        payload = bytes(range(256)) * 10  # 2560 bytes: three frames of at most 1000
        a.publish("fl/model", payload)
        assert got.take(1) == [("fl/model", payload)]
        frame_bytes = sum(map(len, split(payload, 1000)))
        sent, received = a.stats, b.stats
    assert (sent["published_messages"], sent["published_frames"]) == (1, 3)
    assert sent["published_bytes"] == received["received_bytes"] == frame_bytes
    assert (received["received_frames"], received["received_messages"]) == (3, 1)


def test_scoped_subscriptions_drop_only_what_was_subscribed_inside(
    pair: tuple[MemoryTransport, MemoryTransport],
) -> None:
    a, b = pair
    before, inside = Received(), Received()
    b.subscribe("fl/x", before)
    with b.scoped_subscriptions():
        b.subscribe("fl/x", inside)
        b.subscribe("fl/y", inside)
    a.publish("fl/x", b"1")
    a.publish("fl/y", b"2")
    assert before.take(1) == [("fl/x", b"1")]
    settle(b, inside)
    assert inside.none_left()


def test_a_reconnect_counts_and_publishes_the_kept_retained_messages_again(
    pair: tuple[MemoryTransport, MemoryTransport],
) -> None:
    a, b = pair
    got = Received()
    b.subscribe("fl/status/+", got)
    a.publish("fl/status/a", b"training", retain=True, keep=True)
    assert got.take(1) == [("fl/status/a", b"training")]
    assert a.connects == 1
    b.reconnect()
    settle(b, got)
    assert got.none_left(), "a retained message seen already is not handed out again"
    a.reconnect()
    assert a.connects == 2 and a.stats["reconnects"] == 1
    assert got.take(1) == [("fl/status/a", b"training")], "kept: published anew"


def test_a_dropped_link_misses_what_is_sent_meanwhile_and_comes_back(
    pair: tuple[MemoryTransport, MemoryTransport],
) -> None:
    a, b = pair
    received = Received()
    b.subscribe("t/#", received)
    b.drop_link(60.0)  # long enough not to come back by itself during the test
    assert not b.connected
    a.publish("t/lost", b"while down")
    b.reconnect()
    a.publish("t/kept", b"after")
    assert received.take(1) == [("t/kept", b"after")]
    assert b.connects == 2
