"""The learner: what every round needs (a model to compute with, its shapes, the config),
and one decentralized round, composed (`Learner.local_round`).

A round's math (aggregate, train, vote, prune, update the mask) owns nothing of the runtime:
it never waits, sends or sleeps. The in-process simulator and the networked agent both hand
it the same inputs (the agent's state, the models it holds from its neighbours) and get the
same outputs (its new state and the model it publishes), which is what makes a networked
run reproduce a simulated one.

What differs between the decentralized strategies (dadpfl, dispfl, dfedavgm, local, a
user's: what they aggregate, what follows training) is theirs, in `agent.learning.decentral`;
the run's aggregation rule, their default, is `Learner.aggregate`; the centralized strategies'
rounds (ALGORITHMS.md sections 2 to 4) live in `agent.learning.central`; which is which,
with each one's traits, in the table `agent.learning.strategies`. Early stopping
(`early_stop`, section 2) applies to every strategy.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import nn

from agent.learning import (
    channels,
    prefix,
    robust,
    robust_rules,
    sparse,
    statistics,
    strategies,
)
from agent.learning.config import STOP_LAMBDA, StrategyConfig
from agent.learning.decentral.base import DecentralizedStrategy, Trained
from agent.learning.facts import LocalData as LocalData  # re-exported: imported from here too
from agent.learning.kept import Judged, Kept, Shadow
from agent.learning.models import flops_from_positions, output_positions
from agent.learning.precision import FP32
from agent.learning.prefix import Layer
from agent.learning.reduced import reduced_training
from agent.learning.reduction import NO_REDUCTION, Reduction, sends_parts
from agent.learning.reductions.base import Start, started
from agent.learning.sparse import Masks, State
from agent.learning.tasks import Task
from agent.learning.training import (
    CLASSIFICATION,
    derive_seed,
    evaluate,
    model_device,
)

if TYPE_CHECKING:
    from agent.learning.freezing import FreezingPlan
    from agent.learning.width import WidthPlan

log = logging.getLogger(__name__)


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
    shadow: Shadow | None = None
    """The device's local-only model (`--fallback local`), trained beside the strategy's."""
    kept: Kept | None = None
    """The model the device keeps and serves after its latest round (`fallback.choose`)."""


@dataclass(frozen=True)
class RoundResult:
    """One agent's round: its new state, what it publishes, and the figures to report."""

    state: AgentState
    published: Published
    loss: float
    accuracy: float
    """The task's metric on the agent's test split (`tasks.Task.metric_name`): accuracy for
    classification, named so in every record of a classification run. That of the model the
    agent keeps once the round is settled (`fallback.settle`)."""
    train_loss: float
    train_flops: int
    vote: bool | None
    score: float | None
    pruned: bool
    divergence: dict[str, float] | None = None
    """With --wire layers: per layer, how far training moved the model from its aggregate."""
    recovered: bool = False
    """The round's model turned non-finite: the agent kept its model from before the round."""
    judged: Judged | None = None
    """What the agent kept after the round and why, and the strategy's model's figures."""


_Model = TypeVar("_Model", AgentState, Published)


