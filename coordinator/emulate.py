"""`coordinator emulate`: a whole fleet of real agent processes on one machine, over MQTT.

The coordinator publishes the run (configuration and roster, retained), starts the agents,
follows their statuses for progress, and when they are done assembles the same report schema
as `simulate` from each agent's own round log. Each agent is an `edge-agent` process of its
own, or, with `agents_per_process` above 1, one of several `edge-agent` commands that a
`python -m agent.host` process runs in threads (agent/host.py): same code, same connection
per agent, one interpreter per process. Each process is forked from a server that imported
torch and the agent once (coordinator/agent_starts.py, agent/zygote.py), or, with
EDGEFL_AGENT_START=fresh, started as a fresh interpreter. Traffic in this report is what each
agent's MQTT connection actually carried (frames, including statuses and re-sent models), so
it is a little above the simulator's message sizes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from agent.experiment import ExperimentConfig, check_networked, profile_names
from agent.model_store import run_folder
from agent.runtime import checkpoint, new_run_id
from agent.runtime.heap import settled_heap
from agent.time_to_target import with_time_to_target
from agent.workload import build_workload
from coordinator.agent_starts import StartedProcess, Starter, Stdio, start_method, starter
from coordinator.broker_config import COORDINATOR
from coordinator.conductor import Conductor, assemble_report
from protocol import BrokerAddress, Identity, connect, leave
from protocol.cli import log_flags, read_key
from protocol.limits import FOLLOWER_LIMITS
from protocol.mqtt import TransportOptions
from protocol.signing import (
    IDENTITY_FILE,
    Signer,
    key_line,
    member_keys,
    public_line,
)


@dataclasses.dataclass(frozen=True)
class EmulationOptions:
    workdir: Path
    round_timeout_s: float = 120.0
    vote_timeout_s: float = 60.0
    linger_s: float = 30.0
    verbose: int | None = None
    """Log level of the agents (0: warnings, 1: info, 2: debug); None: as this process logs
    (`coordinator -v --log-format json emulate` makes the agents' logs the same)."""
    telemetry: bool = False
    """Agents mirror their statuses as plain JSON (`edge-agent --telemetry`)."""
    run_timeout_s: float | None = None
    """Give up on agents still running after this long (default: scaled to the run)."""
    key_file: Path | None = None
    """A fleet key every agent and the coordinator sign with (`--key-file`)."""
    agent_keys: bool = False
    """A key pair per agent and one for the coordinator, which admits the agents and signs
    the run; the agents trust the coordinator's key alone."""
    agent_brokers: tuple[BrokerAddress, ...] = ()
    """Brokers the agents connect to, agent k to the (k mod n)-th: a fleet spread over
    bridged brokers (default: the coordinator's broker for all)."""
    agents_per_process: int = 1
    """Agents run as threads of one process (`python -m agent.host`); 1: a process each."""


def auto_agents_per_process(agents: int, cores: int | None = None) -> int:
    """How many agents share a process by default: the fleet spread evenly over 2 x cores
    processes, one agent each when it has no more agents than that. A process costs about
    175 MB and, started afresh, 2-3 s of CPU (its interpreter and torch; forked, as it is
    now, far less: bench/agent_starts.py), one more agent in a shared one about 4 MB
    (bench/agents_per_process.py). Two processes a core keep every core busy
    in the agents' Python work, which one process runs on one core at a time; more add no
    speed and cost start-up: on 2 cores, 8 agents (dadpfl, 5 rounds) ran in 6.7 s as 4
    processes, 5.0 s as 2 and 14.6 s as 8 (the minimum of 8 processes before session 15)."""
    processes = 2 * (cores or os.cpu_count() or 1)
    return math.ceil(agents / processes)


class SharedProcess:
    """A `python -m agent.host` process and the exit codes its agents reported (its stdout,
    `events` here, carries `exit ID CODE` lines; its stdin, `commands`, takes `kill ID`)."""

    def __init__(self, process: StartedProcess, commands: IO[bytes], events: IO[bytes]) -> None:
        self.process = process
        self.commands = commands
        self.events = events
        self.codes: dict[str, int] = {}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @classmethod
    def start(
        cls, starter: Starter, command: list[str], log: IO[bytes], env: dict[str, str]
    ) -> SharedProcess:
        """Start `python -m *command` with pipes for its commands and events."""
        commands_r, commands_w = os.pipe()
        events_r, events_w = os.pipe()
        try:
            process = starter.start(command, env, Stdio(commands_r, events_w, log.fileno()))
        except BaseException:
            os.close(commands_w)
            os.close(events_r)
            raise
        finally:
            os.close(commands_r)
            os.close(events_w)
        return cls(process, open(commands_w, "wb"), open(events_r, "rb"))

    def _read(self) -> None:
        for line in self.events:
            match line.decode(errors="replace").split():
                case ["exit", agent_id, code]:
                    self.codes[agent_id] = int(code)

    def code_of(self, agent_id: str) -> int | None:
        """The agent's exit code: the one it reported, else, once the process has ended
        without a word for it, the process's own."""
        if agent_id in self.codes:
            return self.codes[agent_id]
        if self.process.poll() is None:
            return None
        self._reader.join(5)
        return self.codes.get(agent_id, self.process.returncode)

    def kill_agent(self, agent_id: str) -> None:
        """Kill one agent alone, as a crash would (agent/host.py)."""
        self.commands.write(f"kill {agent_id}\n".encode())
        self.commands.flush()

    def end(self, timeout_s: float) -> None:
        """Wait for the process itself to end, killing it after `timeout_s`: its agents'
        `exit` lines come before its own teardown, and an emulation that returned on them
        alone left the process running for a while (seconds on a loaded machine)."""
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout_s)
        with contextlib.suppress(OSError):  # the process is gone: nothing more to tell it
            self.commands.close()
        self._reader.join(timeout_s)
        self.events.close()


