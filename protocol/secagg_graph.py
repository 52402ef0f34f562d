"""SecAgg+'s neighbour graph (Bell et al., CCS 2020): who masks with and shares secrets to
whom in a round of secure aggregation (`protocol.secagg`).

All-to-all SecAgg costs O(n^2) a round (every member masks with and Shamir-shares to every
other). SecAgg+ puts the round's members on a random k-regular graph and keeps both among
neighbours: O(n k) a round. The graph is a Harary graph H(k, n) (a ring on which each member
is joined to the k/2 nearest on each side: k-regular and k-connected) over a random
permutation of the members, as Flower's SecAgg+ builds it. The permutation is seeded from
the round's context and its members (U1), so that every member and the coordinator derive
the same graph from the key list without a message more; it orders members by SHA-256, not
numpy's generators, whose streams may differ between the versions devices run.

k and the threshold t (shares of a member's closed neighbourhood, k + 1 holders with
itself, that rebuild its secrets) are the smallest that keep each of three failures below
FAILURE = 2^-20 a round, by exact hypergeometric tails and union bounds over the members
(`degree_and_threshold`), with DROPOUT = 30% of the members dropping and CORRUPT = 20%
colluding with the coordinator, both independent of the graph:

    reconstruction  some member has fewer than t of its k + 1 left: the round fails
    privacy         some honest member has t or more corrupt neighbours: its secrets leak
    connectivity    the graph without the dropped and corrupt members splits: the sum of a
                    part leaks (a ring lattice splits only where two runs of k/2 consecutive
                    members are gone: at most n^2/2 (gone / n)^k)

t is moreover a majority of the neighbourhood, so that a coordinator that tells some
neighbours a member uploaded and others it dropped gets t shares of at most one of its two
secrets. Where no k below n - 1 meets the bounds (fleets under about 40 members) the graph
is complete and t is all-to-all's max(n/2 + 1, 0.7 n): the same protocol, the same code.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from math import comb

DROPOUT = 0.3
"""The share of a round's members that may drop at any step while the round completes."""
CORRUPT = 0.2
"""The share of a round's members that may collude with the coordinator."""
FAILURE = 2.0**-20
"""The largest probability of each failure a round (reconstruction, privacy, connectivity)."""


def complete_threshold(members: int) -> int:
    """All-to-all's threshold: a majority, and at most 70% of the members, so that the
    round survives any DROPOUT of them dropping."""
    return max(members // 2 + 1, (7 * members) // 10, 1)


def _tail(population: int, marked: int, drawn: int, at_least: int) -> float:
    """P[X >= at_least] for X hypergeometric: `drawn` of `population`, `marked` marked."""
    top = min(marked, drawn)
    if at_least > top:
        return 0.0
    ways = sum(
        comb(marked, x) * comb(population - marked, drawn - x) for x in range(at_least, top + 1)
    )
    return ways / comb(population, drawn)


def _meets(members: int, k: int, t: int) -> bool:
    dropped, corrupt = int(DROPOUT * members), int(CORRUPT * members)
    gone = (dropped + corrupt) / members
    return (
        members * _tail(members, dropped, k + 1, k + 2 - t) <= FAILURE
        and members * _tail(members - 1, corrupt, k, t) <= FAILURE
        and members * members / 2 * gone**k <= FAILURE
    )


@functools.lru_cache(maxsize=64)
def degree_and_threshold(members: int) -> tuple[int, int]:
    """The graph's degree k and the threshold t for a round of `members` (see above)."""
    for k in range(2, members - 1, 2):
        for t in range((k + 1) // 2 + 1, k + 2):
            if _meets(members, k, t):
                return k, t
            if members * _tail(members, int(DROPOUT * members), k + 1, k + 2 - t) > FAILURE:
                break  # a larger t only rebuilds less often
    return members - 1, complete_threshold(members)


def _order(seed: bytes, members: Sequence[str]) -> list[str]:
    return sorted(members, key=lambda m: hashlib.sha256(seed + m.encode()).digest())


def neighbourhoods(seed: bytes, members: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """Each member's closed neighbourhood (itself and its k neighbours, sorted) in the
    round's graph, from the round's `seed` and its members."""
    ordered = _order(seed, sorted(set(members)))
    n = len(ordered)
    k, _ = degree_and_threshold(n)
    if k >= n - 1:
        return dict.fromkeys(ordered, tuple(sorted(ordered)))
    half = k // 2
    return {
        m: tuple(sorted(ordered[(i + d) % n] for d in range(-half, half + 1)))
        for i, m in enumerate(ordered)
    }
