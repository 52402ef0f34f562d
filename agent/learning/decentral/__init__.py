"""Decentralized strategies as small objects, a file per family, beside the centralized
ones (`agent.learning.central`); `base.DecentralizedStrategy` is the contract (a round's
first mask, aggregate, training, step after training and what it publishes):

    dadpfl     sparse, mask-based aggregation, RigL, further PQI pruning at the voted times
    dispfl     sparse, mask-based aggregation, RigL
    dfedavgm   dense, neighbour averaging
    local      dense, no communication

The table of strategies (`agent.learning.strategies`) names each one's class and its traits.
"""

from __future__ import annotations

from agent.learning.decentral.base import DecentralizedStrategy, MaskStep, RoundStart, Trained

__all__ = ["DecentralizedStrategy", "MaskStep", "RoundStart", "Trained"]
