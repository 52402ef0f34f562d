"""Centralized strategies as small pluggable objects: what a participant computes in a round
(`fit`) and how the aggregator combines what they upload (`aggregate`), after Flower's
Strategy. Pure math: nothing here waits or sends. The driver (the simulator, or the
coordinator and agents over MQTT) moves the `Payload`s and counts their encoded bytes.

A round, in the order the messages flow:

    download   (FedSPU family) the aggregator sends each participant the global values of
               its active part, drawn from the participant's seed and its announced p_k
    fit        the participant trains and says what it uploads (FedLDF: nothing yet, only
               its per-layer divergence)
    select     (FedLDF) the aggregator asks each participant for the layers it was picked for
    respond    (FedLDF) the participant's upload of exactly those layers
    aggregate  the aggregator combines the uploads it received; its broadcast goes to all
    receive    each participant updates its view of the server state from the broadcast

The aggregator sees only `Upload`s (a payload as it came off the wire and a sample count),
so the coordinator over MQTT and the simulator call `aggregate` with the same inputs.

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
from dataclasses import dataclass

import torch

from agent.learning import adam, freezing, ldf, sparse
from agent.learning.learner import AgentState, Learner, LocalData, frozen_training_flops
from agent.learning.reduction import active_fraction
from agent.learning.sparse import Masks, State
from agent.learning.training import TrainResult, train_local
from agent.runtime.codec import decode_state, expected_shapes
from protocol.errors import ProtocolError
from protocol.limits import DEFAULT_LIMITS


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
    """One participant's round: its new state, what it uploads, its figures."""

    state: AgentState
    upload: Payload
    num_samples: int
    train_loss: float
    train_flops: int
    divergence: dict[str, float] | None = None
    """FedLDF: per-layer divergence, sent before any tensor."""


@dataclass(frozen=True)
class Upload:
    """What the aggregator received from one participant."""

    payload: Payload
    num_samples: int


@dataclass(frozen=True)
class Aggregate:
    """The aggregator's round: its new state and what it broadcasts (empty: nothing)."""

    server: ServerState
    broadcast: Payload


class CentralStrategy:
    """The contract: `download`, `fit`, (`select`, `respond`), `aggregate`, `receive`."""

    name = ""
    personal = False
    """Whether an agent's accuracy is its own model's (True) or the new global model's."""
    downloads = False
    """Whether each participant fetches its own part of the global model every round."""
    asks_layers = False
    """Whether the aggregator asks for layers after reading divergence vectors (FedLDF)."""
    broadcasts = True
    """Whether a round ends with a broadcast every participant applies (`receive`)."""

    def init_server(self, learner: Learner) -> ServerState:
        return ServerState(dict(learner.initial))

    def download(
        self, learner: Learner, server: ServerState, agent_id: str, round_: int, p_k: float
    ) -> Payload:
        """The part of the global model participant `agent_id` receives this round."""
        raise NotImplementedError(f"{self.name} broadcasts; participants download nothing")

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

    def select(
        self, learner: Learner, divergences: Mapping[str, dict[str, float]]
    ) -> dict[str, list[str]]:
        """The layers to ask each participant for (only strategies that `asks_layers`)."""
        raise NotImplementedError(f"{self.name} asks for no layers")

    def respond(self, learner: Learner, fit: Fit, layers: list[str]) -> Payload:
        """A participant's upload of the layers it was asked for."""
        raise NotImplementedError(f"{self.name} asks for no layers")

    def aggregate(
        self, learner: Learner, server: ServerState, uploads: Mapping[str, Upload]
    ) -> Aggregate:
        raise NotImplementedError

    def receive(self, view: ServerState, broadcast: Payload) -> ServerState:
        """A participant's view of the server state after this round's broadcast."""
        return ServerState(dict(broadcast.weights)) if broadcast.weights else view

    def upload_shapes(self, learner: Learner, layers: list[str] | None = None) -> Shapes | None:
        """(shape, dtype) of each tensor an upload carries, for validation before decoding;
        None when some sizes are only known from the masks it carries (`check_payload`)."""
        names = learner.initial if layers is None else ldf_names(learner, layers)
        return {n: s for n, s in expected_shapes(learner.initial).items() if n in names}

    def broadcast_shapes(self, learner: Learner) -> Shapes | None:
        return self.upload_shapes(learner)

    def check_payload(self, learner: Learner, payload: Payload) -> None:
        """Validate a payload decoded without `upload_shapes`; ValueError if malformed."""

    def decode(self, learner: Learner, data: bytes, shapes: Shapes | None) -> Payload:
        """A payload off the wire, validated; ProtocolError if it is not what `shapes` (or,
        where they are None, `check_payload`) says. Without shapes the decoder still refuses,
        before allocating, more values than three models' worth."""
        size = sum(t.numel() for t in learner.initial.values())
        limits = dataclasses.replace(DEFAULT_LIMITS, max_total_elements=3 * size)
        weights, masks = decode_state(data, shapes, limits=limits)
        if shapes is None:
            try:
                self.check_payload(learner, Payload(weights, masks or None))
            except ValueError as exc:
                raise ProtocolError(str(exc)) from None
        # The model's order, whatever the sender's: aggregation sums in one fixed order.
        order = {name: i for i, name in enumerate(self.payload_order(learner))}
        weights = dict(sorted(weights.items(), key=lambda item: order[item[0]]))
        return Payload(weights, masks or None)

    def payload_order(self, learner: Learner) -> list[str]:
        """Every tensor name a payload of this strategy may carry, in the model's order."""
        return list(learner.initial)


