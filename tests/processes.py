"""Child processes of a test, ended whatever happens to the test.

A test that starts `coordinator serve` or an agent and fails half-way must not leave them
running: a left-over gateway keeps its port, its broker and its CPU for minutes and makes the
next tests on the machine slow or wrong. Every test process goes through `Processes`
(the `processes` fixture of conftest.py), whose `close` ends what is still running, and
the autouse check in conftest.py (`left_behind`) fails a test that leaves a child alive.

Each process gets a session of its own, so that ending it ends the programs it started
too (`coordinator emulate`'s agents, a browser's helpers).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

END_WAIT_S = 10.0
"""How long a killed process may take to be reaped (SIGKILL cannot be ignored)."""

HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")
"""Processes Python's multiprocessing keeps for the life of the test process, by design."""


def end(process: subprocess.Popen[Any]) -> None:
    """Kill `process` and its session (see the module docstring) if it still runs, and reap
    it: the one way out of a test for a process, whether the test passed or not."""
    if process.returncode is None:  # not reaped yet: its pid (and group) are still its own
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            process.kill()
    process.wait(END_WAIT_S)


def interrupt(process: subprocess.Popen[Any], timeout_s: float = 20.0) -> int:
    """Ctrl-C, as a person stops the program, and its exit status; a process that does not
    stop within `timeout_s` is killed and fails the test (a hang is a defect to see)."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
    try:
        return process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        end(process)
        raise AssertionError(
            f"{process.args!r} did not stop within {timeout_s:g}s of Ctrl-C"
        ) from None


def wait_for_text(
    log: Path,
    text: str,
    timeout_s: float = 60.0,
    process: subprocess.Popen[Any] | None = None,
) -> str:
    """Wait until `text` is in `log`, and return the log. A `process` that exits first
    fails the test at once with its log; `timeout_s` only bounds a hang, it is no measure
    of speed: a loaded machine takes seconds to start a Python program, not milliseconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        content = log.read_text(errors="replace") if log.exists() else ""
        if text in content:
            return content
        if process is not None and process.poll() is not None:
            raise AssertionError(
                f"{text!r} not in {log.name}: the process exited ({process.returncode}):\n"
                + content[-3000:]
            )
        if time.monotonic() > deadline:
            raise AssertionError(f"{text!r} not in {log.name} within {timeout_s:g}s:\n{content}")
        time.sleep(0.1)


def wait_until(check: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Wait until `check()`; `timeout_s` bounds a hang (see `wait_for_text`)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g}s")
        time.sleep(0.1)


class Processes:
    """The processes one test started; `close` (the fixture's teardown) ends each that
    still runs, newest first, whether the test passed or not."""

    def __init__(self) -> None:
        self._started: list[subprocess.Popen[Any]] = []

    def spawn(self, command: list[str], log: Path, **options: Any) -> subprocess.Popen[bytes]:
        """Start `command` in the repository, its output (stdout and stderr) in `log`."""
        with open(log, "ab") as out:
            return self.popen(command, stdout=out, stderr=subprocess.STDOUT, **options)

    def popen(self, command: list[str], **options: Any) -> subprocess.Popen[Any]:
        """`subprocess.Popen` in the repository and a session of its own, ended by `close`."""
        options.setdefault("cwd", REPO)
        process = subprocess.Popen(command, start_new_session=True, **options)
        self._started.append(process)
        return process

    def close(self) -> None:
        for process in reversed(self._started):
            end(process)
        self._started.clear()


def children() -> set[int]:
    """The live (not zombie) child processes of this process, multiprocessing's helpers
    left out. Read from /proc/<pid>/task/*/children: far cheaper than a scan of every
    process, which matters for a check made after each of the suite's tests. Empty where
    there is no /proc (the suite's processes run on Linux)."""
    found: set[int] = set()
    tasks = Path(f"/proc/{os.getpid()}/task")
    if not tasks.is_dir():
        return found
    for task in tasks.iterdir():
        with contextlib.suppress(OSError):
            found.update(int(pid) for pid in (task / "children").read_text().split())
    return {pid for pid in found if _alive(pid) and not _helper(pid)}


def describe(pid: int) -> str:
    """'1234 python -c ... serve' for a report of what a test left running."""
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return str(pid)
    return f"{pid} " + " ".join(w.decode(errors="replace") for w in words if w)[:300]


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def _helper(pid: int) -> bool:
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return any(helper.encode() in command for helper in HELPERS)


def left_since(before: set[int], grace_s: float) -> list[str]:
    """The children started since `before` (a `children()`) still running after up to
    `grace_s` (one signalled without a wait may be exiting), described; they are killed."""
    left = children() - before
    deadline = time.monotonic() + grace_s
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left &= children()
    running = [describe(pid) for pid in sorted(left)]
    _kill(left)
    return running


def _kill(pids: set[int]) -> None:
    """SIGKILL processes a test left behind, and reap them: no Popen will."""
    for pid in pids:
        with contextlib.suppress(OSError):
            if os.getpgid(pid) == pid:  # a session of its own: what it started goes too
                os.killpg(pid, signal.SIGKILL)
            os.kill(pid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
