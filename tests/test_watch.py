"""`coordinator status` and `--watch`: the fleet table's figures, as a person sees them on a
terminal (a pseudo-terminal here) and in a log, from messages published on a real broker."""

from __future__ import annotations

import fcntl
import io
import os
import re
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from rich.console import Console

from coordinator.broker import EmbeddedBroker
from coordinator.cli import main
from coordinator.fleet import FleetView, fleet_table
from coordinator.watch import show
from protocol import BrokerAddress, MqttTransport, topics
from protocol import messages as m

REPO = Path(__file__).resolve().parent.parent
COORDINATOR = [
    sys.executable,
    "-c",
    "from coordinator.cli import main; main(prog_name='coordinator')",
]
FLEET = "lab"
WAIT_S = 20.0
SAVED = {"round": 7, "saved_rounds": 23, "saved_flops": 4.5e9, "saved_bytes": 1_234_567}

pytestmark = pytest.mark.timeout(60)


def figures(**changes: Any) -> dict[str, Any]:
    """A round's status figures, as a session publishes them."""
    return {
        "accuracy": 0.8123,
        "sparsity": 0.62,
        "p_k": 0.55,
        "limited_by": "time",
        "bytes_sent": 1_234_567,
        "bytes_received": 4_567_890,
        "stragglers": ["agent-002", "agent-003", "agent-004", "agent-005"],
        "t_star": 3,
        "record": {"round": 5, "accuracy": 0.8123},
        **changes,
    }


def presence(agent: str, online: bool = True) -> bytes:
    since = time.time() - 200
    return m.encode(
        m.Presence(fleet=FLEET, sender=agent, online=online, since=since, profile="jetson-nano")
    )


def status(agent: str, round_: int, state: str = "training", **changes: Any) -> bytes:
    stopped = state == "stopped"
    metrics = figures(**changes) | ({"saved": SAVED} if stopped else {})
    message = m.Status(
        fleet=FLEET, sender=agent, round=round_, state=state, stopped=stopped, metrics=metrics
    )
    return m.encode(message)


def fleet() -> FleetView:
    view = FleetView()
    view.feed(topics.presence(FLEET, "agent-000"), presence("agent-000"))
    view.feed(topics.status(FLEET, "agent-000"), status("agent-000", 5))
    view.feed(topics.presence(FLEET, "agent-001"), presence("agent-001"))
    view.feed(
        topics.status(FLEET, "agent-001"),
        status("agent-001", 7, "stopped", p_k=1.0, limited_by="none", stragglers=[]),
    )
    view.feed(topics.presence(FLEET, "agent-002"), presence("agent-002", online=False))
    return view


def rendered(table: Any, width: int) -> list[str]:
    console = Console(width=width, file=io.StringIO(), color_system=None)
    console.print(table)
    return console.file.getvalue().splitlines()  # type: ignore[attr-defined]


def row(lines: list[str], agent: str) -> str:
    return next(line for line in lines if line.lstrip().startswith(agent))


def block(lines: list[str], agent: str) -> str:
    """An agent's row with the lines its wrapped cells continue on."""
    start = lines.index(row(lines, agent))
    rest = [line for line in lines[start + 1 :] if line.strip()]
    end = next((i for i, line in enumerate(rest) if line[:3].strip()), len(rest))
    return " ".join([lines[start], *rest[:end]])


def test_the_table_shows_each_agents_latest_round() -> None:
    lines = rendered(fleet_table(fleet().entries()), 160)
    header = next(line for line in lines if "accuracy" in line).split()
    assert header == [
        "agent",
        "presence",
        "state",
        "round",
        "accuracy",
        "sparsity",
        "p_k",
        "sent",
        "received",
        "energy",
        "stragglers",
        "profile",
    ]
    training = row(lines, "agent-000").split()
    for cell in ("training", "5", "0.812", "62.0%", "0.55", "(time)", "1.2", "4.6", "jetson-nano"):
        assert cell in training
    stragglers = {"agent-002,", "agent-003", "+2"}
    assert stragglers <= set(block(lines, "agent-000").split()), "two named, then a count"
    stopped = block(lines, "agent-001")
    assert "1.00 " in stopped and "(none)" not in stopped, "an unlimited budget says nothing"
    assert {"stopped", "early", "saved", "23", "rounds,", "FLOPs,"} <= set(stopped.split())
    offline = row(lines, "agent-002")
    assert "offline since" in offline and "0.812" not in offline, "no figures before a round"
    assert any(line.strip() == "fleet lab" for line in lines), "a single fleet is the title"


def test_a_narrow_terminal_loses_whole_columns_and_says_which() -> None:
    lines = rendered(fleet_table(fleet().entries(), width=100), 100)
    text = "\n".join(lines)
    assert max(map(len, lines)) <= 100
    header = next(line for line in lines if "accuracy" in line).split()
    assert "profile" not in header and "stragglers" not in header and "p_k" in header
    assert "too narrow for profile, energy, stragglers" in text
    assert "offline since" in text and "0.55 (time)" in text, "kept columns are not folded"


