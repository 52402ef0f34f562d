"""FedSPU (ALGORITHMS.md 2) and its baseline, federated dropout: each participant trains a
random fraction of the neurons, and only that active part travels, both ways.

    fedspu   the rest is frozen and stays personal
    feddrop  the agent trains the sub-model of the same active neurons; the rest is dropped
"""

from __future__ import annotations

import abc
from collections.abc import Mapping

import torch

from agent.learning import freezing, robust
from agent.learning.central.base import (
    Aggregate,
    CentralStrategy,
    Fit,
    FitContext,
    Payload,
    ServerState,
    Upload,
    clipped_uploads,
    sample_weights,
    train_sgd,
    voted,
)
from agent.learning.model_facts import ModelFacts
from agent.learning.reduced import frozen_training_flops
from agent.learning.reduction import active_fraction
from agent.learning.sparse import Masks
from agent.learning.training import TrainResult

STATIC_TIERS = (0.2, 0.4, 0.6, 0.8, 1.0)


def static_tier(roster: list[str], agent_id: str) -> float:
    """p_k without a measured budget: FedSPU's paper tiers 0.2, 0.4, ..., 1.0 in turn, by the
    agent's place in the sorted roster (with device profiles the budget decides)."""
    return STATIC_TIERS[sorted(roster).index(agent_id) % len(STATIC_TIERS)]


class ActivePart(CentralStrategy):
    """What FedSPU and federated dropout share: each participant downloads, trains and
    uploads this round's active neurons (drawn from its seed), and the aggregator averages
    each value over the participants it was active at; nothing is broadcast."""

    personal = True
    downloads = True
    broadcasts = False

    @abc.abstractmethod
    def fraction(self, p_k: float) -> float:
        """The fraction of the neurons active at a participant with budget p_k."""

    def active(
        self, learner: ModelFacts, server: ServerState, agent_id: str, round_: int, p_k: float
    ) -> Masks:
        """This round's active neurons of a participant with budget p_k, drawn from its seed
        (the aggregator draws the same for its download as the participant for its fit)."""
        generator = learner.generator("active", agent_id, round_)
        return freezing.active_masks(
            learner.freezing_plan, server.weights, self.fraction(p_k), generator
        )

    @abc.abstractmethod
    def train_active(
        self, learner: ModelFacts, ctx: FitContext, active: Masks
    ) -> tuple[TrainResult, int]:
        """The local training of a participant's round, and its FLOPs per sample."""

    def fit(self, learner: ModelFacts, ctx: FitContext) -> Fit:
        active = self.active(learner, ctx.view, ctx.agent_id, ctx.round, ctx.p_k)
        trained, flops = self.train_active(learner, ctx, active)
        upload = Payload(trained.state, active)
        return ctx.fitted(
            trained.state, upload, trained.mean_loss, flops * trained.samples, trained.dp_steps
        )

    def download(
        self, learner: ModelFacts, server: ServerState, agent_id: str, round_: int, p_k: float
    ) -> Payload:
        return Payload(server.weights, self.active(learner, server, agent_id, round_, p_k))

    def aggregate(
        self, learner: ModelFacts, server: ServerState, uploads: Mapping[str, Upload]
    ) -> Aggregate:
        held = {k: _all_masks(u.payload) for k, u in uploads.items()}
        states, rule = clipped_uploads(
            learner, server.weights, {k: u.payload.weights for k, u in uploads.items()}, held
        )
        if rule.robust:
            weights = robust.aggregate_onto(server.weights, states, rule, held)
        else:
            mean = freezing.aggregate_active(
                server.weights,
                {k: (states[k], held[k]) for k in states},
                sample_weights(learner, uploads),
            )
            weights = voted(rule, server.weights, states, mean, held)
        return Aggregate(ServerState(weights), Payload({}))


def _all_masks(payload: Payload) -> Masks:
    """A payload's masks, all True for a tensor sent whole."""
    masks = payload.masks or {}
    return {
        n: masks[n] if n in masks else torch.ones_like(t, dtype=torch.bool)
        for n, t in payload.weights.items()
    }


class FedSPU(ActivePart):
    """Freeze a random 1 - p_k of the neurons; exchange and aggregate the active part only."""

    name = "fedspu"
    trains_own = True

    def fraction(self, p_k: float) -> float:
        """As ALGORITHMS.md section 2 decides for a frozen model (`active_fraction`)."""
        return active_fraction(p_k)

    def train_active(
        self, learner: ModelFacts, ctx: FitContext, active: Masks
    ) -> tuple[TrainResult, int]:
        """Train the agent's own model with the global active part, the rest frozen (which
        still runs forward and passes gradients back)."""
        start = freezing.overwrite_active(ctx.state.weights, ctx.view.weights, active)
        trained = train_sgd(learner, ctx, start, frozen=active)
        return trained, frozen_training_flops(learner, None, active)


class FedDropout(ActivePart):
    """Train the sub-model of the active neurons; the dropped rest is not kept.

    Its accuracy is the trained sub-model's: in federated dropout that is the model an agent
    has and would run (FedSPU's comparison is of these local models)."""

    name = "feddrop"

    def fraction(self, p_k: float) -> float:
        """p_k itself: the trained sub-model keeps that fraction of the neurons."""
        return p_k

    def train_active(
        self, learner: ModelFacts, ctx: FitContext, active: Masks
    ) -> tuple[TrainResult, int]:
        """Train the global model's sub-model of the active neurons alone."""
        start = freezing.submodel(ctx.view.weights, active)
        trained = train_sgd(learner, ctx, start, masks=active)
        return trained, 3 * learner.forward_flops(active)
