"""`coordinator simulate`: a whole fleet in one process, for fast research sweeps.

The loop below is the round structure of ALGORITHMS.md section 1 with the network taken out:
agents are processed in the round's reuse order, so an agent's prior neighbours have already
published this round's model when it runs, and everyone else's model is last round's. All the
math is in `agent.strategies`, the code the networked agent runs too. Traffic is the size of
the real encoded messages an agent would publish (models once per round, whatever the number
of receivers; votes to everyone).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agent import pruning, sparse, topology
from agent.experiment import ExperimentConfig, build_workload, capped_density, nominal_budgets
from agent.strategies import Published, RoundResult
from agent.wire import model_message
from protocol import messages

FLEET = "sim"
COORDINATOR = "coordinator"


@dataclass
class Traffic:
    """Bytes and nonzeros one node put on, and took off, its link in one round."""

    sent: int = 0
    received: int = 0
    nonzeros_sent: int = 0


ProgressCallback = Callable[[int, str], None]


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
        self.states = {agent_id: self.learner.init_agent(agent_id) for agent_id in self.roster}
        self.plan = pruning.PruningPlan(cfg.rounds, cfg.schedule_b, cfg.schedule_c)

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
            "summary": summarize(rounds, self.plan.t_star, time.perf_counter() - started),
        }

    def _message_size(self, round_: int, sender: str, published: Published) -> tuple[int, int]:
        """(encoded bytes, nonzeros) of the Model message carrying `published`."""
        data = model_message(
            fleet=FLEET,
            sender=sender,
            run_id="sim",
            round_=round_,
            weights=published.weights,
            masks=published.masks,
            num_samples=published.num_samples,
            fp16=self.config.learning.fp16,
        )
        nonzeros = (
            sum(int(m.sum()) for m in published.masks.values())
            + sum(w.numel() for n, w in published.weights.items() if n not in published.masks)
            if published.masks
            else sum(w.numel() for w in published.weights.values())
        )
        return len(data), nonzeros

    def _decentralized(self, progress: ProgressCallback | None) -> list[dict[str, Any]]:
        cfg = self.config.learning
        communicates = cfg.strategy != "local"
        votes_matter = self.learner.prunes_further
        vote_bytes = len(
            messages.encode(messages.Vote(fleet=FLEET, sender=self.roster[0], vote=True, score=0.0))
        )
        seed, roster = self.config.seed, self.roster
        previous = {
            k: self.learner.published(s, len(self.data[k].y_train)) for k, s in self.states.items()
        }
        previous_size = dict.fromkeys(roster, 0)  # round-0 models are derivable: never sent
        rounds = []
        for t in range(1, cfg.rounds + 1):
            order = topology.reuse_order(seed, t, roster)
            neighbours = (
                topology.everyone_neighbours(seed, t, roster, cfg.neighbours, cfg.topology)
                if communicates
                else dict.fromkeys(roster, [])
            )
            prune_now = self.plan.is_pruning_round(t)
            current: dict[str, Published] = {}
            size: dict[str, int] = {}
            traffic = {k: Traffic() for k in roster}
            results: dict[str, RoundResult] = {}
            for k in order:
                prior, posterior = topology.prior_posterior(order, neighbours[k], k, cfg.max_wait)
                inbox = {j: current[j] for j in prior} | {j: previous[j] for j in posterior}
                traffic[k].received += sum(size[j] for j in prior)
                traffic[k].received += sum(previous_size[j] for j in posterior)
                cap = capped_density(self.learner, self.budgets.get(k), self.states[k].masks)
                result = self.learner.local_round(
                    self.states[k], self.data[k], inbox, t, prune_now, density_cap=cap
                )
                results[k] = result
                self.states[k] = result.state
                current[k] = result.published
                if communicates:
                    size[k], nonzeros = self._message_size(t, k, result.published)
                    traffic[k].sent += size[k]
                    traffic[k].nonzeros_sent += nonzeros
                else:
                    size[k] = 0
                if progress:
                    progress(t, k)
            if votes_matter:
                for k in roster:
                    traffic[k].sent += vote_bytes
                    traffic[k].received += vote_bytes * (len(roster) - 1)
                votes = {k: bool(r.vote) for k, r in results.items()}
                self.plan.observe(t, pruning.tally(votes, roster, cfg.delta_v))
            previous, previous_size = current, size
            rounds.append(self._round_record(t, results, traffic, order))
        return rounds

    def _centralized(self, progress: ProgressCallback | None) -> list[dict[str, Any]]:
        cfg = self.config.learning
        global_weights = dict(self.learner.initial)
        rounds = []
        for t in range(1, cfg.rounds + 1):
            traffic = {k: Traffic() for k in [*self.roster, COORDINATOR]}
            results: dict[str, RoundResult] = {}
            for k in self.roster:
                result = self.learner.central_train(self.states[k], self.data[k], global_weights, t)
                results[k] = result
                self.states[k] = result.state
                sent, nonzeros = self._message_size(t, k, result.published)
                traffic[k].sent += sent
                traffic[k].nonzeros_sent += nonzeros
                traffic[COORDINATOR].received += sent
                if progress:
                    progress(t, k)
            global_weights = sparse.aggregate_weighted(
                {k: r.published.weights for k, r in results.items()},
                {k: float(r.published.num_samples) for k, r in results.items()},
            )
            global_size, global_nonzeros = self._message_size(
                t, COORDINATOR, Published(global_weights, None, 0)
            )
            traffic[COORDINATOR].sent += global_size
            traffic[COORDINATOR].nonzeros_sent += global_nonzeros
            for k in self.roster:
                traffic[k].received += global_size
            if cfg.strategy == "fedavg":
                for k in self.roster:
                    loss, accuracy = self.learner.evaluate_on(global_weights, self.data[k])
                    results[k] = dataclasses.replace(results[k], loss=loss, accuracy=accuracy)
            rounds.append(self._round_record(t, results, traffic, self.roster))
        return rounds

    def _round_record(
        self,
        t: int,
        results: dict[str, RoundResult],
        traffic: dict[str, Traffic],
        order: list[str],
    ) -> dict[str, Any]:
        agents = {}
        for k in self.roster:
            r = results[k]
            masks = r.state.masks
            agents[k] = {
                "accuracy": r.accuracy,
                "loss": r.loss,
                "train_loss": r.train_loss,
                "sparsity": sparse.sparsity(masks) if masks else 0.0,
                "bytes_sent": traffic[k].sent,
                "bytes_received": traffic[k].received,
                "nonzeros_sent": traffic[k].nonzeros_sent,
                "train_flops": r.train_flops,
                "p_k": self.budgets[k].p_k if k in self.budgets else 1.0,
                "vote": r.vote,
                "score": r.score,
                "pruned": r.pruned,
            }
        record: dict[str, Any] = {"round": t, "order": order, "agents": agents}
        if COORDINATOR in traffic:
            record["coordinator"] = dataclasses.asdict(traffic[COORDINATOR])
        record["t_star"] = self.plan.t_star
        return record


def summarize(rounds: list[dict[str, Any]], t_star: int | None, wall: float) -> dict[str, Any]:
    """Run-level figures; traffic counts every byte on a device link (uploads + downloads)."""
    final = rounds[-1]["agents"]
    per_node: dict[str, int] = {}
    flops = 0
    for record in rounds:
        for k, a in record["agents"].items():
            per_node[k] = per_node.get(k, 0) + a["bytes_sent"] + a["bytes_received"]
            flops += a["train_flops"]
        if "coordinator" in record:
            c = record["coordinator"]
            per_node[COORDINATOR] = per_node.get(COORDINATOR, 0) + c["sent"] + c["received"]
    busiest = max(per_node, key=per_node.__getitem__)
    return {
        "mean_accuracy": sum(a["accuracy"] for a in final.values()) / len(final),
        "mean_sparsity": sum(a["sparsity"] for a in final.values()) / len(final),
        "busiest_agent_bytes": per_node[busiest],
        "busiest_agent": busiest,
        "total_bytes": sum(per_node.values()),
        "total_train_flops": flops,
        "wall_seconds": wall,
        "rounds": len(rounds),
        "t_star": t_star,
    }


def simulate(config: ExperimentConfig, progress: ProgressCallback | None = None) -> dict[str, Any]:
    """Run one simulated experiment and return its report (config, rounds, summary)."""
    return Simulation(config).run(progress)
