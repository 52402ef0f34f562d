"""What a reduction kind gives (ALGORITHMS.md 5): the levels a calibration measures, the
round's `Reduction` for a measured level or by the FLOP rule (its own parameter in
`Reduction.setting`, which only it reads), how the reduced round trains, and what it
records and publishes. One class per kind, each in a file of its own, listed in the
torch-free table of `agent.learning.reductions`; the rule (`agent.learning.reduction`), the
training (`agent.learning.reduced`), the calibration (`agent.device.calibration`), the
round's record and what it publishes ask the kinds instead of naming them.

The base class is itself the round trained whole (kind "none"): every layer of the full
model, its counted FLOPs those of a dense step (3 F), every level of it fit to train.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from agent.learning.costs import Row
from agent.learning.reduction import Reduction
from agent.learning.reductions import kinds
from agent.learning.training import TrainResult, train_local

if TYPE_CHECKING:
    import torch

    from agent.learning.config import SGDConfig
    from agent.learning.costs import Cost, CostTable
    from agent.learning.facts import LocalData
    from agent.learning.model_facts import ModelFacts
    from agent.learning.sparse import Masks, State
    from agent.learning.width import Selection, WidthPlan

    Draw = Callable[[], torch.Generator]
    """Where a kind's random draws come from (a generator made on first need)."""
    Narrow = tuple[WidthPlan, Selection]
    """A narrower model: the width plan and the channels of each class it keeps."""


@dataclass(frozen=True)
class Level:
    """One row a calibration measures: the kind's `level` (what the cost table files it
    under), the reduction that trains it, and the masks it trains with (a prune row's)."""

    level: float
    reduction: Reduction
    masks: Masks | None = None


@dataclass(frozen=True)
class Start:
    """Where a round's training starts: the `weights` under `masks`, and the `active`
    entries when some are frozen (None: everything trains)."""

    weights: State
    masks: Masks | None
    active: Masks | None = None


@dataclass(frozen=True)
class ReducedRound:
    """A round's local training as a kind receives it: from `start`, cut as `reduction`
    says, on `data`, with `sgd`."""

    start: Start
    reduction: Reduction
    data: LocalData
    round_: int
    generator: torch.Generator
    sgd: SGDConfig


