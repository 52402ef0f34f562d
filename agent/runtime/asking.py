"""When an agent asks its peers again for what has not come.

A model published while its receiver was subscribed and connected reaches it, so a
receiver that asks while the model is only late (its sender still training, or the broker
busy) makes the sender send it twice. In a busy fleet whose agents asked every
`request_every_s`, each late model went out again to every asker, which made the fleet
busier still (32 agents all-to-all: 10-20x the algorithm's traffic). So a receiver asks
only when something was lost:

* the sender's status (or the keeper's tally) says it finished the round, yet its model is
  still not here a look later (`request_every_s`: the model went out before the report of
  it, so it is not merely late);
* its own connection came back (the broker dropped what was queued for it);
* it is back from a restart (resumed from its checkpoint): what its peers published while it
  was gone never reached it, so it asks at once, in the first round it waits in (a peer
  that has not published its model yet answers nothing and publishes it as usual). Before,
  a restarted agent waited out the last resort there, 20 s, and its peers with it;
* with `--wire layers`, a sender it asked for layers announced a round again: it is back
  from a restart, and lost the request sent while it was gone (`wire_layers`);
* or, as a last resort, after FALLBACK_FACTOR x `request_every_s`, then at twice that
  interval each time (a lost status as well as a lost model).

The first and the last wait while awaited models keep arriving: a broker still delivering
is busy, not losing. On the embedded broker, 64 agents all-to-all fan a round's models out
over 30-80 s (133 MB through one Python process); the reports of them came long before,
and every ask sent a model again into the same queue (2,325 re-sends in 6 rounds, 8.3x the
algorithm's traffic, bench/emulate_traffic.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from agent.learning import Need
from protocol.transport import Transport

FALLBACK_FACTOR = 4.0
"""The last-resort ask comes after this many `request_every_s` (20 s by default): longer than
a busy broker delays a model, shorter than the round timeout."""


class Asking:
    """The asks of one wait for (round, sender) needs: `to_ask(missing)` says which now."""

    def __init__(
        self,
        transport: Transport,
        request_every_s: float,
        reported_done: Callable[[int, str], bool],
        returned: bool = False,
    ) -> None:
        self.transport = transport
        self.reported_done = reported_done
        self.returned = returned
        """This agent is back from a restart: its first look comes at once and asks for
        everything missing."""
        self.pause_s = FALLBACK_FACTOR * request_every_s
        self.next_at = time.monotonic() + self.pause_s
        self.connects = transport.connects
        self.asked: set[Need] = set()
        """Needs asked for since the last reconnect or last-resort ask."""
        self.suspect: set[Need] = set()
        """Needs reported done but missing at the last look: asked for if still missing at
        the next (a model and the report of it come by different paths, from its sender and
        from the keeper, so the report may overtake the model by a little)."""
        self.waiting: set[Need] = set()
        """What was missing at the last look."""

    def to_ask(self, missing: set[Need]) -> set[Need]:
        """The missing to ask for now: all of them after a reconnect or at the first look
        after a restart; nothing while awaited models keep arriving (the last resort put
        off); else all of them when the last-resort interval passed (the next is twice as
        long), or those whose sender reported the round done already at the last look, once
        each."""
        now, connects = time.monotonic(), self.transport.connects
        arriving, self.waiting = bool(self.waiting - missing), set(missing)
        if self.returned:
            self.returned = False
            self.asked = set(missing)
            return set(missing)
        if arriving and connects == self.connects:
            self.next_at = max(self.next_at, now + self.pause_s)
            self.suspect = set()  # late, not lost: suspected again only once nothing comes
            return set()
        if connects != self.connects or now >= self.next_at:
            self.connects = connects
            self.pause_s *= 2
            self.next_at = now + self.pause_s
            self.asked = set(missing)
            return set(missing)
        reported = {n for n in missing if n not in self.asked and self.reported_done(*n)}
        lost, self.suspect = reported & self.suspect, reported
        self.asked |= lost
        return lost

    def pause(self, check_every_s: float, deadline: float) -> float:
        """How long to wait before looking again: at most `check_every_s` (a reconnect or a
        status is noticed within it), never past `deadline`; nothing before the first look
        of an agent back from a restart."""
        if self.returned:
            return 0.0
        now = time.monotonic()
        return max(min(check_every_s, self.next_at - now, deadline - now), 0.0)
