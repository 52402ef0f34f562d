"""A centralized round under secure aggregation (`--secure-aggregation`), the math around the
cryptography: what a participant's upload becomes before it is masked, and what the
coordinator's unmasked sum becomes before the strategy aggregates it. The masking itself is
`protocol.secagg`'s, which the runtime (`agent.runtime.secure_rounds`,
`coordinator.secure_sum`) and the simulator call; this module imports none of it.

A participant sends the change of its uploaded model from the view it trained from (the
round's global model), flattened over the model's floating tensors in payload order: a
change is small and bounded where weights need not be, so it quantizes finely
(`protocol.secagg.CLIP_RANGE`). The coordinator adds the weighted mean change to its own
model (the same view, as its participants hold it) and hands the strategy that one model as
the round's only upload: for a weighted mean of whole models (`Strategy.secure_sum`) the
mean of one upload is itself. Integer entries (BatchNorm's batch counters) are not summed:
the server keeps its own, where the plain round copies the first participant's.

Partial uploads (FedSPU, federated dropout: a strategy that `downloads` each participant's
part) are summed over the whole vector too, each participant's change 0 outside its part
(`flat_change` with the upload's masks). The coordinator chose every part (it sent them), so
it divides each entry by the weight of the survivors that trained it (`part_mean`) from the
parts and the advertised sample counts it already holds: one masked vector a participant,
none of weights, and nothing the coordinator did not know. An entry nobody trained keeps the
server's value, as the plain round's `freezing.aggregate_active` does.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from agent.learning.central.base import CentralStrategy, Payload, ServerState, Upload
from agent.learning.model_facts import ModelFacts
from agent.learning.sparse import State

SUM = "secure-sum"
"""The key of the round's one upload, the unmasked mean, in what the strategy aggregates."""


def summed_names(strategy: CentralStrategy, facts: ModelFacts) -> list[str]:
    """The tensors whose changes are summed: the floating ones, in payload order."""
    initial = facts.initial
    return [n for n in strategy.payload_order(facts) if torch.is_floating_point(initial[n])]


def vector_length(strategy: CentralStrategy, facts: ModelFacts) -> int:
    """How many values a masked upload carries."""
    return sum(facts.initial[n].numel() for n in summed_names(strategy, facts))


def flat_change(names: list[str], upload: Payload, view: ServerState) -> np.ndarray:
    """A participant's upload as the vector it masks: each tensor's change from `view`, 0
    outside the upload's part (its masks) where it carries one."""
    masks = upload.masks or {}
    parts = []
    for n in names:
        change = upload.weights[n].double() - view.weights[n].double()
        if n in masks:
            change = torch.where(masks[n], change, torch.zeros_like(change))
        parts.append(change.flatten())
    return torch.cat(parts).numpy() if parts else np.zeros(0)


def part_mean(
    mean: np.ndarray,
    names: list[str],
    parts: Mapping[str, Payload],
    weights: Mapping[str, int],
) -> np.ndarray:
    """The per-entry weighted mean change of partial uploads from `mean`, the secure sum's
    weighted mean over all its survivors (`protocol.secagg.survivor_mean`, which counts a
    survivor's 0 outside its part): each entry rescaled to the weight of the survivors that
    trained it (`parts`: the part the coordinator sent each survivor; `weights`: their sample
    counts); 0 where none did."""
    trained = np.zeros(mean.size)
    for agent, part in parts.items():
        masks = part.masks or {}
        flags = [
            (masks[n] if n in masks else torch.ones_like(part.weights[n], dtype=torch.bool))
            .flatten()
            .numpy()
            for n in names
        ]
        active = np.concatenate(flags) if flags else np.zeros(0, dtype=bool)
        if active.size != mean.size:
            raise ValueError(f"the part of {agent} has {active.size} values; the sum {mean.size}")
        trained += weights[agent] * active
    out = np.zeros_like(mean)
    np.divide(mean * sum(weights[k] for k in parts), trained, out=out, where=trained > 0)
    return out


def unflattened(names: list[str], like: State, vector: np.ndarray) -> State:
    """`vector` (the secure sum's, in `names`' order) as float64 tensors shaped as `like`'s;
    ValueError when its length is not theirs."""
    out, at = {}, 0
    for n in names:
        shape = like[n].shape
        out[n] = torch.from_numpy(vector[at : at + like[n].numel()]).view(shape)
        at += like[n].numel()
    if at != vector.size:
        raise ValueError(f"the secure sum has {vector.size} values; the model {at}")
    return out


def summed_upload(
    names: list[str], server: ServerState, mean_change: np.ndarray, weight: int
) -> Upload:
    """The round's one upload from the weighted mean change of the survivors' models, with
    their total sample count."""
    weights = dict(server.weights)
    for n, change in unflattened(names, server.weights, mean_change).items():
        weights[n] = (server.weights[n].double() + change).to(server.weights[n].dtype)
    return Upload(Payload(weights), weight)
