"""A device's agent over months of runs, as a person runs it: real `edge-agent` processes on a
real broker (loopback). Models are kept per run, chosen, rolled back and warm-started from;
runs are called off; the agent answers requests to announce itself, says why a run leaves it
out, and waits for a broker that is not there yet."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import BrokerProcess
from test_agent_service import write_data
from test_cli import EDGE_AGENT, REPO

from agent.experiment import config_to_dict
from agent.onnx_model import OnnxModel
from agent.runfile import parse_run_table
from protocol import MqttTransport, messages, topics
from tests.processes import Processes, wait_for_text

FLEET = "home"
SHAPE = {"input_shape": [1, 40], "classes": 10}
RUN_TOPIC = topics.run(FLEET)


class Fleet:
    """The test's own connection to the broker: it publishes runs as a coordinator would and
    follows one agent's statuses."""

    def __init__(self, broker: BrokerProcess, agent: str) -> None:
        self.transport = MqttTransport(broker.address)
        self.statuses: list[messages.Status] = []
        self.presences = 0
        self._lock = threading.Lock()
        self.transport.subscribe(topics.status(FLEET, agent), self._on_status)
        self.transport.subscribe(topics.presence(FLEET, agent), self._on_presence)
        self.transport.start()
        assert self.transport.wait_subscribed(10)

    def _on_status(self, _topic: str, payload: bytes) -> None:
        if payload:
            message = messages.decode(payload)
            assert isinstance(message, messages.Status)
            with self._lock:
                self.statuses.append(message)

    def _on_presence(self, _topic: str, payload: bytes) -> None:
        with self._lock:
            self.presences += 1

    def publish(self, message: messages.Message, topic: str, retain: bool = True) -> None:
        self.transport.publish(topic, messages.encode(message), retain=retain).wait_for_publish(5)

    def wait_for(
        self, check: Callable[[list[messages.Status]], bool], timeout_s: float = 20
    ) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                if check(list(self.statuses)):
                    return
                seen = [(s.state, s.round) for s in self.statuses[-5:]]
            assert time.monotonic() < deadline, f"statuses so far: {seen}"
            time.sleep(0.05)


@pytest.fixture
def fleet(amqtt_broker) -> Iterator[Fleet]:
    watcher = Fleet(amqtt_broker, "pi")
    yield watcher
    watcher.transport.stop()


def start_agent(
    processes: Processes, tmp: Path, broker: BrokerProcess, log: str, *extra: str
) -> subprocess.Popen[bytes]:
    data = tmp / "own.npz"
    if not data.exists():
        write_data(data, [0, 1, 2, 3], samples=300)
    command = [
        *EDGE_AGENT, "--broker", str(broker.address), "--id", "pi", "--fleet", FLEET,
        "--data", str(data), "--state-dir", str(tmp / "pi"), *extra,
    ]  # fmt: skip
    return processes.spawn(command, tmp / log)


def run_message(
    run_id: str, roster: list[str], *, cancelled: bool = False, **keys: object
) -> messages.RunConfig:
    config = parse_run_table({"agents": len(roster), **SHAPE, **keys}, "test").config(len(roster))
    return messages.RunConfig(
        fleet=FLEET, sender="gw", run_id=run_id, roster=roster, seed=config.seed,
        config=config_to_dict(config), cancelled=cancelled,
    )  # fmt: skip


def stop(agent: subprocess.Popen[bytes]) -> None:
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(30) == 0


class Device:
    """One long-lived agent on the test's fleet, given runs as a coordinator gives them."""

    def __init__(
        self, processes: Processes, tmp: Path, broker: BrokerProcess, fleet: Fleet, *extra: str
    ) -> None:
        self.tmp, self.fleet, self.log = tmp, fleet, tmp / "pi.log"
        self.process = start_agent(processes, tmp, broker, "pi.log", *extra)
        wait_for_text(self.log, "waiting for a run")

    def run(self, run_id: str, **keys: Any) -> str:
        """Give it a one-device run of `keys`; what it said until it waits for the next."""
        said = len(self.log.read_text())
        done = self.log.read_text().count("waiting for the next run")
        self.fleet.publish(run_message(run_id, ["pi"], strategy="local", **keys), RUN_TOPIC)
        deadline = time.monotonic() + 60
        while self.log.read_text().count("waiting for the next run") == done:
            assert time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.05)
        return self.log.read_text()[said:]

    def models(self) -> dict[str, dict]:
        listed = edge_agent(self.tmp, "models", "--json")
        assert listed.returncode == 0, listed.stderr
        return {row["run_id"]: row for row in json.loads(listed.stdout)}


