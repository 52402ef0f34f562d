"""The decentralized round driver: wait for what the round needs, compute, publish, vote.

The math is `Learner.local_round` (through `agent.learning.rounds.train_round`), the very
function the simulator calls; this module only decides when it has the inputs. For round t
agent k needs this round's models of its prior neighbours and last round's models of the
others (ALGORITHMS.md 1.3), exactly what the simulator hands it, so with no faults a networked
run reproduces a simulated one. A neighbour that does not deliver within the round timeout is
a straggler: the agent asks for the model again while it waits, then falls back to the newest
model it holds and records it. A neighbour whose presence says offline (after it took part
in this run) is a straggler at once, without the wait, until its presence says online again.
How models travel is the `--wire` object's (`wire_full`, `wire_delta`, `wire_layers`).
Asynchronous rounds (`--asynchronous`, `--wire full`) never wait: a round takes the freshest
model of each neighbour held, weighted by its staleness (`agent.runtime.asynchronous`).

Pruning needs the fleet's votes (1.7-1.8). The first further pruning is at t_1 = 2 t* + b, so
deciding whether round t prunes needs only the tallies of rounds <= t / 2: the agent waits
for those (missing votes count 0 after the vote timeout), which keeps the fleet loosely
coupled instead of adding a barrier every round. Asynchronously the agent does not wait for
them either: it settles a tally from the votes that came (a missing vote counts 0, as after
the vote timeout). A member behind by more than t / 2 rounds thus counts as a no, which can
only put the fleet's pruning time t* later, never earlier, and agents that settle a tally
with different votes at hand may differ in t* (by the rounds their views differ); the
half-round lag leaves a member that keeps up within t / 2 rounds time to vote.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from agent.device.calibration import ActivationMeter, working_set_mb
from agent.experiment import attackers
from agent.learning import (
    Need,
    Published,
    RoundResult,
    RoundTopology,
    attacked,
    live,
    pruning,
    settle_round,
    settle_votes,
    train_round,
)
from agent.learning.asynchronous import Freshest
from agent.learning.screening import ScreeningLog
from agent.report import AgentRound, reported_p_k
from agent.runtime import checkpoint
from agent.runtime.asking import Asking
from agent.runtime.asynchronous import freshest_held, stale_window
from agent.runtime.codec import all_finite, values_sent
from agent.runtime.inbox import held_models
from agent.runtime.session import RoundClock, Session
from agent.runtime.wire import Have, Wait, Wire
from agent.workload import compute_slot
from protocol import ProtocolError, messages, topics

log = logging.getLogger(__name__)

LOOKAHEAD_ROUNDS = 4
KEEP_OWN_ROUNDS = 4


class DecentralizedRounds:
    """One agent's decentralized rounds: its needs, the waiting for them, the votes, and what
    it published after each recent round (re-sent on request)."""

    def __init__(self, session: Session, wire: Wire) -> None:
        self.session = session
        self.wire = wire
        cfg = session.cfg
        self.plan = pruning.PruningPlan(cfg.rounds, cfg.schedule_b, cfg.schedule_c)
        self.settled_round = 0
        self.votes: dict[int, bool] = {}
        self.own: dict[int, bytes] = {}
        """What this agent published after each recent round (its model, or with --wire
        layers its divergence vector), re-sent on request."""
        self.subscribed: set[str] = set()
        self._needs: dict[int, set[Need]] = {}
        self.resumed_after: int | None = None
        """The round this agent resumed after, when it restarted from its checkpoint."""
        self.screening_log = ScreeningLog(cfg, centralized=False)

    # ------------------------------------------------------------------ needs

    def needs(self, round_: int) -> set[Need]:
        """(round, sender) of every model round `round_` aggregates (1.3); a round's needs
        are asked for several times (look-ahead, waiting, checkpoints), drawn once."""
        if round_ not in self._needs:
            s = self.session
            self._needs[round_] = RoundTopology(s.config.seed, round_, s.roster, s.cfg).needs(s.me)
            if len(self._needs) > 2 * (LOOKAHEAD_ROUNDS + 1):  # the earliest are done
                del self._needs[min(self._needs)]
        return set(self._needs[round_])

    def live(self, needs: set[Need]) -> set[Need]:
        """The needs that count (`live`: a neighbour that stopped early is left out of the
        rounds after its stop; a quarantined one of every round, as it is known to be), as
        far as this agent knows of stops yet."""
        inbox = self.session.inbox
        quarantined = inbox.quarantine.members()
        return {n for n in live(needs, inbox.stopped_agents()) if n[1] not in quarantined}

    def ahead(self, round_: int) -> set[Need]:
        """The announced needs of round `round_` and the few after it."""
        upcoming = range(round_, min(round_ + LOOKAHEAD_ROUNDS, self.session.cfg.rounds) + 1)
        return {need for r in upcoming for need in self.live(self.needs(r)) if need[0] >= 1}

    # ------------------------------------------------------------------ wiring

    def subscribe(self) -> None:
        s = self.session
        if not s.run_info.keeper:  # with a keeper, its tallies carry every vote
            s.transport.subscribe(topics.round_topic(s.fleet, "+", "vote"), s.inbox.on_vote)
        s.transport.subscribe(topics.round_topic(s.fleet, "+", "request", to=s.me), self.serve)
        s.transport.subscribe(topics.round_topic(s.fleet, "+", "resend", to=s.me), self.on_resend)

    def prepare_start(self) -> None:
        self.subscribe_ahead(1)

    def subscribe_ahead(self, round_: int) -> None:
        """Subscribe to the models of the next few rounds before anyone publishes them (with
        --wire delta to every peer's models: deltas build on each other; see `listened`)."""
        wanted = self.wire.wanted(round_, listened(self))
        for topic in sorted(wanted - self.subscribed):
            self.session.transport.subscribe(topic, self.wire.on_announcement)
        for topic in self.subscribed - wanted:
            self.session.transport.unsubscribe(topic)
        self.subscribed = wanted

    def serve(self, topic: str, payload: bytes) -> None:
        """Answer a neighbour that asks for layers of one of our recent models (--wire
        layers), or for what we published after a round (it missed it: the copy goes to it
        alone, once per its session)."""
        s = self.session
        request = s.inbox.decode_request(topic, payload)
        if request is None or request.target != s.me:
            return
        if request.layers:
            if s.inbox.may_answer(request):
                self.wire.serve(request)
            return
        data = self.own.get(request.round)
        if data is not None and s.inbox.may_answer(request):
            log.info("re-sending round %d to %s", request.round, request.sender)
            s.transport.publish(s.topic(request.round, "resend", s.me, to=request.sender), data)

    def on_resend(self, topic: str, payload: bytes) -> None:
        """A copy of a peer's announcement sent to this agent alone: checked and stored as
        the announcement on the peer's own topic would be."""
        s = self.session
        try:
            _, _, fields = topics.parse(topic)
            own_topic = s.topic(int(fields["round"]), self.wire.announcement, fields["agent"])
        except (ProtocolError, ValueError) as exc:
            s.inbox.reject("resend", "?", topic, exc)
            return
        self.wire.on_announcement(own_topic, payload)

    def request(self, missing: set[Need], layers: list[str] | None = None) -> None:
        """Ask each (round, target) for its model again, or for these `layers` of it."""
        s = self.session
        for round_, target in sorted(missing):
            message = messages.Request(
                **s.header(round_), target=target, layers=layers or [], since=s.born
            )
            s.transport.publish(
                s.topic(round_, "request", s.me, to=target), messages.encode(message, key=s.key)
            )

    def republish(self) -> None:
        s = self.session
        for round_, data in self.own.items():
            s.transport.publish(s.topic(round_, self.wire.announcement, s.me), data)

    def resumed(self, done: int) -> None:
        self.resumed_after = done
        self.wire.resumed(done)

    def close(self) -> None:
        self.wire.close()

    # ------------------------------------------------------------------ round

    def await_needs(
        self, round_: int, needs: set[Need], deadline: float, have: Have, wait: Wait
    ) -> set[Need]:
        """Wait for the announcement (`have`/`wait`: models, or divergence vectors) of every
        live need, asking again for the missing when `Asking` says so, until the deadline;
        returns the live needs, fewer when a neighbour stops early meanwhile."""
        s = self.session
        check_every_s = s.timeouts.request_every_s
        returned = self.resumed_after is not None and round_ == self.resumed_after + 1
        asking = Asking(s.transport, check_every_s, s.inbox.reported_done, returned)
        awaited = self.live(needs)
        while True:
            missing = wait(awaited, asking.pause(check_every_s, deadline))
            if (now := self.live(needs)) != awaited:  # a neighbour stopped early meanwhile
                awaited = now
                continue
            if not missing or time.monotonic() >= deadline or self.session.stop.is_set():
                return awaited
            self.request(asking.to_ask(missing))

    def prune_now(self, round_: int) -> bool:
        """Settle the tallies of rounds <= round_ // 2, then ask the plan."""
        s = self.session
        if not s.learner.prunes_further:
            return False
        while self.settled_round < round_ // 2:
            r = self.settled_round + 1
            votes = s.inbox.wait_votes(r, s.roster, vote_wait_s(s))
            settle_votes(self.plan, r, votes, s.roster, s.inbox.stopped_agents(), s.cfg.delta_v)
            self.settled_round = r
        return self.plan.is_pruning_round(round_)

    def run_round(self, round_: int) -> AgentRound:
        s = self.session
        started = time.monotonic()
        self.subscribe_ahead(round_)
        inbox, stragglers, chosen = gathered(self, round_)
        waited = time.monotonic() - started
        prune_now = self.prune_now(round_)
        budget = s.budget()
        p_k = budget.p_k if budget else None
        meter = ActivationMeter()
        with compute_slot():
            compute_started = time.monotonic()
            with meter.measuring():
                result, reduction = train_round(
                    s.learner,
                    s.state,
                    s.data,
                    inbox,
                    round_,
                    prune_now,
                    p_k,
                    s.costs.table if s.costs else None,
                    budget.allowed_mb if budget else None,
                    None if chosen is None else chosen.weights,
                )
        if s.costs is not None:
            clock = s.after_reduced_compute(compute_started, reduction)
        else:
            slept = s.after_compute(compute_started, result.train_flops)
            clock = RoundClock(slept, time.monotonic() - compute_started, None)
        result, settle_slept = settled(s, result, p_k)
        before, s.state = s.state.weights, result.state
        if result.recovered:
            log.warning("round %d: model not finite; kept the model from before it", round_)
        self.screening_log.say(round_, result.screening)
        stops = s.stops_after(result.state.weights, result.train_loss, result.pruned)
        attacker = s.me in attackers(s.config, s.roster)  # research: it sends poisoned models
        sent = attacked(s.learner, result, s.config.attack, round_, before) if attacker else result
        nonzeros = self.publish(round_, sent, poisoned=sent is not result)
        return AgentRound.of_result(
            round_,
            s.me,
            result,
            reduction,
            reported_p_k(p_k, s.learner.traits.budgets),
            nonzeros_sent=nonzeros,
            limited_by=budget.limited_by if budget else "none",
            throttled_s=round(clock.throttled_s + settle_slept, 3),
            train_s=round(clock.train_s, 4),
            predicted_s=None if clock.predicted_s is None else round(clock.predicted_s, 4),
            peak_memory_mb=round(meter.megabytes + working_set_mb(s.learner.facts, reduction), 2),
            stragglers=stragglers,
            wait_s=round(waited, 3),
            staleness=None if chosen is None else chosen.staleness,
            t_star=self.plan.t_star,
            stopped=stops,
        )

    def publish(self, round_: int, result: RoundResult, poisoned: bool = False) -> int:
        """Publish the round's announcement (once for all receivers) and the vote; returns
        the values sent: the model's, or the layers' published since the last round. A
        `poisoned` model goes out even when not finite (`--attack nan`: what its receivers
        do with it is the point)."""
        s = self.session
        if not poisoned and not all_finite(result.published.weights):
            # Receivers would reject it (and a divergence vector of it cannot be encoded).
            log.error("round %d: training diverged (weights not finite); model not sent", round_)
            data = resend = b""
            sent = Published({}, None, 0)
        else:
            data, resend, sent = self.wire.encode(round_, result)
        if not s.learner.traits.alone:
            for old in [r for r in self.own if r <= round_ - KEEP_OWN_ROUNDS]:
                del self.own[old]
                self.wire.forget(old)
            if data:
                self.own[round_] = resend  # re-sent to a peer that asks for it
                s.send(s.topic(round_, self.wire.announcement, s.me), data)
        if result.vote is not None and s.learner.prunes_further:
            self.vote(round_, result)
        return values_sent(sent.weights, sent.masks) + self.wire.take_served()

    def vote(self, round_: int, result: RoundResult) -> None:
        """Record and publish this agent's pruning vote of the round."""
        s = self.session
        assert result.vote is not None
        self.votes[round_] = result.vote
        s.inbox.record_votes(s.me, {round_: result.vote})
        vote = messages.Vote(
            **s.header(round_),
            vote=result.vote,
            score=result.score if result.score is not None else 0.0,
        )
        s.transport.publish(s.topic(round_, "vote", s.me), messages.encode(vote, key=s.key))

    # ------------------------------------------------------------------ persistence

    def checkpoint(self, round_: int) -> dict[str, Any]:
        return {
            "own": dict(self.own),
            "held": self.held(round_),
            "votes": self.votes,
            "settled_round": self.settled_round,
            "t_star": self.plan.t_star,
            **self.wire.checkpoint(),
        }

    def held(self, round_: int) -> dict[str, dict[str, Any]]:
        """Peers' models to keep across a restart: this round's and next round's."""
        s = self.session
        models, vectors = held_models(s.inbox, (round_, round_ + 1))
        roster = set(s.roster)
        held: dict[str, dict[str, Any]] = {}
        for r, j in sorted(key for key in models.keys() | vectors.keys() if key[1] in roster):
            if (p := models.get((r, j))) is not None:
                held[f"{r}|{j}"] = checkpoint.saved_model(p)
            else:  # --wire layers
                layers = {
                    layer: checkpoint.saved_model(p)
                    for layer, p in s.inbox.held_layers(r, j).items()
                }
                held[f"{r}|{j}"] = {"divergence": vectors[(r, j)], "layers": layers}
        return held

    def restore(self, saved: dict[str, Any]) -> None:
        s = self.session
        self.own = dict(saved["own"])
        self.votes = {int(r): bool(v) for r, v in saved["votes"].items()}
        s.inbox.record_votes(s.me, self.votes)
        for key, model in saved["held"].items():
            r, j = key.split("|")
            if "divergence" in model:
                layers = {
                    layer: checkpoint.restored_model(p) for layer, p in model["layers"].items()
                }
                s.inbox.put_announced(int(r), j, model["divergence"], layers)
            else:
                s.inbox.put_model(int(r), j, checkpoint.restored_model(model))
        cfg = s.cfg
        self.plan = pruning.PruningPlan(
            cfg.rounds, cfg.schedule_b, cfg.schedule_c, t_star=saved["t_star"]
        )
        self.plan._last_round = saved["settled_round"]
        self.settled_round = saved["settled_round"]
        self.wire.restore(saved)


def gathered(
    rounds: DecentralizedRounds, round_: int
) -> tuple[dict[str, Published], list[str], Freshest | None]:
    """Round `round_`'s inbox and stragglers: the wire format's, waiting up to the round
    timeout; asynchronously, at once, what is held (`freshest_held`: its stragglers the
    neighbours left out as too stale) and what was taken of whom."""
    s, needs = rounds.session, rounds.needs(round_)
    if not s.cfg.asynchronous:
        deadline = time.monotonic() + s.timeouts.round_s
        return *rounds.wire.gather(round_, needs, deadline, rounds), None
    inbox, chosen = freshest_held(s, rounds.live(needs))
    for sender in chosen.ignored:
        log.info("round %d: nothing of %s within --max-staleness: left out", round_, sender)
    return inbox, chosen.ignored, chosen


def listened(rounds: DecentralizedRounds) -> Callable[[int], set[Need]]:
    """The needs whose models an agent listens for from a round on: those of the next few
    rounds (`DecentralizedRounds.ahead`); asynchronously with each need's `--max-staleness`
    rounds before it too (`stale_window`), which a neighbour that is behind publishes late."""
    if not rounds.session.cfg.asynchronous:
        return rounds.ahead
    stale = rounds.session.cfg.max_staleness
    return lambda round_: stale_window(rounds.ahead(round_), stale)


def vote_wait_s(session: Session) -> float:
    """How long to wait for a round's votes before settling its tally: the vote timeout, or
    asynchronously not at all (a missing vote counts 0)."""
    return 0.0 if session.cfg.asynchronous else session.timeouts.vote_s


def settled(session: Session, result: RoundResult, p_k: float | None) -> tuple[RoundResult, float]:
    """A round once the device judged it (`settle_round`): its local-only model trains here,
    off the budgeted round's clock (the budget is the strategy's), and an emulated board
    sleeps out that model's FLOPs too. Returns the result and the seconds slept."""
    with compute_slot():
        started = time.monotonic()
        result = settle_round(session.learner, result, session.data, p_k)
    flops = result.judged.fallback_flops if result.judged else 0
    if session.throttle is None or not flops:
        return result, 0.0
    return result, session.throttle.after_compute(time.monotonic() - started, flops)
