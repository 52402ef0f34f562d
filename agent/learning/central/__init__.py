"""Centralized strategies as small pluggable objects: what a participant computes in a round
(`fit`) and how the aggregator combines what they upload (`aggregate`), after Flower's
Strategy (`base.CentralStrategy` is the contract; a file per strategy family):

    fedavg       sample-weighted mean of full local models; accuracy of the global model
    fedavg-ft    fedavg, accuracy of each agent's fine-tuned model
    fedspu       FedSPU (ALGORITHMS.md 2): a random fraction p_k of the neurons trains, the rest
                 is frozen and stays personal; only the active part travels, both ways
    feddrop      federated dropout, FedSPU's baseline: the agent trains the sub-model of the
                 same active neurons and the rest is dropped, not kept
    fedadam      local Adam (ALGORITHMS.md 3), dense deltas of weights and both moments
    fedadam-top  the three deltas each top-k sparsified with its own mask
    fedadam-ssm  one shared top-k mask, from the weight delta, for all three
    fedbuff      FedBuff, asynchronous: the server applies the staleness-weighted mean of every
                 K updates as they arrive, each against the version it was trained from
    fedbuff-ssm  FedAdam-SSM's local round and sparse upload into FedBuff's buffer; each
                 version is the whole state (weights and both moments)
    fedldf       FedLDF (ALGORITHMS.md 4): divergence vectors first, then each layer from its
                 n most divergent participants only
"""

from __future__ import annotations

from agent.learning import strategies
from agent.learning.central.base import (
    Aggregate,
    CentralStrategy,
    Fit,
    FitContext,
    Layout,
    Payload,
    ServerState,
    Upload,
    as_sent,
    model_layout,
)
from agent.learning.central.fedadam import FedAdam, FedAdamSSM, FedAdamTop
from agent.learning.central.fedavg import FedAvg, FedAvgFineTuned
from agent.learning.central.fedldf import FedLDF
from agent.learning.central.fedspu import STATIC_TIERS, FedDropout, FedSPU, static_tier

__all__ = [
    "CENTRAL_STRATEGIES",
    "STATIC_TIERS",
    "Aggregate",
    "CentralStrategy",
    "FedAdam",
    "FedAdamSSM",
    "FedAdamTop",
    "FedAvg",
    "FedAvgFineTuned",
    "FedDropout",
    "FedLDF",
    "FedSPU",
    "Fit",
    "FitContext",
    "Layout",
    "Payload",
    "ServerState",
    "Upload",
    "as_sent",
    "central_strategy",
    "model_layout",
    "static_tier",
]

CENTRAL_STRATEGIES: dict[str, type[CentralStrategy]] = {
    name: strategies.implementation(name) for name in strategies.names(strategies.CENTRAL)
}
"""Each centralized strategy's class, by name, as the table of strategies names it."""


def central_strategy(name: str) -> CentralStrategy:
    """A fresh strategy object by its name (`CENTRAL_STRATEGIES`), or of the user's class
    the name imports (MODULE:CLASS, ./FILE.py:CLASS; `strategies.user_strategy`)."""
    cls = CENTRAL_STRATEGIES.get(name) or strategies.implementation(name)
    if not issubclass(cls, CentralStrategy):
        raise ValueError(f"{name} is not a centralized strategy")
    return cls()
