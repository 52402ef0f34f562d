"""`coordinator simulate` for a buffered asynchronous strategy (FedBuff): an event-driven loop
on the virtual clock (`coordinator.virtual_clock`) in place of the synchronous rounds.

Every agent starts its first update at virtual time 0 from version 0 (the initial model). An
update trained from version b on agent k, started at time t, arrives at
`clock.finish(k, t, clock.seconds(k, FLOPs, bytes))`; arrivals are taken in time order, ties
broken by the roster's order, then the update's number (deterministic whatever the workers).
Each arrival is offered to the server's buffer (`fedbuff.Buffer`); the agent then holds the
newest version (its download) and starts its next update from it at once. The run ends when
the server has applied `--rounds` versions; updates still in flight then are dropped.

The report has one round per applied version: each agent's entry is its latest update's
record (its `staleness` at arrival and its virtual `finished_at`), and an agent with no
update in yet is judged on the version it holds. What matches a run over MQTT (`coordinator
emulate`): the rule, given the same arrival order; the arrival order itself cannot be
bit-equal (real time), and an update's number seeds its local training on both sides.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from agent.device.throttle import ENERGY_SOURCE, round_energy
from agent.experiment import ExperimentConfig
from agent.learning import CentralStrategy, Fit, Learner, LocalData, Payload, Upload, as_sent
from agent.learning.central.fedbuff import Buffer, as_buffered
from agent.learning.central.participant import Turn, judge
from agent.report import COORDINATOR, AgentRound, Traffic
from agent.runtime.codec import encode_state
from coordinator.training_pool import FitJob, StateStore, Training
from coordinator.virtual_clock import VirtualClock
from protocol import messages

if TYPE_CHECKING:
    from firmware_profiles import DeviceProfile


class Simulation(Protocol):
    """What the loop needs of `coordinator.simulate.Simulation`."""

    config: ExperimentConfig
    roster: list[str]
    learner: Learner
    data: dict[str, LocalData]
    states: StateStore
    training: Training
    profiles: dict[str, DeviceProfile]


_FLEET, _RUN = "sim", "sim"


@dataclass(frozen=True)
class InFlight:
    """An update being trained: its fit, the version it trained from, when it started."""

    turn: Turn
    fit: Fit
    base: int
    start: float
    received: int
    """Bytes of the global version it trained from, if new to it (0: version 0, or the one
    its last update trained from): the link time its clock counts."""
    sent: int
    """Bytes of its upload."""


def model_message_bytes(
    run: Simulation, kind: type[messages.Message], payload: Payload | None = None
) -> int:
    """The size of an `Update` or `Global` carrying `payload`, by default the whole model
    (what every FedBuff message is)."""
    if payload is None:
        payload = Payload(run.learner.facts.initial)
    body = encode_state(payload.weights, payload.masks, fp16=run.config.learning.fp16)
    header: dict[str, Any] = {"fleet": _FLEET, "sender": "agent", "run_id": _RUN, "round": 1}
    if kind is messages.Global:
        message: messages.Message = messages.Global(**header, tensors=body)
    else:
        message = messages.Update(**header, tensors=body, num_samples=1, base_version=0)
    return len(messages.encode(message))


class BufferedLoop:
    """One simulated FedBuff run (`run`)."""

    def __init__(self, run: Simulation, strategy: CentralStrategy) -> None:
        self.run, self.strategy = run, strategy
        facts = run.learner.facts
        buffered = as_buffered(strategy)
        server = strategy.init_server(facts)
        self.buffer = Buffer.of(facts, server, len(run.roster), buffered.update_delta)
        self.clock = VirtualClock.of(run.config, run.roster)
        self.upload_bytes: int | None = model_message_bytes(run, messages.Update)
        """An upload's size; None where its masks size each one (FedBuff-SSM's)."""
        if strategy.upload_layout(facts) is None:
            self.upload_bytes = None
        version = buffered.version_payload(server)
        self.global_bytes = model_message_bytes(run, messages.Global, version)
        self.events: list[tuple[float, int, int]] = []
        """(arrival time, roster index, update number) of every update in flight."""
        self.flying: dict[str, InFlight] = {}
        self.updates = dict.fromkeys(run.roster, 0)
        """Updates each agent started."""
        self.latest: dict[str, dict[str, Any]] = {}
        """Each agent's latest update's report entry."""
        self.spent = {k: Traffic() for k in [*run.roster, COORDINATOR]}
        """Traffic since the last version."""
        self.bases: dict[str, int] = {}
        """The version each agent's latest update trained from."""

    def start(self, agents: list[str], now: float) -> None:
        """`agents` start their next update at `now`, from the server's newest version."""
        run, base = self.run, self.buffer.version
        jobs = []
        for k in agents:
            self.updates[k] += 1
            turn = Turn.of(k, self.updates[k], run.roster, None)
            samples = len(run.data[k].y_train)
            jobs.append(FitJob(turn, run.states.held(k), self.buffer.server, samples))
        for job, (k, fit) in zip(jobs, run.training.fit(jobs, lambda: None), strict=True):
            received = self.global_bytes if base > self.bases.get(k, 0) else 0
            self.bases[k] = base
            sent = self.upload_bytes or model_message_bytes(run, messages.Update, fit.upload)
            work = fit.train_flops + fit.fallback_flops
            seconds = self.clock.seconds(k, work, sent + received)
            arrival = self.clock.finish(k, now, seconds)
            self.flying[k] = InFlight(job.turn, fit, base, now, received, sent)
            heapq.heappush(self.events, (arrival, run.roster.index(k), self.updates[k]))

    def arrive(self, k: str, at: float) -> int | None:
        """Agent k's update arrives at `at`: offered to the buffer, recorded, and its next
        update started (unless the run is over); the version it made the server apply."""
        run, flying = self.run, self.flying.pop(k)
        fit = flying.fit
        fp16 = run.config.learning.fp16
        offer = self.buffer.offer(
            k, Upload(as_sent(fit.upload, fp16), fit.num_samples), flying.base
        )
        self.spent[k].sent += flying.sent
        self.spent[COORDINATOR].received += flying.sent
        self.settle(k, flying, at, offer.staleness)
        self.go_on([k], at)
        return offer.version

    def go_on(self, agents: list[str], at: float) -> None:
        """`agents` start their next update at `at`, unless the run is over."""
        if self.buffer.version < self.run.config.learning.rounds:
            self.start(agents, at)

    def settle(self, k: str, flying: InFlight, at: float, staleness: int) -> None:
        """Agent k's update, taken `staleness` versions stale (or dropped), is its latest
        record, judged on its data against the server's model now; its state, the model it
        keeps."""
        run, fit = self.run, flying.fit
        state, judged = judge(self.strategy, run.learner, fit, self.buffer.server, run.data[k])
        run.states[k] = dataclasses.replace(fit.state, averaged=state.averaged)
        record = AgentRound.of_fit(
            flying.turn,
            fit,
            judged,
            run.learner.traits.budgets,
            staleness=staleness,
            finished_at=round(at, 6),
        )
        if k in run.profiles:  # its board's energy model, as `simulate.with_energy`
            traffic = flying.sent + flying.received
            energy, radio = round_energy(run.profiles[k], fit.train_flops, traffic)
            record.energy_j, record.radio_energy_j = energy, radio
            record.energy_source = ENERGY_SOURCE
        self.latest[k] = self._entry(record)
        run.states[k] = state

    def _entry(self, record: AgentRound) -> dict[str, Any]:
        entry = record.report_entry()
        return {**entry, "staleness": record.staleness, "finished_at": record.finished_at}

    def _held(self, k: str) -> dict[str, Any]:
        """The entry of an agent with no update in yet: the version it trained from, judged
        on its data."""
        facts = self.run.learner.facts
        loss, accuracy = facts.evaluate_on(facts.initial, self.run.data[k])
        return self._entry(
            AgentRound(
                round=0,
                agent=k,
                accuracy=accuracy,
                loss=loss,
                train_loss=None,
                sparsity=0.0,
                p_k=None,
            )
        )

    def version_record(self, version: int, at: float) -> dict[str, Any]:
        """The report's round for `version`: every agent's latest entry, with the traffic
        since the last version and the version's publication (the coordinator sends it
        once, retained; every agent receives it, as over MQTT)."""
        self.spent[COORDINATOR].sent += self.global_bytes
        for k in self.run.roster:
            self.spent[k].received += self.global_bytes
        agents = {}
        for k in self.run.roster:
            entry = dict(self.latest[k]) if k in self.latest else self._held(k)
            spent = self.spent[k]
            entry.update(bytes_sent=spent.sent, bytes_received=spent.received)
            agents[k] = entry
        record = {
            "round": version,
            "order": list(self.run.roster),
            "agents": agents,
            "coordinator": dataclasses.asdict(self.spent[COORDINATOR]),
            "t_star": None,
            "finished_at": round(at, 6),
            "applied": [{"agent": a, "staleness": s} for a, s in self.buffer.applied[-1]],
        }
        self.spent = {k: Traffic() for k in self.spent}
        return record

    def rounds(self, progress: Callable[[int, str], None] | None) -> list[dict[str, Any]]:
        """Every version of the run, in order. `progress` is told of each version once per
        agent (every agent receives it), as a synchronous round tells of each agent's: a
        run's count is `--rounds` x agents whatever the updates per version."""
        self.start(list(self.run.roster), 0.0)
        records = []
        while self.buffer.version < self.run.config.learning.rounds and self.events:
            at, index, _ = heapq.heappop(self.events)
            version = self.arrive(self.run.roster[index], at)
            if version is not None:
                records.append(self.version_record(version, at))
                for k in self.run.roster:
                    if progress:
                        progress(version, k)
        return records
