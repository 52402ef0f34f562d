"""`coordinator simulate`: a whole fleet in one process, for fast research sweeps.

The loops below are the round structure of ALGORITHMS.md section 1 with the network taken
out, and read top to bottom in algorithm order. A decentralized round processes agents in the
round's reuse order, so an agent's prior neighbours have already published this round's model
when it runs, and everyone else's model is last round's. The rules of a round are
`agent.learning.rounds`, which the networked agent calls too; traffic is the size of the real
encoded messages an agent would send (`coordinator.traffic`, one model per wire format).
Asynchronous decentralized rounds (`--asynchronous`) run in the order of a virtual clock
instead (`coordinator.async_rounds`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agent.device import Budget
from agent.device.calibration import measure_costs
from agent.device.throttle import ENERGY_SOURCE, round_energy
from agent.experiment import ExperimentConfig, agent_profiles, attackers
from agent.learning import (
    AgentState,
    CentralStrategy,
    EarlyStop,
    Fit,
    Learner,
    LocalData,
    Payload,
    Published,
    Reduction,
    RoundResult,
    RoundTopology,
    ServerState,
    Upload,
    as_sent,
    attacked,
    attacked_upload,
    backdoor,
    central_strategy,
    live,
    privacy,
    pruning,
    robust,
    robust_rules,
    running,
    settle_votes,
    sparse,
)
from agent.learning.central.participant import Turn, judge
from agent.learning.central.server import RoundInbox, conclude, gather, participants
from agent.learning.costs import CostTable
from agent.learning.kept import Judged
from agent.learning.reduction import measured_kinds
from agent.learning.reductions import MEASURED_MODES
from agent.learning.screening import Screening, ScreeningLog
from agent.report import (
    COORDINATOR,
    AgentRound,
    Traffic,
    honest_summary,
    named_for_task,
    reported_p_k,
    screened_uploads,
    stopped_summary,
    summarize,
)
from agent.time_to_target import with_time_to_target
from agent.workload import Workload, build_workload, nominal_budgets
from coordinator.async_rounds import AsynchronousRun
from coordinator.buffered_sim_secure import buffered_loop
from coordinator.ray_backend import BACKENDS, RayTraining, require_ray
from coordinator.secure_sim import SecureInProcessInbox, count_traffic
from coordinator.traffic import CentralTraffic, LocalWire, wire_traffic
from coordinator.training_pool import (
    FitJob,
    InProcess,
    RoundJob,
    States,
    StateStore,
    Training,
    training_on,
    when_ready,
)
from coordinator.virtual_times import on_virtual_clock
from protocol.log_context import agent_scope

if TYPE_CHECKING:
    from firmware_profiles import DeviceProfile

__all__ = ["ExperimentConfig", "ProgressCallback", "Simulation", "simulate"]

log = logging.getLogger(__name__)

ProgressCallback = Callable[[int, str], None]
"""Called with (round, agent) after each agent's round."""
RoundsRunner = Callable[[ProgressCallback | None], list[dict[str, Any]]]
"""A way of running a simulation's rounds, which reports progress to the callback."""


def check_backend(workers: int, backend: str, ray_address: str | None) -> None:
    """Where a simulation trains its agents: one clear sentence for a bad choice."""
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    if backend not in BACKENDS:
        raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if ray_address is not None and backend != "ray":
        raise ValueError("--ray-address needs --backend ray")
    if backend == "ray":
        require_ray()


class LateJudge:
    """Judges a centralized participant's round (`judge`) a round late, as the simulator does
    while the next round trains, when the participant's state no longer carries the kept
    average of `--dp-average` (`AgentState.averaged`): this holds each participant's from one
    judgement to the next, as the networked participant's own state does."""

    def __init__(self) -> None:
        self.averages: dict[str, sparse.State | None] = {}

    def __call__(
        self,
        strategy: CentralStrategy,
        learner: Learner,
        fit: Fit,
        server: ServerState,
        k: str,
        data: LocalData,
    ) -> Judged:
        carried = dataclasses.replace(fit.state, averaged=self.averages.get(k))
        state, judged = judge(
            strategy, learner, dataclasses.replace(fit, state=carried), server, data
        )
        self.averages[k] = state.averaged
        return judged


