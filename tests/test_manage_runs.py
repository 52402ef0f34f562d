"""`coordinator runs`, `cancel` and `forget` as a person uses them: the gateway's run
registry on disk, a real embedded broker, and agents that answer as edge-agent does (a
cancelled run: status "cancelled", then idle; a request to announce: presence again)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from click.testing import CliRunner
from paho.mqtt.enums import CallbackAPIVersion

from coordinator.broker import EmbeddedBroker
from coordinator.broker_config import COORDINATOR, member_password, write_broker_config
from coordinator.broker_config import Listener as BrokerListener
from coordinator.cli import main
from coordinator.manage import mark_cancelled
from coordinator.runs import RunEntry, find_entry, save_entry
from protocol import MqttTransport, messages, topics
from protocol.acl import fleet_grants
from protocol.chunking import Reassembler
from protocol.mqtt import TransportOptions
from protocol.signing import FleetKey

FLEET = "lab"
KEY = FleetKey(b"k" * 32)
RUN = messages.RunConfig(
    fleet=FLEET,
    sender=COORDINATOR,
    run_id="run-7",
    roster=["a1", "a2", "a3"],
    seed=5,
    config={"learning": {"strategy": "fedavg", "rounds": 10}},
    timeouts={"round_s": 30.0},
)

pytestmark = pytest.mark.timeout(60)


def dead_pid() -> int:
    """The id of a process that has exited (a `coordinator run` that is gone)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait(60)
    return process.pid


def entry(run_id: str, state: str, started: float, pid: int, **fields: object) -> RunEntry:
    return RunEntry(
        run_id=run_id, fleet=FLEET, strategy="fedavg", rounds=10, run_file="/runs/a.toml",
        state=state, started=started, pid=pid, **fields,  # type: ignore[arg-type]
    )  # fmt: skip


