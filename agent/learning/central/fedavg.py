"""FedAvg: the sample-weighted mean of full local models.

fedavg       accuracy of the global model
fedavg-ft    accuracy of each agent's fine-tuned model
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from agent.learning import robust, sparse
from agent.learning.central.base import (
    Aggregate,
    CentralStrategy,
    Fit,
    Payload,
    ServerState,
    Upload,
    clipped_uploads,
    sample_weights,
    train_sgd,
    voted,
)
from agent.learning.learner import AgentState, Learner, LocalData


def full_model_fit(
    learner: Learner, agent: AgentState, data: LocalData, server: ServerState, round_: int
) -> Fit:
    """Local SGD from the global model, uploading the whole trained model (FedAvg's round,
    and FedLDF's before it chooses what to send)."""
    trained = train_sgd(learner, agent, data, server.weights, round_)
    return Fit(
        state=dataclasses.replace(agent, weights=trained.state, round=round_),
        upload=Payload(trained.state),
        num_samples=len(data.y_train),
        train_loss=trained.mean_loss,
        train_flops=learner.train_flops(None, trained.samples),
    )


class FedAvg(CentralStrategy):
    name = "fedavg"

    def fit(
        self,
        learner: Learner,
        agent: AgentState,
        data: LocalData,
        server: ServerState,
        round_: int,
        p_k: float,
    ) -> Fit:
        return full_model_fit(learner, agent, data, server, round_)

    def aggregate(
        self, learner: Learner, server: ServerState, uploads: Mapping[str, Upload]
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