class Simulation:
    """One run: builds the fleet, runs the rounds, and collects the report."""

    def __init__(
        self,
        config: ExperimentConfig,
        workers: int = 1,
        backend: str = "local",
        ray_address: str | None = None,
    ) -> None:
        config.validate()
        check_backend(workers, backend, ray_address)
        self.config = config
        cfg = config.learning
        self.roster = [f"agent-{k:03d}" for k in range(config.agents)]
        workload = build_workload(config, self.roster)
        self.model_name = workload.model_name
        self.learner = workload.learner
        self.data = workload.data
        self.budgets = nominal_budgets(config, workload, self.roster)
        self.costs = measured_costs(config, workload) if self.budgets else None
        self.profiles = agent_profiles(config, self.roster)
        """Each agent's board, whose model gives its energy (none without --profiles)."""
        self.states: StateStore = States(
            {agent_id: self.learner.init_agent(agent_id) for agent_id in self.roster}
        )
        """Each agent's state between rounds: held here, or, with the Ray backend while the
        run runs, in Ray's object store (`RayTraining.keep`)."""
        self.plan = pruning.PruningPlan(cfg.rounds, cfg.schedule_b, cfg.schedule_c)
        self.early_stops = {k: EarlyStop.of(cfg) for k in self.roster}
        self.stopped: dict[str, int] = {}
        """Agent -> the round after which it stopped (early stopping, its privacy budget)."""
        self.stop_reasons: dict[str, str] = {}
        """Agent -> why it stopped, when its privacy budget was spent (`--max-epsilon`)."""
        self.late_judge = LateJudge()
        samples = {k: len(self.data[k].y_train) for k in self.roster}
        privacy.check_run(cfg, self.learner.facts.model, samples)
        self.last: dict[str, AgentRound] = {}
        """Each agent's latest round, which a stopped agent's later rounds repeat."""
        self.attackers = attackers(config, self.roster)
        """The agents that send poisoned models (`--attackers`)."""
        self.workers = workers
        """Processes that train agents' rounds at once (`TrainingPool`); 1: all here. With
        the Ray backend and no address: the CPUs of the Ray started here (1: all)."""
        self.backend, self.ray_address = backend, ray_address
        """Where the agents train: `local` (here or the pool) or `ray` (`RayTraining`, on
        the cluster at `ray_address`, else on a Ray started here)."""
        strategy = central_strategy(cfg.strategy) if self.centralized else None
        self.training: Training = InProcess(self.learner, self.data, strategy)
        """Where the agents train: here, or (while a run with workers runs) a pool."""
        self.screening_log = ScreeningLog(cfg, self.centralized)

    @property
    def centralized(self) -> bool:
        """Whether a coordinator aggregates (the strategies of `agent.learning.central`)."""
        return self.learner.traits.centralized

    def run(self, progress: ProgressCallback | None = None) -> dict[str, Any]:
        started = time.perf_counter()
        run_rounds = rounds_runner(self)
        with training_for(self) as self.training:
            self.states = self.training.keep(self.states)
            rounds = run_rounds(progress)
            backdoor = backdoor_summary(self)
        report = {
            "config": {
                **dataclasses.asdict(self.config),
                "model": self.model_name,
                "roster": self.roster,
            },
            "rounds": rounds,
            "summary": {
                **summarize(rounds, self.plan.t_star, time.perf_counter() - started),
                "stopped": stopped_summary(rounds, self.stopped, self.config.learning.rounds),
                **honest_summary(rounds, self.attackers),
                **backdoor,
            },
        }
        report = named_for_task(on_virtual_clock(report, self), self.learner.facts.task)
        return with_time_to_target(report, None, 0.0, clock="virtual")

    # ------------------------------------------------------------------ decentralized rounds

    def _early_stop(
        self, k: str, t: int, state: AgentState, train_loss: float, pruned: bool = False
    ) -> None:
        """Early stopping (ALGORITHMS.md 2): record that k stops after round t, if it does;
        a round that `pruned` k's model restarts its rule's window. Under `--max-epsilon`, k
        stops too once its next round would pass it (`privacy.budget_spent`)."""
        samples = len(self.data[k].y_train)
        spent = privacy.budget_spent(self.config.learning, samples, state.dp_steps)
        if spent is not None:
            self.stopped[k], self.stop_reasons[k] = t, spent
            return
        stops = self.early_stops[k].after
        if stops(self.learner.facts, state.weights, train_loss, self.data[k], pruned):
            self.stopped[k] = t

    def _start_round(
        self, k: str, topology: RoundTopology, inbox: dict[str, Published]
    ) -> Future[tuple[RoundResult, Reduction]]:
        """Agent k's local round on `inbox`, cut to its budget, started."""
        t, prune_now = topology.round, self.plan.is_pruning_round(topology.round)
        state = self.states.held(k)
        job = RoundJob(k, state, inbox, t, prune_now, self.budgets.get(k), self.costs)
        return self.training.local_round(job)

    def finish_round(
        self, k: str, t: int, result: RoundResult, reduction: Reduction
    ) -> tuple[RoundResult, AgentRound]:
        """Keep agent k's round: its state, early stopping, figures; what it sends (poisoned
        if it is an attacker)."""
        before = self.states[k].weights if k in self.attackers else {}
        self.states[k] = result.state
        with agent_scope(k):
            if result.recovered:
                log.warning("round %d: model not finite; kept its model from before", t)
            self.screening_log.say(t, result.screening)
        self._early_stop(k, t, result.state, result.train_loss, result.pruned)
        p_k = reported_p_k(p_k_of(self.budgets, k), self.learner.traits.budgets)
        record = AgentRound.of_result(t, k, result, reduction, p_k)
        if k in self.attackers:
            pooled = colluders(self, self.states)
            result = attacked(self.learner, result, self.config.attack, t, before, pooled)
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
            wire.begin(t)
            current: dict[str, Published] = {}
            for k in topology.order:
                if not running(k, t, self.stopped):  # nobody waits for it: it is left out
                    current[k] = previous[k]
                    wire.sat_out(k)
            ran: dict[str, AgentRound] = {}
            for k, result, ran[k] in self._local_rounds(topology, wire, current, previous):
                current[k] = wire.publish(k, t, result, previous[k])
                if progress:
                    progress(t, k)
            self._vote(t, ran, wire)
            rounds.append(self.round_record(t, topology.order, ran, wire.end(t)))
            previous = current
            if len(self.stopped) == len(self.roster):
                break
        return rounds

    def _local_rounds(
        self,
        topology: RoundTopology,
        wire: LocalWire,
        current: dict[str, Published],
        previous: dict[str, Published],
    ) -> Iterator[tuple[str, RoundResult, AgentRound]]:
        """The running agents' local rounds (those not in `current`), each with its figures.
        An agent's round starts once its prior neighbours are in `current`, which the caller
        fills with each result before asking for the next (`when_ready`): here that is reuse
        order; with workers, the earliest agents in it whose inboxes are complete train at
        once. Every agent's round depends only on its inbox, so the report is the same."""
        order = [k for k in topology.order if k not in current]

        def start(k: str) -> Future[tuple[RoundResult, Reduction]]:
            needs = sorted(live(topology.needs(k), self.stopped))
            inbox = {j: (current if r == topology.round else previous)[j] for r, j in needs}
            return self._start_round(k, topology, wire.receive(k, topology, inbox))

        waits_for = {k: set(topology.prior_posterior(k)[0]) - current.keys() for k in order}
        slots, started = self.training.slots, self.training.started
        for k, (result, reduction) in when_ready(order, waits_for, start, slots, started):
            yield k, *self.finish_round(k, topology.round, result, reduction)

    # -------------------------------------------------------------------- centralized rounds

    def _job(
        self, strategy: CentralStrategy, server: ServerState, k: str, t: int
    ) -> tuple[FitJob, Payload | None]:
        """Participant k's fit to run, after its download (if the strategy has one)."""
        turn = Turn.of(k, t, self.roster, p_k_of(self.budgets, k))
        download, part = None, None
        if strategy.downloads:
            download = strategy.download(self.learner.facts, server, k, t, turn.p_k)
            part = as_sent(download, self.config.learning.fp16)
        samples = len(self.data[k].y_train)
        return FitJob(turn, self.states.held(k), turn.view(server, part), samples), download

    def _centralized(self, progress: ProgressCallback | None) -> list[dict[str, Any]]:
        """The rounds of `agent.learning.central`'s contract in one process: the server's
        steps (`central.server`: participants, downloads, `gather` from the fits, `conclude`)
        as the aggregator takes them over MQTT, the participants' (`central.participant`:
        `Turn.of`, `Turn.train`, `judge`) as the networked agent does, each message's cost
        counted (`CentralTraffic`). A round's judging, which the next round does not need, is
        done while its fits train (`report_round`). FedBuff's versions: `buffered_loop`."""
        cfg = self.config.learning
        strategy = central_strategy(cfg.strategy)
        if self.learner.traits.buffered:  # asynchronous: versions on a virtual clock
            return buffered_loop(self, strategy).rounds(progress)
        server = strategy.init_server(self.learner.facts)
        wire = CentralTraffic(self.roster, cfg.fp16)
        rounds: list[dict[str, Any]] = []
        report_round: Callable[[], None] = lambda: None  # noqa: E731 (no round yet)
        for t in range(1, cfg.rounds + 1):
            jobs: dict[str, FitJob] = {}
            downloads: dict[str, Payload] = {}
            for k in participants(self.roster, t, self.stopped):
                jobs[k], download = self._job(strategy, server, k, t)
                if download is not None:
                    downloads[k] = download
            fits: dict[str, Fit] = {}
            for k, fit in self.training.fit(list(jobs.values()), report_round):
                fits[k], self.states[k] = fit, fit.state
                if progress:
                    progress(t, k)
            inbox: RoundInbox = (
                SecureInProcessInbox(self, strategy, fits, t, server, downloads)
                if cfg.secure_aggregation
                else InProcessInbox(self, strategy, fits, t, server.weights)
            )
            requests, uploads = gather(strategy, self.learner, inbox)
            aggregate, server, screening = conclude(
                strategy, self.learner, server, uploads, t, cfg.fp16, self.screening_log
            )
            if isinstance(inbox, SecureInProcessInbox):  # its messages instead of the uploads
                uploads = {k: Upload(Payload({}), f.num_samples) for k, f in fits.items()}
                requests = inbox.asked or requests  # FedLDF asks everyone, for nothing too
            traffic = wire.round(t, fits, uploads, downloads, requests, aggregate)
            if isinstance(inbox, SecureInProcessInbox):
                count_traffic(inbox, traffic)
            for k, fit in fits.items():
                self._early_stop(k, t, fit.state, fit.train_loss)
            report_round = functools.partial(
                self._report_round, rounds, t, strategy, server, jobs, fits, traffic, screening
            )
            if len(self.stopped) == len(self.roster):
                break
        report_round()
        return rounds

    def _report_round(
        self,
        rounds: list[dict[str, Any]],
        t: int,
        strategy: CentralStrategy,
        server: ServerState,
        jobs: dict[str, FitJob],
        fits: dict[str, Fit],
        traffic: dict[str, Traffic],
        screening: Screening,
    ) -> None:
        """Judge round t's participants (`judge`: the model each keeps, against the server
        after the round) and add the round to `rounds` with what the defence screened."""
        ran = {}
        for k, fit in fits.items():
            judged = self.late_judge(strategy, self.learner, fit, server, k, self.data[k])
            ran[k] = AgentRound.of_fit(jobs[k].turn, fit, judged, self.learner.traits.budgets)
        record = self.round_record(t, self.roster, ran, traffic)
        rounds.append(record | screened_uploads(screening.screened, screening.clipped))

    # ------------------------------------------------------------------------------- report

    def round_record(
        self, t: int, order: list[str], ran: dict[str, AgentRound], traffic: dict[str, Traffic]
    ) -> dict[str, Any]:
        """The report's round t: every agent's figures (one that stopped early repeats its
        last, and spends only what it re-sends), and the coordinator's traffic if any."""
        agents = {}
        for k in self.roster:
            spent = traffic[k]
            self.last[k] = with_energy(
                self.profiles,
                dataclasses.replace(
                    ran[k] if k in ran else self.last[k].idle(t),
                    bytes_sent=spent.sent,
                    bytes_received=spent.received,
                    nonzeros_sent=spent.nonzeros_sent,
                    stopped=self.stopped.get(k, t + 1) <= t,
                    stop_reason=self.stop_reasons.get(k, ""),
                ),
            )
            agents[k] = self.last[k].report_entry()
        record: dict[str, Any] = {"round": t, "order": order, "agents": agents}
        if COORDINATOR in traffic:
            record["coordinator"] = dataclasses.asdict(traffic[COORDINATOR])
        record["t_star"] = self.plan.t_star
        return record


