"""One identity, one client id: nobody takes another member's broker session.

MQTT gives a client id's session to its latest connection, and a member's client id
(`<fleet>-<id>`) is visible in its topics. Here an attacker connects with a victim's client
id on the embedded broker with per-device keys (no proof, a wrong proof, a replayed proof),
on the embedded broker with logins (another member's login), and on mosquitto configured
by `coordinator broker-config` (another member's login): each time the victim keeps its
connection and receives what is published after the attack. Also: retained statuses are
written only by their owner, a member reads only its own fleet, and members admitted while
the broker runs connect without a restart.
"""

from __future__ import annotations

import logging
import queue
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from coordinator.broker import EmbeddedBroker
from coordinator.broker_config import (
    COORDINATOR_IDS,
    Admission,
    Listener,
    member_password,
    write_broker_config,
)
from protocol import BrokerAddress, Identity, ProtocolError, connect, leave, topics
from protocol.acl import fleet_grants
from protocol.mqtt import MqttTransport, TransportOptions
from protocol.signing import MemberKeys, add_key, connect_proof
from tests.conftest import BrokerProcess, _require, _unused_port
from tests.processes import Processes
from tests.test_broker_acl import Client

FLEET = "f1"


class Raw(Client):
    """A plain paho client (MQTT 3.1.1) with the client id it is given: what an attacker
    controls byte for byte. One connection attempt within a test."""

    def __init__(
        self, address: BrokerAddress, client_id: str, user: str | None, password: str | None
    ) -> None:
        super().__init__(address, user, password, client_id=client_id, retry=False)


class Victim:
    """A member's own transport, subscribed to `topic_filter`, recording what it receives."""

    def __init__(self, address: BrokerAddress, options: TransportOptions, topic_filter: str):
        self.received: queue.Queue[str] = queue.Queue()
        self.transport = MqttTransport(address, options)
        self.transport.subscribe(topic_filter, lambda topic, _p: self.received.put(topic))
        self.transport.start()
        assert self.transport.wait_subscribed(10), self.transport.refused

    def still_receives(self, sender: Raw, topic: str) -> None:
        """`sender` publishes on `topic` now; the victim gets it on its first connection."""
        sender.publish(topic, frame_of(b"published after the attack"))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                if self.received.get(timeout=0.2) == topic:
                    break
            except queue.Empty:
                continue
        else:
            pytest.fail(f"the victim no longer receives {topic}")
        assert self.transport.connected and self.transport.stats["reconnects"] == 0


def frame_of(payload: bytes) -> bytes:
    from protocol.chunking import split

    return split(payload, 1 << 16)[0]


# -- the embedded broker with per-device keys -------------------------------------------------


def keyed(tmp_path: Path, *members: str) -> tuple[Path, dict[str, MemberKeys]]:
    admitted, keys = tmp_path / "admitted", {}
    for member in members:
        keys[member] = MemberKeys(member, Ed25519PrivateKey.generate())
        add_key(admitted, member, keys[member].public)
    return admitted, keys


@pytest.fixture
def keyed_broker(
    request: pytest.FixtureRequest, tmp_path: Path, unused_port: int
) -> Iterator[tuple[BrokerAddress, dict]]:
    """Per-device keys alone, or beside `broker-config` logins as `coordinator serve` runs
    by default: there a device logs in with its key's proof and never with its password."""
    admitted, keys = keyed(tmp_path, "d0", "d1")
    auth = None
    if getattr(request, "param", "keys") == "keys-and-logins":
        auth = tmp_path / "auth"
        grants = fleet_grants(FLEET, ["d0", "d1"], "gateway", COORDINATOR_IDS)
        write_broker_config(auth, FLEET, grants, Listener(unused_port, "127.0.0.1"))
    with EmbeddedBroker(port=unused_port, auth=auth, admitted=admitted, fleet=FLEET) as broker:
        if auth is not None:  # the member's own password, from a copied bundle: refused
            copied = Raw(broker.address, f"{FLEET}-d0", "d0", member_password(auth, "d0"))
            assert not copied.accepted
            copied.close()
        yield broker.address, keys


def proven(keys: MemberKeys, client_id: str | None = None) -> TransportOptions:
    return TransportOptions(client_id=client_id, credentials=connect_proof(keys))


@pytest.mark.parametrize("keyed_broker", ["keys-and-logins"], indirect=True)
def test_a_device_with_an_older_bundles_password_is_told_to_drop_it(
    keyed_broker: tuple, tmp_path: Path
) -> None:
    """Its gateway now takes its key: the refusal says what to change in its bundle."""
    address, keys = keyed_broker
    password = member_password(tmp_path / "auth", "d0")
    options = TransportOptions(username="d0", password=password)
    with pytest.raises(ProtocolError, match="remove username and password_file"):
        connect(address, Identity(FLEET, "d0", key=keys["d0"]), options, broker_wait_s=5)


