"""`--reduce prefix`: train a window of layers, the others frozen, the layers before it
without a backward pass (`agent.learning.prefix`), by the device's measured costs.

Its levels are windows of about a fraction of the forward FLOPs each; the rule takes, of a
level's windows that fit p_k, this round's in turn (`reduction.measured_reduction`). A round
publishes its window's layers alone (its row's `sends_part`): the rest is the aggregate of
what the agent received, which its neighbours need not receive back (TinyTL's trained
suffix, on the wire too).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar

from agent.learning import prefix
from agent.learning.costs import Row
from agent.learning.reductions.base import Level, ReducedRound, ReductionKind

if TYPE_CHECKING:
    from agent.learning.costs import Cost, CostTable
    from agent.learning.model_facts import ModelFacts
    from agent.learning.reduction import Reduction

LEVELS = (0.5, 0.3, 0.15)
"""The windows' sizes a calibration measures, as fractions of the forward FLOPs."""


class Prefix(ReductionKind):
    name: ClassVar[str] = "prefix"

    def levels(self, learner: ModelFacts) -> list[Level]:
        """Every window of every level of `LEVELS` (`prefix.windows`)."""
        return [
            Level(level, self.at(window))
            for level in LEVELS
            for window in prefix.windows(learner.forward_layers, level)
        ]

    def of_row(self, row: Row) -> Reduction:
        """The row's window (its level is the windows' size)."""
        return self.at(row.window)

    def row(self, level: Level, cost: Cost) -> Row:
        return Row(self.name, level.level, cost, self.setting(level.reduction))

    def ranked(self, costs: CostTable, levels: list[float], p_k: float) -> list[float]:
        """The level whose windows that fit p_k train the most layers between them first
        (of equal ones, the larger windows)."""
        return sorted(levels, key=lambda level: _covered(costs, level, p_k), reverse=True)

    def taking_turns(self, fitting: Sequence[Row], round_: int) -> Callable[[Row], bool]:
        """This round's window of those that fit (`prefix.round_window`): they take turns,
        so every layer some window of the budget reaches trains."""
        window = prefix.round_window([row.window for row in fitting if row.window], round_)
        return lambda row: row.window == window

    def trainable(self, learner: ModelFacts, reduction: Reduction) -> set[str] | None:
        window = self.setting(reduction)
        if window is None:
            return None
        return prefix.trained_names(learner.forward_layers, window)

    def per_sample_flops(self, learner: ModelFacts, job: ReducedRound) -> int:
        window = self.setting(job.reduction)
        assert window is not None
        return prefix.window_flops(learner.forward_layers, window)


def _covered(costs: CostTable, level: float, p_k: float) -> int:
    """How many layers the windows of `level` that fit p_k train between them."""
    rows = [row for row in costs.of_kind(Prefix.name) if row.level == level and row.window]
    return sum(r.window[1] - r.window[0] for r in rows if r.window and costs.fraction(r) <= p_k)