@dataclasses.dataclass(frozen=True)
class HostedProcess:
    """One agent of a `SharedProcess`, seen as a process of its own: its exit code is the
    one it reported; killing it (at the end of a run) kills the process it shares."""

    host: SharedProcess
    agent_id: str

    @property
    def returncode(self) -> int | None:
        return self.host.code_of(self.agent_id)

    @property
    def pid(self) -> int:
        return self.host.process.pid

    def poll(self) -> int | None:
        return self.host.code_of(self.agent_id)

    def kill(self) -> None:
        self.host.process.kill()

    def send_signal(self, sig: int) -> None:
        """Signal the process, with every agent it runs."""
        self.host.process.send_signal(sig)

    def wait(self, timeout: float | None = None) -> int:
        self.host.process.wait(timeout)
        code = self.host.code_of(self.agent_id)
        assert code is not None
        return code


class Emulation:
    def __init__(
        self, config: ExperimentConfig, broker: BrokerAddress, options: EmulationOptions
    ) -> None:
        check_networked(config, aggregator=True)
        self.start_method = start_method()
        self.roster = [f"agent-{k:03d}" for k in range(config.agents)]
        # The whole run is checked here, before any agent starts, by the code simulate builds
        # its fleet with (`build_workload`: the dataset, its partition over the roster, the
        # model for the data's shapes): a run the agents cannot start fails now, with
        # simulate's one sentence (ValueError or OSError), not in N agents' logs. No agent's
        # data is kept; the dataset cache the agents read is filled.
        build_workload(config, self.roster, agents=[])
        self.config = config
        self.broker = broker
        self.options = options
        self.run_id = new_run_id()
        self.fleet = f"emu-{self.run_id[4:12]}"
        self.processes: dict[str, StartedProcess] = {}
        """Each agent's process: its own (a forked child or a `subprocess.Popen`), or a
        `HostedProcess` for an agent that shares one."""
        self.shared: dict[str, SharedProcess] = {}
        """The process each agent shares with others (agents_per_process > 1)."""
        self.conductor: Conductor
        self.key, self.signing_args = self.signing()
        self.agent_starter: Starter | None = None
        """What starts the agents' processes (coordinator/agent_starts.py): from the first
        start to the end of `run`."""

    def signing(self) -> tuple[Signer | None, list[str]]:
        """How this fleet signs: the coordinator's signer and the agents' flags for it.
        With agent keys, each agent's key pair is made in its state folder now, so the
        coordinator can admit them before they start (as `coordinator admit` would)."""
        workdir = self.options.workdir
        if self.options.key_file is not None:
            key = read_key(str(self.options.key_file))
            return key, ["--key-file", str(self.options.key_file)]
        if not self.options.agent_keys:
            return None, []
        admitted, trust = workdir / "admitted.keys", workdir / "trust.keys"
        workdir.mkdir(parents=True, exist_ok=True)
        lines = []
        for agent_id in self.roster:
            lines.append(public_line(agent_id, workdir / agent_id / IDENTITY_FILE))
        admitted.write_text("\n".join(lines) + "\n")
        coordinator = member_keys(COORDINATOR, workdir / "coordinator.pem", admitted)
        trust.write_text(key_line(COORDINATOR, coordinator.public) + "\n")
        return coordinator, ["--trust", str(trust)]

    def profile_of(self, index: int) -> str | None:
        """The run's profile for this agent (its budget and throttle), if the run has any."""
        if not self.config.profiles:
            return None
        names = profile_names(self.config.profiles)
        return names[index % len(names)]

    def broker_of(self, index: int) -> BrokerAddress:
        """The broker this agent connects to (`EmulationOptions.agent_brokers`)."""
        brokers = self.options.agent_brokers or (self.broker,)
        return brokers[index % len(brokers)]

    def agent_command(self, index: int) -> list[str]:
        """What this agent's process runs: `python -m` and this (a module, its arguments)."""
        return ["agent", *self.agent_args(index)]

    def agent_args(self, index: int) -> list[str]:
        """The `edge-agent` arguments of this agent (a process of its own or a thread)."""
        agent_id = self.roster[index]
        return [
            "--broker", str(self.broker_of(index)), "--fleet", self.fleet, "--id", agent_id,
            *(["--profile", profile] if (profile := self.profile_of(index)) else []),
            "--state-dir", str(self.options.workdir / agent_id),
            "--round-timeout", str(self.options.round_timeout_s),
            "--vote-timeout", str(self.options.vote_timeout_s),
            "--linger", str(self.options.linger_s),
            "--once",
            *self.signing_args,
            *(["--telemetry"] if self.options.telemetry else []),
            *self.log_args(),
        ]  # fmt: skip

    def log_args(self) -> list[str]:
        """The agents' logging flags: `verbose` if given, else this process's own."""
        verbose = self.options.verbose
        if verbose is None:
            return log_flags()
        return ["-" + "v" * verbose] if verbose else []

    def log_path(self, agent_id: str) -> Path:
        """Where an agent's output goes (appended to by each process started for it)."""
        return self.options.workdir / f"{agent_id}.log"

    def starter(self) -> Starter:
        """`agent_starter`, started if need be."""
        if self.agent_starter is None:
            workdir = self.options.workdir
            workdir.mkdir(parents=True, exist_ok=True)
            log = workdir / "fork-server.log"
            self.agent_starter = starter(self.start_method, agent_env(workdir), log)
        return self.agent_starter

    def close_starter(self) -> None:
        if self.agent_starter is not None:
            self.agent_starter.close()
            self.agent_starter = None

    def start_agent(self, index: int) -> StartedProcess:
        agent_id = self.roster[index]
        log_path = self.log_path(agent_id)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            stdio = Stdio(None, log.fileno(), log.fileno())
            env = agent_env(self.options.workdir)
            process = self.starter().start(self.agent_command(index), env, stdio)
        self.processes[agent_id] = process
        return process

    def start_shared(self, indices: range) -> SharedProcess:
        """Start the agents `indices` as threads of one `python -m agent.host` process, whose
        own output (not an agent's) goes to host-NNN.log."""
        name = f"host-{indices.start // self.options.agents_per_process:03d}"
        workdir = self.options.workdir
        workdir.mkdir(parents=True, exist_ok=True)
        agents = {self.roster[i]: i for i in indices}
        spec = [
            {"id": a, "log": str(self.log_path(a)), "args": self.agent_args(i)}
            for a, i in agents.items()
        ]
        (workdir / f"{name}.json").write_text(json.dumps(spec, indent=1))
        command = ["agent.host", str(workdir / f"{name}.json")]
        with open(workdir / f"{name}.log", "ab") as log:
            # Many agent threads: glibc's per-thread malloc arenas would each keep what
            # their thread freed; two arenas hold the process to what it uses.
            env = {
                **agent_env(workdir),
                "MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX", "2"),
            }
            host = SharedProcess.start(self.starter(), command, log, env)
        for agent_id in agents:
            self.processes[agent_id] = HostedProcess(host, agent_id)
            self.shared[agent_id] = host
        return host

    def start_agents(self) -> None:
        """Every agent: a process each, or `agents_per_process` to a process."""
        per = self.options.agents_per_process
        if per <= 1:
            for index in range(len(self.roster)):
                self.start_agent(index)
            return
        for first in range(0, len(self.roster), per):
            self.start_shared(range(first, min(first + per, len(self.roster))))

    def kill_agent(self, agent_id: str) -> None:
        """A fault: kill this agent abruptly (the broker publishes its last will), and it
        alone: an agent sharing a process with others is killed in it (agent/host.py)."""
        if agent_id in self.shared:
            self.shared[agent_id].kill_agent(agent_id)
        else:
            self.processes[agent_id].kill()

    def run(
        self,
        progress: Callable[[int], None] | None = None,
        stop: threading.Event | None = None,
    ) -> dict[str, Any]:
        """Run the fleet to its end, or until `stop` is set (Ctrl-C): then the agents still
        running are ended and the report covers the rounds their logs hold, its summary's
        `interrupted` true."""
        started, started_at = time.perf_counter(), time.time()
        identity = Identity(self.fleet, COORDINATOR, role="coordinator", key=self.key)
        transport = connect(
            self.broker, identity, TransportOptions(limits=FOLLOWER_LIMITS), probe_s=0
        )
        self.conductor = Conductor(
            fleet=self.fleet,
            roster=self.roster,
            config=self.config,
            transport=transport,
            sender=identity.sender,
            key=self.key,
            round_timeout_s=self.options.round_timeout_s,
            run_id=self.run_id,
            log_folder=self.options.workdir / "runs" / self.run_id,
        )
        try:
            self.starter()  # a fork server imports while the conductor starts
            self.conductor.start()
            if not (stop is not None and stop.is_set()):
                self.start_agents()
            with settled_heap():  # its collection runs while the agents start
                self._wait(progress, stop or threading.Event())
        finally:
            for process in self.processes.values():
                if process.poll() is None:
                    process.kill()
                    process.wait(10)
            for host in set(self.shared.values()):
                host.end(10)
            self.close_starter()
            self.conductor.close()
            leave(transport, identity)
        interrupted = stop is not None and stop.is_set()
        report = self.report(time.perf_counter() - started, interrupted, started_at)
        if progress:  # the rounds the agents logged: their last statuses may be in flight
            progress(self.rounds_logged())
        return report

    def _wait(self, progress: Callable[[int], None] | None, stop: threading.Event) -> None:
        rounds = self.config.learning.rounds
        limit = self.options.run_timeout_s or (
            120.0 + rounds * (self.options.round_timeout_s + 30.0)
        )
        deadline = time.monotonic() + limit
        while any(p.poll() is None for p in self.processes.values()) and not stop.is_set():
            if time.monotonic() > deadline:
                raise TimeoutError(f"agents still running after {limit:.0f} s")
            if self.conductor.error is not None:
                raise RuntimeError(f"the coordinator's aggregation failed: {self.conductor.error}")
            if progress:
                progress(self.conductor.rounds_done())
            stop.wait(0.2)

    def round_log(self, agent_id: str) -> Path:
        """Where an agent of this run logs its rounds (in its own state folder)."""
        return run_folder(self.options.workdir / agent_id, self.run_id) / "rounds.jsonl"

    def logs(self) -> dict[str, dict[int, dict[str, Any]]]:
        """Each agent's round records, from its round log."""
        return {a: checkpoint.read_records(self.round_log(a)) for a in self.roster}

    def rounds_logged(self) -> int:
        """Agent-rounds the agents logged (an agent that stopped early counts as done), as
        the progress bar counts them: each agent's latest round, as the conductor's live
        count (`Conductor.rounds_done`) takes it from the statuses. Not the number of its
        records: a buffered strategy's (FedBuff's) round is the version an update went into,
        which several updates may share and another may skip."""
        rounds = self.config.learning.rounds
        return sum(
            rounds if any(r.get("stopped") for r in records.values()) else max(records, default=0)
            for records in self.logs().values()
        )

    def report(
        self, wall: float, interrupted: bool = False, started_at: float | None = None
    ) -> dict[str, Any]:
        """The simulate report schema, assembled from the agents' round logs; its time to
        target counted from `started_at` (Unix seconds). Interrupted, an agent ended by a
        signal (Ctrl-C reaches the agents too, and this process ends the rest) did not fail."""
        logs = self.logs()
        codes = {
            a: c
            for a, p in self.processes.items()
            if (c := p.returncode) not in (0, None) and not (interrupted and c in STOPPED_CODES)
        }
        reasons = {a: exit_reason(code, self.log_path(a)) for a, code in codes.items()}
        # An agent that refused the run (a model it cannot build, data that does not fit)
        # exits cleanly after saying why in its status: it failed the run all the same.
        for agent, progress in self.conductor.agents.items():
            if agent not in codes and progress.state in ("rejected", "failed"):
                codes[agent] = self.processes[agent].returncode or 0
                reasons[agent] = f"{progress.state}: {progress.error or 'no reason given'}"
        report = assemble_report(
            self.config, self.roster, logs, self.conductor.aggregated(), wall, reasons
        )
        report["summary"]["failed_agents"] = codes
        report["summary"]["interrupted"] = interrupted
        with_time_to_target(report, None, started_at)
        return {
            "config": {
                **dataclasses.asdict(self.config),
                "roster": self.roster,
                "run_id": self.run_id,
                "broker": str(self.broker),
                "agent_brokers": [str(b) for b in self.options.agent_brokers],
                "agents_per_process": self.options.agents_per_process,
                "profiles": {a: self.profile_of(i) for i, a in enumerate(self.roster)},
            },
            **report,
        }


