"""Replayed presences in a signed fleet: a valid signature is not a current message.

A member's birth, will and probe answers are signed, so nobody can forge them, but anyone
on the broker can record them and publish them again later. Here, on a real broker with a
real member: a recorded birth or answer sent as the answer to a restarting member's probe
does not block its restart, and a recorded birth or will replayed later does not change
what a receiver (an agent's `FleetMail`) believes of the member.
"""

from __future__ import annotations

import queue
import socket
import time
from collections.abc import Callable

import pytest

from agent.runtime.mail import Expected, FleetMail
from protocol import BrokerAddress, topics
from protocol.membership import Identity, connect, leave
from protocol.mqtt import MqttTransport
from protocol.signing import FleetKey

FLEET = "replays"
KEY = FleetKey(b"r" * 32)


def wait_until(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


class Recorder:
    """An eavesdropper: records every message on `topic_filter`, and publishes any again."""

    def __init__(self, address: BrokerAddress, topic_filter: str) -> None:
        self.heard: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.transport = MqttTransport(address)
        self.transport.subscribe(topic_filter, lambda t, p: self.heard.put((t, p)))
        self.transport.start()
        assert self.transport.wait_subscribed(10)

    def next(self, topic: str) -> bytes:
        while True:
            heard, payload = self.heard.get(timeout=10)
            if heard == topic:
                return payload

    def replay(self, topic: str, payload: bytes, retain: bool = True) -> None:
        self.transport.publish(topic, payload, retain=retain).wait_for_publish(5)


def test_a_recorded_birth_or_answer_does_not_block_a_restart(
    embedded_address: BrokerAddress,
) -> None:
    identity = Identity(FLEET, "d7", key=KEY)
    recorder = Recorder(embedded_address, topics.fleet_root(FLEET) + "/#")
    holder = connect(embedded_address, identity)
    birth = recorder.next(identity.topic)
    # A rival's probe while d7 runs: d7's signed answer, recorded too.
    with pytest.raises(Exception, match="already in use"):
        connect(embedded_address, Identity(FLEET, "d7", key=KEY))
    answer = recorder.next(topics.probe_answer(FLEET, "d7"))
    leave(holder, identity)

    def answer_every_probe(_topic: str, _payload: bytes) -> None:
        for old in (birth, answer):
            recorder.replay(topics.probe_answer(FLEET, "d7"), old, retain=False)

    recorder.transport.subscribe(topics.probe(FLEET, "d7"), answer_every_probe)
    assert recorder.transport.wait_subscribed(10)
    restarted = connect(embedded_address, Identity(FLEET, "d7", key=KEY))
    assert restarted.connected or restarted.wait_connected(10)
    leave(restarted, identity)
    recorder.transport.stop()


def receiver(address: BrokerAddress) -> tuple[MqttTransport, FleetMail]:
    """What an agent of a run with d7 believes of d7's presence."""
    mail = FleetMail(Expected(FLEET, "run-1", frozenset({"d7"}), {}, key=KEY))
    transport = MqttTransport(address)
    transport.subscribe(topics.presence(FLEET), mail.on_presence)
    transport.start()
    assert transport.wait_subscribed(10)
    return transport, mail


def test_a_recorded_birth_does_not_bring_back_a_member_that_left(
    embedded_address: BrokerAddress,
) -> None:
    identity = Identity(FLEET, "d7", key=KEY)
    recorder = Recorder(embedded_address, identity.topic)
    transport, mail = receiver(embedded_address)
    member = connect(embedded_address, identity)
    birth = recorder.next(identity.topic)
    wait_until(lambda: "d7" not in mail.offline and mail.born("d7") is not None, "the birth")
    leave(member, identity)
    wait_until(lambda: "d7" in mail.offline, "the goodbye")
    recorder.replay(identity.topic, birth)
    wait_until(lambda: mail.rejected > 0 or "d7" not in mail.offline, "the replay")
    assert "d7" in mail.offline and mail.rejected == 1
    transport.stop()
    recorder.transport.stop()


def test_a_recorded_will_does_not_make_a_live_member_look_lost(
    embedded_address: BrokerAddress,
) -> None:
    identity = Identity(FLEET, "d7", key=KEY)
    recorder = Recorder(embedded_address, identity.topic)
    transport, mail = receiver(embedded_address)
    member = connect(embedded_address, identity)
    recorder.next(identity.topic)  # the birth
    # The link drops (no DISCONNECT): the broker publishes d7's will; d7 reconnects.
    sock = member._client.socket()
    assert isinstance(sock, socket.socket)
    sock.shutdown(socket.SHUT_RDWR)
    will = recorder.next(identity.topic)
    recorder.next(identity.topic)  # the birth of d7's next connection
    wait_until(lambda: member.connects == 2 and "d7" not in mail.offline, "d7 back online")
    recorder.replay(identity.topic, will)
    wait_until(lambda: mail.rejected > 0 or "d7" in mail.offline, "the replay")
    assert "d7" not in mail.offline and mail.rejected == 1
    leave(member, identity)
    transport.stop()
    recorder.transport.stop()
