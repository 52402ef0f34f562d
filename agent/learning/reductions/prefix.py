"""`--reduce prefix`: train a window of layers, the others frozen, the layers before it
without a backward pass (`agent.learning.prefix`), by the device's measured costs.

Its levels are windows of about a fraction of the forward FLOPs each; the rule takes, of a
level's windows that fit p_k, this round's in turn (`reduction.measured_reduction`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar

from agent.learning import prefix
from agent.learning.reduction import Reduction
from agent.learning.reductions.base import Level, ReducedRound, ReductionKind

if TYPE_CHECKING:
    from agent.learning.costs import CostTable, Row
    from agent.learning.model_facts import ModelFacts

LEVELS = (0.5, 0.3, 0.15)
"""The windows' sizes a calibration measures, as fractions of the forward FLOPs."""


class Prefix(ReductionKind):
    name: ClassVar[str] = "prefix"

    def levels(self, learner: ModelFacts) -> list[Level]:
        """Every window of every level of `LEVELS` (`prefix.windows`)."""
        return [
            Level(level, Reduction(window=window))
            for level in LEVELS
            for window in prefix.windows(learner.forward_layers, level)
        ]

    def of_row(self, row: Row) -> Reduction:
        return Reduction(window=row.window)

    def ranked(self, costs: CostTable, levels: list[float], p_k: float) -> list[float]:
        """The level whose windows that fit p_k train the most layers between them first
        (of equal ones, the larger windows)."""
        return sorted(levels, key=lambda level: _covered(costs, level, p_k), reverse=True)

    def taking_turns(self, fitting: Sequence[Row], round_: int) -> Callable[[Row], bool]:
        """This round's window of those that fit (`prefix.round_window`): they take turns,
        so every layer some window of the budget reaches trains."""
        window = prefix.round_window([row.window for row in fitting if row.window], round_)
        return lambda row: row.window == window

    def trains(self, learner: ModelFacts, job: ReducedRound) -> bool:
        return job.reduction.window is not None

    def trainable(self, learner: ModelFacts, reduction: Reduction) -> set[str] | None:
        if reduction.window is None:
            return None
        return prefix.trained_names(learner.forward_layers, reduction.window)

    def per_sample_flops(self, learner: ModelFacts, job: ReducedRound) -> int:
        assert job.reduction.window is not None
        return prefix.window_flops(learner.forward_layers, job.reduction.window)


def _covered(costs: CostTable, level: float, p_k: float) -> int:
    """How many layers the windows of `level` that fit p_k train between them."""
    rows = [row for row in costs.of_kind(Prefix.name) if row.level == level and row.window]
    return sum(r.window[1] - r.window[0] for r in rows if r.window and costs.fraction(r) <= p_k)
