"""Checkpointing the model's blocks (`agent.learning.checkpointing`): the configured batch
in less memory, for more time, the same numbers. Not a `--reduce` mode: the measured rule
takes it where the configured batch does not fit the memory but the time does, for any
kind (`reduction.measured_reduction`), from its one measured row (time up, activations
down); every kind's training reads `Reduction.checkpoint`."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from agent.learning import checkpointing
from agent.learning.reductions.base import Level, ReductionKind

if TYPE_CHECKING:
    from agent.learning.model_facts import ModelFacts


class Checkpoint(ReductionKind):
    name: ClassVar[str] = "checkpoint"

    def levels(self, learner: ModelFacts) -> list[Level]:
        """The dense model checkpointed, where it has blocks to checkpoint."""
        if not checkpointing.blocks(learner.model):
            return []
        return [Level(1.0, self.at(1.0, checkpoint=True))]
