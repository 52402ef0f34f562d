"""The networked agent's round loop: wait for what the round needs, compute, publish, persist.

The math is `Learner.local_round`, the very function the simulator calls; this module only
decides when it has the inputs. For round t agent k needs this round's models of its prior
neighbours and last round's models of the others (ALGORITHMS.md 1.3), exactly what the
simulator hands it, so with no faults a networked run reproduces a simulated one. A
neighbour that does not deliver within the round timeout is a straggler: the agent asks for
the model again while it waits, then falls back to the newest model it holds and records it.

Pruning needs the fleet's votes (1.7-1.8). The first further pruning is at t_1 = 2 t* + b, so
deciding whether round t prunes needs only the tallies of rounds <= t / 2: the agent waits
for those (missing votes count 0 after the vote timeout), which keeps the fleet loosely
coupled instead of adding a barrier every round.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.device.budget import Budget
from agent.device.throttle import Throttle
from agent.experiment import ExperimentConfig, Workload
from agent.learning import ldf, pruning, sparse, topology
from agent.learning.delta import encode_delta
from agent.learning.early_stop import StopWatch, early_stop_savings
from agent.learning.learner import AgentState, Published, RoundResult
from agent.learning.reduction import local_reduction
from agent.runtime import checkpoint
from agent.runtime.codec import (
    all_finite,
    divergence_message,
    expected_delta_shapes,
    expected_shapes,
    model_message,
    values_sent,
)
from agent.runtime.inbox import Expected, Inbox
from protocol import messages, topics
from protocol.mqtt import MqttTransport

log = logging.getLogger(__name__)

LOOKAHEAD_ROUNDS = 4
KEEP_OWN_ROUNDS = 4
LAYER_BATCH_S = 0.2
"""`--wire layers`: how long a sender collects requests before publishing the layers asked
for, so that neighbours asking at about the same time share one publish."""


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


PublishLayers = Callable[[int, set[str]], Iterator[tuple[str, int, bool]]]
"""Publishes a round's layers one by one, yielding (layer, values it carried, retained)."""


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


