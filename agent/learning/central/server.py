"""The server's side of a centralized round, written once: its steps in their order, over
tensors. The simulator (`coordinator.simulate`) calls them with what its participants computed
in the same process, the coordinator's aggregator (`coordinator.aggregator`) with what arrived
over MQTT: one round protocol, two transports (Flower's model), so that neither repeats the
order nor a rule of it. Nothing here waits, sends or decodes.

Round t:

    participants    the roster's agents still training (early stopping takes one out)
    download        (FedSPU family) each participant's part: `CentralStrategy.download`
    layer_requests  (FedLDF) from the participants' divergence vectors, the layers asked of each
    conclude        the uploads aggregated and screened (`checked_aggregate`), the server advanced
                    to what its participants hold once they apply the broadcast
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

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

log = logging.getLogger(__name__)


def participants(roster: Sequence[str], round_: int, stopped: Mapping[str, int]) -> list[str]:
    """Who takes part in round `round_`, in roster order: every agent but those that stopped
    early before it (`stopped`: agent -> the round after which it stopped)."""
    return [k for k in roster if running(k, round_, stopped)]


def layer_requests(
    strategy: CentralStrategy, learner: Learner, divergences: Mapping[str, dict[str, float]]
) -> dict[str, list[str]]:
    """FedLDF's requests from the divergence vectors that arrived (`CentralStrategy.select`):
    a participant asked for no layer gets no request (and uploads nothing)."""
    selected = strategy.select(learner, divergences)
    return {k: layers for k, layers in selected.items() if layers}


def conclude(
    strategy: CentralStrategy,
    learner: Learner,
    server: ServerState,
    uploads: Mapping[str, Upload],
    round_: int,
    fp16: bool,
) -> tuple[Aggregate, ServerState]:
    """The round's aggregate of what arrived, and the server state after it. A non-finite
    aggregate is undone (`checked_aggregate`: the server keeps its model and broadcasts what
    changes nothing). With no upload nothing changes and the broadcast is empty."""
    if not uploads:
        return Aggregate(server, Payload({})), server
    aggregate, undone = checked_aggregate(
        strategy, server, strategy.aggregate(learner, server, uploads)
    )
    if undone:
        log.warning("round %d: aggregate not finite; the server kept its model", round_)
    return aggregate, advance_server(strategy, server, aggregate, fp16)


def advance_server(
    strategy: CentralStrategy, previous: ServerState, aggregate: Aggregate, fp16: bool
) -> ServerState:
    """The server state after a round. A broadcasting strategy holds what its participants
    hold: the previous state with the broadcast applied as they decode it (fp16 on the wire
    rounds it); the others keep the aggregate's state."""
    if not strategy.broadcasts:
        return aggregate.server
    return strategy.receive(previous, as_sent(aggregate.broadcast, fp16))