def starting_point(
    learner: Learner,
    agent: AgentState,
    inbox: dict[str, Published],
    round_: int,
    reduction: Reduction,
) -> tuple[State, AgentState, Masks | None]:
    """The round's start: the strategy's aggregate (`DecentralizedStrategy.aggregate`, the
    run's rule `Learner.aggregate` unless a user's strategy says otherwise), with each
    reduction kind's step before training (`ReductionKind.started`: pruned by magnitude to a
    density cap, the neurons that train drawn for an active fraction, the rest frozen).
    Returns the start, the agent (with its capped masks) and the active masks (None:
    everything trains)."""
    draw = functools.partial(learner.generator, "active", agent.agent_id, round_)
    aggregate = learner.decentral.aggregate(learner, agent, inbox)
    begun = started(learner, Start(aggregate, agent.masks), reduction, draw)
    if begun.masks is not agent.masks:
        agent = dataclasses.replace(agent, masks=begun.masks)
    return begun.weights, agent, begun.active


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
        task: Task = CLASSIFICATION,
    ) -> None:
        self.model = model
        self.task = task
        self.input_shape = input_shape
        self.prunable = prunable
        self.config = config
        self.seed = seed
        self.initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        # Output positions per layer, read once: FLOPs under a mask need only the kept counts.
        self._positions = output_positions(model, input_shape)
        self._weight_shapes = {n: tuple(self.initial[n].shape) for n in self._positions}
        self.dense_flops = flops_from_positions(self._positions, self._weight_shapes)
        self.traits = strategies.strategy(config.strategy)
        """What the strategy is (`agent.learning.strategies`): its family and traits."""
        self.sparse = self.traits.sparse
        self.prunes_further = self.traits.prunes_further
        self.decentralized = self.traits.decentralized
        self._shapes = {name: tuple(self.initial[name].shape) for name in prunable}
        self.channel_masks = self.sparse and config.mask_unit == "channel"
        """Masks keep whole channels (`agent.learning.channels`), the model trains narrow."""
        self._densities = (
            sparse.erk_densities(self._shapes, config.density)
            if self.sparse and not self.channel_masks
            else None
        )
        if self.channel_masks:
            self.channel_plan  # noqa: B018 - a model it cannot cut is refused here, in one line
        self.sends_windows = (
            self.decentralized and config.wire == "full" and sends_parts(config.reduce)
        )
        """A round that trained a window of layers publishes those layers alone
        (`published_part`), the others being what the agent already had from its aggregate."""
        self.compute_format = FP32
        """The training step's memory format and precision, as the device measured it
        fastest (`agent.device.calibration`); plain fp32 unless a measurement says so."""
        self.local_keys = local_statistics(model) if config.batchnorm == "local" else ()
        """State entries that never take another device's values (`own_statistics`)."""
        self.recurrent = any(isinstance(m, nn.RNNBase) for m in model.modules())
        self.sgd = config.local_training(self.recurrent)  # recurrent: Adam (--optimizer auto)

    @property
    def device(self) -> torch.device:
        """The device the model computes on (`to`); weights and masks stay on the CPU."""
        return model_device(self.model)

    def to(self, device: torch.device) -> Learner:
        """Compute on `device` from now on: only the model moves. The weights, masks and data
        a round takes and returns stay CPU tensors (`agent.learning.training` copies batches
        in and results out), and the generators stay CPU ones, so batch order, masks and
        active neurons are drawn as on the CPU. Returns the learner itself.
        """
        if device.type != "cpu" and self.traits.adam:
            raise ValueError(
                f"--device {device}: strategy {self.config.strategy} trains on the cpu only "
                "(its Adam moments are kept there); use --device cpu"
            )
        self.model.to(device)
        return self

    def generator(self, purpose: str, agent_id: str, round_: int) -> torch.Generator:
        return torch.Generator().manual_seed(derive_seed(self.seed, purpose, agent_id, round_))

    def initial_masks(self, agent_id: str) -> Masks | None:
        """The agent's ERK mask, drawn from (fleet seed, agent id) alone (1.1).

        Any agent can therefore recompute any other agent's starting model w0 (.) m_j, so
        round 1 needs no initial exchange of models.
        """
        if not self.sparse:
            return None
        generator = self.generator("mask", agent_id, 0)
        if self.channel_masks:
            return channels.random_masks(self.channel_plan, self.config.density, generator)
        assert self._densities is not None
        return sparse.random_masks(self._shapes, self._densities, generator)

    def init_agent(self, agent_id: str) -> AgentState:
        masks = self.initial_masks(agent_id)
        weights = sparse.apply_masks(self.initial, masks) if masks else dict(self.initial)
        return AgentState(agent_id, weights, masks, init_weights=weights)

    def published(self, state: AgentState, num_samples: int) -> Published:
        return Published(state.weights, state.masks, num_samples)

    def published_part(self, model: Published, reduction: Reduction) -> Published:
        """What a round publishes: with `sends_windows`, what its kind says it publishes
        (`Reduction.published`: a window's layers alone), else the whole model. A
        receiver aggregates each layer over those who sent it (`combine`)."""
        names = reduction.published(self) if self.sends_windows else None
        if names is None:
            return model
        return _restricted(model, [name for name in model.weights if name in names])

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

    def own_statistics(self, state: State, own: State) -> State:
        """`state` with the agent's `own` BatchNorm running statistics (FedBN): a device's
        statistics describe its own data's features, which differ from device to device in
        the non-IID fleets this is for; averaged ones normalize every device with a mix
        that fits none of them (Li et al. 2021, FedBN). The learned scale and shift are
        averaged as usual. `state` itself when the model has none (or with --batchnorm
        shared)."""
        if not self.local_keys:
            return state
        return {name: own[name] if name in self.local_keys else t for name, t in state.items()}

    def fresh_statistics(self, weights: State, data: LocalData) -> State:
        """`weights` with its BatchNorm running statistics re-estimated from the device's
        training data under these very weights (`statistics.refreshed`), as a model is
        evaluated, kept and served; itself without BatchNorm or with --batchnorm shared."""
        return statistics.refreshed(self.model, weights, data.x_train, self.local_keys)

    @functools.cached_property
    def freezing_plan(self) -> FreezingPlan:
        """What FedSPU and `--reduce freeze` freeze in this model (`freezing.freezing_plan`),
        inferred once: it traces the model and runs a forward pass, too much for every draw.
        A model without neuron groups freezes whole layers, and says so here, once."""
        from agent.learning.freezing import freezing_plan

        plan = freezing_plan(self.model, self.input_shape)
        if plan.note is not None:
            log.warning("%s", plan.note)
        return plan

    @functools.cached_property
    def layer_groups(self) -> dict[str, list[str]]:
        """FedLDF's layers: each weight with its bias and norm parameters."""
        from agent.learning.ldf import layer_groups

        return layer_groups(self.model)

    def layer_part(self, model: Published, layers: list[str]) -> Published:
        """The tensors of FedLDF `layers` of a model, with their masks: what a neighbour sends
        when asked for those layers (`--wire layers`)."""
        groups = self.layer_groups
        return _restricted(model, [name for layer in layers for name in groups[layer]])

    def aggregate(self, agent: AgentState, inbox: dict[str, Published]) -> State:
        """Mask-based aggregation for sparse strategies (eq. 7), plain mean for dense ones,
        or the robust rule of `--aggregation`; each received model first clipped to the
        `--clip` bound around the agent's own (`robust.clip`). The run's rule, which a
        round takes through its strategy (`DecentralizedStrategy.aggregate`, the default)."""
        if not inbox:
            return agent.weights
        return self.own_statistics(self._combined(agent, inbox), agent.weights)

    def _combined(self, agent: AgentState, inbox: dict[str, Published]) -> State:
        rule = robust_rules.parse_rule(self.config.aggregation)
        return combine(agent, inbox, rule, self.config.clip)

    @functools.cached_property
    def forward_layers(self) -> tuple[Layer, ...]:
        """The layers a window trains (`agent.learning.prefix`), in forward order: read once
        with a probe pass."""
        return prefix.forward_layers(self.model, self.input_shape)

    @functools.cached_property
    def channel_plan(self) -> channels.ChannelPlan:
        """The channels `--mask-unit channel` keeps or drops (`agent.learning.channels`),
        traced once; ValueError in one line for a model with none to drop."""
        from agent.learning.width import channel_classes

        try:
            classes = channel_classes(self.model, self.input_shape)
            plan = channels.channel_plan(classes, self._shapes)
        except ValueError as exc:
            raise ValueError(f"--mask-unit channel: {exc}") from None
        return plan

    @functools.cached_property
    def width_plan(self) -> WidthPlan:
        """The channels a narrower sub-model keeps (`agent.learning.width`), traced once."""
        from agent.learning.width import width_plan

        plan = width_plan(self.model, self.input_shape)
        if plan.note is not None:
            log.warning("%s", plan.note)
        return plan

    @functools.cached_property
    def decentral(self) -> DecentralizedStrategy:
        """The decentralized strategy whose steps `local_round` takes (the table's class)."""
        cls = strategies.implementation(self.config.strategy)
        if not issubclass(cls, DecentralizedStrategy):
            raise TypeError(f"{self.config.strategy} has no decentralized round")
        return cls()

    def local_round(
        self,
        agent: AgentState,
        data: LocalData,
        inbox: dict[str, Published],
        round_: int,
        prune_now: bool,
        reduction: Reduction = NO_REDUCTION,
    ) -> RoundResult:
        """One decentralized round of agent k: the strategy's aggregate (`decentral`), train,
        the strategy's step after training (vote, prune, RigL), evaluate.

        The order follows the paper's Algorithm 1: the vote scores the freshly trained model,
        further pruning (when `prune_now` and sparsity < s*) precedes the RigL update, and the
        reported accuracy is that of the model the agent keeps and publishes. The device's
        budget cuts the training as `reduction` says (`agent.learning.reduction`): a density
        cap below the current density prunes the aggregated model to the cap by magnitude
        before training; an active fraction trains that fraction of the neurons and freezes
        the rest; a window or a width trains part of the layers or a narrower sub-model.
        """
        cfg = self.config
        before = agent
        start, agent, active = starting_point(self, agent, inbox, round_, reduction)
        trained, flops = reduced_training(
            self,
            start,
            agent.masks,
            active,
            reduction,
            data,
            round_,
            self.generator("train", agent.agent_id, round_),
        )
        done = Trained(agent, trained.state, agent.masks, data, round_, prune_now)
        step = self.decentral.after_training(self, done)
        weights, masks, flops = step.weights, step.masks, flops + step.flops
        if not robust.finite(weights):
            return _recovered(self, before, data, round_, flops, trained.mean_loss)
        weights = self.fresh_statistics(weights, data)
        divergence = None
        if cfg.wire == "layers" and self.decentralized:
            from agent.learning.ldf import divergences

            divergence = divergences(weights, start, self.layer_groups)
        loss, accuracy = self.evaluate_on(weights, data)
        new_state = dataclasses.replace(
            agent, weights=weights, masks=masks, distances=step.distances, round=round_
        )
        return RoundResult(
            state=new_state,
            published=self.published_part(Published(weights, masks, len(data.y_train)), reduction),
            loss=loss,
            accuracy=accuracy,
            train_loss=trained.mean_loss,
            train_flops=flops,
            vote=step.vote,
            score=None if step.score is None or not math.isfinite(step.score) else step.score,
            pruned=step.pruned,
            divergence=divergence,
        )

    def flops_per_density(self, masks: Masks) -> float:
        """FLOP fraction / parameter density of these masks (ERK keeps FLOP-heavy layers
        denser), for `agent.learning.reduction.density_cap`."""
        density = 1.0 - sparse.sparsity(masks)
        flops = flops_from_positions(self._positions, self._weight_shapes, masks)
        return flops / self.dense_flops / density

    def stopping_loss(self, weights: State, train_loss: float, data: LocalData) -> float:
        """L_t = 0.7 L_train + 0.3 L_val (ALGORITHMS.md 2): L_train this round's mean training
        loss, L_val the trained model's loss on the validation split, in eval mode. An agent
        stops once L_t exceeds its previous L (NaN, e.g. without a validation split, never)."""
        val_loss, _ = evaluate(self.model, weights, data.x_val, data.y_val, task=self.task)
        return STOP_LAMBDA * train_loss + (1.0 - STOP_LAMBDA) * val_loss

    def evaluate_on(self, weights: State, data: LocalData) -> tuple[float, float]:
        """(mean loss, metric) of `weights` on the agent's test split: the task's metric,
        accuracy for classification."""
        return evaluate(self.model, weights, data.x_test, data.y_test, task=self.task)


