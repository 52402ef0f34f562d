"""`coordinator simulate`: a whole fleet in one process, for fast research sweeps.

The loops below are the round structure of ALGORITHMS.md section 1 with the network taken
out, and read top to bottom in algorithm order. A decentralized round processes agents in the
round's reuse order, so an agent's prior neighbours have already published this round's model
when it runs, and everyone else's model is last round's. The rules of a round are
`agent.learning.rounds`, which the networked agent calls too; traffic is the size of the real
encoded messages an agent would send (`coordinator.traffic`, one model per wire format).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from agent.device.throttle import ENERGY_SOURCE, round_energy
from agent.experiment import (
    ExperimentConfig,
    agent_profiles,
    attackers,
    build_workload,
    nominal_budgets,
)
from agent.learning import (
    CentralStrategy,
    EarlyStop,
    Fit,
    Payload,
    Published,
    RoundResult,
    RoundTopology,
    ServerState,
    Upload,
    advance_server,
    as_sent,
    attacked,
    attacked_payload,
    central_strategy,
    checked_aggregate,
    checked_fit,
    evaluated_weights,
    layer_requests,
    participant_p_k,
    pruning,
    running,
    settle_votes,
    sparse,
    train_round,
)
from agent.report import (
    COORDINATOR,
    AgentRound,
    Traffic,
    honest_summary,
    reported_sparsity,
    stopped_summary,
    summarize,
)
from coordinator.traffic import CentralTraffic, LocalWire, wire_traffic

__all__ = ["ExperimentConfig", "ProgressCallback", "Simulation", "simulate"]

log = logging.getLogger(__name__)

ProgressCallback = Callable[[int, str], None]
"""Called with (round, agent) after each agent's round."""


