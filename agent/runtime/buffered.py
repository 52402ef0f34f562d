"""A participant's updates in a buffered asynchronous strategy (FedBuff), over MQTT.

The participant never waits for anyone: each update trains from the newest global version it
holds, uploads the trained model tagged with that version (`Update.base_version`; its `round`
is the version it hopes to go into, base + 1), and starts the next one at once. The aggregator
(`coordinator.buffered`) publishes each new version retained on one topic
(`round/latest/global`), so a device that slept or reconnected gets the newest at once, and
none in between. Version 0 is the run's initial model, which every agent derives itself.

An agent's round record is one update: its training, the newest version's accuracy on its
data once the update is out, and its `staleness`, the versions the global model moved on
while it trained (the newest it then holds minus its base: what the aggregator takes the
update with, unless a version came out between the upload and its arrival). The run ends
when the newest version is the last (`--rounds`): the agent judges that one on its data as
its closing record (round `--rounds`, "done") and stops; an update still in training then
is dropped. Each update's number seeds its local training, as in `simulate`.

Under `--secure-aggregation` an update goes masked into a cohort instead
(`agent.runtime.secure_cohorts`): its record's round is the cohort's version, its
`staleness` what the cohort weighted it with, and the next update trains from that version.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from agent.learning import Payload, ServerState, central_strategy
from agent.learning.central.participant import Turn, judge
from agent.report import AgentRound, reported_p_k, reported_sparsity
from agent.runtime import codec
from agent.runtime.centralized import GLOBAL_PATIENCE_ROUNDS, run_aggregator
from agent.runtime.codec import encode_state, values_sent
from agent.runtime.secure_cohorts import SecureCohorts
from agent.runtime.session import Session
from agent.workload import compute_slot
from protocol import ProtocolError, messages, topics

log = logging.getLogger(__name__)

LATEST = "latest"
"""The round level of the topic every new version is published on, retained."""


class BufferedRounds:
    """One participant's updates of a FedBuff run, and the newest global version it holds."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.votes: dict[int, bool] = {}
        """Always empty: FedBuff does not vote."""
        self.aggregator = run_aggregator(session)
        self.strategy = central_strategy(session.cfg.strategy)
        self.version = 0
        self.view = self.strategy.init_server(session.learner.facts)
        """The newest global version this agent decoded, and its model."""
        self.updates = 0
        """Updates this agent trained (each one's number seeds its training)."""
        self._arrived: tuple[int, bytes] | None = None
        self._lock = threading.Lock()
        self._came = threading.Condition()
        """Notified when a newer version than any held comes."""
        self._closed = False
        self._since: float | None = None
        """When the newest version held came (monotonic; None before the first update)."""
        self.cohorts: SecureCohorts | None = None
        """`--secure-aggregation`: this agent's masked updates, each in a cohort."""
        if session.cfg.secure_aggregation:
            patience = GLOBAL_PATIENCE_ROUNDS * session.timeouts.round_s
            self.cohorts = SecureCohorts(
                session, self.aggregator, patience, self.newest, self._came
            )

    # ------------------------------------------------------------------ wiring

    def subscribe(self) -> None:
        s = self.session
        s.transport.subscribe(topics.global_model(s.fleet, LATEST), self.on_global)
        if self.cohorts is not None:
            self.cohorts.subscribe()

    def on_global(self, topic: str, payload: bytes) -> None:
        """Keep a version newer than any held (decoded when an update starts)."""
        s = self.session
        try:
            message = messages.decode(payload, key=s.key)
        except ProtocolError as exc:
            log.warning("rejected a global version: %s", exc)
            return
        if (
            not isinstance(message, messages.Global)
            or message.fleet != s.fleet
            or message.sender != self.aggregator
            or message.run_id != s.run_info.run_id
        ):
            return
        with self._lock:
            held = self._arrived[0] if self._arrived else self.version
            if message.round > held:
                self._arrived = (message.round, message.tensors)
        with self._came:
            self._came.notify_all()

    def prepare_start(self) -> None:
        """Nothing: the subscription covers every version."""

    def republish(self) -> None:
        """Nothing to re-send: the aggregator asks for nothing again."""

    def resumed(self, done: int) -> None:
        """Nothing held on the broker to repair."""

    def close(self) -> None:
        """Nothing served."""

    def checkpoint(self, round_: int) -> dict[str, Any]:
        view = self.view
        kept = {"weights": view.weights, "m": view.m, "v": view.v}
        return {"view": kept, "version": self.version, "updates": self.updates}

    def restore(self, saved: dict[str, Any]) -> None:
        view = saved["view"]
        self.view = ServerState(view["weights"], view["m"], view["v"])
        self.version, self.updates = saved["version"], saved["updates"]

    # ------------------------------------------------------------------ updates

    def newest(self) -> int:
        """The newest version held, decoded into the view if it just arrived."""
        with self._lock:
            arrived, self._arrived = self._arrived, None
        if arrived is not None and arrived[0] > self.version:
            s = self.session
            try:
                payload = codec.decode_broadcast(self.strategy, s.learner.facts, arrived[1])
            except ProtocolError as exc:
                log.warning("rejected global version %d: %s", arrived[0], exc)
                return self.version
            self.view = self.strategy.receive(self.view, payload)
            self.version, self._since = arrived[0], time.monotonic()
        return self.version

    def round_numbers(self, done: int) -> Iterator[int]:
        """The session's loop: another update while the last version is not out, then the
        closing record (`--rounds`)."""
        update = done
        while not self._closed:
            update += 1
            yield update

    def final(self, record: AgentRound) -> bool:
        """Whether `record` is this agent's last of the run: its closing one."""
        return self._closed

    def run_round(self, round_: int) -> AgentRound:
        """One update from the newest version held; the closing record once it is the last,
        or once no new version came for `GLOBAL_PATIENCE_ROUNDS` round timeouts (the
        coordinator is gone: the run cannot go on)."""
        s = self.session
        if self._since is None:
            self._since = time.monotonic()
        if self.newest() >= s.cfg.rounds:
            return self._closing()
        patience = GLOBAL_PATIENCE_ROUNDS * s.timeouts.round_s
        if time.monotonic() - self._since > patience:
            log.warning(
                "no new version from %s for %.0f s: ending with version %d",
                self.aggregator,
                patience,
                self.version,
            )
            return self._closing()
        base, view = self.version, self.view
        self.updates += 1
        turn = Turn.of(s.me, self.updates, s.roster, None)
        with compute_slot():
            started = time.monotonic()
            fit = turn.train(self.strategy, s.learner, s.state, s.data, view)
        throttled = s.after_compute(started, fit.train_flops + fit.fallback_flops)
        if self.cohorts is not None:
            joined = self.cohorts.upload(self.strategy, base, view, fit.upload)
            sent, into, staleness = joined.sent, joined.cohort, joined.staleness
        else:
            sent = self._send(base, fit.upload, fit.num_samples)
            into, staleness = base + 1, self.newest() - base
        state, judged = judge(self.strategy, s.learner, fit, self.view, s.data)
        s.state = dataclasses.replace(state, round=into)
        record = AgentRound.of_fit(
            turn,
            fit,
            judged,
            s.learner.traits.budgets,
            nonzeros_sent=sent,
            throttled_s=round(throttled, 3),
            staleness=staleness,
        )
        return dataclasses.replace(record, round=into)

    def _send(self, base: int, upload: Payload, num_samples: int) -> int:
        """Upload the trained model (FedBuff-SSM: its sparse deltas) tagged with its base
        version; the values it carried."""
        s = self.session
        body = encode_state(upload.weights, upload.masks, fp16=s.cfg.fp16)
        update = messages.Update(
            **s.header(base + 1), tensors=body, num_samples=num_samples, base_version=base
        )
        s.send(s.topic(base + 1, "update", s.me), messages.encode(update, key=s.key))
        return values_sent(upload.weights, upload.masks)

    def _closing(self) -> AgentRound:
        """The run is over: this agent's closing record, the newest version on its data."""
        s = self.session
        self._closed = True
        rounds = s.cfg.rounds
        facts = s.learner.facts  # judged as `judge` judges the global model: own statistics
        weights = facts.fresh_statistics(
            facts.own_statistics(self.view.weights, s.state.weights), s.data
        )
        loss, accuracy = facts.evaluate_on(weights, s.data)
        s.state = dataclasses.replace(s.state, round=rounds)
        log.info("version %d is the newest: done after %d updates", self.version, self.updates)
        return AgentRound(
            round=rounds,
            agent=s.me,
            loss=loss,
            accuracy=accuracy,
            train_loss=None,
            sparsity=reported_sparsity(s.state.masks),
            p_k=reported_p_k(None, s.learner.traits.budgets),
            staleness=0.0,
        )
