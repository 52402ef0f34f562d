"""The contract of a centralized strategy and the values a round moves, after Flower's
`Strategy`. Pure math: nothing here waits, sends or decodes. The driver (the simulator, or the
coordinator and agents over MQTT) moves the `Payload`s; the runtime's wire module
(`agent.runtime.codec`) decodes them, checked against the layout a strategy describes here.

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
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from agent.learning import robust, robust_rules, screening
from agent.learning.learner import AgentState, LocalData
from agent.learning.model_facts import ModelFacts
from agent.learning.sparse import Masks, State
from agent.learning.training import TrainResult, train_local

Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]
"""Tensor name -> (shape, dtype) of every tensor a payload carries."""


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
    fallback_flops: int = 0
    """Training FLOPs of the participant's local-only model this round (`Turn.train`)."""
    undone: bool = False
    """The round's model was not finite and was undone (`rounds.checked_fit`)."""
    epsilon: float | None = None
    """The participant's epsilon after the round under `--dp sample` (`Turn.train`)."""


@dataclass(frozen=True)
class FitContext:
    """What one participant's round trains from, gathered once (`central.participant.Turn.train`,
    wherever the round runs: the simulator, a worker process, the networked agent), so that
    every strategy's `fit` and its helpers take the same one value rather than each repeating
    the list. The model's
    facts are not in it: they are the run's, the same for every participant and round, and
    every other method of the contract takes them apart too."""

    state: AgentState
    """The participant's state before the round (its own model, its id)."""
    data: LocalData
    """Its local data."""
    view: ServerState
    """The server state it trains from: the last broadcast it applied, or this round's
    download of its part of the global model."""
    round: int
    """The round number (1 is the first); with the agent id it seeds the round's draws."""
    p_k: float
    """Its budget this round: the fraction of the model it trains (FedSPU's family)."""

    @property
    def agent_id(self) -> str:
        """The participant's id: with the round, what seeds its draws."""
        return self.state.agent_id

    def fitted(
        self, weights: State, upload: Payload, train_loss: float, flops: int, dp_steps: int = 0
    ) -> Fit:
        """The participant's `Fit` once it trained to `weights`: the figures every strategy
        reports alike (its state at this round, its sample count); `dp_steps`: the DP-SGD
        steps its training took (`TrainResult.dp_steps`), added to what its accountant
        counts (a strategy that trains under `--dp sample` must pass them)."""
        steps = self.state.dp_steps + dp_steps
        return Fit(
            state=dataclasses.replace(
                self.state, weights=weights, round=self.round, dp_steps=steps
            ),
            upload=upload,
            num_samples=len(self.data.y_train),
            train_loss=train_loss,
            train_flops=flops,
        )


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


class CentralStrategy(abc.ABC):
    """The contract. Every strategy implements `fit` and `aggregate`; the flags say which of
    the optional steps it takes part in:

        downloads    `download`: each participant fetches its part of the global model
        asks_layers  `select` and `respond`: uploads go in two steps (FedLDF)
        broadcasts   `receive`: a round ends with a broadcast every participant applies

    and `init_server` starts the aggregator's state. The payload layout (`upload_layout`,
    `broadcast_layout`, `check_payload`, `payload_order`) lets the wire module validate what
    arrives before a strategy sees it."""

    name: ClassVar[str] = ""
    personal: ClassVar[bool] = False
    """Whether an agent's accuracy is its own model's (True) or the new global model's."""
    trains_own: ClassVar[bool] = False
    """Whether `fit` trains from the agent's own weights (in part) rather than wholly from
    the server's: only then can a device start a run from its own model (`init`)."""
    downloads: ClassVar[bool] = False
    """Whether each participant fetches its own part of the global model every round."""
    asks_layers: ClassVar[bool] = False
    """Whether the aggregator asks for layers after reading divergence vectors (FedLDF)."""
    broadcasts: ClassVar[bool] = True
    """Whether a round ends with a broadcast every participant applies (`receive`)."""

    def init_server(self, learner: ModelFacts) -> ServerState:
        """The aggregator's state before round 1."""
        return ServerState(dict(learner.initial))

    def download(
        self, learner: ModelFacts, server: ServerState, agent_id: str, round_: int, p_k: float
    ) -> Payload:
        """The part of the global model participant `agent_id` receives this round."""
        raise NotImplementedError(f"{self.name} broadcasts; participants download nothing")

    @abc.abstractmethod
    def fit(self, learner: ModelFacts, ctx: FitContext) -> Fit:
        """A participant's local round from its view of the server state (`ctx.view`)."""

    def select(
        self, learner: ModelFacts, divergences: Mapping[str, dict[str, float]]
    ) -> dict[str, list[str]]:
        """The layers to ask each participant for (only strategies that `asks_layers`)."""
        raise NotImplementedError(f"{self.name} asks for no layers")

    def respond(self, learner: ModelFacts, fit: Fit, layers: list[str]) -> Payload:
        """A participant's upload of the layers it was asked for."""
        raise NotImplementedError(f"{self.name} asks for no layers")

    @abc.abstractmethod
    def aggregate(
        self, learner: ModelFacts, server: ServerState, uploads: Mapping[str, Upload]
    ) -> Aggregate:
        """The aggregator's new state from the uploads it received, and its broadcast."""

    def receive(self, view: ServerState, broadcast: Payload) -> ServerState:
        """A participant's view of the server state after this round's broadcast."""
        return ServerState(dict(broadcast.weights)) if broadcast.weights else view

    def upload_layout(self, learner: ModelFacts, layers: list[str] | None = None) -> Layout | None:
        """The tensors an upload (only `layers` of the model, when given) carries; None when
        some sizes are only known from the masks it carries (`check_payload`)."""
        names = learner.initial if layers is None else _layer_tensor_names(learner, layers)
        return {n: s for n, s in model_layout(learner.initial).items() if n in names}

    def broadcast_layout(self, learner: ModelFacts) -> Layout | None:
        """The tensors a broadcast (or a download) carries; None as for `upload_layout`."""
        return self.upload_layout(learner)

    def check_payload(self, learner: ModelFacts, payload: Payload) -> None:
        """Validate a payload decoded without a layout (where `upload_layout` or
        `broadcast_layout` is None); ValueError if malformed. A strategy whose payloads all
        have a layout accepts none without it."""
        raise ValueError(f"a {self.name} payload is checked against its layout")

    def payload_order(self, learner: ModelFacts) -> list[str]:
        """Every tensor name a payload of this strategy may carry, in the model's order."""
        return list(learner.initial)


