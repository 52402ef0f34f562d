"""DA-DPFL sparse-model math: masks, aggregation, RigL, PQI pruning (ALGORITHMS.md section 1).

Pure, deterministic functions over state dicts (name -> float tensor) and masks (name -> bool
tensor, for the prunable Conv/Linear weights only). Nothing here touches the global RNG: random
draws take an explicit ``torch.Generator``. Functions return new dicts and never modify their
inputs, except ``apply_masks_`` whose trailing underscore says it works in place.

Conventions shared by every function:

* Ties in magnitude or gradient rankings go to the lower flat index (stable sorts), so the same
  inputs always give the same masks.
* Counts derived from floats (``ceil(alpha n)``, ``floor(d min(...))``) allow a relative slack
  of ``_EPS``, so a value that is an integer up to float error (``0.29 * 100`` is
  ``28.999999999999996``) is treated as that integer.
* Aggregations visit agents in sorted-id order and accumulate in float64, so a networked run and
  the in-process simulator produce bit-identical models whatever order models arrived in.
* Only floating tensors are averaged. A state may also hold integer or bool buffers (a user
  model's BatchNorm ``num_batches_tracked``, int64 0-d): those are copied, never averaged, from
  the first agent in sorted-id order that has them (``copied``), so the result stays an exact
  value some agent had, and aggregating one state returns it unchanged. Complex tensors are
  rejected (``models.check_supported`` refuses them before a run).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

State = dict[str, torch.Tensor]
Masks = dict[str, torch.Tensor]

_EPS = 1e-9


def _ceil(x: float) -> int:
    return math.ceil(x - _EPS * max(1.0, abs(x)))


def _floor(x: float) -> int:
    return math.floor(x + _EPS * max(1.0, abs(x)))


# --------------------------------------------------------------------------- initial masks (1.1)


def erk_densities(shapes: Mapping[str, Sequence[int]], density: float) -> dict[str, float]:
    """Erdos-Renyi-Kernel per-layer densities (ALGORITHMS.md 1.1).

    density_l = eps * sum(dims_l) / prod(dims_l), with eps chosen so that
    sum_l density_l n_l = density * sum_l n_l. A layer whose density would exceed 1 is made
    dense and eps is re-solved over the others. Raising eps only ever makes more layers
    saturate (re-solving after removing a saturated layer cannot lower eps), so saturating every
    offender at once per iteration gives the same fixed point as one at a time.

    Shapes are taken as stored. A recurrent matrix is one (gates x H, I) matrix, as the RigL
    reference treats an LSTM kernel, so it is pruned like a Linear of that size. A depthwise
    kernel (C, 1, k, k) has a large sum/product ratio and so a high density, which is ERK's
    intent for small layers (it holds C k^2 weights, a full conv C^2 k^2): 0.71 at density
    0.5 in examples/keyword_spotting, beside 0.32-0.43 for its pointwise convolutions.
    """
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density}")
    sizes = {name: math.prod(shape) for name, shape in shapes.items()}
    if any(n == 0 for n in sizes.values()):
        raise ValueError("prunable tensors must be non-empty")
    raw = {name: sum(shape) / sizes[name] for name, shape in shapes.items()}
    budget = density * sum(sizes.values())
    dense: set[str] = set()
    while True:
        free = [name for name in shapes if name not in dense]
        remaining = budget - sum(sizes[name] for name in dense)
        weight = sum(raw[name] * sizes[name] for name in free)
        eps = remaining / weight if weight > 0 else 0.0
        over = {name for name in free if eps * raw[name] > 1.0}
        if not over:
            break
        dense |= over
    return {name: 1.0 if name in dense else eps * raw[name] for name in shapes}


def random_masks(
    shapes: Mapping[str, Sequence[int]],
    densities: Mapping[str, float],
    generator: torch.Generator,
) -> Masks:
    """Per-agent random masks with exactly round(density_l n_l) ones per layer (1.1).

    Positions are a uniform random subset (``torch.randperm``). Layers are drawn in sorted-name
    order so the masks depend only on (shapes, densities, generator state), not on dict order;
    the returned dict keeps the order of ``shapes``. ``round`` is Python's (half to even).
    """
    out: Masks = {}
    for name in sorted(shapes):
        shape = tuple(shapes[name])
        n = math.prod(shape)
        keep = round(densities[name] * n)
        flat = torch.zeros(n, dtype=torch.bool)
        flat[torch.randperm(n, generator=generator)[:keep]] = True
        out[name] = flat.view(shape)
    return {name: out[name] for name in shapes}


def apply_masks(state: Mapping[str, torch.Tensor], masks: Mapping[str, torch.Tensor]) -> State:
    """Return a new state whose masked tensors are exactly +0.0 outside the mask.

    Every tensor in the result is a fresh copy (unmasked ones are cloned), so later in-place
    training on the result cannot alter ``state``.
    """
    return {
        name: torch.where(masks[name], t, torch.zeros_like(t)) if name in masks else t.clone()
        for name, t in state.items()
    }


def apply_masks_(state: Mapping[str, torch.Tensor], masks: Mapping[str, torch.Tensor]) -> None:
    """In-place ``apply_masks`` for the training loop (re-mask after every optimizer step, 1.5).

    Works on parameters too (call under ``torch.no_grad()``); writes +0.0 outside the mask.
    """
    for name, mask in masks.items():
        state[name].masked_fill_(~mask, 0.0)


def sparsity(masks: Mapping[str, torch.Tensor]) -> float:
    """Fraction of pruned entries over all prunable tensors (0.0 when there are none)."""
    total = sum(m.numel() for m in masks.values())
    kept = sum(int(m.sum()) for m in masks.values())
    return 1.0 - kept / total if total else 0.0


# ------------------------------------------------------------------------- aggregation (1.4)


def averaged(tensor: torch.Tensor) -> bool:
    """Whether aggregation averages `tensor` (floating) or copies it (integer, bool): a mean of
    counters such as BatchNorm's ``num_batches_tracked`` is no count any model ever had, and
    rounding it back to an integer would be a silent guess."""
    return torch.is_floating_point(tensor)


def _check_states(states: Sequence[Mapping[str, torch.Tensor]]) -> list[str]:
    """The common tensor names; raises ValueError unless every state has the same names in the
    same order, no tensor is complex, and each copied (non-floating) entry has one dtype and
    shape across the states (a copy from one agent must fit every agent's model)."""
    names = list(states[0])
    for state in states:
        if list(state) != names:
            raise ValueError("all states must have the same tensor names in the same order")
        bad = [n for n, t in state.items() if t.is_complex()]
        if bad:
            raise ValueError(f"complex tensors are not exchanged; got {bad}")
        for name, tensor in state.items():
            first = states[0][name]
            if averaged(tensor) != averaged(first) or (
                not averaged(tensor) and (tensor.dtype, tensor.shape) != (first.dtype, first.shape)
            ):
                raise ValueError(f"{name!r} has a different dtype or shape across the states")
    return names


def copied(states: Sequence[Mapping[str, torch.Tensor]], name: str) -> torch.Tensor:
    """A non-averaged entry of the aggregate: a copy of the first state's (callers pass the
    states in sorted-id order)."""
    return states[0][name].clone()


def aggregate_weighted(
    states: Mapping[str, Mapping[str, torch.Tensor]], weights: Mapping[str, float]
) -> State:
    """Weighted mean sum_j a_j w_j / sum_j a_j of every floating tensor (FedAvg: a_j = sample
    count); integer and bool entries are copied from the first agent by id (``copied``).

    Agents are summed in sorted-id order in float64; the result has each tensor's dtype.
    """
    if not states:
        raise ValueError("nothing to aggregate")
    ids = sorted(states)
    if any(weights[i] < 0 for i in ids) or sum(weights[i] for i in ids) <= 0:
        raise ValueError("weights must be non-negative with a positive total")
    ordered = [states[i] for i in ids]
    names = _check_states(ordered)
    total = math.fsum(weights[i] for i in ids)
    out: State = {}
    for name in names:
        if not averaged(ordered[0][name]):
            out[name] = copied(ordered, name)
            continue
        acc = torch.zeros_like(states[ids[0]][name], dtype=torch.float64)
        for i in ids:
            acc += states[i][name].to(torch.float64) * weights[i]
        out[name] = (acc / total).to(states[ids[0]][name].dtype)
    return out


def aggregate_mean(states: Mapping[str, Mapping[str, torch.Tensor]]) -> State:
    """Plain mean of every floating tensor over the agents (DFedAvgM, unweighted FedAvg; 1.4
    dense part); integer and bool entries as in ``aggregate_weighted``."""
    return aggregate_weighted(states, dict.fromkeys(states, 1.0))


def aggregate_masked(
    models: Mapping[str, tuple[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]]],
    own_mask: Mapping[str, torch.Tensor],
    weights: Mapping[str, float] | None = None,
) -> State:
    """Mask-based aggregation, eq. 7 (ALGORITHMS.md 1.4).

    ``models`` maps agent id -> (state, mask the sender trained with) for S = G_k^t + {k}.
    Prunable tensors (the keys of ``own_mask``): agg[e] = sum_j w_j[e] / sum_j m_j[e] where the
    count is positive, else 0, then multiplied by k's own mask. Each sender's weights are
    multiplied by its own mask first, so a stray nonzero outside a sender's mask can never leak
    into the average while not being counted. Every other floating tensor (biases, norms):
    plain mean over S. Integer and bool entries are copied from the first agent of S by id
    (``copied``), whether or not that is k. Agents are visited in sorted-id order and sums are
    taken in float64, so the result does not depend on arrival order.

    With `weights` (asynchronous rounds: each sender's staleness weight), each sender's
    masked entries and its count are scaled by its weight, sum_j a_j m_j w_j / sum_j a_j m_j,
    and the dense tensors are the weighted mean (`aggregate_weighted_masked`); None: eq. 7.
    """
    if not models:
        raise ValueError("nothing to aggregate")
    if weights is not None:
        return aggregate_weighted_masked(models, own_mask, weights)
    ids = sorted(models)
    ordered = [models[i][0] for i in ids]
    names = _check_states(ordered)
    prunable = set(own_mask)
    for i in ids:
        if set(models[i][1]) != prunable:
            raise ValueError(f"mask of {i!r} does not cover the same prunable tensors")
    # The prunable tensors of a model are concatenated into one flat vector, and the others
    # into another: the per-element operations (float64 sums from +0.0 in sorted-id order, one
    # division) are exactly those of a per-tensor loop, in a few large operations per agent
    # instead of a few small ones per tensor and agent.
    ref = models[ids[0]][0]
    masked_names = [n for n in names if n in prunable]
    dense_names = [n for n in names if n not in prunable and averaged(ref[n])]

    def flat(tensors: Mapping[str, torch.Tensor], which: list[str]) -> torch.Tensor:
        return torch.cat([tensors[n].reshape(-1) for n in which])

    out: State = {}
    if masked_names:
        num = torch.zeros(sum(ref[n].numel() for n in masked_names), dtype=torch.float64)
        cnt = torch.zeros(num.shape, dtype=torch.int64)
        for i in ids:
            state, mask = models[i]
            kept = flat(mask, masked_names)
            num += torch.where(kept, flat(state, masked_names).to(torch.float64), 0.0)
            cnt += kept
        agg = torch.where(cnt > 0, num / cnt.clamp(min=1), 0.0)
        agg = torch.where(flat(own_mask, masked_names), agg, 0.0)
        out |= _split(agg, ref, masked_names)
    if dense_names:  # plain mean, as aggregate_mean: sum of w * 1.0 (== w) over n
        acc = torch.zeros(sum(ref[n].numel() for n in dense_names), dtype=torch.float64)
        for i in ids:
            acc += flat(models[i][0], dense_names).to(torch.float64)
        out |= _split(acc / math.fsum(1.0 for _ in ids), ref, dense_names)
    return {name: out[name] if name in out else copied(ordered, name) for name in names}