class LayerServer:
    """Collects neighbours' requests for layers (--wire layers) and publishes each layer
    asked for once per batch: the requests that come within `delay_s` of a batch's first
    share one publish, which reaches every neighbour that subscribed before asking.

    A layer small enough to be retained goes out once per round: a neighbour asks only after
    its subscription is acknowledged, and the broker hands it the retained copy on
    subscribing, so later askers need no publish. One that asks a second time missed it and
    gets a new publish, and so does everyone after a reconnect (`reconnected`: the broker
    may have restarted without its retained messages)."""

    def __init__(self, publish: PublishLayers, delay_s: float) -> None:
        self._publish = publish
        self._delay_s = delay_s
        self._lock = threading.Lock()
        self._flushing = threading.Lock()
        """Held while a batch is published and recorded, so that `forget` and `close`, which
        wait for it, see every layer it retained."""
        self._pending: dict[int, set[str]] = {}
        self._timer: threading.Timer | None = None
        self._served = 0
        self._closed = False
        self._retained: dict[int, set[str]] = {}
        """Layers the broker may retain, per round: cleared when the round is forgotten."""
        self._trusted: dict[int, set[str]] = {}
        """Retained layers published on the current connection: a new asker has them."""
        self._askers: dict[tuple[int, str], set[str]] = {}

    def ask(self, round_: int, layers: list[str], asker: str) -> None:
        with self._lock:
            if self._closed:
                return
            wanted = set()
            for layer in layers:
                askers = self._askers.setdefault((round_, layer), set())
                if layer not in self._trusted.get(round_, ()) or asker in askers:
                    wanted.add(layer)
                askers.add(asker)
            if not wanted:
                return
            self._pending.setdefault(round_, set()).update(wanted)
            if self._timer is None:
                self._timer = threading.Timer(self._delay_s, self.flush)
                self._timer.daemon = True
                self._timer.start()

    def flush(self) -> None:
        with self._flushing:
            with self._lock:
                pending, self._pending, self._timer = self._pending, {}, None
            for round_, layers in sorted(pending.items()):
                try:
                    for layer, values, retained in self._publish(round_, layers):
                        with self._lock:
                            self._served += values
                            if retained:
                                self._retained.setdefault(round_, set()).add(layer)
                                self._trusted.setdefault(round_, set()).add(layer)
                except Exception:  # the transport stopped, a queue stayed full: they ask again
                    log.exception("could not publish the layers of round %d", round_)

    def take_served(self) -> int:
        """Values published since the last call."""
        with self._lock:
            served, self._served = self._served, 0
        return served

    def reconnected(self) -> None:
        """Publish again for every asker: the broker may have lost what it retained."""
        with self._lock:
            self._trusted = {}

    def may_retain(self, round_: int, layers: Iterable[str]) -> None:
        """Layers the broker may hold from before a restart: cleared with their round."""
        with self._lock:
            self._retained.setdefault(round_, set()).update(layers)

    def forget(self, round_: int) -> set[str]:
        """Stop serving `round_` (after a batch being published); returns its layers the
        broker may still retain."""
        with self._flushing, self._lock:
            self._askers = {key: a for key, a in self._askers.items() if key[0] != round_}
            self._pending.pop(round_, None)
            self._trusted.pop(round_, None)
            return self._retained.pop(round_, set())

    def close(self) -> dict[int, set[str]]:
        """Drop what is pending and take no more requests (the run is over); returns, after
        a batch being published, the layers the broker may still retain, per round."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self._pending, self._timer, self._closed = {}, None, True
        with self._flushing, self._lock:
            retained, self._retained, self._trusted, self._askers = self._retained, {}, {}, {}
            return retained


class AgentRuntime:
    """Runs the decentralized rounds of one agent over an already started transport.

    The start barrier, statuses, early stopping, checkpoints, resuming and lingering are
    shared with the centralized rounds (`agent.central_runtime`), which override what a
    round is."""

    def __init__(
        self,
        *,
        agent_id: str,
        fleet: str,
        run: Run,
        workload: Workload,
        transport: MqttTransport,
        state_dir: Path,
        timeouts: Timeouts = Timeouts(),
        key: bytes | None = None,
        on_round: Callable[[dict[str, Any]], None] | None = None,
        on_finish: Callable[[AgentState], None] | None = None,
        stop: threading.Event | None = None,
        budget: Callable[[], Budget | None] | None = None,
        throttle: Throttle | None = None,
    ) -> None:
        self.me = agent_id
        self.fleet = fleet
        self.run_info = run
        self.config = run.config
        self.cfg = run.config.learning
        self.roster = sorted(run.roster)
        self.learner = workload.learner
        self.data = workload.data[agent_id]
        self.transport = transport
        self.state_dir = state_dir
        self.timeouts = timeouts
        self.key = key
        self.on_round = on_round
        self.on_finish = on_finish
        """Called once the model is final, before lingering (the CLI exports it to ONNX)."""
        self.stop = stop or threading.Event()
        self.budget = budget or (lambda: None)
        self.throttle = throttle
        self.inbox = Inbox(
            Expected(
                fleet=fleet,
                run_id=run.run_id,
                roster=frozenset(self.roster),
                shapes=expected_shapes(self.learner.initial),
                key=key,
                aggregator=run.aggregator,
                delta_shapes=(
                    expected_delta_shapes(
                        self.learner.initial, self.learner.initial_masks(agent_id)
                    )
                    if self.sends_deltas
                    else None
                ),
                layer_groups=self.learner.layer_groups if self.layered else None,
            )
        )
        self.state: AgentState = self.learner.init_agent(agent_id)
        self.recon = self.learner.published(self.state, 0)
        """With --wire delta: this agent's model as its peers rebuild it from its deltas."""
        self.whole_after_restart = 0
        """With --wire delta, models to send whole: after a restart the round redone may
        differ from what went out before the crash, and peers keep the first copy they got;
        the round after it, sent whole too, puts sender and receivers back on one copy."""
        self.plan = pruning.PruningPlan(self.cfg.rounds, self.cfg.schedule_b, self.cfg.schedule_c)
        self.settled_round = 0
        self.stop_watch = StopWatch()
        self.stopped_round: int | None = None
        self.own: dict[int, bytes] = {}
        """What this agent published after each recent round (its model, or with --wire
        layers its divergence vector), re-sent on request."""
        self.kept: dict[int, Published] = {}
        """With --wire layers: its recent models, whose layers neighbours ask for."""
        self.layer_server = LayerServer(self._publish_layers, LAYER_BATCH_S)
        self.connects_seen = 0
        """The transport's connection count when the layer server last heard of it."""
        self.votes: dict[int, bool] = {}
        self.subscribed: set[str] = set()
        self._bytes = (0, 0)
        self.checkpoint_path = state_dir / "checkpoint.pt"
        self.records_path = state_dir / "rounds.jsonl"

    # ------------------------------------------------------------------ wiring

    def _topic(self, round_: int, kind: str, agent: str, to: str | None = None) -> str:
        return topics.round_topic(self.fleet, round_, kind, agent, to)

    def _subscribe_common(self) -> None:
        self.transport.subscribe(topics.round_topic(self.fleet, "+", "vote"), self.inbox.on_vote)
        self.transport.subscribe(
            topics.round_topic(self.fleet, "+", "request", to=self.me), self._serve
        )
        self.transport.subscribe(topics.status(self.fleet), self.inbox.on_status)
        self.transport.subscribe(topics.presence(self.fleet), self.inbox.on_presence)

    def _needs(self, round_: int) -> set[tuple[int, str]]:
        """(round, sender) of every model round `round_` aggregates (1.3)."""
        if self.cfg.strategy == "local":
            return set()
        seed, roster = self.config.seed, self.roster
        order = topology.reuse_order(seed, round_, roster)
        mine = topology.neighbours(
            seed, round_, roster, self.me, self.cfg.neighbours, self.cfg.topology
        )
        prior, posterior = topology.prior_posterior(order, mine, self.me, self.cfg.max_wait)
        return {(round_, j) for j in prior} | {(round_ - 1, j) for j in posterior}

    def _sources(self, needs: set[tuple[int, str]]) -> dict[tuple[int, str], tuple[int, str]]:
        """The model that stands for each need: an agent that stopped early after round s is
        represented by its round-s model in every later round."""
        stopped = self.inbox.stopped_agents()
        return {(r, j): (min(r, stopped.get(j, r)), j) for r, j in needs}

    @property
    def sends_deltas(self) -> bool:
        return self.cfg.wire == "delta" and self.cfg.strategy != "local"

    @property
    def layered(self) -> bool:
        """--wire layers: divergence vectors announce models; receivers fetch chosen layers."""
        return self.cfg.wire == "layers" and self.cfg.strategy != "local"

    @property
    def _announcement(self) -> str:
        """The kind of message that announces an agent's round model."""
        return "divergence" if self.layered else "model"

    def _subscribe_ahead(self, round_: int) -> None:
        """Subscribe to the models of the next few rounds before anyone publishes them (with
        --wire delta to every peer's models: deltas build on each other)."""
        wanted = set()
        if self.sends_deltas:
            wanted = {topics.round_topic(self.fleet, "+", "model")}
            if not self.subscribed:  # round 0 is derivable: the first deltas' base
                for j in self.roster:
                    initial = self.learner.init_agent(j)
                    self.inbox.put_model(0, j, self.learner.published(initial, 0))
        else:
            last = min(round_ + LOOKAHEAD_ROUNDS, self.cfg.rounds)
            for upcoming in range(round_, last + 1):
                sources = self._sources(self._needs(upcoming)).values()
                wanted |= {self._topic(r, self._announcement, j) for r, j in sources if r >= 1}
        handler = self.inbox.on_divergence if self.layered else self.inbox.on_model
        for topic in sorted(wanted - self.subscribed):
            self.transport.subscribe(topic, handler)
        for topic in self.subscribed - wanted:
            self.transport.unsubscribe(topic)
        self.subscribed = wanted

    def _serve(self, topic: str, payload: bytes) -> None:
        """Answer a neighbour that asks for layers of one of our recent models (--wire
        layers), or for what we published after a round (it missed it)."""
        request = self.inbox.decode_request(topic, payload)
        if request is None or request.target != self.me:
            return
        if self.layered and request.layers:
            known = [layer for layer in request.layers if layer in self.learner.layer_groups]
            if request.round in self.kept and known:
                connects = self.transport.stats.get("connects", 0)
                if connects != self.connects_seen:
                    self.connects_seen = connects
                    self.layer_server.reconnected()
                self.layer_server.ask(request.round, known, request.sender)
            return
        data = self.own.get(request.round)
        if data is not None:
            log.info(
                "re-sending round %d %s to %s", request.round, self._announcement, request.sender
            )
            self.transport.publish(self._topic(request.round, self._announcement, self.me), data)

    def _publish_layers(self, round_: int, layers: set[str]) -> Iterator[tuple[str, int, bool]]:
        """Publish these layers of our round model, each on its own topic, once for every
        neighbour that asked (the `LayerServer`'s publisher), retained when they fit one
        frame; yields each layer after its publish, with the values it carried."""
        model = self.kept.get(round_)
        if model is None:
            return
        for layer in (layer for layer in self.learner.layer_groups if layer in layers):
            part = self.learner.layer_part(model, [layer])
            data = model_message(
                **self._model_fields(round_, model.num_samples),
                weights=part.weights,
                masks=part.masks,
            )
            if self.throttle is not None:
                self.throttle.before_send(len(data))
            retain = self.transport.fits_one_frame(data)
            topic = self._topic_of_layer((round_, self.me), layer)
            self.transport.publish(topic, data, retain=retain)
            yield layer, values_sent(part.weights, part.masks), retain

    def _clear_layers(self, round_: int, layers: set[str]) -> None:
        """Delete our retained layers of `round_` from the broker: nobody asks for them now."""
        for layer in sorted(layers):
            self.transport.clear_retained(self._topic_of_layer((round_, self.me), layer))

    def _header_fields(self, round_: int) -> dict[str, Any]:
        """`_header` as `agent.wire`'s message builders take it."""
        fields = self._header(round_)
        fields["round_"] = fields.pop("round")
        return fields

    def _model_fields(self, round_: int, num_samples: int) -> dict[str, Any]:
        """The arguments of `model_message` other than the tensors."""
        return {
            **self._header_fields(round_),
            "num_samples": num_samples,
            "fp16": self.cfg.fp16,
            "key": self.key,
        }

    def _header(self, round_: int) -> dict[str, Any]:
        """The envelope fields every message of this agent in this run carries."""
        return {
            "fleet": self.fleet,
            "sender": self.me,
            "run_id": self.run_info.run_id,
            "round": round_,
        }

    def _request(self, missing: set[tuple[int, str]], layers: list[str] | None = None) -> None:
        """Ask each (round, target) for its model again, or for these `layers` of it."""
        for round_, target in sorted(missing):
            message = messages.Request(**self._header(round_), target=target, layers=layers or [])
            self.transport.publish(
                self._topic(round_, "request", self.me, to=target),
                messages.encode(message, key=self.key),
            )

    # ------------------------------------------------------------------ round

    def _gather(self, round_: int) -> tuple[dict[str, Published], list[str]]:
        """The inbox of round `round_` and the stragglers among its senders."""
        needs = self._needs(round_)
        deadline = time.monotonic() + self.timeouts.round_s
        if self.layered:
            return self._gather_layers(round_, needs, deadline)
        for r, j in needs:
            if r == 0:
                self.inbox.put_model(0, j, self.learner.published(self.learner.init_agent(j), 0))
        sources = self._await(round_, needs, deadline, self.inbox.model, self.inbox.wait_models)
        inbox: dict[str, Published] = {}
        stragglers = []
        for r, j in sorted(needs):
            model = self.inbox.model(*sources[(r, j)])
            if model is None:
                stragglers.append(j)
                fallback = self.inbox.latest(j, r)
                model = (
                    fallback[1]
                    if fallback
                    else self.learner.published(self.learner.init_agent(j), 0)
                )
                log.warning("round %d: %s did not deliver its round %d model in time", round_, j, r)
            inbox[j] = model
        return inbox, stragglers

    def _await(
        self,
        round_: int,
        needs: set[tuple[int, str]],
        deadline: float,
        have: Callable[[int, str], object],
        wait: Callable[[set[tuple[int, str]], float], set[tuple[int, str]]],
    ) -> dict[tuple[int, str], tuple[int, str]]:
        """Wait for the announcement (`have`/`wait`: models, or divergence vectors) of every
        need's source, asking again for the missing every `request_every_s`, until the
        deadline; returns the sources, which change when a neighbour stops early meanwhile."""
        sources = self._sources(needs)
        self._request({src for need, src in sources.items() if src != need and have(*src) is None})
        pause = min(self.timeouts.request_every_s, self.timeouts.round_s)
        while True:
            missing = wait(set(sources.values()), max(pause, 0.0))
            if (now := self._sources(needs)) != sources:
                # A neighbour stopped early meanwhile: fetch its last model now (this agent
                # may never have subscribed to it).
                self._subscribe_ahead(round_)
                changed = set(now.values()) - set(sources.values())
                self._request({k for k in changed if have(*k) is None})
                sources = now
                continue
            if not missing or time.monotonic() >= deadline or self.stop.is_set():
                return sources
            self._request(missing)
            pause = min(self.timeouts.request_every_s, deadline - time.monotonic())

    def _gather_layers(
        self, round_: int, needs: set[tuple[int, str]], deadline: float
    ) -> tuple[dict[str, Published], list[str]]:
        """--wire layers: wait for the neighbours' divergence vectors, pick per layer the
        `ldf_n` most diverged (`ldf.select_layers`, as FedLDF's aggregator does), ask each
        neighbour for its picked layers and wait for them. Round-0 models are derivable and
        taken whole; a neighbour counts for the layers that came (none if it sent nothing)."""
        inbox = {
            j: self.learner.published(self.learner.init_agent(j), 0) for r, j in needs if r == 0
        }
        announced = {need for need in needs if need[0] >= 1}
        sources = self._await(
            round_, announced, deadline, self.inbox.divergence, self.inbox.wait_divergences
        )
        divergences = {
            j: vector
            for (_, j), src in sources.items()
            if (vector := self.inbox.divergence(*src)) is not None
        }
        chosen = ldf.select_layers(divergences, self.cfg.ldf_n) if divergences else {}
        source_of = {j: src for (_, j), src in sources.items()}
        wanted = {
            (*source_of[j], layer): self._topic_of_layer(source_of[j], layer)
            for j, layers in chosen.items()
            for layer in layers
        }
        fetch = {
            key: topic
            for key, topic in wanted.items()
            if not self.inbox.layers_of(*key[:2], [key[2]])
        }
        # Layers take a second trip: a vector that came late still gets its layers' time.
        deadline = max(deadline, time.monotonic() + self.timeouts.request_every_s)
        missing = set(fetch)
        try:
            for topic in sorted(set(fetch.values())):
                self.transport.subscribe(topic, self.inbox.on_layer)
            if fetch:
                self.transport.wait_subscribed(max(deadline - time.monotonic(), 0.0))
            while missing and not self.stop.is_set():
                for r, j in sorted({key[:2] for key in missing}):
                    asked = [key[2] for key in sorted(missing) if key[:2] == (r, j)]
                    self._request({(r, j)}, asked)
                pause = min(self.timeouts.request_every_s, deadline - time.monotonic())
                missing = self.inbox.wait_layers(missing, max(pause, 0.0))
                if time.monotonic() >= deadline:
                    break
        finally:
            for topic in sorted(set(fetch.values())):
                self.transport.unsubscribe(topic)
        stragglers = sorted(
            {j for (_, j), src in sources.items() if self.inbox.divergence(*src) is None}
            | {key[1] for key in missing}
        )
        for j in stragglers:
            log.warning("round %d: %s did not deliver in time", round_, j)
        for j, layers in chosen.items():
            part = self.inbox.layers_of(*source_of[j], layers)
            if part is not None:
                inbox[j] = part
        return inbox, stragglers

    def _topic_of_layer(self, source: tuple[int, str], layer: str) -> str:
        index = list(self.learner.layer_groups).index(layer)
        return topics.layer(self.fleet, source[0], source[1], index)

    def _prune_now(self, round_: int) -> bool:
        """Settle the tallies of rounds <= round_ // 2, then ask the plan."""
        if not self.learner.prunes_further:
            return False
        while self.settled_round < round_ // 2:
            r = self.settled_round + 1
            votes = self.inbox.wait_votes(r, self.roster, self.timeouts.vote_s)
            stopped = self.inbox.stopped_agents()
            voters = [j for j in self.roster if stopped.get(j, r) >= r]
            self.plan.observe(r, pruning.tally(votes, voters, self.cfg.delta_v))
            self.settled_round = r
        return self.plan.is_pruning_round(round_)

    def _publish(self, round_: int, result: RoundResult) -> int:
        """Publish the model, or with --wire layers its divergence vector (once for all
        receivers), and the vote; returns the values sent: the model's, or the layers'
        published since the last round."""
        published = result.published
        message = self._model_fields(round_, published.num_samples)
        if not all_finite(published.weights):
            # Receivers would reject it (and a divergence vector of it cannot be encoded).
            log.error("round %d: training diverged (weights not finite); model not sent", round_)
            data = kept = b""
            sent = Published({}, None, 0)
        elif self.layered:
            assert result.divergence is not None
            data = kept = divergence_message(
                **self._header_fields(round_), divergence=result.divergence, key=self.key
            )
            self.kept[round_] = published
            sent = Published({}, None, 0)
        elif self.sends_deltas and not self.whole_after_restart:
            values, value_masks, self.recon = encode_delta(
                published, self.recon, self.cfg.delta_fraction, fp16=self.cfg.fp16
            )
            data = model_message(
                **message, weights=values, masks=value_masks, base_round=round_ - 1
            )
            kept = model_message(**message, weights=self.recon.weights, masks=self.recon.masks)
            sent = Published(values, value_masks, published.num_samples)
        else:
            data = kept = model_message(**message, weights=published.weights, masks=published.masks)
            sent, self.recon = published, published
            self.whole_after_restart = max(self.whole_after_restart - 1, 0)
        if self.cfg.strategy != "local":
            for old in [r for r in self.own if r <= round_ - KEEP_OWN_ROUNDS]:
                del self.own[old]
                self.kept.pop(old, None)
                self._clear_layers(old, self.layer_server.forget(old))
            if data:
                self.own[round_] = kept  # re-sent to a peer that asks for it
                if self.throttle is not None:
                    self.throttle.before_send(len(data))
                self.transport.publish(self._topic(round_, self._announcement, self.me), data)
        if result.vote is not None and self.learner.prunes_further:
            self.votes[round_] = result.vote
            self.inbox.record_votes(self.me, {round_: result.vote})
            vote = messages.Vote(
                **self._header(round_),
                vote=result.vote,
                score=result.score if result.score is not None else 0.0,
            )
            encoded = messages.encode(vote, key=self.key)
            self.transport.publish(self._topic(round_, "vote", self.me), encoded)
        return values_sent(sent.weights, sent.masks) + self.layer_server.take_served()

    def _savings(self, round_: int) -> dict[str, Any]:
        """What stopping after `round_` saves, for the status (from the round log)."""
        records = checkpoint.read_records(self.records_path)
        ran = [records[r] for r in sorted(records) if r <= round_]
        return {"saved": early_stop_savings(ran, round_, self.cfg.rounds)}

    def _stops(self, result: RoundResult) -> bool:
        """Early stopping (ALGORITHMS.md 2): whether this round's loss rose from the last."""
        if not self.cfg.early_stop:
            return False
        loss = self.learner.stopping_loss(result.state.weights, result.train_loss, self.data)
        self.stop_watch, stops = self.stop_watch.after(loss, self.cfg.stop_patience)
        return stops

    def _status(self, state: str, round_: int, metrics: dict[str, Any]) -> None:
        history = "".join("1" if self.votes.get(r) else "0" for r in range(1, round_ + 1))
        message = messages.Status(
            **self._header(round_),
            state=state,
            metrics=finite_or_none(
                {**metrics, "votes": history if self.learner.prunes_further else ""}
            ),
            stopped=self.stopped_round is not None,
        )
        self.transport.publish(
            topics.status(self.fleet, self.me), messages.encode(message, key=self.key), retain=True
        )

    def run_round(self, round_: int) -> dict[str, Any]:
        started = time.monotonic()
        self._subscribe_ahead(round_)
        inbox, stragglers = self._gather(round_)
        waited = time.monotonic() - started
        prune_now = self._prune_now(round_)
        budget = self.budget()
        reduction = local_reduction(self.learner, budget.p_k if budget else None, self.state.masks)
        computing = time.monotonic()
        result = self.learner.local_round(
            self.state,
            self.data,
            inbox,
            round_,
            prune_now,
            density_cap=reduction.density_cap,
            active_fraction=reduction.active_fraction,
        )
        throttled = 0.0
        if self.throttle is not None:
            throttled = self.throttle.after_compute(
                time.monotonic() - computing, result.train_flops
            )
        self.state = result.state
        stops = self._stops(result)
        nonzeros = self._publish(round_, result)
        return self._finish_round(
            round_,
            {
                "round": round_,
                "agent": self.me,
                "accuracy": result.accuracy,
                "loss": result.loss,
                "train_loss": result.train_loss,
                "sparsity": sparse.sparsity(result.state.masks) if result.state.masks else 0.0,
                "nonzeros_sent": nonzeros,
                "train_flops": result.train_flops,
                "p_k": budget.p_k if budget else 1.0,
                "limited_by": budget.limited_by if budget else "none",
                "density_cap": reduction.density_cap,
                "active_fraction": reduction.active_fraction,
                "throttled_s": round(throttled, 3),
                "vote": result.vote,
                "score": result.score,
                "pruned": result.pruned,
                "stragglers": stragglers,
                "wait_s": round(waited, 3),
                "t_star": self.plan.t_star,
                "stopped": stops,
            },
        )

    def _finish_round(self, round_: int, record: dict[str, Any]) -> dict[str, Any]:
        """Add the round's traffic to its record, persist it, publish the status."""
        stats = self.transport.stats
        sent = stats.get("published_bytes", 0) - self._bytes[0]
        received = stats.get("received_bytes", 0) - self._bytes[1]
        self._bytes = (stats.get("published_bytes", 0), stats.get("received_bytes", 0))
        record |= {"bytes_sent": sent, "bytes_received": received, "finished_at": time.time()}
        self._persist(round_, record)
        saved: dict[str, Any] = {}
        stops = record["stopped"]
        if stops:
            self.stopped_round = round_
            saved = self._savings(round_)
        self._status(
            "stopped" if stops else "training" if round_ < self.cfg.rounds else "done",
            round_,
            {
                k: record[k]
                for k in (
                    "accuracy",
                    "sparsity",
                    "p_k",
                    "bytes_sent",
                    "bytes_received",
                    "stragglers",
                    "t_star",
                )
            }
            | saved,
        )
        self.inbox.forget_before(round_ - 1)
        if self.on_round:
            self.on_round(record)
        return record

    # ------------------------------------------------------------------ persistence

    def _persist(self, round_: int, record: dict[str, Any]) -> None:
        """Checkpoint (with the round's record), then log the record.

        A crash before the checkpoint redoes the round; a crash between the two is repaired
        by `restore`, which logs the checkpoint's record if it is missing: no round is ever
        lost or logged twice.
        """
        checkpoint.save(
            self.checkpoint_path,
            {
                "run_id": self.run_info.run_id,
                "agent": self.me,
                "round": round_,
                "weights": self.state.weights,
                "masks": self.state.masks or {},
                "distances": self.state.distances,
                "own": dict(self.own),
                "held": self._held(round_),
                "votes": self.votes,
                "settled_round": self.settled_round,
                "t_star": self.plan.t_star,
                "stop_watch": dataclasses.asdict(self.stop_watch),
                "recon": (
                    {"weights": self.recon.weights, "masks": self.recon.masks or {}}
                    if self.sends_deltas
                    else None
                ),
                "kept": {
                    r: {"weights": p.weights, "masks": p.masks or {}, "samples": p.num_samples}
                    for r, p in self.kept.items()
                },
                "record": record,
                **self._checkpoint_extra(),
            },
        )
        checkpoint.append_record(self.records_path, record)

    def _held(self, round_: int) -> dict[str, dict[str, Any]]:
        """Peers' models to keep across a restart: this round's and next round's, and the
        last models of agents that stopped early that the next round uses (they may have
        left by the time we restart)."""
        keys = {(r, j) for r in (round_, round_ + 1) for j in self.roster}
        if round_ < self.cfg.rounds:
            keys |= set(self._sources(self._needs(round_ + 1)).values())
        held: dict[str, dict[str, Any]] = {}
        for r, j in sorted(keys):
            if (p := self.inbox.model(r, j)) is not None:
                held[f"{r}|{j}"] = {"weights": p.weights, "masks": p.masks or {}}
            elif (vector := self.inbox.divergence(r, j)) is not None:  # --wire layers
                layers = {
                    layer: {"weights": p.weights, "masks": p.masks or {}, "samples": p.num_samples}
                    for layer, p in self.inbox.held_layers(r, j).items()
                }
                held[f"{r}|{j}"] = {"divergence": vector, "layers": layers}
        return held

    def _checkpoint_extra(self) -> dict[str, Any]:
        """Further state a subclass checkpoints (read back by `_restore_extra`)."""
        return {}

    def _restore_extra(self, saved: dict[str, Any]) -> None:
        """Read back what `_checkpoint_extra` saved."""

    def restore(self) -> int:
        """Resume from the checkpoint of this run, if any; returns the last completed round."""
        saved = checkpoint.load(self.checkpoint_path)
        if saved is None:
            return 0
        if saved["run_id"] != self.run_info.run_id or saved["agent"] != self.me:
            log.warning("ignoring checkpoint of another run or agent in %s", self.checkpoint_path)
            return 0
        if saved["round"] not in checkpoint.read_records(self.records_path):
            checkpoint.append_record(self.records_path, saved["record"])
        masks = saved["masks"] or None
        self.state = dataclasses.replace(
            self.state,
            weights=saved["weights"],
            masks=masks,
            distances=list(saved["distances"]),
            round=saved["round"],
        )
        self.own = dict(saved["own"])
        self.votes = {int(r): bool(v) for r, v in saved["votes"].items()}
        self.inbox.record_votes(self.me, self.votes)
        for key, model in saved["held"].items():
            r, j = key.split("|")
            if "divergence" in model:
                layers = {
                    layer: Published(p["weights"], p["masks"] or None, p["samples"])
                    for layer, p in model["layers"].items()
                }
                self.inbox.put_announced(int(r), j, model["divergence"], layers)
            else:
                weights, masks = model["weights"], model["masks"] or None
                self.inbox.put_model(int(r), j, Published(weights, masks, 0))
        self.plan = pruning.PruningPlan(
            self.cfg.rounds, self.cfg.schedule_b, self.cfg.schedule_c, t_star=saved["t_star"]
        )
        self.plan._last_round = saved["settled_round"]
        self.settled_round = saved["settled_round"]
        self.stop_watch = StopWatch(**saved.get("stop_watch", {}))
        if saved.get("recon"):
            recon = saved["recon"]
            self.recon = Published(recon["weights"], recon["masks"] or None, 0)
        self.whole_after_restart = 2
        self.kept = {
            int(r): Published(p["weights"], p["masks"] or None, p["samples"])
            for r, p in saved.get("kept", {}).items()
        }
        if saved["record"].get("stopped"):
            self.stopped_round = int(saved["round"])
        self._restore_extra(saved)
        log.info("resuming after round %d from %s", saved["round"], self.checkpoint_path)
        return int(saved["round"])

    # ------------------------------------------------------------------ main

    def run(self) -> None:
        self._subscribe_common()
        done = self.restore()
        if done:
            for round_, data in self.own.items():
                self.transport.publish(self._topic(round_, self._announcement, self.me), data)
            if self.stopped_round is not None:  # the crash may have come before the status
                self._status("stopped", done, self._savings(done))
        else:
            self._start_together()
        if done and self.layered:
            # Layers served before the crash: the restored rounds' are the same models (clear
            # them with their round); the redone round's may differ, so they go now.
            for round_ in self.kept:
                self.layer_server.may_retain(round_, self.learner.layer_groups)
            self._clear_layers(done + 1, set(self.learner.layer_groups))
        try:
            for round_ in range(done + 1, self.cfg.rounds + 1):
                if self.stop.is_set() or self.stopped_round is not None:
                    break
                self.run_round(round_)
            if self.stopped_round is not None:
                log.info("stopped early after round %d: its loss rose", self.stopped_round)
            if self.finished and self.on_finish:
                self.on_finish(self.state)
            if not self.stop.is_set():
                self._linger()
        finally:
            for round_, layers in self.layer_server.close().items():
                try:
                    self._clear_layers(round_, layers)
                except RuntimeError:  # the transport stopped (a signal): the broker keeps them
                    break

    @property
    def finished(self) -> bool:
        """Trained its last round, or stopped early: its model is final."""
        return self.state.round == self.cfg.rounds or self.stopped_round is not None

    def _start_together(self) -> None:
        """Subscribe, say so in a status, and wait (at most a round timeout) for the others.

        A model published before its receiver subscribed is lost to it, and the receiver only
        asks for it again after `request_every_s`: without this barrier, agents of a fleet
        that start seconds apart would wait that long in their first rounds. (A resumed agent
        skips it: the others are past it, and it republishes its recent models.)
        """
        self._subscribe_ahead(1)
        self._status("ready", 0, {})
        others = set(self.roster) - {self.me}
        absent = self.inbox.wait_ready(others, self.stop, self.timeouts.round_s)
        if absent:
            log.warning("starting without %s: not heard from in time", ", ".join(sorted(absent)))

    def _linger(self) -> None:
        """Keep answering requests until every other agent reports done (or time runs out).

        An agent that stopped early stays for the rest of the run: its neighbours keep
        using, and may still ask for, its last model."""
        others = set(self.roster) - {self.me}
        timeout = self.timeouts.linger_s
        if self.stopped_round is not None:
            rounds_left = self.cfg.rounds - self.stopped_round
            timeout += rounds_left * (self.timeouts.round_s + self.timeouts.vote_s)
        self.inbox.wait_finished(others, self.stop, timeout)
