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

from agent.learning.sparse import State

Groups = Mapping[str, list[str]]

WEIGHTED_TYPES = (nn.Conv1d, nn.Conv2d, nn.Linear)
NORM_TYPES = (nn.GroupNorm, nn.LayerNorm)


def layer_groups(model: nn.Module) -> dict[str, list[str]]:
    """Layer name (the conv/linear module's name) -> state-dict names of its tensors.

    A layer is a conv/linear weight with its bias and the norm that follows it: a norm's
    parameters join the most recent conv/linear in module order, which is forward order for
    the bundled models (ResNet's conv1/norm1, conv2/norm2 and shortcut conv/norm included).
    A layer travels whole because a norm rescales exactly its conv's output; mixing one
    agent's conv with another's norm would pair statistics that were never trained together.
    Raises ValueError when a state-dict entry would belong to no layer (a norm before any
    conv/linear, another module type with parameters, or buffers such as BatchNorm's).
    """
    groups: dict[str, list[str]] = {}
    current: str | None = None
    for name, module in model.named_modules():
        own = [f"{name}.{p}" if name else p for p, _ in module.named_parameters(recurse=False)]
        if isinstance(module, WEIGHTED_TYPES):
            current = name
            groups[current] = own
        elif own:
            if current is None or not isinstance(module, NORM_TYPES):
                raise ValueError(f"parameters of {name!r} belong to no conv/linear layer")
            groups[current] += own
    covered = [t for names in groups.values() for t in names]
    if sorted(covered) != sorted(model.state_dict()):
        raise ValueError("layer groups must cover every state-dict entry exactly once")
    return groups


def divergences(after: State, received: State, groups: Groups) -> dict[str, float]:
    """Per layer ||w_l(after) - w_l(received)||_2 over all its tensors together, in float64
    (float32 squares of large differences overflow, and agents must rank identically)."""
    out: dict[str, float] = {}
    for layer, names in groups.items():
        total = sum(
            float((after[n].to(torch.float64) - received[n].to(torch.float64)).square().sum())
            for n in names
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
    order, one division by the fsum of weights, cast to the first uploader's dtype), so when
    every agent uploads every layer the result equals FedAvg bit for bit.
    """
    ids = sorted(uploads)
    if any(weights[i] < 0 for i in ids):
        raise ValueError("weights must be non-negative")
    owner = {name: layer for layer, names in groups.items() for name in names}
    for i in ids:
        for name, tensor in uploads[i].items():
            if name not in owner:
                raise ValueError(f"agent {i!r} uploaded {name!r}, which is in no layer")
            if not torch.is_floating_point(tensor) or tensor.shape != previous[name].shape:
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
            acc = torch.zeros_like(uploads[senders[0]][name], dtype=torch.float64)
            for i in senders:
                acc += uploads[i][name].to(torch.float64) * weights[i]
            out[name] = (acc / total).to(uploads[senders[0]][name].dtype)
    return {name: out[name] if name in out else t.clone() for name, t in previous.items()}
