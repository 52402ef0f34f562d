"""Asynchronous decentralized rounds (`--asynchronous`): which model of each neighbour a round
takes, and how much it counts.

A synchronous round t of agent k aggregates this round's models of its prior neighbours and
last round's of the others (`rounds.RoundTopology.needs`: (t_sync, j) pairs). An asynchronous
one never waits: for each such (t_sync, j) it takes the newest model of j it holds from a
round t' <= t_sync, `t_sync - t'` rounds stale, weighted by `staleness.staleness_weight`
where sample weights would enter (eq. 7 weighted, `sparse.aggregate_weighted_masked`); one
more than `--max-staleness` rounds stale is ignored, and with none left the agent trains on
its own. Pure: the caller (the simulator's virtual clock, the agent's inbox) says what is
held, so the simulator and the networked agent choose alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from agent.learning.staleness import fresh_enough, staleness_weight

ASYNCHRONOUS_STRATEGIES = ("dadpfl", "dispfl", "dfedavgm")
"""The strategies that run `--asynchronous`: the decentralized ones whose agents aggregate
their neighbours' models (local shares none; the centralized ones have FedBuff)."""

Need = tuple[int, str]
"""(round, sender): a model a synchronous round would aggregate (`rounds.Need`)."""
Newest = Callable[[str, int], int | None]
"""The newest round <= the given one of which the sender's model is held; None: none."""


@dataclass(frozen=True)
class Taken:
    """The model of one neighbour a round takes: its round, staleness and weight."""

    round: int
    staleness: int
    weight: float


@dataclass(frozen=True)
class Freshest:
    """What an asynchronous round takes of its neighbours, and whom it leaves out."""

    taken: dict[str, Taken]
    """Sender -> the model taken."""
    ignored: list[str]
    """Senders whose newest model held is more than max_staleness rounds stale (or absent)."""

    @property
    def weights(self) -> dict[str, float] | None:
        """Each sender's staleness weight for the aggregate; None when every one is 1 (eq. 7
        or the mean as a synchronous round takes them, bit for bit)."""
        if all(t.weight == 1.0 for t in self.taken.values()):
            return None
        return {j: t.weight for j, t in self.taken.items()}

    @property
    def staleness(self) -> float | None:
        """The mean staleness of the models taken (the round record's `staleness`); None when
        the round took none."""
        if not self.taken:
            return None
        return sum(t.staleness for t in self.taken.values()) / len(self.taken)


def freshest(needs: Iterable[Need], newest: Newest, max_staleness: int, rule: str) -> Freshest:
    """For each (t_sync, j) of a synchronous round's needs, the newest model of j held from a
    round <= t_sync (`newest`), its staleness t_sync - t' and weight under `rule`, unless it
    is more than `max_staleness` rounds stale."""
    taken: dict[str, Taken] = {}
    ignored: list[str] = []
    for round_, sender in sorted(needs):
        held = newest(sender, round_)
        if held is None or not fresh_enough(round_ - held, max_staleness):
            ignored.append(sender)
            continue
        stale = round_ - held
        taken[sender] = Taken(held, stale, staleness_weight(stale, rule))
    return Freshest(taken, ignored)
