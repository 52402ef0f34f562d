"""`--reduce prune`: cap a sparse model's density (DA-DPFL's way, the paper's algorithm).

p_k is a FLOP and byte budget: the aggregated model is pruned by magnitude to the density
cap (`reduction.density_cap`) before it trains (`learner.starting_point`). With weight
masks the masked-dense kernels take as long at any density, so calibration measures the
initial density alone; with channel masks (`agent.learning.channels`) a lower density is a
narrower model to train (`channel`), measured at the `LEVELS` below it too.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

from agent.learning import channels, rigl, sparse
from agent.learning.reduction import NO_REDUCTION, Reduction, capped_density
from agent.learning.reductions.base import Level, ReductionKind, Start

if TYPE_CHECKING:
    from agent.learning.model_facts import ModelFacts
    from agent.learning.reductions.base import Draw
    from agent.learning.sparse import Masks

LEVELS = (0.35, 0.2, 0.1)
"""The densities below the initial one a channel-masked model is measured at."""


class Prune(ReductionKind):
    name: ClassVar[str] = "prune"

    def levels(self, learner: ModelFacts) -> list[Level]:
        """The densities a prune row is measured at, with masks of each (module docstring);
        none for a dense strategy."""
        if not learner.sparse:
            return []
        weights, masks = learner.initial_model("calibration")
        assert masks is not None
        density = learner.config.density
        if not learner.channel_masks:
            return [Level(density, NO_REDUCTION, masks)]
        densities = [density, *(d for d in LEVELS if d < density)]
        plan = learner.channel_plan
        return [
            Level(d, NO_REDUCTION, channels.prune_to_density(plan, weights, masks, d))
            for d in densities
        ]

    def by_flops(self, learner: ModelFacts, p_k: float, masks: Masks) -> Reduction:
        """The highest density p_k affords the sparse model (`reduction.density_cap`)."""
        return self.at(capped_density(learner, p_k, masks))

    def figures(self, reduction: Reduction) -> dict[str, Any]:
        return {"density_cap": self.setting(reduction)}

    def started(self, learner: ModelFacts, start: Start, reduction: Reduction, draw: Draw) -> Start:
        """The sparse model pruned by magnitude to the density cap, when there is one."""
        cap = self.setting(reduction)
        if start.masks is None or cap is None:
            return start
        if learner.channel_masks:
            capped = channels.prune_to_density(
                learner.channel_plan, start.weights, start.masks, cap
            )
        else:
            capped = rigl.prune_to_density(start.weights, start.masks, cap)
        return dataclasses.replace(
            start, weights=sparse.apply_masks(start.weights, capped), masks=capped
        )
