"""FedAvg: the sample-weighted mean of full local models.

fedavg       accuracy of the global model
fedavg-ft    accuracy of each agent's fine-tuned model
"""

from __future__ import annotations

from collections.abc import Mapping

from agent.learning import robust, sparse
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


def full_model_fit(learner: ModelFacts, ctx: FitContext) -> Fit:
    """Local SGD from the global model, uploading the whole trained model (FedAvg's round,
    and FedLDF's before it chooses what to send)."""
    trained = train_sgd(learner, ctx, ctx.view.weights)
    flops = learner.train_flops(None, trained.samples)
    return ctx.fitted(
        trained.state, Payload(trained.state), trained.mean_loss, flops, trained.dp_steps
    )


class FedAvg(CentralStrategy):
    name = "fedavg"

    def fit(self, learner: ModelFacts, ctx: FitContext) -> Fit:
        return full_model_fit(learner, ctx)

    def aggregate(
        self, learner: ModelFacts, server: ServerState, uploads: Mapping[str, Upload]
    ) -> Aggregate:
        states, rule = clipped_uploads(
            learner, server.weights, {k: u.payload.weights for k, u in uploads.items()}
        )
        if rule.robust:
            weights = robust.aggregate_onto(server.weights, states, rule)
        else:
            mean = sparse.aggregate_weighted(states, sample_weights(learner, uploads))
            weights = voted(rule, server.weights, states, mean)
        return Aggregate(ServerState(weights), Payload(weights))


class FedAvgFineTuned(FedAvg):
    name = "fedavg-ft"
    personal = True
