"""A round's local training cut to its budget: every reduction's rule, written once.

The simulator, the agents (`Learner.local_round`) and the calibration that measures what each
reduction costs (`agent.device.calibration`) all train through `reduced_training`, so the
cost a device measured is the cost of the round it runs. How each kind trains is its own
(`agent.learning.reductions`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from agent.learning.config import SGDConfig
from agent.learning.reduction import Reduction
from agent.learning.reductions import NONE, kind, kinds
from agent.learning.reductions.base import ReducedRound, Start
from agent.learning.sparse import Masks, State

if TYPE_CHECKING:
    from agent.learning.facts import LocalData
    from agent.learning.model_facts import ModelFacts
    from agent.learning.training import TrainResult


def frozen_training_flops(learner: ModelFacts, masks: Masks | None, active: Masks) -> int:
    """Training FLOPs per sample with frozen weights: the forward pass and the input-gradient
    pass run through every kept weight (frozen neurons still pass gradients back to active
    ones), the weight-gradient pass only through the active ones: 2 F + F_active."""
    masks = masks or {}
    trainable = {n: a & masks[n] if n in masks else a for n, a in active.items()}
    return 2 * learner.forward_flops(masks or None) + learner.forward_flops(trainable)


def reduced_training(
    learner: ModelFacts,
    start: State,
    masks: Masks | None,
    active: Masks | None,
    reduction: Reduction,
    data: LocalData,
    round_: int,
    generator: torch.Generator,
    sgd: SGDConfig | None = None,
) -> tuple[TrainResult, int]:
    """The round's local training cut as `reduction` says, and its counted FLOPs: all of
    the model (the active neurons with `active`), a window of layers, or a narrower
    sub-model; with a smaller batch or fewer minibatches when it says so. The first kind
    whose training applies trains it, those that narrow the model first (a width, then
    channel masks), then in the table's order; none: the whole model (kind "none"). The
    simulator, the agents and the calibration (`agent.device.calibration`, with its own
    `sgd` settings) all train through here. Under DP-SGD (`--dp sample`) the batch stays the
    configured one (`privacy`: what the accountant counts)."""
    sgd = sgd or learner.sgd
    # Not under DP-SGD: its accountant counts a round's steps at the configured batch's
    # sampling rate, and `--max-epsilon` foresees at most a full round of them.
    if reduction.batch_size is not None and sgd.privacy is None:
        sgd = dataclasses.replace(sgd, batch_size=reduction.batch_size)
    job = ReducedRound(Start(start, masks, active), reduction, data, round_, generator, sgd)
    ordered = sorted(kinds(), key=lambda cut: not cut.narrows)
    chosen = next((cut for cut in ordered if cut.trains(learner, job)), kind(NONE))
    return chosen.train(learner, job)
