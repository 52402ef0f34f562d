"""Centralized strategies as small pluggable objects: what a participant computes in a round
(`fit`) and how the aggregator combines what they upload (`aggregate`), after Flower's
Strategy. Pure math: nothing here waits or sends. The driver (the simulator, or the
coordinator and agents over MQTT) moves the `Payload`s and counts their encoded bytes.

    fedavg       sample-weighted mean of full local models; accuracy of the global model
    fedavg-ft    fedavg, accuracy of each agent's fine-tuned model
    fedspu       FedSPU (ALGORITHMS.md 2): a random fraction p_k of the neurons trains, the rest
                 is frozen and stays personal; only the active part travels, both ways
    feddrop      federated dropout, FedSPU's baseline: the agent trains the sub-model of the
                 same active neurons and the rest is dropped, not kept
    fedadam      local Adam (ALGORITHMS.md 3), dense deltas of weights and both moments
    fedadam-top  the three deltas each top-k sparsified with its own mask
    fedadam-ssm  one shared top-k mask, from the weight delta, for all three
    fedldf       FedLDF (ALGORITHMS.md 4): divergence vectors first, then each layer from its
                 n most divergent participants only
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from agent import adam, freezing, ldf, sparse
from agent.budget import active_fraction
from agent.sparse import Masks, State
from agent.strategies import AgentState, Learner, LocalData, frozen_training_flops
from agent.training import TrainResult, train_local


@dataclass(frozen=True)
class Payload:
    """Tensors one message carries: only the entries of `masks` where one is given."""

    weights: State
    masks: Masks | None = None


@dataclass
class ServerState:
    """The aggregator's model (and, for the Adam family, the global moments)."""

    weights: State
    m: State | None = None
    v: State | None = None


@dataclass(frozen=True)
class Fit:
    """One participant's round: its new state, what it received and uploads, its figures."""

    state: AgentState
    upload: Payload
    num_samples: int
    train_loss: float
    train_flops: int
    download: Payload | None = None
    """What it received for this round alone (FedSPU: the global values of its active part);
    None when the round's global model reached it as the previous broadcast."""
    divergence: dict[str, float] | None = None
    """FedLDF: per-layer divergence, sent before any tensor."""
    delta: tuple[State, State, State] | None = None
    """Adam family: the compressed (zero-filled) deltas of weights, first and second moment."""


@dataclass(frozen=True)
class Aggregate:
    """The aggregator's round: its new state, the broadcast, and per-participant extras."""

    server: ServerState
    broadcast: Payload
    uploads: dict[str, Payload] = field(default_factory=dict)
    """Tensors asked for after the first upload (FedLDF: each participant's selected layers)."""
    requests: dict[str, list[str]] = field(default_factory=dict)
    """FedLDF: the layers each participant was asked for."""


class CentralStrategy:
    """The contract: `fit` for every participant, then `aggregate` over their `Fit`s."""

    name = ""
    personal = False
    """Whether an agent's accuracy is its own model's (True) or the new global model's."""

    def init_server(self, learner: Learner) -> ServerState:
        return ServerState(dict(learner.initial))

    def fit(
        self,
        learner: Learner,
        agent: AgentState,
        data: LocalData,
        server: ServerState,
        round_: int,
        p_k: float,
    ) -> Fit:
        raise NotImplementedError

    def aggregate(
        self, learner: Learner, server: ServerState, fits: Mapping[str, Fit]
    ) -> Aggregate:
        raise NotImplementedError


def _sample_weights(fits: Mapping[str, Fit]) -> dict[str, float]:
    return {k: float(f.num_samples) for k, f in fits.items()}


def _train(
    learner: Learner,
    agent: AgentState,
    data: LocalData,
    start: State,
    round_: int,
    *,
    masks: Masks | None = None,
    frozen: Masks | None = None,
) -> TrainResult:
    """The participant's local SGD from `start` (the same call for every SGD strategy)."""
    return train_local(
        learner.model,
        start,
        masks,
        data.x_train,
        data.y_train,
        learner.config.sgd,
        round_,
        learner.generator("train", agent.agent_id, round_),
        frozen=frozen,
    )