STOPPED_CODES = frozenset({-signal.SIGINT, -signal.SIGTERM, -signal.SIGKILL, 130})
"""Exit codes of an agent process ended by a signal (or by Python's KeyboardInterrupt)."""


def agent_env(workdir: Path) -> dict[str, str]:
    """The agents' environment: unbuffered output (their logs are read while they run),
    PYTHONSAFEPATH (`-m agent` must not pick up an `agent` folder in the cwd), and the
    emulation's folder as their temporary folder, so what libraries leave there (onnxruntime's
    session file `.ses`, written when an agent checks its exported model) goes with it."""
    return {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONSAFEPATH": "1",
        "TMPDIR": str(workdir),
    }


def exit_reason(code: int, log_path: Path) -> str:
    """Why an agent process failed, in a few words: its exit code, the signal that killed
    it, or the last line it logged (an agent's fatal error is one line)."""
    if code < 0:
        try:
            return f"exit code {code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"exit code {code}"
    last = last_line(log_path)
    return f"exit code {code}" + (f": {last}" if last else "")


def last_line(path: Path, limit: int = 300) -> str:
    """The last non-empty line of a log (at most `limit` characters), '' if none is left."""
    try:
        with open(path, "rb") as log:
            log.seek(max(log.seek(0, os.SEEK_END) - 4096, 0))
            lines = log.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    tail = [line.strip() for line in lines if line.strip()]
    return tail[-1][:limit] if tail else ""