def edge_agent(tmp: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    command = [*EDGE_AGENT, "--state-dir", str(tmp / "pi"), *arguments]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)


GOOD, WORSE, WARM, OTHER = (f"run-00000000000{k}" for k in "abcd")


def test_a_worse_run_does_not_replace_the_current_model_and_models_use_rolls_back(
    fleet: Fleet, amqtt_broker, tmp_path: Path, processes: Processes
) -> None:
    device = Device(processes, tmp_path, amqtt_broker, fleet, "--keep-runs", "1")
    try:
        assert f"run {GOOD} is now the current model" in device.run(GOOD, rounds=3)
        old = tmp_path / "pi" / "runs" / "run-000000000000"  # an ended run from long ago
        old.mkdir()
        (old / "finished").touch()
        subprocess.run(["touch", "-d", "2020-01-01", str(old / "finished")], check=True, timeout=60)
        # lr 0: the run's model is the seeded one, far worse than three rounds of training.
        worse = device.run(WORSE, rounds=1, lr=0.0)
    finally:
        stop(device.process)
    assert re.search(
        rf"run {GOOD} kept as current model: the new run {WORSE} reaches accuracy "
        r"0\.\d{4}, more than 0.02 below its 0\.\d{4}",
        worse,
    ), worse
    rows = device.models()
    assert set(rows) == {GOOD, WORSE}, "the old run's folder went, the current one stayed"
    assert rows[GOOD]["current"] and not rows[WORSE]["current"]
    assert rows[GOOD]["rounds"] == 3 and rows[GOOD]["accuracy"] > rows[WORSE]["accuracy"]
    assert not old.exists()

    samples = tmp_path / "samples.npy"
    np.save(samples, np.load(tmp_path / "own.npz")["x"][:50])
    rolled = edge_agent(tmp_path, "models", "use", WORSE)
    assert rolled.returncode == 0, rolled.stderr
    assert f"run {WORSE} is now the current model" in rolled.stderr
    served = edge_agent(tmp_path, "predict", str(samples), "--latency-samples", "0")
    assert served.returncode == 0, served.stderr
    kept = OnnxModel.load(tmp_path / "pi" / "runs" / WORSE / "model.onnx", threads=1)
    expected = kept.predict(np.load(samples)).argmax(axis=1).tolist()
    assert served.stdout.split() == [str(c) for c in expected], "it serves the rolled-back model"

    unknown = edge_agent(tmp_path, "models", "use", "run-nope")
    assert unknown.returncode == 2
    assert unknown.stderr.strip().splitlines() == [
        f"Error: no run 'run-nope' in {tmp_path / 'pi' / 'runs'}"
    ]


def test_init_previous_starts_each_device_from_its_current_model(
    fleet: Fleet, amqtt_broker, tmp_path: Path, processes: Processes
) -> None:
    device = Device(processes, tmp_path, amqtt_broker, fleet)
    try:
        final = re.findall(r"round 3: accuracy (0\.\d{4})", device.run(GOOD, rounds=3))
        # lr 0: nothing is learned, so the run ends where it started.
        warm = device.run(WARM, rounds=1, lr=0.0, init="previous")
        other = device.run(OTHER, rounds=1, model="mlp", init="previous")
    finally:
        stop(device.process)
    assert f"starting from the current model (run {GOOD}, accuracy {final[0]})" in warm
    assert re.findall(r"round 1: accuracy (0\.\d{4})", warm) == final
    runs = tmp_path / "pi" / "runs"
    saved = [torch.load(runs / r / "model.pt", weights_only=True)["weights"] for r in (GOOD, WARM)]
    assert all(torch.equal(saved[0][name], saved[1][name]) for name in saved[0])
    assert f"starting from the seed: the current model (run {WARM}) has other parameters" in other


