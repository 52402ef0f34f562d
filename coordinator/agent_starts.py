"""How `coordinator emulate` starts its agent processes.

By default each is forked from a server process that imported torch and the agent's modules
once (agent/zygote.py): it starts in milliseconds of CPU instead of the 1.5 CPU-seconds a
fresh interpreter spends importing them. EDGEFL_AGENT_START=fresh starts each as a fresh
`python -m` interpreter instead (as before session 37; for debugging the start itself).
Either way the emulation gets a handle with `subprocess.Popen`'s interface (`pid`,
`returncode`, `poll`, `wait`, `kill`, `send_signal`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Protocol

START_ENV = "EDGEFL_AGENT_START"
START_METHODS = ("fork", "fresh")
START_TIMEOUT_S = 120.0
"""How long a start may wait for the server (its imports take seconds on a loaded machine)."""


def start_method(
    environ: dict[str, str] | os._Environ[str] = os.environ, platform: str = sys.platform
) -> str:
    """The way agents start: EDGEFL_AGENT_START, `fork` or `fresh`; by default `fork` on
    Linux, where the server is built and tested (a fork after torch's import is unsafe on
    macOS, whose system libraries do not survive one), `fresh` elsewhere."""
    default = "fork" if platform.startswith("linux") else "fresh"
    method = environ.get(START_ENV, "").strip() or default
    if method not in START_METHODS:
        raise ValueError(f"{START_ENV} must be 'fork' or 'fresh', not {method!r}")
    return method


class StartedProcess(Protocol):
    """A started agent process, as `subprocess.Popen` has it."""

    @property
    def returncode(self) -> int | None: ...

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...

    def send_signal(self, sig: int) -> None: ...


@dataclasses.dataclass(frozen=True)
class Stdio:
    """The new process's standard streams (descriptors this process keeps and closes);
    stdin None: a fresh interpreter shares this process's, a fork reads /dev/null."""

    stdin: int | None
    stdout: int
    stderr: int


class Starter(Protocol):
    def start(self, command: list[str], env: dict[str, str], stdio: Stdio) -> StartedProcess:
        """Start `python -m *command` (its module, then its arguments) in environment `env`."""
        ...

    def close(self) -> None: ...


class FreshStarter:
    """Each agent a fresh interpreter (EDGEFL_AGENT_START=fresh)."""

    def start(self, command: list[str], env: dict[str, str], stdio: Stdio) -> StartedProcess:
        return subprocess.Popen(
            [sys.executable, "-m", *command],
            stdin=stdio.stdin,
            stdout=stdio.stdout,
            stderr=stdio.stderr,
            env=env,
        )

    def close(self) -> None:
        """Nothing to end: each process is the emulation's own child."""


@dataclasses.dataclass(frozen=True)
class ForkedProcess:
    """A child of the fork server: signalled directly, its end reported by the server."""

    server: ForkServer
    request_id: int
    pid: int

    @property
    def returncode(self) -> int | None:
        return self.server.code_of(self.request_id)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return self.server.wait_for(self, timeout)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # as Popen: never signal a pid that may be reused
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """A `python -m agent.zygote` process, one per emulation: it is started with the
    emulation, so it imports the code and environment the agents would, and ended with it."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.log = log
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs, open(log, "ab") as errors:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "agent.zygote", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=errors,  # not a terminal: the agents' consoles are made here
                env=env,
            )
        self.channel = ours
        self._ids = itertools.count()
        self._start_lock = threading.Lock()
        self._replies: queue.Queue[dict[str, Any]] = queue.Queue()
        self._ended = threading.Condition()
        self._codes: dict[int, int] = {}
        self._running: dict[int, int] = {}
        """The pid of each child not known to have ended, by request id."""
        self._reader = threading.Thread(target=self._read, name="fork-server", daemon=True)
        self._reader.start()

    def start(self, command: list[str], env: dict[str, str], stdio: Stdio) -> ForkedProcess:
        request = {"module": command[0], "args": command[1:], "env": env, "cwd": os.getcwd()}
        with self._start_lock, open(os.devnull, "rb") as devnull:
            request_id = next(self._ids)
            stdin = devnull.fileno() if stdio.stdin is None else stdio.stdin
            message = json.dumps({"id": request_id, **request}).encode()
            try:
                socket.send_fds(self.channel, [message], [stdin, stdio.stdout, stdio.stderr])
                reply = self._replies.get(timeout=START_TIMEOUT_S)
            except (OSError, queue.Empty) as error:
                reply = {"error": str(error) or "no answer"}
        if "started" not in reply:
            raise RuntimeError(f"the agents' fork server failed ({self.log}): {reply['error']}")
        return ForkedProcess(self, request_id, reply["pid"])

    def _read(self) -> None:
        while message := self.channel.recv(1 << 16):
            reply = json.loads(message)
            with self._ended:
                if "started" in reply:
                    self._running[reply["started"]] = reply["pid"]
                if "exited" in reply:
                    self._running.pop(reply["exited"], None)
                    self._codes[reply["exited"]] = reply["code"]
                    self._ended.notify_all()
            if "exited" not in reply:
                self._replies.put(reply)
        self._orphan_children()

    def _orphan_children(self) -> None:
        """The server is gone and no child's end will be reported: end them all, as if
        killed (an emulation waits for every agent to end)."""
        self._replies.put({"error": "it ended"})
        with self._ended:
            for request_id, pid in self._running.items():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                self._codes[request_id] = -signal.SIGKILL
            self._running.clear()
            self._ended.notify_all()

    def code_of(self, request_id: int) -> int | None:
        with self._ended:
            return self._codes.get(request_id)

    def wait_for(self, child: ForkedProcess, timeout: float | None) -> int:
        """The child's exit code once it has ended; subprocess.TimeoutExpired after `timeout`."""
        with self._ended:
            if not self._ended.wait_for(lambda: child.request_id in self._codes, timeout):
                raise subprocess.TimeoutExpired(f"agent process {child.pid}", timeout or 0.0)
            return self._codes[child.request_id]

    def close(self, timeout_s: float = 10.0) -> None:
        """End the server (its children are the caller's to end first) and reap it; its log
        is kept if it wrote anything (an emulation's folder holds the agents' logs)."""
        with contextlib.suppress(OSError):
            self.channel.shutdown(socket.SHUT_RDWR)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout_s)
        self._reader.join(timeout_s)
        self.channel.close()
        with contextlib.suppress(OSError):
            if self.log.stat().st_size == 0:
                self.log.unlink()


def starter(method: str, env: dict[str, str], log: Path) -> Starter:
    """What starts an emulation's agents (`start_method`), `log` getting a server's output."""
    if method == "fresh":
        return FreshStarter()
    return ForkServer(env, log)
