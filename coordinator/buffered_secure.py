"""The coordinator's side of FedBuff under secure aggregation (`--strategy fedbuff
--secure-aggregation`): each version is one secure sum over a cohort of K devices
(`agent.learning.central.secure_buffer`: the math; `agent.runtime.secure_cohorts`: the
devices' side). Cohorts run one at a time; cohort c makes version c:

    close    wait for the `Keys` of round c (each with the version its update was trained
             from, `Keys.base_version`); close the cohort with the first K to arrive (K =
             `--buffer-size`), or, a round timeout after the first, with those in if they
             are at least `MIN_COHORT` (a fleet with fewer than K devices left still makes
             versions). Keys of a later cohort wait for theirs.
    sum      the secure steps with those K as the round's candidates
             (`coordinator.secure_sum.SecureRound`, up to the unmasked mean: survivors of up
             to 30% dropping mid-cohort included)
    apply    the survivors' sum over their number (`fedbuff.Buffer.apply_summed`); a cohort
             whose sum failed, or left fewer than `MIN_COHORT` survivors, makes a version
             with the last one's model, as a synchronous secure round that fails keeps its
             model
    publish  the version, retained on round/latest/global (`coordinator.buffered`)

A device left out of a closed cohort sees its key list without it (or the version out) and
joins the next with the same update; the coordinator learns of each update only its sender,
its base version and, with the others of its cohort, their sum.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Protocol

from agent.learning import ServerState
from agent.learning.buffering import MIN_COHORT
from agent.learning.central.secure import summed_names
from agent.learning.central.secure_buffer import MEMBER_WEIGHT, cohort_sum
from agent.learning.staleness import fresh_enough
from coordinator import secure_sum
from coordinator.buffered import Applied, BufferedServer
from coordinator.secure_sum import SecureRound
from protocol import Transport, messages, secagg

log = logging.getLogger(__name__)


class CohortIntake(secure_sum.Intake, Protocol):
    """What the cohorts use of the aggregator's handlers besides the secure steps'."""

    current_round: int

    def subscribe(self, transport: Transport) -> None: ...

    def close_round(self, round_: int) -> int: ...


class CohortAggregator(secure_sum.Aggregator, Protocol):
    """The aggregator as the cohorts use it (`coordinator.aggregator.Aggregator`)."""

    @property
    def intake(self) -> CohortIntake: ...


class CohortServer:
    """One secure FedBuff run's cohorts, one at a time, each making a version (`run`)."""

    def __init__(
        self, aggregator: CohortAggregator, plain: BufferedServer, opened: Callable[[int], None]
    ) -> None:
        """`plain`: the buffer and the publishing of versions; `opened`: told of each cohort
        as it opens (the aggregator's record of its traffic)."""
        assert aggregator.secure_intake is not None
        self.aggregator, self.plain, self.opened = aggregator, plain, opened
        self.secure_intake = aggregator.secure_intake
        self.buffer = plain.buffer
        self.names = summed_names(aggregator.strategy, aggregator.learner.facts)

    def subscribe(self, transport: Transport) -> None:
        self.aggregator.intake.subscribe(transport)
        self.secure_intake.subscribe(transport)

    def run(self, applied: Applied) -> None:
        """Every cohort until `--rounds` versions are out (or stop)."""
        agg = self.aggregator
        while self.buffer.version < agg.learner.facts.config.rounds:
            cohort = self.buffer.version + 1
            agg.intake.current_round = cohort
            self.opened(cohort)
            joined = self._close(cohort)
            if joined is None:
                return
            log.info("cohort %d closed: %s", cohort, ", ".join(joined))
            took, summed = self._sum(cohort, joined)
            version = self.buffer.apply_summed(took, summed)
            received = agg.intake.close_round(cohort)
            with self.plain.changed:
                self.plain.received += received
            self.plain.publish(version, applied)

    def _bases(self, cohort: int) -> dict[str, int]:
        """Who advertised keys for `cohort`, in arrival order, with the version its update
        was trained from: only updates the cohort may take (fresh enough, weight 1)."""
        store = self.secure_intake.stores["keys"]
        bases = {}
        for (round_, agent), keys in list(store.items()):
            if round_ != cohort or not isinstance(keys, messages.Keys):
                continue
            staleness = cohort - 1 - keys.base_version
            if keys.base_version < 0 or not fresh_enough(staleness, self.buffer.max_staleness):
                continue
            if keys.num_samples == MEMBER_WEIGHT:
                bases[agent] = keys.base_version
        return bases

    def _close(self, cohort: int) -> list[str] | None:
        """The cohort's members: the first K to join, or after a round timeout from the
        first at least `MIN_COHORT`; None once the run stops."""
        agg = self.aggregator
        size = self.buffer.size
        deadline = math.inf
        with agg.intake.changed:
            while not agg.stop.is_set():
                joined = list(self._bases(cohort))
                if joined and deadline == math.inf:
                    deadline = time.monotonic() + agg.round_timeout_s
                left = deadline - time.monotonic()
                if len(joined) >= size or (len(joined) >= MIN_COHORT and left <= 0):
                    return joined[:size]
                agg.intake.changed.wait(min(left, 0.2) if left > 0 else 0.2)
        return None

    def _sum(
        self, cohort: int, joined: list[str]
    ) -> tuple[list[tuple[str, int]], ServerState | None]:
        """The survivors with their staleness, and their unmasked sum as the buffer applies
        it (None: the cohort's sum failed)."""
        with self.aggregator.intake.changed:
            bases = self._bases(cohort)
        try:
            u3, _, mean = SecureRound(self.aggregator, cohort, joined).unmasked()
        except secagg.SecAggError as exc:
            log.warning("cohort %d: no secure sum (%s): the version keeps the model", cohort, exc)
            return [], None
        summed = cohort_sum(self.names, self.buffer.server.weights, mean, len(u3))
        if summed is None:
            log.warning("cohort %d: %d survivors: the version keeps the model", cohort, len(u3))
            return [], None
        return [(k, cohort - 1 - bases[k]) for k in u3], summed
