"""DFedAvgM (Sun et al. 2022): dense models averaged over the neighbours, local SGD with
momentum 0.9 (its preset fixes it, and N = 0)."""

from __future__ import annotations

from agent.learning.decentral.base import DecentralizedStrategy


class DFedAvgM(DecentralizedStrategy):
    """dfedavgm: the dense round as it is (`DecentralizedStrategy`)."""

    name = "dfedavgm"
