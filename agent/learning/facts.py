"""What the round's rules read of a learner and of an agent's data, as narrow types.

The budget's rule (`reduction`), the reduced training (`reduced`), the reduction kinds
(`reductions`), early stopping (`early_stop`) and the decentralized strategies' steps
(`decentral`) each read a few facts of the model a `learner.Learner` holds; the learner in
turn builds on them. Typed by these protocols instead of by `Learner`, they need not import
the learner module (no import cycle, even a type-only one), and each says exactly what it
depends on. This module imports torch alone when it runs and, for type checking, only
modules the learner itself builds on, never the learner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch

if TYPE_CHECKING:
    from torch import nn

    from agent.learning.channels import ChannelPlan
    from agent.learning.config import SGDConfig, StrategyConfig
    from agent.learning.freezing import FreezingPlan
    from agent.learning.precision import ComputeFormat
    from agent.learning.prefix import Layer
    from agent.learning.sparse import Masks, State
    from agent.learning.tasks import Task
    from agent.learning.width import WidthPlan


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


class ModelFacts(Protocol):
    """What the budget's rule (`reduction.local_reduction`) and the FLOPs of frozen training
    (`reduced.frozen_training_flops`) read of a model: the config and the FLOPs a mask leaves."""

    @property
    def config(self) -> StrategyConfig: ...

    @property
    def dense_flops(self) -> int:
        """Forward FLOPs per sample of the dense model."""

    def forward_flops(self, masks: Masks | None) -> int:
        """Forward FLOPs per sample with `masks` (None: dense)."""

    def flops_per_density(self, masks: Masks) -> float:
        """FLOP fraction / parameter density of `masks`."""


class TrainingFacts(ModelFacts, Protocol):
    """What a round's reduced training (`reduced.reduced_training`) reads besides: the model
    to train, how it trains, and the plans that cut it to a window or a width."""

    @property
    def model(self) -> nn.Module: ...

    @property
    def task(self) -> Task: ...

    @property
    def sgd(self) -> SGDConfig: ...

    @property
    def compute_format(self) -> ComputeFormat: ...

    @property
    def channel_masks(self) -> bool:
        """Masks keep whole channels (`agent.learning.channels`)."""

    @property
    def channel_plan(self) -> ChannelPlan: ...

    @property
    def width_plan(self) -> WidthPlan: ...

    @property
    def forward_layers(self) -> tuple[Layer, ...]: ...


class HeldModel(Protocol):
    """A model an agent holds: its own (before its first round, or its state since), or one
    a neighbour sent; its weights under its masks."""

    @property
    def weights(self) -> State: ...

    @property
    def masks(self) -> Masks | None: ...


class CalibrationFacts(TrainingFacts, Protocol):
    """What a reduction kind's calibration levels (`reductions.base.ReductionKind.levels`)
    read besides: whether the model is sparse, what freezing freezes, a first model."""

    @property
    def sparse(self) -> bool: ...

    @property
    def freezing_plan(self) -> FreezingPlan: ...

    def init_agent(self, agent_id: str) -> HeldModel: ...


class StoppingLoss(Protocol):
    """What early stopping (`early_stop.EarlyStop`) asks of a model after each round."""

    def stopping_loss(self, weights: State, train_loss: float, data: LocalData) -> float:
        """L_t = 0.7 L_train + 0.3 L_val (ALGORITHMS.md 2)."""


class MaskFacts(TrainingFacts, Protocol):
    """What a decentralized strategy's step after training (`agent.learning.decentral`)
    reads of a model besides: the prunable weights and the initial model they are measured
    against, the generators of its draws and the FLOPs of RigL's dense gradients."""

    @property
    def prunable(self) -> list[str]: ...

    @property
    def initial(self) -> State: ...

    def generator(self, purpose: str, agent_id: str, round_: int) -> torch.Generator: ...

    def dense_gradient_flops(self, masks: Masks | None, samples: int) -> int:
        """RigL's dense-gradient batches' FLOPs under `masks`."""


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

    def aggregate(self, agent: _Own, inbox: dict[str, _Sent]) -> State:
        """The agent's model aggregated with those of its `inbox`, by sender."""
