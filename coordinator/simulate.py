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

from agent.experiment import ExperimentConfig, build_workload, nominal_budgets
from agent.learning import delta, ldf, pruning, sparse, topology
from agent.learning.central import (
    Aggregate,
    Fit,
    Payload,
    ServerState,
    Upload,
    as_sent,
    central_strategy,
    static_tier,
)
from agent.learning.early_stop import StopWatch, early_stop_savings
from agent.learning.learner import Published, RoundResult
from agent.learning.reduction import local_reduction
from agent.runtime.codec import divergence_message, encode_state, model_message, values_sent
from protocol import messages
from protocol.chunking import fits_one_frame

FLEET = "sim"
COORDINATOR = "coordinator"


@dataclass
class Traffic:
    """Bytes and nonzeros one node put on, and took off, its link in one round."""

    sent: int = 0
    received: int = 0
    nonzeros_sent: int = 0


ProgressCallback = Callable[[int, str], None]


@dataclass(frozen=True)
class Announced:
    """A divergence vector an agent published (`--wire layers`): its round, values, size."""

    round: int
    values: dict[str, float]
    size: int


@dataclass
class Deliveries:
    """Who received which model, for the traffic of agents that stopped early: one that
    stopped after round s stands in with its round-s model, which a receiver that never got
    it fetches once (the stopped agent re-sends it on request)."""

    final_size: dict[str, int] = dataclasses.field(default_factory=dict)
    held: set[tuple[str, str, int]] = dataclasses.field(default_factory=set)

    def count(
        self,
        traffic: dict[str, Traffic],
        receiver: str,
        sender: str,
        needed: int,
        fresh_size: int,
        stopped: dict[str, int],
    ) -> None:
        """Charge the delivery of `sender`'s round-`needed` model (`fresh_size` bytes)."""
        source = min(needed, stopped.get(sender, needed))
        cost = fresh_size
        if source != needed:
            cost = 0 if (receiver, sender, source) in self.held else self.final_size[sender]
            traffic[sender].sent += cost
        self.held.add((receiver, sender, source))
        traffic[receiver].received += cost


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
        self.stop_watches: dict[str, StopWatch] = {}
        self.stopped: dict[str, int] = {}
        """Agent -> the round after which it stopped (early stopping)."""

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
            },
        }

    def _message_size(
        self, round_: int, sender: str, published: Published, base_round: int = -1
    ) -> tuple[int, int]:
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
            base_round=base_round,
        )
        return len(data), values_sent(published.weights, published.masks)

    def _stops(self, agent_id: str, round_: int, weights: sparse.State, train_loss: float) -> bool:
        """Early stopping (ALGORITHMS.md 2): whether the agent stops after this round."""
        if not self.config.learning.early_stop:
            return False
        loss = self.learner.stopping_loss(weights, train_loss, self.data[agent_id])
        watch = self.stop_watches.get(agent_id, StopWatch())
        self.stop_watches[agent_id], stops = watch.after(loss, self.config.learning.stop_patience)
        if stops:
            self.stopped[agent_id] = round_
        return stops

    def _decentralized(self, progress: ProgressCallback | None) -> list[dict[str, Any]]:
        cfg = self.config.learning
        communicates = cfg.strategy != "local"
        # --wire delta: agents send deltas on what everyone holds of them (their
        # reconstruction, which is what `current` and `previous` then hold), to everyone.
        deltas = communicates and cfg.wire == "delta"
        # --wire layers: agents announce divergence vectors; receivers fetch chosen layers.
        layered = communicates and cfg.wire == "layers"
        votes_matter = self.learner.prunes_further
        vote_bytes = len(
            messages.encode(messages.Vote(fleet=FLEET, sender=self.roster[0], vote=True, score=0.0))
        )
        seed, roster = self.config.seed, self.roster
        previous = {
            k: self.learner.published(s, len(self.data[k].y_train)) for k, s in self.states.items()
        }
        previous_size = dict.fromkeys(roster, 0)  # round-0 models are derivable: never sent
        previous_divergence: dict[str, Announced] = {}
        deliveries, announcements = Deliveries(), Deliveries()
        layers_held: set[tuple[str, str, int, str]] = set()
        """--wire layers: (receiver, sender, round, layer) delivered."""
        layers_retained: set[tuple[str, int, str]] = set()
        """--wire layers: (sender, round, layer) published retained (it fits one frame): the
        broker hands it to every later asker, in any round."""
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
            divergence: dict[str, Announced] = {}
            layers_published: set[tuple[str, int, str]] = set()
            """(sender, round, layer) published this round and not retained (too big for one
            frame): one publish serves every neighbour asking in the same round."""
            traffic = {k: Traffic() for k in roster}
            results: dict[str, RoundResult] = {}
            for k in order:
                if k in self.stopped:  # its neighbours keep using its last model
                    current[k], size[k] = previous[k], 0
                    if layered:
                        divergence[k] = previous_divergence[k]
                    results[k] = idle_result(rounds[-1]["agents"][k], self.states[k])
                    continue
                prior, posterior = topology.prior_posterior(order, neighbours[k], k, cfg.max_wait)
                inbox = {j: current[j] for j in prior} | {j: previous[j] for j in posterior}
                if layered:
                    announced = {j: (t, divergence[j]) for j in prior}
                    announced |= {j: (t - 1, previous_divergence[j]) for j in posterior if t > 1}
                    inbox = self._fetch_layers(
                        k,
                        inbox,
                        announced,
                        traffic,
                        announcements,
                        layers_published,
                        layers_retained,
                        layers_held,
                    )
                for j in prior if not (deltas or layered) else ():
                    deliveries.count(traffic, k, j, t, size[j], self.stopped)
                for j in posterior if not (deltas or layered) else ():
                    deliveries.count(traffic, k, j, t - 1, previous_size[j], self.stopped)
                reduction = local_reduction(
                    self.learner,
                    self.budgets[k].p_k if k in self.budgets else None,
                    self.states[k].masks,
                )
                result = self.learner.local_round(
                    self.states[k],
                    self.data[k],
                    inbox,
                    t,
                    prune_now,
                    density_cap=reduction.density_cap,
                    active_fraction=reduction.active_fraction,
                )
                results[k] = result
                self.states[k] = result.state
                current[k] = sent_model(result.published, cfg.fp16)
                self._stops(k, t, result.state.weights, result.train_loss)
                if layered:
                    divergence[k] = self._announce(t, k, result, traffic)
                    announcements.final_size[k] = divergence[k].size
                    size[k] = 0
                elif deltas:
                    values, value_masks, current[k] = delta.encode_delta(
                        result.published, previous[k], cfg.delta_fraction, fp16=cfg.fp16
                    )
                    sent = Published(values, value_masks, result.published.num_samples)
                    size[k], nonzeros = self._message_size(t, k, sent, base_round=t - 1)
                    traffic[k].sent += size[k]
                    traffic[k].nonzeros_sent += nonzeros
                elif communicates:
                    size[k], nonzeros = self._message_size(t, k, result.published)
                    deliveries.final_size[k] = size[k]
                    traffic[k].sent += size[k]
                    traffic[k].nonzeros_sent += nonzeros
                else:
                    size[k] = 0
                if progress:
                    progress(t, k)
            if deltas:  # every running agent follows every peer
                for k in roster:
                    if self.stopped.get(k, t) >= t:
                        traffic[k].received += sum(size[j] for j in roster if j != k)
            if votes_matter:
                voters = [k for k in roster if results[k].vote is not None]
                for k in voters:
                    traffic[k].sent += vote_bytes
                    traffic[k].received += vote_bytes * (len(voters) - 1)
                votes = {k: bool(results[k].vote) for k in voters}
                active = [k for k in roster if self.stopped.get(k, t) >= t]
                self.plan.observe(t, pruning.tally(votes, active, cfg.delta_v))
            previous, previous_size, previous_divergence = current, size, divergence
            rounds.append(self._round_record(t, results, traffic, order))
            if len(self.stopped) == len(roster):
                break
        return rounds

    def _announce(
        self, t: int, k: str, result: RoundResult, traffic: dict[str, Traffic]
    ) -> Announced:
        """Publish agent k's round-t divergence vector (`--wire layers`), once for all."""
        assert result.divergence is not None
        size = len(
            divergence_message(
                fleet=FLEET, sender=k, run_id="sim", round_=t, divergence=result.divergence
            )
        )
        traffic[k].sent += size
        return Announced(t, result.divergence, size)

    def _fetch_layers(
        self,
        k: str,
        models: dict[str, Published],
        announced: dict[str, tuple[int, Announced]],
        traffic: dict[str, Traffic],
        announcements: Deliveries,
        published: set[tuple[str, int, str]],
        retained: set[tuple[str, int, str]],
        held: set[tuple[str, str, int, str]],
    ) -> dict[str, Published]:
        """Agent k's inbox under `--wire layers`: it receives the divergence vectors of its
        neighbours' models (round-0 models are derivable and taken whole), picks per layer the
        `ldf_n` most diverged, asks each neighbour for its picked layers and gets them.
        `announced` maps each neighbour to the round k needs and the vector standing for it
        (an agent that stopped early stands in with its last). A layer that fits one frame
        goes out once, retained, for all who ask in any round (`retained`); a bigger one once
        per round for all who ask (`published`: agents batch requests, so in emulate a
        neighbour asking much later costs another publish). k never fetches a layer it
        `held`. Whether a layer fits one frame is judged on the simulator's unsigned message;
        an agent's header (run id, signature) is a few dozen bytes longer."""
        inbox = {j: m for j, m in models.items() if j not in announced}
        for j, (needed, a) in announced.items():
            announcements.count(traffic, k, j, needed, a.size, self.stopped)
        chosen = (
            ldf.select_layers(
                {j: a.values for j, (_, a) in announced.items()}, self.config.learning.ldf_n
            )
            if announced
            else {}
        )
        for j, layers in chosen.items():
            if not layers:
                continue
            r = announced[j][1].round
            inbox[j] = self.learner.layer_part(models[j], layers)
            fetch = [layer for layer in layers if (k, j, r, layer) not in held]
            if not fetch:
                continue
            ask = messages.Request(
                fleet=FLEET, sender=k, run_id="sim", round=r, target=j, layers=fetch
            )
            request = len(messages.encode(ask))
            traffic[k].sent += request
            traffic[j].received += request
            for layer in fetch:
                size, values = self._message_size(r, j, self.learner.layer_part(models[j], [layer]))
                held.add((k, j, r, layer))
                traffic[k].received += size
                served = retained if fits_one_frame(size) else published
                if (j, r, layer) not in served:
                    served.add((j, r, layer))
                    traffic[j].sent += size
                    traffic[j].nonzeros_sent += values
        return inbox

    def _centralized(self, progress: ProgressCallback | None) -> list[dict[str, Any]]:
        """The rounds of `agent.central`'s contract in one process: downloads, fits,
        (selection and responses), aggregation. Traffic is the real messages: requests and
        downloads, uploads (FedLDF: divergence vectors, requests, selected layers), one
        broadcast."""
        strategy = central_strategy(self.config.learning.strategy)
        server = strategy.init_server(self.learner)
        fp16 = self.config.learning.fp16
        p_k: dict[str, float] = {}  # what each agent trained with (budget or static tier)
        rounds: list[dict[str, Any]] = []
        for t in range(1, self.config.learning.rounds + 1):
            traffic = {k: Traffic() for k in [*self.roster, COORDINATOR]}
            results: dict[str, RoundResult] = {}
            fits: dict[str, Fit] = {}
            downloads: dict[str, Payload] = {}
            for k in self.roster:
                if k in self.stopped:
                    results[k] = idle_result(rounds[-1]["agents"][k], self.states[k])
                    continue
                p_k[k] = self.budgets[k].p_k if k in self.budgets else static_tier(self.roster, k)
                view = server
                if strategy.downloads:
                    downloads[k] = strategy.download(self.learner, server, k, t, p_k[k])
                    view = ServerState(as_sent(downloads[k], fp16).weights)
                fits[k] = strategy.fit(self.learner, self.states[k], self.data[k], view, t, p_k[k])
                self.states[k] = fits[k].state
                if progress:
                    progress(t, k)
            requests: dict[str, list[str]] = {}
            previous_server = server
            if strategy.asks_layers:
                selected = strategy.select(
                    self.learner, {k: f.divergence or {} for k, f in fits.items()}
                )
                requests = {k: layers for k, layers in selected.items() if layers}
                payloads = {
                    k: strategy.respond(self.learner, f, requests.get(k, []))
                    for k, f in fits.items()
                }
            else:
                payloads = {k: f.upload for k, f in fits.items()}
            # What the aggregator decodes (fp16 on the wire rounds the values).
            uploads = {
                k: Upload(as_sent(payload, fp16), fits[k].num_samples)
                for k, payload in payloads.items()
            }
            aggregate = strategy.aggregate(self.learner, server, uploads)
            server = aggregate.server
            if strategy.broadcasts:  # the state participants hold (fp16 rounds the broadcast)
                sent = as_sent(aggregate.broadcast, fp16)
                server = strategy.receive(previous_server, sent)
            self._central_traffic(t, fits, uploads, downloads, requests, aggregate, traffic)
            for k, fit in fits.items():
                evaluated = fit.state.weights if strategy.personal else server.weights
                loss, accuracy = self.learner.evaluate_on(evaluated, self.data[k])
                results[k] = RoundResult(
                    state=fit.state,
                    published=Published(fit.state.weights, None, fit.num_samples),
                    loss=loss,
                    accuracy=accuracy,
                    train_loss=fit.train_loss,
                    train_flops=fit.train_flops,
                    vote=None,
                    score=None,
                    pruned=False,
                )
                self._stops(k, t, fit.state.weights, fit.train_loss)
            rounds.append(self._round_record(t, results, traffic, self.roster, p_k))
            if len(self.stopped) == len(self.roster):
                break
        return rounds

    def _payload_size(
        self, kind: type[messages.Message], t: int, sender: str, payload: Payload
    ) -> int:
        body = encode_state(payload.weights, payload.masks, fp16=self.config.learning.fp16)
        header = {"fleet": FLEET, "sender": sender, "run_id": "sim", "round": t}
        if kind is messages.Global:
            return len(messages.encode(messages.Global(**header, tensors=body)))
        return len(messages.encode(messages.Update(**header, tensors=body, num_samples=1)))

    def _central_traffic(
        self,
        t: int,
        fits: dict[str, Fit],
        uploads: dict[str, Upload],
        downloads: dict[str, Payload],
        requests: dict[str, list[str]],
        aggregate: Aggregate,
        traffic: dict[str, Traffic],
    ) -> None:
        coordinator = traffic[COORDINATOR]
        header = {"fleet": FLEET, "run_id": "sim", "round": t}
        broadcast = 0
        if aggregate.broadcast.weights:
            payload = aggregate.broadcast
            broadcast = self._payload_size(messages.Global, t, COORDINATOR, payload)
            coordinator.sent += broadcast
            coordinator.nonzeros_sent += values_sent(payload.weights, payload.masks)
        for k, fit in fits.items():
            up = down = 0
            sent = uploads[k].payload
            if sent.weights:
                up += self._payload_size(messages.Update, t, k, sent)
                traffic[k].nonzeros_sent += values_sent(sent.weights, sent.masks)
            if fit.divergence is not None:
                up += len(
                    divergence_message(
                        fleet=FLEET, sender=k, run_id="sim", round_=t, divergence=fit.divergence
                    )
                )
            if k in downloads:
                asked = messages.Request(**header, sender=k, target=COORDINATOR, fraction=1.0)
                up += len(messages.encode(asked))
                size = self._payload_size(messages.Global, t, COORDINATOR, downloads[k])
                down += size
                coordinator.sent += size
                coordinator.nonzeros_sent += values_sent(downloads[k].weights, downloads[k].masks)
            if k in requests:
                request = messages.Request(
                    **header, sender=COORDINATOR, target=k, layers=requests[k]
                )
                size = len(messages.encode(request))
                down += size
                coordinator.sent += size
            down += broadcast
            traffic[k].sent += up
            traffic[k].received += down
            coordinator.received += up

    def _round_record(
        self,
        t: int,
        results: dict[str, RoundResult],
        traffic: dict[str, Traffic],
        order: list[str],
        p_k: dict[str, float] | None = None,
    ) -> dict[str, Any]:
        p_k = {k: b.p_k for k, b in self.budgets.items()} | (p_k or {})
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
                "p_k": p_k.get(k, 1.0),
                "vote": r.vote,
                "score": r.score,
                "pruned": r.pruned,
                "stopped": k in self.stopped,
            }
        record: dict[str, Any] = {"round": t, "order": order, "agents": agents}
        if COORDINATOR in traffic:
            record["coordinator"] = dataclasses.asdict(traffic[COORDINATOR])
        record["t_star"] = self.plan.t_star
        return record


def sent_model(published: Published, fp16: bool) -> Published:
    """A model as its receivers decode it (fp16 on the wire rounds its values)."""
    if not fp16:
        return published
    rounded = as_sent(Payload(published.weights), fp16).weights
    return Published(rounded, published.masks, published.num_samples)


def idle_result(last: dict[str, Any], state: sparse.State) -> RoundResult:
    """A stopped agent's round: it keeps its model and figures, and spends nothing."""
    return RoundResult(
        state=state,
        published=Published(state.weights, state.masks, 0),
        loss=last["loss"],
        accuracy=last["accuracy"],
        train_loss=last["train_loss"],
        train_flops=0,
        vote=None,
        score=None,
        pruned=False,
    )


def stopped_summary(
    rounds: list[dict[str, Any]], stopped: dict[str, int], limit: int
) -> dict[str, dict[str, Any]]:
    """Per agent stopped early: when, and what it saved (`early_stop_savings`)."""
    return {
        agent_id: early_stop_savings(
            [r["agents"][agent_id] for r in rounds[:round_]], round_, limit
        )
        for agent_id, round_ in sorted(stopped.items())
    }


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