def model_layout(weights: State) -> Layout:
    """The (shape, dtype) of every tensor of a model."""
    return {name: (tuple(t.shape), t.dtype) for name, t in weights.items()}


def _layer_tensor_names(learner: ModelFacts, layers: list[str]) -> set[str]:
    """The tensor names of FedLDF layers; ValueError for a layer the model does not have."""
    groups = learner.layer_groups
    unknown = [layer for layer in layers if layer not in groups]
    if unknown:
        raise ValueError(f"unknown layers {unknown[:4]}")
    return {name for layer in layers for name in groups[layer]}


def clipped_uploads(
    learner: ModelFacts,
    reference: State,
    states: Mapping[str, State],
    held: Mapping[str, Masks | None] | None = None,
) -> tuple[dict[str, State], robust_rules.Rule]:
    """The uploads' tensors clipped (`--clip`) around the aggregator's `reference` (which
    it screened out and clipped added to the round's tally, `screening.noted`), and the
    `--aggregation` rule to combine them with."""
    cfg = learner.config
    clipped = screening.noted(robust.clip(reference, states, cfg.clip, held))
    return clipped, robust_rules.parse_rule(cfg.aggregation)


def voted(
    rule: robust_rules.Rule,
    reference: State,
    states: Mapping[str, State],
    combined: State,
    held: Mapping[str, Masks] | None = None,
) -> State:
    """The round's aggregate `combined` of `states` (all trained from `reference`): under
    `--aggregation signs`, with its step reversed where the senders disagree on its way
    (`robust.sign_vote`); as it is under every other rule."""
    if rule.kind != robust_rules.SIGNS:
        return combined
    return robust.sign_vote(reference, states, combined, held)


def sample_weights(learner: ModelFacts, uploads: Mapping[str, Upload]) -> dict[str, float]:
    """Each upload's weight in the strategy's mean: its sample count under `--aggregation
    mean` (the strategies as published, undefended), 1 each under the default `screened`.
    A count is its sender's own claim: one member claiming the protocol's 10,000,000 samples
    with a step the wrong way took a FedAvg fleet's honest devices from 0.91 to 0.09
    (digits, Dirichlet 0.3, 1 attacker of 20, 3 seeds). Equal weights held 0.90 there and
    cost nothing on clean runs (+1.0 points on digits, +2.2 on mnist1d against the counts);
    a cap at the round's median count held 0.87 at -0.3 and -0.1 (bench/inflated_claims.py)."""
    if robust_rules.parse_rule(learner.config.aggregation).kind == "mean":
        return {k: float(u.num_samples) for k, u in uploads.items()}
    return dict.fromkeys(uploads, 1.0)


def train_sgd(
    learner: ModelFacts,
    ctx: FitContext,
    start: State,
    *,
    masks: Masks | None = None,
    frozen: Masks | None = None,
) -> TrainResult:
    """The participant's local SGD from `start` (the same call for every SGD strategy), with
    its own BatchNorm statistics (`ModelFacts.own_statistics`)."""
    return train_local(
        learner.model,
        learner.own_statistics(start, ctx.state.weights),
        masks,
        ctx.data.x_train,
        ctx.data.y_train,
        learner.sgd,
        ctx.round,
        learner.generator("train", ctx.agent_id, ctx.round),
        frozen=frozen,
        task=learner.task,
    )


def as_sent(payload: Payload, fp16: bool) -> Payload:
    """The payload as its receivers decode it: with fp16 on the wire, values rounded so."""
    if not fp16:
        return payload
    rounded = {
        n: t.half().to(t.dtype) if torch.is_floating_point(t) else t
        for n, t in payload.weights.items()
    }
    return Payload(rounded, payload.masks)
