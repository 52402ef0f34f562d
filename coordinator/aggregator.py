"""The coordinator's side of a centralized strategy over MQTT: collect, aggregate, broadcast.

The math is `agent.learning.central`'s strategy and the server's steps of a round in their
order (`agent.learning.central.server`), which the simulator calls too; here they get what came
off the wire, and this module only waits, messages and re-sends. Round t:

    downloads   (FedSPU family) answer each participant's `Request` (fraction = its p_k)
                with its part of the global model, on round/t/global/<agent>
    collect     the `Update`s (FedLDF: the `Divergence` vectors, then a `Request` to each
                participant for its selected layers and their `Update`s)
    aggregate   and publish the broadcast on round/t/global (kept for re-sends on request)

A round's timeout runs from its first delivery; a participant that has not delivered by then
is left out of the round (a straggler). One that stopped early (its status says so) is not
waited for, nor one that is offline and missed the last round. A broadcast strategy always
ends a round with a `Global`, empty when nobody delivered. Handlers (`Intake`) only validate
and store; the round loop (`Aggregator`) runs on its own thread, and an error there ends the
run (`error`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.experiment import ExperimentConfig
from agent.learning import (
    Payload,
    ServerState,
    Upload,
    central_strategy,
    ldf,
    privacy,
    running,
)
from agent.learning.central.server import conclude, gather, participants
from agent.learning.screening import Screening, ScreeningLog
from agent.report import Traffic
from agent.runtime import checkpoint, decode_upload, encode_state, expected_shapes, values_sent
from agent.runtime.inbox import ROUNDS_AHEAD
from agent.workload import build_workload
from coordinator.buffered import BufferedServer, Run
from coordinator.buffered_secure import CohortServer
from coordinator.secure_sum import SecureIntake, SecureRound
from protocol import ProtocolError, Transport, messages, topics
from protocol.limits import DEFAULT_LIMITS, run_limits
from protocol.logs import RejectionLog, claimed_sender
from protocol.signing import Signer

log = logging.getLogger(__name__)

KEEP_GLOBALS = 4
"""Broadcasts kept for participants that ask for one again."""


@dataclass
class AggregatorRecord:
    round: int
    participants: list[str]
    stragglers: list[str]
    traffic: Traffic = field(default_factory=Traffic)
    screened: list[str] = field(default_factory=list)
    """The uploads the defence (`--clip`) screened out (`agent.learning.screening`)."""
    clipped: list[str] = field(default_factory=list)
    """The uploads it clipped."""

    @classmethod
    def restored(cls, kept: Mapping[str, Any]) -> AggregatorRecord:
        """A record as the aggregator's kept state holds it (`Aggregator._save`)."""
        return cls(**{**kept, "traffic": Traffic(**kept["traffic"])})