def _active(
    learner: Learner, agent: AgentState, server: ServerState, round_: int, p_k: float
) -> Masks:
    """This round's active neurons of a FedSPU / dropout participant, drawn from its seed."""
    generator = learner.generator("active", agent.agent_id, round_)
    return freezing.active_masks(learner.model, server.weights, p_k, generator)


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
        trained = _train(learner, agent, data, server.weights, round_)
        return Fit(
            state=dataclasses.replace(agent, weights=trained.state, round=round_),
            upload=Payload(trained.state),
            num_samples=len(data.y_train),
            train_loss=trained.mean_loss,
            train_flops=learner.train_flops(None, trained.samples),
        )

    def aggregate(
        self, learner: Learner, server: ServerState, fits: Mapping[str, Fit]
    ) -> Aggregate:
        weights = sparse.aggregate_weighted(
            {k: f.upload.weights for k, f in fits.items()}, _sample_weights(fits)
        )
        return Aggregate(ServerState(weights), Payload(weights))


class FedAvgFineTuned(FedAvg):
    name = "fedavg-ft"
    personal = True


class FedSPU(CentralStrategy):
    """Freeze a random 1 - p_k of the neurons; exchange and aggregate the active part only."""

    name = "fedspu"
    personal = True

    def fit(
        self,
        learner: Learner,
        agent: AgentState,
        data: LocalData,
        server: ServerState,
        round_: int,
        p_k: float,
    ) -> Fit:
        active = _active(learner, agent, server, round_, active_fraction(p_k))
        start = freezing.overwrite_active(agent.weights, server.weights, active)
        trained = _train(learner, agent, data, start, round_, frozen=active)
        flops = frozen_training_flops(learner, None, active) * trained.samples
        return Fit(
            state=dataclasses.replace(agent, weights=trained.state, round=round_),
            upload=Payload(trained.state, active),
            num_samples=len(data.y_train),
            train_loss=trained.mean_loss,
            train_flops=flops,
            download=Payload(server.weights, active),
        )

    def aggregate(
        self, learner: Learner, server: ServerState, fits: Mapping[str, Fit]
    ) -> Aggregate:
        weights = freezing.aggregate_active(
            server.weights,
            {k: (f.upload.weights, f.upload.masks or {}) for k, f in fits.items()},
            _sample_weights(fits),
        )
        return Aggregate(ServerState(weights), Payload({}))


class FedDropout(FedSPU):
    """Train the sub-model of the active neurons; the dropped rest is not kept.

    Its accuracy is the trained sub-model's: in federated dropout that is the model an agent
    has and would run (FedSPU's comparison is of these local models)."""

    name = "feddrop"

    def fit(
        self,
        learner: Learner,
        agent: AgentState,
        data: LocalData,
        server: ServerState,
        round_: int,
        p_k: float,
    ) -> Fit:
        active = _active(learner, agent, server, round_, p_k)
        start = freezing.submodel(server.weights, active)
        trained = _train(learner, agent, data, start, round_, masks=active)
        return Fit(
            state=dataclasses.replace(agent, weights=trained.state, round=round_),
            upload=Payload(trained.state, active),
            num_samples=len(data.y_train),
            train_loss=trained.mean_loss,
            train_flops=3 * learner.forward_flops(active) * trained.samples,
            download=Payload(server.weights, active),
        )


