"""FedLDF layer-divergence feedback (ALGORITHMS.md section 4): layers, divergences, selection
and per-layer aggregation.

Pure, deterministic functions over state dicts (``sparse.State``). Participants first send one
divergence per layer; the aggregator then asks each participant only for the layers where it is
among the n most diverged, and averages each layer over those who sent it. Agents are visited
in sorted-id order and sums are taken in float64, as in ``sparse.aggregate_weighted``, so with
n = K the result is FedAvg bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from agent.learning.models import RECURRENT_TYPES
from agent.learning.sparse import State, averaged

Groups = Mapping[str, list[str]]

# Layers a directly following norm joins: it rescales exactly their output.
WEIGHTED_TYPES = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.Linear,
    *RECURRENT_TYPES,
)
NORM_TYPES = (
    nn.GroupNorm,
    nn.LayerNorm,
    nn.RMSNorm,
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
)
# The layer name of the root module's own tensors (a module name is never empty otherwise,
# and never contains parentheses when it comes from attributes or Sequential indices).
ROOT_LAYER = "(root)"


def layer_groups(model: nn.Module) -> dict[str, list[str]]:
    """Layer name -> state-dict names of its tensors, layers in module order, each layer's
    tensors in state-dict order.

    Every module with tensors of its own in the state dict (parameters and persistent buffers,
    such as BatchNorm's running statistics and ``num_batches_tracked``) is a layer, named by
    its module name (``ROOT_LAYER`` for the root's own), except that a norm directly following
    a conv, linear or recurrent layer (the next module with tensors of its own, in module
    order, skipping activations and containers) joins that layer: a norm rescales exactly its
    conv's output, and mixing one agent's conv with another's norm would pair statistics that
    were never trained together. This is forward order for the bundled models (ResNet's
    conv1/norm1, conv2/norm2 and shortcut conv/norm included). A recurrent layer's tensors
    (every layer and direction) form one layer, an embedding is a layer, and a norm with no
    such layer before it is a layer of its own.

    Raises ValueError when the layers would not cover every state-dict entry exactly once (a
    module registered under two names, which ``models.check_supported`` rejects first).
    """
    keys = list(model.state_dict())
    own: dict[str, list[str]] = {}
    for key in keys:
        own.setdefault(key.rpartition(".")[0], []).append(key)
    groups: dict[str, list[str]] = {}
    joinable: str | None = None  # the weighted layer a norm visited next would join
    for name, module in model.named_modules():
        tensors = own.get(name, [])
        if not tensors:
            continue
        if joinable is not None and isinstance(module, NORM_TYPES):
            groups[joinable] += tensors
            joinable = None
            continue
        layer = name or ROOT_LAYER
        if layer in groups:
            raise ValueError(f"module name {layer!r} is taken by the root module's tensors")
        groups[layer] = list(tensors)
        joinable = layer if isinstance(module, WEIGHTED_TYPES) else None
    covered = [t for names in groups.values() for t in names]
    if sorted(covered) != sorted(keys):
        raise ValueError("layer groups must cover every state-dict entry exactly once")
    return groups


def divergences(after: State, received: State, groups: Groups) -> dict[str, float]:
    """Per layer ||w_l(after) - w_l(received)||_2 over all its floating tensors together, in
    float64 (float32 squares of large differences overflow, and agents must rank identically).
    Integer buffers are left out: BatchNorm's ``num_batches_tracked`` counts steps taken, not
    how far the model moved, and would outweigh every weight."""
    out: dict[str, float] = {}
    for layer, names in groups.items():
        total = sum(
            float((after[n].to(torch.float64) - received[n].to(torch.float64)).square().sum())
            for n in names
            if averaged(received[n])
        )
        out[layer] = math.sqrt(total)
    return out


def checked_divergences(layers: list[str], values: list[float], groups: Groups) -> dict[str, float]:
    """A received divergence vector as layer -> value in the model's layer order; raises
    ValueError unless it gives every layer of `groups` exactly once, none negative."""
    if sorted(layers) != sorted(groups) or len(values) != len(layers):
        raise ValueError("a divergence vector must give every layer once")
    if any(v < 0 for v in values):
        raise ValueError("a divergence is never negative")
    given = dict(zip(layers, values, strict=True))
    return {layer: given[layer] for layer in groups}


def select_layers(divergences: Mapping[str, Mapping[str, float]], n: int) -> dict[str, list[str]]:
    """Agent -> layers it must upload: per layer, the n agents with the largest divergence
    (ties: lower agent id), eq. 4 of the paper. Layers keep the order of the first agent's
    (by id) divergences; an agent picked for nothing gets []. With n >= K all upload all."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    ids = sorted(divergences)
    if not ids:
        return {}
    layers = list(divergences[ids[0]])
    for i in ids:
        if set(divergences[i]) != set(layers):
            raise ValueError(f"agent {i!r} reports divergences for different layers")
        if any(math.isnan(d) for d in divergences[i].values()):
            raise ValueError(f"agent {i!r} reports a NaN divergence")
    chosen: dict[str, list[str]] = {i: [] for i in ids}
    for layer in layers:
        for i in sorted(ids, key=lambda i: (-divergences[i][layer], i))[:n]:
            chosen[i].append(layer)
    return chosen


def partial_state(state: State, layers: list[str], groups: Groups) -> State:
    """The tensors of `layers` only (what an agent uploads); shares storage with `state`."""
    return {name: state[name] for layer in layers for name in groups[layer]}


def aggregate_layers(
    uploads: Mapping[str, State],
    weights: Mapping[str, float],
    groups: Groups,
    previous: State,
) -> State:
    """Per layer, the weighted mean sum_j a_j w_j / sum_j a_j over the agents that uploaded it
    (eqs. 5-6); a layer nobody uploaded keeps `previous`. Returns a full state in the order
    of `previous`.

    Arithmetic is exactly ``sparse.aggregate_weighted``'s (float64 sums from zero in sorted-id
    order, one division by the fsum of weights, cast to the first uploader's dtype; integer
    entries copied from the first uploader by id, not averaged), so when every agent uploads
    every layer the result equals FedAvg bit for bit.
    """
    ids = sorted(uploads)
    if any(weights[i] < 0 for i in ids):
        raise ValueError("weights must be non-negative")
    owner = {name: layer for layer, names in groups.items() for name in names}
    for i in ids:
        for name, tensor in uploads[i].items():
            if name not in owner:
                raise ValueError(f"agent {i!r} uploaded {name!r}, which is in no layer")
            ref = previous[name]
            if (
                tensor.shape != ref.shape
                or tensor.is_complex()
                or averaged(tensor) != averaged(ref)
                or (not averaged(ref) and tensor.dtype != ref.dtype)
            ):
                raise ValueError(f"agent {i!r} uploaded {name!r} with a bad dtype or shape")
        for layer in {owner[name] for name in uploads[i]}:
            if any(name not in uploads[i] for name in groups[layer]):
                raise ValueError(f"agent {i!r} uploaded only part of layer {layer!r}")
    out: State = {}
    for layer, names in groups.items():
        senders = [i for i in ids if names[0] in uploads[i]]
        if not senders:
            continue
        total = math.fsum(weights[i] for i in senders)
        if total <= 0:
            raise ValueError(f"layer {layer!r}: uploaders' weights must have a positive total")
        for name in names:
            if not averaged(previous[name]):
                out[name] = uploads[senders[0]][name].clone()
                continue
            acc = torch.zeros_like(uploads[senders[0]][name], dtype=torch.float64)
            for i in senders:
                acc += uploads[i][name].to(torch.float64) * weights[i]
            out[name] = (acc / total).to(uploads[senders[0]][name].dtype)
    return {name: out[name] if name in out else t.clone() for name, t in previous.items()}
