"""A FedBuff participant's updates under secure aggregation (`--strategy fedbuff
--secure-aggregation`), over the transport: each update joins a cohort, whose secure steps
(`agent.runtime.secure_rounds.SecureSteps`, the cohort's number as the round's) carry it
masked to the aggregator (`coordinator.buffered_secure`). The math is
`agent.learning.central.secure_buffer`'s. An update trained from version b:

    join     the open cohort c, the version after the newest this agent holds: its keys
             for round c, with b (`Keys.base_version`); the aggregator closes the cohort
             once K devices advertised and sends their key list
    again    a cohort that went on without it (its key list leaves this agent out, or its
             version is out) is followed by the next, the update a version staler; past
             `--max-staleness` the update is dropped, as the plain buffer drops it
    mask     listed: w(c - 1 - b) (y - x_b) masked, and the steps after it
    wait     for version c (the cohort's), so that the next update trains from it

An update whose cohort never sends a key list within the patience (the aggregator is gone),
or that is ready once the last version (`--rounds`) is out, is given up; the round driver
then ends the run as a plain update's does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from agent.learning import Payload, ServerState
from agent.learning.central import CentralStrategy
from agent.learning.central.secure import summed_names
from agent.learning.central.secure_buffer import MEMBER_WEIGHT, member_change
from agent.learning.staleness import fresh_enough
from agent.runtime.secure_rounds import SecureSteps, Vector

if TYPE_CHECKING:
    from agent.runtime.session import Session

log = logging.getLogger(__name__)


def _fixed(change: np.ndarray) -> Vector:
    """A member's vector to mask: its staleness-weighted change whatever the cohort's size
    (a member's weight is 1: the coordinator divides the sum by the survivors)."""
    return lambda _members: change


@dataclass(frozen=True)
class Joined:
    """What became of one update under secure aggregation."""

    cohort: int
    """The cohort (the version) it went into, or the last it tried (dropped past
    `--max-staleness`, or no key list came)."""
    staleness: int
    """Versions the server moved on since its base when that cohort applied."""
    sent: int = 0
    """Values its masked upload carried (0: no cohort took it)."""


class SecureCohorts:
    """One participant's masked FedBuff updates, for every cohort of its run."""

    def __init__(
        self,
        session: Session,
        aggregator: str,
        patience_s: float,
        held: Callable[[], int],
        arrived: threading.Condition,
    ) -> None:
        """`held`: the newest version this agent holds (decoding one that just came);
        `arrived`: notified when a newer version comes."""
        self.session = session
        self.held = held
        self.arrived = arrived
        self.patience_s = patience_s
        self.steps = SecureSteps(session, aggregator, patience_s, closed=self._closed)

    def subscribe(self) -> None:
        self.steps.subscribe()

    def _closed(self, cohort: int) -> bool:
        """Whether `cohort` is over: its version (or a newer one) is out."""
        return self.held() >= cohort

    def upload(
        self, strategy: CentralStrategy, base: int, view: ServerState, upload: Payload
    ) -> Joined:
        """Carry `upload` (trained from version `base`, whose model is `view`) into a
        cohort, and wait for that cohort's version."""
        s = self.session
        cfg = s.cfg
        names = summed_names(strategy, s.learner.facts)
        cohort = max(self.held(), base) + 1
        while not s.stop.is_set() and cohort <= cfg.rounds:  # no cohort after the last version
            staleness = cohort - 1 - base
            if not fresh_enough(staleness, cfg.max_staleness):
                log.info(
                    "dropped the update from version %d: %d versions stale (--max-staleness %d)",
                    base,
                    staleness,
                    cfg.max_staleness,
                )
                return Joined(cohort, staleness)
            self.steps.advertise(cohort, MEMBER_WEIGHT, base_version=base, share=False)
            listed = self.steps.join(cohort)
            if listed is None:
                return Joined(cohort, staleness)
            if listed:
                change = member_change(names, upload, view, staleness, cfg.staleness_weight)
                sent = self.steps.upload_joined(cohort, _fixed(change))
                self._wait_for(cohort)
                return Joined(cohort, staleness, sent)
            cohort = max(cohort, self.held()) + 1
        last = min(cohort, cfg.rounds)  # the run is over: no cohort is left to try
        return Joined(last, last - 1 - base)

    def _wait_for(self, version: int) -> None:
        """Until `version` (its cohort's) is held, or the patience passed."""
        deadline = time.monotonic() + self.patience_s
        with self.arrived:
            while self.held() < version and not self.session.stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("version %d did not come; going on", version)
                    return
                self.arrived.wait(min(left, 0.5))
