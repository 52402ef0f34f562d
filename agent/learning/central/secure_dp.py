"""Client-level DP under secure aggregation (`--dp client --secure-aggregation`): distributed
DP (Kairouz et al. 2021; Flower's SecAgg+ with client-side noise). The coordinator sees only
the masked sum, so the noise it would add (`client_dp.noised_sum`) moves to the devices.

Each device clips its update to C (`client_dp.clipped_fit`, as under `--dp client` alone)
and adds its share of the noise to it before it is weighted, quantized and masked
(`private_change`). Every member advertises weight 1, so the secure sum is the unweighted
mean of DP-FedAvg: the masked vector is the noised change over |U1| (a public constant
that keeps the sum within the fixed-point range, `protocol.secagg`), and the coordinator
rescales the sum to the mean over the survivors U3.

Dropouts take their share of the noise with them. Each share is sized for the fewest
survivors a round may release (`survivors_floor`: 70% of U1, the dropout the secure round
is built to survive): N(0, sigma^2 C^2 / ceil(0.7 |U1|)), so any sum over at least that many
members carries at least the N(0, sigma^2 C^2) the accountant counts
(`privacy.Accountant.of_rounds`, unchanged), and no device reveals its secrets for a sum of
fewer (`secure_rounds`), which the coordinator refuses too (`coordinator.secure_sum`). The
price: with nobody dropping the noise's std is sqrt(1 / 0.7) = 1.2 times the plain run's.

A networked device draws its share from the operating system's randomness (the generator
its round driver passes in), so nobody, the coordinator included, can draw it again and
subtract it: the fleet seed is the coordinator's. Simulate, and a lab run given
`--dp-seeded-noise`, draw it from the run's seeded generator (fleet seed, agent, round)
instead, so an emulated run reproduces a simulated one.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from agent.learning.central.base import Payload, ServerState
from agent.learning.central.client_dp import noise_share
from agent.learning.central.secure import flat_change
from agent.learning.config import DP_CLIENT, StrategyConfig
from agent.learning.model_facts import ModelFacts

SHARE_PURPOSE = "client-dp-share"
"""A device's noise share is seeded by (fleet seed, this, agent, round)."""
SURVIVING = 0.7
"""The share of U1 a released sum must hold (1 - `protocol.secagg_graph.DROPOUT`)."""


def distributed(config: StrategyConfig) -> bool:
    """Whether the devices add the noise: `--dp client` under `--secure-aggregation`."""
    return config.dp == DP_CLIENT and config.secure_aggregation


def survivors_floor(members: int) -> int:
    """The fewest survivors of a round of `members` (U1) whose sum carries the full noise."""
    return max(math.ceil(SURVIVING * members - 1e-9), 1)


def effective_noise(noise: float, members: int, survivors: int) -> float:
    """The noise multiplier actually in a sum of `survivors` shares, each sized for
    `survivors_floor(members)`: sigma * sqrt(survivors / floor); at least sigma when the
    round may be released."""
    return noise * math.sqrt(survivors / survivors_floor(members))


def private_change(
    facts: ModelFacts,
    names: list[str],
    upload: Payload,
    view: ServerState,
    agent: str,
    round_: int,
    members: int,
    generator: torch.Generator | None = None,
) -> np.ndarray:
    """A device's clipped change (`secure.flat_change`) plus its noise share for a round of
    `members`, N(0, sigma^2 C^2 / survivors_floor(members)) per entry, drawn from
    `generator` (a device's secret one), else from (fleet seed, agent, round)."""
    config = facts.config
    like = {n: upload.weights[n] for n in names}
    if generator is None:
        generator = facts.generator(SHARE_PURPOSE, agent, round_)
    share = noise_share(like, config.dp_noise, config.dp_clip, survivors_floor(members), generator)
    parts = [share[n].double().flatten().numpy() for n in names]
    noise: np.ndarray = np.concatenate(parts) if parts else np.zeros(0)
    change: np.ndarray = flat_change(names, upload, view) + noise
    return change
