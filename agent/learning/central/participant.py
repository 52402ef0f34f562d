"""The participant's side of a centralized round, written once: its steps in their order, over
tensors. The networked agent (`agent.runtime.centralized`) takes them with what came over MQTT,
the simulator (`coordinator.simulate`) in one process (its fits possibly in worker processes,
its judging while the next round trains), as both take the server's (`central.server`).
Nothing here waits, sends or decodes. Round t of participant k:

    begin       its p_k: its measured budget, else FedSPU's static tier (`Turn.of`)
    download    (the transport; FedSPU family) its part of the global model, asked for with p_k
    train       from that part, else from the view it holds (`Turn.view`, `Turn.train`)
    exchange    (the transport) its upload (FedLDF: its divergence vector, then the layers it
                is asked for); the round's broadcast applied to its view (`receive`)
    judge       the model it keeps (`judge`); the round's record: `AgentRound.of_fit`
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from agent.learning import fallback
from agent.learning.central import client_dp
from agent.learning.central.base import CentralStrategy, Fit, FitContext, Payload, ServerState
from agent.learning.central.fedspu import static_tier
from agent.learning.kept import FLEET, PERSONAL, Judged
from agent.learning.learner import AgentState, Learner, LocalData
from agent.learning.rounds import checked_fit

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Turn:
    """Participant `agent`'s round `round`: the fraction of the model it trains (`p_k`) and
    its measured budget (None without one), which decides its local-only model's round."""

    agent: str
    round: int
    p_k: float
    budget_p_k: float | None = None

    @classmethod
    def of(cls, agent: str, round_: int, roster: Sequence[str], budget_p_k: float | None) -> Turn:
        """The turn of `agent` in `round_`: p_k is its measured budget, else FedSPU's static
        tier by its place in the roster."""
        p_k = budget_p_k if budget_p_k is not None else static_tier(list(roster), agent)
        return cls(agent, round_, p_k, budget_p_k)

    def view(self, held: ServerState, part: Payload | None) -> ServerState:
        """The server state it trains from: its part of the global model as it arrived (a
        strategy that `downloads`), else the view it `held`."""
        return held if part is None else ServerState(part.weights)

    def train(
        self,
        strategy: CentralStrategy,
        learner: Learner,
        state: AgentState,
        data: LocalData,
        view: ServerState,
    ) -> Fit:
        """Its whole local round, in one order wherever it runs (the networked agent, the
        simulator, a worker process): the strategy's fit (`CentralStrategy.fit`), its model's
        BatchNorm statistics re-estimated for the weights it trained to
        (`ModelFacts.fresh_statistics`), undone if not finite (`checked_fit`, then `Fit.undone`),
        and only then its local-only model's round (`fallback.advance`, by its measured
        budget), so an undone fit never undoes the local-only model's training; its epsilon
        so far (`Learner.epsilon`) under `--dp`. Under `--dp client` its upload is clipped
        around `view` (`client_dp.clipped_fit`)."""
        fit = strategy.fit(learner.facts, FitContext(state, data, view, self.round, self.p_k))
        fresh = learner.facts.fresh_statistics(fit.state.weights, data)
        fit = dataclasses.replace(fit, state=dataclasses.replace(fit.state, weights=fresh))
        fit, undone = checked_fit(fit, state, view)
        if undone:
            log.warning("round %d: model not finite; kept the model from before it", self.round)
        fit = client_dp.clipped_fit(learner.config, fit, view)
        trained, flops = fallback.advance(learner, fit.state, data, self.round, self.budget_p_k)
        epsilon = learner.epsilon(trained, len(data.y_train))
        return dataclasses.replace(
            fit, state=trained, fallback_flops=flops, undone=undone, epsilon=epsilon
        )


def judge(
    strategy: CentralStrategy, learner: Learner, fit: Fit, view: ServerState, data: LocalData
) -> tuple[AgentState, Judged]:
    """What the participant keeps after its round `fit` (`fallback.judge`), with the FLOPs its
    local-only model cost: the strategy's model first (its own under a personalized strategy,
    else the global model it holds, `view`), then the other one it holds (a strategy that
    broadcasts no global model leaves it only its own). The global model is judged with
    BatchNorm statistics of the participant's own data re-estimated for its weights
    (`ModelFacts.fresh_statistics`)."""
    agent = fit.state
    own = (agent.weights, agent.masks)
    if not strategy.broadcasts:
        held = {PERSONAL: own}
    else:
        fleet_weights = learner.facts.own_statistics(view.weights, agent.weights)
        fleet = (learner.facts.fresh_statistics(fleet_weights, data), None)
        held = {PERSONAL: own, FLEET: fleet} if strategy.personal else {FLEET: fleet, PERSONAL: own}
    return fallback.judge(learner, agent, data, held, fit.fallback_flops)
