"""The model a device keeps under `--dp sample`: a moving average of its strategy's models.

DP-SGD's models carry the noise of their last steps; averaging the iterates cancels part of
it (De et al. 2022, "Unlocking high-accuracy differentially private image classification
through scale": an exponential moving average of the parameters is what they evaluate). Here
the average runs over rounds: after each round the device keeps `share` of its previous
average and `1 - share` of the strategy's new model (`--dp-average`), serves and reports that
one, and goes on training, sending and aggregating the strategy's own models as before. It
reads only models that DP-SGD's steps produced (or the aggregates of such models), which the
accountant already covers, so it is post-processing: it costs no privacy and the accountant
does not see it.

Measured on digits (docs/privacy.md, bench/dp_average.py): none on runs of 12 one-epoch
rounds, where the model still climbs and an average lags it; +1 to +3 points on the mean of
runs of 30 to 36 rounds, whose late models wander around a plateau by their noise.
"""

from __future__ import annotations

import torch

from agent.learning.config import DP_SAMPLE, StrategyConfig
from agent.learning.sparse import Masks, State


def moving_average(
    previous: State | None, latest: State, share: float, masks: Masks | None = None
) -> State:
    """`share` x `previous` + (1 - `share`) x `latest`, tensor by tensor (the latest alone
    without a previous one, or for a tensor that is not floating point: a count); zero outside
    `masks` (name -> True where the latest model's entry is kept), so the average of a sparse
    strategy's models has the latest one's sparsity."""
    if previous is None or share == 0:
        return dict(latest)
    averaged = {}
    for name, new in latest.items():
        old = previous.get(name)
        if old is None or old.shape != new.shape or not new.is_floating_point():
            averaged[name] = new
            continue
        mixed = torch.lerp(new, old.to(new.dtype), share)
        mask = (masks or {}).get(name)
        averaged[name] = mixed * mask.to(mixed.dtype) if mask is not None else mixed
    return averaged


def averaged_candidate(
    previous: State | None,
    candidate: tuple[State, Masks | None],
    share: float,
) -> tuple[State, Masks | None]:
    """The strategy's model as the device keeps it: its weights averaged with `previous`
    (`moving_average`), its masks as they are."""
    weights, masks = candidate
    return moving_average(previous, weights, share, masks), masks


def kept_share(config: StrategyConfig) -> float:
    """The previous average's share in the kept model (`--dp-average`) under `--dp sample`;
    0 (the latest model alone) otherwise."""
    return config.dp_average if config.dp == DP_SAMPLE else 0.0
