"""The FedAdam family under secure aggregation (`--secure-aggregation`): what a device masks
and what the coordinator makes of the unmasked sum (the masking is `protocol.secagg`'s).

A device masks one vector: its deltas of the weights, the first and the second moment
(`fedadam.moment_deltas`, 0 outside a top-k mask), concatenated in payload order
(`fedadam.moment_layout`: every w:, then every m:, then every v:). The family's plain rule
is the weighted mean of the zero-filled deltas over every participant, a 0 counting where a
device did not select an entry (`adam.aggregate_deltas`), so the secure sum's survivor mean
is that rule as it is: the coordinator hands the mean deltas to the strategy as the round's
one upload, and its server step and broadcast run unchanged.

The fixed-point range (`protocol.secagg`: a weighted entry within CLIP_RANGE = 8, steps of
2^-27) suits the weight and first-moment deltas (at most ~0.14 and ~0.06 on mnist1d and
digits, 4 devices, seed 3). Second-moment deltas are smaller by two to three orders (median
~3e-6, largest ~1e-3) and V enters the local step under a square root beside eps = 1e-6, so
they are masked scaled by `SECOND_MOMENT_SCALE` = 64: a device's dv then fits up to 0.125 /
a_u (its share a_u of the round's weight; 125 times the largest seen), and the mean's
quantization error is at most |U3| * 5.8e-11, under 0.3% of eps at 50 devices. An entry
beyond the range is clipped and counted in the device's log (`protocol.secagg.Client`).

FedAdam-Top and -SSM mask over the union of the devices' top-k masks (`union`), agreed
before masking: every device sends its masks (a `Support` message) and masks its deltas
over the union the coordinator sends back, so the masked vector is as long as the union,
not the model (`agent.learning.central.secure`).
"""

from __future__ import annotations

import numpy as np
import torch

from agent.learning.central.base import Payload, Upload
from agent.learning.central.fedadam import moment_deltas, moment_layout
from agent.learning.model_facts import ModelFacts

SECOND_MOMENT_SCALE = 64.0
"""What a second-moment delta is multiplied by before it is masked (a power of two: exact)."""


def _scales(names: list[str], facts: ModelFacts) -> np.ndarray:
    """Per entry of the masked vector, its block's scale (V's entries `SECOND_MOMENT_SCALE`)."""
    layout = moment_layout(facts)
    parts = [
        np.full(
            int(np.prod(layout[n][0], dtype=np.int64)),
            SECOND_MOMENT_SCALE if n.startswith("v:") else 1.0,
        )
        for n in names
    ]
    return np.concatenate(parts) if parts else np.zeros(0)


def moment_vector(names: list[str], facts: ModelFacts, upload: Payload) -> np.ndarray:
    """A device's upload as the vector it masks (before any union): its three zero-filled
    deltas, flattened in `names`' order, V's scaled."""
    dw, dm, dv = moment_deltas(upload)
    blocks = {"w": dw, "m": dm, "v": dv}
    parts = [blocks[n[0]][n[2:]].double().flatten().numpy() for n in names]
    flat = np.concatenate(parts) if parts else np.zeros(0)
    scaled: np.ndarray = flat * _scales(names, facts)
    return scaled


def moment_support(names: list[str], upload: Payload) -> np.ndarray:
    """The entries a device's upload covers, over the whole vector: its top-k masks (under
    SSM w's mask covers m and v too), every entry where it sends a delta dense."""
    masks = upload.masks or {}
    parts = []
    for n in names:
        mask = masks.get(n, masks.get(f"w:{n[2:]}"))
        if mask is None:
            mask = torch.ones(upload.weights[f"w:{n[2:]}"].shape, dtype=torch.bool)
        parts.append(mask.flatten().numpy())
    return np.concatenate(parts) if parts else np.zeros(0, dtype=bool)


def moment_upload(names: list[str], facts: ModelFacts, mean: np.ndarray, weight: int) -> Upload:
    """The round's one upload from the survivors' mean vector (scaled as `moment_vector`
    scales it): their mean deltas as a dense moment payload, with their total weight."""
    layout = moment_layout(facts)
    flat = mean / _scales(names, facts)
    out = {}
    at = 0
    for n in names:
        shape, dtype = layout[n]
        size = int(np.prod(shape, dtype=np.int64))
        out[n] = torch.from_numpy(flat[at : at + size].copy()).view(shape).to(dtype)
        at += size
    if at != mean.size:
        raise ValueError(f"the secure sum has {mean.size} values; the moments {at}")
    return Upload(Payload(out), weight)
