"""`python -m agent.zygote FD`: a fork server for an emulation's agent processes.

A fresh agent interpreter spends about 1.5 CPU-seconds importing torch and the agent's
modules before it does anything. This server imports them once, then forks a child per
request on FD (a SOCK_SEQPACKET Unix socket): the child becomes `python -m MODULE ARGS...`
(`agent`, `agent.host`) as a fresh interpreter would, with the requester's environment,
working folder and the three file descriptors sent with the request as its stdin, stdout
and stderr, and ends as that interpreter would (its exit code, or the signal that killed
it). No torch operation runs here before a fork: the intra-op thread pools they start do
not survive one; importing starts no thread (`serve` checks).

What an interpreter reads from its environment only as it starts is the server's: it is
started with the agents' environment (coordinator/emulate.py `agent_env`), so sys.path
(PYTHONSAFEPATH, PYTHONPATH), the thread settings torch and OpenBLAS read as they load
(OMP_NUM_THREADS...) and the str hash seed (one for all the agents, where each fresh one
drew its own: no result depends on it) are what the agents would have had. The rest is
applied in the child: the request's environment, TMPDIR (tempfile reads it afresh),
PYTHONUNBUFFERED (the standard streams are made unbuffered), MALLOC_ARENA_MAX (which
glibc reads at a process's start: set with mallopt instead, before any agent thread runs).

Requests, one JSON object a message, with three descriptors:
`{"id": N, "module": M, "args": [...], "env": {...}, "cwd": PATH}`.
Replies: `{"started": N, "pid": PID}` once child N is forked (`{"failed": N, "error": E}`
when it could not be), `{"exited": N, "code": CODE}` once it has ended (CODE as
`subprocess.Popen.returncode` gives it: negative for a signal). The server ends when the
requester closes its end (coordinator/agent_starts.py then ends any child still running).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import importlib
import io
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import tempfile
import threading
from typing import Any

PRELOAD = (
    "torch",
    "numpy",
    "agent.cli",
    "agent.host",
    "agent.service",
    "agent.workload",
    "agent.runfile",
    "agent.own_data",
    "agent.device",
    "agent.onnx_export",
)
"""What every agent imports: the expensive part of its start (torch alone about 1.4 s)."""
MESSAGE_BYTES = 1 << 20
"""The largest request (its environment and arguments: a few kilobytes)."""
M_ARENA_MAX = -8
"""glibc's mallopt parameter for MALLOC_ARENA_MAX (malloc.h)."""


@dataclasses.dataclass(frozen=True)
class Child:
    """What a forked child is to become: `python -m module *args` in `env` and `cwd`."""

    module: str
    args: list[str]
    env: dict[str, str]
    cwd: str

    def run(self) -> None:
        """Become the agent's interpreter and run its entry point as `-m` would: what it
        raises (SystemExit, an error) ends this interpreter as it would have ended that one."""
        os.environ.clear()
        os.environ.update(self.env)
        tempfile.tempdir = None  # TMPDIR is read again on first use
        if arenas := self.env.get("MALLOC_ARENA_MAX"):
            # glibc reads the variable when the process starts, which was the server's start.
            ctypes.CDLL(None).mallopt(M_ARENA_MAX, int(arenas))
        os.chdir(self.cwd)
        # numpy's global generator was seeded once, in the server; a fresh interpreter
        # seeds its own (Python's `random` is reseeded after a fork by itself).
        sys.modules["numpy"].random.seed()
        stdin, stdout, stderr = (_text_stream(fd) for fd in (0, 1, 2))
        sys.stdin, sys.stdout, sys.stderr = stdin, stdout, stderr
        sys.argv = [self.module, *self.args]
        runpy.run_module(self.module, run_name="__main__", alter_sys=True)


