"""One run on a fleet, from the coordinator's side: publish it, aggregate, follow, report.

`coordinator run` (real devices) and `coordinator emulate` (agent processes it starts) both
conduct a run through `Conductor`: it publishes the run message (retained, so an agent that
starts or restarts later still finds it), aggregates a centralized strategy with the same
`Aggregator` and strategy objects `simulate` calls, follows every agent's retained status
(each carries that round's full record), and at the end clears the run message.
`assemble_report` turns per-agent round records into the report schema `simulate` writes;
`coordinator run` has them from the statuses, `emulate` from the agents' own round logs.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.experiment import ExperimentConfig, attackers, config_to_dict
from agent.learning import running, topology
from agent.learning.strategies import strategy
from agent.report import (
    AgentRound,
    honest_summary,
    named_for_task,
    screened_uploads,
    stopped_summary,
    summarize,
)
from agent.runtime import new_run_id
from coordinator.agent_logs import LogKeeper
from coordinator.aggregator import Aggregator, AggregatorRecord
from coordinator.status_figures import TOLD, checked, header_problem, incomplete
from coordinator.tallies import DEFAULT_VOTE_WAIT_S, TallyKeeper
from protocol import ProtocolError, Transport, messages, topics
from protocol.limits import Limits
from protocol.membership import PresenceClock
from protocol.messages import FINAL_STATES
from protocol.signing import Signer, keys_to_list

log = logging.getLogger(__name__)

Records = dict[str, dict[int, dict[str, Any]]]
"""Per agent, per round, the agent's round record (`AgentRound.as_dict`)."""


@dataclass(frozen=True)
class Resumed:
    """What an earlier process of a run kept, for `coordinator run --resume` to go on."""

    records: Records
    """The round records the agents had reported."""


@dataclass
class AgentProgress:
    """What the coordinator knows of one agent in the run, from its statuses."""

    state: str = ""
    round: int = 0
    stopped: bool = False
    error: str = ""
    records: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)


