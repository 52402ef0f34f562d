"""`--wire layers`: a divergence vector announces each round model; receivers pick per layer
the `ldf_n` most diverged neighbours (`ldf.select_layers`, as FedLDF's aggregator does) and
fetch only those layers, which the sender's `LayerServer` publishes once for all askers.

The sender keeps its recent models (`kept`) to serve their layers, and clears the layers the
broker retains once nobody can ask for them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from agent.learning import Learner, Need, Published, RoundResult, layers_to_fetch
from agent.runtime import checkpoint
from agent.runtime.asking import Asking
from agent.runtime.codec import divergence_message, model_message, values_sent
from agent.runtime.layer_server import LayerServer
from agent.runtime.session import Session
from agent.runtime.wire import Fetcher, Gathered, announced_topics
from protocol import fits_one_frame, messages, topics

log = logging.getLogger(__name__)

LAYER_BATCH_S = 0.2
"""How long a sender collects requests before publishing the layers asked for, so that
neighbours asking at about the same time share one publish."""

LayerKey = tuple[int, str, str]
"""(round, sender, layer)."""


class LayersWire:
    """Divergence vectors out, chosen layers fetched on request."""

    announcement = "divergence"

    def __init__(self, session: Session) -> None:
        self.session = session
        self.on_announcement = session.inbox.on_divergence
        self.layers = list(session.learner.facts.layer_groups)
        self.kept: dict[int, Published] = {}
        """Our recent models, whose layers neighbours ask for."""
        self.server = LayerServer(self._publish_layers, LAYER_BATCH_S)
        self.connects_seen = 0
        """The transport's connection count when the layer server last heard of it."""

    @staticmethod
    def expects(learner: Learner, agent_id: str) -> dict[str, Any]:
        """The model's layers, for the inbox to check divergence vectors and layers."""
        return {"layer_groups": learner.facts.layer_groups}

    def wanted(self, round_: int, ahead: Callable[[int], set[Need]]) -> set[str]:
        return announced_topics(self.session, self.announcement, ahead(round_))

    def encode(self, round_: int, result: RoundResult) -> tuple[bytes, bytes, Published]:
        """The divergence vector, once for all receivers; the layers go out on request."""
        assert result.divergence is not None
        data = divergence_message(
            **self.session.header_fields(round_),
            divergence=result.divergence,
            key=self.session.key,
        )
        self.kept[round_] = result.published
        return data, data, Published({}, None, 0)

    # ------------------------------------------------------------------ serving

    def serve(self, request: messages.Request) -> bool:
        """Hand a request for layers of one of our recent models to the layer server."""
        if not request.layers:
            return False
        known = [layer for layer in request.layers if layer in self.layers]
        if request.round in self.kept and known:
            connects = self.session.transport.connects
            if connects != self.connects_seen:
                self.connects_seen = connects
                self.server.reconnected()
            self.server.ask(request.round, known, request.sender)
        return True

    def _publish_layers(self, round_: int, layers: set[str]) -> Iterator[tuple[str, int, bool]]:
        """Publish these layers of our round model, each on its own topic, once for every
        neighbour that asked (the `LayerServer`'s publisher), retained when they fit one
        frame; yields each layer after its publish, with the values it carried."""
        model = self.kept.get(round_)
        if model is None:
            return
        session = self.session
        for layer in (layer for layer in self.layers if layer in layers):
            part = session.learner.layer_part(model, [layer])
            data = model_message(
                **session.model_fields(round_, model.num_samples),
                weights=part.weights,
                masks=part.masks,
            )
            retain = fits_one_frame(len(data), session.transport.options.chunk_size)
            session.send(self.topic((round_, session.me), layer), data, retain=retain)
            yield layer, values_sent(part.weights, part.masks), retain

    def topic(self, source: tuple[int, str], layer: str) -> str:
        return topics.layer(self.session.fleet, source[0], source[1], self.layers.index(layer))

    def _clear(self, round_: int, layers: set[str]) -> None:
        """Delete our retained layers of `round_` from the broker: nobody asks for them now."""
        for layer in sorted(layers):
            self.session.transport.clear_retained(self.topic((round_, self.session.me), layer))

    def forget(self, round_: int) -> None:
        self.kept.pop(round_, None)
        self._clear(round_, self.server.forget(round_))

    def take_served(self) -> int:
        return self.server.take_served()

    # ------------------------------------------------------------------ gathering

    def gather(self, round_: int, needs: set[Need], deadline: float, fetch: Fetcher) -> Gathered:
        """Wait for the neighbours' divergence vectors, pick the layers, fetch them. Round-0
        models are derivable and taken whole; a neighbour counts for the layers that came
        (none if it sent nothing)."""
        inbox = self.session.inbox
        models = {j: self.session.round0_model(j) for r, j in needs if r == 0}
        announced = {need for need in needs if need[0] >= 1}
        awaited = fetch.await_needs(
            round_, announced, deadline, inbox.divergence, inbox.wait_divergences
        )
        divergences = {
            j: vector for r, j in awaited if (vector := inbox.divergence(r, j)) is not None
        }
        chosen = layers_to_fetch(divergences, self.session.cfg.ldf_n)
        need_of = {j: (r, j) for r, j in awaited}
        wanted = {
            (*need_of[j], layer): self.topic(need_of[j], layer)
            for j, layers in chosen.items()
            for layer in layers
        }
        fetch_now = {k: t for k, t in wanted.items() if not inbox.layers_of(*k[:2], [k[2]])}
        # Layers take a second trip: a vector that came late still gets its layers' time.
        deadline = max(deadline, time.monotonic() + self.session.timeouts.request_every_s)
        missing = self._fetch_layers(fetch_now, deadline, fetch)
        stragglers = sorted(
            {j for r, j in awaited if inbox.divergence(r, j) is None} | {key[1] for key in missing}
        )
        gone = inbox.gone()
        for j in stragglers:
            why = "is offline" if j in gone else "did not deliver in time"
            log.warning("round %d: %s %s", round_, j, why)
        for j, layers in chosen.items():
            part = inbox.layers_of(*need_of[j], layers)
            if part is not None:
                models[j] = part
        return models, stragglers

    def _fetch_layers(
        self, fetch_now: dict[LayerKey, str], deadline: float, fetch: Fetcher
    ) -> set[LayerKey]:
        """Subscribe to the layers' topics, ask their senders for them (and again when
        `Asking` says so, or at once when a sender announced again: it is back from a
        restart, and lost what was asked of it while it was gone) until they came, their
        senders are gone or the deadline; returns the missing."""
        session, inbox = self.session, self.session.inbox
        missing = set(fetch_now)
        try:
            for topic in sorted(set(fetch_now.values())):
                session.transport.subscribe(topic, inbox.on_layer)
            if fetch_now:
                session.transport.wait_subscribed(max(deadline - time.monotonic(), 0.0))
            check_every_s = session.timeouts.request_every_s
            # Layers are asked for once; again only after a reconnect, when their sender
            # announced again (`back`), or as a last resort.
            asking = Asking(session.transport, check_every_s, lambda _round, _sender: False)
            ask = {key[:2] for key in missing}
            again = {j: inbox.announced_again(j) for _, j in ask}

            def back() -> set[str]:
                return {j for j, seen in again.items() if inbox.announced_again(j) > seen}

            while missing and not session.stop.is_set():
                for r, j in sorted(ask):
                    asked = [key[2] for key in sorted(missing) if key[:2] == (r, j)]
                    fetch.request({(r, j)}, asked)
                pause = asking.pause(check_every_s, deadline)
                missing = inbox.wait_layers(missing, pause, until=lambda: bool(back()))
                if time.monotonic() >= deadline:
                    break
                returned = back()
                again |= {j: inbox.announced_again(j) for j in returned}
                waiting = {key[:2] for key in missing}
                ask = asking.to_ask(waiting) | {need for need in waiting if need[1] in returned}
        finally:
            for topic in sorted(set(fetch_now.values())):
                session.transport.unsubscribe(topic)
        return {key for key in fetch_now if session.inbox.layers_of(*key[:2], [key[2]]) is None}

    # ------------------------------------------------------------------ persistence

    def checkpoint(self) -> dict[str, Any]:
        return {"kept": {r: checkpoint.saved_model(p) for r, p in self.kept.items()}}

    def restore(self, saved: dict[str, Any]) -> None:
        self.kept = {int(r): checkpoint.restored_model(p) for r, p in saved.get("kept", {}).items()}

    def resumed(self, done: int) -> None:
        """Layers served before the crash: the restored rounds' are the same models (clear
        them with their round); the redone round's may differ, so they go now."""
        for round_ in self.kept:
            self.server.may_retain(round_, self.layers)
        self._clear(done + 1, set(self.layers))

    def close(self) -> None:
        """Take no more requests and clear the layers the broker may still retain."""
        for round_, layers in self.server.close().items():
            try:
                self._clear(round_, layers)
            except RuntimeError:  # the transport stopped (a signal): the broker keeps them
                break
