"""The two programs as a person runs them: real processes, a real embedded broker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.processes import Processes, interrupt, wait_for_text, wait_until

REPO = Path(__file__).resolve().parent.parent
COORDINATOR = [
    sys.executable,
    "-c",
    "from coordinator.cli import main; main(prog_name='coordinator')",
]
EDGE_AGENT = [sys.executable, "-c", "from agent.cli import main; main(prog_name='edge-agent')"]


def _status(port: int, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [*COORDINATOR, "status", "--broker", f"127.0.0.1:{port}", *extra]
    wide = {**os.environ, "COLUMNS": "160"}
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60, env=wide)


def _fleet(port: int) -> dict[str, dict]:
    result = _status(port, "--json", "--wait", "0.5")
    assert result.returncode == 0, result.stderr
    return {entry["agent"]: entry for entry in json.loads(result.stdout)}


def _wait_for_fleet(
    port: int, check: Callable[[dict[str, dict]], bool], what: str, timeout_s: float = 60.0
) -> dict[str, dict]:
    """The fleet as `coordinator status` shows it, once `check` holds; the bound only
    guards a hang, and a fleet that never gets there fails with what status showed."""
    deadline = time.monotonic() + timeout_s
    while not check(fleet := _fleet(port)):
        assert time.monotonic() < deadline, f"{what}: status shows {fleet}"
        time.sleep(0.3)
    return fleet


def _online(fleet: dict[str, dict], agent: str) -> bool | None:
    """Whether `agent` shows online (None while status has not heard of it)."""
    return fleet[agent]["online"] if agent in fleet else None


@pytest.fixture
def served(
    tmp_path: Path, unused_port: int, processes: Processes
) -> tuple[subprocess.Popen[bytes], int, Path]:
    log = tmp_path / "serve.log"
    command = [*COORDINATOR, "serve", "--host", "127.0.0.1", "--port", str(unused_port)]
    serve = processes.spawn(command, log)
    wait_for_text(log, f"listening on 127.0.0.1:{unused_port}", process=serve)
    return serve, unused_port, log


def test_serve_status_and_agents_end_to_end(served, processes: Processes, tmp_path: Path) -> None:
    serve, port, serve_log = served
    broker = f"127.0.0.1:{port}"
    agents = {
        name: processes.spawn(
            [*EDGE_AGENT, "--broker", broker, "--id", name, "--profile", profile]
            + ["--state-dir", str(tmp_path / name)],
            tmp_path / f"{name}.log",
        )
        for name, profile in (("pi-1", "raspberry-pi-4"), ("nano-2", "jetson-nano"))
    }
    # An agent takes seconds of CPU to start (torch): on a loaded machine tens of seconds
    # pass before it joins. Its own line says when it has; a fixed window of status polls
    # from the spawn ran out first and left the agents out of the table (KeyError 'pi-1').
    for name, agent in agents.items():
        wait_for_text(tmp_path / f"{name}.log", "waiting for a run", process=agent)
    fleet = _wait_for_fleet(port, lambda f: all(_online(f, a) for a in agents), "agents online")
    assert fleet["pi-1"]["profile"] == "raspberry-pi-4"
    assert fleet["nano-2"]["state"] == "idle"
    assert fleet["gateway"]["role"] == "coordinator"

    agents["nano-2"].send_signal(signal.SIGKILL)
    assert interrupt(agents["pi-1"], 15) == 0
    fleet = _wait_for_fleet(
        port, lambda f: all(_online(f, a) is False for a in agents), "agents offline"
    )
    assert fleet["nano-2"]["reason"] == "lost"
    assert fleet["pi-1"]["reason"] == "shutdown"
    assert fleet["pi-1"]["since"] > fleet["nano-2"]["since"] - 60

    table = _status(port)
    assert table.returncode == 0
    assert "pi-1" in table.stdout and "offline since" in table.stdout
    assert "lost" in table.stdout
    wait_for_text(serve_log, "default/nano-2: lost")

    assert interrupt(serve) == 0
    assert "stopped" in serve_log.read_text()


def test_serve_refuses_a_port_in_use(served, tmp_path: Path) -> None:
    _, port, _ = served
    result = subprocess.run(
        [*COORDINATOR, "serve", "--host", "127.0.0.1", "--port", str(port)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "already in use" in result.stderr


def test_status_says_when_the_broker_is_unreachable(unused_port: int) -> None:
    result = _status(unused_port, "--timeout", "1")
    assert result.returncode == 1
    assert (
        f"no MQTT broker answers at 127.0.0.1:{unused_port} (connection refused)" in result.stderr
    )


@pytest.mark.parametrize(
    ("command", "message"),
    [
        ([*COORDINATOR, "status", "--broker", "host:99999"], "port"),
        ([*COORDINATOR, "status", "--broker", "a:b:c"], "bad broker address"),
        ([*COORDINATOR, "serve", "--fleet", "Bad/Fleet"], "invalid fleet"),
        ([*COORDINATOR, "serve", "--port", "0"], "0 is not in the range"),
        ([*COORDINATOR, "serve", "--key-file", "/nonexistent/key"], "does not exist"),
        ([*COORDINATOR, "bogus"], "No such command"),
        (
            [*COORDINATOR, "emulate", "--strategy", "fedavg", "--wire", "delta"],
            "--wire has no effect here",
        ),
        ([*COORDINATOR, "emulate", "--dataset", "npz:/no/such.npz"], "/no/such.npz"),
        (
            [*EDGE_AGENT, "--broker", "127.0.0.1", "--expect", "2", "--strategy", "fedspu"],
            "fedspu is centralized",
        ),
        ([*EDGE_AGENT], "no broker: give --broker HOST[:PORT]"),
        ([*EDGE_AGENT, "--broker", "127.0.0.1", "--profile", "no-such-board"], "jetson-nano"),
        ([*EDGE_AGENT, "--broker", "127.0.0.1", "--id", "UPPER"], "invalid id 'UPPER'"),
    ],
)
def test_bad_arguments_get_a_one_line_error(command: list[str], message: str) -> None:
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_a_short_key_file_is_refused(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_bytes(b"short")
    result = subprocess.run(
        [*EDGE_AGENT, "--broker", "127.0.0.1:1", "--key-file", str(key)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "at least 16 bytes" in result.stderr


def test_help_describes_every_command() -> None:
    for command in (
        [*COORDINATOR, "--help"],
        [*COORDINATOR, "serve", "--help"],
        [*COORDINATOR, "status", "--help"],
        [*EDGE_AGENT, "--help"],
    ):
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0
        assert "--broker" in result.stdout or "serve" in result.stdout


@pytest.mark.mosquitto
def test_mdns_announces_an_external_broker_and_agents_on_loopback(
    mosquitto_broker, processes: Processes, tmp_path: Path
) -> None:
    from protocol import Discovery

    address = mosquitto_broker.address
    broker = f"{address.host}:{address.port}"
    fleet = f"cli-{os.getpid()}"
    serve_log, agent_log = tmp_path / "serve.log", tmp_path / "agent.log"
    serve = processes.spawn(
        [*COORDINATOR, "serve", "--broker", broker, "--fleet", fleet, "--mdns", "127.0.0.1"],
        serve_log,
    )
    agent = processes.spawn(
        [*EDGE_AGENT, "--broker", broker, "--fleet", fleet, "--id", "a1", "--mdns", "127.0.0.1"]
        + ["--state-dir", str(tmp_path / "a1")],
        agent_log,
    )
    # Both advertise before these lines: the adverts' wait below starts once they exist,
    # however long the programs took to start on a loaded machine.
    wait_for_text(serve_log, f"following fleet {fleet}", process=serve)
    wait_for_text(agent_log, "waiting for a run", process=agent)
    with Discovery(["127.0.0.1"]) as discovery:
        peers = discovery.wait_for_peers(fleet, 1, timeout=15.0)
        assert "a1" in peers, f"no advert of a1 over mDNS: {peers}"
        assert peers["a1"].broker == broker
        wait_until(lambda: (address.host, address.port) in discovery.brokers(), "broker advert")
    wait_for_text(serve_log, f"using MQTT broker at {broker}", process=serve)
    wait_for_text(serve_log, f"{fleet}/a1: online", process=serve)
    assert interrupt(agent) == 0
    assert interrupt(serve) == 0
