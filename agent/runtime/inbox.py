"""What an agent has received from its peers, and waiting for what it still needs.

Handlers run on the transport's dispatcher thread and only validate and store; the round loop
waits here with timeouts. Everything is keyed by (round, sender) and the first copy wins, so
a model delivered twice (QoS 1 redelivery, or re-sent on request) changes nothing. The fleet's
state (statuses, presence, votes) and the message checks are `FleetMail`'s.

Memory is bounded against a hostile (or broken) sender: once the round being run is known
(`at_round`, `forget_before`, or a model restored from a checkpoint), a message or vote of a
round more than `rounds_ahead` past it is dropped and counted (`dropped`), so at most
`rounds_ahead` + 2 rounds of (round, sender) entries are held ahead of `forget_before`;
a model or layer whose `num_samples` is outside 1..`limits.max_num_samples` is rejected (it
would dominate FedAvg); a peer asking again for what we published is answered once per
(asker, round, layers) and asker's session, for a few sessions (`may_answer`).

A member that keeps sending invalid models is quarantined for the run (`FleetMail`'s
`quarantine`, agent/runtime/quarantine.py): its models are ignored and never waited for.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Container, Iterable, Mapping
from typing import Any

from agent.learning import Published, apply_delta
from agent.learning.ldf import checked_divergences
from agent.learning.sparse import State
from agent.runtime.codec import decode_state
from agent.runtime.mail import Expected, FleetMail
from protocol import ProtocolError, messages, topics
from protocol.limits import DEFAULT_LIMITS, Limits
from protocol.logs import claimed_sender

__all__ = ["ROUNDS_AHEAD", "Expected", "Inbox", "held_models"]

ROUNDS_AHEAD = 4
"""Rounds past the one being run whose messages are kept: the round driver subscribes to the
models of the next 4 rounds (`decentralized.LOOKAHEAD_ROUNDS`); a peer further ahead re-sends
on request what it published (it keeps its last 4 rounds)."""
SESSIONS_ANSWERED = 3
"""How many sessions of one asker (restarts within a round) get an answer to the same ask:
`since` is the asker's word, so a peer cannot claim new sessions without end."""