class Conductor:
    """Publishes one run, aggregates it when centralized, and follows its agents."""

    def __init__(
        self,
        *,
        fleet: str,
        roster: list[str],
        config: ExperimentConfig,
        transport: Transport,
        sender: str = "coordinator",
        key: Signer | None = None,
        round_timeout_s: float = 120.0,
        run_id: str | None = None,
        timeouts: Mapping[str, float] | None = None,
        resumed: Resumed | None = None,
        state_path: Path | None = None,
        log_folder: Path | None = None,
    ) -> None:
        """`timeouts`: the run's timeouts for the agents (see `messages.RunConfig`);
        `resumed`: what an earlier process of this run kept (`coordinator run --resume`);
        `state_path`: where a centralized run's server state is kept after every round;
        `log_folder`: the run's folder, where the agents' log records are kept
        (`coordinator.agent_logs`; None: not kept)."""
        self.fleet = fleet
        self.roster = sorted(roster)
        self.config = config
        self.transport = transport
        self.sender = sender
        self.key = key
        self.run_id = run_id or new_run_id()
        self.timeouts = dict(timeouts or {})
        self.offline: dict[str, float] = {}
        self._presences = PresenceClock()
        """Agents whose presence says they are gone, and since when (monotonic)."""
        self.agents = {agent: AgentProgress() for agent in self.roster}
        self.cancelled = False
        """The run's signer called it off (`coordinator cancel`)."""
        self.resumed = resumed
        if resumed is not None:
            for agent, rows in resumed.records.items():
                if agent in self.agents:
                    self.agents[agent].records.update(rows)
                    self.agents[agent].round = max(rows, default=0)
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._limits: Limits | None = None
        """The transport's limits before the aggregator raised them for the run."""
        self.keeper = TallyKeeper(
            fleet=fleet,
            run_id=self.run_id,
            roster=self.roster,
            rounds=config.learning.rounds,
            transport=transport,
            sender=sender,
            key=key,
            wait_s=self.timeouts.get("vote_s", DEFAULT_VOTE_WAIT_S),
            start_wait_s=self.timeouts.get("round_s", round_timeout_s),
        )
        self.logs = (
            None if log_folder is None else LogKeeper(fleet, self.run_id, roster, log_folder, key)
        )
        self.aggregator: Aggregator | None = None
        if strategy(config.learning.strategy).centralized:
            self.aggregator = Aggregator(
                fleet=fleet,
                run_id=self.run_id,
                roster=self.roster,
                config=config,
                transport=transport,
                sender=sender,
                key=key,
                round_timeout_s=round_timeout_s,
                stop=self._stop,
                state_path=state_path,
            )

    def start(self) -> None:
        """Subscribe (statuses, votes, the aggregator's inputs), then publish the run."""
        if self.logs is not None:
            self.logs.subscribe(self.transport)
        self.transport.subscribe(topics.status(self.fleet), self._on_status)
        self.transport.subscribe(topics.presence(self.fleet), self._on_presence)
        self.transport.subscribe(topics.round_topic(self.fleet, "+", "vote"), self._on_vote)
        self.transport.subscribe(topics.run(self.fleet), self._on_run)
        # The agents of a run resumed here followed every status and vote themselves since
        # their keeper went offline; a keeper restarted in mid-run does not know which
        # tallies they already took, and a wrong one would split the fleet. So the run
        # message names no keeper any more: an agent that restarts follows everyone too.
        if self.resumed is None:
            self.keeper.start()
        if self.aggregator is not None:
            self._limits = self.transport.limits  # the aggregator raises them to the run's
            self.aggregator.start()
            self._thread = threading.Thread(
                target=self.aggregator.run, name="aggregator", daemon=True
            )
            self._thread.start()
        run = messages.RunConfig(
            fleet=self.fleet,
            sender=self.sender,
            run_id=self.run_id,
            roster=self.roster,
            seed=self.config.seed,
            config=config_to_dict(self.config),
            timeouts=self.timeouts,
            keys=keys_to_list(self.key, self.roster),
            keeper=self.sender if self.resumed is None else "",
        )
        self._publish_run(run)

    def _publish_run(self, run: messages.RunConfig) -> None:
        """Retained and kept: after a broker restart it is there again for an agent that
        restarts and looks for the run it was in."""
        self.transport.publish(
            topics.run(self.fleet), messages.encode(run, key=self.key), retain=True, keep=True
        )

    def _on_run(self, topic: str, payload: bytes) -> None:
        """`coordinator cancel` replaced the run message with a cancelled one: stop
        aggregating, keep that message (a reconnect must not bring the run back), and wait
        for the agents to end their round ("cancelled" is a final state)."""
        if not payload:
            return
        try:
            message = messages.decode(payload, key=self.key)
        except ProtocolError:
            return
        if (
            not isinstance(message, messages.RunConfig)
            or message.fleet != self.fleet
            or message.run_id != self.run_id
            or not message.cancelled
            or message.sender != self.sender
            or self.cancelled
        ):
            return
        log.warning("run %s cancelled", self.run_id)
        with self._changed:
            self.cancelled = True
            self._changed.notify_all()
        self._stop.set()
        self._publish_run(message)

    def close(self, clear: bool = True) -> None:
        """Stop aggregating and (`clear`) clear the retained run message: it is over."""
        self._stop.set()
        self.keeper.close()
        if self.logs is not None:
            self.logs.unsubscribe(self.transport)
        if self._thread is not None:
            self._thread.join(10)
        if self._limits is not None:  # no more models: a follower's limits again
            self.transport.set_limits(self._limits)
        if clear and self.transport.connected:
            self.keeper.clear()
            self.transport.clear_retained(topics.run(self.fleet)).wait_for_publish(5)

    @property
    def error(self) -> Exception | None:
        """Why aggregation failed, if it did (the run cannot go on)."""
        return self.aggregator.error if self.aggregator is not None else None

    def _ours(
        self, topic: str, payload: bytes, kind: str, check_run: bool = True
    ) -> messages.Message | None:
        """A message of `kind` from a roster member (of this run, unless `check_run` is
        False: presence is not per run), or None."""
        try:
            message = messages.decode_on_topic(topic, payload, kind, self.fleet, self.key)
        except ProtocolError:
            return None
        if message.sender not in self.agents or (check_run and message.run_id != self.run_id):
            return None
        return message

    def _on_status(self, topic: str, payload: bytes) -> None:
        message = self._ours(topic, payload, "status", check_run=False)
        if isinstance(message, messages.Status) and message.run_id != self.run_id:
            message = ended_earlier(message, self.run_id)
        if not isinstance(message, messages.Status):
            return
        rounds = self.config.learning.rounds
        if not 0 <= message.round <= rounds:
            return  # a round the run does not have: nothing to keep of it
        if problem := header_problem(message):
            TOLD.tell(self.fleet, message.sender, [problem], "status ignored")
            return
        figures, problems = checked(message.metrics, message.round, run_metric(self.config))
        TOLD.tell(self.fleet, message.sender, problems, "ignored")
        progress = self.agents[message.sender]
        self.keeper.on_status(message)
        with self._changed:
            progress.state, progress.stopped = message.state, message.stopped
            progress.round = max(progress.round, message.round)
            for row in reportable(self.fleet, message, figures):
                progress.records.setdefault(row["round"], row)
            error = figures.get("error")
            if isinstance(error, str):
                progress.error = error[:500]
            self._changed.notify_all()

    def _on_presence(self, topic: str, payload: bytes) -> None:
        message = self._ours(topic, payload, "presence", check_run=False)
        if not isinstance(message, messages.Presence) or not self._presences.fresh(message):
            return
        self.keeper.on_presence(message.sender, message.online, message.reason)
        with self._changed:
            if message.online:
                self.offline.pop(message.sender, None)
            else:
                self.offline.setdefault(message.sender, time.monotonic())
            self._changed.notify_all()

    def _on_vote(self, topic: str, payload: bytes) -> None:
        message = self._ours(topic, payload, "vote")
        if isinstance(message, messages.Vote) and 1 <= message.round <= self.config.learning.rounds:
            self.keeper.on_vote(message)

    def gone(self, after_s: float) -> bool:
        """Every agent not finished has been offline for `after_s` at least: nobody is left
        to wait for."""
        now = time.monotonic()
        with self._changed:
            return all(
                now - self.offline.get(agent, now) >= after_s
                for agent, p in self.agents.items()
                if p.state not in FINAL_STATES
            )

    def rounds_done(self) -> int:
        """Agent-rounds completed so far (an agent that stopped early counts as done)."""
        rounds = self.config.learning.rounds
        with self._changed:
            return sum(
                rounds if p.stopped or p.state in FINAL_STATES else p.round
                for p in self.agents.values()
            )

    def last_round(self) -> int:
        """The latest round any agent of the run reported finished."""
        with self._changed:
            return max((p.round for p in self.agents.values()), default=0)

    def ended_rounds(self) -> dict[str, int]:
        """Per agent, the latest round it reported finished: a cancelled run's agents each
        end after the round they are in, and say which (`after_rounds`)."""
        with self._changed:
            return {agent: p.round for agent, p in self.agents.items()}

    def unfinished(self) -> list[str]:
        with self._changed:
            return [a for a, p in self.agents.items() if p.state not in FINAL_STATES]

    def wait(self, timeout_s: float) -> bool:
        """Wait for a status change, at most `timeout_s`; True if every agent is finished."""
        with self._changed:
            self._changed.wait(timeout_s)
        return not self.unfinished()

    def records(self) -> Records:
        with self._changed:
            return {a: dict(p.records) for a, p in self.agents.items()}

    def aggregated(self) -> list[AggregatorRecord]:
        return self.aggregator.records if self.aggregator is not None else []


