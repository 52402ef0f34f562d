"""What the round's rules read of an agent's data and of the models an agent holds, as
narrow types.

The model's facts are a concrete leaf (`model_facts.ModelFacts`); what is left here types
what a decentralized strategy's steps (`decentral`) read of an agent's state, of the models
it holds and of the learner's aggregation rule, which `learner` defines: typed by these
protocols, the strategies need not import the learner module (no import cycle, even a
type-only one). This module imports torch alone when it runs, never the learner.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch

if TYPE_CHECKING:
    from agent.learning.sparse import Masks, State


@dataclass(frozen=True)
class LocalData:
    """One agent's local data as tensors: train for training, test for accuracy, validation
    for early stopping."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor


class HeldModel(Protocol):
    """A model an agent holds: its own (before its first round, or its state since), or one
    a neighbour sent; its weights under its masks."""

    @property
    def weights(self) -> State: ...

    @property
    def masks(self) -> Masks | None: ...


class AgentFacts(Protocol):
    """What a decentralized strategy's step after training reads of an agent's state: who
    it is, its initial model, and the distances from it of its models so far."""

    @property
    def agent_id(self) -> str: ...

    @property
    def init_weights(self) -> State: ...

    @property
    def distances(self) -> list[float]: ...


_Own = TypeVar("_Own", bound=HeldModel, contravariant=True)
_Sent = TypeVar("_Sent", bound=HeldModel)


class AggregationRule(Protocol[_Own, _Sent]):
    """What a decentralized strategy's aggregate (`DecentralizedStrategy.aggregate`) reads of
    a learner: the run's rule (eq. 7 over masks or the mean, under `--aggregation` and
    `--clip`), over the learner's own types of an agent's state (`_Own`) and of what its
    neighbours sent (`_Sent`), which this module cannot name without importing the learner."""

    def aggregate(
        self, agent: _Own, inbox: dict[str, _Sent], weights: Mapping[str, float] | None = None
    ) -> State:
        """The agent's model aggregated with those of its `inbox`, by sender (`weights`: each
        sender's staleness weight in an asynchronous round)."""
