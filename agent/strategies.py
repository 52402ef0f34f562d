"""Strategies: what one agent does in one round, as small pluggable objects.

A strategy owns the math of a round (aggregate, train, vote, prune, update the mask) and
nothing of the runtime: it never waits, sends or sleeps. The in-process simulator and the
networked agent both hand it the same inputs (the agent's state, the models it holds from its
neighbours) and get the same outputs (its new state and the model it publishes), which is
what makes a networked run reproduce a simulated one.

Presets (ALGORITHMS.md section 1 and its baselines):

    dadpfl     sparse, mask-based aggregation, waits for up to N prior neighbours, RigL,
               further PQI pruning at the voted times
    dispfl     dadpfl with N = 0 and no further pruning
    dfedavgm   dense, neighbour averaging, local SGD with momentum 0.9
    local      dense, no communication
    fedavg     centralized, sample-weighted averaging; accuracy of the global model
    fedavg-ft  fedavg whose accuracy is that of each agent's model after local training
               (the global model fine-tuned for E epochs on the agent's data)

and the centralized ones of ALGORITHMS.md sections 2 to 4 (fedspu, feddrop, fedadam,
fedadam-top, fedadam-ssm, fedldf), whose rounds live in `agent.central`. Early stopping
(`early_stop`, section 2) applies to every strategy.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn

from agent import pruning, sparse
from agent.models import flops_from_positions, output_positions
from agent.sparse import Masks, State
from agent.training import SGDConfig, dense_gradients, derive_seed, evaluate, train_local

DECENTRALIZED = ("dadpfl", "dispfl", "dfedavgm")
CENTRALIZED = (
    "fedavg",
    "fedavg-ft",
    "fedspu",
    "feddrop",
    "fedadam",
    "fedadam-top",
    "fedadam-ssm",
    "fedldf",
)
PRESETS = (*DECENTRALIZED, "local", *CENTRALIZED)
ADAM_FAMILY = ("fedadam", "fedadam-top", "fedadam-ssm")
STOP_LAMBDA = 0.7
REDUCE_MODES = ("prune", "freeze", "auto")
WIRE_FORMATS = ("full", "delta", "layers")


def param(default: Any, help: str) -> Any:
    """A config field with its help text, so the CLI flags document themselves."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class StrategyConfig:
    """Every hyper-parameter of a run; defaults are ALGORITHMS.md's decisions."""

    strategy: str = param("dadpfl", "Algorithm preset: " + ", ".join(PRESETS) + ".")
    rounds: int = param(30, "Communication rounds T.")
    neighbours: int = param(5, "Neighbours M per agent and round (decentralized strategies).")
    max_wait: int = param(2, "Max prior neighbours N an agent waits for (0: fully parallel).")
    topology: str = param("random", "Neighbour topology: random, ring or full.")
    epochs: int = param(5, "Local epochs E per round.")
    batch_size: int = param(128, "Local batch size (the local set if smaller).")
    lr: float = param(0.1, "Initial learning rate (FedAdam presets: 1e-3).")
    lr_decay: float = param(0.998, "Learning-rate decay per round: lr x decay^t (FedAdam: 1).")
    weight_decay: float = param(5e-4, "SGD weight decay.")
    momentum: float = param(0.0, "SGD momentum (dfedavgm uses 0.9).")
    density: float = param(0.5, "Initial ERK density of the sparse models (1 - sparsity).")
    rigl_a: float = param(0.3, "RigL drop fraction a: alpha_t = a/2 (1 + cos(pi t / T)).")
    rigl_batches: int = param(1, "Local batches for RigL's dense gradient.")
    delta_pr: float = param(0.02, "Pruning-time detection threshold delta_pr.")
    detection_distance: str = param(
        "squared",
        "Distance D = ||w - w0||^2 of the detection score (squared, ALGORITHMS.md 1.7) or "
        "||w - w0|| (norm, as the DA-DPFL authors' code computes it).",
    )
    delta_v: float = param(0.5, "Fraction of votes that decides the first pruning time t*.")
    schedule_b: float = param(0.0, "Pruning schedule delay b: I_tau = ceil((t* + b) / c^(tau-1)).")
    schedule_c: float = param(1.3, "Pruning schedule factor c.")
    pqi_p: float = param(0.5, "PQI norm p.")
    pqi_q: float = param(1.0, "PQI norm q.")
    pqi_eta_c: float = param(0.0, "PQI compression hyper-parameter eta_c.")
    pqi_gamma: float = param(1.0, "PQI scaling factor gamma.")
    pqi_beta: float = param(0.9, "PQI cap beta on the fraction pruned per layer and event.")
    target_sparsity: float = param(0.8, "Target sparsity s* that further pruning stops at.")
    fp16: bool = param(False, "Send model values as fp16.")
    reduce: str = param(
        "prune",
        "How a sparse agent cuts compute to its budget p_k: prune (cap its density), freeze "
        "(train a p_k fraction of its neurons, FedSPU-style) or auto (freeze at p_k >= 0.5).",
    )
    early_stop: bool = param(
        False, "Stop an agent once L = 0.7 L_train + 0.3 L_val rises from its previous round."
    )
    stop_patience: int = param(1, "Early stopping: consecutive rises of L that stop an agent.")
    ssm_fraction: float = param(0.05, "FedAdam-SSM/-Top: fraction alpha of deltas kept (top-k).")
    ldf_n: int = param(
        4,
        "FedLDF: participants n uploading each layer (top-n divergence); with --wire layers, "
        "the neighbours each layer is fetched from.",
    )
    wire: str = param(
        "full",
        "What decentralized agents send: full (their sparse model), delta (the top-k of its "
        "change since what receivers hold; every agent follows every peer) or layers (a "
        "divergence vector, then the layers each receiver asks for: FedLDF between neighbours).",
    )
    delta_fraction: float = param(0.1, "--wire delta: fraction of the kept entries sent (top-k).")

    @property
    def sgd(self) -> SGDConfig:
        return SGDConfig(
            lr=self.lr,
            lr_decay=self.lr_decay,
            momentum=self.momentum,
            weight_decay=self.weight_decay,
            batch_size=self.batch_size,
            epochs=self.epochs,
        )


