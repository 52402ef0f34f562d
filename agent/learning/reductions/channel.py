"""A sparse model whose masks keep whole channels (`--mask-unit channel`,
`agent.learning.channels`) trains as the narrower model its masks keep: a lower density,
under `--reduce prune`'s cap or the strategy's own pruning, is a smaller model to train.
Not a `--reduce` mode: its costs are measured as prune's rows."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from agent.learning import channels
from agent.learning.reduced import narrow_training
from agent.learning.reductions.base import ReducedRound, ReductionKind

if TYPE_CHECKING:
    from agent.learning.facts import TrainingFacts
    from agent.learning.training import TrainResult


class Channel(ReductionKind):
    name: ClassVar[str] = "channel"
    narrows: ClassVar[bool] = True

    def trains(self, learner: TrainingFacts, job: ReducedRound) -> bool:
        return learner.channel_masks and job.start.masks is not None

    def train(self, learner: TrainingFacts, job: ReducedRound) -> tuple[TrainResult, int]:
        """The channels the masks keep, trained as a narrower model and written back."""
        assert job.start.masks is not None
        plan = learner.channel_plan
        return narrow_training(learner, plan.width, channels.selection(plan, job.start.masks), job)
