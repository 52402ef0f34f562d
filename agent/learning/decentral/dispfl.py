"""DisPFL (Dai et al. 2022): each agent trains a sparse personal model under its own mask,
aggregated by masks (eq. 7) and moved by RigL; no agent waits (its preset fixes N = 0) and
none prunes further."""

from __future__ import annotations

from agent.learning.decentral.sparse import SparseStrategy


class DisPFL(SparseStrategy):
    """dispfl: the sparse round as it is (`SparseStrategy`)."""

    name = "dispfl"