@dataclass(frozen=True)
class InProcessInbox:
    """A simulated round's participants as the server's inbox (`RoundInbox`): what each sends
    of its fit, as the aggregator decodes it (fp16 on the wire rounds the values); an
    attacker's upload is poisoned around `reference`, the global model it trained from
    (`attacked_upload`)."""

    run: Simulation
    strategy: CentralStrategy
    fits: dict[str, Fit]
    round: int
    reference: sparse.State

    def divergences(self) -> dict[str, dict[str, float]]:
        return {k: f.divergence or {} for k, f in self.fits.items()}

    def uploads(self, requests: Mapping[str, list[str]] | None) -> dict[str, Upload]:
        """Every participant's upload: its fit's, or (FedLDF) its response to its request
        (none: an empty one)."""
        run, fits = self.run, self.fits
        payloads = {k: f.upload for k, f in fits.items()}
        if requests is not None:
            respond = self.strategy.respond
            payloads = {
                k: respond(run.learner.facts, f, requests.get(k, [])) for k, f in fits.items()
            }
        sent = {k: Upload(p, fits[k].num_samples) for k, p in payloads.items()}
        attack, pooled = run.config.attack, colluders(run, payloads)
        for k in set(run.attackers) & set(payloads):
            sent[k] = attacked_upload(
                run.learner, sent[k], attack, k, self.round, self.reference, pooled
            )
        fp16 = run.config.learning.fp16
        return {k: Upload(as_sent(u.payload, fp16), u.num_samples) for k, u in sent.items()}