def preset(name: str, **overrides: Any) -> StrategyConfig:
    """The configuration of a named preset, with explicit overrides applied on top.

    A preset fixes what defines its method (DisPFL never waits, DFedAvgM uses momentum 0.9);
    an override that contradicts it is an error rather than silently ignored.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown strategy {name!r}; known: {', '.join(PRESETS)}")
    fixed: dict[str, Any] = {}
    defaults: dict[str, Any] = {}
    if name == "dispfl":
        fixed = {"max_wait": 0}
    elif name == "dfedavgm":
        fixed = {"max_wait": 0, "momentum": 0.9}
    elif name in ADAM_FAMILY:
        defaults = {"lr": 1e-3, "lr_decay": 1.0}  # ALGORITHMS.md 3: Adam at lr 1e-3
    for key, value in fixed.items():
        if key in overrides and overrides[key] != value:
            flag = "--" + key.replace("_", "-")
            raise ValueError(f"{name} fixes {flag} to {value}; got {overrides[key]}")
    return StrategyConfig(**{**defaults, **overrides, **fixed, "strategy": name})


@dataclass(frozen=True)
class StopWatch:
    """An agent's early-stopping state: its last loss L and how many rounds in a row L rose.

    ALGORITHMS.md 2 stops at the first rise (patience 1); a larger `stop_patience` waits for
    that many consecutive rises, for noisy local losses."""

    previous: float | None = None
    rises: int = 0

    def after(self, loss: float, patience: int) -> tuple[StopWatch, bool]:
        """The state after a round with loss `loss`, and whether the agent stops."""
        rose = self.previous is not None and loss > self.previous
        watch = StopWatch(loss, self.rises + 1 if rose else 0)
        return watch, watch.rises >= patience


def frozen_training_flops(learner: Learner, masks: Masks | None, active: Masks) -> int:
    """Training FLOPs per sample with frozen weights: the forward pass and the input-gradient
    pass run through every kept weight (frozen neurons still pass gradients back to active
    ones), the weight-gradient pass only through the active ones: 2 F + F_active."""
    masks = masks or {}
    trainable = {n: a & masks[n] if n in masks else a for n, a in active.items()}
    return 2 * learner.forward_flops(masks or None) + learner.forward_flops(trainable)


def early_stop_savings(records: list[dict[str, Any]], stop_round: int, limit: int) -> dict:
    """What an agent that stopped after `stop_round` saved against training to round `limit`:
    the rounds not run, and its mean training FLOPs and link bytes per round run (from its
    round `records`) times those rounds."""
    saved_rounds = limit - stop_round
    ran = max(len(records), 1)
    flops = sum(r["train_flops"] for r in records) / ran
    traffic = sum(r["bytes_sent"] + r["bytes_received"] for r in records) / ran
    return {
        "round": stop_round,
        "saved_rounds": saved_rounds,
        "saved_flops": round(flops * saved_rounds),
        "saved_bytes": round(traffic * saved_rounds),
    }


@dataclass(frozen=True)
class Published:
    """The model an agent makes available to its neighbours after a round."""

    weights: State
    masks: Masks | None
    num_samples: int


@dataclass
class AgentState:
    """Everything an agent carries from one round to the next (and checkpoints)."""

    agent_id: str
    weights: State
    masks: Masks | None
    init_weights: State
    distances: list[float] = field(default_factory=list)
    round: int = 0


@dataclass(frozen=True)
class RoundResult:
    """One agent's round: its new state, what it publishes, and the figures to report."""

    state: AgentState
    published: Published
    loss: float
    accuracy: float
    train_loss: float
    train_flops: int
    vote: bool | None
    score: float | None
    pruned: bool
    divergence: dict[str, float] | None = None
    """With --wire layers: per layer, how far training moved the model from its aggregate."""


