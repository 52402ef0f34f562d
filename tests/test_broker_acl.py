"""Broker authorization: per-member credentials and the fleet ACL of `protocol.acl`, enforced
by the embedded broker and by a real mosquitto running the configuration that
`coordinator broker-config` writes. Real brokers on loopback, plain paho clients."""

from __future__ import annotations

import itertools
import queue
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import psutil
import pytest
from click.testing import CliRunner
from paho.mqtt.enums import CallbackAPIVersion

from coordinator.broker import EmbeddedBroker
from coordinator.broker_config import (
    COORDINATOR_IDS,
    BrokerAuth,
    BrokerAuthError,
    Listener,
    broker_config,
    check_password,
    hash_password,
    member_password,
    write_broker_config,
)
from protocol import BrokerAddress, topics
from protocol.acl import covers, fleet_grants, parse_acl, render_acl
from tests.conftest import BrokerProcess, _require, _unused_port

FLEET = "f1"
_ids = itertools.count()


class Client:
    """A plain paho client (MQTT 3.1.1) that records what it receives."""

    def __init__(
        self,
        address: BrokerAddress,
        user: str | None,
        password: str | None,
        will: str = "",
        *,
        client_id: str | None = None,
        retry: bool = True,
    ) -> None:
        self.received: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.reason: mqtt.ReasonCode | None = None
        self._answered, self._subscribed = threading.Event(), threading.Event()
        client_id = client_id or f"acl-test-{next(_ids)}"
        client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id)
        if not retry:
            client.reconnect_delay_set(60, 60)  # one attempt within a test
        if user is not None:
            client.username_pw_set(user, password)
        if will:
            client.will_set(will, b"forged", qos=1, retain=True)
        client.on_connect = self._on_connect
        client.on_subscribe = lambda *_: self._subscribed.set()
        client.on_message = lambda _c, _u, m: self.received.put((m.topic, bytes(m.payload)))
        client.connect(address.host, address.port, keepalive=10)
        client.loop_start()
        self.client = client
        self._answered.wait(5)

    def _on_connect(self, _c: object, _u: object, _f: object, reason: mqtt.ReasonCode, _p: object):
        self.reason = reason
        self._answered.set()

    @property
    def accepted(self) -> bool:
        return self.reason is not None and not self.reason.is_failure

    def subscribe(self, topic_filter: str) -> None:
        self._subscribed.clear()
        self.client.subscribe(topic_filter, qos=1)
        assert self._subscribed.wait(5), "no SUBACK"

    def publish(self, topic: str, payload: bytes = b"x", retain: bool = False) -> None:
        self.client.publish(topic, payload, qos=1, retain=retain).wait_for_publish(5)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def configure(folder: Path, port: int) -> dict[str, str]:
    """A fleet f1 of agents a1, a2 and the coordinator `gateway`; every member's password."""
    grants = fleet_grants(FLEET, ["a1", "a2"], "gateway", COORDINATOR_IDS)
    write_broker_config(folder, FLEET, grants, Listener(port, "127.0.0.1"))
    members = folder / "members"
    return {m.name: (m / "password").read_text().strip() for m in members.iterdir()}


@pytest.fixture(params=["amqtt", pytest.param("mosquitto", marks=pytest.mark.mosquitto)])
def secured(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[BrokerAddress, dict[str, str]]]:
    """A broker under the generated configuration: embedded, or mosquitto with its conf."""
    port, folder = _unused_port(), tmp_path / "auth"
    passwords = configure(folder, port)
    if request.param == "amqtt":
        with EmbeddedBroker(port=port, auth=folder) as broker:
            yield broker.address, passwords
        return
    conf = folder / "mosquitto.conf"
    # As root, mosquitto would otherwise read its files as user mosquitto (pytest's tmp is 0700).
    conf.write_text(conf.read_text() + "user root\nlog_dest stdout\n")
    binary = _require("mosquitto")
    process = BrokerProcess("mosquitto", [binary, "-c", str(conf)], port, tmp_path / "m.log")
    process.start()
    try:
        yield process.address, passwords
    finally:
        process.kill()


