"""What a participant masks in a secure round (`--secure-aggregation`), once the round's index
set is agreed: the runtime around `agent.learning.central.secure`'s rules, which the
simulator calls too (`coordinator.secure_sim`). `agent.runtime.centralized` builds one per
round and hands it to `SecureSteps.upload`, which calls it once the shares are in:

    FedSPU family   its change over the whole model, 0 outside the part it was sent
    FedLDF          its change on the layers the aggregator asked it for (an empty ask: 0
                    everywhere), 0 elsewhere: it waits for the request
    FedAdam         its three deltas; Top and SSM over the union of the supports, which it
                    waits for after announcing its own (`SecureSteps.announce`), and none
                    if its own entries are not all in it
    --dp client     its clipped change with its noise share for the key list's |U1|
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import numpy as np
import torch

from agent.learning import Fit, ServerState
from agent.learning.central import secure_dp
from agent.learning.central.base import CentralStrategy
from agent.learning.central.secure import (
    chooses_entries,
    device_support,
    device_vector,
    on_support,
    summed_names,
    vector_length,
)
from agent.runtime.secure_rounds import SecureSteps
from agent.runtime.session import Session


def secret_generator() -> torch.Generator:
    """A generator seeded from the operating system's randomness: a device's noise share
    under `--dp client --secure-aggregation`, which nobody else can draw again (the fleet
    seed is the coordinator's)."""
    return torch.Generator().manual_seed(secrets.randbits(63))


@dataclass
class SecureVector:
    """One participant's vector of one round, made when the round's index set is agreed."""

    session: Session
    steps: SecureSteps
    strategy: CentralStrategy
    fit: Fit
    view: ServerState
    """The server state it trained from (its part of the global model, FedSPU's family)."""
    round: int

    @property
    def names(self) -> list[str]:
        return summed_names(self.strategy, self.session.learner.facts)

    def announce(self) -> None:
        """Before sharing: (FedAdam-Top, -SSM) the entries its upload covers."""
        if chooses_entries(self.strategy):
            self.steps.announce(
                self.round, device_support(self.strategy, self.names, self.fit.upload)
            )

    def __call__(self, members: int) -> np.ndarray | None:
        """The vector to mask in a round of `members` (U1); None when there is none."""
        s = self.session
        facts = s.learner.facts
        if secure_dp.distributed(s.cfg):
            generator = None if s.cfg.dp_seeded_noise else secret_generator()
            return secure_dp.private_change(
                facts, self.names, self.fit.upload, self.view, s.me, self.round, members, generator
            )
        upload = self.fit.upload
        if self.strategy.asks_layers:
            asked = self._asked_layers()
            if asked is None:
                return None
            upload = self.strategy.respond(facts, self.fit, asked)
        whole = device_vector(self.strategy, facts, self.names, upload, self.view)
        if not chooses_entries(self.strategy):
            return whole
        support = self.steps.agreed(self.round, vector_length(self.strategy, facts))
        return None if support is None else on_support(whole, support)

    def _asked_layers(self) -> list[str] | None:
        """(FedLDF) The layers the aggregator asked this agent for; None if it never asked."""
        s = self.session
        key = (self.round, s.me)
        s.inbox.wait_global(self.round, False, self.steps.patience_s, request=key)
        request = s.inbox.layer_request(self.round, s.me)
        return None if request is None else list(request.layers)
