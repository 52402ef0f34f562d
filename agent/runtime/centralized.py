"""A participant's rounds in a centralized strategy, over MQTT with the coordinator.

The math is `agent.central`'s strategy, the very objects the simulator calls; this module
only moves their payloads. Round t of agent k:

    FedSPU family   ask the aggregator for its part (`Request` with fraction = p_k), wait
                    for it on round/t/global/k
    all             fit; publish the `Update` (FedLDF: only the `Divergence` vector)
    FedLDF          answer the aggregator's `Request` for layers with an `Update` of them
    broadcasting    wait for round/t/global, apply it to the view of the server state

A message that does not come is asked for again every `request_every_s`. If it never comes
(the coordinator is down or the agent fell behind) the agent names the coordinator as its
straggler after three round timeouts: without its part of the global model a FedSPU-family
agent skips the round's training, and without a broadcast any agent keeps the view it holds.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from agent.device.budget import Budget
from agent.learning.central import Fit, Payload, ServerState, central_strategy, static_tier
from agent.runtime import codec
from agent.runtime.codec import divergence_message, encode_state, values_sent
from agent.runtime.decentralized import AgentRuntime
from protocol import messages, topics
from protocol.errors import ProtocolError

log = logging.getLogger(__name__)

GLOBAL_PATIENCE_ROUNDS = 3.0
"""How many round timeouts to wait for a round's global model before going on without it."""