def test_runs_lists_the_recorded_runs_oldest_first(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    gone = dead_pid()
    save_entry(runs, entry("run-2", "running", 2000.0, gone, rounds_done=3, agents=["a", "b"]))
    save_entry(runs, entry("run-1", "done", 1000.0, gone, rounds_done=10, agents=["a"]))
    result = CliRunner().invoke(main, ["runs", "--runs-dir", str(runs)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    first = next(i for i, line in enumerate(lines) if "run-1" in line)
    second = next(i for i, line in enumerate(lines) if "run-2" in line)
    assert first < second, "newest last"
    assert {"done", "10/10", "1"} <= set(lines[first].split())
    assert {"interrupted", "3/10", "2"} <= set(lines[second].split()), "its process is gone"
    started = time.strftime("%Y-%m-%d %H:%M", time.localtime(1000.0))
    assert started in lines[first]

    result = CliRunner().invoke(main, ["runs", "--runs-dir", str(runs), "--json"])
    rows = json.loads(result.output)
    assert [(r["run_id"], r["state"], r["rounds_done"]) for r in rows] == [
        ("run-1", "done", 10),
        ("run-2", "interrupted", 3),
    ]
    assert "config" not in rows[0] and "pid" not in rows[0]

    empty = CliRunner().invoke(main, ["runs", "--runs-dir", str(tmp_path / "none")])
    assert empty.exit_code == 0
    assert empty.output.strip() == f"no runs recorded in {tmp_path / 'none'}"


@pytest.fixture
def broker(unused_port: int) -> Iterator[EmbeddedBroker]:
    with EmbeddedBroker(port=unused_port) as started:
        yield started


class FakeAgent:
    """An agent as the coordinator sees it: a retained presence (with its will) and
    status, which ends a cancelled run after its round and announces itself when asked."""

    def __init__(self, broker: EmbeddedBroker, name: str, round_: int = 4) -> None:
        self.name = name
        self.asked: list[messages.Message] = []
        since = time.time()
        birth = messages.Presence(fleet=FLEET, sender=name, online=True, since=since)
        will = messages.Presence(fleet=FLEET, sender=name, online=False, since=since, reason="lost")
        self.transport = MqttTransport(
            broker.address,
            birth=(topics.presence(FLEET, name), messages.encode(birth, key=KEY)),
            will=(topics.presence(FLEET, name), messages.encode(will, key=KEY)),
        )
        self.transport.subscribe(topics.run(FLEET), self._on_run)
        self.transport.subscribe(topics.announce(FLEET, name), self._on_announce)
        self.transport.start()
        assert self.transport.wait_subscribed(5)
        self.status("training", RUN.run_id, round_)
        telemetry = self.transport.publish_plain(topics.telemetry(FLEET, name), b"{}", retain=True)
        assert telemetry.wait_for_publish(5)

    def status(self, state: str, run_id: str = "", round_: int = 0) -> None:
        status = messages.Status(
            fleet=FLEET, sender=self.name, run_id=run_id, round=round_, state=state
        )
        topic = topics.status(FLEET, self.name)
        sent = self.transport.publish(
            topic, messages.encode(status, key=KEY), retain=True, keep=True
        )
        assert sent.wait_for_publish(5)

    def _on_run(self, _topic: str, payload: bytes) -> None:
        run = messages.decode(payload, key=KEY) if payload else None
        if isinstance(run, messages.RunConfig) and run.cancelled:
            self.status("cancelled", run.run_id, 4)
            self.status("idle")

    def _on_announce(self, _topic: str, payload: bytes) -> None:
        self.asked.append(messages.decode(payload, key=KEY))
        self.transport.reassert()


def publish_run(broker: EmbeddedBroker, run: messages.RunConfig | None) -> None:
    with MqttTransport(broker.address) as coordinator:
        assert coordinator.wait_connected(5)
        topic = topics.run(FLEET)
        sent = (
            coordinator.publish(topic, messages.encode(run, key=KEY), retain=True)
            if run is not None
            else coordinator.clear_retained(topic)
        )
        assert sent.wait_for_publish(5)


def retained(broker: EmbeddedBroker, *topic_filters: str) -> dict[str, bytes]:
    """What the broker retains on these topics, as a fresh subscriber gets it: a plain paho
    client, which takes the unframed JSON telemetry as it takes the rest."""
    got: dict[str, bytes] = {}
    subscribed = threading.Event()
    client = mqtt.Client(CallbackAPIVersion.VERSION2)
    client.on_message = lambda _c, _u, m: got.__setitem__(m.topic, bytes(m.payload))
    client.on_subscribe = lambda *_: subscribed.set()
    client.connect(broker.address.host, broker.address.port)
    client.loop_start()
    try:
        client.subscribe([(topic_filter, 1) for topic_filter in topic_filters])
        assert subscribed.wait(5)
        time.sleep(0.5)
    finally:
        client.disconnect()
        client.loop_stop()
    return {topic: payload for topic, payload in got.items() if payload}


def run_message(broker: EmbeddedBroker) -> messages.Message:
    """The fleet's retained run message, as an agent reads it."""
    frame = retained(broker, topics.run(FLEET))[topics.run(FLEET)]
    payload = Reassembler().feed(topics.run(FLEET), frame)
    assert payload is not None
    return messages.decode(payload, key=KEY)


def invoke(broker: EmbeddedBroker, *args: str) -> tuple[int, str]:
    where = ["--broker", str(broker.address), "--fleet", FLEET]
    result = CliRunner().invoke(main, [*args, *where])
    return result.exit_code, result.output


def test_runs_shows_whole_ids_in_a_narrow_output(tmp_path: Path) -> None:
    """Piped (80 columns to rich), with a fleet column, the ids `cancel` needs stay whole."""
    runs = tmp_path / "runs"
    ids = ["run-2dfc6e1b7a90", "run-77aa01c3f5e2"]
    for n, run_id in enumerate(ids):
        fleet = f"greenhouse-sensors-{n}-with-a-long-name"
        save_entry(
            runs, dataclasses.replace(entry(run_id, "running", 1.0, dead_pid()), fleet=fleet)
        )
    result = CliRunner().invoke(main, ["runs", "--runs-dir", str(runs)])
    assert result.exit_code == 0, result.output
    for run_id in ids:
        assert run_id in result.output
    assert result.output.count("interrupted") == 2, result.output


def test_cancel_calls_the_run_off_and_says_who_stopped(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    agents = [FakeAgent(broker, "a1"), FakeAgent(broker, "a2")]  # a3 is offline
    publish_run(broker, RUN)
    runs = tmp_path / "runs"
    save_entry(runs, entry(RUN.run_id, "running", time.time(), dead_pid()))
    key = tmp_path / "fleet.key"
    key.write_bytes(b"k" * 32)
    try:
        started = time.monotonic()
        code, output = invoke(
            broker, "cancel", RUN.run_id, "--key-file", str(key), "--runs-dir", str(runs),
            "--json", "--wait", "10",
        )  # fmt: skip
        assert code == 0, output
        assert time.monotonic() - started < 8, "done when every online agent stopped"
        answer = json.loads(output[output.index("{") :])
        assert answer == {
            "run_id": RUN.run_id,
            "cancelled": True,
            "agents": {"a1": "cancelled", "a2": "cancelled", "a3": "offline"},
        }
        message = run_message(broker)
        assert message == messages.RunConfig(**{**vars(RUN), "cancelled": True}), "same run"
        recorded = find_entry(runs, RUN.run_id)
        assert recorded is not None and recorded.state == "cancelled", "its process was gone"

        code, output = invoke(broker, "cancel", RUN.run_id, "--key-file", str(key), "--wait", "5")
        assert code == 0
        assert f"run {RUN.run_id} in fleet {FLEET} is cancelled (it already was)" in output
        stopped = (
            "stopped: a1 (idle), a2 (idle)",
            "stopped: a1 (cancelled after round 4), a2 (cancelled after round 4)",
        )
        assert any(line in output for line in stopped), "out of the run (again: the message is)"
        assert "offline: a3 (they end the run when they are back)" in output
    finally:
        for agent in agents:
            agent.transport.stop()


def test_cancel_waits_for_presences_it_has_not_heard_yet(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    """An agent whose presence reaches `cancel` after the run message (the broker sends the
    retained presences last; on a busy gateway they come late) is not taken for offline."""
    publish_run(broker, RUN)
    key = tmp_path / "fleet.key"
    key.write_bytes(b"k" * 32)
    agents: list[FakeAgent] = []
    late = threading.Timer(0.4, lambda: agents.extend(FakeAgent(broker, a) for a in ("a1", "a2")))
    late.start()
    try:
        code, output = invoke(
            broker, "cancel", RUN.run_id, "--key-file", str(key), "--runs-dir",
            str(tmp_path / "runs"), "--json", "--wait", "10",
        )  # fmt: skip
        assert code == 0, output
        answer = json.loads(output[output.index("{") :])
        assert answer["agents"] == {"a1": "cancelled", "a2": "cancelled", "a3": "offline"}
    finally:
        late.join()
        for agent in agents:
            agent.transport.stop()


def test_cancel_refuses_a_run_that_is_not_on(broker: EmbeddedBroker, tmp_path: Path) -> None:
    key = tmp_path / "fleet.key"
    key.write_bytes(b"k" * 32)
    publish_run(broker, RUN)
    code, output = invoke(broker, "cancel", "run-8", "--key-file", str(key))
    assert code == 1
    assert f"run run-8 is not on in fleet {FLEET} (the run on now: {RUN.run_id})" in output
    code, output = invoke(broker, "cancel", RUN.run_id)
    assert code == 1
    assert f"fleet {FLEET} signs its messages: give the key `coordinator run` signs" in output
    run = run_message(broker)
    assert isinstance(run, messages.RunConfig) and not run.cancelled, "left as it was"
    publish_run(broker, None)
    code, output = invoke(broker, "cancel", RUN.run_id, "--key-file", str(key))
    assert code == 1
    assert f"run {RUN.run_id} is not on in fleet {FLEET} (no run is on)" in output.replace(
        "\n", " "
    )


def test_a_run_a_live_coordinator_conducts_is_left_for_it_to_record(tmp_path: Path) -> None:
    save_entry(tmp_path, entry("live", "running", time.time(), pid=os.getpid()))
    save_entry(tmp_path, entry("gone", "running", time.time(), pid=dead_pid()))
    assert not mark_cancelled(tmp_path, "live")
    assert mark_cancelled(tmp_path, "gone")
    states = [getattr(find_entry(tmp_path, run), "state", None) for run in ("live", "gone")]
    assert states == ["running", "cancelled"]


def test_forget_clears_a_gone_agent_and_a_live_one_comes_back(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    key = tmp_path / "fleet.key"
    key.write_bytes(b"k" * 32)
    live, gone = FakeAgent(broker, "a1"), FakeAgent(broker, "a2")
    gone.transport.abort()  # a crash: its will says it is lost
    time.sleep(0.5)
    own = [topics.presence(FLEET, "a2"), topics.status(FLEET, "a2"), topics.telemetry(FLEET, "a2")]
    assert set(retained(broker, *own)) == set(own)
    try:
        code, output = invoke(broker, "forget", "a2", "--key-file", str(key))
        assert (code, output.strip()) == (0, "forgot agent a2 (it was lost)")
        assert retained(broker, f"fl/v1/{FLEET}/+/a2") == {}, "presence, status, telemetry"

        code, output = invoke(broker, "forget", "a1", "--key-file", str(key), "--json")
        assert code == 0, output
        assert json.loads(output) == {
            "fleet": FLEET,
            "agent": "a1",
            "was": "online",
            "online": True,
        }
        assert [(m.sender, getattr(m, "target", None)) for m in live.asked] == [
            (COORDINATOR, "a1")
        ], "asked once, signed as the coordinator"
        assert topics.presence(FLEET, "a1") in retained(broker, topics.presence(FLEET, "+"))

        code, output = invoke(broker, "forget", "a9", "--key-file", str(key))
        assert (code, output.strip()) == (1, f"Error: fleet {FLEET} has no agent a9 on this broker")
    finally:
        live.transport.stop()


def test_forget_says_so_when_the_broker_acl_refuses(tmp_path: Path, unused_port: int) -> None:
    auth = tmp_path / "auth"
    grants = fleet_grants(FLEET, ["a1", "a2"], COORDINATOR)
    write_broker_config(auth, FLEET, grants, BrokerListener(port=unused_port))
    password = tmp_path / "a2.password"
    password.write_text(member_password(auth, "a2"))
    with EmbeddedBroker(port=unused_port, auth=auth) as broker:
        options = TransportOptions(username="a1", password=member_password(auth, "a1"))
        presence = messages.Presence(fleet=FLEET, sender="a1", online=False, since=time.time())
        with MqttTransport(broker.address, options) as agent:
            assert agent.wait_connected(5)
            topic = topics.presence(FLEET, "a1")
            assert agent.publish(topic, messages.encode(presence), retain=True).wait_for_publish(5)
        code, output = invoke(
            broker, "forget", "a1", "--username", "a2", "--password-file", str(password)
        )
    assert code == 1
    assert f"the broker kept fl/v1/{FLEET}/presence/a1: its ACL does not let this login" in output


@pytest.mark.parametrize("command", [["cancel", "run-7"], ["forget", "a1"]])
def test_cancel_and_forget_name_an_address_where_nothing_answers(
    command: list[str], unused_port: int
) -> None:
    started = time.monotonic()
    result = CliRunner().invoke(main, [*command, "--broker", f"127.0.0.1:{unused_port}"])
    assert result.exit_code == 1
    assert (
        f"no MQTT broker answers at 127.0.0.1:{unused_port} (connection refused): check --broker"
        in result.output
    )
    assert time.monotonic() - started < 5
