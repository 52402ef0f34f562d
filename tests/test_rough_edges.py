"""Rough edges of the gateway a long-lived fleet runs into: what `coordinator serve` logs and
how it stops, a broker address where nothing answers, the status table with a long
rejection, the dashboard across runs, and the folders `coordinator emulate` leaves."""

from __future__ import annotations

import io
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from test_cli import COORDINATOR, EDGE_AGENT, REPO

from agent.report import AgentRound
from coordinator.broker import EmbeddedBroker
from coordinator.dashboard import FleetState
from coordinator.dashboard.metrics import registry_for
from coordinator.fleet import FleetView, fleet_table
from protocol import BrokerAddress, MqttTransport, messages, topics
from tests.processes import Processes, interrupt, wait_for_text

FLEET = "lab"

pytestmark = pytest.mark.timeout(60)


def status(
    agent: str, state: str, run_id: str = "", round_: int = 0, **metrics: Any
) -> tuple[str, bytes]:
    message = messages.Status(
        fleet=FLEET, sender=agent, run_id=run_id, round=round_, state=state, metrics=metrics
    )
    return topics.status(FLEET, agent), messages.encode(message)


def presence(agent: str) -> tuple[str, bytes]:
    message = messages.Presence(fleet=FLEET, sender=agent, online=True, since=time.time())
    return topics.presence(FLEET, agent), messages.encode(message)


# ------------------------------------------------------------------ coordinator serve


@pytest.fixture
def serve(
    tmp_path: Path, unused_port: int, processes: Processes
) -> tuple[subprocess.Popen[bytes], Path]:
    log = tmp_path / "serve.log"
    command = [*COORDINATOR, "serve", "--port", str(unused_port), "--fleet", FLEET]
    process = processes.spawn(command, log)
    wait_for_text(log, "press Ctrl-C to stop", process=process)
    return process, log


def agent_connection(port: int, agent: str) -> MqttTransport:
    """An agent's connection: its presence as birth, its last will, as edge-agent has."""
    gone = messages.Presence(fleet=FLEET, sender=agent, online=False, since=time.time())
    transport = MqttTransport(
        BrokerAddress("127.0.0.1", port),
        birth=presence(agent),
        will=(topics.presence(FLEET, agent), messages.encode(gone)),
    )
    transport.start()
    assert transport.wait_connected(5)
    return transport


def test_serve_logs_changes_not_rounds_and_stops_quietly(serve, unused_port: int) -> None:
    process, log = serve
    agents = {name: agent_connection(unused_port, name) for name in ("a1", "a2")}
    run = messages.RunConfig(
        fleet=FLEET, sender="coordinator", run_id="r1", roster=sorted(agents), seed=1,
        config={"learning": {"strategy": "fedavg", "rounds": 5}},
    )  # fmt: skip
    try:
        agents["a1"].publish(topics.run(FLEET), messages.encode(run), retain=True)
        # Agents train only once the run reached them: statuses of its rounds follow it.
        wait_for_text(log, "lab: run r1: fedavg")
        for round_ in range(6):
            for name, transport in agents.items():
                state = "idle" if round_ == 0 else "training" if round_ < 5 else "done"
                topic, payload = status(name, state, "r1" if round_ else "", round_)
                transport.publish(topic, payload, retain=True)
        for name, transport in agents.items():
            transport.publish(*status(name, "idle"), retain=True)
        wait_for_text(log, "lab/a2: online, done round 5/5")
        wait_for_text(log, "lab/a2: online, idle\n")  # (its second idle)
        time.sleep(0.3)
        assert interrupt(process) == 0  # the agents still connected: their wills fly
    finally:
        for transport in agents.values():
            transport.stop()
    text = log.read_text()
    assert [line for line in text.splitlines() if line.startswith("lab/a1")] == [
        "lab/a1: online",
        "lab/a1: online, idle",
        "lab/a1: online, training round 1/5",
        "lab/a1: online, done round 5/5",
        "lab/a1: online, idle",
    ], "a line when the state changes, none when only the round does"
    progress = [line for line in text.splitlines() if line.startswith("lab: run r1")]
    assert progress == [
        "lab: run r1: fedavg, 2 agents, 5 rounds",
        "lab: run r1 at round 1/5",
    ], "progress every 30 s at most"
    assert "not broadcasted" not in text and "Traceback" not in text, text


def test_the_embedded_broker_stops_at_once_while_agents_send(unused_port: int) -> None:
    broker = EmbeddedBroker(port=unused_port)
    broker.start()
    agents = [agent_connection(unused_port, f"a{i}") for i in range(5)]
    try:
        for transport in agents:
            transport.subscribe(topics.status(FLEET), lambda _topic, _payload: None)
            assert transport.wait_subscribed(5)
        for transport in agents:
            for _ in range(10):
                transport.publish(topics.status(FLEET, "a0"), b"x" * 100, qos=0)
        started = time.monotonic()
        broker.stop()
        assert time.monotonic() - started < 3, "not its whole shutdown timeout (15 s)"
    finally:
        for transport in agents:
            transport.stop()