class Inbox(FleetMail):
    """Peers' models (whole, as deltas, or as layers with their divergence vectors) and the
    aggregator's messages, on top of the fleet's state."""

    def __init__(
        self,
        expected: Expected,
        *,
        limits: Limits = DEFAULT_LIMITS,
        rounds_ahead: int = ROUNDS_AHEAD,
    ) -> None:
        super().__init__(expected)
        self.limits = limits
        self.guard = Guard(rounds_ahead)
        self.dropped = self.guard.dropped
        self._models: dict[tuple[int, str], Published] = {}
        self._pending: dict[tuple[int, str], tuple[int, Published]] = {}
        """Deltas waiting for their base: (round, sender) -> (base round, zero-filled delta
        with its masks)."""
        self._globals: dict[tuple[int, bool], messages.Global] = {}
        self._asked: dict[tuple[int, str], messages.Request] = {}
        self._divergences: dict[tuple[int, str], dict[str, float]] = {}
        self._layers: dict[tuple[int, str, str], Published] = {}
        """`--wire layers`: (round, sender, layer) -> that layer of the sender's model."""
        self._announced_again: Counter[str] = Counter()
        """`--wire layers`: divergence vectors that came again, by sender. A sender back
        from a restart announces its recent rounds again, and a request for layers that
        reached it while it was gone is lost: its askers ask again (`announced_again`)."""

    def on_model(self, topic: str, payload: bytes) -> None:
        """A peer's model, whole or (`base_round` >= 0) as a delta on an earlier one, which
        is applied once that base is here (`agent.learning.delta`)."""
        message = self._decode(topic, payload, "model")
        if not isinstance(message, messages.Model) or not self._admit(message, topic):
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
            windows = None if is_delta else self.expected.window_layers
            weights, masks = decode_state(message.tensors, shapes, partial=windows is not None)
            if windows is not None:
                check_whole_layers(weights, windows)
        except ProtocolError as exc:
            self.reject_model("model", message, topic, exc)
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

    def record_votes(self, sender: str, votes: dict[int, bool]) -> None:
        """`FleetMail.record_votes` for the rounds within the window: a forged status could
        otherwise claim a vote history of a million rounds (a dict entry each)."""
        super().record_votes(sender, {r: v for r, v in votes.items() if self.guard.ahead_ok(r)})

    def at_round(self, round_: int) -> None:
        """The agent runs round `round_` next (1 on a fresh start, after a restart the round
        it resumes at): the window of rounds kept starts here."""
        self.guard.reached(round_)

    def _admit(self, message: messages.Model, topic: str, kind: str = "model") -> bool:
        """A model (or layer) of a sender not quarantined, within the window of rounds, whose
        `num_samples` the run allows (rejected and logged otherwise)."""
        if self.quarantine.holds(message.sender) or not self.guard.ahead_ok(message.round):
            return False
        problem = self.limits.samples_problem(message.num_samples)
        if problem is not None:
            self.reject(kind, message.sender, topic, problem)
            return False
        return True

    def may_answer(self, request: messages.Request) -> bool:
        """Whether to answer a peer's request (re-send what we published, or publish layers)
        now: once per asker's session (`Guard.may_answer`). Ask only when about to answer:
        an ask for what is not published yet must not use up the answer."""
        return self.guard.may_answer(request)

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
        if not isinstance(message, messages.Divergence) or not self.guard.ahead_ok(message.round):
            return
        try:
            vector = checked_divergences(
                message.layers, message.values, self.expected.layer_groups or {}
            )
        except ValueError as exc:
            self.reject("divergence", message.sender, topic, exc)
            return
        with self._changed:
            key = (message.round, message.sender)
            if key in self._divergences:
                self._announced_again[message.sender] += 1
            self._divergences.setdefault(key, vector)
            self._changed.notify_all()

    def announced_again(self, sender: str) -> int:
        """How many of `sender`'s divergence vectors came again (a count that grows when it
        is back from a restart, or answered someone's request for its announcements)."""
        with self._changed:
            return self._announced_again[sender]

    def on_layer(self, topic: str, payload: bytes) -> None:
        """One layer of a neighbour's model (`--wire layers`), checked against the layer's
        tensors; the layer's index is the last topic level."""
        message = self._decode(topic, payload, "model")
        if not isinstance(message, messages.Model) or not self._admit(message, topic, "layer"):
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
            self.reject_model("layer", message, topic, exc)
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
            self.guard.reached(round_)
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
            self.reject("global", claimed_sender(topic), topic, exc)
            return
        if message.sender != self.expected.aggregator or message.run_id != self.expected.run_id:
            return
        if not self.guard.ahead_ok(message.round):
            return
        with self._changed:
            self._globals.setdefault((message.round, "to" in fields), message)
            self._changed.notify_all()

    def on_aggregator_request(self, topic: str, payload: bytes) -> None:
        """The aggregator asking this run's agents for layers (FedLDF)."""
        message = self.decode_request(topic, payload)
        if (
            message is not None
            and message.sender == self.expected.aggregator
            and self.guard.ahead_ok(message.round)
        ):
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

    def put_model(self, round_: int, sender: str, published: Published) -> None:
        """Store a model restored from a checkpoint (or derived locally)."""
        with self._changed:
            self.guard.reached(round_)
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
        """Wait until every (round, sender) is here, or will not come (its sender stopped
        early before that round, or is `gone`), or the timeout passes; returns the missing
        still worth waiting for."""
        return self._wait_missing(needed, self._models, timeout_s)

    def wait_divergences(
        self, needed: Iterable[tuple[int, str]], timeout_s: float
    ) -> set[tuple[int, str]]:
        """`wait_models` for divergence vectors (`--wire layers`)."""
        return self._wait_missing(needed, self._divergences, timeout_s)

    def wait_layers(
        self,
        needed: Iterable[tuple[int, str, str]],
        timeout_s: float,
        until: Callable[[], bool] | None = None,
    ) -> set[tuple[int, str, str]]:
        """`wait_models` for (round, sender, layer)s (`--wire layers`), returning early too
        once `until()` holds (it is called with the inbox locked, on every change)."""
        return self._wait_missing(needed, self._layers, timeout_s, until)

    def forget_before(self, round_: int) -> None:
        """Drop models older than round_ (except each sender's newest, kept as a fallback)."""
        with self._changed:
            self.guard.forget_before(round_)
            for stored in (self._models, self._divergences, self._layers):
                _drop_before(stored, round_, keep_newest=True)
            for dropped in (self._globals, self._pending, self._asked):
                _drop_before(dropped, round_, keep_newest=False)