class Intake:
    """The aggregator's handlers: each message of this run from a roster agent is validated
    and stored (under `changed`, which they notify); the round loop reads the stores."""

    def __init__(
        self,
        *,
        fleet: str,
        run_id: str,
        roster: list[str],
        me: str,
        key: Signer | None,
        layer_groups: dict[str, list[str]],
        resend: Callable[[int], None],
    ) -> None:
        self.fleet = fleet
        self.run_id = run_id
        self.roster = roster
        self.me = me
        self.key = key
        self.layer_groups = layer_groups
        self.resend = resend
        """Called with a round whose broadcast a participant asks for again."""
        self.changed = threading.Condition()
        self.updates: dict[tuple[int, str], messages.Update] = {}
        self.divergences: dict[tuple[int, str], dict[str, float]] = {}
        self.asks: dict[tuple[int, str], tuple[int, float]] = {}
        """(round, agent) -> (how many times asked, fraction) for downloads."""
        self.answered: dict[tuple[int, str], int] = {}
        self.received: dict[int, int] = {}
        self.stopped: dict[str, int] = {}
        self.offline: set[str] = set()
        self.rejected = 0
        self.current_round = 1
        """The round being aggregated: messages further ahead than ROUNDS_AHEAD are dropped
        unread (a forged far-future update would otherwise be kept for the whole run)."""
        self._rejections = RejectionLog(log)
        self.on_close: list[Callable[[int], None]] = []
        """Other stores' `close_round`, called with it under `changed`."""

    def subscribe(self, transport: Transport) -> None:
        subscribe = transport.subscribe
        subscribe(topics.round_topic(self.fleet, "+", "update"), self.on_update)
        subscribe(topics.round_topic(self.fleet, "+", "divergence"), self.on_divergence)
        subscribe(topics.round_topic(self.fleet, "+", "request", to=self.me), self.on_request)
        subscribe(topics.status(self.fleet), self.on_status)
        subscribe(topics.presence(self.fleet), self.on_presence)

    def decode(self, topic: str, payload: bytes, kind: str) -> Any:
        """A round message of this run from a roster agent, matching its topic; else None."""
        try:
            message = messages.decode_on_topic(topic, payload, kind, self.fleet, self.key)
        except ProtocolError as exc:
            self.reject(kind, claimed_sender(topic), topic, exc)
            return None
        if message.run_id != self.run_id or message.sender not in self.roster:
            return None
        if kind != "status" and message.round > self.current_round + ROUNDS_AHEAD:
            self.reject(kind, message.sender, topic, "a round too far ahead")
            return None
        if kind != "status":
            with self.changed:
                received = self.received.get(message.round, 0)
                self.received[message.round] = received + len(payload)
        return message

    def on_update(self, topic: str, payload: bytes) -> None:
        message = self.decode(topic, payload, "update")
        if isinstance(message, messages.Update):
            problem = DEFAULT_LIMITS.samples_problem(message.num_samples)
            if problem is not None:
                self.reject("update", message.sender, topic, problem)
                return
            with self.changed:
                self.updates.setdefault((message.round, message.sender), message)
                self.changed.notify_all()

    def on_divergence(self, topic: str, payload: bytes) -> None:
        message = self.decode(topic, payload, "divergence")
        if isinstance(message, messages.Divergence):
            try:
                vector = ldf.checked_divergences(message.layers, message.values, self.layer_groups)
            except ValueError as exc:
                self.reject("divergence", message.sender, topic, exc)
                return
            with self.changed:
                self.divergences.setdefault((message.round, message.sender), vector)
                self.changed.notify_all()

    def on_request(self, topic: str, payload: bytes) -> None:
        message = self.decode(topic, payload, "request")
        if not isinstance(message, messages.Request) or message.target != self.me:
            return
        if message.fraction > 0:  # a download: answered by the round loop
            with self.changed:
                key = (message.round, message.sender)
                count = self.asks.get(key, (0, 0.0))[0]
                self.asks[key] = (count + 1, min(message.fraction, 1.0))
                self.changed.notify_all()
            return
        self.resend(message.round)

    def reject(self, kind: str, sender: str, topic: str, reason: object) -> None:
        """Count a message that failed its checks and warn of it (rate-limited)."""
        with self.changed:
            self.rejected += 1
        self._rejections.reject(kind, sender, topic, reason)

    def on_status(self, topic: str, payload: bytes) -> None:
        message = self.decode(topic, payload, "status")
        if isinstance(message, messages.Status) and message.stopped:
            with self.changed:
                self.stopped[message.sender] = message.round
                self.changed.notify_all()

    def on_presence(self, topic: str, payload: bytes) -> None:
        try:
            message = messages.decode(payload, key=self.key)
        except ProtocolError:
            return
        if isinstance(message, messages.Presence) and message.sender in self.roster:
            with self.changed:
                (self.offline.discard if message.online else self.offline.add)(message.sender)
                self.changed.notify_all()

    def due_downloads(self, round_: int) -> dict[str, float]:
        """Who asked (again) for its part of `round_`'s global model since last answered,
        with the fraction it asked for; marks them answered."""
        with self.changed:
            due = {
                agent: fraction
                for (r, agent), (count, fraction) in self.asks.items()
                if r == round_ and count > self.answered.get((r, agent), 0)
            }
            for agent in due:
                self.answered[(round_, agent)] = self.asks[(round_, agent)][0]
        return due

    def close_round(self, round_: int) -> int:
        """Forget what earlier rounds left behind; the bytes received for `round_`."""
        with self.changed:
            for store in (self.updates, self.divergences, self.asks, self.answered):
                for key in [k for k in store if k[0] < round_]:
                    del store[key]
            for forget in self.on_close:
                forget(round_)
            return self.received.pop(round_, 0)


