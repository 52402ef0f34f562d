"""The contract of a decentralized strategy: the steps of a round that differ between
dadpfl, dispfl, dfedavgm and local, beside `agent.learning.central.base.CentralStrategy`.

A decentralized round (`Learner.local_round`, ALGORITHMS.md 1) asks its strategy for two
steps and composes the rest: the strategy's `aggregate` of what the neighbours sent (the
run's rule by default: eq. 7 over masks, or the mean, under `--aggregation` and `--clip`),
training cut to the device's budget, then the strategy's step after training
(`after_training`): a sparse strategy scores the model for the pruning vote, may prune
further, and moves its mask with RigL; a dense one keeps what it trained. Pure math, typed
by the facts it reads (`agent.learning.model_facts`, `agent.learning.facts`), so that this
package never imports the learner that calls it.

Which strategy is which, and the traits the rest of the code asks of it (sparse, prunes
further, trains alone), is the table's (`agent.learning.strategies`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, TypeVar

if TYPE_CHECKING:
    from agent.learning.facts import AgentFacts, AggregationRule, HeldModel, LocalData
    from agent.learning.model_facts import ModelFacts
    from agent.learning.sparse import Masks, State

_Own = TypeVar("_Own", bound="HeldModel")
"""The learner's type of an agent's state (`learner.AgentState`), named by its traits."""
_Sent = TypeVar("_Sent", bound="HeldModel")
"""The learner's type of a model a neighbour sent (`learner.Published`)."""


@dataclass(frozen=True)
class Trained:
    """What a round's training gave (`weights` under `masks`) and where the round stands:
    the step after training's input."""

    agent: AgentFacts
    weights: State
    masks: Masks | None
    data: LocalData
    round: int
    prune_now: bool
    """Whether the pruning plan prunes this round."""


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


class DecentralizedStrategy:
    """The contract: a dense strategy's steps, which aggregate by the run's rule and keep
    what training gave; sparse ones override `after_training`
    (`agent.learning.decentral.sparse`), and a user's strategy may override either."""

    name: ClassVar[str] = ""
    trains_own: ClassVar[bool] = True
    """Whether a round trains from the agent's own weights (in part), as
    `CentralStrategy.trains_own` says of the centralized ones: a decentralized agent always
    starts a round from its aggregate of its own model and its neighbours'."""

    def aggregate(
        self, learner: AggregationRule[_Own, _Sent], agent: _Own, inbox: dict[str, _Sent]
    ) -> State:
        """The model the agent's round starts from, before its budget cuts it: the run's
        rule over its own model and those its neighbours sent (`Learner.aggregate`: eq. 7
        over masks, or the mean, under `--aggregation` and `--clip`), which every shipped
        strategy keeps; the agent's own model when nobody sent one. Weights only: the
        agent's masks stay its own, moved only after training."""
        return learner.aggregate(agent, inbox)

    def after_training(self, learner: ModelFacts, trained: Trained) -> MaskStep:
        """The round's model once the strategy had its say on what training gave."""
        return MaskStep(trained.weights, trained.masks, trained.agent.distances)
