"""How emulate starts its agent processes: forked from a server that imported torch once
(the default), or as fresh interpreters (EDGEFL_AGENT_START=fresh); either way the process
is what `python -m MODULE ARGS` would be: arguments, environment, output, exit code."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import wait_until_logged

from agent.experiment import ExperimentConfig
from agent.learning import preset
from coordinator.agent_starts import (
    START_ENV,
    ForkServer,
    FreshStarter,
    StartedProcess,
    Starter,
    Stdio,
    start_method,
)
from coordinator.emulate import Emulation, EmulationOptions

pytestmark = pytest.mark.timeout(600)

PROBE = """
import json, os, sys, tempfile, time
seen = {
    "ppid": os.getppid(), "torch": "torch" in sys.modules, "argv": sys.argv[1:],
    "mark": os.environ.get("PROBE_MARK"), "tmp": tempfile.gettempdir(), "cwd": os.getcwd(),
}
print(json.dumps(seen))
if sys.argv[1] == "sleep":
    time.sleep(120)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture(scope="module")
def probe_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """An environment whose Python path has the `zygote_probe` module."""
    folder = tmp_path_factory.mktemp("probe")
    (folder / "zygote_probe.py").write_text(PROBE)
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


@pytest.fixture(scope="module")
def server(
    probe_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ForkServer]:
    server = ForkServer(probe_env, tmp_path_factory.mktemp("server") / "fork-server.log")
    yield server
    server.close()


def start_probe(
    starter: Starter, args: list[str], env: dict[str, str], out: Path
) -> tuple[StartedProcess, dict]:
    """Start the probe with `args`; what it saw of itself, once it has said it."""
    with open(out, "ab") as log:
        process = starter.start(
            ["zygote_probe", *args], env, Stdio(None, log.fileno(), log.fileno())
        )
    deadline = time.monotonic() + 120
    while not out.read_text().strip():
        assert time.monotonic() < deadline and process.poll() in (None, 0, 3), out.read_text()
        time.sleep(0.05)
    return process, json.loads(out.read_text().splitlines()[0])


@pytest.mark.parametrize("forked", [True, False], ids=["fork", "fresh"])
def test_a_started_process_is_python_dash_m_with_its_own_arguments_environment_and_exit_code(
    server: ForkServer, probe_env: dict[str, str], tmp_path: Path, forked: bool
) -> None:
    starter = server if forked else FreshStarter()
    env = {**probe_env, "PROBE_MARK": "mine", "TMPDIR": str(tmp_path)}
    process, seen = start_probe(starter, ["3", "two words"], env, tmp_path / "out.log")
    assert process.wait(60) == 3 and process.returncode == 3
    assert seen["argv"] == ["3", "two words"]
    assert seen["mark"] == "mine" and seen["tmp"] == str(tmp_path)
    assert seen["cwd"] == os.getcwd()
    if forked:  # a child of the server, torch imported before its first line ran
        assert seen["ppid"] == server.process.pid and seen["torch"]
    else:
        assert seen["ppid"] == os.getpid() and not seen["torch"]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("forked", [True, False], ids=["fork", "fresh"])
def test_a_signalled_process_ends_as_a_fresh_interpreter_would(
    server: ForkServer, probe_env: dict[str, str], tmp_path: Path, forked: bool, sig: int
) -> None:
    """Killed: -9, as Popen reports it. Interrupted or terminated: Python's own handling
    (KeyboardInterrupt, which ends the interpreter by SIGINT; SIGTERM's default), though
    the server ignores both."""
    starter = server if forked else FreshStarter()
    process, _ = start_probe(starter, ["sleep"], probe_env, tmp_path / "out.log")
    assert process.poll() is None
    process.send_signal(sig)
    assert process.wait(60) == -sig and process.poll() == -sig
    process.kill()  # once it has ended: nothing happens, as with Popen
    if sig == signal.SIGINT:
        assert "KeyboardInterrupt" in (tmp_path / "out.log").read_text()


