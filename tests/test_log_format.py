"""One log format in every program, the agent's id on every line, on real processes.

An edge-agent's output is its log: each line `HH:MM:SS LEVEL AGENT: message`, or one JSON
object with an `agent` field; a broker that goes away and comes back is said both ways as it
happens; agents sharing a process (the Python API) each name themselves on their own lines,
their MQTT threads' lines included; and a login the broker refuses ends in its one-line
error, not after a page of retries.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from protocol.signing import public_line
from tests.conftest import REPO, BrokerProcess, _unused_port

EDGE_AGENT = [sys.executable, "-c", "from agent.cli import main; main(prog_name='edge-agent')"]
LINE = re.compile(r"^\d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR|CRITICAL) (?P<agent>[\w.-]+): \S")
"""The one text format."""
TWO_AGENTS = """
import sys, threading
import edgefl
stop = threading.Event()
broker, state = sys.argv[1], sys.argv[2]
threads = [
    threading.Thread(
        target=edgefl.run_agent,
        kwargs=dict(broker=broker, agent_id=a, state_dir=f"{state}/{a}", stop=stop),
    )
    for a in ("a1", "a2")
]
for thread in threads:
    thread.start()
sys.stdin.read()
stop.set()
for thread in threads:
    thread.join(30)
"""
"""Two agents in threads of one process through the Python API, until stdin closes."""


def spawn(command: list[str], log: Path, stdin: int | None = None) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            command, cwd=REPO, stdin=stdin, stdout=out, stderr=subprocess.STDOUT
        )


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    """The test's processes, each killed at the end if still running."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait(10)


def wait_for(log: Path, found: Callable[[list[str]], bool], what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if found(log.read_text(errors="replace").splitlines()):
            return
        time.sleep(0.1)
    raise AssertionError(f"no {what} in {log.name}:\n{log.read_text(errors='replace')}")


def containing(text: str, count: int = 1) -> Callable[[list[str]], bool]:
    return lambda lines: sum(text in line for line in lines) >= count


def message(line: str, fmt: str) -> tuple[str, str]:
    """(agent, message) of a line in format `fmt`."""
    if fmt == "json":
        entry = json.loads(line)
        return entry["agent"], entry["message"]
    match = LINE.match(line)
    assert match, f"not in the one format: {line!r}"
    return match["agent"], line[match.end() - 1 :]


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_an_agent_logs_in_one_format_and_says_when_the_broker_is_back(
    amqtt_broker: BrokerProcess, processes: list, tmp_path: Path, fmt: str
) -> None:
    log = tmp_path / "pi-1.log"
    agent = spawn(
        [*EDGE_AGENT, "--broker", str(amqtt_broker.address), "--id", "pi-1"]
        + ["--state-dir", str(tmp_path / "state"), "--log-format", fmt],
        log,
    )
    processes.append(agent)
    wait_for(log, containing("waiting for a run"), "start")
    amqtt_broker.kill()
    wait_for(log, containing("lost MQTT broker"), "loss")
    amqtt_broker.start()
    wait_for(log, containing("reconnected to MQTT broker"), "reconnection")
    agent.send_signal(signal.SIGINT)
    assert agent.wait(20) == 0
    said = [message(line, fmt) for line in log.read_text().splitlines()]
    assert {agent for agent, _ in said} == {"pi-1"}
    texts = [text for _, text in said]
    lost = next(i for i, text in enumerate(texts) if text.startswith("lost MQTT broker"))
    back = next(i for i, text in enumerate(texts) if text.startswith("reconnected to"))
    assert lost < back and "(connection dropped)" in texts[lost]
    assert re.search(r"after \d+\.\d s$", texts[back]), texts[back]
    assert texts[-1] == "agent pi-1 stopped"


def test_agents_sharing_a_process_each_name_themselves_on_their_lines(
    amqtt_broker: BrokerProcess, processes: list, tmp_path: Path
) -> None:
    log = tmp_path / "api.log"
    command = [sys.executable, "-c", TWO_AGENTS, str(amqtt_broker.address), str(tmp_path)]
    api = spawn(command, log, stdin=subprocess.PIPE)
    processes.append(api)
    wait_for(log, containing("waiting for a run", 2), "start")
    amqtt_broker.kill()  # each agent's network thread says it: lines of their own threads
    wait_for(log, containing("reconnecting", 2), "losses")
    amqtt_broker.start()
    wait_for(log, containing("reconnected to", 2), "reconnections")
    assert api.stdin is not None
    api.stdin.close()
    assert api.wait(30) == 0
    said = [message(line, "text") for line in log.read_text().splitlines()]
    for agent_id in ("a1", "a2"):
        assert all(agent == agent_id for agent, text in said if f"agent {agent_id}" in text)
    for event in ("lost MQTT broker", "reconnected to MQTT broker"):
        assert sorted(agent for agent, text in said if text.startswith(event)) == ["a1", "a2"]


def refusing_by_key(tmp_path: Path) -> tuple[BrokerProcess, list[str]]:
    """The embedded broker taking only admitted keys, and an agent whose key is not."""
    admitted, port = tmp_path / "admitted.keys", _unused_port()
    admitted.write_text("")
    command = [sys.executable, "-m", "coordinator.broker", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--admitted", str(admitted), "--fleet", "default"]
    broker = BrokerProcess("amqtt", command, port, tmp_path / "broker.log")
    trust = tmp_path / "trust.keys"
    trust.write_text(public_line("coordinator", tmp_path / "coordinator.pem") + "\n")
    return broker, ["--id", "d9", "--trust", str(trust)]


def refusing_by_password(tmp_path: Path) -> tuple[BrokerProcess, list[str]]:
    """mosquitto over TLS admitting alice with her password, and alice with another one."""
    from tests.conftest import _mosquitto, _require

    cert, key, passwords = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "passwords"
    subprocess.run(
        [_require("openssl"), "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
        + ["-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost"]
        + ["-addext", "subjectAltName=IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )
    subprocess.run(
        [_require("mosquitto_passwd"), "-b", "-c", str(passwords), "alice", "secret"],
        check=True,
        capture_output=True,
    )
    access = (
        f"certfile {cert}\nkeyfile {key}\npassword_file {passwords}\n"
        "allow_anonymous false\nuser root\n"
    )
    wrong = tmp_path / "wrong-password"
    wrong.write_text("not-the-secret\n")
    login = ["--username", "alice", "--password-file", str(wrong), "--tls-ca", str(cert)]
    return _mosquitto(tmp_path, access), login


@pytest.mark.parametrize(
    "refusing",
    [refusing_by_key, pytest.param(refusing_by_password, marks=pytest.mark.mosquitto)],
    ids=["key-not-admitted", "wrong-password"],
)
def test_a_refused_login_is_its_one_line_error_after_at_most_one_line(
    refusing: Callable[[Path], tuple[BrokerProcess, list[str]]], tmp_path: Path
) -> None:
    broker, login = refusing(tmp_path)
    broker.start()
    try:
        agent = subprocess.run(
            [*EDGE_AGENT, "--broker", str(broker.address), "--state-dir", str(tmp_path / "d")]
            + login,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        broker.kill()
    lines = agent.stderr.splitlines()
    assert agent.returncode == 1 and agent.stdout == ""
    assert len(lines) <= 2, agent.stderr
    assert lines[-1].startswith("Error: the MQTT broker") and "refused" in lines[-1], lines
    assert all(LINE.match(line) for line in lines[:-1]), lines
