"""`simulate --asynchronous`: decentralized rounds in the order a fleet that never waits
would run them, on the simulator's virtual clock (`coordinator.virtual_clock`).

Agent k's round t starts when its round t-1 ended (`VirtualClock.finish`, which also places
the offline spans of a device whose availability is modelled) and takes, for each model its
synchronous round would aggregate (`RoundTopology.needs`), the newest one that neighbour had
published by then, weighted by its staleness (`agent.learning.asynchronous.freshest`: more
than `--max-staleness` rounds stale, it is left out). Rounds run one at a time in the order
of their virtual start, so every model a round takes was computed before it. The pruning
plan settles round r's tally when the first agent reaches a round that needs it (2r or
later; `DecentralizedRounds.prune_now`), from the votes of the rounds r that had ended by
then, a missing vote counting 0, as an agent that does not wait settles it. Each record
carries the virtual time its round ended (`finished_at`, seconds from the start) and the
mean staleness of what it took (`staleness`); traffic is each published model message once
to its sender and once to each receiver that took it (votes aside).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from agent.learning import Published, RoundTopology, live, running, settle_votes
from agent.learning.asynchronous import Freshest, freshest
from agent.report import AgentRound, Traffic
from coordinator.traffic import as_received, message_size
from coordinator.training_pool import RoundJob
from coordinator.virtual_clock import VirtualClock

if TYPE_CHECKING:
    from agent.device import Budget
    from agent.experiment import ExperimentConfig
    from agent.learning import Learner, LocalData, Reduction, RoundResult
    from agent.learning.costs import CostTable
    from agent.learning.pruning import PruningPlan
    from coordinator.training_pool import StateStore, Training


class Fleet(Protocol):
    """What an asynchronous run reads of the simulation (`coordinator.simulate.Simulation`),
    which calls it: the fleet, its rounds' shared steps and its report's round."""

    config: ExperimentConfig
    roster: list[str]
    learner: Learner
    data: dict[str, LocalData]
    states: StateStore
    training: Training
    budgets: dict[str, Budget]
    costs: CostTable | None
    plan: PruningPlan
    stopped: dict[str, int]

    def finish_round(
        self, k: str, t: int, result: RoundResult, reduction: Reduction
    ) -> tuple[RoundResult, AgentRound]: ...

    def round_record(
        self, t: int, order: list[str], ran: dict[str, AgentRound], traffic: dict[str, Traffic]
    ) -> dict[str, Any]: ...


@dataclasses.dataclass(frozen=True)
class Held:
    """A model an agent published: when its round ended (virtual seconds) and the model."""

    finished_at: float
    model: Published


class AsynchronousRun:
    """One simulated run of asynchronous decentralized rounds (see the module docstring)."""

    def __init__(self, sim: Fleet) -> None:
        self.sim = sim
        self.cfg = sim.config.learning
        self.clock = VirtualClock.of(sim.config, sim.roster)
        self.history: dict[str, dict[int, Held]] = {
            k: {0: Held(0.0, sim.learner.published(s, len(sim.data[k].y_train)))}
            for k, s in sim.states.items()
        }  # round 0: the models everyone derives, held from the start
        self.ran: dict[int, dict[str, AgentRound]] = {}
        self.traffic: dict[int, dict[str, Traffic]] = {}
        self.topologies: dict[int, RoundTopology] = {}
        self.settled = 0
        self.received: set[tuple[str, str, int]] = set()
        """(receiver, sender, round) of the model messages delivered."""

    def topology(self, t: int) -> RoundTopology:
        if t not in self.topologies:
            sim = self.sim
            self.topologies[t] = RoundTopology(sim.config.seed, t, sim.roster, self.cfg)
        return self.topologies[t]

    def rounds(self, progress: Callable[[int, str], None] | None) -> list[dict[str, Any]]:
        """Every agent's rounds in the order of their virtual start; the report's rounds."""
        sim = self.sim
        queue = [(0.0, index, k) for index, k in enumerate(sim.roster)]
        next_round = dict.fromkeys(sim.roster, 1)
        while queue:
            now, index, k = heapq.heappop(queue)
            t = next_round[k]
            if t > self.cfg.rounds or not running(k, t, sim.stopped):
                continue
            ended = self.run_round(k, t, now)
            next_round[k] = t + 1
            heapq.heappush(queue, (ended, index, k))
            if progress:
                progress(t, k)
        return self.records()

    def newest(self, now: float) -> Callable[[str, int], int | None]:
        """The newest round <= the one asked of which a sender's model had ended by `now`."""

        def held(sender: str, up_to: int) -> int | None:
            ended = [r for r, h in self.history[sender].items() if r <= up_to]
            ended = [r for r in ended if self.history[sender][r].finished_at <= now]
            return max(ended, default=None)

        return held

    def run_round(self, k: str, t: int, now: float) -> float:
        """Agent k's round t, started at virtual time `now`; returns when it ends."""
        sim, cfg = self.sim, self.cfg
        self.settle_votes(t, now)
        needs = live(self.topology(t).needs(k), sim.stopped)
        chosen = freshest(needs, self.newest(now), cfg.max_staleness, cfg.staleness_weight)
        inbox = {j: self.history[j][taken.round].model for j, taken in chosen.taken.items()}
        prune_now = sim.plan.is_pruning_round(t)
        job = RoundJob(
            k,
            sim.states.held(k),
            inbox,
            t,
            prune_now,
            sim.budgets.get(k),
            sim.costs,
            chosen.weights,
        )
        future = sim.training.local_round(job)
        sim.training.started()
        result, reduction = future.result()
        result, record = sim.finish_round(k, t, result, reduction)
        sent = self.charge(k, t, result.published, chosen)
        ended = self.clock.finish(k, now, self.clock.seconds(k, record.train_flops, sent))
        self.history[k][t] = Held(ended, as_received(result.published, cfg.fp16))
        self.ran.setdefault(t, {})[k] = dataclasses.replace(
            record, staleness=chosen.staleness, finished_at=ended
        )
        return ended

    def charge(self, k: str, t: int, published: Published, chosen: Freshest) -> int:
        """Count round t's traffic of k: its model message sent, the models it took received
        (once each: a model taken again came in before). Returns the bytes it moved."""
        traffic = self.traffic.setdefault(t, {})
        spent = traffic.setdefault(k, Traffic())
        size, nonzeros = message_size(t, k, published, self.cfg.fp16)
        spent.sent += size
        spent.nonzeros_sent += nonzeros
        for j, taken in chosen.taken.items():
            if taken.round and (k, j, taken.round) not in self.received:
                self.received.add((k, j, taken.round))
                held = self.history[j][taken.round].model
                spent.received += message_size(taken.round, j, held, self.cfg.fp16)[0]
        return spent.sent + spent.received

    def settle_votes(self, t: int, now: float) -> None:
        """Settle the tallies of rounds <= t // 2 not settled yet, from the votes of the
        rounds that had ended by `now` (a missing vote counts 0)."""
        sim = self.sim
        if not sim.learner.prunes_further:
            return
        while self.settled < t // 2:
            r = self.settled + 1
            votes = {
                j: bool(record.vote)
                for j, record in self.ran.get(r, {}).items()
                if record.vote is not None and (record.finished_at or 0.0) <= now
            }
            settle_votes(sim.plan, r, votes, sim.roster, sim.stopped, self.cfg.delta_v)
            self.settled = r

    def records(self) -> list[dict[str, Any]]:
        """The report's rounds: each round's records, with their virtual end."""
        rounds = []
        for t in sorted(self.ran):
            traffic = {k: self.traffic.get(t, {}).get(k, Traffic()) for k in self.sim.roster}
            record = self.sim.round_record(t, self.topology(t).order, self.ran[t], traffic)
            for k, entry in record["agents"].items():
                if k in self.ran[t]:
                    entry["finished_at"] = round(self.ran[t][k].finished_at or 0.0, 6)
            rounds.append(record)
        return rounds