def training_for(run: Simulation) -> contextlib.AbstractContextManager[Training]:
    """Where a run's agents train, for the run (see `Simulation.backend`)."""
    if run.backend == "ray":
        return RayTraining(run.config, run.roster, run.workers, run.ray_address)
    return training_on(run.workers, run.training, run.config, run.roster)


def rounds_runner(run: Simulation) -> RoundsRunner:
    """How `run` runs its rounds: centralized, decentralized in reuse order, or asynchronous
    decentralized ones (`--asynchronous`) in the order of a virtual clock
    (`coordinator.async_rounds`)."""
    if run.centralized:
        return run._centralized
    if run.config.learning.asynchronous:
        return AsynchronousRun(run).rounds
    return run._decentralized


def p_k_of(budgets: dict[str, Budget], k: str) -> float | None:
    """Agent k's nominal budget p_k (none: it trains whole)."""
    return budgets[k].p_k if k in budgets else None


def measured_costs(config: ExperimentConfig, workload: Workload) -> CostTable | None:
    """The host's cost table when `--reduce` chooses by measured costs (prefix, width,
    auto) in a decentralized run, measured here on the first agent's data (one table for
    every simulated agent: they share the host); else None."""
    cfg = config.learning
    if cfg.reduce not in MEASURED_MODES or workload.learner.traits.centralized:
        return None
    data = workload.data[min(workload.data)]
    return measure_costs(workload.learner.facts, data, kinds=measured_kinds(cfg.reduce))


