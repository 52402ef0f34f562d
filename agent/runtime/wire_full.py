"""`--wire full`: every round model goes out whole, once, to the neighbours subscribed to it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agent.learning import Learner, Need, Published, RoundResult
from agent.runtime.wire import WholeModels, announced_topics


class FullWire(WholeModels):
    """Whole models, subscribed to a few rounds ahead for the neighbours each round needs."""

    @staticmethod
    def expects(learner: Learner, agent_id: str) -> dict[str, Any]:
        """The layers a model may come as a window of, when rounds may train windows."""
        if not learner.sends_windows:
            return {}
        return {
            "window_layers": {
                layer.name: list(layer.tensors) for layer in learner.facts.forward_layers
            }
        }

    def wanted(self, round_: int, ahead: Callable[[int], set[Need]]) -> set[str]:
        return announced_topics(self.session, self.announcement, ahead(round_))

    def encode(self, round_: int, result: RoundResult) -> tuple[bytes, bytes, Published]:
        data = self.message(
            round_, result.published.num_samples, result.published.weights, result.published.masks
        )
        return data, data, result.published
