"""A participant's rounds in a centralized strategy, over MQTT with the coordinator.

The math is `agent.learning.central`'s strategy and a participant's steps of a round in their
order (`agent.learning.central.participant`: its p_k, the fit checked and settled, the model it
keeps; an attacker's upload is `agent.learning.rounds`'), which the simulator calls too; this
module only moves their payloads. Round t of agent k:

    FedSPU family   ask the aggregator for its part (`Request` with fraction = p_k), wait
                    for it on round/t/global/k
    all             fit; publish the `Update` (FedLDF: only the `Divergence` vector, which
                    goes first under secure aggregation too)
    FedLDF          answer the aggregator's `Request` for layers with an `Update` of them
    broadcasting    wait for round/t/global, apply it to the view of the server state
    secure          (`--secure-aggregation`) its keys at the round's start, and in place of the
                    `Update` its masked vector over the round's index set and the steps
                    around it (`agent.runtime.secure_rounds`, `agent.runtime.secure_vector`;
                    FedLDF's layers go in it, not in an answer to the request)

A message that does not come is asked for again every `request_every_s`; when the
aggregator was born again since this round's uploads went out (`coordinator run` restarted
and resumed the run), or this agent's connection was made again (a broker that restarted
may have acknowledged them and died before passing them on), they are sent again first (the
aggregator keeps the first copy of each). If it never comes
(the coordinator is down or the agent fell behind) the agent names the coordinator as its
straggler after three round timeouts: without its part of the global model a FedSPU-family
agent skips the round's training, and without a broadcast any agent keeps the view it holds.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from agent.device import Budget
from agent.experiment import attackers
from agent.learning import Fit, Payload, ServerState, Upload, attacked_upload, central_strategy
from agent.learning.central import secure_dp
from agent.learning.central.participant import Turn, judge
from agent.report import AgentRound, reported_p_k, reported_sparsity
from agent.runtime import codec
from agent.runtime.codec import divergence_message, encode_state, values_sent
from agent.runtime.secure_rounds import SecureSteps
from agent.runtime.secure_vector import SecureVector
from agent.runtime.session import Session
from agent.workload import compute_slot
from protocol import ProtocolError, messages, topics

log = logging.getLogger(__name__)

GLOBAL_PATIENCE_ROUNDS = 3.0
"""How many round timeouts to wait for a round's global model before going on without it."""


def run_aggregator(session: Session) -> str:
    """The aggregator a centralized run names; ValueError if the run names none."""
    if session.run_info.aggregator is None:
        raise ValueError(f"{session.cfg.strategy} is centralized: the run needs an aggregator")
    return session.run_info.aggregator


