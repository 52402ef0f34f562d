"""What a device keeps after a round, as data (`fallback` decides it): the candidates' names,
its local-only model (`Shadow`), its choice (`Kept`), a round's verdict (`Judged`), and their
checkpoint forms. Apart from `fallback`, so that an agent's state can hold them without the
learner importing the rule that fills them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agent.learning.sparse import Masks, State

PERSONAL, FLEET, LOCAL = "personal", "fleet", "local"


@dataclass(frozen=True)
class Shadow:
    """A device's local-only model: its weights and the rounds it trained."""

    weights: State
    rounds: int = 0

    def saved(self) -> dict[str, object]:
        """As a checkpoint holds it: tensors and plain numbers (`restored_shadow`)."""
        return {"weights": self.weights, "rounds": self.rounds}


@dataclass(frozen=True)
class Kept:
    """The model a device keeps after a round: which candidate, its weights and masks, and
    why (each candidate's validation metric)."""

    name: str
    weights: State
    masks: Masks | None
    scores: dict[str, float]
    reason: str

    def saved(self) -> dict[str, object]:
        """As a checkpoint holds it: tensors and plain data (`restored_kept`)."""
        return {
            "name": self.name,
            "weights": self.weights,
            "masks": self.masks or {},
            "scores": self.scores,
            "reason": self.reason,
        }


def restored_shadow(saved: Mapping[str, Any] | None) -> Shadow | None:
    """A `Shadow.saved` read back (None: the checkpoint had none)."""
    if not saved:
        return None
    return Shadow(saved["weights"], int(saved["rounds"]))


def restored_kept(saved: Mapping[str, Any] | None) -> Kept | None:
    """A `Kept.saved` read back (None: the checkpoint had none)."""
    if not saved:
        return None
    scores = {str(k): float(v) for k, v in saved["scores"].items()}
    return Kept(
        str(saved["name"]), saved["weights"], saved["masks"] or None, scores, str(saved["reason"])
    )


@dataclass(frozen=True)
class Judged:
    """A device's choice after a round (`judge`): what it keeps, and the test figures of the
    kept model and of the strategy's own (the first candidate)."""

    kept: Kept
    loss: float
    metric: float
    strategy_loss: float
    strategy_metric: float
    fallback_flops: int = 0
    """Training FLOPs of the local-only model this round (0: it did not train)."""