class Aggregator:
    """Aggregates one run of a centralized strategy; `start`, then `run` (blocking)."""

    def __init__(
        self,
        *,
        fleet: str,
        run_id: str,
        roster: list[str],
        config: ExperimentConfig,
        transport: Transport,
        sender: str = "coordinator",
        key: Signer | None = None,
        round_timeout_s: float = 120.0,
        stop: threading.Event | None = None,
        state_path: Path | None = None,
    ) -> None:
        """`state_path`: where the server state is kept after every round (and read back
        from, when it is there: a restarted `coordinator run` goes on from it)."""
        self.fleet = fleet
        self.run_id = run_id
        self.roster = sorted(roster)
        self.config = config
        self.transport = transport
        self.me = sender
        self.key = key
        self.round_timeout_s = round_timeout_s
        self.stop = stop or threading.Event()
        self.learner = build_workload(config, self.roster, agents=[]).learner
        self.strategy = central_strategy(config.learning.strategy)
        self.server = self.strategy.init_server(self.learner.facts)
        self.records: list[AggregatorRecord] = []
        self.screening_log = ScreeningLog(config.learning, centralized=True)
        self.intake = Intake(
            fleet=fleet,
            run_id=run_id,
            roster=self.roster,
            me=sender,
            key=key,
            layer_groups=self.learner.facts.layer_groups,
            resend=self._resend,
        )
        self._changed = self.intake.changed
        self.secure_intake: SecureIntake | None = None
        """`--secure-aggregation`: its messages (`coordinator.secure_sum`)."""
        if config.learning.secure_aggregation:
            self.secure_intake = SecureIntake(self.intake)
            self.intake.on_close.append(self.secure_intake.close_round)
        self.buffered = buffered_server(self)
        """FedBuff: its versions, taken as the updates come (`coordinator.buffered`)."""
        self._globals: dict[int, bytes] = {}
        self._missed: set[str] = set()
        """Who did not deliver in the last round."""
        self.error: Exception | None = None
        self.state_path = state_path
        self.first_round = 1
        """The round to aggregate first: after the last one kept at `state_path`."""
        self.resumed_round = 0
        """`first_round` when it was read back from `state_path` (0: a fresh run)."""
        if state_path is not None:
            self._restore(state_path)

    # ------------------------------------------------------------------ kept state

    def _save(self, round_: int) -> None:
        """Keep what the next round needs, atomically, so a restart loses at most the round
        in progress (whose uploads the agents send again, see agent/runtime/centralized.py)."""
        if self.state_path is None:
            return
        with self._changed:
            kept = {
                "run_id": self.run_id,
                "round": round_,
                "server": dataclasses.asdict(self.server),
                "records": [dataclasses.asdict(r) for r in self.records],
                "globals": dict(self._globals),
                "missed": sorted(self._missed),
                "stopped": dict(self.intake.stopped),
                "buffer": None if self.buffered is None else self.buffered.buffer.saved(),
            }
        checkpoint.save(self.state_path, kept)

    def _restore(self, path: Path) -> None:
        kept = checkpoint.load(path)
        if kept is None:
            return
        if kept["run_id"] != self.run_id:
            raise ValueError(f"{path} holds the server state of run {kept['run_id']}")
        self.server = ServerState(**kept["server"])
        self.records = [AggregatorRecord.restored(r) for r in kept["records"]]
        self._globals = dict(kept["globals"])
        self._missed = set(kept["missed"])
        self.intake.stopped.update(kept["stopped"])
        self.first_round = self.resumed_round = kept["round"] + 1
        self.intake.current_round = self.first_round
        restore_buffer(self, kept.get("buffer"))
        log.info("resuming aggregation after round %d from %s", kept["round"], path)

    def start(self) -> None:
        """Subscribe; call before the run is published so that no upload is missed. The
        transport's limits follow the run's model, as an agent's do."""
        shapes = expected_shapes(self.learner.facts.initial)
        self.transport.set_limits(run_limits(shapes, len(self.roster)))
        if self.buffered is not None:
            self.buffered.subscribe(self.transport)
            return
        self.intake.subscribe(self.transport)
        if self.secure_intake is not None:
            self.secure_intake.subscribe(self.transport)

    # ------------------------------------------------------------------ sending

    def header(self, round_: int) -> dict[str, Any]:
        return {"fleet": self.fleet, "sender": self.me, "run_id": self.run_id, "round": round_}

    def publish(self, round_: int, topic: str, data: bytes, nonzeros: int = 0) -> None:
        self.transport.publish(topic, data)
        with self._changed:
            record = self._record(round_)
            if record is not None:
                record.traffic.sent += len(data)
                record.traffic.nonzeros_sent += nonzeros

    def _record(self, round_: int) -> AggregatorRecord | None:
        for record in reversed(self.records):
            if record.round == round_:
                return record
        return None

    def _resend(self, round_: int) -> None:
        """A kept broadcast again, to a participant that asked for it."""
        with self._changed:
            data = self._globals.get(round_)
        if data is not None:
            self.publish(round_, topics.global_model(self.fleet, round_), data)

    def _global_message(self, round_: int, payload: Payload, to: list[str]) -> bytes:
        body = encode_state(payload.weights, payload.masks, fp16=self.config.learning.fp16)
        message = messages.Global(**self.header(round_), tensors=body, participants=to)
        return messages.encode(message, key=self.key)

    def answer_downloads(self, round_: int) -> None:
        """Send each participant that asked (again) its part of this round's global model."""
        for agent, fraction in sorted(self.intake.due_downloads(round_).items()):
            part = self.strategy.download(self.learner.facts, self.server, agent, round_, fraction)
            self.publish(
                round_,
                topics.global_model(self.fleet, round_, agent),
                self._global_message(round_, part, [agent]),
                values_sent(part.weights, part.masks),
            )

    # ------------------------------------------------------------------ rounds

    def expected(self, round_: int, candidates: list[str]) -> list[str]:
        """Of `candidates`, those to wait for: not stopped early, and not offline after
        missing the last round (an agent that just crashed may be back within the timeout;
        one that stays gone costs one timeout, not one per round)."""
        intake = self.intake
        return [
            k
            for k in candidates
            if running(k, round_, intake.stopped)
            and not (k in intake.offline and k in self._missed)
        ]

    def collect(
        self,
        round_: int,
        store: dict[tuple[int, str], Any],
        candidates: list[str],
        *,
        asked: bool = False,
    ) -> list[str]:
        """Wait until every expected candidate's message of `round_` is in `store` (answering
        downloads meanwhile) or the round timeout passes; returns who delivered.

        The timeout runs from the first delivery (or, when `asked`, from now): until someone
        delivers nobody is late, however long the fleet takes to start or train."""
        # A round resumed after a restart may never see a first delivery: what the agents
        # uploaded while no aggregator ran is lost, and they may have gone on already.
        timed = asked or round_ == self.resumed_round
        deadline = time.monotonic() + self.round_timeout_s if timed else math.inf
        while True:
            if self.strategy.downloads:
                self.answer_downloads(round_)
            with self._changed:
                got = [k for k in candidates if (round_, k) in store]
                if got and deadline == math.inf:
                    deadline = time.monotonic() + self.round_timeout_s
                waiting = set(self.expected(round_, candidates)) - set(got)
                remaining = deadline - time.monotonic()
                if not waiting or remaining <= 0 or self.stop.is_set():
                    if waiting:
                        log.warning(
                            "round %d: no upload from %s", round_, ", ".join(sorted(waiting))
                        )
                    return got
                self._changed.wait(min(remaining, 0.2))

    def ask_layers(self, round_: int, requests: Mapping[str, list[str]]) -> None:
        """Send each FedLDF participant picked for some layer its `Request` for them."""
        for k, layers in sorted(requests.items()):
            request = messages.Request(**self.header(round_), target=k, layers=layers)
            topic = topics.round_topic(self.fleet, round_, "request", self.me, to=k)
            self.publish(round_, topic, messages.encode(request, key=self.key))

    def _gather(
        self, round_: int, candidates: list[str]
    ) -> tuple[list[str], dict[str, Upload], set[str]]:
        """This round's participants (who uploaded, or under FedLDF who sent a divergence
        vector), their decoded uploads, and who was asked for layers but sent none that
        decodes (FedLDF)."""
        if self.secure_intake is not None:
            senders, uploads = SecureRound(self, round_, candidates).gather()
            return senders, uploads, set()
        inbox = _RoundInbox(self, round_, candidates)
        requests, uploads = gather(self.strategy, self.learner, inbox)
        return inbox.senders, uploads, set(requests) - set(uploads)

    def _conclude(self, round_: int, uploads: dict[str, Upload], senders: list[str]) -> Screening:
        """Aggregate what arrived (`conclude`) and, for a broadcast strategy, publish (and
        keep) the broadcast, naming who it is from (`senders`): empty when nothing arrived.
        Returns which uploads the defence screened out or clipped."""
        fp16, said = self.config.learning.fp16, self.screening_log
        aggregate, self.server, screening = conclude(
            self.strategy, self.learner, self.server, uploads, round_, fp16, said
        )
        if not self.strategy.broadcasts:
            return screening
        broadcast = aggregate.broadcast
        data = self._global_message(round_, broadcast, sorted(senders) if uploads else [])
        with self._changed:
            self._globals[round_] = data
            for r in [r for r in self._globals if r <= round_ - KEEP_GLOBALS]:
                del self._globals[r]
        self.publish(
            round_,
            topics.global_model(self.fleet, round_),
            data,
            values_sent(broadcast.weights, broadcast.masks),
        )
        return screening

    def run_round(self, round_: int) -> bool:
        """One round; False when nobody is left to take part (everyone stopped early)."""
        stopped = self.intake.stopped
        with self._changed:
            candidates = participants(self.roster, round_, stopped)
        if not candidates or budget_spent(self.config, round_):
            return False
        record = AggregatorRecord(round_, [], [])
        self.records.append(record)
        self.intake.current_round = round_
        senders, uploads, missing = self._gather(round_, candidates)
        with self._changed:
            stopped_now = {k for k in candidates if not running(k, round_, stopped)}
        record.participants = sorted(senders)
        record.stragglers = sorted((set(candidates) - set(senders) - stopped_now) | missing)
        self._missed = set(record.stragglers)
        screening = self._conclude(round_, uploads, senders)
        received = self.intake.close_round(round_)
        with self._changed:
            record.traffic.received += received
            record.screened, record.clipped = list(screening.screened), list(screening.clipped)
        return True

    def _log_round(self, round_: int) -> None:
        """The round's line in the log, with the run's privacy loss under `--dp client`."""
        participants = len(self.records[-1].participants)
        log.info("round %d aggregated from %d participants", round_, participants)
        spent = privacy.released(self.config.learning, round_)
        if spent is not None:
            log.info("round %d: %s", round_, spent)

    def run(self) -> None:
        """Every round of the run, until everyone stopped early or `stop` is set (handlers
        keep re-sending kept broadcasts on request while the transport is up). An error is
        logged and kept in `error`: the caller ends the run with it."""
        try:
            if self.buffered is not None:
                self.buffered.run(functools.partial(applied, self))
                return
            for round_ in range(self.first_round, self.config.learning.rounds + 1):
                if self.stop.is_set() or not self.run_round(round_):
                    break
                self._save(round_)
                self._log_round(round_)
        except Exception as exc:
            log.exception("aggregation failed")
            self.error = exc