def ended_earlier(idle: messages.Status, run_id: str) -> messages.Status | None:
    """An agent's idle status read as its final status of run `run_id`, when that run is the
    last one it ended (`last_run`): the run finished while no coordinator followed it, and
    the idle status has taken the final one's place on the broker."""
    last = idle.metrics.get("last_run")
    if idle.state != "idle" or not isinstance(last, dict) or last.get("run_id") != run_id:
        return None
    state, round_ = last.get("state"), last.get("round")
    if state not in FINAL_STATES or not isinstance(round_, int):
        return None
    return dataclasses.replace(
        idle,
        run_id=run_id,
        round=round_,
        state=state,
        stopped=state == "stopped",
        metrics={"records": last.get("records")},
    )


def run_metric(config: ExperimentConfig) -> str:
    """The name under which the run's agents report their metric (`Task.metric_name`),
    without loading the task (torch): whether a status's accuracy must be a share is the
    run's to say, not the member's."""
    if config.metric:
        return config.metric.rpartition(":")[2]
    return "accuracy" if config.task == "classification" else config.task


def reportable(
    fleet: str, message: messages.Status, figures: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """The round records of a status (checked `figures`) a report can be built from: its
    round's and those its final status repeats (`earlier_records`), each with every figure
    a report needs; one that lacks any is told and left out."""
    record = figures.get("record")
    rows = [record] if isinstance(record, dict) and message.round >= 1 else []
    rows += earlier_records(figures.get("records"), message.round)
    kept = []
    for row in rows:
        if why := incomplete(row):
            where = f"of round {row.get('round', message.round)}"
            TOLD.tell(fleet, message.sender, [("record", f"{where} {why}")], "left out")
        else:
            kept.append(row)
    return kept


def earlier_records(rows: object, rounds: int) -> list[dict[str, Any]]:
    """The round records an agent's final status repeats (`records`), those well formed and
    of the run's `rounds`: the rounds whose statuses went by while no coordinator followed
    the run."""
    if not isinstance(rows, list):
        return []
    return [
        row
        for row in rows
        if isinstance(row, dict)
        and isinstance(row.get("round"), int)
        and 1 <= row["round"] <= rounds
    ]


def assemble_report(
    config: ExperimentConfig,
    roster: list[str],
    logs: Mapping[str, Mapping[int, Mapping[str, Any]]],
    aggregated: list[AggregatorRecord],
    wall: float,
    failed: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The `simulate` report's `rounds` and `summary` from each agent's round records.

    An agent that stopped early keeps its last figures and spends nothing in later rounds,
    as in simulate; a round no agent reported ends the report (the run ended there).
    `failed`: why each agent that failed did (its exit code, its state); the summary's
    `failures` add the round each one failed in.
    """
    roster = sorted(roster)
    rounds: list[dict[str, Any]] = []
    t_star = None
    stopped = {
        agent_id: t for agent_id, records in logs.items() for t, r in records.items()
        if r.get("stopped")
    }  # fmt: skip
    last: dict[str, AgentRound] = {}
    buffered = strategy(config.learning.strategy).buffered
    for t in range(1, config.learning.rounds + 1):
        agents = {}
        for agent_id, records in sorted(logs.items()):
            if t in records:
                last[agent_id] = AgentRound.from_dict(records[t])
                t_star = t_star or records[t].get("t_star")
            elif agent_id in last and not running(agent_id, t, stopped):
                last[agent_id] = last[agent_id].idle(t)
            elif agent_id in last and buffered and agent_id not in (failed or {}):
                last[agent_id] = carried(last[agent_id], t)
            else:
                continue
            agents[agent_id] = last[agent_id].report_entry(networked=True)
        if not agents or len(stopped) == len(roster) and t > max(stopped.values()):
            break
        record: dict[str, Any] = {
            "round": t,
            "order": topology.reuse_order(config.seed, t, roster),
            "agents": agents,
            "t_star": t_star,
        }
        if strategy(config.learning.strategy).centralized:
            record["order"] = roster
            if t <= len(aggregated):
                server = aggregated[t - 1]
                record["coordinator"] = dataclasses.asdict(server.traffic)
                record["participants"] = server.participants
                if not buffered:  # FedBuff's buffer screens nothing
                    record |= screened_uploads(server.screened, server.clipped)
        rounds.append(record)
    report = {
        "rounds": rounds,
        "summary": {
            **(
                summarize(rounds, t_star, wall)
                if rounds
                else {"rounds": 0, "agents_reported": 0, "t_star": None}
            ),
            "failures": failures(logs, failed or {}),
            "stopped": stopped_summary(rounds, stopped, config.learning.rounds),
            **honest_summary(rounds, attackers(config, roster)),
            "stragglers": sorted(
                {s for r in rounds for a in r["agents"].values() for s in a["stragglers"]}
                | {s for r in aggregated for s in r.stragglers}
            ),
            "quarantined": sorted(
                {s for r in rounds for a in r["agents"].values() for s in a.get("quarantined", [])}
            ),
        },
    }
    return named_for_task(report, config.learning_task())


def carried(record: AgentRound, version: int) -> AgentRound:
    """FedBuff: an agent's figures at a version it sent no update trained from (it trained
    from another, or was still training): its latest update's, spending nothing more."""
    return dataclasses.replace(
        record, round=version, bytes_sent=0, bytes_received=0, nonzeros_sent=0, train_flops=0
    )


def failures(
    logs: Mapping[str, Mapping[int, Any]], reasons: Mapping[str, str]
) -> dict[str, dict[str, Any]]:
    """Per failed agent, the round it failed in (the one after its last record) and why."""
    return {
        agent: {"from_round": max(logs.get(agent, {}), default=0) + 1, "reason": reason}
        for agent, reason in sorted(reasons.items())
    }


def describe_failures(report: Mapping[str, Any]) -> str | None:
    """One line naming each agent that failed, from which round and why; None if none did."""
    planned = report["config"]["learning"]["rounds"]
    named = []
    for agent, failure in report["summary"]["failures"].items():
        start = failure["from_round"]
        when = f"from round {start}" if start <= planned else "after its last round"
        named.append(f"{agent} ({when}, {failure['reason']})")
    return f"agents that failed: {', '.join(named)}" if named else None


def wait_until_finished(
    conductor: Conductor,
    limit_s: float,
    progress: Callable[[int], None] | None = None,
    *,
    stop: threading.Event | None = None,
    gone_after_s: float | None = None,
) -> list[str]:
    """Follow the run until every agent is finished, every unfinished one has been offline
    for `gone_after_s`, `stop` is set or `limit_s` passes; returns who is not finished.
    `progress(done)` gets the agent-rounds done as they change."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
        if conductor.error is not None:
            raise RuntimeError(f"the coordinator's aggregation failed: {conductor.error}")
        finished = conductor.wait(0.5)
        ended = finished or (gone_after_s is not None and conductor.gone(gone_after_s))
        if progress is not None:  # counted after deciding: the last statuses count too
            progress(conductor.rounds_done())
        if ended:
            break
    return conductor.unfinished()
