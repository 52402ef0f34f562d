"""Sparse deltas on the wire (`--wire delta`, ALGORITHMS.md 3's last paragraph): what a
DA-DPFL agent sends instead of its full sparse model, and how a receiver rebuilds it.

Receivers do not hold a sender's true model but its *reconstruction*: the model as rebuilt
from what it sent. The sender keeps the same reconstruction and each round sends the top-k
entries of (its model - the reconstruction) over the entries its new mask keeps, plus the
mask positions that changed (RigL, pruning). Whatever is not sent stays in the difference and
goes out in a later round, so the error never accumulates (error feedback by construction).
Every agent follows every peer's deltas (one publish still reaches all of them), so it always
holds the base the next delta applies to; one that lacks it asks for a full model.

Both sides compute the reconstruction with `apply_delta` from the zero-filled payload, so
they agree bit for bit (with fp16 the values are rounded before, not after).
"""

from __future__ import annotations

import torch

from agent.learning.learner import Published
from agent.learning.sparse import Masks, State


def encode_delta(
    model: Published, base: Published, fraction: float, *, fp16: bool = False
) -> tuple[State, Masks, Published]:
    """The payload (zero-filled values and their masks) that moves the receivers' copy of a
    sender from `base` towards `model`, and the reconstruction they will hold after it.

    Candidates are the entries `model` keeps (every entry of an unmasked tensor); the
    max(1, round(fraction x candidates)) largest |model - base| among them are sent, ties
    broken by position. The flips of a masked tensor carry its new mask where it differs
    from the base's.
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"the delta fraction must be in (0, 1], got {fraction}")
    masks = model.masks or {}
    names = list(model.weights)
    diffs = {n: model.weights[n] - base.weights[n] for n in names}
    kept = {
        n: masks[n] if n in masks else torch.ones_like(diffs[n], dtype=torch.bool) for n in names
    }
    magnitude = torch.cat([torch.where(kept[n], diffs[n].abs(), -1.0).flatten() for n in names])
    candidates = int(sum(int(kept[n].sum()) for n in names))
    count = max(1, round(fraction * candidates))
    chosen = torch.zeros(magnitude.numel(), dtype=torch.bool)
    chosen[torch.argsort(magnitude, descending=True, stable=True)[:count]] = True
    payload: State = {}
    payload_masks: Masks = {}
    offset = 0
    for n in names:
        size = diffs[n].numel()
        selected = chosen[offset : offset + size].view_as(diffs[n]) & kept[n]
        offset += size
        values = torch.where(selected, diffs[n], torch.zeros((), dtype=diffs[n].dtype))
        if fp16:
            values = values.half().to(diffs[n].dtype)
        payload[n], payload_masks[n] = values, selected
    base_masks = base.masks or {}
    for n, mask in masks.items():
        payload[f"{FLIP}{n}"] = mask.clone()
        payload_masks[f"{FLIP}{n}"] = mask != base_masks[n] if n in base_masks else mask
    return payload, payload_masks, apply_delta(base, payload, payload_masks, model.num_samples)


def apply_delta(base: Published, payload: State, masks: Masks, num_samples: int) -> Published:
    """The reconstruction after `payload` (zero-filled values, flips at their masks)."""
    new_masks: Masks = {}
    for n, old in (base.masks or {}).items():
        flips = payload[f"{FLIP}{n}"]
        new_masks[n] = torch.where(masks.get(f"{FLIP}{n}", torch.ones_like(flips)), flips, old)
    weights = {}
    for n, t in base.weights.items():
        updated = t + payload[n]
        weights[n] = updated * new_masks[n] if n in new_masks else updated
    return Published(weights, new_masks or None, num_samples)


FLIP = "flip:"
"""Prefix of the bool tensors of a delta message carrying a tensor's mask where it changed."""