def budget_spent(config: ExperimentConfig, round_: int) -> bool:
    """Under `--dp client` with `--max-epsilon`: whether round `round_`'s release would take
    the run's epsilon past it (`privacy.release_spent`), said in the log."""
    spent = privacy.release_spent(config.learning, round_)
    if spent is not None:
        log.warning("round %d not released: %s", round_, spent)
    return spent is not None


def buffered_server(agg: Aggregator) -> BufferedServer | CohortServer | None:
    """FedBuff's server for the aggregator's run (`coordinator.buffered`; under
    `--secure-aggregation` its cohorts, `coordinator.buffered_secure`); None for another
    strategy."""
    if not agg.learner.traits.buffered:
        return None
    run = Run(
        agg.fleet, agg.run_id, agg.roster, agg.config, agg.learner, agg.strategy, agg.transport,
        agg.key, agg.stop, agg.header,
    )  # fmt: skip
    plain = BufferedServer(run, agg.server)
    if agg.secure_intake is None:
        return plain
    return CohortServer(agg, plain, functools.partial(open_record, agg))


def open_record(agg: Aggregator, round_: int) -> None:
    """A record for `round_` (a secure cohort's) from its start, so that its messages'
    traffic counts in it (`Aggregator.publish`)."""
    with agg._changed:
        if agg._record(round_) is None:
            agg.records.append(AggregatorRecord(round_, [], []))