def test_off_a_terminal_each_agent_keeps_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    out = io.StringIO()
    show(Console(file=out, width=80), fleet().entries(), None)
    stopped = row(out.getvalue().splitlines(), "agent-001")
    assert "stopped early after round 7: saved 23 rounds, 4.50e+09 FLOPs, 1.2 MB" in stopped
    assert "\x1b[" not in out.getvalue()


def test_watch_with_json_is_refused_in_one_line() -> None:
    result = CliRunner().invoke(main, ["status", "--watch", "--json"])
    assert result.exit_code == 2
    assert "--watch shows a live table; leave out --json" in result.output


# -- the command against a broker -------------------------------------------------------------


@pytest.fixture
def broker(unused_port: int) -> Iterator[tuple[BrokerAddress, MqttTransport]]:
    """An embedded broker and a connected publisher on it."""
    with (
        EmbeddedBroker("127.0.0.1", unused_port) as embedded,
        MqttTransport(embedded.address) as publisher,
    ):
        assert publisher.wait_connected(WAIT_S)
        yield embedded.address, publisher


def publish(publisher: MqttTransport, topic: str, payload: bytes) -> None:
    assert publisher.publish(topic, payload, retain=True).wait_for_publish(WAIT_S)


class Screen:
    """Everything a child process wrote to a pseudo-terminal, with its escape codes."""

    def __init__(self, fd: int) -> None:
        self.raw = bytearray()
        self._fd = fd
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self._fd, 65536)
            except OSError:  # EIO: the child closed its side
                return
            if not chunk:
                return
            self.raw += chunk

    def close(self) -> None:
        """Wait for the last output (the child has exited), then close our side."""
        self._reader.join(5)
        os.close(self._fd)

    @property
    def text(self) -> str:
        return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", self.raw.decode(errors="replace"))

    def wait_for(self, condition: Callable[[str], bool], what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not condition(self.text):
            assert time.monotonic() < deadline, f"never saw {what} in:\n{self.text[-3000:]}"
            time.sleep(0.05)


def test_watch_on_a_terminal_redraws_as_statuses_arrive(broker) -> None:
    address, publisher = broker
    publish(publisher, topics.presence(FLEET, "agent-000"), presence("agent-000"))
    publish(publisher, topics.status(FLEET, "agent-000"), status("agent-000", 1))
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    command = [*COORDINATOR, "status", "--watch", "--interval", "0.5", "--broker", str(address)]
    child = subprocess.Popen(
        command,
        cwd=REPO,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env={**env, "TERM": "xterm-256color"},
        start_new_session=True,
    )
    os.close(slave)
    screen = Screen(master)
    try:
        screen.wait_for(lambda text: "0.812" in text and "Ctrl-C to stop" in text, "round 1")
        assert b"\x1b[?25l" in screen.raw, "a live display hides the cursor while it redraws"
        publish(
            publisher, topics.status(FLEET, "agent-000"), status("agent-000", 2, accuracy=0.9042)
        )
        screen.wait_for(lambda text: "0.904" in text, "the update")
        after = screen.text.rsplit("0.904", 1)[0].rsplit("agent", 1)[-1]
        assert "2" in after.split(), "the round column moved on with the accuracy"
        child.send_signal(signal.SIGINT)
        assert child.wait(15) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        screen.close()
    assert "Traceback" not in screen.text
    assert screen.raw.rfind(b"\x1b[?25h") > screen.raw.rfind(b"\x1b[?25l"), "cursor shown again"


def read_until(child: subprocess.Popen[bytes], lines: list[str], text: str) -> None:
    """Read `child`'s output lines into `lines` until one holds `text`; its end first fails
    the test (instead of reading empty lines forever)."""
    assert child.stdout is not None
    while not any(text in line for line in lines):
        line = child.stdout.readline().decode()
        assert line, f"the output ended ({child.poll()}) before {text!r}:\n{''.join(lines)}"
        lines.append(line)


def test_watch_off_a_terminal_prints_a_table_per_change(broker) -> None:
    address, publisher = broker
    publish(publisher, topics.presence(FLEET, "agent-000"), presence("agent-000"))
    publish(publisher, topics.status(FLEET, "agent-000"), status("agent-000", 1))
    command = [*COORDINATOR, "status", "--watch", "--interval", "0.3", "--broker", str(address)]
    child = subprocess.Popen(
        command,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "COLUMNS": "160"},
    )
    try:
        lines: list[str] = []
        read_until(child, lines, "0.812")
        publish(
            publisher, topics.status(FLEET, "agent-000"), status("agent-000", 2, accuracy=0.9042)
        )
        read_until(child, lines, "0.904")
        time.sleep(1.0)  # three intervals with nothing new: no more tables
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=15)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
    assert child.returncode == 0, err
    text = "".join(lines) + out.decode()
    assert "\x1b[" not in text, "no cursor control off a terminal"
    tables = re.split(r"─+ \d{4}-\d\d-\d\d \d\d:\d\d:\d\d ─+", text)
    assert "0.904" in tables[-1] and "0.904" not in "".join(tables[:-1]), "quiet: no reprint"
    assert "0.812" in "".join(tables[:-1]) and "Ctrl-C" not in text