class CentralRuntime(AgentRuntime):
    """Runs one participant's rounds of a centralized strategy."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if self.run_info.aggregator is None:
            raise ValueError(f"{self.cfg.strategy} is centralized: the run needs an aggregator")
        self.aggregator = self.run_info.aggregator
        self.strategy = central_strategy(self.cfg.strategy)
        self.view = self.strategy.init_server(self.learner)
        """This agent's copy of the server state: the last broadcast applied."""
        self.values_sent = 0
        """Values this round's uploads carried."""

    # ------------------------------------------------------------------ wiring

    def _subscribe_common(self) -> None:
        inbox = self.inbox
        self.transport.subscribe(topics.status(self.fleet), inbox.on_status)
        self.transport.subscribe(topics.presence(self.fleet), inbox.on_presence)
        self.transport.subscribe(topics.global_model(self.fleet, "+"), inbox.on_global)
        self.transport.subscribe(topics.global_model(self.fleet, "+", self.me), inbox.on_global)
        self.transport.subscribe(
            topics.round_topic(self.fleet, "+", "request", self.aggregator, to=self.me),
            inbox.on_aggregator_request,
        )

    def _subscribe_ahead(self, round_: int) -> None:
        """Nothing per round: the subscriptions above cover every round."""

    def _held(self, round_: int) -> dict[str, dict[str, Any]]:
        return {}

    def _checkpoint_extra(self) -> dict[str, Any]:
        return {"view": {"weights": self.view.weights, "m": self.view.m, "v": self.view.v}}

    def _restore_extra(self, saved: dict[str, Any]) -> None:
        view = saved["view"]
        self.view = ServerState(view["weights"], view["m"], view["v"])

    # ------------------------------------------------------------------ messages

    def _ask(self, round_: int, fraction: float = 0.0) -> None:
        """Ask the aggregator for this round's part (fraction > 0) or its broadcast again."""
        request = messages.Request(
            **self._header(round_), target=self.aggregator, fraction=fraction
        )
        self.transport.publish(
            self._topic(round_, "request", self.me, to=self.aggregator),
            messages.encode(request, key=self.key),
        )

    def _send(self, round_: int, payload: Payload, num_samples: int) -> None:
        """Upload `payload` (counting its values in `values_sent`)."""
        self.values_sent += values_sent(payload.weights, payload.masks)
        body = encode_state(payload.weights, payload.masks, fp16=self.cfg.fp16)
        update = messages.Update(**self._header(round_), tensors=body, num_samples=num_samples)
        data = messages.encode(update, key=self.key)
        if self.throttle is not None:
            self.throttle.before_send(len(data))
        self.transport.publish(self._topic(round_, "update", self.me), data)

    def _receive(
        self, round_: int, addressed: bool, p_k: float, fit: Fit | None = None
    ) -> Payload | None:
        """Wait for the round's broadcast (or this agent's part); None if it never came.

        Meanwhile answer the aggregator's layer request of this round (FedLDF) from `fit`."""
        deadline = time.monotonic() + GLOBAL_PATIENCE_ROUNDS * self.timeouts.round_s
        answered = fit is None
        while not self.stop.is_set():
            if not answered and (request := self.inbox.layer_request(round_, self.me)):
                answered = True
                assert fit is not None
                payload = self.strategy.respond(self.learner, fit, list(request.layers))
                self._send(round_, payload, fit.num_samples)
            wait = min(self.timeouts.request_every_s, deadline - time.monotonic())
            if wait <= 0:
                break
            woken_by = None if answered else (round_, self.me)
            found = self.inbox.wait_global(round_, addressed, wait, request=woken_by)
            if found is not None and not found.participants and not addressed:
                return Payload({})  # nobody delivered this round: nothing changes
            if found is not None:
                decode = codec.decode_download if addressed else codec.decode_broadcast
                try:
                    return decode(self.strategy, self.learner, found.tensors)
                except ProtocolError as exc:
                    self.inbox.rejected += 1
                    log.warning("rejected the round %d global model: %s", round_, exc)
                    return None
            if answered or self.inbox.layer_request(round_, self.me) is None:
                self._ask(round_, p_k if addressed else 0.0)
        log.warning("round %d: no global model from %s; going on", round_, self.aggregator)
        return None

    # ------------------------------------------------------------------ round

    def run_round(self, round_: int) -> dict[str, Any]:
        started = time.monotonic()
        self.values_sent = 0
        budget = self.budget()
        p_k = budget.p_k if budget else static_tier(self.roster, self.me)
        stragglers: list[str] = []
        view = self.view
        if self.strategy.downloads:
            self._ask(round_, p_k)
            part = self._receive(round_, True, p_k)
            if part is None:
                return self._missed_round(round_, p_k, budget)
            view = ServerState(part.weights)
        waited = time.monotonic() - started
        computing = time.monotonic()
        fit = self.strategy.fit(self.learner, self.state, self.data, view, round_, p_k)
        throttled = 0.0
        if self.throttle is not None:
            throttled = self.throttle.after_compute(time.monotonic() - computing, fit.train_flops)
        self.state = fit.state
        if fit.upload.weights:
            self._send(round_, fit.upload, fit.num_samples)
        if fit.divergence is not None:
            self.transport.publish(
                self._topic(round_, "divergence", self.me),
                divergence_message(
                    **self._header_fields(round_), divergence=fit.divergence, key=self.key
                ),
            )
        if self.strategy.broadcasts:
            broadcast = self._receive(
                round_, False, p_k, fit if self.strategy.asks_layers else None
            )
            if broadcast is None:
                stragglers.append(self.aggregator)
            else:
                self.view = self.strategy.receive(self.view, broadcast)
        evaluated = fit.state.weights if self.strategy.personal else self.view.weights
        loss, accuracy = self.learner.evaluate_on(evaluated, self.data)
        stops = self._stops_after(fit)
        return self._finish_round(
            round_,
            self._record(
                round_,
                p_k,
                budget,
                accuracy=accuracy,
                loss=loss,
                train_loss=fit.train_loss,
                nonzeros_sent=self.values_sent,
                train_flops=fit.train_flops,
                throttled_s=round(throttled, 3),
                stragglers=sorted(set(stragglers)),
                wait_s=round(waited, 3),
                stopped=stops,
            ),
        )

    def _record(
        self, round_: int, p_k: float, budget: Budget | None, **figures: Any
    ) -> dict[str, Any]:
        """A round's record in the decentralized runtime's schema (no masks, votes or t*)."""
        return {
            "round": round_,
            "agent": self.me,
            "sparsity": 0.0,
            "p_k": p_k,
            "limited_by": budget.limited_by if budget else "none",
            "density_cap": None,
            "active_fraction": None,
            "vote": None,
            "score": None,
            "pruned": False,
            "t_star": None,
            **figures,
        }

    def _missed_round(self, round_: int, p_k: float, budget: Budget | None) -> dict[str, Any]:
        """A round without this agent's part of the global model: nothing to train from, so
        it trains nothing and keeps its model (training on a stale view would overwrite its
        active part with old global values)."""
        loss, accuracy = self.learner.evaluate_on(self.state.weights, self.data)
        self.state = dataclasses.replace(self.state, round=round_)
        return self._finish_round(
            round_,
            self._record(
                round_,
                p_k,
                budget,
                accuracy=accuracy,
                loss=loss,
                train_loss=None,
                nonzeros_sent=0,
                train_flops=0,
                throttled_s=0.0,
                stragglers=[self.aggregator],
                wait_s=0.0,
                stopped=False,
            ),
        )

    def _stops_after(self, fit: Fit) -> bool:
        if not self.cfg.early_stop:
            return False
        loss = self.learner.stopping_loss(fit.state.weights, fit.train_loss, self.data)
        self.stop_watch, stops = self.stop_watch.after(loss, self.cfg.stop_patience)
        return stops
