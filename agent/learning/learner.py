"""The learner: what every round needs (the model's facts, `model_facts`, the config and
the strategy), and one decentralized round, composed (`Learner.local_round`).

A round's math (aggregate, train, vote, prune, update the mask) owns nothing of the runtime:
it never waits, sends or sleeps. The in-process simulator and the networked agent both hand
it the same inputs (the agent's state, the models it holds from its neighbours) and get the
same outputs (its new state and the model it publishes), which is what makes a networked
run reproduce a simulated one.

What differs between the decentralized strategies (dadpfl, dispfl, dfedavgm, local, a
user's: their first mask, what they aggregate, how they train, what follows training and
what they publish) is theirs, in `agent.learning.decentral`;
the run's aggregation rule, their default, is `Learner.aggregate`; the centralized strategies'
rounds (ALGORITHMS.md sections 2 to 4) live in `agent.learning.central`; which is which,
with each one's traits, in the table `agent.learning.strategies`. Early stopping
(`early_stop`, section 2) applies to every strategy.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import nn

from agent.learning import channels, robust, robust_rules, screening, sparse, strategies
from agent.learning.config import StrategyConfig
from agent.learning.decentral.base import DecentralizedStrategy, RoundStart
from agent.learning.facts import LocalData as LocalData  # re-exported: imported from here too
from agent.learning.kept import Judged, Kept, Shadow
from agent.learning.model_facts import ModelFacts
from agent.learning.privacy import Accountant
from agent.learning.reduction import NO_REDUCTION, Reduction, sends_parts
from agent.learning.reductions.base import Start, started
from agent.learning.screening import NOTHING, Screening
from agent.learning.sparse import Masks, State
from agent.learning.tasks import Task
from agent.learning.training import CLASSIFICATION


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
    dp_steps: int = 0
    """The DP-SGD steps its training took in the run so far (`--dp sample`): what its
    accountant composes (`privacy.Accountant`)."""
    shadow: Shadow | None = None
    """The device's local-only model (`--fallback local`), trained beside the strategy's."""
    kept: Kept | None = None
    """The model the device keeps and serves after its latest round (`fallback.choose`)."""
    averaged: State | None = None
    """Under `--dp sample` with `--dp-average`: the moving average of its strategy's models,
    which it keeps in their stead (`agent.learning.averaging`)."""


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
    epsilon: float | None = None
    """Its epsilon after the round under `--dp sample` (`privacy.Accountant`), else None."""
    screening: Screening = NOTHING
    """Which received models its aggregate's defence (`--clip`) screened out or clipped."""


_Model = TypeVar("_Model", AgentState, Published)


def starting_point(
    learner: Learner,
    agent: AgentState,
    inbox: dict[str, Published],
    data: LocalData,
    round_: int,
    prune_now: bool,
    reduction: Reduction,
    weights: Mapping[str, float] | None = None,
) -> tuple[AgentState, RoundStart]:
    """The round's start: the strategy's aggregate (`DecentralizedStrategy.aggregate`, the
    run's rule `Learner.aggregate` unless a user's strategy says otherwise; `weights`: the
    senders' staleness weights of an asynchronous round, None in a synchronous one), with each
    reduction kind's step before training (`ReductionKind.started`: pruned by magnitude to a
    density cap, the neurons that train drawn for an active fraction, the rest frozen).
    Returns the agent (with its capped masks) and the round from there (its active masks
    None: everything trains)."""
    draw = functools.partial(learner.facts.generator, "active", agent.agent_id, round_)
    if weights is None:
        aggregate = learner.decentral.aggregate(learner, agent, inbox)
    else:
        aggregate = learner.decentral.aggregate(learner, agent, inbox, weights)
    begun = started(learner.facts, Start(aggregate, agent.masks), reduction, draw)
    if begun.masks is not agent.masks:
        agent = dataclasses.replace(agent, masks=begun.masks)
    start = RoundStart(
        agent, begun.weights, begun.masks, begun.active, reduction, data, round_, prune_now
    )
    return agent, start


