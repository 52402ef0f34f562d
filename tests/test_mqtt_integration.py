"""MqttTransport against real brokers (amqtt and mosquitto) on loopback.

Every test that takes the `broker` fixture runs against both. Waits are bounded; backoff
and keepalive are short so crashes and restarts are noticed within seconds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import queue
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from coordinator.broker import BrokerStartError, EmbeddedBroker
from protocol import (
    MAGIC,
    BrokerAddress,
    MqttTransport,
    PublishQueueFull,
    TlsOptions,
    TransportOptions,
    fits_one_frame,
    messages,
    split,
    topics,
)

if TYPE_CHECKING:
    from conftest import BrokerProcess

REPO = Path(__file__).resolve().parent.parent
FLEET = "itest"
WAIT_S = 20.0
FAST = TransportOptions(keepalive_s=5, backoff_min_s=0.1, backoff_max_s=1.0)

pytestmark = pytest.mark.timeout(120)


def options(client_id: str, **changes: Any) -> TransportOptions:
    return dataclasses.replace(FAST, client_id=client_id, **changes)


@contextmanager
def transport(
    address: BrokerAddress,
    client_id: str,
    *,
    subscribe: dict[str, Callable[[str, bytes], None]] | None = None,
    **kw: Any,
) -> Iterator[MqttTransport]:
    """A started transport, connected and subscribed before the test body runs."""
    t = MqttTransport(address, options(client_id), **kw)
    for topic_filter, handler in (subscribe or {}).items():
        t.subscribe(topic_filter, handler)
    t.start()
    try:
        assert t.wait_subscribed(WAIT_S), f"{client_id} did not connect to {address}"
        yield t
    finally:
        t.stop()


def collector() -> tuple[queue.Queue[tuple[str, bytes]], Callable[[str, bytes], None]]:
    received: queue.Queue[tuple[str, bytes]] = queue.Queue()
    return received, lambda topic, payload: received.put((topic, payload))


def until(condition: Callable[[], bool], timeout_s: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def presence(sender: str, online: bool) -> bytes:
    return messages.encode(
        messages.Presence(fleet=FLEET, sender=sender, online=online, since=time.time())
    )


def next_presence(received: queue.Queue[tuple[str, bytes]], sender: str) -> messages.Presence:
    deadline = time.monotonic() + WAIT_S
    while True:
        _, payload = received.get(timeout=max(0.01, deadline - time.monotonic()))
        message = messages.decode(payload)
        assert isinstance(message, messages.Presence)
        if message.sender == sender:
            return message


@contextmanager
def raw_client(address: BrokerAddress) -> Iterator[paho.Client]:
    """A plain paho client, to put frames on the wire that MqttTransport would never send."""
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"raw-{os.getpid()}")
    client.connect(address.host, address.port)
    client.loop_start()
    try:
        yield client
    finally:
        client.disconnect()
        client.loop_stop()


def test_20_mb_message_reaches_three_subscribers_uploaded_once(broker: BrokerProcess) -> None:
    payload = os.urandom(20 << 20)
    topic = topics.round_topic(FLEET, 3, "model", "a1")
    received, handler = collector()
    with (
        transport(
            broker.address, "s1", subscribe={topics.round_topic(FLEET, "+", "model"): handler}
        ),
        transport(broker.address, "s2", subscribe={topic: handler}) as s2,
        transport(broker.address, "s3", subscribe={f"fl/v1/{FLEET}/#": handler}),
        transport(broker.address, "a1") as publisher,
    ):
        assert publisher.publish(topic, payload).wait_for_publish(WAIT_S)
        digests = [hashlib.sha256(received.get(timeout=WAIT_S)[1]).digest() for _ in range(3)]
        assert digests == [hashlib.sha256(payload).digest()] * 3
        stats = publisher.stats
        assert stats["published_messages"] == 1 and stats["published_frames"] == 80
        assert len(payload) < stats["published_bytes"] < len(payload) * 1.001
        assert s2.stats["received_messages"] == 1
        assert received.empty()


WILL_CLIENT = """
import sys, time
from protocol import messages, topics
from protocol import BrokerAddress, MqttTransport, TransportOptions
fleet, agent, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
topic = topics.presence(fleet, agent)
def presence(online):
    return messages.encode(messages.Presence(fleet=fleet, sender=agent, online=online, since=1.0))
