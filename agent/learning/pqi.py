"""PQI (ALGORITHMS.md 1.9): how much further to prune each layer, from its PQ sparsity index."""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import torch

from agent.learning.sparse import Masks, _floor, smallest_active


def _lp_norm(x: torch.Tensor, p: float) -> float:
    return float(x.abs().pow(p).sum().pow(1.0 / p))


def pqi(x: torch.Tensor, p: float = 0.5, q: float = 1.0) -> float:
    """PQ Index of a layer's active weights: 1 - d^(1/q - 1/p) ||x||_p / ||x||_q (1.9).

    0 for a vector of equal magnitudes, up to 1 - d^(1/q - 1/p) for a single nonzero. Computed
    in float64. Degenerate inputs (no entries, or all zero) return 0.0: there is nothing to
    measure, and ``pqi_prune_count`` prunes nothing for them.
    """
    x = x.detach().flatten().to(torch.float64)
    d = x.numel()
    if d == 0 or not bool(x.any()):
        return 0.0
    return 1.0 - cast(float, d ** (1.0 / q - 1.0 / p)) * _lp_norm(x, p) / _lp_norm(x, q)


def pqi_prune_count(
    x: torch.Tensor,
    p: float = 0.5,
    q: float = 1.0,
    eta_c: float = 0.0,
    gamma: float = 1.0,
    beta: float = 0.9,
) -> int:
    """Number of weights PQI pruning removes from a layer with active weights x (1.9).

    r = d (1 + eta_c)^(-q/(q-p)) (1 - PQI)^(p/(q-p)) is the lower bound on weights to keep;
    c = floor(d min(gamma (1 - r/d), beta)), clamped at 0 (r > d can occur for eta_c < 0).
    No entries or all-zero entries: prune nothing.
    """
    if not 0.0 < p < q:
        raise ValueError(f"need 0 < p < q, got p={p}, q={q}")
    d = x.numel()
    if d == 0 or not bool(x.any()):
        return 0
    r = d * (1.0 + eta_c) ** (-q / (q - p)) * (1.0 - pqi(x, p, q)) ** (p / (q - p))
    return max(0, _floor(d * min(gamma * (1.0 - r / d), beta)))


def _trim_to_budget(counts: dict[str, int], budget: int) -> dict[str, int]:
    """Scale per-layer counts down proportionally so they sum exactly to ``budget``.

    Largest-remainder rounding in exact integer arithmetic: floor(c_l B / C) each, then one
    more to the layers with the largest remainders (ties: sorted layer name).
    """
    total = sum(counts.values())
    if total <= budget:
        return dict(counts)
    out = {name: c * budget // total for name, c in counts.items()}
    by_remainder = sorted(counts, key=lambda name: (-(counts[name] * budget % total), name))
    for name in by_remainder[: budget - sum(out.values())]:
        out[name] += 1
    return out


def pqi_prune(
    weights: Mapping[str, torch.Tensor],
    masks: Mapping[str, torch.Tensor],
    *,
    p: float = 0.5,
    q: float = 1.0,
    eta_c: float = 0.0,
    gamma: float = 1.0,
    beta: float = 0.9,
    target_sparsity: float = 0.8,
) -> Masks:
    """One sparse-to-sparser event (ALGORITHMS.md 1.9, Algorithm 2); returns new masks.

    Per prunable layer, c_l = ``pqi_prune_count`` of its active weights, and the c_l active
    weights of smallest |w| are pruned (ties: lower flat index). Total sparsity never passes
    s* = ``target_sparsity``: the step may prune at most B = floor(A - (1 - s*) N) weights
    (A active, N prunable entries); if sum c_l > B, every c_l is scaled down proportionally with
    largest-remainder rounding so the step prunes exactly B, landing on s* up to one weight.
    Already at or past s*: nothing changes. New weights are ``apply_masks(weights, new_masks)``.
    """
    total = sum(m.numel() for m in masks.values())
    active = sum(int(m.sum()) for m in masks.values())
    budget = max(0, _floor(active - (1.0 - target_sparsity) * total))
    counts = {
        name: pqi_prune_count(weights[name][mask], p, q, eta_c, gamma, beta)
        for name, mask in masks.items()
    }
    counts = _trim_to_budget(counts, budget)
    out: Masks = {}
    for name, mask in masks.items():
        flat = mask.flatten().clone()
        if counts[name]:
            flat[smallest_active(weights[name].flatten().abs(), flat, counts[name])] = False
        out[name] = flat.view(mask.shape)
    return out