def test_a_cancelled_run_ends_after_its_round_and_the_agent_waits_for_the_next(
    amqtt_broker, fleet: Fleet, tmp_path: Path, processes: Processes
) -> None:
    agent = start_agent(processes, tmp_path, amqtt_broker, "first.log")
    wait_for_text(tmp_path / "first.log", "waiting for a run")
    run = run_message("run-0000000000aa", ["pi"], strategy="local", rounds=100000)
    fleet.publish(run, RUN_TOPIC)
    fleet.wait_for(lambda seen: any(s.state == "training" and s.round >= 2 for s in seen))
    agent.send_signal(signal.SIGKILL)  # a crash in the middle of the run
    agent.wait(10)

    agent = start_agent(processes, tmp_path, amqtt_broker, "second.log")
    text = wait_for_text(tmp_path / "second.log", "from its checkpoint")
    resumed = re.search(
        r"run run-0000000000aa: resuming after round (\d+) of 100000 from its", text
    )
    assert resumed, text
    fleet.wait_for(lambda seen: seen[-1].round > int(resumed[1]) + 1)
    cancel = run_message(run.run_id, ["pi"], cancelled=True, strategy="local", rounds=100000)
    fleet.publish(cancel, RUN_TOPIC)
    fleet.wait_for(lambda seen: [s.state for s in seen[-2:]] == ["cancelled", "idle"])
    text = wait_for_text(tmp_path / "second.log", "waiting for the next run")
    assert re.search(r"run run-0000000000aa cancelled after round \d+: its checkpoint", text)
    assert agent.poll() is None, "the agent goes on serving"
    folder = tmp_path / "pi" / "runs" / "run-0000000000aa"
    assert (folder / "cancelled").exists() and (folder / "checkpoint.pt").exists()
    assert not (tmp_path / "pi" / "model.onnx").exists(), "no model of a cancelled run"
    logged = (folder / "rounds.jsonl").read_text()
    stop(agent)

    agent = start_agent(
        processes, tmp_path, amqtt_broker, "third.log"
    )  # the cancel is still retained
    wait_for_text(tmp_path / "third.log", "waiting for a run")
    time.sleep(2)
    stop(agent)
    assert "resuming" not in (tmp_path / "third.log").read_text()
    assert (folder / "rounds.jsonl").read_text() == logged, "a cancelled run never resumes"


def test_an_agent_announces_itself_again_when_asked_at_most_every_few_seconds(
    amqtt_broker, fleet: Fleet, tmp_path: Path, processes: Processes
) -> None:
    agent = start_agent(processes, tmp_path, amqtt_broker, "pi.log")
    try:
        fleet.wait_for(lambda seen: [s.state for s in seen] == ["idle"])
        fleet.transport.clear_retained(topics.status(FLEET, "pi")).wait_for_publish(5)
        presences = fleet.presences
        ask = messages.Request(fleet=FLEET, sender="gw", target="pi")
        elsewhere = messages.Request(fleet=FLEET, sender="gw", target="pi-b")
        fleet.publish(elsewhere, topics.announce(FLEET, "pi"), retain=False)
        time.sleep(1)
        assert len(fleet.statuses) == 1, "a request for another agent is not for this one"
        fleet.publish(ask, topics.announce(FLEET, "pi"), retain=False)
        fleet.wait_for(lambda seen: len(seen) == 2 and seen[-1].state == "idle")
        fleet.publish(ask, topics.announce(FLEET, "pi"), retain=False)
        time.sleep(1.5)
        assert len(fleet.statuses) == 2, "at most one answer in 5 s"
        assert fleet.presences == presences + 1
    finally:
        stop(agent)