class FedAdam(CentralStrategy):
    """Local Adam from the global weights and moments; upload the deltas of all three."""

    name = "fedadam"
    mode = adam.MODE_DENSE

    def init_server(self, learner: Learner) -> ServerState:
        weights = dict(learner.initial)
        return ServerState(weights, adam.zeros_like_state(weights), adam.zeros_like_state(weights))

    def fit(
        self,
        learner: Learner,
        agent: AgentState,
        data: LocalData,
        server: ServerState,
        round_: int,
        p_k: float,
    ) -> Fit:
        cfg = learner.config
        assert server.m is not None and server.v is not None
        result = adam.train_adam(
            learner.model,
            server.weights,
            server.m,
            server.v,
            data.x_train,
            data.y_train,
            adam.AdamConfig(lr=cfg.lr, epochs=cfg.epochs, batch_size=cfg.batch_size),
            learner.generator("train", agent.agent_id, round_),
        )
        (dw, w_mask), (dm, m_mask), (dv, v_mask) = adam.compress(
            adam.deltas(result.weights, server.weights),
            adam.deltas(result.m, server.m),
            adam.deltas(result.v, server.v),
            cfg.ssm_fraction,
            self.mode,
        )
        return Fit(
            state=dataclasses.replace(agent, weights=result.weights, round=round_),
            upload=_moment_payload((dw, w_mask), (dm, m_mask), (dv, v_mask), self.mode),
            num_samples=len(data.y_train),
            train_loss=result.mean_loss,
            train_flops=learner.train_flops(None, result.samples),
            delta=(dw, dm, dv),
        )

    def aggregate(
        self, learner: Learner, server: ServerState, fits: Mapping[str, Fit]
    ) -> Aggregate:
        assert server.m is not None and server.v is not None
        weights = _sample_weights(fits)
        agg = [
            adam.aggregate_deltas({k: f.delta[i] for k, f in fits.items() if f.delta}, weights)
            for i in range(3)
        ]
        new = ServerState(
            adam.apply(server.weights, agg[0]),
            adam.apply(server.m, agg[1]),
            adam.apply(server.v, agg[2]),
        )
        support = {n: (agg[0][n] != 0) | (agg[1][n] != 0) | (agg[2][n] != 0) for n in agg[0]}
        mode = adam.MODE_DENSE if self.mode == adam.MODE_DENSE else adam.MODE_SSM
        return Aggregate(
            new,
            _moment_payload(*((d, support) for d in agg), mode),  # type: ignore[arg-type]
        )


class FedAdamTop(FedAdam):
    name = "fedadam-top"
    mode = adam.MODE_TOP


class FedAdamSSM(FedAdam):
    name = "fedadam-ssm"
    mode = adam.MODE_SSM


def _moment_payload(
    w: tuple[State, Masks], m: tuple[State, Masks], v: tuple[State, Masks], mode: str
) -> Payload:
    """The deltas of weights and both moments as one message body. With one shared mask
    (SSM) the mask travels once: the moments go as bare value vectors in its order."""
    if mode == adam.MODE_DENSE:
        parts = {"w": w[0], "m": m[0], "v": v[0]}
        return Payload({f"{p}:{n}": t for p, s in parts.items() for n, t in s.items()})
    weights = {f"w:{n}": t for n, t in w[0].items()}
    masks = {f"w:{n}": w[1][n] for n in w[0]}
    for prefix, (delta, mask) in (("m", m), ("v", v)):
        for n, t in delta.items():
            if mode == adam.MODE_SSM:
                weights[f"{prefix}:{n}"] = t[w[1][n]]
            else:
                weights[f"{prefix}:{n}"] = t
                masks[f"{prefix}:{n}"] = mask[n]
    return Payload(weights, masks)


class FedLDF(FedAvg):
    """Divergence vectors first; each layer then from its n most divergent participants."""

    name = "fedldf"

    def fit(
        self,
        learner: Learner,
        agent: AgentState,
        data: LocalData,
        server: ServerState,
        round_: int,
        p_k: float,
    ) -> Fit:
        fit = super().fit(learner, agent, data, server, round_, p_k)
        groups = learner.layer_groups
        return dataclasses.replace(
            fit,
            upload=Payload({}),
            divergence=ldf.divergences(fit.state.weights, server.weights, groups),
        )

    def aggregate(
        self, learner: Learner, server: ServerState, fits: Mapping[str, Fit]
    ) -> Aggregate:
        groups = learner.layer_groups
        selected = ldf.select_layers(
            {k: f.divergence or {} for k, f in fits.items()}, learner.config.ldf_n
        )
        uploads = {
            k: ldf.partial_state(fits[k].state.weights, layers, groups)
            for k, layers in selected.items()
        }
        weights = ldf.aggregate_layers(
            {k: u for k, u in uploads.items() if u}, _sample_weights(fits), groups, server.weights
        )
        return Aggregate(
            ServerState(weights),
            Payload(weights),
            uploads={k: Payload(u) for k, u in uploads.items()},
            requests=selected,
        )


CENTRAL_STRATEGIES: dict[str, type[CentralStrategy]] = {
    cls.name: cls
    for cls in (
        FedAvg,
        FedAvgFineTuned,
        FedSPU,
        FedDropout,
        FedAdam,
        FedAdamTop,
        FedAdamSSM,
        FedLDF,
    )
}


def central_strategy(name: str) -> CentralStrategy:
    return CENTRAL_STRATEGIES[name]()
