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

FedLDF's index set is its layer selection: the divergence vectors come in the clear, the
coordinator picks each layer's most divergent devices and asks each for its layers (an
empty ask included), and each device masks its change on those layers, 0 elsewhere
(`flat_change` of its response, which carries only them). The coordinator divides each
layer by the weight of the survivors it asked for it (`part_mean` over `layer_parts`); a
layer none of them sent keeps the server's value, as `ldf.aggregate_layers` keeps it.

The FedAdam family's vector is its three deltas (`central.secure_moments`); FedAdam-Top and
-SSM mask it over the union of the devices' top-k masks, which each device sent before
masking (`union`, `on_support`, `from_support`). `device_vector` and `round_upload` pick a
strategy's rule, so the runtime and the simulator write none of it.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from agent.learning import adam, ldf
from agent.learning.central import secure_moments
from agent.learning.central.base import CentralStrategy, Payload, ServerState, Upload
from agent.learning.central.fedadam import FedAdam, moment_layout
from agent.learning.model_facts import ModelFacts
from agent.learning.sparse import State

SUM = "secure-sum"
"""The key of the round's one upload, the unmasked mean, in what the strategy aggregates."""


def summed_names(strategy: CentralStrategy, facts: ModelFacts) -> list[str]:
    """The tensors whose changes are summed: the floating ones, in payload order (the Adam
    family: its three deltas of every parameter)."""
    if is_adam(strategy):
        return list(moment_layout(facts))
    initial = facts.initial
    return [n for n in strategy.payload_order(facts) if torch.is_floating_point(initial[n])]


def vector_length(strategy: CentralStrategy, facts: ModelFacts) -> int:
    """How many values a masked upload carries before any union (`on_support`) cuts it."""
    if is_adam(strategy):
        layout = moment_layout(facts)
        return sum(int(np.prod(layout[n][0], dtype=np.int64)) for n in layout)
    return sum(facts.initial[n].numel() for n in summed_names(strategy, facts))


def is_adam(strategy: CentralStrategy) -> bool:
    """Whether its devices upload Adam's deltas (`central.secure_moments`), not models."""
    return isinstance(strategy, FedAdam)


def chooses_entries(strategy: CentralStrategy) -> bool:
    """Whether each device picks the entries it uploads from its own data (FedAdam-Top and
    -SSM's top-k masks), so that they are agreed (`union`) before masking."""
    return is_adam(strategy) and getattr(strategy, "mode", adam.MODE_DENSE) != adam.MODE_DENSE


def device_vector(
    strategy: CentralStrategy,
    facts: ModelFacts,
    names: list[str],
    upload: Payload,
    view: ServerState,
) -> np.ndarray:
    """A participant's upload as the vector it masks, over the whole model (before `on_support`):
    its change from `view` (`flat_change`), or its Adam deltas (`secure_moments`)."""
    if is_adam(strategy):
        return secure_moments.moment_vector(names, facts, upload)
    return flat_change(names, upload, view)


def device_support(strategy: CentralStrategy, names: list[str], upload: Payload) -> np.ndarray:
    """(FedAdam-Top and -SSM) The entries of the whole vector a participant's upload covers."""
    return secure_moments.moment_support(names, upload)


def union(supports: Mapping[str, np.ndarray], length: int) -> np.ndarray:
    """The entries some participant covers: the masked vector's entries."""
    covered = np.zeros(length, dtype=bool)
    for agent, support in supports.items():
        if support.size != length:
            raise ValueError(f"the support of {agent} has {support.size} entries, not {length}")
        covered |= support
    return covered


def on_support(vector: np.ndarray, support: np.ndarray | None) -> np.ndarray | None:
    """A whole vector cut to the agreed entries (all without a `support`); None when it has
    a non-zero value outside them (its sender's masks came too late for the union)."""
    if support is None:
        return vector
    if np.any(vector[~support]):
        return None
    cut: np.ndarray = vector[support]
    return cut


def from_support(values: np.ndarray, support: np.ndarray | None) -> np.ndarray:
    """A vector over the agreed entries back over the whole vector, 0 elsewhere."""
    if support is None:
        return values
    whole = np.zeros(support.size)
    whole[support] = values
    return whole


def flat_change(names: list[str], upload: Payload, view: ServerState) -> np.ndarray:
    """A participant's upload as the vector it masks: each tensor's change from `view`, 0
    outside the upload's part (its masks) where it carries one, and 0 for a tensor it does
    not carry (FedLDF's layers it was not asked for)."""
    masks = upload.masks or {}
    parts = []
    for n in names:
        if n not in upload.weights:
            parts.append(torch.zeros(view.weights[n].numel(), dtype=torch.float64))
            continue
        change = upload.weights[n].double() - view.weights[n].double()
        if n in masks:
            change = torch.where(masks[n], change, torch.zeros_like(change))
        parts.append(change.flatten())
    return torch.cat(parts).numpy() if parts else np.zeros(0)


def layer_parts(
    facts: ModelFacts, server: ServerState, asked: Mapping[str, list[str]]
) -> dict[str, Payload]:
    """(FedLDF) Each participant's part as `part_mean` reads it: the server's model, masked
    to the tensors of the layers it was asked for."""
    groups = facts.layer_groups
    parts = {}
    for k, layers in asked.items():
        chosen = ldf.partial_state(server.weights, layers, groups)
        masks = {
            n: torch.full_like(t, n in chosen, dtype=torch.bool) for n, t in server.weights.items()
        }
        parts[k] = Payload(server.weights, masks)
    return parts


def part_mean(
    mean: np.ndarray,
    names: list[str],
    parts: Mapping[str, Payload],
    weights: Mapping[str, int],
) -> np.ndarray:
    """The per-entry weighted mean change of partial uploads from `mean`, the secure sum's
    weighted mean over all its survivors (`protocol.secagg.survivor_mean`, which counts a
    survivor's 0 outside its part): each entry rescaled to the weight of the survivors that
    trained it (`parts`: for every survivor, the part the coordinator sent it or the layers
    it asked it for, `layer_parts`; `weights`: their sample counts); 0 where none did."""
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


def round_upload(
    strategy: CentralStrategy,
    facts: ModelFacts,
    server: ServerState,
    mean: np.ndarray,
    weights: Mapping[str, int],
    parts: Mapping[str, Payload] | None = None,
) -> Upload:
    """The round's one upload from the survivors' mean vector over the whole model
    (`from_support`) and their weights: per entry over the `parts` the coordinator chose
    (FedSPU's family, FedLDF: `part_mean`), as it is where every survivor's entries count
    (FedAvg, the Adam family, whose zeros outside a top-k mask count in its plain mean)."""
    names = summed_names(strategy, facts)
    total = sum(weights.values())
    if is_adam(strategy):
        return secure_moments.moment_upload(names, facts, mean, total)
    if parts is not None:
        mean = part_mean(mean, names, parts, weights)
    return summed_upload(names, server, mean, total)
