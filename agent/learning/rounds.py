"""The rules of a round, written once.

The simulator (`coordinator.simulate`), the networked agent (`agent.runtime`) and the
coordinator's aggregator (`coordinator.aggregator`) all call these functions, so that a fleet
on a real network computes exactly what the simulator computes: nothing here waits, sends or
reads a clock; callers bring what arrived and these decide what it means.

Decentralized rounds (ALGORITHMS.md 1.2-1.8): `RoundTopology` says whom agent k needs in round
t (this round's models of its prior neighbours, last round's of the others), `live` which of
them count once neighbours stopped early, `settle_votes` how a round's votes settle the
pruning plan, `train_round` the budgeted local round. A centralized round's steps, in their
order, are `agent.learning.central.participant`'s and `agent.learning.central.server`'s. Under
attack and faults: `attacked` and `attacked_upload` (what an attacker sends instead of its
round's model), `checked_fit` and `checked_aggregate` (a non-finite model is never kept or
sent: the round is undone).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import cast

import torch

from agent.learning import fallback, ldf, pruning, robust, robust_rules, strategies, topology
from agent.learning.central import Aggregate, CentralStrategy, Fit, Payload, ServerState
from agent.learning.central.base import Upload
from agent.learning.config import StrategyConfig
from agent.learning.costs import CostTable
from agent.learning.learner import (
    AgentState,
    Learner,
    LocalData,
    Published,
    RoundResult,
)
from agent.learning.reduction import Reduction, local_reduction
from agent.learning.sparse import State

Need = tuple[int, str]
"""(round, sender): a model a round aggregates."""


class RoundTopology:
    """Round t's reuse order and neighbour sets (ALGORITHMS.md 1.2-1.3): pure functions of
    (seed, t, roster), so every agent computes everyone's without a server. A neighbour set is
    drawn when first asked for: an agent needs only its own (O(K) work), the simulator
    everyone's."""

    def __init__(self, seed: int, round_: int, roster: Sequence[str], cfg: StrategyConfig):
        self.round = round_
        self.order = topology.reuse_order(seed, round_, roster)
        self._seed, self._roster, self._cfg = seed, list(roster), cfg
        self._neighbours: dict[str, list[str]] = {}
        self._split: dict[str, tuple[list[str], list[str]]] = {}
        self._positions = topology.positions(self.order)
        self._draw: topology.NeighbourDraw | None = None

    def neighbours(self, agent: str) -> list[str]:
        """`agent`'s neighbour set G_k^t, sorted by id; under a strategy whose agents train
        `alone` (local) nobody has any."""
        if agent not in self._neighbours:
            self._neighbours[agent] = self._drawn(agent)
        return self._neighbours[agent]

    def _drawn(self, agent: str) -> list[str]:
        cfg = self._cfg
        if strategies.strategy(cfg.strategy).alone:
            return []
        if cfg.topology != "random":
            kind = cast(topology.Topology, cfg.topology)  # validated by ExperimentConfig
            return topology.neighbours(
                self._seed, self.round, self._roster, agent, cfg.neighbours, kind
            )
        if self._draw is None:  # shared by every agent's draw of the round
            self._draw = topology.NeighbourDraw(self._seed, self.round, self._roster)
        return self._draw(agent, cfg.neighbours)

    def prior_posterior(self, agent: str) -> tuple[list[str], list[str]]:
        """The neighbours whose round-t models `agent` waits for, and the others (their
        round t-1 models), each in reuse order."""
        if agent not in self._split:
            self._split[agent] = topology.prior_posterior(
                self._positions, self.neighbours(agent), agent, self._cfg.max_wait
            )
        return self._split[agent]

    def needs(self, agent: str) -> set[Need]:
        """(round, sender) of every model `agent`'s round aggregates."""
        prior, posterior = self.prior_posterior(agent)
        return {(self.round, j) for j in prior} | {(self.round - 1, j) for j in posterior}


def live(needs: Iterable[Need], stopped: Mapping[str, int]) -> set[Need]:
    """The needs whose sender trained in that round: a neighbour that stopped early after
    round s is left out of every aggregate that needs its model of a later round, as if it
    had left. Its last model standing in for it instead cost the DA-DPFL agents that trained
    on 1.7 points on digits, against 0.3 left out (early stopping, 10 seeds, at the same cut:
    studies/early_stopping.py): a stale model pulls its neighbours back to where it stopped."""
    return {(r, j) for r, j in needs if running(j, r, stopped)}


def running(agent: str, round_: int, stopped: Mapping[str, int]) -> bool:
    """Whether `agent` trains in `round_` (it had not stopped before it)."""
    return stopped.get(agent, round_) >= round_


def settle_votes(
    plan: pruning.PruningPlan,
    round_: int,
    votes: Mapping[str, bool],
    roster: Sequence[str],
    stopped: Mapping[str, int],
    delta_v: float,
) -> None:
    """Settle round `round_`'s tally (ALGORITHMS.md 1.7): the votes of the agents still
    running count, a missing vote counts 0."""
    voters = [j for j in roster if running(j, round_, stopped)]
    plan.observe(round_, pruning.tally(votes, voters, delta_v))