@pytest.mark.parametrize("keyed_broker", ["keys", "keys-and-logins"], indirect=True)
def test_keys_a_members_client_id_takes_its_proof(keyed_broker: tuple) -> None:
    address, keys = keyed_broker
    captured: list[tuple[str, str]] = []
    prove = connect_proof(keys["d0"])

    def credentials(client_id: str) -> tuple[str, str]:
        captured.append(prove(client_id))
        return captured[-1]

    victim_id = f"{FLEET}-d0"
    options = TransportOptions(client_id=victim_id, credentials=credentials)
    victim = Victim(address, options, topics.status(FLEET, "+"))
    d1 = Raw(address, f"{FLEET}-d1", *connect_proof(keys["d1"])(f"{FLEET}-d1"))
    assert d1.accepted
    wrong_key = connect_proof(MemberKeys("d0", Ed25519PrivateKey.generate()))(victim_id)
    for user, password in [
        (None, None),  # anonymous
        wrong_key,  # a proof by another key
        captured[0],  # the victim's own CONNECT, replayed
        connect_proof(keys["d1"])(victim_id),  # another member's valid proof
    ]:
        attacker = Raw(address, victim_id, user, password)
        assert not attacker.accepted, (user, password)
        attacker.close()
        victim.still_receives(d1, topics.status(FLEET, "d1"))
    # A proof for another client id does not open this one either.
    elsewhere = Raw(address, victim_id, *connect_proof(keys["d0"])(f"{FLEET}-other"))
    assert not elsewhere.accepted
    elsewhere.close()
    victim.transport.stop()
    d1.close()


def test_keys_an_unproven_client_reads_and_probes_but_writes_no_retained_status(
    keyed_broker: tuple,
) -> None:
    address, keys = keyed_broker
    d0 = Raw(address, f"{FLEET}-d0", *connect_proof(keys["d0"])(f"{FLEET}-d0"))
    status, real = topics.status(FLEET, "d0"), frame_of(b"the real status")
    d0.publish(status, real, retain=True)
    anonymous = Raw(address, "edgefl-anything", None, None)
    assert anonymous.accepted  # reading needs no key: `coordinator status`, a prober
    anonymous.subscribe(topics.probe(FLEET, "d0"))
    anonymous.publish(topics.probe(FLEET, "d0"), b"probe")
    assert anonymous.received.get(timeout=5)[0] == topics.probe(FLEET, "d0")
    anonymous.publish(status, frame_of(b"forged"), retain=True)
    anonymous.publish(status, b"", retain=True)  # a clear is a publish too
    anonymous.publish(topics.run(FLEET), frame_of(b"forged run"), retain=True)
    d1 = Raw(address, f"{FLEET}-d1", *connect_proof(keys["d1"])(f"{FLEET}-d1"))
    d1.publish(status, frame_of(b"forged by d1"), retain=True)  # a member, not the owner
    reader = Raw(address, "edgefl-reader", None, None)
    reader.subscribe(topics.fleet_root(FLEET) + "/#")
    assert reader.received.get(timeout=5) == (status, real)
    with pytest.raises(queue.Empty):
        reader.received.get(timeout=0.5)  # no forged run either
    for client in (d0, anonymous, d1, reader):
        client.close()


def test_keys_a_proof_signs_its_time_and_one_off_the_clock_is_refused_with_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    admitted, keys = keyed(tmp_path, "d0")
    admission = Admission(admitted=admitted, fleet=FLEET)
    user, password = connect_proof(keys["d0"])(f"{FLEET}-d0")
    assert admission.refusal(f"{FLEET}-d0", user, password) is None
    when, signature = password.removeprefix("ed25519:").split(":")
    moved = f"ed25519:{int(when) + 1}:{signature}"  # a replay with a newer time
    assert "not signed" in (admission.refusal(f"{FLEET}-d0", user, moved) or "")
    real = time.time_ns
    monkeypatch.setattr(time, "time_ns", lambda: real() - 3_600 * 10**9)  # a device's clock
    user, password = connect_proof(keys["d0"])(f"{FLEET}-d0")
    monkeypatch.undo()
    why = admission.refusal(f"{FLEET}-d0", user, password)
    assert why is not None and "-3600 s off the broker's clock" in why


