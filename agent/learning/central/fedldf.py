"""FedLDF (ALGORITHMS.md 4): divergence vectors first, then each layer from its n most
divergent participants only."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from agent.learning import ldf, robust
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
    voted,
)
from agent.learning.central.fedavg import full_model_fit
from agent.learning.model_facts import ModelFacts


class FedLDF(CentralStrategy):
    """Divergence vectors first; each layer then from its n most divergent participants."""

    name = "fedldf"
    asks_layers = True

    def fit(self, learner: ModelFacts, ctx: FitContext) -> Fit:
        """FedAvg's local round, uploading nothing yet: only the per-layer divergence."""
        fit = full_model_fit(learner, ctx)
        groups = learner.layer_groups
        return dataclasses.replace(
            fit,
            upload=Payload({}),
            divergence=ldf.divergences(fit.state.weights, ctx.view.weights, groups),
        )

    def select(
        self, learner: ModelFacts, divergences: Mapping[str, dict[str, float]]
    ) -> dict[str, list[str]]:
        return ldf.select_layers(divergences, learner.config.ldf_n)

    def respond(self, learner: ModelFacts, fit: Fit, layers: list[str]) -> Payload:
        return Payload(ldf.partial_state(fit.state.weights, layers, learner.layer_groups))

    def aggregate(
        self, learner: ModelFacts, server: ServerState, uploads: Mapping[str, Upload]
    ) -> Aggregate:
        states, rule = clipped_uploads(
            learner,
            server.weights,
            {k: u.payload.weights for k, u in uploads.items() if u.payload.weights},
        )
        weights = ldf.aggregate_layers(
            states, sample_weights(learner, uploads), learner.layer_groups, server.weights
        )  # also what validates the uploads
        weights = voted(rule, server.weights, states, weights)
        if rule.robust:
            weights = robust.aggregate_onto(server.weights, states, rule)
        return Aggregate(ServerState(weights), Payload(weights))
