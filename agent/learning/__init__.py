"""The learning core: pure functions and small state objects over tensors, shared by the
simulator (`coordinator.simulate`), the networked agent (`agent.runtime`) and the
coordinator's aggregator, which is why a fleet on a network computes what the simulator
computes. It imports torch and numpy only: no network, clock, threads or files
(tests/test_layering.py). docs/architecture.md maps each step of ALGORITHMS.md to its module.
"""

from __future__ import annotations

from agent.learning import (
    adam,
    central,
    delta,
    freezing,
    ldf,
    models,
    pqi,
    pruning,
    rigl,
    robust,
    sparse,
    topology,
    training,
)
from agent.learning.central import (
    Aggregate,
    CentralStrategy,
    Fit,
    Payload,
    ServerState,
    Upload,
    as_sent,
    central_strategy,
    static_tier,
)
from agent.learning.config import (
    CENTRALIZED,
    DECENTRALIZED,
    PRESETS,
    REDUCE_MODES,
    WIRE_FORMATS,
    StrategyConfig,
    param,
    preset,
)
from agent.learning.delta import FLIP, apply_delta, encode_delta
from agent.learning.early_stop import EarlyStop, StopWatch
from agent.learning.learner import AgentState, Learner, LocalData, Published, RoundResult
from agent.learning.models import MODEL_NAMES, build_model, default_model, forward_flops
from agent.learning.pruning import DISTANCES, PruningPlan
from agent.learning.reduction import (
    Reduction,
    active_fraction,
    capped_density,
    density_cap,
    local_reduction,
)
from agent.learning.rounds import (
    Need,
    RoundTopology,
    advance_server,
    attacked,
    attacked_payload,
    checked_aggregate,
    checked_fit,
    evaluated_weights,
    layer_requests,
    layers_to_fetch,
    participant_p_k,
    running,
    settle_votes,
    stand_in,
    train_round,
)
from agent.learning.sparse import Masks, State
from agent.learning.topology import TOPOLOGIES

__all__ = [
    "CENTRALIZED",
    "DECENTRALIZED",
    "DISTANCES",
    "FLIP",
    "MODEL_NAMES",
    "PRESETS",
    "REDUCE_MODES",
    "TOPOLOGIES",
    "WIRE_FORMATS",
    "Aggregate",
    "AgentState",
    "CentralStrategy",
    "EarlyStop",
    "Fit",
    "Learner",
    "LocalData",
    "Masks",
    "Need",
    "Payload",
    "PruningPlan",
    "Published",
    "Reduction",
    "RoundResult",
    "RoundTopology",
    "ServerState",
    "State",
    "StopWatch",
    "StrategyConfig",
    "Upload",
    "active_fraction",
    "adam",
    "advance_server",
    "attacked",
    "attacked_payload",
    "apply_delta",
    "as_sent",
    "build_model",
    "capped_density",
    "central",
    "central_strategy",
    "checked_aggregate",
    "checked_fit",
    "default_model",
    "delta",
    "density_cap",
    "encode_delta",
    "evaluated_weights",
    "forward_flops",
    "freezing",
    "layer_requests",
    "layers_to_fetch",
    "ldf",
    "local_reduction",
    "models",
    "param",
    "participant_p_k",
    "pqi",
    "preset",
    "pruning",
    "rigl",
    "robust",
    "running",
    "settle_votes",
    "sparse",
    "stand_in",
    "static_tier",
    "topology",
    "train_round",
    "training",
]