Shapes = dict[str, tuple[tuple[int, ...], str]]


def ldf_names(learner: Learner, layers: list[str]) -> set[str]:
    """The tensor names of FedLDF layers; ValueError for a layer the model does not have."""
    groups = learner.layer_groups
    unknown = [layer for layer in layers if layer not in groups]
    if unknown:
        raise ValueError(f"unknown layers {unknown[:4]}")
    return {name for layer in layers for name in groups[layer]}


def _sample_weights(uploads: Mapping[str, Upload]) -> dict[str, float]:
    return {k: float(u.num_samples) for k, u in uploads.items()}


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
    learner: Learner, agent_id: str, server: ServerState, round_: int, fraction: float
) -> Masks:
    """This round's active neurons of a FedSPU / dropout participant, drawn from its seed."""
    generator = learner.generator("active", agent_id, round_)
    return freezing.active_masks(learner.model, server.weights, fraction, generator)


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
        self, learner: Learner, server: ServerState, uploads: Mapping[str, Upload]
    ) -> Aggregate:
        weights = sparse.aggregate_weighted(
            {k: u.payload.weights for k, u in uploads.items()}, _sample_weights(uploads)
        )
        return Aggregate(ServerState(weights), Payload(weights))


class FedAvgFineTuned(FedAvg):
    name = "fedavg-ft"
    personal = True


class FedSPU(CentralStrategy):
    """Freeze a random 1 - p_k of the neurons; exchange and aggregate the active part only."""

    name = "fedspu"
    personal = True
    downloads = True
    broadcasts = False

    def active(
        self, learner: Learner, server: ServerState, agent_id: str, round_: int, p_k: float
    ) -> Masks:
        """This round's active neurons of a participant, drawn from its seed."""
        return _active(learner, agent_id, server, round_, active_fraction(p_k))

    def download(
        self, learner: Learner, server: ServerState, agent_id: str, round_: int, p_k: float
    ) -> Payload:
        return Payload(server.weights, self.active(learner, server, agent_id, round_, p_k))

    def fit(
        self,
        learner: Learner,
        agent: AgentState,
        data: LocalData,
        server: ServerState,
        round_: int,
        p_k: float,
    ) -> Fit:
        active = self.active(learner, server, agent.agent_id, round_, p_k)
        start = freezing.overwrite_active(agent.weights, server.weights, active)
        trained = _train(learner, agent, data, start, round_, frozen=active)
        flops = frozen_training_flops(learner, None, active) * trained.samples
        return Fit(
            state=dataclasses.replace(agent, weights=trained.state, round=round_),
            upload=Payload(trained.state, active),
            num_samples=len(data.y_train),
            train_loss=trained.mean_loss,
            train_flops=flops,
        )

    def aggregate(
        self, learner: Learner, server: ServerState, uploads: Mapping[str, Upload]
    ) -> Aggregate:
        weights = freezing.aggregate_active(
            server.weights,
            {k: (u.payload.weights, _all_masks(u.payload)) for k, u in uploads.items()},
            _sample_weights(uploads),
        )
        return Aggregate(ServerState(weights), Payload({}))


