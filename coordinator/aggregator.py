"""The coordinator's side of a centralized strategy over MQTT: collect, aggregate, broadcast.

The math is `agent.central`'s strategy, the object the simulator calls with the same inputs:
the uploads as they came off the wire. Round t:

    downloads   (FedSPU family) answer each participant's `Request` (fraction = its p_k)
                with its part of the global model, on round/t/global/<agent>
    collect     the `Update`s (FedLDF: the `Divergence` vectors, then a `Request` to each
                participant for its selected layers and their `Update`s)
    aggregate   and publish the broadcast on round/t/global (kept for re-sends on request)

A round's timeout runs from its first delivery; a participant that has not delivered by then
is left out of the round (a straggler). One that stopped early (its status says so) is not
waited for, nor one that is offline and missed the last round. A broadcast strategy always
ends a round with a `Global`, empty when nobody delivered. Handlers only validate and store;
the round loop runs on its own thread, and an error there ends the run (`error`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from agent.experiment import ExperimentConfig, build_workload
from agent.learning import ldf
from agent.learning.central import Payload, Upload, as_sent, central_strategy
from agent.runtime.codec import decode_upload, encode_state, values_sent
from protocol import messages, topics
from protocol.errors import ProtocolError
from protocol.mqtt import MqttTransport

log = logging.getLogger(__name__)

KEEP_GLOBALS = 4
"""Broadcasts kept for participants that ask for one again."""


@dataclass
class RoundTraffic:
    """What the aggregator put on and took off its link in one round."""

    sent: int = 0
    received: int = 0
    nonzeros_sent: int = 0


@dataclass
class AggregatorRecord:
    round: int
    participants: list[str]
    stragglers: list[str]
    traffic: RoundTraffic = field(default_factory=RoundTraffic)


class Aggregator:
    """Aggregates one run of a centralized strategy; `start`, then `run` (blocking)."""

    def __init__(
        self,
        *,
        fleet: str,
        run_id: str,
        roster: list[str],
        config: ExperimentConfig,
        transport: MqttTransport,
        sender: str = "coordinator",
        key: bytes | None = None,
        round_timeout_s: float = 120.0,
        stop: threading.Event | None = None,
    ) -> None:
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
        self.server = self.strategy.init_server(self.learner)
        self.records: list[AggregatorRecord] = []
        self._changed = threading.Condition()
        self._updates: dict[tuple[int, str], messages.Update] = {}
        self._divergences: dict[tuple[int, str], dict[str, float]] = {}
        self._asks: dict[tuple[int, str], tuple[int, float]] = {}
        """(round, agent) -> (how many times asked, fraction) for downloads."""
        self._answered: dict[tuple[int, str], int] = {}
        self._globals: dict[int, bytes] = {}
        self._received: dict[int, int] = {}
        self._stopped: dict[str, int] = {}
        self._offline: set[str] = set()
        self._missed: set[str] = set()
        """Who did not deliver in the last round."""
        self.rejected = 0
        self.error: Exception | None = None

    # ------------------------------------------------------------------ wiring

    def start(self) -> None:
        """Subscribe; call before the run is published so that no upload is missed."""
        subscribe = self.transport.subscribe
        subscribe(topics.round_topic(self.fleet, "+", "update"), self._on_update)
        subscribe(topics.round_topic(self.fleet, "+", "divergence"), self._on_divergence)
        subscribe(topics.round_topic(self.fleet, "+", "request", to=self.me), self._on_request)
        subscribe(topics.status(self.fleet), self._on_status)
        subscribe(topics.presence(self.fleet), self._on_presence)

    def _decode(self, topic: str, payload: bytes, kind: str) -> Any:
        """A round message of this run from a roster agent, matching its topic; else None."""
        try:
            fleet, topic_kind, fields = topics.parse(topic)
            message = messages.decode(payload, key=self.key)
            if (
                topic_kind != kind
                or message.TYPE.value != kind
                or fleet != self.fleet
                or message.fleet != fleet
                or message.sender != fields.get("agent")
                or fields.get("round", str(message.round)) != str(message.round)
                or (isinstance(message, messages.Request) and fields.get("to") != message.target)
            ):
                raise ProtocolError(f"{kind} message does not match its topic")
        except ProtocolError as exc:
            self._reject(topic, str(exc))
            return None
        if message.run_id != self.run_id or message.sender not in self.roster:
            return None
        if kind != "status":
            with self._changed:
                received = self._received.get(message.round, 0)
                self._received[message.round] = received + len(payload)
        return message

    def _on_update(self, topic: str, payload: bytes) -> None:
        message = self._decode(topic, payload, "update")
        if isinstance(message, messages.Update):
            if message.num_samples < 1:
                self._reject(topic, "an update must weigh at least one sample")
                return
            with self._changed:
                self._updates.setdefault((message.round, message.sender), message)
                self._changed.notify_all()

    def _on_divergence(self, topic: str, payload: bytes) -> None:
        message = self._decode(topic, payload, "divergence")
        if isinstance(message, messages.Divergence):
            try:
                vector = ldf.checked_divergences(
                    message.layers, message.values, self.learner.layer_groups
                )
            except ValueError as exc:
                self._reject(topic, str(exc))
                return
            with self._changed:
                self._divergences.setdefault((message.round, message.sender), vector)
                self._changed.notify_all()

    def _on_request(self, topic: str, payload: bytes) -> None:
        message = self._decode(topic, payload, "request")
        if not isinstance(message, messages.Request) or message.target != self.me:
            return
        if message.fraction > 0:  # a download: answered by the round loop
            with self._changed:
                key = (message.round, message.sender)
                count = self._asks.get(key, (0, 0.0))[0]
                self._asks[key] = (count + 1, min(message.fraction, 1.0))
                self._changed.notify_all()
            return
        with self._changed:
            data = self._globals.get(message.round)
        if data is not None:
            self._publish(message.round, topics.global_model(self.fleet, message.round), data)

    def _reject(self, topic: str, reason: str) -> None:
        with self._changed:
            self.rejected += 1
        log.warning("rejected message on %s: %s", topic, reason)

    def _on_status(self, topic: str, payload: bytes) -> None:
        message = self._decode(topic, payload, "status")
        if isinstance(message, messages.Status) and message.stopped:
            with self._changed:
                self._stopped[message.sender] = message.round
                self._changed.notify_all()

    def _on_presence(self, topic: str, payload: bytes) -> None:
        try:
            message = messages.decode(payload, key=self.key)
        except ProtocolError:
            return
        if isinstance(message, messages.Presence) and message.sender in self.roster:
            with self._changed:
                (self._offline.discard if message.online else self._offline.add)(message.sender)
                self._changed.notify_all()

    # ------------------------------------------------------------------ sending

    def _header(self, round_: int) -> dict[str, Any]:
        return {"fleet": self.fleet, "sender": self.me, "run_id": self.run_id, "round": round_}

    def _publish(self, round_: int, topic: str, data: bytes, nonzeros: int = 0) -> None:
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

    def _global_message(self, round_: int, payload: Payload, to: list[str]) -> bytes:
        body = encode_state(payload.weights, payload.masks, fp16=self.config.learning.fp16)
        message = messages.Global(**self._header(round_), tensors=body, participants=to)
        return messages.encode(message, key=self.key)

    def _answer_downloads(self, round_: int) -> None:
        """Send each participant that asked (again) its part of this round's global model."""
        with self._changed:
            due = {
                agent: fraction
                for (r, agent), (count, fraction) in self._asks.items()
                if r == round_ and count > self._answered.get((r, agent), 0)
            }
            for agent in due:
                self._answered[(round_, agent)] = self._asks[(round_, agent)][0]
        for agent, fraction in sorted(due.items()):
            part = self.strategy.download(self.learner, self.server, agent, round_, fraction)
            self._publish(
                round_,
                topics.global_model(self.fleet, round_, agent),
                self._global_message(round_, part, [agent]),
                values_sent(part.weights, part.masks),
            )

    # ------------------------------------------------------------------ rounds

    def _expected(self, round_: int, candidates: list[str]) -> list[str]:
        """Of `candidates`, those to wait for: not stopped early, and not offline after
        missing the last round (an agent that just crashed may be back within the timeout;
        one that stays gone costs one timeout, not one per round)."""
        return [
            k
            for k in candidates
            if self._stopped.get(k, round_) >= round_
            and not (k in self._offline and k in self._missed)
        ]

    def _collect(
        self, round_: int, store: dict, candidates: list[str], *, asked: bool = False
    ) -> list[str]:
        """Wait until every expected candidate's message of `round_` is in `store` (answering
        downloads meanwhile) or the round timeout passes; returns who delivered.

        The timeout runs from the first delivery (or, when `asked`, from now): until someone
        delivers nobody is late, however long the fleet takes to start or train."""
        deadline = time.monotonic() + self.round_timeout_s if asked else math.inf
        while True:
            if self.strategy.downloads:
                self._answer_downloads(round_)
            with self._changed:
                got = [k for k in candidates if (round_, k) in store]
                if got and deadline == math.inf:
                    deadline = time.monotonic() + self.round_timeout_s
                waiting = set(self._expected(round_, candidates)) - set(got)
                remaining = deadline - time.monotonic()
                if not waiting or remaining <= 0 or self.stop.is_set():
                    if waiting:
                        log.warning(
                            "round %d: no upload from %s", round_, ", ".join(sorted(waiting))
                        )
                    return got
                self._changed.wait(min(remaining, 0.2))

    def _uploads(
        self, round_: int, agents: list[str], layers: dict[str, list[str]] | None
    ) -> dict[str, Upload]:
        """Decode the `Update`s of `agents`; one that does not decode is left out."""
        uploads = {}
        for k in agents:
            update = self._updates[(round_, k)]
            asked = None if layers is None else layers[k]
            try:
                payload = decode_upload(self.strategy, self.learner, update.tensors, asked)
            except (ProtocolError, ValueError) as exc:
                self.rejected += 1
                log.warning("round %d: rejected the upload of %s: %s", round_, k, exc)
                continue
            uploads[k] = Upload(payload, update.num_samples)
        return uploads

    def run_round(self, round_: int) -> bool:
        """One round; False when nobody is left to take part (everyone stopped early)."""
        with self._changed:
            candidates = [k for k in self.roster if self._stopped.get(k, round_) >= round_]
        if not candidates:
            return False
        record = AggregatorRecord(round_, [], [])
        self.records.append(record)
        if self.strategy.asks_layers:
            senders = self._collect(round_, self._divergences, candidates)
            divergences = {k: self._divergences[(round_, k)] for k in senders}
            selected = self.strategy.select(self.learner, divergences)
            requests = {k: layers for k, layers in selected.items() if layers}
            for k, layers in sorted(requests.items()):
                request = messages.Request(**self._header(round_), target=k, layers=layers)
                topic = topics.round_topic(self.fleet, round_, "request", self.me, to=k)
                self._publish(round_, topic, messages.encode(request, key=self.key))
            delivered = self._collect(round_, self._updates, sorted(requests), asked=True)
            uploads = self._uploads(round_, delivered, requests)
            missing = set(requests) - set(uploads)
        else:
            delivered = self._collect(round_, self._updates, candidates)
            uploads = self._uploads(round_, delivered, None)
            missing = set()
            senders = list(uploads)
        with self._changed:
            stopped_now = {k for k in candidates if self._stopped.get(k, round_) < round_}
        record.participants = sorted(senders)
        record.stragglers = sorted((set(candidates) - set(senders) - stopped_now) | missing)
        self._missed = set(record.stragglers)
        broadcast = Payload({})
        if uploads:
            aggregate = self.strategy.aggregate(self.learner, self.server, uploads)
            broadcast = aggregate.broadcast
            if self.strategy.broadcasts:  # hold what participants hold (fp16 rounds it)
                sent = as_sent(broadcast, self.config.learning.fp16)
                self.server = self.strategy.receive(self.server, sent)
            else:
                self.server = aggregate.server
        if self.strategy.broadcasts:
            data = self._global_message(round_, broadcast, sorted(uploads))
            with self._changed:
                self._globals[round_] = data
            self._publish(
                round_,
                topics.global_model(self.fleet, round_),
                data,
                values_sent(broadcast.weights, broadcast.masks),
            )
        with self._changed:
            record.traffic.received += self._received.pop(round_, 0)
            for store in (self._updates, self._divergences, self._asks, self._answered):
                for key in [k for k in store if k[0] < round_]:
                    del store[key]
            for r in [r for r in self._globals if r <= round_ - KEEP_GLOBALS]:
                del self._globals[r]
        return True

    def run(self) -> None:
        """Every round of the run, until everyone stopped early or `stop` is set (handlers
        keep re-sending kept broadcasts on request while the transport is up). An error is
        logged and kept in `error`: the caller ends the run with it."""
        try:
            for round_ in range(1, self.config.learning.rounds + 1):
                if self.stop.is_set() or not self.run_round(round_):
                    break
                participants = len(self.records[-1].participants)
                log.info("round %d aggregated from %d participants", round_, participants)
        except Exception as exc:
            log.exception("aggregation failed")
            self.error = exc
