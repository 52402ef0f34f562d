"""RigL (ALGORITHMS.md 1.6): drop the smallest active weights, regrow where the dense
gradient is largest.

Masks are same-shape bool tensors of any layout: conv kernels (depthwise (C, 1, k, k)
included), linear and recurrent matrices (gates x hidden, input) are all ranked over their
flattened entries, layer by layer, so nothing here depends on what a dimension means.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from agent.learning.sparse import Masks, _ceil, smallest_active, sparsity


def rigl_alpha(t: int, total_rounds: int, a: float = 0.3) -> float:
    """Cosine-annealed drop fraction alpha_t = (a/2)(1 + cos(pi t / T)) (1.6)."""
    if total_rounds <= 0:
        raise ValueError("total_rounds must be positive")
    return a / 2 * (1 + math.cos(math.pi * t / total_rounds))


def prune_to_density(
    weights: Mapping[str, torch.Tensor], masks: Mapping[str, torch.Tensor], density: float
) -> Masks:
    """Masks at (about) `density` overall: each layer keeps round(kept_l x density / current)
    of its largest-magnitude active weights, so layers shrink in proportion.

    How a device whose budget p_k caps its density gets there (DESIGN.md, resource budget);
    a no-op when the masks are already at or below `density`.
    """
    current = 1.0 - sparsity(masks)
    if current <= density:
        return {name: mask.clone() for name, mask in masks.items()}
    ratio = density / current
    pruned = {}
    for name, mask in masks.items():
        kept = int(mask.sum())
        drop = kept - max(1, round(kept * ratio)) if kept else 0
        flat = mask.flatten().clone()
        magnitude = weights[name].detach().abs().flatten()
        flat[smallest_active(magnitude, flat, drop)] = False
        pruned[name] = flat.view_as(mask)
    return pruned


def rigl_update(
    weights: Mapping[str, torch.Tensor],
    masks: Mapping[str, torch.Tensor],
    dense_grads: Mapping[str, torch.Tensor],
    alpha: float,
) -> Masks:
    """One RigL drop-and-regrow step per prunable layer (ALGORITHMS.md 1.6); returns new masks.

    With n active weights in a layer: drop the ceil(alpha n) active weights of smallest |w| and
    regrow as many previously inactive positions with the largest |dense gradient|; positions
    dropped in this step are not eligible, so the layer's count is unchanged. When fewer than
    ceil(alpha n) inactive positions exist, only as many are dropped as can be regrown.
    Ties go to the lower flat index on both sides.

    New weights are ``apply_masks(weights, new_masks)``: dropped positions become 0 and regrown
    ones start at 0 because the input weights are exactly 0 outside the old mask (the stored
    model is always masked, 1.5-1.6).
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    out: Masks = {}
    for name, mask in masks.items():
        active = mask.flatten()
        n_active = int(active.sum())
        k = min(_ceil(alpha * n_active), active.numel() - n_active)
        new = active.clone()
        if k > 0:
            new[smallest_active(weights[name].flatten().abs(), active, k)] = False
            grow = torch.where(active, -math.inf, dense_grads[name].flatten().abs().double())
            new[torch.sort(grow, descending=True, stable=True).indices[:k]] = True
        out[name] = new.view(mask.shape)
    return out