def test_keys_a_device_admitted_while_the_broker_runs_connects(
    tmp_path: Path, unused_port: int
) -> None:
    admitted, keys = keyed(tmp_path, "d0")
    with EmbeddedBroker(port=unused_port, admitted=admitted, fleet=FLEET) as broker:
        late = MemberKeys("d9", Ed25519PrivateKey.generate())
        before = Raw(broker.address, f"{FLEET}-d9", *connect_proof(late)(f"{FLEET}-d9"))
        assert not before.accepted
        add_key(admitted, "d9", late.public)  # `coordinator admit` while `serve` runs
        after = Raw(broker.address, f"{FLEET}-d9", *connect_proof(late)(f"{FLEET}-d9"))
        assert after.accepted
        after.publish(topics.status(FLEET, "d9"), frame_of(b"status"), retain=True)
        reader = Raw(broker.address, "edgefl-reader", None, None)
        reader.subscribe(topics.status(FLEET, "+"))
        assert reader.received.get(timeout=5)[0] == topics.status(FLEET, "d9")
        for client in (before, after, reader):
            client.close()


# -- logins: the embedded broker and mosquitto -------------------------------------------------


def configure(folder: Path, port: int, agents: tuple[str, ...] = ("a1", "a2")) -> dict[str, str]:
    grants = fleet_grants(FLEET, agents, "gateway", COORDINATOR_IDS)
    grants += fleet_grants("f2", ["b1"], None)
    listener = Listener(
        port, "127.0.0.1", tied=True, local_port=_unused_port(), local_users=("gateway",)
    )
    write_broker_config(folder, FLEET, grants, listener, force=True)
    return {m.name: (m / "password").read_text().strip() for m in (folder / "members").iterdir()}


@pytest.fixture(params=["amqtt", pytest.param("mosquitto", marks=pytest.mark.mosquitto)])
def secured(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple]:
    """A broker under `coordinator broker-config`'s configuration of fleets f1 and f2."""
    port, folder = _unused_port(), tmp_path / "auth"
    passwords = configure(folder, port)
    if request.param == "amqtt":
        with EmbeddedBroker(port=port, auth=folder) as broker:
            yield broker.address, passwords, folder
        return
    conf = folder / "mosquitto.conf"
    # As root, mosquitto would otherwise read its files as user mosquitto (pytest's tmp is 0700).
    conf.write_text(conf.read_text() + "user root\nlog_dest stdout\n")
    process = BrokerProcess(
        "mosquitto", [_require("mosquitto"), "-c", str(conf)], port, tmp_path / "m.log"
    )
    process.start()
    try:
        yield process.address, passwords, folder
    finally:
        process.kill()


def test_logins_another_members_client_id_takes_no_session(secured: tuple) -> None:
    address, passwords, _folder = secured
    options = TransportOptions(client_id=f"{FLEET}-a1", username="a1", password=passwords["a1"])
    victim = Victim(address, options, topics.status(FLEET, "+"))
    # Not a2 (mosquitto gives one login one connection): the coordinator's login publishes.
    sender = Raw(address, f"{FLEET}-gateway", "gateway", passwords["gateway"])
    assert sender.accepted
    for client_id in (f"{FLEET}-a1", "a1"):  # the embedded broker's id, mosquitto's
        attacker = Raw(address, client_id, "a2", passwords["a2"])
        time.sleep(0.3)  # mosquitto: time to close the victim, if it would
        attacker.close()
        victim.still_receives(sender, topics.status(FLEET, "a2"))
    victim.transport.stop()
    sender.close()


def test_logins_a_member_reads_only_its_own_fleet(secured: tuple) -> None:
    address, passwords, _folder = secured
    a1 = Raw(address, "reader-a1", "a1", passwords["a1"])
    b1 = Raw(address, "writer-b1", "b1", passwords["b1"])
    a2 = Raw(address, "writer-a2", "a2", passwords["a2"])
    for topic_filter in ("fl/v1/#", "fl/v1/f2/#", topics.fleet_root(FLEET) + "/#"):
        a1.subscribe(topic_filter)  # amqtt refuses the first two, mosquitto filters them
    b1.publish(topics.round_topic("f2", 1, "model", "b1"), b"f2's model")
    own = topics.round_topic(FLEET, 1, "model", "a2")
    a2.publish(own, b"f1's model")  # published after f2's, by another client
    assert a1.received.get(timeout=5)[0] == own
    with pytest.raises(queue.Empty):
        a1.received.get(timeout=0.5)
    for client in (a1, b1, a2):
        client.close()


