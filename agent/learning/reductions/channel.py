"""A sparse model whose masks keep whole channels (`--mask-unit channel`,
`agent.learning.channels`) trains as the narrower model its masks keep: a lower density,
under `--reduce prune`'s cap or the strategy's own pruning, is a smaller model to train.
Not a `--reduce` mode: its costs are measured as prune's rows."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from agent.learning import channels
from agent.learning.reductions.base import ReducedRound, ReductionKind

if TYPE_CHECKING:
    from agent.learning.model_facts import ModelFacts
    from agent.learning.reduction import Reduction
    from agent.learning.reductions.base import Narrow
    from agent.learning.sparse import Masks


class Channel(ReductionKind):
    name: ClassVar[str] = "channel"
    narrows: ClassVar[bool] = True

    def trains(self, learner: ModelFacts, job: ReducedRound) -> bool:
        return learner.channel_masks and job.start.masks is not None

    def narrowed(
        self, learner: ModelFacts, reduction: Reduction, masks: Masks | None, round_: int
    ) -> Narrow | None:
        """The channels the masks keep (`channels.selection`)."""
        if not learner.channel_masks or masks is None:
            return None
        plan = learner.channel_plan
        return plan.width, channels.selection(plan, masks)