def test_a_run_that_leaves_the_agent_out_is_said_once_with_its_reason(
    amqtt_broker, fleet: Fleet, tmp_path: Path, processes: Processes
) -> None:
    agent = start_agent(processes, tmp_path, amqtt_broker, "pi.log")
    try:
        wait_for_text(tmp_path / "pi.log", "waiting for a run")
        fleet.publish(
            run_message("run-0000000000b1", ["pi-b"], strategy="local"), topics.run(FLEET)
        )
        wait_for_text(tmp_path / "pi.log", "run-0000000000b1")
        images = run_message("run-0000000000b2", ["pi-b"], strategy="local", input_shape=[3, 8, 8])
        fleet.publish(images, topics.run(FLEET))
        fleet.wait_for(lambda seen: seen[-1].state == "rejected")
        text = wait_for_text(tmp_path / "pi.log", "run-0000000000b2")
    finally:
        stop(agent)
    # An agent's messages are log lines: `HH:MM:SS INFO pi: ...`.
    lines = [line.split(" INFO pi: ", 1)[-1] for line in text.splitlines() if "run-000" in line]
    assert lines == [
        "run run-0000000000b1 does not name this agent; waiting for the next run",
        "not joining run run-0000000000b2 (it leaves this agent out): its data does not fit the "
        "run: samples have shape (1, 40), the run's model takes (3, 8, 8); waiting for the next "
        "run",
    ]
    assert [s.state for s in fleet.statuses].count("rejected") == 1


@pytest.mark.parametrize("where", ["port", "name"])
def test_an_agent_without_a_broker_says_why_and_joins_once_one_answers(
    tmp_path: Path, unused_port: int, where: str, processes: Processes
) -> None:
    broker = f"127.0.0.1:{unused_port}" if where == "port" else "no-such-broker.invalid"
    command = [*EDGE_AGENT, "--broker", broker, "--id", "pi", "--state-dir", str(tmp_path / "pi")]
    if where == "name":  # a name that does not resolve is no loopback: open, or its bundle
        command.append("--open")
    agent = processes.spawn(command, tmp_path / "pi.log")
    said = {
        "port": f"no MQTT broker answers at {broker} (connection refused); retrying until it does",
        "name": "the broker's name 'no-such-broker.invalid' does not resolve (",
    }[where]
    text = wait_for_text(tmp_path / "pi.log", said, process=agent)
    time.sleep(2)
    assert agent.poll() is None, "an agent outlives a gateway that is down"
    assert "waiting for a run" not in text and "WARNING" not in text, text
    if where == "port":
        late = BrokerProcess(
            "amqtt",
            [sys.executable, "-m", "coordinator.broker", "--host", "127.0.0.1",
             "--port", str(unused_port)],
            unused_port, tmp_path / "amqtt.log",
        )  # fmt: skip
        late.start()
        try:
            text = wait_for_text(tmp_path / "pi.log", "waiting for a run", process=agent)
            assert f"connected to broker {broker}\n" in text
            stop(agent)
        finally:
            late.kill()
    else:
        stop(agent)


def test_after_the_broker_restarts_empty_the_agent_restores_what_the_fleet_reads(
    broker: BrokerProcess, tmp_path: Path, processes: Processes
) -> None:
    agent = start_agent(processes, tmp_path, broker, "pi.log")
    try:
        wait_for_text(tmp_path / "pi.log", "waiting for a run")
        broker.kill()
        broker.start()  # no persistence: it comes back with no retained message at all
        restarted = time.monotonic()
        reader = Fleet(broker, "pi")  # a coordinator that connects after the restart
        try:
            reader.wait_for(lambda seen: any(s.state == "idle" for s in seen), timeout_s=20)
            waited = time.monotonic() - restarted
            deadline = time.monotonic() + 10
            while reader.presences == 0:
                assert time.monotonic() < deadline, "no presence after the restart"
                time.sleep(0.05)
            reader.publish(run_message(WARM, ["pi"], strategy="local", rounds=1), RUN_TOPIC)
            reader.wait_for(lambda seen: any(s.state == "done" for s in seen), timeout_s=30)
        finally:
            reader.transport.stop()
    finally:
        stop(agent)
    assert waited < 15, f"the retained status came back after {waited:.1f} s"
