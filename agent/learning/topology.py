"""Who talks to whom, and who waits for whom, in a DA-DPFL round (ALGORITHMS.md 1.2-1.3).

Every draw is a pure function of (fleet seed, round, sorted roster, ...) so each agent can
compute everyone's neighbour sets and the round's reuse order without a server. Randomness
comes from SHA-256 rather than a PRNG: a candidate's key is
``sha256(json([purpose, seed, round, sorted roster]) + json(ids))`` with ids = [agent,
candidate] for neighbours and [agent] for the reuse order (``json.dumps`` defaults: ASCII
escapes, ", " and ": " separators), and a draw is "sort candidates by key". Sorting i.i.d.
uniform keys gives a uniform random permutation, and its first M entries a uniform M-subset
without replacement. The result is identical across processes, Python/torch versions and
platforms (no ``hash()``, no library PRNG whose algorithm could change), and is easy to
reproduce on an agent written in another language.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

Topology = Literal["random", "ring", "full"]
TOPOLOGIES: tuple[str, ...] = typing.get_args(Topology)


def _canonical_roster(roster: Sequence[str]) -> list[str]:
    ordered = sorted(roster)
    if len(set(ordered)) != len(ordered):
        raise ValueError("roster has duplicate agent ids")
    return ordered


def _keyer(purpose: str, seed: int, round_: int, roster: list[str]) -> Callable[..., bytes]:
    """ids -> sha256(json([purpose, seed, round, roster]) + json([*ids])), prefix hashed once."""
    prefix = hashlib.sha256(json.dumps([purpose, seed, round_, roster]).encode())

    def key(*ids: str) -> bytes:
        h = prefix.copy()
        h.update(json.dumps(list(ids)).encode())
        return h.digest()

    return key


class NeighbourDraw:
    """Round t's random neighbour draws for any agent of one roster, each the `neighbours`
    of the module's definition, byte for byte. A draw hashes every other agent (the m
    smallest keys of K - 1), so drawing everyone's is K^2 hashes a round: what it shares
    across agents is done once here (the sorted roster, the hashed prefix, each id's JSON),
    and a key costs one hash state copied and finished, not a JSON encoding (at 1,000
    agents, 0.27 against 1.8 microseconds of CPU a key: bench/dadpfl_scale.py)."""

    def __init__(self, seed: int, round_: int, roster: Sequence[str]):
        self.ordered = _canonical_roster(roster)
        self._prefix = hashlib.sha256(
            json.dumps(["neighbours", seed, round_, self.ordered]).encode()
        )
        # json.dumps([a, j]) is '[' + json(a) + ', ' + json(j) + ']' (default separators)
        self._ids = {a: json.dumps(a) for a in self.ordered}
        self._tails = [(self._ids[j] + "]").encode() for j in self.ordered]

    def __call__(self, agent: str, m: int) -> list[str]:
        """`agent`'s m neighbours, sorted by id; ValueError for one not in the roster."""
        if agent not in self._ids:
            raise ValueError(f"{agent!r} is not in the roster")
        if not 0 <= m <= len(self.ordered) - 1:
            raise ValueError(
                f"m={m} must be in [0, {len(self.ordered) - 1}] for a roster of {len(self.ordered)}"
            )
        head = self._prefix.copy()
        head.update(("[" + self._ids[agent] + ", ").encode())
        copy = head.copy
        keys = []
        for tail in self._tails:
            h = copy()
            h.update(tail)
            keys.append(h.digest())
        me = self.ordered.index(agent)
        candidates = [i for i in range(len(self.ordered)) if i != me]
        # nsmallest is sorted(...)[:m], ties in roster order: the definition's stable sort
        return sorted(self.ordered[i] for i in heapq.nsmallest(m, candidates, keys.__getitem__))


def neighbours(
    seed: int,
    round_: int,
    roster: Sequence[str],
    agent: str,
    m: int,
    topology: Topology = "random",
) -> list[str]:
    """The neighbour set G_k^t of ``agent`` in round ``round_``, sorted by id (1.2).

    * ``random``: m agents drawn uniformly without replacement from the others, directed
      (j in G_k does not imply k in G_j), redrawn every round.
    * ``ring``: on the sorted roster as a cycle, the ceil(m/2) next agents and the floor(m/2)
      previous ones (m = 2: previous and next), so |G_k| = m for every m <= K - 1. Static.
    * ``full``: every other agent; m is ignored.

    Raises ValueError for an agent not in the roster, duplicate ids, an unknown topology, or
    m outside [0, K - 1] (random, ring).
    """
    ordered = _canonical_roster(roster)
    if agent not in ordered:
        raise ValueError(f"{agent!r} is not in the roster")
    others = [a for a in ordered if a != agent]
    if topology == "full":
        return others
    if not 0 <= m <= len(others):
        raise ValueError(f"m={m} must be in [0, {len(others)}] for a roster of {len(ordered)}")
    if topology == "random":
        return NeighbourDraw(seed, round_, ordered)(agent, m)
    if topology == "ring":
        i, n = ordered.index(agent), len(ordered)
        offsets = [*range(1, (m + 1) // 2 + 1), *range(-(m // 2), 0)]
        return sorted(ordered[(i + o) % n] for o in offsets)
    raise ValueError(f"unknown topology {topology!r}")


def everyone_neighbours(
    seed: int, round_: int, roster: Sequence[str], m: int, topology: Topology = "random"
) -> dict[str, list[str]]:
    """``neighbours`` for every agent of the roster, keyed in sorted-id order."""
    return {k: neighbours(seed, round_, roster, k, m, topology) for k in sorted(roster)}


def reuse_order(seed: int, round_: int, roster: Sequence[str]) -> list[str]:
    """The round's reuse order: a uniform random permutation of the roster (1.3).

    Drawn independently of the neighbour sets (its own key purpose), never the agent index
    order, which would let low indices always go first.
    """
    ordered = _canonical_roster(roster)
    return sorted(ordered, key=_keyer("reuse", seed, round_, ordered))


def prior_posterior(
    order: Sequence[str] | Mapping[str, int],
    neighbours_of_k: Sequence[str],
    k: str,
    max_wait: int,
) -> tuple[list[str], list[str]]:
    """Split k's neighbours into (prior, posterior), each in reuse order (1.3).

    Prior: the ``max_wait`` (N) neighbours that come earliest in the reuse order among those
    earlier than k; k waits for their round-t models. Posterior: every other neighbour, i.e.
    the later ones plus any earlier ones beyond the cap; k does not wait for them and uses
    their round t-1 model. Use the round t-1 model for posterior neighbours even when a
    fresher one has already arrived (an earlier neighbour beyond the cap may well have finished),
    so network timing cannot change the result and the in-process simulator, which runs agents
    in reuse order, reproduces a networked run exactly.

    N = 0: no prior set, every agent starts at once (DisPFL-like). N >= M: the cap never binds
    and k waits for all its earlier neighbours (the paper's uncapped rule); with the full
    topology that makes the round sequential. Prior sets only contain agents earlier in one
    permutation, so the waits form a DAG: no cycles, and processing in reuse order always
    has every prior model ready. `order` may be given as each agent's place in it
    (`positions`), which a caller splitting every agent's neighbours makes once.
    """
    if max_wait < 0:
        raise ValueError("max_wait must be >= 0")
    position = order if isinstance(order, Mapping) else positions(order)
    missing = [a for a in (k, *neighbours_of_k) if a not in position]
    if missing:
        raise ValueError(f"not in the reuse order: {missing}")
    ranked = sorted(neighbours_of_k, key=position.__getitem__)
    earlier = [j for j in ranked if position[j] < position[k]]
    prior = earlier[:max_wait]
    return prior, [j for j in ranked if j not in prior]


def positions(order: Sequence[str]) -> dict[str, int]:
    """Each agent's place in a reuse order."""
    return {a: i for i, a in enumerate(order)}