class ReductionKind:
    """One way to cut a round; the defaults are those of a round trained whole."""

    name: ClassVar[str] = "none"
    narrows: ClassVar[bool] = False
    """It trains a narrower model in place of the full one, so it takes the round before
    the kinds that cut the full model's training (`agent.learning.reduced`)."""

    def setting(self, reduction: Reduction) -> Any:
        """This kind's own parameter in `reduction` (`Reduction.setting`); None when
        another kind cuts the round."""
        return reduction.setting if reduction.kind == self.name else None

    def at(self, setting: Any, **shared: Any) -> Reduction:
        """A round cut by this kind at `setting` (with `shared`: what any kind may add)."""
        return Reduction(self.name, setting, **shared)

    def levels(self, learner: ModelFacts) -> list[Level]:
        """The levels of this kind a calibration measures for `learner` (none where the
        model cannot be cut this way)."""
        return []

    def of_row(self, row: Row) -> Reduction:
        """The round's reduction at a cost table's row of this kind, chosen by the measured
        rule (`reduction.measured_reduction`, which adds the batch, steps and reason): by
        default, at the row's level."""
        return self.at(row.level)

    def row(self, level: Level, cost: Cost) -> Row:
        """The cost table's row of a measured `level` (the inverse of `of_row`)."""
        return Row(self.name, level.level, cost)

    def ranked(self, costs: CostTable, levels: list[float], p_k: float) -> list[float]:
        """The measured `levels` of this kind, highest first, in the order the measured rule
        tries them at p_k."""
        return levels

    def taking_turns(self, fitting: Sequence[Row], round_: int) -> Callable[[Row], bool]:
        """Which rows of a level may train in round `round_`, given those of them that fit
        the budget (`fitting`): any, unless the kind's rows take turns."""
        return lambda row: True

    def by_flops(self, learner: ModelFacts, p_k: float, masks: Masks) -> Reduction:
        """The round's reduction by counted FLOPs (the papers' budgets), for a kind whose
        `--reduce` mode is not measured."""
        raise NotImplementedError(f"{self.name} is chosen by measured costs")

    def level(self, reduction: Reduction) -> float | None:
        """The level `reduction` trains this kind at, to read its measured share off the
        cost table (None: a whole round, whose share is 1): a FLOP rule's setting."""
        level: float | None = self.setting(reduction)
        return level

    def figures(self, reduction: Reduction) -> dict[str, Any]:
        """The round record's fields (`agent.report.AgentRound`) this kind fills."""
        return {}

    def started(self, learner: ModelFacts, start: Start, reduction: Reduction, draw: Draw) -> Start:
        """The round's start with this kind's step before training (a density cap, the
        neurons that train, drawn from `draw()`); each kind in the table's order takes the
        start the one before it left."""
        return start

    def trains(self, learner: ModelFacts, job: ReducedRound) -> bool:
        """Whether this kind's training (`train`) takes the round: when it cuts it."""
        return self.setting(job.reduction) is not None

    def trainable(self, learner: ModelFacts, reduction: Reduction) -> set[str] | None:
        """The state entries the full model's training updates (None: all of them)."""
        return None

    def narrowed(
        self, learner: ModelFacts, reduction: Reduction, masks: Masks | None, round_: int
    ) -> Narrow | None:
        """The narrower model this kind trains in round `round_` in place of the full one
        (None: the full one)."""
        return None

    def per_sample_flops(self, learner: ModelFacts, job: ReducedRound) -> int:
        """Counted training FLOPs per sample (ALGORITHMS.md 1.10): forward and backward."""
        return 3 * learner.forward_flops(job.start.masks)

    def train(self, learner: ModelFacts, job: ReducedRound) -> tuple[TrainResult, int]:
        """The round's training and its counted FLOPs: the kind's narrower model, or the
        full model's `trainable` entries (the `active` neurons' weights alone when some
        are frozen)."""
        start = job.start
        narrow = self.narrowed(learner, job.reduction, start.masks, job.round_)
        if narrow is not None:
            return narrow_training(learner, *narrow, job)
        trained = train_local(
            learner.model,
            start.weights,
            start.masks,
            job.data.x_train,
            job.data.y_train,
            job.sgd,
            job.round_,
            job.generator,
            frozen=start.active,
            trainable=self.trainable(learner, job.reduction),
            step_fraction=job.reduction.step_fraction,
            task=learner.task,
            compute=learner.compute_format,
            checkpoint=job.reduction.checkpoint,
        )
        return trained, self.per_sample_flops(learner, job) * trained.samples


def narrow_training(
    learner: ModelFacts, plan: WidthPlan, selection: Selection, job: ReducedRound
) -> tuple[TrainResult, int]:
    """The `selection` of channels as a narrower model, trained, and written back into the
    full model; the other entries keep the start's values. Width reduction's rolling
    window (FedRolex), or the channels a structured mask keeps (`agent.learning.channels`),
    whose narrowed masks are all kept and so not applied."""
    from agent.learning import width

    start, masks = job.start.weights, job.start.masks
    narrow = width.narrow_model(learner.model, plan, selection)
    narrow_masks = None if masks is None else width.narrow_state(masks, plan, selection)
    if narrow_masks is not None and all(bool(m.all()) for m in narrow_masks.values()):
        narrow_masks = None
    trained = train_local(
        narrow,
        width.narrow_state(start, plan, selection),
        narrow_masks,
        job.data.x_train,
        job.data.y_train,
        job.sgd,
        job.round_,
        job.generator,
        step_fraction=job.reduction.step_fraction,
        task=learner.task,
        compute=learner.compute_format,
        checkpoint=job.reduction.checkpoint,
    )
    held = width.held_masks(start, plan, selection)
    if masks is not None:
        held = {n: h & masks[n] if n in masks else h for n, h in held.items()}
    state = width.widen_state(start, trained.state, plan, selection)
    flops = 3 * learner.forward_flops(held) * trained.samples
    return dataclasses.replace(trained, state=state), flops


def started(learner: ModelFacts, start: Start, reduction: Reduction, draw: Draw) -> Start:
    """`start` with every kind's step before training (`ReductionKind.started`), in the
    table's order: the round's start, and the start a calibration times."""
    for cut in kinds():
        start = cut.started(learner, start, reduction, draw)
    return start
