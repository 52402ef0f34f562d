"""Fixtures that run real MQTT brokers (amqtt and mosquitto) on loopback ports.

Each broker runs in a child process so a test can kill it (SIGKILL, like a crash) and start
it again on the same port.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from protocol import BrokerAddress
from tests.processes import Processes, children, left_since

# One intra-op thread: the suite's models are tiny, and two threads per test process fight
# over two cores with the brokers and agents the tests start.
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests marked slow (a wheel install, a fleet in network namespaces, a soak) first,
    the rest in their order: pytest-xdist hands tests out in this order, so the longest
    start while the other worker takes the short ones, instead of one of them starting
    last and running alone at the end of the suite."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def _checkout_files() -> set[str]:
    """What git would list as untracked in the checkout's top folder (ignored files aside:
    a report.json written there is not ignored)."""
    listed = subprocess.run(
        ["git", "ls-files", "--others", "--exclude-standard", "--directory"],
        cwd=REPO, capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    return set(listed.stdout.split()) if listed.returncode == 0 else set()


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_UNTRACKED] = _checkout_files()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the suite when its tests left files in the checkout (a run's report.json from a
    command started in it without --report): they belong in the test's tmp_path. Checked
    once, by the process that runs the session (xdist's workers each have one too)."""
    if hasattr(session.config, "workerinput"):
        return
    left = sorted(_checkout_files() - session.config.stash.get(_UNTRACKED, set()))
    if left:
        session.config.get_terminal_writer().line(
            f"the tests left files in the checkout: {', '.join(left)}", red=True
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_UNTRACKED = pytest.StashKey[set[str]]()


@pytest.fixture(autouse=True, scope="session")
def dataset_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One dataset cache for the session (agent processes inherit it), not the user's."""
    folder = tmp_path_factory.mktemp("dataset-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EDGEFL_CACHE_DIR", str(folder))
        yield folder


@pytest.fixture(autouse=True, scope="session")
def runs_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One gateway run registry for the session (`coordinator run` processes inherit it),
    not the user's ~/.edgefl/runs."""
    folder = tmp_path_factory.mktemp("runs")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EDGEFL_RUNS_DIR", str(folder))
        yield folder


LEFT_GRACE_S = 2.0
"""How long a child found alive after a test's teardown may take to finish exiting (one
signalled without a wait) before it counts as left behind."""


@pytest.fixture(autouse=True)
def left_behind() -> Iterator[None]:
    """Fail a test that leaves a child process running after its teardown (a gateway on
    its port, an agent, a broker), and kill what it left: the next tests, and the people
    on the machine, would otherwise share the CPU with it for minutes. Autouse fixtures
    are torn down after the test's own, so the processes its fixtures end are ended by
    then; those of fixtures of a wider scope were running before it and are not its."""
    before = children()
    yield
    left = left_since(before, LEFT_GRACE_S)
    if left:
        running = "\n".join(left)
        pytest.fail(f"the test left {len(left)} process(es) running (now killed):\n{running}")


@pytest.fixture
def processes() -> Iterator[Processes]:
    """Start a test's processes with this (`tests.processes.Processes`): each is ended at
    the test's end whatever happened, and its session with it."""
    started = Processes()
    try:
        yield started
    finally:
        started.close()


BROKER_START_TIMEOUT_S = 20.0


def _unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _require(tool: str) -> str:
    """Path of a broker tool; a missing one skips the test, or fails it when CI is set."""
    path = shutil.which(tool) or next(
        (p for p in (f"/usr/sbin/{tool}", f"/usr/bin/{tool}") if os.access(p, os.X_OK)), None
    )
    if path is None:
        reason = f"{tool} is not installed (Debian: apt-get install mosquitto openssl)"
        if os.environ.get("CI"):
            pytest.fail(f"{reason}; CI must run the mosquitto tests")
        pytest.skip(reason)
    return path


class BrokerProcess:
    """A broker child process on a fixed loopback port; start, kill and start again."""

    def __init__(self, kind: str, command: list[str], port: int, log_path: Path) -> None:
        self.kind = kind
        self.address = BrokerAddress("127.0.0.1", port)
        self._command = command
        self._log_path = log_path
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        assert self._process is None, "broker already running"
        with open(self._log_path, "ab") as log:
            self._process = subprocess.Popen(
                self._command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + BROKER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                break
            try:
                socket.create_connection((self.address.host, self.address.port), 0.5).close()
                return
            except OSError:
                time.sleep(0.05)
        self.kill()
        pytest.fail(f"{self.kind} broker did not start:\n{self._log_path.read_text()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL: the broker dies without closing anything, like a crash or power loss."""
        if self._process is not None:
            self._process.send_signal(signal.SIGKILL)
            self._process.wait(10)
            self._process = None


def _amqtt(tmp_path: Path) -> BrokerProcess:
    port = _unused_port()
    command = [sys.executable, "-m", "coordinator.broker", "--host", "127.0.0.1"]
    return BrokerProcess("amqtt", command + ["--port", str(port)], port, tmp_path / "amqtt.log")


def _mosquitto(tmp_path: Path, access: str = "allow_anonymous true\n") -> BrokerProcess:
    binary, port = _require("mosquitto"), _unused_port()
    config = tmp_path / "mosquitto.conf"
    config.write_text(
        f"listener {port} 127.0.0.1\n{access}persistence false\n"
        "log_dest stdout\nlog_type error\nlog_type warning\nlog_type notice\n"
    )
    return BrokerProcess("mosquitto", [binary, "-c", str(config)], port, tmp_path / "mosquitto.log")


def _running(broker: BrokerProcess) -> Iterator[BrokerProcess]:
    broker.start()
    try:
        yield broker
    finally:
        broker.kill()


@pytest.fixture
def unused_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    return _unused_port()


@pytest.fixture
def embedded_address(unused_port: int) -> Iterator[BrokerAddress]:
    """The embedded broker in this process (no kill and restart: see `amqtt_broker`)."""
    from coordinator.broker import EmbeddedBroker

    with EmbeddedBroker("127.0.0.1", unused_port) as embedded:
        yield embedded.address


def run_in_threads(runs: list[Callable[[], None]], timeout_s: float = 60) -> None:
    """Run each of `runs` (agents' `run`) in a thread of its own and wait for them all."""
    threads = [threading.Thread(target=run) for run in runs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    assert not any(thread.is_alive() for thread in threads), "the run did not finish"


def wait_until_logged(emulation: Any, thread: threading.Thread, agent: str, round_: int) -> None:
    """Wait until `agent` of `emulation` (a `coordinator.emulate.Emulation` whose run goes on
    in `thread`) has logged round `round_`."""
    from agent.runtime import checkpoint

    path = emulation.round_log(agent)
    while round_ not in checkpoint.read_records(path):
        assert thread.is_alive(), f"the run ended before {agent} logged round {round_}"
        thread.join(0.05)


@pytest.fixture
def amqtt_broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    yield from _running(_amqtt(tmp_path))


@pytest.fixture
def mosquitto_broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    yield from _running(_mosquitto(tmp_path))


@pytest.fixture(params=["amqtt", pytest.param("mosquitto", marks=pytest.mark.mosquitto)])
def broker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BrokerProcess]:
    """Each test that uses it runs once against amqtt and once against mosquitto."""
    make = _amqtt if request.param == "amqtt" else _mosquitto
    yield from _running(make(tmp_path))


@pytest.fixture
def mosquitto_tls_broker(tmp_path: Path) -> Iterator[tuple[BrokerProcess, Path]]:
    """mosquitto over TLS (self-signed certificate for 127.0.0.1, returned as the CA) that
    admits only user `alice` with password `secret`."""
    openssl, mosquitto_passwd = _require("openssl"), _require("mosquitto_passwd")
    cert, key, passwords = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "passwords"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
        + ["-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost"]
        + ["-addext", "subjectAltName=IP:127.0.0.1"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    subprocess.run(
        [mosquitto_passwd, "-b", "-c", str(passwords), "alice", "secret"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    # `user root`: as root, mosquitto would otherwise drop privileges before reading the key.
    access = (
        f"certfile {cert}\nkeyfile {key}\npassword_file {passwords}\n"
        "allow_anonymous false\nuser root\n"
    )
    for broker in _running(_mosquitto(tmp_path, access)):
        yield broker, cert


@pytest.fixture
def chromium(tmp_path: Path) -> Iterator[Any]:
    """A headless Chromium for the dashboard's page tests (`tests.test_dashboard.Chromium`)."""
    from tests.test_dashboard import Chromium

    binary = shutil.which("chromium")
    if binary is None:
        reason = "chromium is not installed (Debian: apt-get install chromium)"
        if os.environ.get("CI"):
            pytest.fail(f"{reason}; CI must run the dashboard's browser test")
        pytest.skip(reason)
    browser = Chromium(binary, tmp_path / "chromium-profile")
    yield browser
    browser.close()
