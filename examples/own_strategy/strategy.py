"""FedAvgM: FedAvg with server momentum (Hsu, Qi and Brown, "Measuring the effects of
non-identical data distribution for federated visual classification", 2019).

FedAvg replaces the global model by the mean of the participants' models. Under non-IID
data consecutive means pull in different directions; FedAvgM treats the step from the
global model to the mean as a pseudo-gradient and moves the global model along its
running average instead:

    v <- beta * v + (w - mean)          w <- w - server_lr * v

With beta = 0 and server_lr = 1 it is FedAvg. The participants' rounds are FedAvg's: only
the aggregator's step changes. The server state of a broadcasting strategy is what every
participant holds after applying the broadcast (`receive`), so v is not kept beside it but
read back from the global model's last move, w_{t-1} - w_t = server_lr * v_t, which the
aggregator and the participants see alike (`ServerState.m`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from agent.learning.central import Aggregate, FedAvg, Payload, ServerState, Upload
from agent.learning.model_facts import ModelFacts


class FedAvgM(FedAvg):
    """FedAvg, its global model moved by the momentum of the participants' mean steps."""

    name = "fedavgm"
    beta: ClassVar[float] = 0.9
    """The server momentum (the paper's best under skewed labels: 0.9 to 0.99)."""
    server_lr: ClassVar[float] = 1.0
    preset: ClassVar[dict[str, Any]] = {"lr": 0.05}
    """Config defaults a run may override: momentum lengthens each step, so the local
    learning rate is lower than FedAvg's."""

    def aggregate(
        self, learner: ModelFacts, server: ServerState, uploads: Mapping[str, Upload]
    ) -> Aggregate:
        mean = super().aggregate(learner, server, uploads).server.weights
        moved = server.m or {}  # the global model's last move (`receive`)
        weights = {}
        for name, old in server.weights.items():
            velocity = old - mean[name]
            if name in moved:
                velocity = velocity + self.beta / self.server_lr * moved[name]
            # Counters (BatchNorm's batches seen) are taken from the mean, not moved.
            moving = old.is_floating_point()
            weights[name] = old - self.server_lr * velocity if moving else mean[name]
        return Aggregate(ServerState(weights), Payload(weights))

    def receive(self, view: ServerState, broadcast: Payload) -> ServerState:
        new = super().receive(view, broadcast)
        moved = {n: view.weights[n] - w for n, w in new.weights.items() if w.is_floating_point()}
        return ServerState(new.weights, m=moved)
