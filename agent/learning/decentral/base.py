"""The contract of a decentralized strategy: the steps of a round that differ between
dadpfl, dispfl, dfedavgm, local and a user's own, beside
`agent.learning.central.base.CentralStrategy`.

A round (`Learner.local_round`, ALGORITHMS.md 1) takes them in this order: `aggregate` (the
start, which the budget's reduction then cuts), `train`, `after_training` (a sparse
strategy's vote, further pruning and RigL), then, once the learner checked the model is
finite, refreshed its statistics and evaluated it, `publish` (what goes to the neighbours,
whatever the wire format); `initial_masks` is an agent's first mask (1.1). Pure math, typed
by the facts it reads (`agent.learning.model_facts`, `agent.learning.facts`), so that this
package never imports the learner that calls it. Which strategy is which, and the traits
the rest of the code asks of it (sparse, prunes further, trains alone), is the table's
(`agent.learning.strategies`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol, TypeVar

from agent.learning.reduced import reduced_training

if TYPE_CHECKING:
    from agent.learning.facts import AgentFacts, AggregationRule, HeldModel, LocalData
    from agent.learning.model_facts import ModelFacts
    from agent.learning.reduction import Reduction
    from agent.learning.sparse import Masks, State

_Own = TypeVar("_Own", bound="HeldModel")
"""The learner's type of an agent's state (`learner.AgentState`), named by its traits."""
_Sent = TypeVar("_Sent", bound="HeldModel")
"""The learner's type of a model a neighbour sent (`learner.Published`)."""


class Publisher(Protocol[_Sent]):
    """What a strategy's `publish` reads of a learner: the part of a model a round's
    reduction leaves to send (`Learner.published_part`), and the model's facts, as the
    other steps take them (its generators, say, for what it draws)."""

    @property
    def facts(self) -> ModelFacts: ...

    def published_part(self, model: _Sent, reduction: Reduction) -> _Sent: ...


@dataclass(frozen=True)
class RoundStart:
    """Where an agent's round stands once it aggregated and its budget cut the start: what
    `train`, `after_training` and `publish` take."""

    agent: AgentFacts
    weights: State
    """The start: the strategy's aggregate, as the reduction's step before training left it."""
    masks: Masks | None
    """The agent's masks (capped by the reduction's density cap, if any)."""
    active: Masks | None
    """The entries that train when the reduction freezes the rest (None: all of them)."""
    reduction: Reduction
    """How the device's budget cuts the round (`agent.learning.reduction`)."""
    data: LocalData
    round: int
    prune_now: bool
    """Whether the pruning plan prunes this round."""


@dataclass(frozen=True)
class Trained:
    """What a round's training gave: the weights (under the round's masks), the mean
    training loss and the training FLOPs it cost."""

    weights: State
    train_loss: float
    flops: int
    dp_steps: int = 0
    """DP-SGD steps the training took (`TrainResult.dp_steps`), which the accountant counts."""


@dataclass(frozen=True)
class MaskStep:
    """A round's model after the strategy's step after training, and what the step found."""

    weights: State
    masks: Masks | None
    distances: list[float]
    """The agent's distances from its initial model so far (pruning-time detection)."""
    flops: int = 0
    """Training FLOPs the step cost (RigL's dense gradients)."""
    vote: bool | None = None
    """The agent's vote that its model settled (None: the strategy does not vote)."""
    score: float | None = None
    pruned: bool = False
    """Whether the step pruned the model further."""
    dp_steps: int = 0
    """DP-SGD steps the step took (RigL's dense gradients under `--dp sample`), which the
    accountant counts."""


class DecentralizedStrategy:
    """The contract: a dense strategy's steps, which start from the whole model, aggregate
    by the run's rule, train as the budget says, keep what training gave and publish it;
    sparse ones draw masks and override `after_training` (`agent.learning.decentral.sparse`),
    and a user's strategy may override any step."""

    name: ClassVar[str] = ""
    trains_own: ClassVar[bool] = True
    """Whether a round trains from the agent's own weights (in part), as
    `CentralStrategy.trains_own` says of the centralized ones: a decentralized agent always
    starts a round from its aggregate of its own model and its neighbours'."""

    def initial_masks(self, learner: ModelFacts, agent_id: str) -> Masks | None:
        """The agent's first masks, drawn from (fleet seed, agent id) alone, so that any
        agent can recompute any other's starting model (1.1); None: the model is dense."""
        return None

    def aggregate(
        self,
        learner: AggregationRule[_Own, _Sent],
        agent: _Own,
        inbox: dict[str, _Sent],
        weights: Mapping[str, float] | None = None,
    ) -> State:
        """The model the agent's round starts from, before its budget cuts it: the run's
        rule over its own model and those its neighbours sent (`Learner.aggregate`: eq. 7
        over masks, or the mean, under `--aggregation` and `--clip`), which every shipped
        strategy keeps; the agent's own model when nobody sent one. Weights only: the
        agent's masks stay its own, moved only after training. `weights`: each sender's
        staleness weight in an asynchronous round (`agent.learning.asynchronous`), where
        sample weights would enter; a synchronous round passes none (a user's strategy that
        does not take them is never run asynchronously with them)."""
        if weights is None:
            return learner.aggregate(agent, inbox)
        return learner.aggregate(agent, inbox, weights)

    def train(self, learner: ModelFacts, start: RoundStart) -> Trained:
        """The round's local training from `start`: the budget's reduced training
        (`reduced.reduced_training`: the whole model, its active entries, a window of
        layers or a narrower sub-model) with the learner's SGD, its batch order drawn from
        (seed, agent, round)."""
        result, flops = reduced_training(
            learner,
            start.weights,
            start.masks,
            start.active,
            start.reduction,
            start.data,
            start.round,
            learner.generator("train", start.agent.agent_id, start.round),
        )
        return Trained(result.state, result.mean_loss, flops, result.dp_steps)

    def after_training(self, learner: ModelFacts, start: RoundStart, trained: Trained) -> MaskStep:
        """The round's model once the strategy had its say on what training gave."""
        return MaskStep(trained.weights, start.masks, start.agent.distances)

    def publish(self, learner: Publisher[_Sent], model: _Sent, start: RoundStart) -> _Sent:
        """What the agent makes available to its neighbours after the round, of the `model`
        it keeps (a `learner.Published`: weights, masks, sample count): the part of it the
        round's reduction trained (`Learner.published_part`: with `--reduce prefix`, the
        window's layers alone), the whole model otherwise. A round whose model turned
        non-finite publishes the model from before it, uncut (its `start.reduction` is none)."""
        return learner.published_part(model, start.reduction)
