"""The coordinator's side of a buffered asynchronous strategy (FedBuff) over MQTT.

Nothing here waits for a participant: every `Update` that arrives (tagged with the version
it was trained from, `Update.base_version`) is offered to the server's buffer in the order
MQTT delivered it (`fedbuff.Buffer`: the rule, which the simulator feeds in virtual-time
order); each time the buffer fills, the new version is published retained on
`round/latest/global` (`agent.runtime.buffered`), so an agent that slept or reconnected gets
the newest at once. The run ends when `--rounds` versions are out; a device asleep or gone
for good holds nobody back, and its late update is taken with its staleness (or dropped past
`--max-staleness`).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agent.experiment import ExperimentConfig
from agent.learning import CentralStrategy, Learner, ServerState, Upload
from agent.learning.central.fedbuff import Buffer, Offer, as_buffered
from agent.report import Traffic
from agent.runtime import decode_upload, encode_state, values_sent
from agent.runtime.buffered import LATEST
from protocol import ProtocolError, Transport, messages, topics
from protocol.limits import DEFAULT_LIMITS
from protocol.logs import RejectionLog, claimed_sender
from protocol.signing import Signer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Run:
    """What the buffered server needs of the coordinator's run (`Aggregator`'s)."""

    fleet: str
    run_id: str
    roster: list[str]
    config: ExperimentConfig
    learner: Learner
    strategy: CentralStrategy
    transport: Transport
    key: Signer | None
    stop: threading.Event
    header: Callable[[int], dict[str, Any]]


Applied = Callable[[int, list[str], Traffic, ServerState], None]
"""Told of each version published: its number, who it took, its traffic, the new state."""


class BufferedServer:
    """Takes one FedBuff run's updates as they come and publishes its versions (`run`)."""

    def __init__(self, run: Run, server: ServerState) -> None:
        self.aggregator = run
        self.strategy = as_buffered(run.strategy)
        self.buffer = Buffer.of(
            run.learner.facts, server, len(run.roster), self.strategy.update_delta
        )
        self.arrived: deque[messages.Update] = deque()
        self.seen: set[tuple[str, int, int]] = set()
        """(sender, round, base) of every update taken off the wire: MQTT may deliver one
        twice."""
        self.changed = threading.Condition()
        self.received = 0
        self.stalenesses: list[tuple[str, int, bool]] = []
        """(sender, staleness, taken) of every update offered, in order (the log's figures)."""
        self._rejections = RejectionLog(log)

    def subscribe(self, transport: Transport) -> None:
        fleet = self.aggregator.fleet
        transport.subscribe(topics.round_topic(fleet, "+", "update"), self.on_update)

    def on_update(self, topic: str, payload: bytes) -> None:
        """Validate and queue an update of this run from a roster agent."""
        agg = self.aggregator
        try:
            message = messages.decode_on_topic(topic, payload, "update", agg.fleet, agg.key)
        except ProtocolError as exc:
            self._rejections.reject("update", claimed_sender(topic), topic, exc)
            return
        if (
            not isinstance(message, messages.Update)
            or message.run_id != agg.run_id
            or message.sender not in agg.roster
        ):
            return
        problem = DEFAULT_LIMITS.samples_problem(message.num_samples)
        if problem is None and message.base_version < 0:
            problem = "no base version"
        if problem is not None:
            self._rejections.reject("update", message.sender, topic, problem)
            return
        key = (message.sender, message.round, message.base_version)
        with self.changed:
            self.received += len(payload)
            if key not in self.seen:
                self.seen.add(key)
                self.arrived.append(message)
                self.changed.notify_all()

    def _next(self) -> messages.Update | None:
        """The next update in arrival order, waiting for one (None once stopped)."""
        with self.changed:
            while not self.arrived:
                if self.aggregator.stop.is_set():
                    return None
                self.changed.wait(0.2)
            return self.arrived.popleft()

    def offer(self, update: messages.Update) -> Offer | None:
        """Decode `update` and offer it to the buffer (None: it did not decode)."""
        agg = self.aggregator
        try:
            payload = decode_upload(agg.strategy, agg.learner.facts, update.tensors)
        except (ProtocolError, ValueError) as exc:
            log.warning("rejected the update of %s: %s", update.sender, exc)
            return None
        offer = self.buffer.offer(
            update.sender, Upload(payload, update.num_samples), update.base_version
        )
        self.stalenesses.append((update.sender, offer.staleness, offer.taken))
        if not offer.taken:
            log.info(
                "dropped the update of %s: %d versions stale (--max-staleness %d)",
                update.sender,
                offer.staleness,
                self.buffer.max_staleness,
            )
        return offer

    def publish(self, version: int, applied: Applied) -> None:
        """Publish `version` retained; tell `applied` who it took (and log how stale)."""
        agg = self.aggregator
        weights = self.strategy.version_payload(self.buffer.server).weights
        took = self.buffer.applied[-1]
        body = encode_state(weights, None, fp16=agg.config.learning.fp16)
        message = messages.Global(
            **agg.header(version), tensors=body, participants=[k for k, _ in took]
        )
        data = messages.encode(message, key=agg.key)
        agg.transport.publish(topics.global_model(agg.fleet, LATEST), data, retain=True)
        with self.changed:
            received, self.received = self.received, 0
        traffic = Traffic(sent=len(data), received=received)
        traffic.nonzeros_sent = values_sent(weights, None)
        applied(version, sorted({k for k, _ in took}), traffic, self.buffer.server)
        stale = ", ".join(f"{k} ({s} stale)" for k, s in took)
        log.info("version %d applied from %s", version, stale)

    def run(self, applied: Applied) -> None:
        """Offer every update as it arrives until `--rounds` versions are out (or stop)."""
        rounds = self.aggregator.config.learning.rounds
        while self.buffer.version < rounds:
            update = self._next()
            if update is None:
                return
            offer = self.offer(update)
            if offer is not None and offer.version is not None:
                self.publish(offer.version, applied)