def test_logins_a_member_added_while_the_embedded_broker_runs_logs_in(
    tmp_path: Path, unused_port: int
) -> None:
    folder = tmp_path / "auth"
    configure(folder, unused_port, ("a1",))
    with EmbeddedBroker(port=unused_port, auth=folder) as broker:
        time.sleep(0.05)  # a file system whose mtime is coarse still sees a change
        passwords = configure(folder, unused_port, ("a1", "a3"))  # broker-config --force
        a3 = Raw(broker.address, f"{FLEET}-a3", "a3", passwords["a3"])
        assert a3.accepted
        a3.close()


@pytest.mark.slow
@pytest.mark.mosquitto
def test_a_coordinated_run_works_through_mosquitto_with_client_ids_tied(
    tmp_path: Path, unused_port: int, processes: Processes
) -> None:
    """Agents on the device listener (one connection per login: the prober leaves before
    the member connects), the coordinator through the listener on 127.0.0.1 (local.toml)."""
    from test_agent_service import write_run
    from test_broker_acl_fleet import FLEET as ACL_FLEET
    from test_broker_acl_fleet import REPO, agents, finish
    from test_cli import COORDINATOR

    folder, local = tmp_path / "auth", _unused_port()
    grants = fleet_grants(ACL_FLEET, ["a1", "a2"], "gateway", COORDINATOR_IDS)
    listener = Listener(
        unused_port, "127.0.0.1", tied=True, local_port=local, local_users=("gateway",)
    )
    write_broker_config(folder, ACL_FLEET, grants, listener)
    conf = folder / "mosquitto.conf"
    conf.write_text(conf.read_text() + "user root\nlog_dest stdout\nlog_type all\n")
    log = tmp_path / "m.log"
    broker = BrokerProcess("mosquitto", [_require("mosquitto"), "-c", str(conf)], unused_port, log)
    broker.start()
    run = write_run(tmp_path / "run.toml", strategy="fedavg", agents=2, rounds=2,
                    input_shape=[1, 40], classes=10)  # fmt: skip
    try:
        fleet = agents(processes, tmp_path, str(broker.address), ["--once"])
        conductor = [
            *COORDINATOR, "run", str(run), "--fleet", ACL_FLEET,
            "--config", str(folder / "members" / "gateway" / "local.toml"),
            "--report", str(tmp_path / "report.json"),
        ]  # fmt: skip
        result = subprocess.run(conductor, cwd=REPO, capture_output=True, text=True, timeout=100)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        finish(fleet, tmp_path, 30)
    finally:
        broker.kill()
    text = log.read_text()
    assert "already connected, closing old connection" not in text, text[-3000:]
    assert "denied" not in text.lower(), text[-3000:]


def test_keys_a_member_that_joins_with_its_key_pair_proves_it_by_itself(
    keyed_broker: tuple,
) -> None:
    """`connect` with a member's own key pair and no login (edge-agent's and the
    coordinator's way) sends the proof itself: the broker lets it join and publish its
    presence, where the same member without a proof is refused."""
    address, keys = keyed_broker
    identity = Identity(FLEET, "d0", key=keys["d0"])
    member = connect(address, identity, probe_s=0.5, broker_wait_s=5)
    try:
        assert member.wait_subscribed(5), member.refused
        reader = Raw(address, "reader", None, None)
        reader.subscribe(topics.presence(FLEET, "d0"))
        topic, _payload = reader.received.get(timeout=5)
        assert topic == topics.presence(FLEET, "d0")
        reader.close()
    finally:
        leave(member, identity)
    unproven = Raw(address, f"{FLEET}-d0", None, None)
    assert not unproven.accepted
    unproven.close()


def test_a_connection_taken_over_again_and_again_says_so(
    embedded_address: BrokerAddress, caplog: pytest.LogCaptureFixture
) -> None:
    """Two clients with one client id (a board cloned with the device's key) take the id
    from each other in turn, and MQTT tells neither: each notices the pattern and says
    what it means, in one warning per burst."""
    options = TransportOptions(client_id=f"{FLEET}-d0", backoff_min_s=0.2, backoff_max_s=1.0)
    first, second = (
        MqttTransport(embedded_address, options),
        MqttTransport(embedded_address, options),
    )
    with caplog.at_level(logging.WARNING, logger="protocol.mqtt"):
        first.start()
        assert first.wait_connected(5)
        second.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(
            t.stats.get("taken_over") for t in (first, second)
        ):
            time.sleep(0.2)
        first.stop()
        second.stop()
    said = [r.getMessage() for r in caplog.records if "another client uses client id" in r.message]
    assert said and f"'{FLEET}-d0'" in said[0] and "--replace" in said[0], caplog.text[-2000:]
