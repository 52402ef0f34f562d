"""`--reduce width`: train a narrower sub-model, every hidden channel's rolling share
(HeteroFL / FedRolex, `agent.learning.width`), by the device's measured costs."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, ClassVar

from agent.learning.reduced import narrow_training
from agent.learning.reduction import Reduction
from agent.learning.reductions.base import Level, ReducedRound, ReductionKind

if TYPE_CHECKING:
    from agent.learning.costs import Row
    from agent.learning.facts import CalibrationFacts, TrainingFacts
    from agent.learning.training import TrainResult

log = logging.getLogger(__name__)

LEVELS = (0.75, 0.5, 0.35, 0.25)
"""The widths a calibration measures."""


class Width(ReductionKind):
    name: ClassVar[str] = "width"
    narrows: ClassVar[bool] = True

    def levels(self, learner: CalibrationFacts) -> list[Level]:
        """Every width of `LEVELS`, for a model with channels to narrow (one it cannot cut
        says why in the log)."""
        try:
            if learner.width_plan.classes:
                return [Level(w, Reduction(width=w)) for w in LEVELS]
        except ValueError as exc:
            log.info("width reduction unavailable for this model: %s", exc)
        return []

    def of_row(self, row: Row) -> Reduction:
        return Reduction(width=row.level)

    def trains(self, learner: TrainingFacts, job: ReducedRound) -> bool:
        return job.reduction.width is not None

    def train(self, learner: TrainingFacts, job: ReducedRound) -> tuple[TrainResult, int]:
        """This round's rolling window of channels (`width.rolling_selection`), trained
        narrow and written back."""
        from agent.learning.width import rolling_selection

        assert job.reduction.width is not None
        plan = learner.width_plan
        chosen = rolling_selection(plan, job.reduction.width, job.round_)
        return narrow_training(learner, plan, chosen, job)