transport = MqttTransport(
    BrokerAddress("127.0.0.1", port),
    TransportOptions(client_id=agent, keepalive_s=2, backoff_min_s=0.1, backoff_max_s=1.0),
    will=(topic, presence(False)),
    birth=(topic, presence(True)),
)
transport.start()
time.sleep(600)
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["sigkill", "sigstop"])
def test_crashed_client_gets_its_retained_will(broker: BrokerProcess, sig: signal.Signals) -> None:
    """SIGKILL closes the socket; SIGSTOP leaves it half-open, found by the keepalive check."""
    received, handler = collector()
    with transport(broker.address, "observer", subscribe={topics.presence(FLEET): handler}):
        child = subprocess.Popen(
            [sys.executable, "-c", WILL_CLIENT, FLEET, "crasher", str(broker.address.port)],
            cwd=REPO,
        )
        try:
            assert next_presence(received, "crasher").online
            child.send_signal(sig)
            assert not next_presence(received, "crasher").online
        finally:
            child.kill()
            child.wait(10)
    late, late_handler = collector()
    with transport(broker.address, "late", subscribe={topics.presence(FLEET): late_handler}):
        assert not next_presence(late, "crasher").online  # retained


def test_client_recovers_by_itself_after_broker_restart(broker: BrokerProcess) -> None:
    births, birth_handler = collector()
    inbox, inbox_handler = collector()
    topic = topics.presence(FLEET, "survivor")
    with (
        transport(
            broker.address, "observer", subscribe={topics.presence(FLEET): birth_handler}
        ) as obs,
        transport(
            broker.address,
            "survivor",
            subscribe={"x/#": inbox_handler},
            birth=(topic, presence("survivor", True)),
        ) as survivor,
    ):
        assert next_presence(births, "survivor").online
        broker.kill()
        assert until(lambda: not survivor.connected and not obs.connected)
        broker.start()
        assert survivor.wait_subscribed(WAIT_S) and obs.wait_subscribed(WAIT_S)
        assert next_presence(births, "survivor").online  # the birth was republished
        with transport(broker.address, "sender") as sender:
            assert sender.publish("x/after", b"hello again").wait_for_publish(WAIT_S)
        assert inbox.get(timeout=WAIT_S) == ("x/after", b"hello again")
        assert survivor.stats["reconnects"] >= 1


def test_first_connection_waits_for_a_broker_that_starts_later(broker: BrokerProcess) -> None:
    broker.kill()
    late = MqttTransport(broker.address, options("early-bird"))
    late.start()
    try:
        time.sleep(1.0)
        assert not late.connected
        broker.start()
        assert late.wait_connected(WAIT_S)
    finally:
        late.stop()


def test_duplicate_chunked_message_reaches_handler_once(broker: BrokerProcess) -> None:
    received, handler = collector()
    payload = os.urandom(300_000)
    frames = split(payload, 64 * 1024)
    with (
        transport(broker.address, "dedup", subscribe={"dup/#": handler}) as sub,
        raw_client(broker.address) as raw,
    ):
        for frame in [*frames, frames[0], *frames, frames[2]]:
            raw.publish("dup/model", frame, qos=1).wait_for_publish(WAIT_S)
        assert until(lambda: sub.stats["reassembly.duplicates"] == len(frames) + 2)
        assert received.get(timeout=WAIT_S) == ("dup/model", payload)
        time.sleep(0.2)
        assert received.empty()