def drain(client: Client, until: str, timeout_s: float = 5.0) -> set[str]:
    """Topics received up to and including `until` (published last, by the same client)."""
    seen = set()
    while until not in seen:
        seen.add(client.received.get(timeout=timeout_s)[0])
    return seen


def test_agent_publishes_only_on_its_own_topics(
    secured: tuple[BrokerAddress, dict[str, str]],
) -> None:
    address, passwords = secured
    watcher = Client(address, "gateway", passwords["gateway"])
    agent = Client(address, "a1", passwords["a1"])
    assert watcher.accepted and agent.accepted
    watcher.subscribe(topics.fleet_root(FLEET) + "/#")
    forged = [
        topics.status(FLEET, "a2"),
        topics.presence(FLEET, "a2"),
        topics.run(FLEET),
        topics.global_model(FLEET, 1, "a1"),
        topics.round_topic(FLEET, 1, "model", "a2"),
        topics.round_topic(FLEET, 1, "request", "a2", to="a1"),
        topics.round_topic(FLEET, 1, "resend", "a2", to="a1"),
        topics.status("other", "a1"),
    ]
    own = [
        topics.status(FLEET, "a1"),
        topics.round_topic(FLEET, 1, "request", "a1", to="a2"),
        topics.round_topic(FLEET, 1, "resend", "a1", to="a2"),
        topics.layer(FLEET, 1, "a1", 3),
    ]
    for topic in forged + own:
        agent.publish(topic)
    last = topics.presence(FLEET, "a1")
    agent.publish(last)  # QoS 1 from one client: delivered after everything before it
    assert drain(watcher, last) == set(own) | {last}
    # The coordinator's login publishes the run and the global models.
    watcher.publish(topics.global_model(FLEET, 2))
    watcher.publish(topics.run(FLEET))
    assert drain(watcher, topics.run(FLEET)) >= {topics.global_model(FLEET, 2)}
    watcher.close()
    agent.close()


def test_anonymous_and_wrong_password_refused(
    secured: tuple[BrokerAddress, dict[str, str]],
) -> None:
    address, passwords = secured
    for user, password in [(None, None), ("a1", passwords["a2"]), ("intruder", "guess")]:
        client = Client(address, user, password)
        assert not client.accepted, (user, client.reason)
        client.close()


def test_last_will_on_another_members_topic_never_delivered(
    secured: tuple[BrokerAddress, dict[str, str]],
) -> None:
    """The embedded broker refuses the connection; mosquitto accepts it and drops the will."""
    address, passwords = secured
    watcher = Client(address, "gateway", passwords["gateway"])
    watcher.subscribe(topics.fleet_root(FLEET) + "/#")
    for will in (topics.presence(FLEET, "a2"), topics.presence(FLEET, "a1")):
        client = Client(address, "a1", passwords["a1"], will=will)
        connection = client.client.socket()
        if client.accepted and connection is not None:
            connection.close()  # a crash: the broker publishes the will
        client.client.loop_stop()
    assert drain(watcher, topics.presence(FLEET, "a1")) == {topics.presence(FLEET, "a1")}
    watcher.close()


def test_embedded_broker_binds_loopback_by_default(unused_port: int) -> None:
    with EmbeddedBroker(port=unused_port):
        listening = [
            c.laddr.ip
            for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == unused_port
        ]
    assert listening == ["127.0.0.1"]


def test_generated_hash_matches_mosquitto_passwd(tmp_path: Path) -> None:
    passwd = _require("mosquitto_passwd")
    file = tmp_path / "pw"
    subprocess.run([passwd, "-b", "-c", str(file), "u", "s3cret"], check=True, timeout=60)
    theirs = file.read_text().strip().partition(":")[2]
    assert check_password("s3cret", theirs) and not check_password("other", theirs)
    ours = hash_password("s3cret")
    assert check_password("s3cret", ours) and not check_password("s3cre", ours)
    assert not check_password("s3cret", "$6$salt$hash")


