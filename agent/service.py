"""The long-lived edge agent: it joins its fleet, takes part in every run that names it,
keeps its personalized model, and waits for the next run.

Runs come from the fleet's retained run message: a coordinator's (`coordinator run`,
`coordinator emulate`), or, in a fleet without one (`--expect N`), the message that the
first agent of the roster publishes once N agents are online, which every other agent
accepts only if it describes the run its own run file (or flags) describe. Every run has a
fresh id; each run's checkpoint and round log live in their own folder
(`STATE_DIR/runs/RUN_ID`), and a run this agent finished is marked there, so a stale
retained message is never run twice and a restart resumes the run it was in.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agent.device import Budget, BudgetLimits, Throttle, compute_budget, read_device
from agent.experiment import (
    ExperimentConfig,
    Workload,
    build_workload,
    check_networked,
    config_from_dict,
    config_to_dict,
    data_misfit,
    nominal_budgets,
    own_workload,
    profile_names,
    round_work,
)
from agent.files import DiskFullError, disk_full_as_error
from agent.learning import AgentState
from agent.onnx_export import export_onnx
from agent.own_data import OwnData
from agent.runtime import (
    AgentRuntime,
    Run,
    Timeouts,
    new_run_id,
    publish_telemetry,
    run_folder,
)
from agent.runtime.heap import settled_heap
from firmware_profiles import DeviceProfile, load_profile
from protocol import Identity, MqttTransport, ProtocolError, messages, topics
from protocol.logs import RejectionLog, claimed_sender
from protocol.signing import Signer, keys_to_list, signer_for_run

log = logging.getLogger(__name__)

FINISHED_MARK = "finished"
"""The file that marks a run this agent finished, in the run's folder."""


def _ignore(_: str) -> None:
    """The default `say`: user-facing messages go nowhere (tests, embedding)."""


@dataclass(frozen=True)
class ServiceOptions:
    state_dir: Path
    timeouts: Timeouts = Timeouts()
    device: DeviceProfile | None = None
    """This board's profile: the agent measures its budget p_k with it every round."""
    own: OwnData | None = None
    """This device's own data (`--data`), for runs on the devices' own data."""
    once: bool = False
    """Exit after one run (emulated agents, and fleets without a coordinator)."""
    expect: int | None = None
    """Without a coordinator: start a run once this many agents are online."""
    own_config: Callable[[int], ExperimentConfig] | None = None
    """Without a coordinator: the run this agent wants, for a roster of n agents."""
    own_timeouts: Mapping[str, float] = dataclasses.field(default_factory=dict)
    """Without a coordinator: the timeouts the run file fixes for every agent."""
    say: Callable[[str], None] = _ignore
    """Where the user-facing one-line messages go (the CLI's console or JSON log)."""
    compute: torch.device = torch.device("cpu")
    """What a real device trains on (`--device`); emulated boards train on the CPU."""
    telemetry: bool = False
    """Mirror every status as plain JSON on the telemetry topic, for MQTT tools."""
    compute_auto: bool = False
    """`--device auto` chose `compute`: a strategy that cannot use it falls back to the CPU."""


ONNX_EXPORT = threading.Lock()
"""Held by an export: torch.onnx.export keeps its state in process globals, and agents
sharing a process (agent/host.py) may finish at once."""

REFUSAL_INTERVAL_S = 5.0
"""At most one "rejected" status for runs that fail their checks in this many seconds."""