def restore_buffer(agg: Aggregator, saved: dict[str, Any] | None) -> None:
    """FedBuff: its version, and the versions it keeps, as `_save` kept them."""
    if agg.buffered is not None and saved:
        agg.buffered.buffer.restore(saved, agg.server)


def applied(
    agg: Aggregator, version: int, senders: list[str], traffic: Traffic, server: ServerState
) -> None:
    """FedBuff: a version is out (`BufferedServer`): its record, the server's new state,
    kept at `state_path` with the buffer (a restarted coordinator goes on from it)."""
    with agg._changed:
        record = agg._record(version)
        if record is None:  # a plain buffer's version: no record opened before it
            record = AggregatorRecord(version, [], [])
            agg.records.append(record)
        record.participants = senders
        record.traffic.sent += traffic.sent
        record.traffic.received += traffic.received
        record.traffic.nonzeros_sent += traffic.nonzeros_sent
        agg.server = server
    agg._save(version)


class _RoundInbox:
    """The aggregator's round `round_` as the server's inbox (`RoundInbox`): each kind of
    message waited for among `candidates` (`Aggregator.collect`) and decoded; FedLDF's
    requests sent (`Aggregator.ask_layers`) before their layers are waited for."""

    def __init__(self, aggregator: Aggregator, round_: int, candidates: list[str]) -> None:
        self.aggregator, self.round, self.candidates = aggregator, round_, candidates
        self.senders: list[str] = []
        """The round's participants: who sent a divergence vector (FedLDF), else an upload
        that decodes."""

    def divergences(self) -> dict[str, dict[str, float]]:
        store = self.aggregator.intake.divergences
        self.senders = self.aggregator.collect(self.round, store, self.candidates)
        return {k: store[(self.round, k)] for k in self.senders}

    def uploads(self, requests: Mapping[str, list[str]] | None) -> dict[str, Upload]:
        aggregator, round_, candidates = self.aggregator, self.round, self.candidates
        if requests is not None:
            aggregator.ask_layers(round_, requests)
            candidates = sorted(requests)
        delivered = aggregator.collect(
            round_, aggregator.intake.updates, candidates, asked=requests is not None
        )
        uploads = self._decoded(delivered, requests)
        if requests is None:
            self.senders = list(uploads)
        return uploads

    def _decoded(
        self, agents: list[str], layers: Mapping[str, list[str]] | None
    ) -> dict[str, Upload]:
        """Decode the `Update`s of `agents`; one that does not decode is left out."""
        aggregator, intake = self.aggregator, self.aggregator.intake
        uploads = {}
        for k in agents:
            update = intake.updates[(self.round, k)]
            asked = None if layers is None else layers[k]
            try:
                payload = decode_upload(
                    aggregator.strategy, aggregator.learner.facts, update.tensors, asked
                )
            except (ProtocolError, ValueError) as exc:
                with intake.changed:
                    intake.rejected += 1
                log.warning("round %d: rejected the upload of %s: %s", self.round, k, exc)
                continue
            uploads[k] = Upload(payload, update.num_samples)
        return uploads