def _all_masks(payload: Payload) -> Masks:
    """A payload's masks, all True for a tensor sent whole."""
    masks = payload.masks or {}
    return {
        n: masks[n] if n in masks else torch.ones_like(t, dtype=torch.bool)
        for n, t in payload.weights.items()
    }


class FedDropout(FedSPU):
    """Train the sub-model of the active neurons; the dropped rest is not kept.

    Its accuracy is the trained sub-model's: in federated dropout that is the model an agent
    has and would run (FedSPU's comparison is of these local models)."""

    name = "feddrop"

    def active(
        self, learner: Learner, server: ServerState, agent_id: str, round_: int, p_k: float
    ) -> Masks:
        return _active(learner, agent_id, server, round_, p_k)

    def fit(
        self,
        learner: Learner,
        agent: AgentState,
        data: LocalData,
        server: ServerState,
        round_: int,
        p_k: float,
    ) -> Fit:
        active = self.active(learner, server, agent.agent_id, round_, p_k)
        start = freezing.submodel(server.weights, active)
        trained = _train(learner, agent, data, start, round_, masks=active)
        return Fit(
            state=dataclasses.replace(agent, weights=trained.state, round=round_),
            upload=Payload(trained.state, active),
            num_samples=len(data.y_train),
            train_loss=trained.mean_loss,
            train_flops=3 * learner.forward_flops(active) * trained.samples,
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
        )

    @property
    def broadcast_mode(self) -> str:
        """The broadcast's layout: dense for FedAdam, else one shared mask (the support)."""
        return adam.MODE_DENSE if self.mode == adam.MODE_DENSE else adam.MODE_SSM

    def aggregate(
        self, learner: Learner, server: ServerState, uploads: Mapping[str, Upload]
    ) -> Aggregate:
        assert server.m is not None and server.v is not None
        weights = _sample_weights(uploads)
        deltas = {k: _moment_deltas(u.payload) for k, u in uploads.items()}
        agg = [
            adam.aggregate_deltas({k: d[i] for k, d in deltas.items()}, weights) for i in range(3)
        ]
        new = ServerState(
            adam.apply(server.weights, agg[0]),
            adam.apply(server.m, agg[1]),
            adam.apply(server.v, agg[2]),
        )
        support = {n: (agg[0][n] != 0) | (agg[1][n] != 0) | (agg[2][n] != 0) for n in agg[0]}
        return Aggregate(
            new,
            _moment_payload(*((d, support) for d in agg), self.broadcast_mode),  # type: ignore[arg-type]
        )

    def receive(self, view: ServerState, broadcast: Payload) -> ServerState:
        """Apply the broadcast deltas to W, M and V, as the aggregator did."""
        assert view.m is not None and view.v is not None
        dw, dm, dv = _moment_deltas(broadcast)
        return ServerState(
            adam.apply(view.weights, dw), adam.apply(view.m, dm), adam.apply(view.v, dv)
        )

    def upload_shapes(self, learner: Learner, layers: list[str] | None = None) -> Shapes | None:
        return _moment_shapes(learner) if self.mode != adam.MODE_SSM else None

    def payload_order(self, learner: Learner) -> list[str]:
        return list(_moment_shapes(learner))

    def broadcast_shapes(self, learner: Learner) -> Shapes | None:
        return _moment_shapes(learner) if self.broadcast_mode == adam.MODE_DENSE else None

    def check_payload(self, learner: Learner, payload: Payload) -> None:
        """An SSM-layout payload: w:<name> in the model's shapes with a mask, m:/v:<name>
        value vectors as long as that mask's count."""
        shapes = expected_shapes(learner.initial)
        masks = payload.masks or {}
        want = {f"{p}:{n}" for p in "wmv" for n in learner.initial}
        if set(payload.weights) != want:
            raise ValueError("a moment payload must hold w:, m: and v: of every tensor")
        if not all(torch.is_floating_point(t) for t in payload.weights.values()):
            raise ValueError("a moment payload holds floating values only")
        for name, (shape, _dtype) in shapes.items():
            w = payload.weights[f"w:{name}"]
            mask = masks.get(f"w:{name}")
            if tuple(w.shape) != shape or mask is None:
                raise ValueError(f"w:{name} must have shape {shape} and a mask")
            count = int(mask.sum())
            for prefix in "mv":
                if tuple(payload.weights[f"{prefix}:{name}"].shape) != (count,):
                    raise ValueError(f"{prefix}:{name} must hold {count} values")