@pytest.mark.parametrize("command", [["status"], ["serve"], ["emulate", "--agents", "2"]])
@pytest.mark.parametrize("where", ["refused", "no-such-name"])
def test_a_broker_address_where_nothing_answers_is_one_line(
    command: list[str], where: str, unused_port: int, tmp_path: Path
) -> None:
    address = f"127.0.0.1:{unused_port}" if where == "refused" else "no-such-host.invalid"
    started = time.monotonic()
    result = subprocess.run(
        [*COORDINATOR, *command, "--broker", address],
        cwd=REPO,
        env={**os.environ, "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert time.monotonic() - started < 15, "said within seconds (of a Python start)"
    assert result.returncode == 1
    expected = (
        f"Error: no MQTT broker answers at 127.0.0.1:{unused_port} (connection refused): "
        "check --broker"
        if where == "refused"
        else "Error: the broker's name 'no-such-host.invalid' does not resolve ("
    )
    assert result.stderr.startswith(expected), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert list(tmp_path.iterdir()) == [], "nothing left behind (emulate's scratch folder)"


def test_a_mistyped_broker_name_is_said_before_any_admission(tmp_path: Path) -> None:
    """An agent given a broker name that does not resolve hears that, not that it is not
    admitted to a fleet it never reached (and no key is made for it)."""
    state = tmp_path / "z1"
    result = subprocess.run(
        [*EDGE_AGENT, "--broker", "no-such-host.invalid", "--id", "z1", "--state-dir", str(state)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("Error: the broker's name 'no-such-host.invalid' does not")
    assert result.stderr.strip().endswith(": check --broker"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not state.exists()


# ------------------------------------------------------------------ the status table


def test_a_long_rejection_keeps_the_table_within_the_terminal() -> None:
    reason = "its data does not fit the run: " + "the model wants 784 features, " * 7
    view = FleetView()
    for agent, error in (("a1", reason), ("a2", reason), ("a3", "disk full")):
        view.feed(*presence(agent))
        view.feed(*status(agent, "rejected", "r1", error=error))
    view.feed(*presence("a4"))
    view.feed(*status("a4", "training", "r1", 3, accuracy=0.5))
    console = Console(width=100, file=io.StringIO(), color_system=None)
    console.print(fleet_table(view.entries(), width=100))
    lines = console.file.getvalue().splitlines()  # type: ignore[attr-defined]
    assert max(map(len, lines)) <= 100
    rows = {line.split()[0]: line for line in lines if line.strip().startswith("a")}
    assert "left out [1]" in rows["a1"] and "left out [1]" in rows["a2"], "one note, shared"
    assert "left out [2]" in rows["a3"] and "training" in rows["a4"]
    notes = [line.strip() for line in lines if line.strip().startswith("[")]
    assert notes[0].startswith("[1] its data does not fit the run: the model wants")
    assert notes[0].endswith("…"), "cut to the width, not wrapped"
    assert notes[1] == "[2] disk full"


# ------------------------------------------------------------------ the dashboard


def round_status(agent: str, run_id: str, round_: int, last: int) -> tuple[str, bytes]:
    """Round `round_` of a run like every other: the same traffic, energy and FLOPs."""
    row = AgentRound(
        round_, agent, 0.1 * round_, loss=1.0, train_loss=1.0, sparsity=0.5,
        bytes_sent=1000 * round_, bytes_received=700, train_flops=5000,
        energy_j=0.25, stragglers=["a2"] if round_ == last and agent == "a1" else [],
    )  # fmt: skip
    record = row.as_dict()
    figures = {k: record[k] for k in ("bytes_sent", "bytes_received", "energy_j", "stragglers")}
    state = "training" if round_ < last else "done"
    return status(agent, state, run_id, round_, **figures, record=record)


def per_run(state: FleetState) -> tuple[dict[str, Any], dict[str, float]]:
    """The agents' rows (without what names the run) and the /metrics samples."""
    keep = ("round", "bytes_sent", "bytes_received", "train_flops", "energy_total_j")
    rows = {
        row["agent"]: {k: row[k] for k in (*keep, "stragglers", "series")}
        for row in state.snapshot()["agents"]
    }
    text = generate_latest(registry_for(state)).decode()
    samples = {
        f"{s.name}/{s.labels.get('agent', '')}": s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    return rows, samples


def test_the_dashboard_counts_each_run_from_zero() -> None:
    state = FleetState(FLEET)
    for agent in ("a1", "a2"):
        state.feed(*presence(agent))
    figures = []
    for run_id in ("r1", "r2"):
        for agent in ("a1", "a2"):
            state.feed(*status(agent, "ready", run_id))
        state.feed(*round_status("a1", run_id, 1, 3))
        first = state.snapshot()["agents"][0]
        assert (first["bytes_sent"], first["stragglers"]) == (1000, []), "nothing of r1 in r2"
        for round_ in range(1, 4):
            for agent in ("a1", "a2"):
                state.feed(*round_status(agent, run_id, round_, 3))
        for agent in ("a1", "a2"):
            state.feed(*status(agent, "idle"))  # the run is over
        figures.append(per_run(state))
    (rows, samples), (again, samples_again) = figures
    assert rows["a1"]["round"] == 3, "the last run's final round, not 0"
    assert rows["a1"]["energy_total_j"] == pytest.approx(0.75)
    assert (rows["a1"]["bytes_sent"], rows["a1"]["stragglers"]) == (6000, ["a2"])
    assert samples["edgefl_agent_training_energy_joules_total/a1"] == pytest.approx(0.75)
    assert samples["edgefl_fleet_round/"] == 3
    assert again == rows and samples_again == samples, "two runs alike read alike"


# ------------------------------------------------------------------ coordinator emulate


def test_emulate_removes_its_temporary_folder_after_a_good_run(
    tmp_path: Path, processes: Processes
) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    report = tmp_path / "report.json"
    command = [*COORDINATOR, "emulate", "--agents", "2", "--rounds", "1", "--report", str(report)]
    emulate = processes.popen(  # a timeout ends its agents with it
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(scratch)},
    )
    out, err = emulate.communicate(timeout=50)
    assert emulate.returncode == 0, out + err
    assert f"logs in {scratch}/emulate-" in out
    assert list(scratch.iterdir()) == [], "its agents' state and logs are gone"
    assert json.loads(report.read_text())["rounds"], "the report is kept"
