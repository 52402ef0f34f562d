"""The networked side of asynchronous decentralized rounds (`--asynchronous`): what an agent
that never waits takes of its inbox, and which models it listens for.

The choice is `agent.learning.asynchronous.freshest`'s, as in the simulator: for each model
its synchronous round would aggregate, the newest one of that neighbour the inbox holds from
a round no later, within `--max-staleness` rounds, weighted by its staleness. Nothing waits:
a neighbour that is behind (slow, asleep, stopped by a signal, gone) counts with the last
model of it that came, or not at all. A neighbour that is behind publishes its rounds late,
so the agent listens for each needed neighbour's models of the `--max-staleness` rounds
before too (`stale_window`): up to that many more subscriptions per neighbour, and the
models of a neighbour that is behind come in as it publishes them.
"""

from __future__ import annotations

from agent.learning import Need, Published
from agent.learning.asynchronous import Freshest, freshest
from agent.runtime.session import Session


def stale_window(needs: set[Need], max_staleness: int) -> set[Need]:
    """The (round, sender)s worth listening for to meet `needs` asynchronously: each need's
    sender's models of that round and of the `max_staleness` rounds before it (round 0's
    being derived, never sent)."""
    return {
        (round_ - back, sender)
        for round_, sender in needs
        for back in range(max_staleness + 1)
        if round_ - back >= 1
    }


def freshest_held(session: Session, needs: set[Need]) -> tuple[dict[str, Published], Freshest]:
    """The round's inbox (sender -> the model taken) and what was taken of whom, from what
    the agent holds now. A neighbour's round-0 model, derived, counts while it is within
    `--max-staleness` rounds of the round that needs it."""
    cfg, inbox = session.cfg, session.inbox
    for round_, sender in needs:
        if round_ <= cfg.max_staleness:
            inbox.put_model(0, sender, session.round0_model(sender))
    held: dict[tuple[int, str], Published] = {}

    def newest(sender: str, up_to: int) -> int | None:
        found = inbox.latest(sender, up_to)
        if found is None:
            return None
        held[(found[0], sender)] = found[1]
        return found[0]

    chosen = freshest(needs, newest, cfg.max_staleness, cfg.staleness_weight)
    models = {j: held[(taken.round, j)] for j, taken in chosen.taken.items()}
    return models, chosen
