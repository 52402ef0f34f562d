"""How much a late model or update counts: the staleness weights of asynchronous rounds.

A model (asynchronous decentralized rounds) or an update (FedBuff) is `s` rounds stale when it
was trained from, or published at, a round `s` rounds behind the one that takes it in. Its
weight in the aggregate is the product of its usual weight (samples, masks) and
`staleness_weight(s, rule)`; one older than `--max-staleness` rounds is not taken at all.

The rules are FedAsync's (Xie et al., 2019, section 5.2) with its defaults; `polynomial` with
a = 0.5 is the 1/sqrt(1 + s) FedBuff uses (Nguyen et al., 2022). Torch-free: plain numbers,
so the config, the aggregator and the simulator share them without loading torch.
"""

from __future__ import annotations

import math

STALENESS_WEIGHTS = ("polynomial", "constant", "hinge")
"""The rules `--staleness-weight` chooses among; the first is the default."""

POLYNOMIAL_A = 0.5
"""`polynomial`: (1 + s)^-a."""
HINGE_A, HINGE_B = 10.0, 4
"""`hinge`: 1 up to b rounds stale, then 1 / (a (s - b) + 1)."""


def staleness_weight(staleness: int, rule: str = STALENESS_WEIGHTS[0]) -> float:
    """The weight in (0, 1] of a model or update `staleness` rounds stale under `rule`;
    ValueError for a negative staleness or an unknown rule."""
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    if rule == "constant":
        return 1.0
    if rule == "polynomial":
        return math.pow(1.0 + staleness, -POLYNOMIAL_A)
    if rule == "hinge":
        return 1.0 if staleness <= HINGE_B else 1.0 / (HINGE_A * (staleness - HINGE_B) + 1.0)
    raise ValueError(f"unknown staleness weight {rule!r}; known: {', '.join(STALENESS_WEIGHTS)}")


def fresh_enough(staleness: int, max_staleness: int) -> bool:
    """Whether a model or update `staleness` rounds stale is taken at all (bounded staleness:
    `max_staleness` rounds at most)."""
    return 0 <= staleness <= max_staleness
