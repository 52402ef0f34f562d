"""Early stopping (ALGORITHMS.md 2): stop once L = 0.7 L_train + 0.3 L_val rises."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agent.learning.learner import Learner, LocalData
    from agent.learning.sparse import State


@dataclass(frozen=True)
class StopWatch:
    """An agent's early-stopping state: its last loss L and how many rounds in a row L rose.

    ALGORITHMS.md 2 stops at the first rise (patience 1); a larger `stop_patience` waits for
    that many consecutive rises, for noisy local losses."""

    previous: float | None = None
    rises: int = 0

    def after(self, loss: float, patience: int) -> tuple[StopWatch, bool]:
        """The state after a round with loss `loss`, and whether the agent stops."""
        rose = self.previous is not None and loss > self.previous
        watch = StopWatch(loss, self.rises + 1 if rose else 0)
        return watch, watch.rises >= patience


@dataclass
class EarlyStop:
    """One agent's early stopping (ALGORITHMS.md 2), the same object in the simulator and on
    a device: after each round it computes L = 0.7 L_train + 0.3 L_val and says whether the
    agent stops (`patience` rises in a row; off unless `enabled`)."""

    enabled: bool
    patience: int
    watch: StopWatch = StopWatch()

    def after(self, learner: Learner, weights: State, train_loss: float, data: LocalData) -> bool:
        """Whether the agent stops after a round that ended with `weights`."""
        if not self.enabled:
            return False
        loss = learner.stopping_loss(weights, train_loss, data)
        self.watch, stops = self.watch.after(loss, self.patience)
        return stops
