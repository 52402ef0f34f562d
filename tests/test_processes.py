"""The suite's own guard against left-over processes (tests/processes.py): a test that
leaves a child running is caught and the child killed, and `Processes` ends what a test
started, the programs those started included, whatever happened to the test."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.processes import (
    Processes,
    children,
    interrupt,
    left_since,
    wait_for_text,
    wait_until,
)

SLEEPER = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(600)"]

PARENT = [
    sys.executable,
    "-c",
    "import subprocess, sys, time; "
    f"child = subprocess.Popen({SLEEPER!r}); "
    "print(child.pid, flush=True); time.sleep(600)",
]
"""A program that starts one of its own, as `coordinator emulate` starts agents."""


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


@pytest.fixture(autouse=True)
def linux() -> None:
    if not Path("/proc/self/task").is_dir():
        pytest.skip("the check reads /proc (Linux)")


def test_a_process_left_running_is_reported_and_killed() -> None:
    before = children()
    left = subprocess.Popen(SLEEPER, stdout=subprocess.DEVNULL)
    try:
        assert left.pid in children()
        reported = left_since(before, grace_s=0.2)
        assert len(reported) == 1 and reported[0].startswith(f"{left.pid} ")
        assert "time.sleep(600)" in reported[0]
        assert not _running(left.pid)
    finally:
        left.kill()
        left.wait(10)


def test_an_ended_process_is_not_reported() -> None:
    before = children()
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait(60)
    killed = subprocess.Popen(SLEEPER, stdout=subprocess.DEVNULL)
    killed.kill()  # not waited for: a zombie until reaped, which runs nothing
    try:
        assert left_since(before, grace_s=2.0) == []
    finally:
        killed.wait(10)


def test_close_ends_a_process_and_what_it_started(tmp_path: Path) -> None:
    started = Processes()
    log = tmp_path / "parent.log"
    try:
        parent = started.spawn(PARENT, log)
        wait_for_text(log, "up", process=parent)
        grandchild = next(int(w) for w in log.read_text().split() if w.isdigit())
        assert _running(grandchild)
    finally:
        started.close()
    assert parent.returncode is not None
    # SIGKILL reaches the grandchild asynchronously: it is dying, not yet dead, at once.
    wait_until(lambda: not _running(grandchild), "the grandchild killed with its parent", 10)


def test_interrupt_returns_the_exit_status(processes: Processes, tmp_path: Path) -> None:
    log = tmp_path / "sleeper.log"
    sleeper = processes.spawn(SLEEPER, log)
    wait_for_text(log, "up", process=sleeper)
    assert interrupt(sleeper) == -signal.SIGINT  # Python dies of an unhandled Ctrl-C


def test_wait_for_text_fails_at_once_when_the_process_exits(
    processes: Processes, tmp_path: Path
) -> None:
    log = tmp_path / "crash.log"
    crash = processes.spawn([sys.executable, "-c", "raise SystemExit('no broker')"], log)
    with pytest.raises(AssertionError, match="the process exited \\(1\\)"):
        wait_for_text(log, "joined", timeout_s=600, process=crash)