class Learner:
    """What a decentralized round composes: the model's facts (`facts`), the config and the
    strategy (its traits and its steps, `decentral`).

    One `Learner` serves every agent of a simulation (its model is only a compute buffer:
    weights are loaded from the agent's state each time).
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
        self.traits = strategies.strategy(config.strategy)
        """What the strategy is (`agent.learning.strategies`): its family and traits."""
        self.sparse = self.traits.sparse
        self.prunes_further = self.traits.prunes_further
        self.decentralized = self.traits.decentralized
        self.facts = ModelFacts(
            model, input_shape, prunable, config, seed, task, sparse_masks=self.sparse
        )
        """The model's facts, which the rules a round takes read (`model_facts`)."""
        self.sends_windows = (
            self.decentralized and config.wire == "full" and sends_parts(config.reduce)
        )
        """A round that trained a window of layers publishes those layers alone
        (`published_part`), the others being what the agent already had from its aggregate."""

    @property
    def config(self) -> StrategyConfig:
        """The run's config: the one the model's facts hold, so that there is one."""
        return self.facts.config

    def to(self, device: torch.device) -> Learner:
        """Compute on `device` from now on (`ModelFacts.to`). Returns the learner itself."""
        if device.type != "cpu" and self.traits.adam:
            raise ValueError(
                f"--device {device}: strategy {self.config.strategy} trains on the cpu only "
                "(its Adam moments are kept there); use --device cpu"
            )
        self.facts.to(device)
        return self

    def initial_masks(self, agent_id: str) -> Masks | None:
        """The agent's first masks, its decentralized strategy's draw from (fleet seed, agent
        id) alone (`DecentralizedStrategy.initial_masks`: ERK for the sparse ones, 1.1), so
        that any agent can recompute any other agent's starting model w0 (.) m_j and round 1
        needs no initial exchange of models. None: a dense model, as a centralized
        strategy's participants start from."""
        if self.traits.centralized:
            return None
        return self.decentral.initial_masks(self.facts, agent_id)

    def init_agent(self, agent_id: str) -> AgentState:
        masks = self.initial_masks(agent_id)
        weights = self.facts.initial_under(masks)
        return AgentState(agent_id, weights, masks, init_weights=weights)

    def published(self, state: AgentState, num_samples: int) -> Published:
        """`state`'s model as a neighbour holds it: before round 1 the one every agent
        derives; after a round, what its strategy's `publish` sends of."""
        return Published(state.weights, state.masks, num_samples)

    def published_part(self, model: Published, reduction: Reduction) -> Published:
        """What a round publishes: with `sends_windows`, what its kind says it publishes
        (`Reduction.published`: a window's layers alone), else the whole model. A
        receiver aggregates each layer over those who sent it (`combine`)."""
        names = reduction.published(self.facts) if self.sends_windows else None
        if names is None:
            return model
        return _restricted(model, [name for name in model.weights if name in names])

    def layer_part(self, model: Published, layers: list[str]) -> Published:
        """The tensors of FedLDF `layers` of a model, with their masks: what a neighbour sends
        when asked for those layers (`--wire layers`)."""
        groups = self.facts.layer_groups
        return _restricted(model, [name for layer in layers for name in groups[layer]])

    def aggregate(
        self,
        agent: AgentState,
        inbox: dict[str, Published],
        weights: Mapping[str, float] | None = None,
    ) -> State:
        """Mask-based aggregation for sparse strategies (eq. 7), plain mean for dense ones,
        or the robust rule of `--aggregation`; each received model first clipped to the
        `--clip` bound around the agent's own (`robust.clip`). The run's rule, which a
        round takes through its strategy (`DecentralizedStrategy.aggregate`, the default).
        `weights`: each sender's staleness weight (asynchronous rounds; the agent's own
        model counts 1), entering where sample weights would."""
        if not inbox:
            return agent.weights
        rule = robust_rules.parse_rule(self.config.aggregation)
        combined = combine(agent, inbox, rule, self.config.clip, weights)
        return self.facts.own_statistics(combined, agent.weights)

    @functools.cached_property
    def decentral(self) -> DecentralizedStrategy:
        """The decentralized strategy whose steps `local_round` and `initial_masks` take (the
        table's class)."""
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
        sender_weights: Mapping[str, float] | None = None,
    ) -> RoundResult:
        """One decentralized round of agent k, its strategy's steps (`decentral`) composed:
        aggregate, the reduction's start, train, the step after training (vote, prune,
        RigL), back to the model before the round if not finite, fresh statistics,
        evaluate, publish.

        The order follows the paper's Algorithm 1: the vote scores the freshly trained model,
        further pruning (when `prune_now` and sparsity < s*) precedes the RigL update, and the
        reported accuracy is that of the model the agent keeps and publishes. The device's
        budget cuts the training as `reduction` says (`agent.learning.reduction`): a density
        cap below the current density prunes the aggregated model to the cap by magnitude
        before training; an active fraction trains that fraction of the neurons and freezes
        the rest; a window or a width trains part of the layers or a narrower sub-model.
        `sender_weights`: the senders' staleness weights of an asynchronous round (None:
        synchronous). The result says which received models the aggregate's defence
        (`--clip`) screened out or clipped (`agent.learning.screening`).
        """
        strategy, before, facts = self.decentral, agent, self.facts
        with screening.tallied() as tally:
            agent, start = starting_point(
                self, agent, inbox, data, round_, prune_now, reduction, sender_weights
            )
        trained = strategy.train(facts, start)
        step = strategy.after_training(facts, start, trained)
        flops = trained.flops + step.flops
        spent = before.dp_steps + trained.dp_steps + step.dp_steps
        before = dataclasses.replace(before, dp_steps=spent)
        if not robust.finite(step.weights):
            recovered = _recovered(self, before, start, flops, trained.train_loss)
            return dataclasses.replace(recovered, screening=tally.screening)
        weights = facts.fresh_statistics(step.weights, data)
        divergence = None
        if self.config.wire == "layers" and self.decentralized:
            from agent.learning.ldf import divergences

            divergence = divergences(weights, start.weights, facts.layer_groups)
        loss, accuracy = facts.evaluate_on(weights, data)
        kept = dataclasses.replace(
            agent,
            weights=weights,
            masks=step.masks,
            distances=step.distances,
            round=round_,
            dp_steps=before.dp_steps,
        )
        return RoundResult(
            state=kept,
            published=strategy.publish(self, self.published(kept, len(data.y_train)), start),
            loss=loss,
            accuracy=accuracy,
            train_loss=trained.train_loss,
            train_flops=flops,
            vote=step.vote,
            score=None if step.score is None or not math.isfinite(step.score) else step.score,
            pruned=step.pruned,
            divergence=divergence,
            epsilon=self.epsilon(kept, len(data.y_train)),
            screening=tally.screening,
        )

    def epsilon(self, agent: AgentState, samples: int) -> float | None:
        """The agent's epsilon so far at `--dp-delta` (`privacy.Accountant`, over every DP
        step it took), for a device of `samples` training samples; None without `--dp`."""
        accountant = Accountant.of(self.config, samples)
        return None if accountant is None else accountant.epsilon(agent.dp_steps)


