"""`python -m agent.host SPEC`: several agents of one fleet in one process.

A lone agent costs an interpreter and a torch import (about 200 MB and a second or two of
CPU); an emulated fleet of hundreds cannot afford one per agent. Here each agent still runs
the whole `edge-agent` command (agent/cli.py `main`, with its own command line) in its own
thread, with its own MQTT connection, state folder, checkpoint and status; what the agents
share is the process. SPEC is a JSON file: a list of {"id", "log", "args"}, `args` being the
agent's `edge-agent` arguments and `log` the file that gets what that agent alone would
print (its messages and log lines, routed by thread).

Lines on stdin are commands: `kill ID` ends agent ID as a crash would (its connection cut
without a goodbye, so the broker publishes its last will; nothing more from it is logged).
Lines on stdout are events: `exit ID CODE` once agent ID has ended, CODE being what its
process would have exited with (-9 when killed). End of stdin stops every agent cleanly.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:  # imported at run time once sys.stderr is routed (see `main`)
    from protocol import MqttTransport

HOST_NICENESS = 10
"""How much lower than the broker's and the coordinator's the agents' priority is."""
SWITCH_INTERVAL_S = 0.05
"""The interpreter's thread switch interval in a host process (Python's default: 0.005 s)."""
KILLED = -signal.SIGKILL
"""The exit code reported for a killed agent: what a process killed with SIGKILL exits with."""


@dataclasses.dataclass(frozen=True)
class AgentSpec:
    agent_id: str
    log: Path
    args: list[str]


def read_spec(path: str) -> list[AgentSpec]:
    entries = json.loads(Path(path).read_text())
    return [AgentSpec(e["id"], Path(e["log"]), [str(a) for a in e["args"]]) for e in entries]


class ThreadRoutedStream(io.TextIOBase):
    """Stands in for sys.stdout and sys.stderr: what a thread of agent A writes goes to A's
    log, so each agent's messages and log lines (written to sys.stderr when written, by rich
    and by logging alike) come out as a lone agent's would. A thread is A's when its name is
    A's id or ends with "-" + that id (the MQTT threads are named after the client id,
    FLEET-ID); anything else goes to the process's own stream."""

    def __init__(self, fallback: IO[str]) -> None:
        super().__init__()
        self.fallback = fallback
        self._logs: dict[str, IO[str]] = {}
        self._muted: set[str] = set()
        self._owners: dict[str, str | None] = {}
        self._lock = threading.Lock()

    @property
    def encoding(self) -> str:  # type: ignore[override]  # a read-only attribute in IO
        return "utf-8"

    def add(self, agent_id: str, log: IO[str]) -> None:
        with self._lock:
            self._logs[agent_id] = log
            self._owners.clear()

    def mute(self, agent_id: str) -> None:
        """Drop whatever agent `agent_id` writes from now on (a killed process writes none)."""
        with self._lock:
            self._muted.add(agent_id)

    def owner(self, thread_name: str) -> str | None:
        """The agent whose thread this is (the longest id that matches), or None."""
        with self._lock:
            if thread_name not in self._owners:
                matches = [
                    a for a in self._logs if thread_name == a or thread_name.endswith("-" + a)
                ]
                self._owners[thread_name] = max(matches, key=len, default=None)
            return self._owners[thread_name]

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def write(self, text: str) -> int:
        if not isinstance(text, str):  # click tells text streams from binary ones this way
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        agent_id = self.owner(threading.current_thread().name)
        if agent_id is None:
            self.fallback.write(text)
            self.fallback.flush()
        elif agent_id not in self._muted:
            log = self._logs[agent_id]
            with self._lock:
                log.write(text)
                log.flush()
        return len(text)

    def flush(self) -> None:
        self.fallback.flush()


