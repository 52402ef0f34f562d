"""Real agents and a real coordinator under the fleet's ACL: the topics they publish are all
their own, so a run completes and the broker denies nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_agent_service import write_data, write_run
from test_cli import COORDINATOR, EDGE_AGENT, REPO

from coordinator.broker_config import COORDINATOR_IDS, Listener, write_broker_config
from protocol.acl import fleet_grants
from tests.conftest import BrokerProcess
from tests.processes import Processes

FLEET = "acl"


def start_secured_broker(tmp: Path, port: int, coordinator: str | None) -> BrokerProcess:
    folder = tmp / "auth"
    grants = fleet_grants(FLEET, ["a1", "a2"], coordinator, COORDINATOR_IDS)
    write_broker_config(folder, FLEET, grants, Listener(port, "127.0.0.1"))
    command = [sys.executable, "-m", "coordinator.broker", "--port", str(port)]
    broker = BrokerProcess("amqtt", [*command, "--auth", str(folder)], port, tmp / "broker.log")
    broker.start()
    return broker


def member(tmp: Path, name: str) -> list[str]:
    return ["--config", str(tmp / "auth" / "members" / name / "broker.toml")]


def agents(
    processes: Processes, tmp: Path, broker: str, extra: list[str]
) -> dict[str, subprocess.Popen[bytes]]:
    fleet = {}
    for k, name in enumerate(("a1", "a2")):
        data = write_data(tmp / f"{name}.npz", [k, k + 1, k + 2, k + 3], samples=120, seed=k)
        command = [
            *EDGE_AGENT, "--broker", broker, *member(tmp, name), "--id", name, "--fleet", FLEET,
            "--data", str(data), "--state-dir", str(tmp / name), "--round-timeout", "20", *extra,
        ]  # fmt: skip
        fleet[name] = processes.spawn(command, tmp / f"{name}.log")
    return fleet


def finish(fleet: dict[str, subprocess.Popen[bytes]], tmp: Path, timeout_s: float) -> None:
    """Each agent ends its run and exits cleanly (the `processes` fixture ends any other)."""
    for name, process in fleet.items():
        assert process.wait(timeout_s) == 0, (tmp / f"{name}.log").read_text()[-3000:]


@pytest.mark.slow
def test_a_fleet_without_coordinator_runs_under_the_acl(
    tmp_path: Path, unused_port: int, processes: Processes
) -> None:
    broker = start_secured_broker(tmp_path, unused_port, coordinator=None)
    run = write_run(tmp_path / "run.toml", strategy="dadpfl", agents=2, rounds=2,
                    input_shape=[1, 40], classes=10)  # fmt: skip
    try:
        expect = ["--expect", "2", "--run", str(run)]
        fleet = agents(processes, tmp_path, str(broker.address), expect)
        finish(fleet, tmp_path, 120)
    finally:
        broker.kill()
    assert not {"denied", "refused"} & set((tmp_path / "broker.log").read_text().split())


@pytest.mark.slow
def test_a_coordinated_centralized_run_under_the_acl(
    tmp_path: Path, unused_port: int, processes: Processes
) -> None:
    broker = start_secured_broker(tmp_path, unused_port, coordinator="gateway")
    run = write_run(tmp_path / "run.toml", strategy="fedavg", agents=2, rounds=2,
                    input_shape=[1, 40], classes=10)  # fmt: skip
    address = str(broker.address)
    try:
        fleet = agents(processes, tmp_path, address, ["--once"])
        report = tmp_path / "report.json"
        conductor = [
            *COORDINATOR, "run", str(run), "--broker", address, *member(tmp_path, "gateway"),
            "--fleet", FLEET, "--report", str(report),
        ]  # fmt: skip
        result = subprocess.run(conductor, cwd=REPO, capture_output=True, text=True, timeout=100)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        assert report.exists()
        finish(fleet, tmp_path, 30)
    finally:
        broker.kill()
    assert not {"denied", "refused"} & set((tmp_path / "broker.log").read_text().split())
