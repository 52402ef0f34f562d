"""A simulated centralized round under `--secure-aggregation`, as the server's inbox
(`central.server.RoundInbox`): the participants' vectors masked, summed and unmasked by
`protocol.secagg`'s steps in one process (`sum_in_process`, the steps the agents and the
aggregator take over MQTT: `agent.runtime.secure_rounds`, `coordinator.secure_sum`), over
the index set agreed before masking (`agent.learning.central.secure`): FedLDF's layers asked
of each (every participant asked, an empty ask included, as the aggregator asks), FedAdam-Top
and -SSM's union of the top-k masks. The round's one upload is `secure.round_upload`'s.
`count_traffic` adds what those messages put on the wire, as emulate counts it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from agent.experiment import ExperimentConfig
from agent.learning import CentralStrategy, Fit, Learner, Payload, ServerState, Upload, as_sent
from agent.learning.central import secure_dp
from agent.learning.central.secure import (
    SUM,
    chooses_entries,
    device_support,
    device_vector,
    from_support,
    layer_parts,
    on_support,
    round_upload,
    summed_names,
    union,
    vector_length,
)
from agent.report import Traffic
from coordinator.secure_traffic import secure_round
from protocol import secagg

log = logging.getLogger(__name__)


class Simulation(Protocol):
    """What a secure round needs of `coordinator.simulate.Simulation`."""

    config: ExperimentConfig
    learner: Learner


@dataclass
class SecureInProcessInbox:
    """A simulated round under `--secure-aggregation` as the server's inbox; after `uploads`
    it holds the round's index set (`asked`, `supports`, `support`) and the masked length."""

    run: Simulation
    strategy: CentralStrategy
    fits: dict[str, Fit]
    round: int
    server: ServerState
    downloads: Mapping[str, Payload]
    asked: dict[str, list[str]] | None = None
    """(FedLDF) The layers asked of each participant, none included."""
    supports: dict[str, np.ndarray] = field(default_factory=dict)
    """(FedAdam-Top, -SSM) The entries each participant covers, as it sent them."""
    support: np.ndarray | None = None
    """(FedAdam-Top, -SSM) Their union: the entries masked."""
    survivors: list[str] = field(default_factory=list)
    """Whose vectors the sum holds (none: the sum failed)."""

    def divergences(self) -> dict[str, dict[str, float]]:
        if not self.strategy.asks_layers:
            return {}
        return {k: f.divergence or {} for k, f in self.fits.items()}

    @property
    def length(self) -> int:
        """How many values a masked vector carries."""
        if self.support is not None:
            return int(self.support.sum())
        return vector_length(self.strategy, self.run.learner.facts)

    def uploads(self, requests: Mapping[str, list[str]] | None) -> dict[str, Upload]:
        facts = self.run.learner.facts
        names = summed_names(self.strategy, facts)
        payloads = {k: f.upload for k, f in self.fits.items()}
        if requests is not None:  # FedLDF: each one's answer to its ask
            self.asked = {k: list(requests.get(k, [])) for k in self.fits}
            payloads = {
                k: self.strategy.respond(facts, f, self.asked[k]) for k, f in self.fits.items()
            }
        whole = {
            k: device_vector(self.strategy, facts, names, p, self._view(k))
            for k, p in payloads.items()
        }
        weights = {k: f.num_samples for k, f in self.fits.items()}
        if secure_dp.distributed(self.run.config.learning):  # noised, weight 1 each
            whole, weights = self._noised(names), dict.fromkeys(self.fits, 1)
        if chooses_entries(self.strategy):
            self.supports = {
                k: device_support(self.strategy, names, p) for k, p in payloads.items()
            }
            self.support = union(self.supports, vector_length(self.strategy, facts))
        cut = {k: on_support(v, self.support) for k, v in whole.items()}
        vectors = {k: v for k, v in cut.items() if v is not None}
        try:
            summed = secagg.sum_in_process(secagg.Context("simulate", self.round), vectors, weights)
        except secagg.SecAggError as exc:
            log.warning("round %d: no secure sum: %s", self.round, exc)
            return {}
        if summed.clipped:
            log.warning(
                "round %d: %d changes clipped to the secure sum's range", self.round, summed.clipped
            )
        u3 = self.survivors = summed.survivors
        mean = from_support(summed.mean, self.support)
        upload = round_upload(
            self.strategy, facts, self.server, mean, {k: weights[k] for k in u3}, self._parts(u3)
        )
        return {SUM: upload}

    def _parts(self, u3: list[str]) -> dict[str, Payload] | None:
        """What each survivor was sent or asked for (none: every entry counts everyone)."""
        if self.strategy.downloads:
            return {k: self.downloads[k] for k in u3}
        if self.asked is not None:
            return layer_parts(self.run.learner.facts, self.server, {k: self.asked[k] for k in u3})
        return None

    def _view(self, agent: str) -> ServerState:
        """What `agent` trained from: its part as it arrived, else the server's model."""
        if agent not in self.downloads:
            return self.server
        return ServerState(as_sent(self.downloads[agent], self.run.config.learning.fp16).weights)

    def _noised(self, names: list[str]) -> dict[str, np.ndarray]:
        """Under `--dp client`: each change with its noise share, as the devices mask it."""
        facts = self.run.learner.facts
        return {
            k: secure_dp.private_change(
                facts, names, f.upload, self.server, k, self.round, len(self.fits)
            )
            for k, f in self.fits.items()
        }


def count_traffic(inbox: SecureInProcessInbox, traffic: dict[str, Traffic]) -> None:
    """Add the round's secure-aggregation messages to `traffic` (`secure_round`)."""
    secure_round(
        inbox.round,
        sorted(inbox.fits),
        inbox.survivors,
        inbox.length,
        traffic,
        inbox.supports,
        inbox.support,
    )