class RunBoard:
    """The fleet's retained run message as it changes (empty: no run is on)."""

    def __init__(
        self,
        transport: MqttTransport,
        fleet: str,
        key: Signer | None,
        refused: Callable[[str, str], None] | None = None,
        me: str = "",
    ) -> None:
        """`refused(run_id, reason)`: called for a run naming `me` that fails its checks."""
        self.fleet = fleet
        self.key = key
        self.me = me
        self._refused = refused
        self._last_refusal = (-REFUSAL_INTERVAL_S, "")
        self._changed = threading.Condition()
        self._current: messages.RunConfig | None = None
        self._rejections = RejectionLog(log)
        transport.subscribe(topics.run(fleet), self._on_run)

    def _on_run(self, topic: str, payload: bytes) -> None:
        message: messages.RunConfig | None = None
        if payload:
            try:
                decoded = messages.decode(payload, key=self.key)
                if not isinstance(decoded, messages.RunConfig) or decoded.fleet != self.fleet:
                    raise ProtocolError("not a run message of this fleet")
                signer_for_run(self.key, decoded)  # signed by a member trusted to start runs
                message = decoded
            except ProtocolError as exc:
                self._rejections.reject("run", claimed_sender(topic), topic, exc)
                self._tell_refused(payload, exc)
                return
        with self._changed:
            self._current = message
            self._changed.notify_all()

    def _tell_refused(self, payload: bytes, why: ProtocolError) -> None:
        """A run naming this agent that it cannot trust (a wrong trust file, a coordinator
        without --admitted): its sender waits for the agent, so say why in the agent's
        status. The run is read unverified, only to name it; at most one such answer per
        REFUSAL_INTERVAL_S, so forged runs cannot make the agent publish in a loop."""
        try:
            offer = messages.decode(payload)
        except ProtocolError:
            return
        last_at, last_run = self._last_refusal
        now = time.monotonic()
        if (
            self._refused is None
            or not isinstance(offer, messages.RunConfig)
            or self.me not in offer.roster
            or offer.run_id == last_run
            or now - last_at < REFUSAL_INTERVAL_S
        ):
            return
        self._last_refusal = (now, offer.run_id)
        self._refused(offer.run_id, f"the run message fails its checks: {why}")

    def next(
        self, skip: Container[str], stop: threading.Event, timeout_s: float | None = None
    ) -> messages.RunConfig | None:
        """The run message on now whose id is not in `skip`; None on `stop` or timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._changed:
            while not stop.is_set():
                current = self._current
                if current is not None and current.run_id not in skip:
                    return current
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                self._changed.wait(0.5)
        return None


class AgentService:
    """One device's agent over a started transport: `serve()` until `stop` (or one run)."""

    def __init__(
        self,
        identity: Identity,
        transport: MqttTransport,
        options: ServiceOptions,
        stop: threading.Event,
    ) -> None:
        self.identity = identity
        self.me = identity.sender
        self.fleet = identity.fleet
        self.transport = transport
        self.options = options
        self.stop = stop
        self.say = options.say
        self.runs_done = 0

    def serve(self) -> None:
        board = RunBoard(self.transport, self.fleet, self.identity.key, self.reject, self.me)
        self.publish_status("idle")
        self.say(f"waiting for a run of fleet {self.fleet}")
        handled: set[str] = set()
        leader_step = self.options.expect is not None
        while not self.stop.is_set():
            offer = board.next(handled, self.stop, 3.0 if leader_step else None)
            if offer is None:
                if leader_step and not self.stop.is_set():
                    self.start_without_coordinator()
                    leader_step = False
                continue
            handled.add(offer.run_id)
            run = self.accept(offer)
            if run is None:
                continue
            self.learn(run, self.timeouts_of(offer), signer_for_run(self.identity.key, offer))
            self.runs_done += 1
            if self.options.once or self.stop.is_set():
                return
            self.publish_status("idle")
            self.say(f"waiting for the next run of fleet {self.fleet}")

    # ------------------------------------------------------------------ joining a run

    def accept(self, offer: messages.RunConfig) -> Run | None:
        """The run `offer` describes, if this agent is to take part in it; otherwise None,
        having said why (and, when its data does not fit, told the fleet)."""
        if self.me not in offer.roster:
            self.say(f"run {offer.run_id} does not name this agent; waiting for the next")
            self.tell_misfit(offer)
            return None
        if (run_folder(self.options.state_dir, offer.run_id) / FINISHED_MARK).exists():
            log.info("run %s: already finished here", offer.run_id)
            return None
        try:
            config = config_from_dict(offer.config)
            check_networked(config, aggregator=self.options.expect is None)
            if self.options.own_config is not None:
                wanted = self.options.own_config(len(offer.roster))
                if config != wanted or offer.sender not in offer.roster:
                    raise ValueError("it is not the run this agent's run file describes")
            if config.on_devices:
                self.check_own_data(config)
            signer_for_run(self.identity.key, offer)
        except (ValueError, ProtocolError) as exc:
            self.reject(offer.run_id, str(exc))
            return None
        # Only the run's own signer may keep its tallies.
        keeper = offer.keeper if offer.keeper == offer.sender else ""
        return Run(offer.run_id, tuple(sorted(offer.roster)), config, offer.sender, keeper)

    def tell_misfit(self, offer: messages.RunConfig) -> None:
        """A run left this agent out: if its data is why, say so (log and status)."""
        try:
            config = config_from_dict(offer.config)
            if config.on_devices:
                self.check_own_data(config)
        except ValueError as exc:
            self.reject(offer.run_id, str(exc))

    def timeouts_of(self, offer: messages.RunConfig) -> Timeouts:
        """The run's timeouts where its message gives them, else this agent's own."""
        own = self.options.timeouts
        given = {
            name: float(value)
            for name, value in offer.timeouts.items()
            if name in ("round_s", "vote_s", "linger_s")
            and isinstance(value, (int, float))
            and 0 <= value < 1e6
        }
        return dataclasses.replace(own, **given)

    def check_own_data(self, config: ExperimentConfig) -> None:
        own = self.options.own
        if own is None:
            raise ValueError("the run learns from each device's own data; start with --data")
        problem = data_misfit(config, own)
        if problem is not None:
            raise ValueError(f"its data does not fit the run: {problem}")

    def reject(self, run_id: str, reason: str) -> None:
        """Tell the fleet (and the user) that this agent does not take part in a run."""
        self.say(f"not joining run {run_id}: {reason}")
        log.warning("not joining run %s: %s", run_id, reason)
        self.publish_status("rejected", run_id, {"error": reason})

    def start_without_coordinator(self) -> None:
        """`--expect N`: once N agents are online, the first of them (by id) publishes the
        run with a fresh id; the others wait for it (and check it, in `accept`)."""
        expect, own_config = self.options.expect, self.options.own_config
        assert expect is not None and own_config is not None
        self.say(f"no run from a coordinator; waiting for {expect} agents")
        roster = wait_for_roster(self.transport, self.identity, expect, self.stop)
        if roster is None or roster[0] != self.me:
            return
        config = own_config(len(roster))
        run = messages.RunConfig(
            fleet=self.fleet,
            sender=self.me,
            run_id=new_run_id(),
            roster=roster,
            seed=config.seed,
            config=config_to_dict(config),
            timeouts=dict(self.options.own_timeouts),
            keys=keys_to_list(self.identity.key, roster),
        )
        self.transport.publish(
            topics.run(self.fleet), messages.encode(run, key=self.identity.key), retain=True
        )

    def publish_status(
        self, state: str, run_id: str = "", metrics: dict[str, Any] | None = None
    ) -> None:
        """A retained status outside a run: idle (with a description of this device's data,
        so a coordinator can check the fit before it fixes a roster) or rejected."""
        figures = dict(metrics or {})
        if self.options.own is not None:
            figures.setdefault("data", self.options.own.describe())
        status = messages.Status(
            fleet=self.fleet, sender=self.me, run_id=run_id, state=state, metrics=figures
        )
        self.transport.publish(
            topics.status(self.fleet, self.me),
            messages.encode(status, key=self.identity.key),
            retain=True,
        )
        if self.options.telemetry:
            publish_telemetry(self.transport, status)

    # ------------------------------------------------------------------ one run

    def learn(self, run: Run, timeouts: Timeouts, key: Signer | None) -> None:
        """Run the rounds of `run` (resuming from its checkpoint), export the model, and
        mark the run finished once its model is final. `key` checks the run's messages."""
        folder = run_folder(self.options.state_dir, run.run_id)
        cfg = run.config.learning
        self.say(
            f"run {run.run_id}: {cfg.strategy}, {len(run.roster)} agents, {cfg.rounds} rounds; "
            f"state in {folder}"
        )
        try:
            workload = self.workload(run)
            budget, throttle = budget_source(run, self.me, workload, self.options.device)
            # A real device trains where --device says; an emulated one where simulate does.
            if throttle is None or not throttle.enabled:
                self.place(workload)
        except ValueError as exc:
            self.reject(run.run_id, str(exc))
            return
        runtime = AgentRuntime(
            agent_id=self.me,
            fleet=self.fleet,
            run=run,
            workload=workload,
            transport=self.transport,
            state_dir=folder,
            timeouts=timeouts,
            key=key,
            on_round=self.report_round,
            on_finish=lambda state: self.export(run, workload, state),
            stop=self.stop,
            budget=budget,
            throttle=throttle,
            telemetry=self.options.telemetry,
        )
        try:
            with settled_heap(), disk_full_as_error(folder):
                runtime.run()
                if runtime.session.finished:
                    (folder / FINISHED_MARK).touch()
        except DiskFullError as exc:
            # The fleet learns now that this agent is out (the CLI then says goodbye); its
            # last checkpoint is kept, so a restart with room on the disk resumes the run.
            self.publish_status("failed", run.run_id, {"error": str(exc)})
            raise

    def place(self, workload: Workload) -> None:
        """Put the model on the device the agent trains on; with --device auto, a strategy
        that trains on the CPU only stays there."""
        try:
            workload.learner.to(self.options.compute)
        except ValueError:
            if not self.options.compute_auto:
                raise
            self.say(f"{workload.learner.config.strategy} trains on the cpu only; using the cpu")

    def workload(self, run: Run) -> Workload:
        roster = list(run.roster)
        if run.config.on_devices:
            assert self.options.own is not None  # checked in accept
            return own_workload(run.config, roster, self.me, self.options.own)
        return build_workload(run.config, roster, agents=[self.me])

    def report_round(self, record: dict[str, Any]) -> None:
        self.say(
            f"round {record['round']}: accuracy {record['accuracy']:.4f}, "
            f"p_k {record['p_k']:.3f}, sparsity {record['sparsity']:.3f}, "
            f"waited {record['wait_s']:.2f}s"
            + (f", stragglers {record['stragglers']}" if record["stragglers"] else "")
        )

    def export(self, run: Run, workload: Workload, state: AgentState) -> None:
        """The personalized model as ONNX, for `edge-agent predict` (the latest run's)."""
        with ONNX_EXPORT:
            path = self._export(run, workload, state)
        self.say(f"run {run.run_id}: personalized model final, exported to {path}")

    def _export(self, run: Run, workload: Workload, state: AgentState) -> Path:
        return export_onnx(
            workload.learner.model,
            state.weights,
            workload.learner.input_shape,
            self.options.state_dir / "model.onnx",
            metadata={
                "agent": self.me,
                "run_id": run.run_id,
                "round": str(state.round),
                "model": workload.model_name,
                "strategy": run.config.learning.strategy,
            },
        )


