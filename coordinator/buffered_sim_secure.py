"""`coordinator simulate` for FedBuff under secure aggregation (`--strategy fedbuff
--secure-aggregation`): the virtual clock's loop (`coordinator.buffered_sim`) with cohorts
in place of the buffer, as the coordinator runs them over MQTT (`coordinator.buffered_secure`;
the math: `agent.learning.central.secure_buffer`).

Each update that arrives joins the open cohort, whose version is the server's next; it is
`s = version - base` stale, and dropped past `--max-staleness` (its agent then starts its
next update at once). A member waits for its cohort, as a device does over MQTT: once K
updates are in (arrival order), their staleness-weighted deltas are masked, summed and
unmasked by `protocol.secagg`'s steps in one process (`sum_in_process`), the buffer applies
the sum over the survivors, every member is judged against the new version and starts its
next update from it. The cohort's messages are counted as the devices and the coordinator
send them (`coordinator.secure_traffic`), in place of the plain uploads; a member's clock
counts its masked vector as its upload.
"""

from __future__ import annotations

import logging

from agent.learning import CentralStrategy, ServerState
from agent.learning.central.secure import summed_names, vector_length
from agent.learning.central.secure_buffer import MEMBER_WEIGHT, cohort_sum, member_change
from agent.learning.staleness import fresh_enough
from coordinator.buffered_sim import BufferedLoop, InFlight, Simulation
from coordinator.secure_traffic import secure_round
from coordinator.traffic import FLEET, RUN_ID
from protocol import messages, secagg

log = logging.getLogger(__name__)


class SecureLoop(BufferedLoop):
    """One simulated secure FedBuff run: `BufferedLoop` with its cohorts."""

    def __init__(self, run: Simulation, strategy: CentralStrategy) -> None:
        super().__init__(run, strategy)
        facts = run.learner.facts
        self.names = summed_names(strategy, facts)
        self.length = vector_length(strategy, facts)
        masked = messages.Masked(
            fleet=FLEET, sender="agent", run_id=RUN_ID, round=1, values=b"\0" * 4 * self.length
        )
        self.upload_bytes = len(messages.encode(masked))
        self.members: list[tuple[str, InFlight, int]] = []
        """The open cohort: (agent, its update, its staleness), in arrival order."""

    def arrive(self, k: str, at: float) -> int | None:
        """Agent k's update arrives at `at`: into the open cohort (or dropped, too stale);
        the version its cohort made, if it was the K-th."""
        flying = self.flying.pop(k)
        staleness = self.buffer.version - flying.base
        if not fresh_enough(staleness, self.buffer.max_staleness):
            self.settle(k, flying, at, staleness)
            self.go_on([k], at)
            return None
        self.members.append((k, flying, staleness))
        if len(self.members) < self.buffer.size:
            return None
        return self._close(at)

    def _close(self, at: float) -> int:
        """The full cohort's secure sum, its version, and its members' next updates."""
        members, self.members = self.members, []
        cohort, rule = self.buffer.version + 1, self.run.config.learning.staleness_weight
        vectors = {
            k: member_change(
                self.names, f.fit.upload, ServerState(self.buffer.kept[f.base]), s, rule
            )
            for k, f, s in members
        }
        stale = {k: s for k, _, s in members}
        try:
            summed = secagg.sum_in_process(
                secagg.Context("simulate", cohort), vectors, dict.fromkeys(vectors, MEMBER_WEIGHT)
            )
        except secagg.SecAggError as exc:
            log.warning("cohort %d: no secure sum: %s", cohort, exc)
            uploaded, survivors, total = [], [], None
        else:
            if summed.clipped:
                log.warning(
                    "cohort %d: %d changes clipped to the secure sum's range",
                    cohort,
                    summed.clipped,
                )
            like = self.buffer.server.weights
            total = cohort_sum(self.names, like, summed.mean, len(summed.survivors))
            uploaded = summed.survivors
            survivors = uploaded if total is not None else []
        version = self.buffer.apply_summed([(k, stale[k]) for k in survivors], total)
        secure_round(cohort, sorted(stale), uploaded, self.length, self.spent)
        for k, flying, s in members:
            self.settle(k, flying, at, s)
        self.go_on([k for k, _, _ in members], at)
        return version


def buffered_loop(run: Simulation, strategy: CentralStrategy) -> BufferedLoop:
    """The loop of a simulated FedBuff run: with cohorts under `--secure-aggregation`."""
    if run.config.learning.secure_aggregation:
        return SecureLoop(run, strategy)
    return BufferedLoop(run, strategy)