def test_bad_frames_are_dropped_and_counted(broker: BrokerProcess) -> None:
    received, handler = collector()
    liar = split(os.urandom(10_000), 4096)[0]
    liar = liar.replace(MAGIC.encode(), b"xyz", 1)
    corrupt = split(os.urandom(10_000), 4096)
    corrupt[1] = corrupt[1][:-1] + bytes([corrupt[1][-1] ^ 0xFF])
    with (
        transport(broker.address, "robust", subscribe={"bad/#": handler}) as sub,
        raw_client(broker.address) as raw,
        transport(broker.address, "good") as good,
    ):
        for frame in [b"not a frame", liar, *corrupt, b"\xff" * 100]:
            raw.publish("bad/x", frame, qos=1).wait_for_publish(WAIT_S)
        assert until(lambda: sub.stats.get("dropped_frames", 0) == 4)
        stats = sub.stats
        assert stats["dropped.malformed"] == 3 and stats["dropped.digest"] == 1
        assert good.publish("bad/ok", b"still fine").wait_for_publish(WAIT_S)
        assert received.get(timeout=WAIT_S) == ("bad/ok", b"still fine")
        assert sub.connected


def test_failing_handler_does_not_stop_delivery(broker: BrokerProcess) -> None:
    received, handler = collector()

    def explode(topic: str, payload: bytes) -> None:
        raise RuntimeError("handler bug")

    with transport(broker.address, "brave") as sub:
        sub.subscribe("h/#", explode)
        sub.subscribe("h/#", handler)
        assert sub.wait_subscribed(WAIT_S)
        assert sub.publish("h/1", b"one").wait_for_publish(WAIT_S)
        assert sub.publish("h/2", b"two").wait_for_publish(WAIT_S)
        assert [received.get(timeout=WAIT_S)[1] for _ in range(2)] == [b"one", b"two"]
        assert until(lambda: sub.stats.get("handler_errors", 0) == 2)


def test_publish_queue_is_bounded_while_offline(unused_port: int) -> None:
    offline = MqttTransport(
        BrokerAddress("127.0.0.1", unused_port),
        options("offline", max_queued=3, queue_timeout_s=0.3, chunk_size=1000),
    )
    offline.start()
    try:
        first = offline.publish("q/1", os.urandom(1500))  # two frames
        assert not first.is_published()
        with pytest.raises(PublishQueueFull):
            offline.publish("q/2", os.urandom(1500))
        offline.publish("q/3", b"fits")
        assert offline.publish("q/4", b"qos 0 is not queued", qos=0).is_published()
        with pytest.raises(ValueError, match="never fit"):
            offline.publish("q/5", os.urandom(4000))
        with pytest.raises(ValueError, match="retained"):
            offline.publish("q/6", os.urandom(1500), retain=True)
    finally:
        offline.stop()


def test_queued_messages_are_sent_once_connected(broker: BrokerProcess) -> None:
    received, handler = collector()
    with transport(broker.address, "listener", subscribe={"later/#": handler}):
        early = MqttTransport(broker.address, options("early"))
        publication = early.publish("later/x", os.urandom(100))
        early.start()
        try:
            assert publication.wait_for_publish(WAIT_S)
            assert received.get(timeout=WAIT_S)[0] == "later/x"
        finally:
            early.stop()


@pytest.mark.mosquitto
def test_tls_and_password_are_passed_through(
    mosquitto_tls_broker: tuple[BrokerProcess, Path],
) -> None:
    broker, ca = mosquitto_tls_broker
    tls = TlsOptions(ca_certs=str(ca))
    received, handler = collector()
    secure = MqttTransport(
        broker.address, options("alice", tls=tls, username="alice", password="secret")
    )
    secure.subscribe("s/#", handler)
    secure.start()
    try:
        assert secure.wait_subscribed(WAIT_S)
        payload = os.urandom(600_000)
        assert secure.publish("s/model", payload).wait_for_publish(WAIT_S)
        assert received.get(timeout=WAIT_S) == ("s/model", payload)
    finally:
        secure.stop()
    for name, changes in [
        ("bad-password", {"tls": tls, "username": "alice", "password": "wrong"}),
        ("no-tls", {"username": "alice", "password": "secret"}),
    ]:
        refused = MqttTransport(broker.address, options(name, **changes))
        refused.start()
        try:
            assert not refused.wait_connected(1.5), name
        finally:
            refused.stop()