@dataclass(frozen=True)
class LocalData:
    """One agent's local data as tensors: train for training, test for accuracy, validation
    for early stopping."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor


_Model = TypeVar("_Model", AgentState, Published)


class Learner:
    """The pieces every round needs: a model to compute with, its shapes and the config.

    One `Learner` serves every agent of a simulation (the model module is only a compute
    buffer: weights are loaded from the agent's state each time).
    """

    def __init__(
        self,
        model: nn.Module,
        input_shape: tuple[int, ...],
        prunable: list[str],
        config: StrategyConfig,
        seed: int,
    ) -> None:
        self.model = model
        self.input_shape = input_shape
        self.prunable = prunable
        self.config = config
        self.seed = seed
        self.initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        # Output positions per layer, read once: FLOPs under a mask need only the kept counts.
        self._positions = output_positions(model, input_shape)
        self._weight_shapes = {n: tuple(self.initial[n].shape) for n in self._positions}
        self.dense_flops = flops_from_positions(self._positions, self._weight_shapes)
        self.sparse = config.strategy in ("dadpfl", "dispfl")
        self.prunes_further = config.strategy == "dadpfl"
        self.decentralized = config.strategy in DECENTRALIZED
        self._shapes = {name: tuple(self.initial[name].shape) for name in prunable}
        self._densities = (
            sparse.erk_densities(self._shapes, config.density) if self.sparse else None
        )

    def generator(self, purpose: str, agent_id: str, round_: int) -> torch.Generator:
        return torch.Generator().manual_seed(derive_seed(self.seed, purpose, agent_id, round_))

    def initial_masks(self, agent_id: str) -> Masks | None:
        """The agent's ERK mask, drawn from (fleet seed, agent id) alone (1.1).

        Any agent can therefore recompute any other agent's starting model w0 (.) m_j, so
        round 1 needs no initial exchange of models.
        """
        if self._densities is None:
            return None
        generator = self.generator("mask", agent_id, 0)
        return sparse.random_masks(self._shapes, self._densities, generator)

    def init_agent(self, agent_id: str) -> AgentState:
        masks = self.initial_masks(agent_id)
        weights = sparse.apply_masks(self.initial, masks) if masks else dict(self.initial)
        return AgentState(agent_id, weights, masks, init_weights=weights)

    def published(self, state: AgentState, num_samples: int) -> Published:
        return Published(state.weights, state.masks, num_samples)

    def forward_flops(self, masks: Masks | None) -> int:
        """Forward FLOPs per sample with the conv/linear weights of `masks` (other entries of
        `masks`, such as biases, are ignored; None: dense)."""
        if not masks:
            return self.dense_flops
        weights = {n: m for n, m in masks.items() if n in self._positions}
        return flops_from_positions(self._positions, self._weight_shapes, weights)

    def train_flops(self, masks: Masks | None, samples: int) -> int:
        """3 x forward FLOPs of the (masked) model x samples: forward + backward (1.10)."""
        return 3 * self.forward_flops(masks) * samples

    def dense_gradient_flops(self, masks: Masks | None, samples: int) -> int:
        """RigL's dense-gradient batches (1.10), counted as the RigL paper does (Evci et al.
        2020, sec. 3: 2 f_S + f_D per sample): the forward pass and the gradient of the
        inputs go through the masked model, like training's; only the weights' gradient is
        dense."""
        return (2 * self.forward_flops(masks) + self.dense_flops) * samples

    @functools.cached_property
    def layer_groups(self) -> dict[str, list[str]]:
        """FedLDF's layers: each weight with its bias and norm parameters."""
        from agent.ldf import layer_groups

        return layer_groups(self.model)

    def layer_part(self, model: Published, layers: list[str]) -> Published:
        """The tensors of FedLDF `layers` of a model, with their masks: what a neighbour sends
        when asked for those layers (`--wire layers`)."""
        groups = self.layer_groups
        return _restricted(model, [name for layer in layers for name in groups[layer]])

    def aggregate(self, agent: AgentState, inbox: dict[str, Published]) -> State:
        """Mask-based aggregation for sparse strategies (eq. 7), plain mean for dense ones.

        A neighbour that sent only some layers (`--wire layers`) counts for those alone: each
        set of tensors with the same senders is aggregated over them and the agent itself,
        which per element is exactly the aggregation of whole models."""
        if not inbox:
            return agent.weights
        by_senders: dict[frozenset[str], list[str]] = {}
        for name in agent.weights:
            senders = frozenset(j for j, p in inbox.items() if name in p.weights)
            by_senders.setdefault(senders, []).append(name)
        if len(by_senders) > 1 or set(by_senders) != {frozenset(inbox)}:
            out: State = {}
            for senders, names in by_senders.items():
                part = _restricted(agent, names)
                out |= self.aggregate(part, {j: _restricted(inbox[j], names) for j in senders})
            return {name: out[name] for name in agent.weights}
        if agent.masks is not None:
            models = {j: (p.weights, p.masks or {}) for j, p in inbox.items()}
            models[agent.agent_id] = (agent.weights, agent.masks)
            return sparse.aggregate_masked(models, agent.masks)
        states = {j: p.weights for j, p in inbox.items()}
        states[agent.agent_id] = agent.weights
        return sparse.aggregate_mean(states)

    def local_round(
        self,
        agent: AgentState,
        data: LocalData,
        inbox: dict[str, Published],
        round_: int,
        prune_now: bool,
        density_cap: float | None = None,
        active_fraction: float | None = None,
    ) -> RoundResult:
        """One decentralized round of agent k: aggregate, train, vote, prune, RigL, evaluate.

        The order follows the paper's Algorithm 1: the vote scores the freshly trained model,
        further pruning (when `prune_now` and sparsity < s*) precedes the RigL update, and the
        reported accuracy is that of the model the agent keeps and publishes. A `density_cap`
        below the current density (the device's budget, `agent.budget.density_cap`) prunes
        the aggregated model to the cap by magnitude before training; an `active_fraction`
        instead trains that fraction of the neurons and freezes the rest (`--reduce`).
        """
        cfg = self.config
        start = self.aggregate(agent, inbox)
        if agent.masks is not None and density_cap is not None:
            capped = sparse.prune_to_density(start, agent.masks, density_cap)
            agent = dataclasses.replace(agent, masks=capped)
            start = sparse.apply_masks(start, capped)
        active = None
        if active_fraction is not None:
            from agent.freezing import active_masks

            generator = self.generator("active", agent.agent_id, round_)
            active = active_masks(self.model, start, active_fraction, generator)
        trained = train_local(
            self.model,
            start,
            agent.masks,
            data.x_train,
            data.y_train,
            cfg.sgd,
            round_,
            self.generator("train", agent.agent_id, round_),
            frozen=active,
        )
        if active is None:
            flops = self.train_flops(agent.masks, trained.samples)
        else:
            flops = frozen_training_flops(self, agent.masks, active) * trained.samples
        weights, masks = trained.state, agent.masks
        vote = score = None
        distances = agent.distances
        pruned = False
        if self.sparse and masks is not None:
            distance = pruning.distance_from_init(
                weights, agent.init_weights, self.prunable, cfg.detection_distance
            )
            distances = [*agent.distances, distance]
            previous = distances[-2] if len(distances) > 1 else 0.0
            score = pruning.detection_score(distance, previous, distances[0])
            vote = pruning.vote(score, cfg.delta_pr)
            if self.prunes_further and prune_now and sparse.sparsity(masks) < cfg.target_sparsity:
                masks = sparse.pqi_prune(
                    weights,
                    masks,
                    p=cfg.pqi_p,
                    q=cfg.pqi_q,
                    eta_c=cfg.pqi_eta_c,
                    gamma=cfg.pqi_gamma,
                    beta=cfg.pqi_beta,
                    target_sparsity=cfg.target_sparsity,
                )
                weights = sparse.apply_masks(weights, masks)
                pruned = True
            grads, grad_samples = dense_gradients(
                self.model,
                weights,
                self.prunable,
                data.x_train,
                data.y_train,
                cfg.batch_size,
                cfg.rigl_batches,
                self.generator("rigl", agent.agent_id, round_),
            )
            flops += self.dense_gradient_flops(masks, grad_samples)
            masks = sparse.rigl_update(
                weights, masks, grads, sparse.rigl_alpha(round_, cfg.rounds, cfg.rigl_a)
            )
            weights = sparse.apply_masks(weights, masks)
        loss, accuracy = evaluate(self.model, weights, data.x_test, data.y_test)
        divergence = None
        if cfg.wire == "layers" and self.decentralized:
            from agent.ldf import divergences

            divergence = divergences(weights, start, self.layer_groups)
        new_state = dataclasses.replace(
            agent, weights=weights, masks=masks, distances=distances, round=round_
        )
        return RoundResult(
            state=new_state,
            published=Published(weights, masks, len(data.y_train)),
            loss=loss,
            accuracy=accuracy,
            train_loss=trained.mean_loss,
            train_flops=flops,
            vote=vote,
            score=None if score is None or not math.isfinite(score) else score,
            pruned=pruned,
            divergence=divergence,
        )

    def flops_per_density(self, masks: Masks) -> float:
        """FLOP fraction / parameter density of these masks (ERK keeps FLOP-heavy layers
        denser), for `agent.budget.density_cap`."""
        density = 1.0 - sparse.sparsity(masks)
        flops = flops_from_positions(self._positions, self._weight_shapes, masks)
        return flops / self.dense_flops / density

    def stopping_loss(self, weights: State, train_loss: float, data: LocalData) -> float:
        """L_t = 0.7 L_train + 0.3 L_val (ALGORITHMS.md 2): L_train this round's mean training
        loss, L_val the trained model's loss on the validation split, in eval mode. An agent
        stops once L_t exceeds its previous L (NaN, e.g. without a validation split, never)."""
        val_loss, _ = evaluate(self.model, weights, data.x_val, data.y_val)
        return STOP_LAMBDA * train_loss + (1.0 - STOP_LAMBDA) * val_loss

    def evaluate_on(self, weights: State, data: LocalData) -> tuple[float, float]:
        return evaluate(self.model, weights, data.x_test, data.y_test)


def _restricted(model: _Model, names: list[str]) -> _Model:
    """An agent state or published model cut down to the tensors `names` (and their masks)."""
    weights = {n: model.weights[n] for n in names}
    masks = None if model.masks is None else {n: model.masks[n] for n in names if n in model.masks}
    return dataclasses.replace(model, weights=weights, masks=masks)
