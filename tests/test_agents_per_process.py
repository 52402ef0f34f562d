"""Several agents in one process (`coordinator emulate --agents-per-process K`): the same
numbers as simulate, each agent's own log, and one agent killed alone."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner
from conftest import wait_until_logged

from agent.experiment import ExperimentConfig
from agent.learning import preset
from agent.runtime import checkpoint
from coordinator import cli
from coordinator.emulate import Emulation, EmulationOptions, auto_agents_per_process
from coordinator.simulate import simulate
from protocol import MqttTransport, messages, topics
from tests.test_emulate import assert_same_learning

pytestmark = pytest.mark.timeout(600)


def config(strategy: str = "dadpfl", agents: int = 6, rounds: int = 3) -> ExperimentConfig:
    extra = {"max_wait": 2} if strategy == "dadpfl" else {}
    return ExperimentConfig(
        dataset="mnist1d",
        agents=agents,
        partition="dirichlet:0.5",
        seed=7,
        round_time_s=0.01,
        learning=preset(strategy, rounds=rounds, neighbours=3, epochs=1, **extra),
    )


def test_agents_sharing_processes_give_the_numbers_of_simulate(
    amqtt_broker, tmp_path: Path
) -> None:
    """A centralized fleet here; tests/test_emulate.py runs its decentralized comparisons
    with agents sharing processes too."""
    cfg = config("fedavg")
    workdir = tmp_path / "fleet"
    options = EmulationOptions(workdir=workdir, linger_s=20.0, agents_per_process=3)
    emulation = Emulation(cfg, amqtt_broker.address, options)
    emulated = emulation.run()
    assert emulated["summary"]["failed_agents"] == {}
    assert emulated["summary"]["stragglers"] == []
    assert_same_learning(emulated, simulate(cfg))
    hosts = {id(host) for host in emulation.shared.values()}
    assert len(hosts) == 2, "six agents, three to a process"
    for agent_id in emulation.roster:  # each agent's own messages in its own log
        log = emulation.log_path(agent_id).read_text()
        assert f"agent {agent_id} joined fleet" in log and f"agent {agent_id} stopped" in log
        others = set(emulation.roster) - {agent_id}
        assert not any(f"agent {other} " in log for other in others), log


def watch_presence(broker: Any, fleet: str) -> tuple[MqttTransport, list[messages.Presence]]:
    """Every presence message of the fleet, as the broker delivers them."""
    seen: list[messages.Presence] = []

    def on_presence(_topic: str, payload: bytes) -> None:
        message = messages.decode(payload)
        if isinstance(message, messages.Presence):
            seen.append(message)

    watcher = MqttTransport(broker)
    watcher.subscribe(topics.presence(fleet), on_presence)
    watcher.start()
    assert watcher.wait_subscribed(10)
    return watcher, seen


def test_one_agent_killed_in_a_shared_process_fails_alone(amqtt_broker, tmp_path: Path) -> None:
    cfg = config(agents=4, rounds=6)
    options = EmulationOptions(
        workdir=tmp_path / "fleet", round_timeout_s=2.0, linger_s=2.0, agents_per_process=2
    )
    emulation = Emulation(cfg, amqtt_broker.address, options)
    watcher, presences = watch_presence(amqtt_broker.address, emulation.fleet)
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(report=emulation.run()), daemon=True)
    thread.start()
    wait_until_logged(emulation, thread, "agent-001", 2)
    emulation.kill_agent("agent-001")
    thread.join(400)
    watcher.stop()
    hosts = set(emulation.shared.values())
    assert all(host.process.poll() is not None for host in hosts), "none outlives the run"
    summary = result["report"]["summary"]
    assert summary["failures"].keys() == {"agent-001"}
    failure = summary["failures"]["agent-001"]
    assert failure["reason"] == "exit code -9 (SIGKILL)"
    logged = checkpoint.read_records(emulation.round_log("agent-001"))
    assert failure["from_round"] == max(logged) + 1 >= 3
    assert summary["failed_agents"] == {"agent-001": -9}
    assert summary["rounds"] == 6 and summary["agents_reported"] == 3
    mate = checkpoint.read_records(emulation.round_log("agent-000"))
    assert sorted(mate) == list(range(1, 7)), "its process-mate finished every round"
    gone = [p for p in presences if p.sender == "agent-001" and not p.online]
    assert [p.reason for p in gone] == ["lost"], "the broker published its last will"
    assert emulation.shared["agent-000"] is emulation.shared["agent-001"]


def test_the_emulate_command_shares_processes_as_asked_and_by_default_for_large_fleets(
    amqtt_broker, tmp_path: Path
) -> None:
    workdir = tmp_path / "w"
    report = tmp_path / "report.json"
    args = ["emulate", "--broker", str(amqtt_broker.address), "--workdir", str(workdir)]
    flags = ["--agents", "4", "--rounds", "2", "--strategy", "fedavg", "--report", str(report)]
    result = CliRunner().invoke(cli.main, [*args, *flags, "--agents-per-process", "2"])
    assert result.exit_code == 0, result.output
    assert "4 agents (2 per process)" in result.output
    specs = [json.loads(p.read_text()) for p in sorted(workdir.glob("host-*.json"))]
    assert [[agent["id"] for agent in spec] for spec in specs] == [
        ["agent-000", "agent-001"],
        ["agent-002", "agent-003"],
    ]
    assert json.loads(report.read_text())["summary"]["failures"] == {}
    # A fleet spreads over 2 x cores processes: a process per agent while the cores allow.
    assert auto_agents_per_process(4, cores=2) == 1
    assert auto_agents_per_process(8, cores=2) == 2
    assert auto_agents_per_process(8, cores=16) == 1
    assert auto_agents_per_process(32, cores=2) == 8
    assert auto_agents_per_process(1000, cores=16) == 32


def test_agents_sharing_a_process_compute_one_at_a_time(monkeypatch) -> None:
    """A hundred threads training at once starve the network threads of the interpreter;
    a host's agents take turns (`share_compute`), lone agents never wait."""
    from agent import workload

    running, most = 0, 0
    lock = threading.Lock()

    def compute() -> None:
        nonlocal running, most
        with workload.compute_slot():
            with lock:
                running += 1
                most = max(most, running)
            threading.Event().wait(0.05)
            with lock:
                running -= 1

    def most_at_once() -> int:
        threads = [threading.Thread(target=compute) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return most

    monkeypatch.setattr(workload, "_COMPUTE", [])
    assert most_at_once() > 1, "no slots: a lone agent's process"
    most = 0
    workload.share_compute(1)
    assert most_at_once() == 1


def test_an_agent_without_early_stopping_records_its_round_while_others_compute(
    monkeypatch,
) -> None:
    """Early stopping off: `stops_after` computes nothing, so it must not wait for the
    process's compute slot (held here by another agent's training until the test ends)."""
    from agent import workload
    from agent.learning.config import StrategyConfig
    from agent.learning.early_stop import EarlyStop, StopRule
    from agent.runtime.session import Session

    monkeypatch.setattr(workload, "_COMPUTE", [])
    workload.share_compute(1)
    training, done = threading.Event(), threading.Event()

    def other_agent_trains() -> None:
        with workload.compute_slot():
            training.set()
            done.wait(30)

    other = threading.Thread(target=other_agent_trains)
    other.start()
    training.wait(5)
    answers: list[bool] = []
    agent = SimpleNamespace(
        early=EarlyStop(False, StopRule("progress", 20, 0.1)),
        cfg=StrategyConfig(),  # no --max-epsilon: its privacy budget never stops it
        data=SimpleNamespace(y_train=[0] * 10),
        state=SimpleNamespace(dp_steps=0),
    )
    recording = threading.Thread(target=lambda: answers.append(Session.stops_after(agent, {}, 1.0)))
    recording.start()
    recording.join(5)
    answered_while_the_other_trained = list(answers)
    done.set()
    other.join()
    recording.join()
    assert answered_while_the_other_trained == [False], "it waited for the compute slot"