def _recovered(
    learner: Learner,
    before: AgentState,
    data: LocalData,
    round_: int,
    flops: int,
    train_loss: float,
) -> RoundResult:
    """A round whose model turned non-finite (a poisoned aggregate, a diverged step): the
    agent goes back to its model before the round, keeps it and publishes it again,
    rather than dropping out with a model nobody can use."""
    loss, accuracy = learner.evaluate_on(before.weights, data)
    layers = learner.config.wire == "layers" and learner.decentralized
    return RoundResult(
        state=dataclasses.replace(before, round=round_),
        published=Published(before.weights, before.masks, len(data.y_train)),
        loss=loss,
        accuracy=accuracy,
        train_loss=train_loss if math.isfinite(train_loss) else loss,
        train_flops=flops,
        vote=False if learner.sparse else None,  # a missing vote would count 0 as well
        score=None,
        pruned=False,
        divergence=dict.fromkeys(learner.layer_groups, 0.0) if layers else None,
        recovered=True,
    )


def local_statistics(model: nn.Module) -> tuple[str, ...]:
    """The state-dict names of the model's BatchNorm running statistics (running mean,
    variance and batch count): what FedBN keeps on each device."""
    return tuple(
        f"{name}.{buffer}" if name else buffer
        for name, module in model.named_modules()
        if isinstance(module, nn.modules.batchnorm._BatchNorm)
        for buffer, value in module.named_buffers(recurse=False)
        if value is not None
    )