def _recovered(
    learner: Learner, before: AgentState, start: RoundStart, flops: int, train_loss: float
) -> RoundResult:
    """A round whose model turned non-finite (a poisoned aggregate, a diverged step): the
    agent goes back to its model before the round, keeps it and publishes it again (its
    strategy's `publish`, uncut: no part of it trained), rather than dropping out with a
    model nobody can use."""
    data = start.data
    loss, accuracy = learner.facts.evaluate_on(before.weights, data)
    layers = learner.config.wire == "layers" and learner.decentralized
    kept = dataclasses.replace(before, round=start.round)
    whole = dataclasses.replace(start, reduction=NO_REDUCTION)
    return RoundResult(
        state=kept,
        published=learner.decentral.publish(
            learner, learner.published(kept, len(data.y_train)), whole
        ),
        loss=loss,
        accuracy=accuracy,
        train_loss=train_loss if math.isfinite(train_loss) else loss,
        train_flops=flops,
        vote=False if learner.sparse else None,  # a missing vote would count 0 as well
        score=None,
        pruned=False,
        divergence=dict.fromkeys(learner.facts.layer_groups, 0.0) if layers else None,
        recovered=True,
        epsilon=learner.epsilon(kept, len(data.y_train)),
    )


def combine(
    agent: AgentState,
    inbox: dict[str, Published],
    rule: robust_rules.Rule,
    clip: str = robust_rules.CLIP_OFF,
    weights: Mapping[str, float] | None = None,
) -> State:
    """`Learner.aggregate`: each received model clipped to the `clip` bound around the
    agent's own (`robust.clip`), then eq. 7 for sparse agents, the plain mean for dense
    ones, or the robust `rule`; with `weights` (a sender's staleness weight, the agent's
    own 1) eq. 7 weighted or the weighted mean (`sparse.aggregate_weighted_masked`).

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
            parts = {j: _restricted(inbox[j], names) for j in senders}
            out |= combine(part, parts, rule, clip, weights)
        return {name: out[name] for name in agent.weights}
    if clip != robust_rules.CLIP_OFF:
        clipped = screening.noted(
            robust.clip(
                agent.weights,
                {j: p.weights for j, p in inbox.items()},
                clip,
                {j: p.masks for j, p in inbox.items()},
            )
        )
        inbox = {j: dataclasses.replace(p, weights=clipped[j]) for j, p in inbox.items()}
    if rule.robust:
        if weights is not None:
            raise ValueError("a robust --aggregation rule takes no staleness weights")
        return _robust_combine(agent, inbox, rule)
    own = None if weights is None else {j: weights[j] for j in inbox} | {agent.agent_id: 1.0}
    if agent.masks is not None:
        models = {j: (p.weights, p.masks or {}) for j, p in inbox.items()}
        models[agent.agent_id] = (agent.weights, agent.masks)
        return sparse.aggregate_masked(models, agent.masks, own)
    states = {j: p.weights for j, p in inbox.items()}
    states[agent.agent_id] = agent.weights
    return sparse.aggregate_mean(states) if own is None else sparse.aggregate_weighted(states, own)


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
    facts = learner.facts
    if not facts.channel_masks or masks is None:
        return facts.model, weights
    from agent.learning import width

    plan = facts.channel_plan
    chosen = channels.selection(plan, masks)
    narrow = width.narrow_model(facts.model, plan.width, chosen)
    return narrow, width.narrow_state(weights, plan.width, chosen)
