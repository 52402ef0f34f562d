"""A member id is claimed before it is used: a live duplicate is refused, a dead one is not.

Every test runs against amqtt and mosquitto. Connects that must succeed use a short probe
(loopback answers in milliseconds); those that must be refused end at the first answer.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from protocol import messages, topics
from protocol.membership import DuplicateMember, Identity, connect, leave
from protocol.mqtt import BrokerAddress, MqttTransport
from protocol.signing import FleetKey

if TYPE_CHECKING:
    from conftest import BrokerProcess

REPO = Path(__file__).resolve().parent.parent
FLEET = "default"
FREE_PROBE_S = 0.3
KEY = FleetKey(b"k" * 32)
OTHER_KEY = FleetKey(b"o" * 32)


@contextmanager
def member(address: BrokerAddress, identity: Identity) -> Iterator[MqttTransport]:
    """A connected member that leaves cleanly at the end of the block."""
    transport = connect(address, identity, probe_s=FREE_PROBE_S)
    try:
        assert transport.wait_connected(10)
        yield transport
    finally:
        leave(transport, identity)


def test_a_live_duplicate_is_refused_and_the_holder_keeps_its_session(
    broker: BrokerProcess,
) -> None:
    first = Identity(FLEET, "raspberrypi")
    with member(broker.address, first) as holder:
        started = time.monotonic()
        with pytest.raises(DuplicateMember) as refused:
            connect(broker.address, Identity(FLEET, "raspberrypi"))
        assert time.monotonic() - started < 1.0, "an answer should end the probe at once"
        assert "agent id 'raspberrypi' is already in use in fleet 'default'" in str(refused.value)
        assert "give this device its own --id" in str(refused.value)
        assert refused.value.since == pytest.approx(first.since)
        time.sleep(1.0)
        assert holder.connected and holder.stats["reconnects"] == 0
        with member(broker.address, Identity(FLEET, "raspberrypi-2")) as other:
            assert other.connected and holder.connected
        coordinator = Identity(FLEET, "coordinator", role="coordinator")
        with (
            member(broker.address, coordinator),
            pytest.raises(DuplicateMember, match="coordinator id 'coordinator'.*other coord"),
        ):
            connect(broker.address, Identity(FLEET, "coordinator", role="coordinator"))
    with member(broker.address, Identity(FLEET, "raspberrypi")) as after_leave:
        assert after_leave.connected


HOLDER = """
import sys, time
from protocol.membership import Identity, connect
from protocol.mqtt import BrokerAddress
transport = connect(BrokerAddress("127.0.0.1", int(sys.argv[1])), Identity("default", "pi"))
assert transport.wait_connected(10)
print("ready", flush=True)
time.sleep(600)
"""


def test_a_crashed_holder_does_not_block_its_restart(broker: BrokerProcess) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(broker.address.port)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        with pytest.raises(DuplicateMember):
            connect(broker.address, Identity(FLEET, "pi"))
        child.kill()  # SIGKILL: no goodbye, as in a crash or a power cut
        child.wait(10)
        with member(broker.address, Identity(FLEET, "pi")) as restarted:
            assert restarted.connected
    finally:
        child.kill()
        child.wait(10)


@contextmanager
def forger(address: BrokerAddress, agent: str, key: FleetKey | None) -> Iterator[None]:
    """Answers every probe for `agent` as its holder (naming the probe's nonce), signing
    with `key`."""
    with MqttTransport(address) as transport:

        def answer_probe(_topic: str, payload: bytes) -> None:
            probe = messages.decode(payload)
            assert isinstance(probe, messages.Presence)
            answer = messages.Presence(
                fleet=FLEET, sender=agent, online=True, since=1.0, reason="x", answers=probe.reason
            )
            transport.publish(topics.probe_answer(FLEET, agent), messages.encode(answer, key=key))

        transport.subscribe(topics.probe(FLEET, agent), answer_probe)
        assert transport.wait_subscribed(10)
        yield


def test_in_a_keyed_fleet_only_answers_signed_with_its_key_count(broker: BrokerProcess) -> None:
    for forged_key in (None, OTHER_KEY):
        with (
            forger(broker.address, "pi", forged_key),
            member(broker.address, Identity(FLEET, "pi", key=KEY)) as joined,
        ):
            assert joined.connected
    with forger(broker.address, "pi", KEY), pytest.raises(DuplicateMember):
        connect(broker.address, Identity(FLEET, "pi", key=KEY))


def test_two_devices_starting_together_leave_exactly_one_holder(broker: BrokerProcess) -> None:
    start = threading.Barrier(2)
    joined: list[tuple[MqttTransport, Identity]] = []
    refused: list[DuplicateMember] = []

    def claim() -> None:
        identity = Identity(FLEET, "raspberrypi")
        start.wait()
        try:
            joined.append((connect(broker.address, identity, probe_s=1.0), identity))
        except DuplicateMember as exc:
            refused.append(exc)

    threads = [threading.Thread(target=claim) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    try:
        assert (len(joined), len(refused)) == (1, 1)
        assert joined[0][0].wait_connected(10)
        time.sleep(0.5)
        assert joined[0][0].stats["reconnects"] == 0
    finally:
        for transport, identity in joined:
            leave(transport, identity)


def test_a_member_started_before_its_broker_connects_when_it_comes(
    broker: BrokerProcess,
) -> None:
    broker.kill()
    identity = Identity(FLEET, "pi")
    started = time.monotonic()
    transport = connect(broker.address, identity, probe_s=FREE_PROBE_S, broker_wait_s=0.5)
    try:
        assert time.monotonic() - started < 3.0 and not transport.connected
        broker.start()
        assert transport.wait_connected(15)
    finally:
        leave(transport, identity)