def combine(
    agent: AgentState,
    inbox: dict[str, Published],
    rule: robust_rules.Rule,
    clip: str = robust_rules.CLIP_OFF,
) -> State:
    """`Learner.aggregate`: each received model clipped to the `clip` bound around the
    agent's own (`robust.clip`), then eq. 7 for sparse agents, the plain mean for dense
    ones, or the robust `rule`.

    A neighbour that sent only some layers (`--wire layers`, a trained window) counts for
    those alone: each set of tensors with the same senders is clipped and aggregated over
    them and the agent itself, which per element is exactly the aggregation of whole
    models, and compares distances over the same tensors only."""
    by_senders: dict[frozenset[str], list[str]] = {}
    for name in agent.weights:
        senders = frozenset(j for j, p in inbox.items() if name in p.weights)
        by_senders.setdefault(senders, []).append(name)
    if len(by_senders) > 1 or set(by_senders) != {frozenset(inbox)}:
        out: State = {}
        for senders, names in by_senders.items():
            part = _restricted(agent, names)
            if not senders:
                out |= part.weights
                continue
            out |= combine(part, {j: _restricted(inbox[j], names) for j in senders}, rule, clip)
        return {name: out[name] for name in agent.weights}
    if clip != robust_rules.CLIP_OFF:
        clipped = robust.clip(
            agent.weights,
            {j: p.weights for j, p in inbox.items()},
            clip,
            {j: p.masks for j, p in inbox.items()},
        )
        inbox = {j: dataclasses.replace(p, weights=clipped[j]) for j, p in inbox.items()}
    if rule.robust:
        return _robust_combine(agent, inbox, rule)
    if agent.masks is not None:
        models = {j: (p.weights, p.masks or {}) for j, p in inbox.items()}
        models[agent.agent_id] = (agent.weights, agent.masks)
        return sparse.aggregate_masked(models, agent.masks)
    states = {j: p.weights for j, p in inbox.items()}
    states[agent.agent_id] = agent.weights
    return sparse.aggregate_mean(states)


