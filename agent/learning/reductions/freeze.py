"""`--reduce freeze`: train a p_k-sized fraction of the neurons, the rest frozen and kept
(FedSPU's way, `agent.learning.freezing`), by counted FLOPs.

A frozen weight skips only its weight-gradient pass, a third of its cost
(`reduced.frozen_training_flops`), so freezing fits only mild budgets; `--reduce auto`
tries it first, as the reduction of least expected accuracy cost. The neurons that train
are drawn each round (`learner.starting_point`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

from agent.learning.reduced import frozen_training_flops
from agent.learning.reduction import NO_REDUCTION, Reduction
from agent.learning.reductions.base import Level, ReducedRound, ReductionKind, Start

if TYPE_CHECKING:
    from agent.learning.model_facts import ModelFacts
    from agent.learning.reductions.base import Draw
    from agent.learning.sparse import Masks

LEVELS = (0.8, 0.5, 0.35, 0.2, 0.05)
"""The active fractions a calibration measures."""
MIN_ACTIVE = 0.05
"""The least fraction of the neurons it trains."""


class Freeze(ReductionKind):
    name: ClassVar[str] = "freeze"

    def levels(self, learner: ModelFacts) -> list[Level]:
        """Every active fraction of `LEVELS`, for a model with something to freeze."""
        plan = learner.freezing_plan
        if not (plan.groups or plan.layers):
            return []
        return [Level(a, self.at(a)) for a in LEVELS]

    def by_flops(self, learner: ModelFacts, p_k: float, masks: Masks) -> Reduction:
        """The active fraction a whose round costs p_k of a dense one by counted FLOPs.

        A full round of the sparse model costs c, its FLOP fraction; training a fraction a
        of the weights costs c (2 + a) / 3, so a = 3 p_k / c - 2 meets the budget; taking a
        as the neuron fraction errs on the cheap side (a weight trains only when both its
        neurons do). Freezing cannot go below 2/3 of a round by this count, so it trains at
        least MIN_ACTIVE.
        """
        cost = learner.forward_flops(masks) / learner.dense_flops
        active = 3.0 * p_k / cost - 2.0
        if active >= 1.0:
            return NO_REDUCTION
        return self.at(max(active, MIN_ACTIVE))

    def figures(self, reduction: Reduction) -> dict[str, Any]:
        return {"active_fraction": self.setting(reduction)}

    def started(self, learner: ModelFacts, start: Start, reduction: Reduction, draw: Draw) -> Start:
        """The neurons that train this round, drawn (`freezing.active_masks`)."""
        fraction = self.setting(reduction)
        if fraction is None:
            return start
        from agent.learning.freezing import active_masks

        plan = learner.freezing_plan
        active = active_masks(plan, start.weights, fraction, draw())
        return dataclasses.replace(start, active=active)

    def trains(self, learner: ModelFacts, job: ReducedRound) -> bool:
        return job.start.active is not None

    def per_sample_flops(self, learner: ModelFacts, job: ReducedRound) -> int:
        assert job.start.active is not None
        return frozen_training_flops(learner, job.start.masks, job.start.active)