def _moment_shapes(learner: Learner) -> Shapes:
    shapes = expected_shapes(learner.initial)
    return {f"{p}:{n}": shape for p in "wmv" for n, shape in shapes.items()}


def _moment_deltas(payload: Payload) -> tuple[State, State, State]:
    """The zero-filled deltas of weights, first and second moment a `_moment_payload` carries
    (in the shared-mask layout the moments' values are scattered back under w's mask)."""
    masks = payload.masks or {}
    names = [n.removeprefix("w:") for n in payload.weights if n.startswith("w:")]
    out: list[State] = [{}, {}, {}]
    for i, prefix in enumerate("wmv"):
        for n in names:
            t = payload.weights[f"{prefix}:{n}"]
            shape = payload.weights[f"w:{n}"].shape
            if t.shape != shape:  # a value vector in the order of w's mask
                full = torch.zeros(shape, dtype=t.dtype)
                full[masks[f"w:{n}"]] = t
                t = full
            elif f"{prefix}:{n}" in masks:
                t = torch.where(masks[f"{prefix}:{n}"], t, torch.zeros((), dtype=t.dtype))
            out[i][n] = t
    return out[0], out[1], out[2]


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
    asks_layers = True

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

    def select(
        self, learner: Learner, divergences: Mapping[str, dict[str, float]]
    ) -> dict[str, list[str]]:
        return ldf.select_layers(divergences, learner.config.ldf_n)

    def respond(self, learner: Learner, fit: Fit, layers: list[str]) -> Payload:
        return Payload(ldf.partial_state(fit.state.weights, layers, learner.layer_groups))

    def aggregate(
        self, learner: Learner, server: ServerState, uploads: Mapping[str, Upload]
    ) -> Aggregate:
        weights = ldf.aggregate_layers(
            {k: u.payload.weights for k, u in uploads.items() if u.payload.weights},
            _sample_weights(uploads),
            learner.layer_groups,
            server.weights,
        )
        return Aggregate(ServerState(weights), Payload(weights))


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


STATIC_TIERS = (0.2, 0.4, 0.6, 0.8, 1.0)


def static_tier(roster: list[str], agent_id: str) -> float:
    """p_k without a measured budget: FedSPU's paper tiers 0.2, 0.4, ..., 1.0 in turn, by the
    agent's place in the sorted roster (with device profiles the budget decides)."""
    return STATIC_TIERS[sorted(roster).index(agent_id) % len(STATIC_TIERS)]


def as_sent(payload: Payload, fp16: bool) -> Payload:
    """The payload as its receivers decode it: with fp16 on the wire, values rounded so."""
    if not fp16:
        return payload
    rounded = {
        n: t.half().to(t.dtype) if torch.is_floating_point(t) else t
        for n, t in payload.weights.items()
    }
    return Payload(rounded, payload.masks)


def central_strategy(name: str) -> CentralStrategy:
    return CENTRAL_STRATEGIES[name]()