class Guard:
    """What the inbox keeps out, besides what fails its checks: messages of rounds too far
    ahead, and requests answered moments ago. Thread-safe (its own lock)."""

    def __init__(self, rounds_ahead: int) -> None:
        self.rounds_ahead = rounds_ahead
        self._lock = threading.Lock()
        self._floor: int | None = None
        """The round being run is at most 2 past this (`forget_before`, `reached`); None
        until known: a resumed agent may be at any round, so nothing is dropped yet."""
        self.dropped: Counter[str] = Counter()
        """Messages (and votes) dropped unread by reason (`future_round`, `answered`)."""
        self._answered: dict[tuple[int, str, tuple[str, ...]], set[float]] = {}

    def reached(self, round_: int) -> None:
        """The agent runs round `round_` or a later one (it is told so, or holds a model of
        that round from a checkpoint)."""
        with self._lock:
            self._floor = max(self._floor or 0, round_ - 2)

    def forget_before(self, round_: int) -> None:
        """The inbox forgets the rounds before `round_`: the agent runs `round_` + 2 at most."""
        with self._lock:
            self._floor = max(self._floor or 0, round_)
            self._answered = {k: v for k, v in self._answered.items() if k[0] >= round_}

    def ahead_ok(self, round_: int) -> bool:
        """Whether a message of `round_` is within the window kept: at most `rounds_ahead`
        past the round being run (every round while that is unknown); counts it if not."""
        with self._lock:
            if self._floor is None or round_ <= self._floor + 2 + self.rounds_ahead:
                return True
            self.dropped["future_round"] += 1
            return False

    def may_answer(self, request: messages.Request) -> bool:
        """Whether this is the asker's first request for this round and layers in its
        session (`since`): a peer that got our publish has no reason to ask, one that asked
        while the publish was in flight gets one copy, and one that came back (and lost what
        was in flight to it) may ask again, for at most SESSIONS_ANSWERED sessions. A flood
        of requests cannot make this agent send its model over and over."""
        key = (request.round, request.sender, tuple(sorted(request.layers)))
        with self._lock:
            sessions = self._answered.setdefault(key, set())
            if request.since in sessions or len(sessions) >= SESSIONS_ANSWERED:
                self.dropped["answered"] += 1
                return False
            sessions.add(request.since)
            return True


def _drop_before(store: dict[Any, Any], round_: int, *, keep_newest: bool) -> None:
    """Delete the entries keyed (round, sender, ...) of rounds before `round_`; with
    `keep_newest`, each sender's newest entries stay."""
    newest: dict[Any, int] = {}
    for key in store:
        newest[key[1]] = max(key[0], newest.get(key[1], key[0]))
    for key in [k for k in store if k[0] < round_]:
        if not keep_newest or newest[key[1]] != key[0]:
            del store[key]


def check_whole_layers(weights: State, layers: Mapping[str, list[str]]) -> None:
    """A model that came as a window of layers holds each layer whole or not at all
    (ProtocolError otherwise): what a receiver aggregates per layer."""
    for layer, tensors in layers.items():
        held = [name in weights for name in tensors]
        if any(held) and not all(held):
            raise ProtocolError(f"layer {layer!r} only in part")


def held_models(
    inbox: Inbox, rounds: Container[int]
) -> tuple[dict[tuple[int, str], Published], dict[tuple[int, str], dict[str, float]]]:
    """The models and the divergence vectors of `rounds` in `inbox`, by (round, sender), in
    one look: what a checkpoint keeps, every round (asking for each roster member took the
    lock twice per member and round)."""
    with inbox._changed:
        models = {key: p for key, p in inbox._models.items() if key[0] in rounds}
        vectors = {key: v for key, v in inbox._divergences.items() if key[0] in rounds}
    return models, vectors