def _robust_combine(
    agent: AgentState, inbox: dict[str, Published], rule: robust_rules.Rule
) -> State:
    """`rule` over the agent and its senders, per element over those that hold it (a sparse
    sender its mask's entries), cut to the agent's own mask (eq. 7's last step)."""
    states = {j: p.weights for j, p in inbox.items()} | {agent.agent_id: agent.weights}
    held = {j: p.masks or {} for j, p in inbox.items()} | {agent.agent_id: agent.masks or {}}
    out, _counts = robust.aggregate(states, rule, held)
    return sparse.apply_masks(out, agent.masks) if agent.masks is not None else out


def _restricted(model: _Model, names: list[str]) -> _Model:
    """An agent state or published model cut down to the tensors `names` (and their masks)."""
    weights = {n: model.weights[n] for n in names}
    masks = None if model.masks is None else {n: model.masks[n] for n in names if n in model.masks}
    return dataclasses.replace(model, weights=weights, masks=masks)


def served_model(learner: Learner, weights: State, masks: Masks | None) -> tuple[nn.Module, State]:
    """The model a device serves (exports to ONNX) and its weights: with channel masks the
    narrower model they leave, which computes the same outputs with fewer weights and FLOPs
    (`agent.learning.channels`); else the learner's model itself."""
    if not learner.channel_masks or masks is None:
        return learner.model, weights
    from agent.learning import width

    plan = learner.channel_plan
    chosen = channels.selection(plan, masks)
    narrow = width.narrow_model(learner.model, plan.width, chosen)
    return narrow, width.narrow_state(weights, plan.width, chosen)