def wait_for_roster(
    transport: MqttTransport, identity: Identity, expect: int, stop: threading.Event
) -> list[str] | None:
    """The first `expect` agents (by id) seen online on the fleet's presence topics, once
    this agent is among them; None if `stop` is set first."""
    online: dict[str, bool] = {}
    lock = threading.Lock()

    def on_presence(_topic: str, payload: bytes) -> None:
        try:
            message = messages.decode(payload, key=identity.key)
        except ProtocolError:
            return
        if isinstance(message, messages.Presence) and message.role == "agent":
            with lock:
                online[message.sender] = message.online

    transport.subscribe(topics.presence(identity.fleet), on_presence)
    try:
        while not stop.wait(0.5):
            with lock:
                peers = sorted(a for a, up in online.items() if up)
            if len(peers) >= expect and identity.sender in peers[:expect]:
                return peers[:expect]
        return None
    finally:
        transport.unsubscribe(topics.presence(identity.fleet))


def budget_source(
    run: Run, agent_id: str, workload: Workload, device: DeviceProfile | None
) -> tuple[Callable[[], Budget | None] | None, Throttle | None]:
    """Where p_k comes from, and whether this agent's speed and link are emulated.

    A run with `profiles` is an emulated fleet: each agent budgets as an idle board of its
    profile (the simulator computes the same) and is throttled to its speed and link.
    Otherwise an agent with a --profile is a real board and measures itself each round (its
    throttle is disabled: it only prices the round's energy).
    """
    budgets = nominal_budgets(run.config, workload, list(run.roster))
    if agent_id in budgets:
        names = profile_names(run.config.profiles)
        board = load_profile(names[sorted(run.roster).index(agent_id) % len(names)])
        return (lambda: budgets[agent_id]), Throttle(board)
    if device is None:
        return None, None
    work = round_work(run.config, workload.learner, len(workload.data[agent_id].y_train))
    limits = BudgetLimits(round_time_s=run.config.round_time_s)
    readings = [read_device()]

    def measure() -> Budget:
        readings[0] = read_device(readings[0])
        return compute_budget(
            device, readings[0], work, limits, compute=workload.learner.device.type
        )

    # A real board runs at its own speed (a disabled throttle) but has a profile: its rounds'
    # energy is its measured training time at the profile's power.
    return measure, Throttle(device, enabled=False)