def train_round(
    learner: Learner,
    state: AgentState,
    data: LocalData,
    inbox: dict[str, Published],
    round_: int,
    prune_now: bool,
    p_k: float | None,
    costs: CostTable | None = None,
    memory_mb: float | None = None,
    weights: Mapping[str, float] | None = None,
) -> tuple[RoundResult, Reduction]:
    """A decentralized agent's local round, cut to its budget p_k first (`--reduce`): the
    reduction (`local_reduction`, by counted FLOPs or by the measured `costs`, within
    `memory_mb`) and then `Learner.local_round` (`weights`: the senders' staleness weights
    of an asynchronous round)."""
    reduction = local_reduction(
        learner.facts, p_k, state.masks, costs=costs, round_=round_, memory_mb=memory_mb
    )
    result = learner.local_round(
        state, data, inbox, round_, prune_now, reduction=reduction, sender_weights=weights
    )
    return result, reduction


def settle_round(
    learner: Learner, result: RoundResult, data: LocalData, p_k: float | None
) -> RoundResult:
    """A decentralized round once the device judged it (`fallback.settle`): its local-only
    model's round, and the model it keeps. Apart from `train_round`, so that a device times
    its budgeted round without the local model's (which its budget does not cover)."""
    return fallback.settle(learner, result, data, p_k)


def layers_to_fetch(
    divergences: Mapping[str, Mapping[str, float]], ldf_n: int
) -> dict[str, list[str]]:
    """`--wire layers`: per neighbour, the layers an agent fetches, FedLDF's selection among
    its neighbours: per layer the `ldf_n` most diverged of those whose vectors it holds.
    Round-0 models are derivable (no vector: taken whole); a neighbour picked for no layer
    counts for none."""
    return ldf.select_layers(divergences, ldf_n) if divergences else {}


def attacked(
    learner: Learner,
    result: RoundResult,
    attack: str,
    round_: int,
    before: State | None = None,
    colluders: robust.Colluders | None = None,
) -> RoundResult:
    """A decentralized attacker's round: its state stays its own, what it publishes is
    poisoned as a centralized attacker's upload is (`attacked_payload`), stepping from
    `before`, its model before the round."""
    published = result.published
    sent = attacked_payload(
        learner,
        Payload(published.weights, published.masks),
        attack,
        result.state.agent_id,
        round_,
        before,
        colluders,
    )
    return dataclasses.replace(
        result, published=dataclasses.replace(published, weights=sent.weights)
    )


def attacked_payload(
    learner: Learner,
    payload: Payload,
    attack: str,
    agent_id: str,
    round_: int,
    reference: State | None = None,
    colluders: robust.Colluders | None = None,
) -> Payload:
    """An attacker's upload, poisoned (`robust.poison`, noise drawn from the fleet seed, the
    agent and the round); `reference` is the model it trained from (`inflate`, `ipm` and
    `replace` step from it), `colluders` what `alie` attackers pool."""
    generator = learner.facts.generator("attack", agent_id, round_)
    poisoned = robust.poison(
        payload.weights, payload.masks, attack, generator, reference, colluders
    )
    return Payload(poisoned, payload.masks)


def attacked_upload(
    learner: Learner,
    upload: Upload,
    attack: str,
    agent_id: str,
    round_: int,
    reference: State,
    colluders: robust.Colluders | None = None,
) -> Upload:
    """A centralized attacker's upload (the simulator's and the networked participant's):
    its payload poisoned around `reference`, the global model it trained from
    (`attacked_payload`), and the sample count its attack claims: the protocol's largest
    under `inflate`, else its own."""
    payload = attacked_payload(
        learner, upload.payload, attack, agent_id, round_, reference, colluders
    )
    claimed = robust_rules.INFLATED_SAMPLES if attack == "inflate" else upload.num_samples
    return Upload(payload, claimed)


def _neutral(payload: Payload, reference: State) -> Payload:
    """A payload of `payload`'s layout that changes nothing: `reference`'s values where it
    has the tensor (a model), zeros elsewhere (a delta)."""
    weights = {
        n: reference[n].clone() if n in reference else torch.zeros_like(t)
        for n, t in payload.weights.items()
    }
    return Payload(weights, payload.masks)


def checked_fit(fit: Fit, before: AgentState, view: ServerState) -> tuple[Fit, bool]:
    """A centralized participant's fit, undone when its model or upload is not finite (a
    poisoned global model, a diverged step): the participant keeps its model from before the
    round and uploads what changes nothing. Returns the fit and whether it was undone."""
    if robust.finite(fit.state.weights) and robust.finite(fit.upload.weights):
        return fit, False
    undone = dataclasses.replace(
        fit,
        state=dataclasses.replace(
            before, round=fit.state.round, dp_steps=fit.state.dp_steps
        ),  # its DP steps were taken all the same
        upload=_neutral(fit.upload, view.weights),
        divergence=None if fit.divergence is None else dict.fromkeys(fit.divergence, 0.0),
    )
    return undone, True


def checked_aggregate(
    strategy: CentralStrategy, server: ServerState, aggregate: Aggregate
) -> tuple[Aggregate, bool]:
    """The aggregator's round, undone when its new state or broadcast is not finite: the
    server keeps its state and broadcasts what changes nothing. Returns it and whether it
    was undone."""
    new = aggregate.server
    states = [new.weights, new.m or {}, new.v or {}, aggregate.broadcast.weights]
    if all(robust.finite(s) for s in states):
        return aggregate, False
    broadcast = aggregate.broadcast
    if strategy.broadcasts and broadcast.weights:
        broadcast = _neutral(broadcast, server.weights)
    return Aggregate(server, broadcast), True