def test_embedded_broker_refuses_a_taken_port() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        broker = EmbeddedBroker("127.0.0.1", taken.getsockname()[1])
        with pytest.raises(BrokerStartError, match="already in use"):
            broker.start()


def test_embedded_broker_keeps_retained_messages_and_passes_full_chunks(unused_port: int) -> None:
    with EmbeddedBroker("127.0.0.1", unused_port) as broker:
        payload = os.urandom(3 * 256 * 1024)
        received, handler = collector()
        with transport(broker.address, "writer") as writer:
            assert writer.publish("r/flag", b"retained", retain=True).wait_for_publish(WAIT_S)
        with transport(broker.address, "reader", subscribe={"r/#": handler}) as reader:
            assert received.get(timeout=WAIT_S) == ("r/flag", b"retained")
            assert reader.publish("r/big", payload).wait_for_publish(WAIT_S)
            assert received.get(timeout=WAIT_S) == ("r/big", payload)
        assert broker.address == BrokerAddress("127.0.0.1", unused_port)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("broker", BrokerAddress("broker", 1883)),
        ("10.0.0.2:1884", BrokerAddress("10.0.0.2", 1884)),
        ("[::1]", BrokerAddress("::1", 1883)),
        ("[fe80::1]:8883", BrokerAddress("fe80::1", 8883)),
    ],
)
def test_broker_address_parses(text: str, expected: BrokerAddress) -> None:
    assert BrokerAddress.parse(text) == expected


@pytest.mark.parametrize("text", ["", ":1883", "host:", "host:abc", "host:0", "h:70000", "[::1"])
def test_broker_address_rejects_bad_input(text: str) -> None:
    with pytest.raises(ValueError, match="broker"):
        BrokerAddress.parse(text)


def test_a_retained_message_pushed_before_subscribing_is_still_delivered_after(
    broker: BrokerProcess,
) -> None:
    """A client that connects while another holds a filter, and subscribes later, gets the
    retained message once it subscribes (amqtt once pushed it unasked at connect, and the
    transport then swallowed the real delivery: agents never saw the run message)."""
    topic = f"{FLEET}/run"
    with transport(broker.address, "holder", subscribe={topic: lambda *_: None}) as holder:
        holder.publish(topic, b"the run", retain=True).wait_for_publish(WAIT_S)
        with transport(broker.address, "late") as late:
            received, handler = collector()
            late.subscribe(topic, handler)
            assert received.get(timeout=WAIT_S) == (topic, b"the run")


def test_a_cleared_retained_message_is_gone_and_its_clearing_is_not_a_malformed_frame(
    broker: BrokerProcess,
) -> None:
    """--wire layers retains the layers it serves and clears them when the round ages out:
    a later subscriber must not get them, and one subscribed at the clearing sees nothing."""
    kept, gone = f"{FLEET}/layer/0", f"{FLEET}/layer/1"
    received, handler = collector()
    with transport(broker.address, "server") as server:
        assert fits_one_frame(1000, server.options.chunk_size)
        assert not fits_one_frame(server.options.chunk_size + 1, server.options.chunk_size)
        for topic in (kept, gone):
            assert server.publish(topic, topic.encode(), retain=True).wait_for_publish(WAIT_S)
        with transport(broker.address, "watcher", subscribe={f"{FLEET}/layer/#": handler}) as w:
            assert sorted(received.get(timeout=WAIT_S) for _ in range(2)) == [
                (kept, kept.encode()),
                (gone, gone.encode()),
            ]
            assert server.clear_retained(gone).wait_for_publish(WAIT_S)
            assert until(lambda: w.stats.get("cleared_retained", 0) == 1)
            assert w.stats.get("dropped_frames", 0) == 0
        late_received, late_handler = collector()
        with transport(broker.address, "late", subscribe={f"{FLEET}/layer/#": late_handler}):
            assert late_received.get(timeout=WAIT_S) == (kept, kept.encode())
            with pytest.raises(queue.Empty):
                late_received.get(timeout=1.0)
        assert received.empty()