def test_the_agent_command_line_fails_the_same_forked_or_fresh(
    server: ForkServer, tmp_path: Path
) -> None:
    """A usage error: `edge-agent`'s own message and exit status 2 in both."""
    outputs = {}
    for name, starter in (("fork", server), ("fresh", FreshStarter())):
        out = tmp_path / f"{name}.log"
        with open(out, "ab") as log:
            stdio = Stdio(None, log.fileno(), log.fileno())
            process = starter.start(["agent", "--no-such-flag"], dict(os.environ), stdio)
        assert process.wait(120) == 2, out.read_text()
        outputs[name] = out.read_text()
    assert "Usage: edge-agent" in outputs["fork"] and "--no-such-flag" in outputs["fork"]
    assert outputs["fork"] == outputs["fresh"]


def process_state(pid: int) -> str:
    """The process's state letter (R, S, T, Z...), "gone" if there is no such process."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return "gone"
    return next(line for line in status.splitlines() if line.startswith("State:")).split()[1]


def test_children_of_a_server_that_died_are_ended_and_reported_killed(
    probe_env: dict[str, str], tmp_path: Path
) -> None:
    server = ForkServer(probe_env, tmp_path / "fork-server.log")
    process, _ = start_probe(server, ["sleep"], probe_env, tmp_path / "out.log")
    server.process.kill()
    assert process.wait(60) == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while process_state(process.pid) not in ("gone", "Z"):  # a zombie until init reaps it
        assert time.monotonic() < deadline, "the child of the dead server still runs"
        time.sleep(0.05)
    server.close()
    assert server.process.returncode == -signal.SIGKILL


def test_a_closed_server_ends_cleanly(probe_env: dict[str, str], tmp_path: Path) -> None:
    server = ForkServer(probe_env, tmp_path / "fork-server.log")
    process, _ = start_probe(server, ["0"], probe_env, tmp_path / "out.log")
    assert process.wait(60) == 0
    server.close()
    assert server.process.returncode == 0
    assert not (tmp_path / "fork-server.log").exists(), "an empty log is not kept"


def test_the_start_method_is_fork_on_linux_unless_asked_otherwise() -> None:
    assert start_method({}, platform="linux") == "fork"
    assert start_method({}, platform="darwin") == "fresh"
    assert start_method({START_ENV: "fork"}, platform="darwin") == "fork"
    assert start_method({START_ENV: "fresh"}) == "fresh"
    with pytest.raises(ValueError, match="EDGEFL_AGENT_START must be 'fork' or 'fresh'"):
        start_method({START_ENV: "spawn"})


def parent_pid(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("PPid:")).split()[1])


@pytest.mark.parametrize("method", ["fork", "fresh"])
def test_an_emulated_agent_is_started_as_asked_and_a_killed_one_fails_with_sigkill(
    amqtt_broker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    monkeypatch.setenv(START_ENV, method)
    cfg = ExperimentConfig(
        dataset="mnist1d",
        agents=3,
        seed=7,
        round_time_s=0.01,
        learning=preset("fedavg", rounds=3, epochs=1),
    )
    options = EmulationOptions(workdir=tmp_path / "fleet", round_timeout_s=3.0, linger_s=5.0)
    emulation = Emulation(cfg, amqtt_broker.address, options)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(report=emulation.run()), daemon=True)
    thread.start()
    wait_until_logged(emulation, thread, "agent-002", 1)
    server = emulation.agent_starter
    parents = {parent_pid(p.pid) for p in emulation.processes.values()}
    if method == "fork":
        assert isinstance(server, ForkServer) and parents == {server.process.pid}
    else:
        assert isinstance(server, FreshStarter) and parents == {os.getpid()}
    emulation.processes["agent-002"].send_signal(signal.SIGKILL)
    thread.join(400)
    summary = result["report"]["summary"]
    assert summary["failed_agents"] == {"agent-002": -signal.SIGKILL}
    assert summary["failures"]["agent-002"]["reason"] == "exit code -9 (SIGKILL)"
    assert emulation.agent_starter is None, "the run ended what started its agents"
    if isinstance(server, ForkServer):
        assert server.process.returncode == 0
