"""One agent's run, whatever its topology: the start barrier, statuses, checkpoints and
resuming, early stopping, lingering and the exit.

What a round is belongs to a round driver (`agent.runtime.decentralized`,
`agent.runtime.centralized`); the session runs the drivers' rounds in order and does what
every round ends with: count its traffic, persist it, publish the status. Keeping that here
means a crash, a restart or an early stop behaves alike under every strategy.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from typing_extensions import Required, TypedDict

from agent.device import Budget, Throttle
from agent.device.budget import RoundWork
from agent.device.calibration import RoundCosts
from agent.device.throttle import ENERGY_SOURCE
from agent.experiment import ExperimentConfig, agent_availability
from agent.learning import AgentState, EarlyStop, Learner, Masks, Published, State, privacy
from agent.learning.reduction import Reduction
from agent.report import AgentRound
from agent.runtime.codec import expected_shapes
from agent.runtime.dozing import Dozing
from agent.runtime.inbox import Expected, Inbox
from agent.runtime.run_files import persist, recent_records, restore, savings
from agent.workload import Workload, compute_slot, round_work
from protocol import Transport, messages, topics
from protocol.limits import run_limits
from protocol.signing import Signer

log = logging.getLogger(__name__)

STATUS_FIGURES = (
    "limited_by",
    "accuracy",
    "sparsity",
    "p_k",
    "bytes_sent",
    "bytes_received",
    "stragglers",
    "quarantined",
    "t_star",
    "energy_j",
    "reduction",
    "reduction_why",
    "kept",
    "kept_why",
    "strategy_accuracy",
    "train_s",
    "predicted_s",
    "peak_memory_mb",
    "epsilon",
    "stop_reason",
)
"""The round figures a status shows (with `metric`, the name of the figure under
"accuracy": the task's metric, and the run's `strategy`); it also carries the whole round
record, from which `coordinator run` writes its report."""
REPORT_ONLY = ("record", "records", "last_run")
"""Status metrics for `coordinator run`'s report, left out of the telemetry mirror."""


@dataclass(frozen=True)
class Timeouts:
    round_s: float = 120.0
    """How long to wait for a neighbour's model before treating it as a straggler."""
    request_every_s: float = 5.0
    """While waiting, ask for missing models again this often (they may have been lost)."""
    vote_s: float = 60.0
    """How long to wait for a round's votes before counting the missing ones as 0."""
    linger_s: float = 60.0
    """After the last round, keep answering requests until the fleet is done or this passes."""


@dataclass(frozen=True)
class Run:
    """The agreed run: its id, the sorted roster and the experiment configuration."""

    run_id: str
    roster: tuple[str, ...]
    config: ExperimentConfig
    aggregator: str | None = None
    """Who aggregates a centralized strategy: the coordinator that published the run."""
    keeper: str = ""
    """Who publishes the round tallies (the coordinator that published the run); empty: this
    agent follows every status and vote itself."""


def new_run_id() -> str:
    """A fresh id for every run: nothing of one run (retained messages, checkpoints, round
    logs) is mistaken for the next, even with the same configuration."""
    return f"run-{uuid.uuid4().hex[:12]}"


