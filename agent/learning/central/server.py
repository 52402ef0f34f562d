"""The server's side of a centralized round, written once: its steps in their order, over
tensors. The simulator (`coordinator.simulate`) calls them with what its participants computed
in the same process, the coordinator's aggregator (`coordinator.aggregator`) with what arrived
over MQTT: one round protocol, two transports (Flower's model), so that neither repeats the
order nor a rule of it (the participant's side: `central.participant`). Nothing here waits,
sends or decodes.

Round t:

    participants    the roster's agents still training (early stopping takes one out)
    download        (FedSPU family) each participant's part: `CentralStrategy.download`
    gather          the uploads, asked for in the strategy's order from a `RoundInbox` (the
                    transport): FedLDF's divergence vectors first, the layers asked of each
                    (`layer_requests`), then those layers; the others' uploads at once
    conclude        the uploads aggregated and screened (`checked_aggregate`), the server advanced
                    to what its participants hold once they apply the broadcast; what the
                    defence (`--clip`) screened out or clipped is said (`ScreeningLog`) and
                    returned for the round's record
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Protocol

from agent.learning.central import client_dp
from agent.learning.central.base import (
    Aggregate,
    CentralStrategy,
    Payload,
    ServerState,
    Upload,
    as_sent,
)
from agent.learning.learner import Learner
from agent.learning.rounds import checked_aggregate, running
from agent.learning.screening import NOTHING, Screening, ScreeningLog, tallied

log = logging.getLogger(__name__)


def participants(roster: Sequence[str], round_: int, stopped: Mapping[str, int]) -> list[str]:
    """Who takes part in round `round_`, in roster order: every agent but those that stopped
    early before it (`stopped`: agent -> the round after which it stopped)."""
    return [k for k in roster if running(k, round_, stopped)]


def layer_requests(
    strategy: CentralStrategy, learner: Learner, divergences: Mapping[str, dict[str, float]]
) -> dict[str, list[str]]:
    """FedLDF's requests from the divergence vectors that arrived (`CentralStrategy.select`):
    a participant asked for no layer gets no request."""
    selected = strategy.select(learner.facts, divergences)
    return {k: layers for k, layers in selected.items() if layers}


class RoundInbox(Protocol):
    """What one round's participants send the server, as the aggregator decodes it: computed
    in the same process (the simulator) or waited for over MQTT (the aggregator). `gather`
    asks in the protocol's order, so an implementation only moves messages."""

    def divergences(self) -> Mapping[str, dict[str, float]]:
        """(FedLDF) The divergence vector of each participant that sent one."""
        ...

    def uploads(self, requests: Mapping[str, list[str]] | None) -> dict[str, Upload]:
        """The uploads that arrived; under FedLDF (`requests` given) those of the layers each
        participant is asked for, once the requests are out."""
        ...


def gather(
    strategy: CentralStrategy, learner: Learner, inbox: RoundInbox
) -> tuple[dict[str, list[str]], dict[str, Upload]]:
    """A round's uploads in the order the strategy takes them, and the layer requests that
    went out (none but under FedLDF, which asks for them once the divergence vectors are in)."""
    if not strategy.asks_layers:
        return {}, inbox.uploads(None)
    requests = layer_requests(strategy, learner, inbox.divergences())
    return requests, inbox.uploads(requests)


def conclude(
    strategy: CentralStrategy,
    learner: Learner,
    server: ServerState,
    uploads: Mapping[str, Upload],
    round_: int,
    fp16: bool,
    screening_log: ScreeningLog,
) -> tuple[Aggregate, ServerState, Screening]:
    """The round's aggregate of what arrived, the server state after it, and which uploads
    the defence screened out or clipped (said in the log by the run's `screening_log`). A non-finite
    aggregate is undone (`checked_aggregate`: the server keeps its model and broadcasts what
    changes nothing). With no upload nothing changes and the broadcast is empty. Under
    `--dp client` the aggregate is noised (`client_dp.aggregate`)."""
    if not uploads:
        return Aggregate(server, Payload({})), server, NOTHING
    with tallied() as tally:
        combined = client_dp.aggregate(strategy, learner.facts, server, uploads, round_)
    screening_log.say(round_, tally.screening)
    aggregate, undone = checked_aggregate(strategy, server, combined)
    if undone:
        log.warning("round %d: aggregate not finite; the server kept its model", round_)
    return aggregate, advance_server(strategy, server, aggregate, fp16), tally.screening


def advance_server(
    strategy: CentralStrategy, previous: ServerState, aggregate: Aggregate, fp16: bool
) -> ServerState:
    """The server state after a round. A broadcasting strategy holds what its participants
    hold: the previous state with the broadcast applied as they decode it (fp16 on the wire
    rounds it); the others keep the aggregate's state."""
    if not strategy.broadcasts:
        return aggregate.server
    return strategy.receive(previous, as_sent(aggregate.broadcast, fp16))