class HostedAgent:
    """One agent of the host: the `edge-agent` command in a thread, and its fate."""

    def __init__(
        self, spec: AgentSpec, router: ThreadRoutedStream, report: Callable[[str, int], None]
    ) -> None:
        from agent.cli import Hosted  # after `main` routed the streams

        self.spec = spec
        self.stop = threading.Event()
        self.ready = threading.Event()
        self._router = router
        self._report = report
        self._lock = threading.Lock()
        self._transport: MqttTransport | None = None
        self.killed = False
        self._ended = False
        self._hosted = Hosted(started=self._started, joined=self._joined)
        self.thread = threading.Thread(target=self._run, name=spec.agent_id, daemon=True)

    def _started(self) -> threading.Event:
        self.ready.set()
        return self.stop

    def _joined(self, transport: MqttTransport) -> None:
        with self._lock:
            self._transport = transport
            if not self.killed:
                return
        transport.abort()

    def start(self) -> None:
        """Start the agent and wait until its command line is read and logging set up
        (which touches process-wide state: one agent at a time)."""
        self.thread.start()
        while not self.ready.wait(0.05) and self.thread.is_alive():
            pass

    def kill(self) -> None:
        """End this agent as a crash would (`MqttTransport.abort`); its process-mates go on."""
        with self._lock:
            if self.killed or self._ended:
                return
            self.killed = True
            transport = self._transport
        self._router.mute(self.spec.agent_id)
        self._report(self.spec.agent_id, KILLED)
        if transport is not None:
            transport.abort()
        self.stop.set()

    def _run(self) -> None:
        from agent.cli import main

        try:
            main.main(self.spec.args, prog_name="edge-agent", obj=self._hosted)
            code = 0
        except SystemExit as exit_:  # click's standalone mode always ends here
            code = exit_.code if isinstance(exit_.code, int) else 0 if exit_.code is None else 1
            if isinstance(exit_.code, str):
                print(exit_.code, file=sys.stderr)
        except Exception:  # what Python prints for an uncaught exception, exit code 1
            traceback.print_exc()
            code = 1
        with self._lock:
            self._ended = True
            if self.killed:
                return
        self._report(self.spec.agent_id, code)


class Host:
    """The agents of one process, the commands that reach them, and what they report."""

    def __init__(self, specs: list[AgentSpec], router: ThreadRoutedStream, out: IO[str]):
        self._out = out
        self._out_lock = threading.Lock()
        self.codes: dict[str, int] = {}
        self.agents = {s.agent_id: HostedAgent(s, router, self.report) for s in specs}
        for spec in specs:
            spec.log.parent.mkdir(parents=True, exist_ok=True)
            router.add(spec.agent_id, open(spec.log, "a", encoding="utf-8"))  # noqa: SIM115

    def report(self, agent_id: str, code: int) -> None:
        with self._out_lock:
            self.codes[agent_id] = code
            self._out.write(f"exit {agent_id} {code}\n")
            self._out.flush()

    def stop_all(self) -> None:
        for agent in self.agents.values():
            agent.stop.set()

    def follow(self, commands: IO[str]) -> None:
        """Obey `kill ID` lines until the end of `commands`, then stop every agent (whoever
        started this process is gone, or wants it over)."""
        for line in commands:
            verb, _, agent_id = line.strip().partition(" ")
            agent = self.agents.get(agent_id)
            if verb == "kill" and agent is not None:
                agent.kill()
            else:
                print(f"agent.host: unknown command {line.strip()!r}", file=sys.stderr)
        self.stop_all()

    def run(self, commands: IO[str]) -> int:
        """Start the agents, one after the other, and wait for every one to end; the exit
        code is 0 when each ended with 0."""
        for agent in self.agents.values():
            agent.start()
        threading.Thread(target=self.follow, args=(commands,), daemon=True).start()
        for agent in self.agents.values():
            while agent.thread.is_alive() and not agent.killed:
                agent.thread.join(0.5)  # short waits keep the main thread's signals working
        return 0 if all(code == 0 for code in self.codes.values()) else 1


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m agent.host SPEC.json", file=sys.stderr)
        return 2
    specs = read_spec(argv[0])
    events = sys.stdout
    router = ThreadRoutedStream(sys.stderr)
    # Before edgefl is imported: rich's console (protocol.cli) looks at stderr when made.
    sys.stdout = sys.stderr = router
    from agent.workload import share_compute, share_partitions

    share_partitions()
    share_compute()
    # The emulated devices yield the cores to the broker and the coordinator, which in a
    # real fleet run on machines of their own: a broker starved by hundreds of agent
    # threads stops answering keep-alives, and the fleet drops off it.
    os.nice(HOST_NICENESS)
    # Hundreds of threads: each one waiting for the interpreter lock wakes every switch
    # interval to ask for it; a longer interval keeps those wake-ups from eating the cores.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    host = Host(specs, router, events)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: host.stop_all())
    return host.run(sys.stdin)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