def finite_or_none(value: Any) -> Any:
    """`value` with every non-finite float (a diverged model's loss) replaced by None: the
    protocol carries finite numbers only."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite_or_none(v) for v in value]
    return value


def telemetry_json(status: messages.Status, at: float) -> bytes:
    """`status` as the plain UTF-8 JSON of the telemetry mirror, stamped with Unix time `at`.

    Its metrics leave out the round records: the status figures are already there, and the
    record is for `coordinator run`'s report. JSON has no NaN, so non-finite numbers are null.
    """
    document = {
        "fleet": status.fleet,
        "agent": status.sender,
        "run_id": status.run_id,
        "round": status.round,
        "state": status.state,
        "stopped": status.stopped,
        "time": at,
        "metrics": {k: v for k, v in status.metrics.items() if k not in REPORT_ONLY},
    }
    if status.staleness is not None:
        document["staleness"] = status.staleness
    return json.dumps(finite_or_none(document), allow_nan=False).encode()


def publish_telemetry(transport: Transport, status: messages.Status) -> None:
    """Publish `status` again as plain JSON, retained, for MQTT tools; it stays after the run
    like the status, the latest state. Unframed: a JSON reader expects no frame header."""
    topic = topics.telemetry(status.fleet, status.sender)
    transport.publish_plain(topic, telemetry_json(status, time.time()), retain=True, keep=True)


class TrafficMeter:
    """What a transport carried since the last look: a round's bytes (its record) and frames
    (MQTT deliveries, in the agent's log)."""

    KEYS = ("published_bytes", "received_bytes", "published_frames", "received_frames")

    def __init__(self, transport: Transport) -> None:
        """Counts from now: a long-lived agent's transport carried its earlier runs too, and
        none of that is this run's traffic."""
        self.transport = transport
        self._seen = dict.fromkeys(self.KEYS, 0)
        self.take()

    def take(self) -> dict[str, int]:
        stats = self.transport.stats
        now = {key: stats.get(key, 0) for key in self.KEYS}
        used = {key: now[key] - self._seen[key] for key in self.KEYS}
        self._seen = now
        return used


class EitherSet(threading.Event):
    """Reads as set once any of its events is: a session's stop is the process's stop or
    its run called off. The round drivers' waits check `is_set`, so a cancel ends them as a
    stop does, while the process (a long-lived agent) goes on serving."""

    def __init__(self, *events: threading.Event) -> None:
        super().__init__()
        self.events = events

    def is_set(self) -> bool:
        return super().is_set() or any(event.is_set() for event in self.events)


class RoundDriver(Protocol):
    """What a topology's rounds are; the session calls these in a run's order."""

    @property
    def votes(self) -> Mapping[int, bool]:
        """This agent's pruning votes by round (its status carries their history)."""

    def subscribe(self) -> None:
        """The subscriptions every round of the run needs besides the fleet's statuses and
        presence, which the session subscribes itself."""

    def prepare_start(self) -> None:
        """What to subscribe before telling the fleet this agent is ready."""

    def run_round(self, round_: int) -> AgentRound:
        """Wait for the round's inputs, compute, publish; the record without its traffic."""

    def checkpoint(self, round_: int) -> dict[str, Any]:
        """The driver's state to persist with round `round_`."""

    def restore(self, saved: dict[str, Any]) -> None:
        """Read back what `checkpoint` saved."""

    def republish(self) -> None:
        """After a restart, publish again what the last rounds published."""

    def resumed(self, done: int) -> None:
        """After a restart into round `done` + 1, once its status is out."""

    def close(self) -> None:
        """The run is over: stop serving and clean up what the broker holds for us."""


@runtime_checkable
class OpenEndedDriver(Protocol):
    """A driver whose run ends when something else says so, not after `--rounds` rounds of
    its own (FedBuff: when the server's last version is out, `agent.runtime.buffered`)."""

    def round_numbers(self, done: int) -> Iterator[int]:
        """The rounds to run after `done`, until the driver says the run is over."""

    def final(self, record: AgentRound) -> bool:
        """Whether `record` is the agent's last of the run."""


@dataclass(frozen=True)
class RoundClock:
    """A round's computation by the device's clock: what an emulated board slept, the
    round's seconds (host and sleep) and what the measured costs predicted (None without)."""

    throttled_s: float
    train_s: float
    predicted_s: float | None


class SessionOptions(TypedDict, total=False):
    """`Session`'s arguments other than `expects`, as `AgentRuntime` takes and passes them."""

    agent_id: Required[str]
    fleet: Required[str]
    run: Required[Run]
    workload: Required[Workload]
    transport: Required[Transport]
    state_dir: Required[Path]
    timeouts: Timeouts
    key: Signer | None
    on_round: Callable[[dict[str, Any]], None] | None
    on_finish: Callable[[AgentState], None] | None
    stop: threading.Event | None
    budget: Callable[[], Budget | None] | None
    throttle: Throttle | None
    costs: RoundCosts | None
    telemetry: bool
    cancelled: threading.Event | None
    start_from: tuple[State, Masks | None] | None
    say: Callable[[str], None] | None


def run_inbox(
    fleet: str,
    run: Run,
    learner: Learner,
    transport: Transport,
    key: Signer | None,
    expects: Mapping[str, Any],
) -> Inbox:
    """The inbox of one agent's run, and the transport's limits set for it: what a message
    of this run can be at most follows from its model, so a hostile peer cannot make the
    agent buffer more than a few models' worth."""
    shapes = expected_shapes(learner.facts.initial)
    limits = run_limits(shapes, len(run.roster))
    transport.set_limits(limits)
    expected = Expected(
        fleet=fleet,
        run_id=run.run_id,
        roster=frozenset(run.roster),
        shapes=shapes,
        key=key,
        aggregator=run.aggregator,
        keeper=run.keeper,
        rounds=run.config.learning.rounds,
        **expects,
    )
    return Inbox(expected, limits=limits)


def round_numbers(driver: RoundDriver, done: int, rounds: int) -> Iterable[int]:
    """The rounds left after `done`: up to `rounds`, or an open-ended driver's own (FedBuff's
    updates, until the last version)."""
    if isinstance(driver, OpenEndedDriver):
        return driver.round_numbers(done)
    return range(done + 1, rounds + 1)


def is_last(driver: RoundDriver, record: AgentRound, rounds: int) -> bool:
    """Whether `record` is the agent's last round of the run."""
    if isinstance(driver, OpenEndedDriver):
        return driver.final(record)
    return record.round >= rounds


def status_figures(session: Session, row: dict[str, Any]) -> dict[str, Any]:
    """The figures of a round's record its status carries, with the run's metric, strategy
    and DP mode (under `--dp`)."""
    cfg = session.cfg
    return (
        {k: row[k] for k in STATUS_FIGURES}
        | {"metric": session.learner.facts.task.metric_name, "strategy": cfg.strategy}
        | ({"dp": cfg.dp} if cfg.dp != "off" else {})
    )


class Session:
    """One agent in one run over an already started transport; `run(driver)` runs it."""

    def __init__(
        self,
        *,
        agent_id: str,
        fleet: str,
        run: Run,
        workload: Workload,
        transport: Transport,
        state_dir: Path,
        timeouts: Timeouts = Timeouts(),
        key: Signer | None = None,
        on_round: Callable[[dict[str, Any]], None] | None = None,
        on_finish: Callable[[AgentState], None] | None = None,
        stop: threading.Event | None = None,
        budget: Callable[[], Budget | None] | None = None,
        throttle: Throttle | None = None,
        costs: RoundCosts | None = None,
        telemetry: bool = False,
        cancelled: threading.Event | None = None,
        start_from: tuple[State, Masks | None] | None = None,
        say: Callable[[str], None] | None = None,
        expects: Mapping[str, Any] | None = None,
    ) -> None:
        """`expects`: more fields of the inbox's `Expected` (what the wire format sends);
        `telemetry`: mirror statuses as JSON; `cancelled`: set when the run is called off (it
        ends after its round); `start_from`: weights and masks to start from instead of the
        seed's (`init = "previous"`); `say`: where user-facing lines go (else the log)."""
        self.me = agent_id
        self.born = time.time()
        """When this session began (its requests say so: `messages.Request.since`)."""
        self.fleet = fleet
        self.run_info = run
        self.config = run.config
        self.cfg = run.config.learning
        self.roster = sorted(run.roster)
        self.learner = workload.learner
        self.data = workload.data[agent_id]
        self.transport = transport
        self.timeouts = timeouts
        self.key = key
        self.on_round = on_round
        self.on_finish = on_finish
        """Called once the model is final, before lingering (the CLI exports it to ONNX)."""
        self.cancelled = cancelled or threading.Event()
        self.stop: threading.Event = EitherSet(stop or threading.Event(), self.cancelled)
        """Ends the rounds: the process stopping, or the run called off (`cancelled`)."""
        self.say = say or log.info
        self.budget = budget or (lambda: None)
        self.throttle = throttle
        self.costs = costs
        """This device's measured costs, when a budget or `--reduce` needs them."""
        self.board_work: RoundWork | None = None
        """An emulated board's dense round, which its throttle scales by measured cost."""
        if costs is not None and throttle is not None and throttle.enabled:
            self.board_work = round_work(self.config, self.learner, len(self.data.y_train))
        self.telemetry = telemetry
        self.inbox = run_inbox(fleet, run, self.learner, transport, key, expects or {})
        self.state: AgentState = self.learner.init_agent(agent_id)
        if start_from is not None:
            weights, masks = start_from
            self.state = dataclasses.replace(self.state, weights=weights, masks=masks)
            self.state.init_weights = weights
        self.warm_start: Published | None = (
            None if start_from is None else self.learner.published(self.state, 0)
        )
        """This agent's own starting model, when it did not start from the seed."""
        self.early = EarlyStop.of(self.cfg)
        self.stopped_round: int | None = None
        self.stop_reason = ""  # why it stopped, when its privacy budget was spent
        privacy.check_run(self.cfg, self.learner.facts.model, {agent_id: len(self.data.y_train)})
        self.meter = TrafficMeter(transport)
        self._trained_s = 0.0
        """Seconds the round's computation took on this host (a real board's energy)."""
        self.over = False
        """The rounds are over (set under `following`): nothing may subscribe for this run
        any more, since its subscriptions are about to be dropped (`scoped_subscriptions`)."""
        self.following = threading.Lock()
        self.dozing = dozing(self)  # its availability (`--availability`, its profile's)
        self.checkpoint_path = state_dir / "checkpoint.pt"
        self.records_path = state_dir / "rounds.jsonl"

    def round0_model(self, agent: str) -> Published:
        """A peer's round-0 model, never sent: derived from the seed; or, when this agent
        started from its own model (`init = "previous"`), that model, since a peer's own
        starting point is unknown here and a seeded stand-in would average a random model
        into the warm start (ALGORITHMS.md 1.3, decision of issue 31)."""
        if self.warm_start is not None:
            return self.warm_start
        return self.learner.published(self.learner.init_agent(agent), 0)

    # ------------------------------------------------------------------ messages

    def topic(self, round_: int, kind: str, agent: str, to: str | None = None) -> str:
        return topics.round_topic(self.fleet, round_, kind, agent, to)

    def header(self, round_: int) -> dict[str, Any]:
        """The envelope fields every message of this agent in this run carries."""
        return {
            "fleet": self.fleet,
            "sender": self.me,
            "run_id": self.run_info.run_id,
            "round": round_,
        }

    def header_fields(self, round_: int) -> dict[str, Any]:
        """`header` as `agent.runtime.codec`'s message builders take it."""
        fields = self.header(round_)
        fields["round_"] = fields.pop("round")
        return fields

    def model_fields(self, round_: int, num_samples: int) -> dict[str, Any]:
        """The arguments of `model_message` other than the tensors."""
        return {
            **self.header_fields(round_),
            "num_samples": num_samples,
            "fp16": self.cfg.fp16,
            "key": self.key,
        }

    def send(self, topic: str, data: bytes, *, retain: bool = False) -> None:
        """Publish `data`, first holding it back to the emulated link's speed, if any."""
        if self.throttle is not None:
            self.throttle.before_send(len(data))
        self.transport.publish(topic, data, retain=retain)

    def after_compute(self, started: float, train_flops: int) -> float:
        """Seconds slept to run at the emulated device's speed after a computation started
        at monotonic time `started`."""
        self._trained_s = time.monotonic() - started
        throttle = self.throttle
        slept = throttle.after_compute(self._trained_s, train_flops) if throttle else 0.0
        return slept + self.dozing.hold(started, time.monotonic() - started)

    def after_reduced_compute(self, started: float, reduction: Reduction) -> RoundClock:
        """`after_compute` for a round cut by `reduction` with measured costs: an emulated
        board sleeps out its time for the reduction's measured share of a dense round
        (`Throttle.board_seconds`), not its counted FLOPs; the round's clock and prediction
        come back with what was slept, offline spans too (`Dozing.hold`)."""
        host_s = self._trained_s = time.monotonic() - started
        if self.costs is None:
            return RoundClock(self.dozing.hold(started, host_s), host_s, None)
        predicted = self.costs.predicted_s(reduction)
        if self.throttle is None or not self.throttle.enabled or self.board_work is None:
            return RoundClock(self.dozing.hold(started, host_s), host_s, predicted)
        share = 1.0 if reduction.predicted is None else reduction.predicted
        work = self.board_work
        board_s = self.throttle.board_seconds(work.fixed_flops, work.train_flops, share)
        slept = self.throttle.until(host_s, board_s)
        slept += self.dozing.hold(started, host_s + slept)
        return RoundClock(slept, host_s + slept, board_s)

    def status(
        self, state: str, round_: int, metrics: dict[str, Any], votes: Mapping[int, bool]
    ) -> None:
        """Publish the retained status: the vote history (a restarted agent's way to learn
        the votes it missed), and the staleness of the round record among its `metrics`."""
        self.dozing.shown = (state, round_, metrics, votes)
        history = "".join("1" if votes.get(r) else "0" for r in range(1, round_ + 1))
        message = messages.Status(
            **self.header(round_),
            state=state,
            metrics=finite_or_none(
                {**metrics, "votes": history if self.learner.prunes_further else ""}
            ),
            stopped=self.stopped_round is not None,
            staleness=finite_or_none((metrics.get("record") or {}).get("staleness")),
        )
        self.transport.publish(
            topics.status(self.fleet, self.me),
            messages.encode(message, key=self.key),
            retain=True,
            keep=True,
        )
        if self.telemetry:
            publish_telemetry(self.transport, message)

    def stops_after(self, weights: State, train_loss: float, restart: bool = False) -> bool:
        """Whether early stopping stops the agent after a round that ended with `weights`
        (`EarlyStop.after`): computation, so in a compute slot (`workload.compute_slot`)
        when it is on; off, no wait for a slot (it held the round's record and status back).
        Under `--max-epsilon`, it stops, and shares nothing more, once its next round would
        take its epsilon past it (`privacy.budget_spent`: the reason is its `stop_reason`)."""
        spent = privacy.budget_spent(self.cfg, len(self.data.y_train), self.state.dp_steps)
        if spent is not None:
            self.stop_reason = spent
            return True
        if not self.early.enabled:
            return False
        with compute_slot():
            return self.early.after(self.learner.facts, weights, train_loss, self.data, restart)

    # ------------------------------------------------------------------ rounds

    def run(self, driver: RoundDriver) -> None:
        follow_fleet(self)
        driver.subscribe()
        done = restore(self, driver)
        self.inbox.at_round(done + 1)
        if done:
            driver.republish()
            if self.stopped_round is not None:  # the crash may have come before the status
                self.status("stopped", done, savings(self, done), driver.votes)
            driver.resumed(done)
        else:
            self.start_together(driver)
        try:
            for round_ in round_numbers(driver, done, self.cfg.rounds):
                self.dozing.wait_online()
                if self.stop.is_set() or self.stopped_round is not None:
                    break
                self.finish_round(driver, driver.run_round(round_))
            if self.stopped_round is not None:
                reason = self.stop_reason or self.early.rule.reason
                log.info("stopped early after round %d: %s", self.stopped_round, reason)
            if self.finished and self.on_finish:
                self.on_finish(self.state)
            elif self.cancelled.is_set():
                self.status("cancelled", self.state.round, {}, driver.votes)
            if not self.stop.is_set():
                self.linger()
        finally:
            with self.following:
                self.over = True
            self.dozing.close()
            driver.close()

    @property
    def finished(self) -> bool:
        """Trained its last round, or stopped early: its model is final."""
        return self.state.round == self.cfg.rounds or self.stopped_round is not None

    def finish_round(self, driver: RoundDriver, record: AgentRound) -> dict[str, Any]:
        """Add the round's traffic to its record, persist it, publish the status."""
        used = self.meter.take()
        record.bytes_sent, record.bytes_received = used["published_bytes"], used["received_bytes"]
        frames = (used["received_frames"], used["published_frames"])
        log.info("round %d: %d deliveries received, %d frames sent", record.round, *frames)
        record.finished_at = time.time()
        if self.throttle is not None:  # a profile's board: its energy model
            record.energy_j, record.radio_energy_j = self.throttle.round_energy(
                record.train_flops, self._trained_s, record.bytes_sent + record.bytes_received
            )
            record.energy_source = ENERGY_SOURCE
        self._trained_s = 0.0
        record.quarantined = sorted(self.inbox.quarantine.members())
        if record.stopped:
            record.stop_reason = self.stop_reason
        row = record.as_dict()
        persist(self, driver, record.round, row)
        saved: dict[str, Any] = {}
        if record.stopped:
            self.stopped_round = record.round
            saved = savings(self, record.round)
        final = record.stopped or is_last(driver, record, self.cfg.rounds)
        self.status(
            "stopped" if record.stopped else "done" if final else "training",
            record.round,
            status_figures(self, row)
            | saved
            | {"record": row}
            | ({"records": recent_records(self)} if final else {}),
            driver.votes,
        )
        self.inbox.forget_before(record.round - 1)
        if self.on_round:
            self.on_round(row)
        return row

    def start_together(self, driver: RoundDriver) -> None:
        """Subscribe, say so in a status, and wait (at most a round timeout) for the others.

        A model published before its receiver subscribed is lost to it, and the receiver only
        asks for it again after `request_every_s`: without this barrier, agents of a fleet
        that start seconds apart would wait that long in their first rounds. (A resumed agent
        skips it: the others are past it, and it republishes its recent models.)
        """
        driver.prepare_start()
        self.status("ready", 0, {}, driver.votes)
        others = set(self.roster) - {self.me}
        absent = self.inbox.wait_ready(others, self.stop, self.timeouts.round_s)
        if absent:
            log.warning("starting without %s: not heard from in time", ", ".join(sorted(absent)))

    def linger(self) -> None:
        """Keep answering requests until every other agent reports done (or time runs out).

        An agent that stopped early stays for the rest of the run: its neighbours may still
        ask for its last round's model, and it stays reachable."""
        others = set(self.roster) - {self.me}
        timeout = self.timeouts.linger_s
        if self.stopped_round is not None:
            rounds_left = self.cfg.rounds - self.stopped_round
            timeout += rounds_left * (self.timeouts.round_s + self.timeouts.vote_s)
        self.inbox.wait_finished(others, self.stop, timeout)


def dozing(session: Session) -> Dozing:
    """The session's device as its availability says: it sleeps (and says so in its
    status), its link drops."""
    pattern = agent_availability(session.config, session.roster).get(session.me)
    return Dozing(pattern, session.transport, session.stop, lambda s: say_asleep(session, s))


def say_asleep(session: Session, seconds: float) -> None:
    """The last status again, with `asleep_s`: the device sleeps for `seconds`."""
    shown = session.dozing.shown
    if shown is not None:
        state, round_, metrics, votes = shown
        session.status(state, round_, {**metrics, "asleep_s": round(seconds, 1)}, votes)
        session.dozing.shown = shown


def follow_fleet(session: Session) -> None:
    """Subscribe to who is ready, stopped or gone (the start barrier, the needs left out and
    lingering need it). With a keeper, one tally a round says it all (and every vote), and
    its absence notice who is offline: no agent receives every other agent's statuses, votes
    and presences, unless the keeper goes offline."""
    keeper, transport, inbox = session.run_info.keeper, session.transport, session.inbox
    if keeper:
        transport.subscribe(topics.round_topic(session.fleet, "+", "tally", keeper), inbox.on_tally)
        transport.subscribe(topics.absent(session.fleet, keeper), inbox.on_absent)
        inbox.on_keeper_lost = lambda: follow_everyone(session)
        transport.subscribe(topics.presence(session.fleet, keeper), inbox.on_presence)
    else:
        transport.subscribe(topics.status(session.fleet), inbox.on_status)
        transport.subscribe(topics.presence(session.fleet), inbox.on_presence)


def follow_everyone(session: Session) -> None:
    """The keeper went offline: follow every agent's (retained) status, which carries its
    vote history, every vote and every presence, so the run goes on without its tallies."""
    # A keeper leaves when its run is over for it, often while this agent lingers: only a
    # keeper lost before this agent's last round is worth a warning.
    with session.following:
        # The keeper's offline presence may be handled after the run ended here; then its
        # subscriptions would outlive the run: every status of the fleet in every later run.
        if session.over:
            return
        lost = log.info if session.finished else log.warning
        lost("the tally keeper %s went offline: following every agent", session.run_info.keeper)
        session.transport.subscribe(topics.status(session.fleet), session.inbox.on_status)
        vote = topics.round_topic(session.fleet, "+", "vote")
        session.transport.subscribe(vote, session.inbox.on_vote)
        session.transport.subscribe(topics.presence(session.fleet), session.inbox.on_presence)