def with_energy(profiles: dict[str, DeviceProfile], spent: AgentRound) -> AgentRound:
    """`spent` with the energy its board's model gives its FLOPs and bytes (the emulated agent
    computes the same, `Throttle.round_energy`); unchanged without a profile."""
    if spent.agent not in profiles:
        return spent
    traffic = spent.bytes_sent + spent.bytes_received
    energy, radio = round_energy(profiles[spent.agent], spent.train_flops, traffic)
    return dataclasses.replace(
        spent, energy_j=energy, radio_energy_j=radio, energy_source=ENERGY_SOURCE
    )


def colluders(
    run: Simulation, honest: Mapping[str, AgentState] | Mapping[str, Payload]
) -> robust.Colluders | None:
    """Under `--attack alie`, what the run's attackers pool: their honest models (of
    `honest`: each agent's latest state or upload) and the z of the fleet's size and theirs."""
    if run.config.attack != "alie":
        return None
    z = robust_rules.alie_z(len(run.roster), len(run.attackers))
    return robust.Colluders([honest[k].weights for k in sorted(run.attackers) if k in honest], z)


def backdoor_summary(run: Simulation) -> dict[str, Any]:
    """Under a trigger attack (`--attack backdoor` or `replace`), the trigger's success on
    the honest agents' final models (`backdoor.honest_summary`; with no attacker, the rate
    at which clean models take a triggered sample for the target class anyway); nothing
    otherwise."""
    if run.config.attack not in robust_rules.TRIGGER_ATTACKS:
        return {}
    return backdoor.honest_summary(run.learner.facts.model, run.states, run.data, run.attackers)


def simulate(
    config: ExperimentConfig,
    progress: ProgressCallback | None = None,
    workers: int = 1,
    backend: str = "local",
    ray_address: str | None = None,
) -> dict[str, Any]:
    """Run one simulated experiment and return its report (config, rounds, summary); its
    agents train in `workers` processes, or on Ray (`backend`; the same report)."""
    return Simulation(config, workers, backend, ray_address).run(progress)