class Simulation:
    """One run: builds the fleet, runs the rounds, and collects the report."""

    def __init__(self, config: ExperimentConfig) -> None:
        config.validate()
        self.config = config
        cfg = config.learning
        self.roster = [f"agent-{k:03d}" for k in range(config.agents)]
        workload = build_workload(config, self.roster)
        self.model_name = workload.model_name
        self.learner = workload.learner
        self.data = workload.data
        self.budgets = nominal_budgets(config, workload, self.roster)
        self.profiles = agent_profiles(config, self.roster)
        """Each agent's board, whose model gives its energy (none without --profiles)."""
        self.states = {agent_id: self.learner.init_agent(agent_id) for agent_id in self.roster}
        self.plan = pruning.PruningPlan(cfg.rounds, cfg.schedule_b, cfg.schedule_c)
        self.early_stops = {k: EarlyStop.of(cfg) for k in self.roster}
        self.stopped: dict[str, int] = {}
        """Agent -> the round after which it stopped (early stopping)."""
        self.last: dict[str, AgentRound] = {}
        """Each agent's latest round, which a stopped agent's later rounds repeat."""
        self.p_k: dict[str, float] = {}
        """Centralized: what each participant last trained with (budget or static tier)."""
        self.attackers = attackers(config, self.roster)
        """The agents that send poisoned models (`--attackers`)."""

    def run(self, progress: ProgressCallback | None = None) -> dict[str, Any]:
        started = time.perf_counter()
        cfg = self.config.learning
        if self.learner.decentralized or cfg.strategy == "local":
            rounds = self._decentralized(progress)
        else:
            rounds = self._centralized(progress)
        return {
            "config": {
                **dataclasses.asdict(self.config),
                "model": self.model_name,
                "roster": self.roster,
            },
            "rounds": rounds,
            "summary": {
                **summarize(rounds, self.plan.t_star, time.perf_counter() - started),
                "stopped": stopped_summary(rounds, self.stopped, cfg.rounds),
                **honest_summary(rounds, self.attackers),
            },
        }

    # ------------------------------------------------------------------ decentralized rounds

    def _early_stop(
        self, k: str, t: int, weights: sparse.State, train_loss: float, pruned: bool = False
    ) -> None:
        """Early stopping (ALGORITHMS.md 2): record that k stops after round t, if it does;
        a round that `pruned` k's model restarts its rule's window."""
        if self.early_stops[k].after(self.learner, weights, train_loss, self.data[k], pruned):
            self.stopped[k] = t

    def _train(
        self, k: str, t: int, inbox: dict[str, Published], prune_now: bool
    ) -> tuple[RoundResult, AgentRound]:
        """Agent k's local round on its inbox, cut to its budget; the round's figures."""
        budget = self.budgets[k].p_k if k in self.budgets else None
        result, reduction = train_round(
            self.learner, self.states[k], self.data[k], inbox, t, prune_now, budget
        )
        self.states[k] = result.state
        if result.recovered:
            log.warning("%s round %d: model not finite; kept its model from before", k, t)
        self._early_stop(k, t, result.state.weights, result.train_loss, result.pruned)
        record = AgentRound.of_result(t, k, result, reduction, budget)
        if k in self.attackers:
            result = attacked(self.learner, result, self.config.attack, t)
        return result, record

    def _vote(self, t: int, ran: dict[str, AgentRound], wire: LocalWire) -> None:
        """The round's votes go to everyone and settle the pruning plan (ALGORITHMS.md 1.7)."""
        if not self.learner.prunes_further:
            return
        votes = {k: bool(ran[k].vote) for k in self.roster if k in ran and ran[k].vote is not None}
        wire.votes(list(votes))
        settle_votes(self.plan, t, votes, self.roster, self.stopped, self.config.learning.delta_v)

    def _decentralized(self, progress: ProgressCallback | None) -> list[dict[str, Any]]:
        """The rounds of ALGORITHMS.md 1: each agent, in reuse order, aggregates what it
        receives, trains and publishes; then the votes settle the pruning plan."""
        cfg = self.config.learning
        wire = wire_traffic(cfg, self.roster, self.stopped, self.learner)
        previous = {
            k: self.learner.published(s, len(self.data[k].y_train)) for k, s in self.states.items()
        }  # round 0: the models everyone derives
        rounds = []
        for t in range(1, cfg.rounds + 1):
            topology = RoundTopology(self.config.seed, t, self.roster, cfg)
            prune_now = self.plan.is_pruning_round(t)
            wire.begin(t)
            current: dict[str, Published] = {}
            ran: dict[str, AgentRound] = {}
            for k in topology.order:
                if not running(k, t, self.stopped):  # it stands in with its last model (stand_in)
                    current[k] = previous[k]
                    wire.stood_in(k)
                    continue
                prior, posterior = topology.prior_posterior(k)
                inbox = {j: current[j] for j in prior} | {j: previous[j] for j in posterior}
                inbox = wire.receive(k, topology, inbox)
                result, ran[k] = self._train(k, t, inbox, prune_now)
                current[k] = wire.publish(k, t, result, previous[k])
                if progress:
                    progress(t, k)
            self._vote(t, ran, wire)
            rounds.append(self._round_record(t, topology.order, ran, wire.end(t)))
            previous = current
            if len(self.stopped) == len(self.roster):
                break
        return rounds

    # -------------------------------------------------------------------- centralized rounds

    def _fit(
        self, strategy: CentralStrategy, server: ServerState, k: str, t: int
    ) -> tuple[Fit, Payload | None]:
        """Participant k's round: its download (if the strategy has one), then its fit."""
        budget = self.budgets[k].p_k if k in self.budgets else None
        self.p_k[k] = participant_p_k(budget, self.roster, k)
        view, download = server, None
        if strategy.downloads:
            download = strategy.download(self.learner, server, k, t, self.p_k[k])
            view = ServerState(as_sent(download, self.config.learning.fp16).weights)
        fit = strategy.fit(self.learner, self.states[k], self.data[k], view, t, self.p_k[k])
        fit, undone = checked_fit(fit, self.states[k], view)
        if undone:
            log.warning("%s round %d: model not finite; kept its model from before", k, t)
        self.states[k] = fit.state
        return fit, download

    def _uploads(
        self, strategy: CentralStrategy, fits: dict[str, Fit], t: int
    ) -> tuple[dict[str, list[str]], dict[str, Payload]]:
        """(the coordinator's layer requests, what each participant uploads): FedLDF selects
        layers from the divergence vectors and participants send those; the others send
        their fit's upload. An attacker's upload is poisoned."""
        requests: dict[str, list[str]] = {}
        if not strategy.asks_layers:
            payloads = {k: f.upload for k, f in fits.items()}
        else:
            divergences = {k: f.divergence or {} for k, f in fits.items()}
            requests = layer_requests(strategy.select(self.learner, divergences))
            payloads = {
                k: strategy.respond(self.learner, f, requests.get(k, [])) for k, f in fits.items()
            }
        attack = self.config.attack
        return requests, {
            k: attacked_payload(self.learner, p, attack, k, t) if k in self.attackers else p
            for k, p in payloads.items()
        }

    def _evaluate(
        self, strategy: CentralStrategy, server: ServerState, k: str, t: int, fit: Fit
    ) -> AgentRound:
        """Participant k's figures after the round, on its own model or the global one."""
        evaluated = evaluated_weights(strategy, fit.state.weights, server)
        loss, accuracy = self.learner.evaluate_on(evaluated, self.data[k])
        self._early_stop(k, t, fit.state.weights, fit.train_loss)
        return AgentRound(
            round=t,
            agent=k,
            accuracy=accuracy,
            loss=loss,
            train_loss=fit.train_loss,
            sparsity=reported_sparsity(fit.state.masks),
            train_flops=fit.train_flops,
            p_k=self.p_k[k],
        )

    def _centralized(self, progress: ProgressCallback | None) -> list[dict[str, Any]]:
        """The rounds of `agent.learning.central`'s contract in one process: downloads, fits,
        (selection and responses), aggregation, evaluation."""
        cfg = self.config.learning
        strategy = central_strategy(cfg.strategy)
        server = strategy.init_server(self.learner)
        wire = CentralTraffic(self.roster, cfg.fp16)
        rounds: list[dict[str, Any]] = []
        for t in range(1, cfg.rounds + 1):
            fits: dict[str, Fit] = {}
            downloads: dict[str, Payload] = {}
            for k in self.roster:
                if running(k, t, self.stopped):
                    fits[k], download = self._fit(strategy, server, k, t)
                    if download is not None:
                        downloads[k] = download
                    if progress:
                        progress(t, k)
            requests, payloads = self._uploads(strategy, fits, t)
            uploads = {  # what the aggregator decodes (fp16 on the wire rounds the values)
                k: Upload(as_sent(payload, cfg.fp16), fits[k].num_samples)
                for k, payload in payloads.items()
            }
            aggregate, undone = checked_aggregate(
                strategy, server, strategy.aggregate(self.learner, server, uploads)
            )
            if undone:
                log.warning("round %d: aggregate not finite; the server kept its model", t)
            server = advance_server(strategy, server, aggregate, cfg.fp16)
            traffic = wire.round(t, fits, uploads, downloads, requests, aggregate)
            ran = {k: self._evaluate(strategy, server, k, t, fit) for k, fit in fits.items()}
            rounds.append(self._round_record(t, self.roster, ran, traffic))
            if len(self.stopped) == len(self.roster):
                break
        return rounds

    # ------------------------------------------------------------------------------- report

    def _round_record(
        self, t: int, order: list[str], ran: dict[str, AgentRound], traffic: dict[str, Traffic]
    ) -> dict[str, Any]:
        """The report's round t: every agent's figures (one that stopped early repeats its
        last, and spends only what it re-sends), and the coordinator's traffic if any."""
        agents = {}
        for k in self.roster:
            spent = traffic[k]
            self.last[k] = self._with_energy(
                dataclasses.replace(
                    ran[k] if k in ran else self.last[k].idle(t),
                    bytes_sent=spent.sent,
                    bytes_received=spent.received,
                    nonzeros_sent=spent.nonzeros_sent,
                    stopped=k in self.stopped,
                )
            )
            agents[k] = self.last[k].report_entry()
        record: dict[str, Any] = {"round": t, "order": order, "agents": agents}
        if COORDINATOR in traffic:
            record["coordinator"] = dataclasses.asdict(traffic[COORDINATOR])
        record["t_star"] = self.plan.t_star
        return record

    def _with_energy(self, spent: AgentRound) -> AgentRound:
        """`spent` with the energy its board's model gives its FLOPs and bytes (the emulated
        agent computes the same, `Throttle.round_energy`); unchanged without a profile."""
        if spent.agent not in self.profiles:
            return spent
        traffic = spent.bytes_sent + spent.bytes_received
        energy, radio = round_energy(self.profiles[spent.agent], spent.train_flops, traffic)
        return dataclasses.replace(
            spent, energy_j=energy, radio_energy_j=radio, energy_source=ENERGY_SOURCE
        )


def simulate(config: ExperimentConfig, progress: ProgressCallback | None = None) -> dict[str, Any]:
    """Run one simulated experiment and return its report (config, rounds, summary)."""
    return Simulation(config).run(progress)