class CentralizedRounds:
    """One participant's rounds of a centralized strategy, and its view of the server state.

    A participant does not vote, keeps no peers' models and publishes nothing to re-send:
    its checkpoint adds only the view."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.votes: dict[int, bool] = {}
        """Always empty: a centralized strategy does not vote."""
        self.aggregator = run_aggregator(session)
        self.strategy = central_strategy(session.cfg.strategy)
        self.view = self.strategy.init_server(session.learner.facts)
        """This agent's copy of the server state: the last broadcast applied."""
        self.values_sent = 0
        """Values this round's uploads carried."""
        self.attacker = session.me in attackers(session.config, session.roster)
        """Research (`--attackers`): this agent uploads poisoned models."""
        self._uploads: list[tuple[str, bytes]] = []
        """What the latest uploading round sent the aggregator, to send again if lost."""
        self._uploads_round = 0
        """The round `_uploads` belong to: kept into the next round until its first upload,
        since a FedSPU-family agent goes on without a broadcast and an aggregator that
        restarts then still lacks them."""
        self._uploaded_to: tuple[float | None, int] = (None, 0)
        """The birth of the aggregator those uploads went to, and this transport's
        connection count then (`transport.connects`)."""
        self.secure: SecureSteps | None = None
        """`--secure-aggregation`: this agent's masked uploads and their steps."""
        if session.cfg.secure_aggregation:
            patience = GLOBAL_PATIENCE_ROUNDS * session.timeouts.round_s
            self.secure = SecureSteps(session, self.aggregator, patience)

    # ------------------------------------------------------------------ wiring

    def subscribe(self) -> None:
        s, inbox = self.session, self.session.inbox
        s.transport.subscribe(topics.global_model(s.fleet, "+"), inbox.on_global)
        s.transport.subscribe(topics.global_model(s.fleet, "+", s.me), inbox.on_global)
        s.transport.subscribe(
            topics.round_topic(s.fleet, "+", "request", self.aggregator, to=s.me),
            inbox.on_aggregator_request,
        )
        if self.secure is not None:
            self.secure.subscribe()

    def prepare_start(self) -> None:
        """Nothing per round: the subscriptions cover every round."""

    def republish(self) -> None:
        """Nothing to re-send: the aggregator asks for nothing again."""

    def resumed(self, done: int) -> None:
        """Nothing held on the broker to repair."""

    def close(self) -> None:
        """Nothing served."""

    def checkpoint(self, round_: int) -> dict[str, Any]:
        return {"view": {"weights": self.view.weights, "m": self.view.m, "v": self.view.v}}

    def restore(self, saved: dict[str, Any]) -> None:
        view = saved["view"]
        self.view = ServerState(view["weights"], view["m"], view["v"])

    # ------------------------------------------------------------------ messages

    def _ask(self, round_: int, fraction: float = 0.0) -> None:
        """Ask the aggregator for this round's part (fraction > 0) or its broadcast again."""
        s = self.session
        request = messages.Request(
            **s.header(round_), target=self.aggregator, fraction=fraction, since=s.born
        )
        s.transport.publish(
            s.topic(round_, "request", s.me, to=self.aggregator),
            messages.encode(request, key=s.key),
        )

    def _send(self, round_: int, upload: Upload) -> None:
        """Send `upload` (an attacker's poisoned: `attacked_upload`), counting its values in
        `values_sent`."""
        s = self.session
        if self.attacker:
            reference = self.view.weights
            upload = attacked_upload(s.learner, upload, s.config.attack, s.me, round_, reference)
        payload = upload.payload
        self.values_sent += values_sent(payload.weights, payload.masks)
        body = encode_state(payload.weights, payload.masks, fp16=s.cfg.fp16)
        update = messages.Update(**s.header(round_), tensors=body, num_samples=upload.num_samples)
        self._upload(round_, s.topic(round_, "update", s.me), messages.encode(update, key=s.key))

    def _upload(self, round_: int, topic: str, data: bytes, throttled: bool = True) -> None:
        """Send (at the emulated link's speed unless not `throttled`) and keep for a resend,
        noting to which aggregator and on which connection the round's first one went."""
        if round_ != self._uploads_round:
            s = self.session
            self._uploads, self._uploads_round = [], round_
            self._uploaded_to = (s.inbox.born(self.aggregator), s.transport.connects)
        self._uploads.append((topic, data))
        if throttled:
            self.session.send(topic, data)
        else:
            self.session.transport.publish(topic, data)

    def _upload_again_if_lost(self) -> bool:
        """Send this round's uploads again if the aggregator was born again, or this agent
        connected again, since they went out; True if they were."""
        now = (self.session.inbox.born(self.aggregator), self.session.transport.connects)
        before, self._uploaded_to = self._uploaded_to, now
        if now[0] is None or now == before or not self._uploads:
            return False
        why = "restarted" if now[0] != before[0] else "may have missed them (reconnected)"
        log.info("the aggregator %s %s: sending this round's uploads again", self.aggregator, why)
        for topic, data in self._uploads:
            self.session.send(topic, data)
        return True

    def _receive(
        self, round_: int, addressed: bool, p_k: float, fit: Fit | None = None
    ) -> Payload | None:
        """Wait for the round's broadcast (or this agent's part); None if it never came.

        Meanwhile answer the aggregator's layer request of this round (FedLDF) from `fit`."""
        s, inbox = self.session, self.session.inbox
        deadline = time.monotonic() + GLOBAL_PATIENCE_ROUNDS * s.timeouts.round_s
        answered = fit is None
        while not s.stop.is_set():
            if not answered and (request := inbox.layer_request(round_, s.me)):
                answered = True
                assert fit is not None
                payload = self.strategy.respond(s.learner.facts, fit, list(request.layers))
                self._send(round_, Upload(payload, fit.num_samples))
            wait = min(s.timeouts.request_every_s, deadline - time.monotonic())
            if wait <= 0:
                break
            woken_by = None if answered else (round_, s.me)
            found = inbox.wait_global(round_, addressed, wait, request=woken_by)
            if found is not None and not found.participants and not addressed:
                return Payload({})  # nobody delivered this round: nothing changes
            if found is not None:
                decode = codec.decode_download if addressed else codec.decode_broadcast
                try:
                    return decode(self.strategy, s.learner.facts, found.tensors)
                except ProtocolError as exc:
                    inbox.rejected += 1
                    log.warning("rejected the round %d global model: %s", round_, exc)
                    return None
            if self._upload_again_if_lost() and fit is not None:
                answered = False  # the new aggregator asks for the layers anew
            if answered or inbox.layer_request(round_, s.me) is None:
                self._ask(round_, p_k if addressed else 0.0)
        log.warning("round %d: no global model from %s; going on", round_, self.aggregator)
        return None

    # ------------------------------------------------------------------ round

    def run_round(self, round_: int) -> AgentRound:
        """Round `round_` in `central.participant`'s steps, with their messages."""
        s = self.session
        started = time.monotonic()
        self.values_sent = 0
        budget = s.budget()
        turn = Turn.of(s.me, round_, s.roster, budget.p_k if budget else None)
        part = None
        if self.strategy.downloads:
            self._ask(round_, turn.p_k)
            part = self._receive(round_, True, turn.p_k)
            if part is None:
                return self._missed_round(turn, budget)
        if self.secure is not None:  # under --dp client, weight 1 each: the unweighted mean
            weight = 1 if secure_dp.distributed(s.cfg) else len(s.data.y_train)
            self.secure.advertise(round_, weight)
        waited = time.monotonic() - started
        with compute_slot():
            compute_started = time.monotonic()
            view = turn.view(self.view, part)
            fit = turn.train(self.strategy, s.learner, s.state, s.data, view)
        throttled = s.after_compute(compute_started, fit.train_flops + fit.fallback_flops)
        stragglers = self._exchange(round_, turn.p_k, fit, view)
        s.state, judged = judge(self.strategy, s.learner, fit, self.view, s.data)
        return AgentRound.of_fit(
            turn,
            fit,
            judged,
            s.learner.traits.budgets,
            limited_by=budget.limited_by if budget else "none",
            nonzeros_sent=self.values_sent,
            throttled_s=round(throttled, 3),
            stragglers=stragglers,
            wait_s=round(waited, 3),
            stopped=s.stops_after(fit.state.weights, fit.train_loss),
        )

    def _exchange(self, round_: int, p_k: float, fit: Fit, trained_from: ServerState) -> list[str]:
        """Upload the fit (FedLDF: its divergence vector, then the layers asked for; under
        secure aggregation its masked change from the view it `trained_from`) and apply the
        round's broadcast to the view; returns the stragglers (the aggregator, if its
        broadcast never came)."""
        s = self.session
        if fit.divergence is not None:
            self._upload(
                round_,
                s.topic(round_, "divergence", s.me),
                divergence_message(**s.header_fields(round_), divergence=fit.divergence, key=s.key),
                throttled=False,
            )
        if self.secure is not None:
            vector = SecureVector(s, self.secure, self.strategy, fit, trained_from, round_)
            vector.announce()
            noised = secure_dp.distributed(s.cfg)
            self.values_sent += self.secure.upload(round_, vector, noised)
        elif fit.upload.weights:
            self._send(round_, Upload(fit.upload, fit.num_samples))
        if not self.strategy.broadcasts:
            return []
        answers = self.strategy.asks_layers and self.secure is None  # else in its masked vector
        broadcast = self._receive(round_, False, p_k, fit if answers else None)
        if broadcast is None:
            return [self.aggregator]
        self.view = self.strategy.receive(self.view, broadcast)
        return []

    def _missed_round(self, turn: Turn, budget: Budget | None) -> AgentRound:
        """A round without this agent's part of the global model: nothing to train from, so
        it trains nothing and keeps its model (training on a stale view would overwrite its
        active part with old global values). It sent, trained, waited and slept for nothing,
        and does not stop."""
        s = self.session
        loss, accuracy = s.learner.facts.evaluate_on(s.state.weights, s.data)
        s.state = dataclasses.replace(s.state, round=turn.round)
        return AgentRound(
            round=turn.round,
            agent=turn.agent,
            loss=loss,
            accuracy=accuracy,
            train_loss=None,
            sparsity=reported_sparsity(s.state.masks),
            p_k=reported_p_k(turn.p_k, s.learner.traits.budgets),
            limited_by=budget.limited_by if budget else "none",
            stragglers=[self.aggregator],
        )
