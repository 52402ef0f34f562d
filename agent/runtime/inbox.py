"""What an agent has received from its peers, and waiting for what it still needs.

Handlers run on the transport's dispatcher thread and only validate and store; the round loop
waits here with timeouts. Everything is keyed by (round, sender) and the first copy wins, so
a model delivered twice (QoS 1 redelivery, or re-sent on request) changes nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Container, Iterable
from dataclasses import dataclass
from typing import Any

from agent.learning.delta import apply_delta
from agent.learning.ldf import checked_divergences
from agent.learning.learner import Published
from agent.runtime.codec import decode_state
from protocol import messages, topics
from protocol.errors import ProtocolError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Expected:
    """What a valid message for this run looks like."""

    fleet: str
    run_id: str
    roster: frozenset[str]
    shapes: dict[str, tuple[tuple[int, ...], str]]
    key: bytes | None = None
    aggregator: str | None = None
    """The coordinator aggregating a centralized run (it sends globals and layer requests)."""
    delta_shapes: dict[str, tuple[tuple[int, ...], str]] | None = None
    """The tensors of a delta message (`--wire delta`); None: models come whole."""
    layer_groups: dict[str, list[str]] | None = None
    """`--wire layers`: the model's layers in order, each with its tensors."""


class Inbox:
    def __init__(self, expected: Expected) -> None:
        self.expected = expected
        self._models: dict[tuple[int, str], Published] = {}
        self._votes: dict[int, dict[str, bool]] = {}
        self._changed = threading.Condition()
        self.rejected = 0
        self.ready: set[str] = set()
        self.finished: set[str] = set()
        self.stopped: dict[str, int] = {}
        """Agents stopped early -> their last round; their later models will never come."""
        self.offline: set[str] = set()
        self._pending: dict[tuple[int, str], tuple[int, Published]] = {}
        """Deltas waiting for their base: (round, sender) -> (base round, zero-filled delta
        with its masks)."""
        self._globals: dict[tuple[int, bool], messages.Global] = {}
        self._asked: dict[tuple[int, str], messages.Request] = {}
        self._divergences: dict[tuple[int, str], dict[str, float]] = {}
        self._layers: dict[tuple[int, str, str], Published] = {}
        """`--wire layers`: (round, sender, layer) -> that layer of the sender's model."""

    def _decode(
        self, topic: str, payload: bytes, kind: str, check_run: bool = True
    ) -> messages.Message | None:
        try:
            fleet, topic_kind, fields = topics.parse(topic)
            message = messages.decode(payload, key=self.expected.key)
            if (
                topic_kind != kind
                or message.TYPE.value != kind
                or fleet != self.expected.fleet
                or message.fleet != fleet
                or message.sender != fields["agent"]
                or fields.get("round", str(message.round)) != str(message.round)
                or (isinstance(message, messages.Request) and fields.get("to") != message.target)
            ):
                raise ProtocolError(f"{kind} message does not match its topic")
        except ProtocolError as exc:
            self.rejected += 1
            log.warning("rejected message on %s: %s", topic, exc)
            return None
        aggregator = kind == "request" and message.sender == self.expected.aggregator
        if message.sender not in self.expected.roster and not aggregator:
            log.debug("ignored %s of %s: not in this run's roster", kind, message.sender)
            return None
        if check_run and message.run_id != self.expected.run_id:
            return None
        return message

    def on_model(self, topic: str, payload: bytes) -> None:
        """A peer's model, whole or (`base_round` >= 0) as a delta on an earlier one, which
        is applied once that base is here (`agent.delta`)."""
        message = self._decode(topic, payload, "model")
        if not isinstance(message, messages.Model):
            return
        key = (message.round, message.sender)
        with self._changed:
            if key in self._models:
                return
        is_delta = message.base_round >= 0
        shapes = self.expected.delta_shapes if is_delta else self.expected.shapes
        try:
            if shapes is None:
                raise ProtocolError("this run sends whole models, not deltas")
            if is_delta and message.base_round >= message.round:
                raise ProtocolError(f"delta of round {message.round} on a later base")
            weights, masks = decode_state(message.tensors, shapes)
        except ProtocolError as exc:
            self.rejected += 1
            log.warning("rejected model from %s: %s", message.sender, exc)
            return
        published = Published(weights, masks or None, message.num_samples)
        with self._changed:
            if key in self._models:
                return
            if is_delta:
                self._pending[key] = (message.base_round, published)
            else:
                self._models[key] = published
            self._resolve(message.sender)
            self._changed.notify_all()

    def _resolve(self, sender: str) -> None:
        """Apply `sender`'s pending deltas whose base is here (in round order). Lock held."""
        for key in sorted(k for k in self._pending if k[1] == sender):
            base_round, delta = self._pending[key]
            base = self._models.get((base_round, sender))
            if key in self._models:
                del self._pending[key]
            elif base is not None:
                del self._pending[key]
                self._models[key] = apply_delta(
                    base, delta.weights, delta.masks or {}, delta.num_samples
                )

    def on_divergence(self, topic: str, payload: bytes) -> None:
        """A neighbour's divergence vector (`--wire layers`): one value per layer, >= 0."""
        message = self._decode(topic, payload, "divergence")
        if not isinstance(message, messages.Divergence):
            return
        try:
            vector = checked_divergences(
                message.layers, message.values, self.expected.layer_groups or {}
            )
        except ValueError as exc:
            self.rejected += 1
            log.warning("rejected divergence of %s: %s", message.sender, exc)
            return
        with self._changed:
            self._divergences.setdefault((message.round, message.sender), vector)
            self._changed.notify_all()

    def on_layer(self, topic: str, payload: bytes) -> None:
        """One layer of a neighbour's model (`--wire layers`), checked against the layer's
        tensors; the layer's index is the last topic level."""
        message = self._decode(topic, payload, "model")
        if not isinstance(message, messages.Model):
            return
        groups = self.expected.layer_groups or {}
        layers = list(groups)
        try:
            if message.base_round >= 0:
                raise ProtocolError("layers travel whole, not as deltas")
            index = int(topics.parse(topic)[2].get("layer", -1))
            if not 0 <= index < len(layers):
                raise ProtocolError("not a layer of this model")
            layer = layers[index]
            shapes = {name: self.expected.shapes[name] for name in groups[layer]}
            weights, masks = decode_state(message.tensors, shapes)
        except ProtocolError as exc:
            self.rejected += 1
            log.warning("rejected layer on %s: %s", topic, exc)
            return
        with self._changed:
            key = (message.round, message.sender, layer)
            self._layers.setdefault(key, Published(weights, masks or None, message.num_samples))
            self._changed.notify_all()

    def put_announced(
        self, round_: int, sender: str, divergence: dict[str, float], layers: dict[str, Published]
    ) -> None:
        """Store a divergence vector and layers restored from a checkpoint (--wire layers)."""
        with self._changed:
            self._divergences.setdefault((round_, sender), divergence)
            for layer, part in layers.items():
                self._layers.setdefault((round_, sender, layer), part)

    def held_layers(self, round_: int, sender: str) -> dict[str, Published]:
        """The layers of `sender`'s round model that are here, by layer."""
        with self._changed:
            return {k[2]: p for k, p in self._layers.items() if k[:2] == (round_, sender)}

    def divergence(self, round_: int, sender: str) -> dict[str, float] | None:
        with self._changed:
            return self._divergences.get((round_, sender))

    def layers_of(self, round_: int, sender: str, layers: Iterable[str]) -> Published | None:
        """The layers of `sender`'s round model that are here, as one partial model."""
        with self._changed:
            parts = [p for layer in layers if (p := self._layers.get((round_, sender, layer)))]
        if not parts:
            return None
        weights = {n: t for p in parts for n, t in p.weights.items()}
        masks = {n: m for p in parts for n, m in (p.masks or {}).items()}
        return Published(weights, masks or None, parts[0].num_samples)

    def on_global(self, topic: str, payload: bytes) -> None:
        """The aggregator's broadcast of a round, or this agent's own part of it (stored
        undecoded: its tensors are checked by the strategy that knows their layout)."""
        try:
            fleet, kind, fields = topics.parse(topic)
            message = messages.decode(payload, key=self.expected.key)
            if (
                kind != "global"
                or not isinstance(message, messages.Global)
                or fleet != self.expected.fleet
                or message.fleet != fleet
                or fields["round"] != str(message.round)
            ):
                raise ProtocolError("global message does not match its topic")
        except ProtocolError as exc:
            self.rejected += 1
            log.warning("rejected message on %s: %s", topic, exc)
            return
        if message.sender != self.expected.aggregator or message.run_id != self.expected.run_id:
            return
        with self._changed:
            self._globals.setdefault((message.round, "to" in fields), message)
            self._changed.notify_all()

    def on_aggregator_request(self, topic: str, payload: bytes) -> None:
        """The aggregator asking this run's agents for layers (FedLDF)."""
        message = self.decode_request(topic, payload)
        if message is not None and message.sender == self.expected.aggregator:
            with self._changed:
                self._asked.setdefault((message.round, message.target), message)
                self._changed.notify_all()

    def wait_global(
        self,
        round_: int,
        addressed: bool,
        timeout_s: float,
        *,
        request: tuple[int, str] | None = None,
    ) -> messages.Global | None:
        """The round's broadcast (or with `addressed` this agent's part), or None after the
        timeout or, with `request` = (round, target), as soon as that layer request is here."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                found = self._globals.get((round_, addressed))
                remaining = deadline - time.monotonic()
                if found is not None or remaining <= 0 or request in self._asked:
                    return found
                self._changed.wait(min(remaining, 0.5))

    def layer_request(self, round_: int, target: str) -> messages.Request | None:
        """The aggregator's request of `round_` to `target` for layers, if it came."""
        with self._changed:
            return self._asked.get((round_, target))

    def on_vote(self, topic: str, payload: bytes) -> None:
        message = self._decode(topic, payload, "vote")
        if isinstance(message, messages.Vote):
            self.record_votes(message.sender, {message.round: message.vote})

    def decode_request(self, topic: str, payload: bytes) -> messages.Request | None:
        message = self._decode(topic, payload, "request")
        return message if isinstance(message, messages.Request) else None

    def on_status(self, topic: str, payload: bytes) -> None:
        """Retained statuses carry each agent's vote history: a restarted agent's way to
        learn the votes it missed while it was down."""
        message = self._decode(topic, payload, "status")
        if isinstance(message, messages.Status):
            with self._changed:
                self.ready.add(message.sender)
                if message.state == "done" or message.stopped:
                    self.finished.add(message.sender)
                if message.stopped:
                    self.stopped[message.sender] = message.round
                self._changed.notify_all()
            history = message.metrics.get("votes")
            if isinstance(history, str) and set(history) <= {"0", "1"}:
                self.record_votes(
                    message.sender, {r: v == "1" for r, v in enumerate(history, start=1)}
                )

    def on_presence(self, topic: str, payload: bytes) -> None:
        """Track who is offline, so nobody waits out a timeout for an agent known gone."""
        message = self._decode(topic, payload, "presence", check_run=False)
        if isinstance(message, messages.Presence):
            with self._changed:
                if message.online:
                    self.offline.discard(message.sender)
                else:
                    self.offline.add(message.sender)
                self._changed.notify_all()

    def stopped_agents(self) -> dict[str, int]:
        """A copy of who stopped early and after which round."""
        with self._changed:
            return dict(self.stopped)

    def record_votes(self, sender: str, votes: dict[int, bool]) -> None:
        with self._changed:
            for round_, vote in votes.items():
                self._votes.setdefault(round_, {}).setdefault(sender, vote)
            self._changed.notify_all()

    def put_model(self, round_: int, sender: str, published: Published) -> None:
        """Store a model restored from a checkpoint (or derived locally)."""
        with self._changed:
            self._models.setdefault((round_, sender), published)
            self._resolve(sender)

    def model(self, round_: int, sender: str) -> Published | None:
        with self._changed:
            return self._models.get((round_, sender))

    def latest(self, sender: str, up_to: int) -> tuple[int, Published] | None:
        """The newest model of `sender` from a round <= up_to, for a straggler fallback."""
        with self._changed:
            rounds = [r for (r, s) in self._models if s == sender and r <= up_to]
            if not rounds:
                return None
            newest = max(rounds)
            return newest, self._models[(newest, sender)]

    def wait_models(
        self, needed: Iterable[tuple[int, str]], timeout_s: float
    ) -> set[tuple[int, str]]:
        """Wait until every (round, sender) is here, or will never come (its sender stopped
        early before that round), or the timeout passes; returns the missing."""
        return self._wait_missing(needed, self._models, timeout_s)

    def wait_divergences(
        self, needed: Iterable[tuple[int, str]], timeout_s: float
    ) -> set[tuple[int, str]]:
        """`wait_models` for divergence vectors (`--wire layers`)."""
        return self._wait_missing(needed, self._divergences, timeout_s)

    def wait_layers(
        self, needed: Iterable[tuple[int, str, str]], timeout_s: float
    ) -> set[tuple[int, str, str]]:
        """`wait_models` for (round, sender, layer)s (`--wire layers`)."""
        return self._wait_missing(needed, self._layers, timeout_s)

    def _wait_missing(self, needed: Iterable[Any], store: Container[Any], timeout_s: float) -> Any:
        """Wait until every key (round, sender, ...) is in `store` or will never come (its
        sender stopped early before that round), or the timeout passes; returns the missing."""
        needed = set(needed)
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                missing = {
                    key
                    for key in needed
                    if key not in store and key[0] <= self.stopped.get(key[1], key[0])
                }
                remaining = deadline - time.monotonic()
                if not missing or remaining <= 0:
                    return missing
                self._changed.wait(min(remaining, 0.5))

    def wait_votes(self, round_: int, roster: Iterable[str], timeout_s: float) -> dict[str, bool]:
        """The votes of round_ once all of the roster voted, or what arrived by the timeout."""
        roster = set(roster)
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                votes = dict(self._votes.get(round_, {}))
                stopped = {j for j, last in self.stopped.items() if last < round_}
                if roster - self.offline - stopped <= set(votes) or time.monotonic() >= deadline:
                    return votes
                self._changed.wait(min(deadline - time.monotonic(), 0.5))

    def wait_ready(
        self, agents: Iterable[str], stop: threading.Event, timeout_s: float
    ) -> set[str]:
        """Wait until every agent has subscribed (its first status of this run says so), is
        offline, `stop` is set, or timeout; returns the agents not heard from."""
        return self._wait_all(set(agents), self.ready, stop, timeout_s)

    def wait_finished(
        self, agents: Iterable[str], stop: threading.Event, timeout_s: float
    ) -> set[str]:
        """Wait until every agent reported its last round done, is offline, `stop` is set, or
        timeout; returns the agents still running."""
        return self._wait_all(set(agents), self.finished, stop, timeout_s)

    def _wait_all(
        self, agents: set[str], group: set[str], stop: threading.Event, timeout_s: float
    ) -> set[str]:
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                waiting = agents - group - self.offline
                remaining = deadline - time.monotonic()
                if not waiting or stop.is_set() or remaining <= 0:
                    return waiting
                self._changed.wait(min(remaining, 0.2))

    def forget_before(self, round_: int) -> None:
        """Drop models older than round_ (except each sender's newest, kept as a fallback)."""
        with self._changed:
            newest: dict[str, int] = {}
            for r, s in self._models:
                newest[s] = max(r, newest.get(s, r))
            for key in [k for k in self._models if k[0] < round_ and newest[k[1]] != k[0]]:
                del self._models[key]
            for old in [k for k in self._globals if k[0] < round_]:
                del self._globals[old]
            for old in [k for k in self._pending if k[0] < round_]:
                del self._pending[old]
            for old in [k for k in self._asked if k[0] < round_]:
                del self._asked[old]
            for store in (self._divergences, self._layers):
                newest = {}
                for key in store:
                    newest[key[1]] = max(key[0], newest.get(key[1], key[0]))
                for key in [k for k in store if k[0] < round_ and newest[k[1]] != k[0]]:
                    del store[key]