def _text_stream(fd: int) -> io.TextIOWrapper:
    """Standard stream `fd` as a fresh interpreter under PYTHONUNBUFFERED=1 makes it (the
    agents' logs are read while they run): written through, with the server's own stream's
    encoding and error handler (its streams are files too, as an agent's are)."""
    like = (sys.__stdin__, sys.__stdout__, sys.__stderr__)[fd]
    encoding, errors = (like.encoding, like.errors) if like else ("utf-8", "strict")
    if fd == 0:
        return io.TextIOWrapper(open(fd, "rb", closefd=False), encoding, errors)  # noqa: SIM115
    raw = open(fd, "wb", buffering=0, closefd=False)  # noqa: SIM115
    return io.TextIOWrapper(raw, encoding, errors, write_through=True)


def _reply(channel: socket.socket, **fields: Any) -> None:
    with contextlib.suppress(OSError):  # the requester is gone: nothing to tell
        channel.send(json.dumps(fields).encode())


class Server:
    """The serving loop: forks on requests, reports the children's ends."""

    def __init__(self, channel: socket.socket) -> None:
        self.channel = channel
        self.children: dict[int, int] = {}
        """Request id of each running child, by pid."""
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)

    def serve(self) -> Child | None:
        """Serve until the requester closes its end (None), or, in a forked child, return
        what that child is to become."""
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self._wake_w)
        with selectors.DefaultSelector() as selector:
            selector.register(self.channel, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            while True:
                for key, _ in selector.select():
                    if key.fileobj is self._wake_r:
                        os.read(self._wake_r, 4096)
                        self.reap()
                        continue
                    message, fds, _flags, _address = socket.recv_fds(self.channel, MESSAGE_BYTES, 3)
                    if not message:
                        return None
                    child = self.fork(json.loads(message), fds)
                    if child is not None:
                        return child

    def fork(self, request: dict[str, Any], fds: list[int]) -> Child | None:
        """Fork child `request["id"]`; in the child, the `Child` it is to become."""
        request_id = request["id"]
        try:
            if len(fds) != 3:
                raise ValueError(f"a start needs 3 file descriptors, not {len(fds)}")
            pid = os.fork()
        except (OSError, ValueError) as error:
            _reply(self.channel, failed=request_id, error=str(error))
            for fd in fds:
                os.close(fd)
            return None
        if pid == 0:
            self.become_child(fds)
            return Child(request["module"], request["args"], request["env"], request["cwd"])
        for fd in fds:
            os.close(fd)
        self.children[pid] = request_id
        _reply(self.channel, started=request_id, pid=pid)
        return None

    def become_child(self, fds: list[int]) -> None:
        """In a new child: the received descriptors as fds 0-2, nothing of the server's."""
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in {*fds, self._wake_r, self._wake_w} - {0, 1, 2}:
            os.close(fd)
        self.channel.close()

    def reap(self) -> None:
        """Report every child that has ended (and let the system forget it)."""
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            request_id = self.children.pop(pid, None)
            if request_id is not None:
                _reply(self.channel, exited=request_id, code=os.waitstatus_to_exitcode(status))


def preload() -> None:
    """Import what every agent imports. No Python thread may be running after it: a fork
    keeps only the thread that forks, and a lock another thread held stays locked forever.
    (Importing numpy starts OpenBLAS's thread pool, which OpenBLAS itself ends before a
    fork and starts again in the child when it is first needed.)"""
    for name in PRELOAD:
        importlib.import_module(name)
    if threading.active_count() != 1:
        names = [thread.name for thread in threading.enumerate()]
        raise RuntimeError(f"importing the agent started threads {names}: cannot fork")


def main(argv: list[str]) -> Child | None:
    if len(argv) != 1 or not argv[0].isdigit():
        print("usage: python -m agent.zygote FD (a SOCK_SEQPACKET socket)", file=sys.stderr)
        raise SystemExit(2)
    channel = socket.socket(fileno=int(argv[0]))
    # Ctrl-C and a SIGTERM to the process group are for the agents, which end as they
    # choose; the server lives on to report their ends, until the emulation closes it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    preload()
    return Server(channel).serve()


if __name__ == "__main__":
    child = main(sys.argv[1:])
    if child is not None:
        child.run()