def test_acl_rule_and_its_file_round_trip() -> None:
    grants = fleet_grants(FLEET, ["a1"], "gateway", COORDINATOR_IDS)
    parsed = parse_acl(render_acl(grants, "header\nlines"))
    assert list(parsed.values()) == grants
    agent, coordinator = parsed["a1"], parsed["gateway"]
    assert agent.may_publish("fl/v1/f1/round/3/vote/a1")
    assert not agent.may_publish("fl/v1/f1/round/3/global/a1")
    assert not agent.may_publish("fl/v1/f1/round/3/model/a1/x/y")
    assert coordinator.may_publish("fl/v1/f1/presence/coordinator")
    assert coordinator.may_publish("fl/v1/f1/round/3/request/coordinator/a1")
    # An agent reads its own fleet only; the coordinator's login (status, watch) every fleet.
    assert agent.may_subscribe("fl/v1/f1/presence/+") and not agent.may_subscribe("#")
    assert not agent.may_subscribe("fl/v1/+/presence/+") and not agent.may_subscribe("fl/v1/f2/#")
    assert coordinator.may_subscribe("fl/v1/+/presence/+")
    # Without a coordinator, agents publish the run (`edge-agent --expect`).
    assert fleet_grants(FLEET, ["a1"], None)[0].may_publish("fl/v1/f1/run")
    assert covers("a/#", "a") and covers("a/+", "a/b") and not covers("a/b", "a/+")


def test_broker_config_command(tmp_path: Path) -> None:
    out, runner = tmp_path / "cfg", CliRunner()
    args = ["--out", str(out), "--fleet", FLEET, "--agent", "a1"]
    first = runner.invoke(broker_config, args)
    assert first.exit_code == 0, first.output
    password = (out / "members/a1/password").read_text()
    assert (out / "members/a1/password").stat().st_mode & 0o077 == 0
    again = runner.invoke(broker_config, args)
    assert again.exit_code == 2 and "--force" in again.output
    forced = runner.invoke(broker_config, [*args, "--agent", "a2", "--force"])
    assert forced.exit_code == 0, forced.output
    assert (out / "members/a1/password").read_text() == password  # devices keep working
    assert set(BrokerAuth.load(out).passwords) == {"a1", "a2", "gateway"}
    assert member_password(out, "a1") == password.strip()
    with pytest.raises(BrokerAuthError, match="cannot read"):
        member_password(out, "a3")
    for bad, says in [
        (["--out", str(tmp_path / "x")], "no agent given"),
        (["--out", str(tmp_path / "x"), "--agent", "A/1"], "invalid agent"),
        (["--out", str(tmp_path / "x"), "--agent", "gateway"], "must differ"),
    ]:
        result = runner.invoke(broker_config, bad)
        assert result.exit_code == 2 and says in result.output, result.output


def test_broker_config_with_tls(tmp_path: Path) -> None:
    for name in ("cert.pem", "key.pem", "ca.pem"):
        (tmp_path / name).write_text(name)
    out, runner = tmp_path / "cfg", CliRunner()
    tls = ["--tls-cert", str(tmp_path / "cert.pem"), "--tls-key", str(tmp_path / "key.pem")]
    args = ["--out", str(out), "--agent", "a1", *tls, "--tls-ca", str(tmp_path / "ca.pem")]
    assert runner.invoke(broker_config, args).exit_code == 0
    conf = (out / "mosquitto.conf").read_text()
    assert "listener 8883\n" in conf and f"certfile {tmp_path / 'cert.pem'}" in conf
    assert (out / "members/a1/ca.pem").read_text() == "ca.pem"
    assert 'tls_ca = "ca.pem"' in (out / "members/a1/broker.toml").read_text()
    alone = runner.invoke(broker_config, ["--out", str(tmp_path / "y"), "--agent", "a1", *tls[:2]])
    assert alone.exit_code == 2 and "go together" in alone.output


def test_unusable_auth_folder_is_one_line_error(tmp_path: Path, unused_port: int) -> None:
    with pytest.raises(BrokerAuthError, match="cannot read"):
        EmbeddedBroker(port=unused_port, auth=tmp_path)
    (tmp_path / "passwords").write_text("a1:plain\n")
    (tmp_path / "acl").write_text("user a1\ntopic write x\n")
    with pytest.raises(BrokerAuthError, match="passwords:1"):
        EmbeddedBroker(port=unused_port, auth=tmp_path)
