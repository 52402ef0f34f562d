"""`--reduce width`: train a narrower sub-model, every hidden channel's rolling share
(HeteroFL / FedRolex, `agent.learning.width`), by the device's measured costs."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, ClassVar

from agent.learning.reductions.base import Level, ReductionKind

if TYPE_CHECKING:
    from agent.learning.model_facts import ModelFacts
    from agent.learning.reduction import Reduction
    from agent.learning.reductions.base import Narrow
    from agent.learning.sparse import Masks

log = logging.getLogger(__name__)

LEVELS = (0.75, 0.5, 0.35, 0.25)
"""The widths a calibration measures."""


class Width(ReductionKind):
    name: ClassVar[str] = "width"
    narrows: ClassVar[bool] = True

    def levels(self, learner: ModelFacts) -> list[Level]:
        """Every width of `LEVELS`, for a model with channels to narrow (one it cannot cut
        says why in the log)."""
        try:
            if learner.width_plan.classes:
                return [Level(w, self.at(w)) for w in LEVELS]
        except ValueError as exc:
            log.info("width reduction unavailable for this model: %s", exc)
        return []

    def narrowed(
        self, learner: ModelFacts, reduction: Reduction, masks: Masks | None, round_: int
    ) -> Narrow | None:
        """This round's rolling window of channels (`width.rolling_selection`)."""
        fraction = self.setting(reduction)
        if fraction is None:
            return None
        from agent.learning.width import rolling_selection

        plan = learner.width_plan
        return plan, rolling_selection(plan, fraction, round_)