def aggregate_weighted_masked(
    models: Mapping[str, tuple[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]]],
    own_mask: Mapping[str, torch.Tensor],
    weights: Mapping[str, float],
) -> State:
    """Eq. 7 with a weight a_j per sender where a FedAvg weight would enter: a prunable entry
    is sum_j a_j m_j w_j / sum_j a_j m_j (0 where no weighted sender holds it), then cut to
    the own mask; a dense floating tensor the weighted mean; integer and bool entries copied
    (``copied``). All weights 1 give eq. 7's values. Sorted-id order, float64 sums."""
    ids = sorted(models)
    if any(weights[i] < 0 for i in ids) or math.fsum(weights[i] for i in ids) <= 0:
        raise ValueError("weights must be non-negative with a positive total")
    ordered = [models[i][0] for i in ids]
    names = _check_states(ordered)
    out: State = {}
    for name in names:
        if not averaged(ordered[0][name]):
            out[name] = copied(ordered, name)
            continue
        if name not in own_mask:
            out |= aggregate_weighted({i: {name: models[i][0][name]} for i in ids}, weights)
            continue
        num = torch.zeros_like(ordered[0][name], dtype=torch.float64)
        cnt = torch.zeros_like(num)
        for i in ids:
            state, mask = models[i]
            kept = mask[name].to(torch.float64) * weights[i]
            num += torch.where(mask[name], state[name].to(torch.float64), 0.0) * kept
            cnt += kept
        agg = torch.where(cnt > 0, num / torch.where(cnt > 0, cnt, 1.0), 0.0)
        out[name] = torch.where(own_mask[name], agg, 0.0).to(ordered[0][name].dtype)
    return out


def _split(flat: torch.Tensor, like: Mapping[str, torch.Tensor], names: list[str]) -> State:
    """Cut a flat vector back into the named tensors of `like`, in their shapes and dtypes."""
    out: State = {}
    offset = 0
    for name in names:
        ref = like[name]
        out[name] = flat[offset : offset + ref.numel()].view(ref.shape).to(ref.dtype)
        offset += ref.numel()
    return out


# -------------------------------------------------------------------------------- RigL (1.6)


# ---------------------------------------------------------------------------- PQI pruning (1.9)


def smallest_active(magnitude: torch.Tensor, active: torch.Tensor, count: int) -> torch.Tensor:
    """Flat indices of the ``count`` active entries of smallest magnitude (ties: lower index)."""
    score = torch.where(active, magnitude.to(torch.float64), math.inf)
    return torch.sort(score, stable=True).indices[:count]
