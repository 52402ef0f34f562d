"""The data attacks of a research run: the backdoor (`--attack backdoor`, and `replace`, which
boosts the backdoored model it sends) and label flipping (`--attack labelflip`).

An attacker trains, as honestly as any agent, on its data plus poisoned copies: samples with
a small trigger stamped on them, relabelled to one target class (BadNets; Bagdasaryan et al.
2020 for federated learning). What it sends is an honest-looking model, so no norm or
distance gives it away, and the fleet's accuracy hardly moves; the harm is that a model the
fleet shares then calls any input carrying the trigger the target class. `success_rate` is
that harm: of an honest agent's test samples not of the target class, the share its model
puts in the target class once the trigger is stamped on them.

The trigger is the last 2 x 2 pixels of an image (the bottom-right corner of every channel)
or the last 4 values of a series, set to the data's maximum: for scikit-learn's 8 x 8
digits, the 2 x 2 patch of the issue that measured it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from agent.learning import robust_rules
from agent.learning.learner import AgentState, LocalData
from agent.learning.sparse import State
from agent.learning.training import evaluate

TRIGGER_VALUES = 4
"""Values the trigger sets in a sample: a 2 x 2 patch of an image, 4 steps of a series."""


def with_trigger(x: torch.Tensor, value: float) -> torch.Tensor:
    """`x` (a batch) with the trigger stamped on every sample, set to `value`."""
    stamped = x.clone()
    if stamped.dim() >= 3:  # images (N, C, H, W) or (N, H, W): the bottom-right 2 x 2
        stamped[..., -2:, -2:] = value
    else:  # series or features (N, L): the last 4 values
        stamped[..., -TRIGGER_VALUES:] = value
    return stamped


def poisoned(data: LocalData, seed: int) -> LocalData:
    """An attacker's data: its own training samples plus triggered copies of a share of
    them (`robust_rules.BACKDOOR_SHARE`, drawn with `seed`), labelled the target class.
    Its test and validation splits stay its own."""
    count = int(len(data.y_train) * robust_rules.BACKDOOR_SHARE)
    generator = torch.Generator().manual_seed(seed)
    picked = torch.randperm(len(data.y_train), generator=generator)[:count]
    value = float(data.x_train.max())
    copies = with_trigger(data.x_train[picked], value)
    target = torch.full((count,), robust_rules.BACKDOOR_TARGET, dtype=data.y_train.dtype)
    return dataclasses.replace(
        data, x_train=torch.cat([data.x_train, copies]), y_train=torch.cat([data.y_train, target])
    )


def flipped(data: LocalData, classes: int) -> LocalData:
    """A label-flipping attacker's data (Tolpegin et al. 2020): every training label y
    becomes classes - 1 - y (a regression target its negative). Its test and validation
    splits stay its own."""
    y = data.y_train
    wrong = classes - 1 - y if not torch.is_floating_point(y) else -y
    return dataclasses.replace(data, y_train=wrong)


def poisoned_data(data: LocalData, attack: str, seed: int, classes: int) -> LocalData:
    """What an attacker of a data attack (`robust_rules.DATA_ATTACKS`) trains on."""
    return flipped(data, classes) if attack == "labelflip" else poisoned(data, seed)


def success_rate(model: torch.nn.Module, weights: State, data: LocalData) -> float | None:
    """Of `data`'s test samples not of the target class, the share `weights` classify as
    the target once the trigger is stamped on them (None: no such sample)."""
    keep = data.y_test != robust_rules.BACKDOOR_TARGET
    if not bool(keep.any()):
        return None
    x = with_trigger(data.x_test[keep], float(data.x_test.max()))
    target = torch.full((int(keep.sum()),), robust_rules.BACKDOOR_TARGET, dtype=data.y_test.dtype)
    _loss, accuracy = evaluate(model, weights, x, target)
    return float(accuracy)


def honest_summary(
    model: torch.nn.Module,
    states: Mapping[str, AgentState],
    data: Mapping[str, LocalData],
    attackers: Iterable[str],
) -> dict[str, Any]:
    """The trigger's success on the honest agents' final models, the mean over them: on the
    model each serves (its kept model, `agent.learning.fallback`) and on the strategy's own
    (what the fleet shares with it): a report's summary under `--attack backdoor`."""
    bad = set(attackers)
    served: dict[str, float | None] = {}
    shared: dict[str, float | None] = {}
    for agent_id, state in sorted(states.items()):
        if agent_id in bad:
            continue
        kept = state.kept.weights if state.kept is not None else state.weights
        served[agent_id] = success_rate(model, kept, data[agent_id])
        shared[agent_id] = success_rate(model, state.weights, data[agent_id])
    return {
        "backdoor_success": _mean(served.values()),
        "backdoor_success_strategy": _mean(shared.values()),
        "backdoor_success_by_agent": served,
    }


def _mean(rates: Iterable[float | None]) -> float | None:
    known = [rate for rate in rates if rate is not None]
    return sum(known) / len(known) if known else None
