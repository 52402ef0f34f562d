"""The two programs as a person runs them: real processes, a real embedded broker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
COORDINATOR = [
    sys.executable,
    "-c",
    "from coordinator.cli import main; main(prog_name='coordinator')",
]
EDGE_AGENT = [sys.executable, "-c", "from agent.cli import main; main(prog_name='edge-agent')"]


def _spawn(command: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)


def _wait_for_text(log: Path, text: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in log.read_text(errors="replace"):
            return
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not in {log.name}:\n{log.read_text(errors='replace')}")


def _status(port: int, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [*COORDINATOR, "status", "--broker", f"127.0.0.1:{port}", *extra]
    wide = {**os.environ, "COLUMNS": "160"}
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60, env=wide)


def _fleet(port: int) -> dict[str, dict]:
    result = _status(port, "--json", "--wait", "0.5")
    assert result.returncode == 0, result.stderr
    return {entry["agent"]: entry for entry in json.loads(result.stdout)}


def _wait_for_fleet(port: int, check, timeout_s: float = 20.0) -> dict[str, dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        fleet = _fleet(port)
        if check(fleet) or time.monotonic() > deadline:
            return fleet
        time.sleep(0.3)


@pytest.fixture
def served(tmp_path: Path, unused_port: int) -> Iterator[tuple[subprocess.Popen[bytes], int, Path]]:
    log = tmp_path / "serve.log"
    serve = _spawn([*COORDINATOR, "serve", "--host", "127.0.0.1", "--port", str(unused_port)], log)
    try:
        _wait_for_text(log, f"listening on 127.0.0.1:{unused_port}")
        yield serve, unused_port, log
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait(10)


def test_serve_status_and_agents_end_to_end(served, tmp_path: Path) -> None:
    serve, port, serve_log = served
    broker = f"127.0.0.1:{port}"
    agents = {
        name: _spawn(
            [*EDGE_AGENT, "--broker", broker, "--id", name, "--profile", profile],
            tmp_path / f"{name}.log",
        )
        for name, profile in (("pi-1", "raspberry-pi-4"), ("nano-2", "jetson-nano"))
    }
    try:
        fleet = _wait_for_fleet(port, lambda f: all(f.get(a, {}).get("online") for a in agents))
        assert fleet["pi-1"]["online"] and fleet["nano-2"]["online"]
        assert fleet["pi-1"]["profile"] == "raspberry-pi-4"
        assert fleet["nano-2"]["state"] == "idle"
        assert fleet["gateway"]["role"] == "coordinator"

        agents["nano-2"].send_signal(signal.SIGKILL)
        agents["pi-1"].send_signal(signal.SIGINT)
        assert agents["pi-1"].wait(15) == 0
        fleet = _wait_for_fleet(
            port, lambda f: not f["nano-2"]["online"] and not f["pi-1"]["online"]
        )
        assert fleet["nano-2"]["reason"] == "lost"
        assert fleet["pi-1"]["reason"] == "shutdown"
        assert fleet["pi-1"]["since"] > fleet["nano-2"]["since"] - 60

        table = _status(port)
        assert table.returncode == 0
        assert "pi-1" in table.stdout and "offline since" in table.stdout
        assert "lost" in table.stdout
        _wait_for_text(serve_log, "default/nano-2: lost")
    finally:
        for process in agents.values():
            if process.poll() is None:
                process.kill()
            process.wait(10)

    serve.send_signal(signal.SIGINT)
    assert serve.wait(20) == 0
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
    mosquitto_broker, tmp_path: Path
) -> None:
    from protocol import Discovery

    address = mosquitto_broker.address
    broker = f"{address.host}:{address.port}"
    fleet = f"cli-{os.getpid()}"
    serve_log, agent_log = tmp_path / "serve.log", tmp_path / "agent.log"
    serve = _spawn(
        [*COORDINATOR, "serve", "--broker", broker, "--fleet", fleet, "--mdns", "127.0.0.1"],
        serve_log,
    )
    agent = _spawn(
        [*EDGE_AGENT, "--broker", broker, "--fleet", fleet, "--id", "a1", "--mdns", "127.0.0.1"],
        agent_log,
    )
    try:
        with Discovery(["127.0.0.1"]) as discovery:
            peers = discovery.wait_for_peers(fleet, 1, timeout=15.0)
            assert peers["a1"].broker == broker
            deadline = time.monotonic() + 15
            while (address.host, address.port) not in discovery.brokers():
                assert time.monotonic() < deadline, discovery.brokers()
                time.sleep(0.1)
        _wait_for_text(serve_log, f"using MQTT broker at {broker}")
        _wait_for_text(serve_log, f"{fleet}/a1: online")
    finally:
        for process in (agent, serve):
            process.send_signal(signal.SIGINT)
            assert process.wait(20) == 0