def test_the_embedded_brokers_subscription_table_can_change_while_walked(unused_port) -> None:
    """amqtt walks this table across awaits while other clients (un)subscribe; with a plain
    dict a client connecting amid a crowd lost its session (seen with 16 agents starting)."""
    with EmbeddedBroker("127.0.0.1", unused_port) as embedded:
        table = embedded._broker._subscriptions
        table.update({"a/1": [], "a/2": []})
        walked = []
        for topic in table:
            walked.append(topic)
            table[f"{topic}/new"] = []
            table.pop("a/2", None)
        for topic, _ in table.items():
            del table[topic]
        assert walked == ["a/1", "a/2"] and not table


def test_the_embedded_broker_closes_a_connection_that_does_not_start_with_connect(
    unused_port: int,
) -> None:
    """MQTT 3.1.1 [MQTT-3.1.0-1]: a first packet that is not CONNECT closes the connection.
    amqtt left it open, and a client whose PUBLISH went out ahead of its CONNECT (paho's
    reconnect has such a window) waited out its keep-alive, 30 s, for a CONNACK."""
    topic = b"fl/v1/fleet/x"
    publish = bytes([0x30, 2 + len(topic) + 4]) + len(topic).to_bytes(2, "big") + topic + b"data"
    connect = bytes([0x10, 13]) + b"\x00\x04MQTT\x04\x02\x00\x3c" + b"\x00\x01x"
    with (
        EmbeddedBroker("127.0.0.1", unused_port) as broker,
        socket.create_connection((broker.address.host, broker.address.port), 5) as raw,
    ):
        raw.sendall(publish + connect)  # the CONNECT right behind, as in paho's race
        raw.settimeout(WAIT_S)
        try:
            answer = raw.recv(16)
        except TimeoutError:
            pytest.fail("the broker kept a connection that began with a PUBLISH open")
        assert answer == b"", "the broker answered a connection that never sent CONNECT"


def test_a_filter_dropped_right_after_subscribing_receives_nothing_more(
    broker: BrokerProcess,
) -> None:
    """A run's subscriptions end with it, sometimes a moment after they were made (a keeper
    lost at a run's end). amqtt takes SUBSCRIBE and UNSUBSCRIBE packets from two queues, so
    an UNSUBSCRIBE sent before the broker acknowledged the SUBSCRIBE could be handled first
    and the subscription stayed: the device then received (and counted) every status of the
    fleet in every later run."""
    kept = [f"{FLEET}/vote/{k}/+" for k in range(8)]
    dropped = f"{FLEET}/status/+"
    with transport(broker.address, "device") as device, transport(broker.address, "peer") as peer:
        for topic_filter in [*kept, dropped]:
            device.subscribe(topic_filter, lambda *_: None)
        device.unsubscribe(dropped)
        received, handler = collector()
        device.subscribe(f"{FLEET}/marker", handler)
        assert device.wait_subscribed(WAIT_S)
        before = device.stats.get("received_frames", 0)
        peer.publish(f"{FLEET}/status/d1", b"not for the device")
        peer.publish(f"{FLEET}/marker", b"last").wait_for_publish(WAIT_S)
        assert received.get(timeout=WAIT_S) == (f"{FLEET}/marker", b"last")
        assert device.stats.get("received_frames", 0) - before == 1, "the dropped filter stayed"
