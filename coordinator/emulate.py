"""`coordinator emulate`: a whole fleet of real agent processes on one machine, over MQTT.

The coordinator publishes the run (configuration and roster, retained), starts one
`edge-agent` process per agent, follows their statuses for progress, and when they are done
assembles the same report schema as `simulate` from each agent's own round log. Traffic in
this report is what each agent's MQTT connection actually carried (frames, including
statuses and re-sent models), so it is a little above the simulator's message sizes.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.data import load_dataset
from agent.experiment import ExperimentConfig, check_networked, profile_names
from agent.learning import CENTRALIZED, running, topology
from agent.report import AgentRound, stopped_summary, summarize
from agent.runtime import checkpoint
from coordinator.aggregator import Aggregator
from protocol import BrokerAddress, Identity, connect, leave, messages, topics


@dataclasses.dataclass(frozen=True)
class EmulationOptions:
    workdir: Path
    round_timeout_s: float = 120.0
    vote_timeout_s: float = 60.0
    linger_s: float = 30.0
    verbose: int = 0
    """Log level of the agents (1: info, 2: debug)."""
    run_timeout_s: float | None = None
    """Give up on agents still running after this long (default: scaled to the run)."""


class Emulation:
    def __init__(
        self, config: ExperimentConfig, broker: BrokerAddress, options: EmulationOptions
    ) -> None:
        check_networked(config, aggregator=True)
        # Once here rather than in every agent: fills the dataset cache the agents read, and a
        # bad --dataset fails now (ValueError or OSError), not in N processes.
        load_dataset(config.dataset, seed=config.seed)
        self.config = config
        self.broker = broker
        self.options = options
        self.run_id = f"run-{uuid.uuid4().hex[:12]}"
        self.fleet = f"emu-{self.run_id[4:12]}"
        self.roster = [f"agent-{k:03d}" for k in range(config.agents)]
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.progress: dict[str, int] = {}
        self._lock = threading.Lock()
        self.aggregator: Aggregator | None = None
        """The coordinator's aggregator, for a centralized strategy."""

    def profile_of(self, index: int) -> str | None:
        """The run's profile for this agent (its budget and throttle), if the run has any."""
        if not self.config.profiles:
            return None
        names = profile_names(self.config.profiles)
        return names[index % len(names)]

    def agent_command(self, index: int) -> list[str]:
        agent_id = self.roster[index]
        return [
            sys.executable, "-m", "agent",
            "--broker", str(self.broker), "--fleet", self.fleet, "--id", agent_id,
            *(["--profile", profile] if (profile := self.profile_of(index)) else []),
            "--state-dir", str(self.options.workdir / agent_id),
            "--round-timeout", str(self.options.round_timeout_s),
            "--vote-timeout", str(self.options.vote_timeout_s),
            "--linger", str(self.options.linger_s),
            *(["-" + "v" * self.options.verbose] if self.options.verbose else []),
        ]  # fmt: skip

    def start_agent(self, index: int) -> subprocess.Popen[bytes]:
        agent_id = self.roster[index]
        log_path = self.options.workdir / f"{agent_id}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                self.agent_command(index),
                stdout=log,
                stderr=subprocess.STDOUT,
                # PYTHONSAFEPATH: `-m agent` must not pick up an `agent` folder in the cwd.
                env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONSAFEPATH": "1"},
            )
        self.processes[agent_id] = process
        return process

    def _on_status(self, _topic: str, payload: bytes) -> None:
        try:
            message = messages.decode(payload)
        except Exception:
            return
        if isinstance(message, messages.Status) and message.run_id == self.run_id:
            with self._lock:
                self.progress[message.sender] = max(
                    self.progress.get(message.sender, 0), message.round
                )

    def run(self, progress: Callable[[int], None] | None = None) -> dict[str, Any]:
        started = time.perf_counter()
        identity = Identity(self.fleet, "coordinator", role="coordinator")
        transport = connect(self.broker, identity)
        aggregating: threading.Thread | None = None
        stop = threading.Event()
        try:
            transport.subscribe(topics.status(self.fleet), self._on_status)
            if self.config.learning.strategy in CENTRALIZED:
                self.aggregator = Aggregator(
                    fleet=self.fleet,
                    run_id=self.run_id,
                    roster=self.roster,
                    config=self.config,
                    transport=transport,
                    sender=identity.sender,
                    round_timeout_s=self.options.round_timeout_s,
                    stop=stop,
                )
                self.aggregator.start()
                aggregating = threading.Thread(
                    target=self.aggregator.run, name="aggregator", daemon=True
                )
                aggregating.start()
            run = messages.RunConfig(
                fleet=self.fleet,
                sender="coordinator",
                run_id=self.run_id,
                roster=self.roster,
                seed=self.config.seed,
                config=dataclasses.asdict(self.config),
            )
            transport.publish(topics.run(self.fleet), messages.encode(run), retain=True)
            for index in range(len(self.roster)):
                self.start_agent(index)
            self._wait(progress)
        finally:
            stop.set()
            for process in self.processes.values():
                if process.poll() is None:
                    process.kill()
                    process.wait(10)
            if aggregating is not None:
                aggregating.join(10)
            leave(transport, identity)
        return self.report(time.perf_counter() - started)

    def _wait(self, progress: Callable[[int], None] | None) -> None:
        rounds = self.config.learning.rounds
        limit = self.options.run_timeout_s or (
            120.0 + rounds * (self.options.round_timeout_s + 30.0)
        )
        deadline = time.monotonic() + limit
        while any(p.poll() is None for p in self.processes.values()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"agents still running after {limit:.0f} s")
            if self.aggregator is not None and self.aggregator.error is not None:
                raise RuntimeError(f"the coordinator's aggregation failed: {self.aggregator.error}")
            if progress:
                with self._lock:
                    progress(sum(self.progress.values()))
            time.sleep(0.2)
        if progress:
            progress(rounds * len(self.roster))

    def report(self, wall: float) -> dict[str, Any]:
        """The simulate report schema, assembled from the agents' round logs."""
        logs = {
            agent_id: checkpoint.read_records(self.options.workdir / agent_id / "rounds.jsonl")
            for agent_id in self.roster
        }
        rounds: list[dict[str, Any]] = []
        t_star = None
        stopped = {
            agent_id: t for agent_id, records in logs.items() for t, r in records.items()
            if r.get("stopped")
        }  # fmt: skip
        last: dict[str, AgentRound] = {}
        for t in range(1, self.config.learning.rounds + 1):
            agents = {}
            for agent_id, records in logs.items():
                if t in records:
                    last[agent_id] = AgentRound.from_dict(records[t])
                    t_star = t_star or records[t].get("t_star")
                elif not running(agent_id, t, stopped):  # its figures stay, it spends nothing
                    last[agent_id] = last[agent_id].idle(t)
                else:
                    continue
                agents[agent_id] = last[agent_id].report_entry(networked=True)
            if not agents or len(stopped) == len(self.roster) and t > max(stopped.values()):
                break
            record = {
                "round": t,
                "order": topology.reuse_order(self.config.seed, t, self.roster),
                "agents": agents,
                "t_star": t_star,
            }
            if self.aggregator is not None:
                record["order"] = self.roster
                if t <= len(self.aggregator.records):
                    round_record = self.aggregator.records[t - 1]
                    record["coordinator"] = dataclasses.asdict(round_record.traffic)
                    record["participants"] = round_record.participants
            rounds.append(record)
        missing = {a: p.returncode for a, p in self.processes.items() if p.returncode != 0}
        aggregated = self.aggregator.records if self.aggregator else []
        return {
            "config": {
                **dataclasses.asdict(self.config),
                "roster": self.roster,
                "run_id": self.run_id,
                "broker": str(self.broker),
                "profiles": {a: self.profile_of(i) for i, a in enumerate(self.roster)},
            },
            "rounds": rounds,
            "summary": {
                **(summarize(rounds, t_star, wall) if rounds else {"rounds": 0, "t_star": None}),
                "stopped": stopped_summary(rounds, stopped, self.config.learning.rounds),
                "failed_agents": missing,
                "stragglers": sorted(
                    {s for r in rounds for a in r["agents"].values() for s in a["stragglers"]}
                    | {s for r in aggregated for s in r.stragglers}
                ),
            },
        }
