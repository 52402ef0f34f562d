"""The long-lived edge agent: it joins its fleet, takes part in every run that names it,
keeps its personalized model, and waits for the next run.

Runs come from the fleet's retained run message: a coordinator's (`coordinator run`,
`coordinator emulate`), or, in a fleet without one (`--expect N`), the message that the
first agent of the roster publishes once N agents are online, which every other agent
accepts only if it describes the run its own run file (or flags) describe. Every run has a
fresh id; each run's checkpoint and round log live in their own folder
(`STATE_DIR/runs/RUN_ID`), and a run this agent finished is marked there, so a stale
retained message is never run twice and a restart resumes the run it was in. A run's
signer calls it off by publishing its message again with `cancelled` set: the agent ends
it after the round it is in, marks its folder, and waits for the next run. Each finished
run's model is kept in its folder, and a policy picks the current one (`agent.model_store`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agent.device import Budget, BudgetLimits, Throttle, compute_budget, read_device
from agent.device.calibration import RoundCosts, cached_costs
from agent.experiment import (
    ExperimentConfig,
    check_networked,
    config_from_dict,
    config_to_dict,
    profile_names,
)
from agent.files import DiskFullError, disk_full_as_error
from agent.learning import AgentState, Masks, State
from agent.learning.central import central_strategy
from agent.learning.kept import Kept
from agent.learning.learner import served_model
from agent.learning.reduction import measured_kinds
from agent.learning.reductions import MEASURED_MODES
from agent.model_store import (
    CANCELLED_MARK,
    DEFAULT_KEEP_RUNS,
    FINISHED_MARK,
    KeptModel,
    ModelStore,
    ended,
    run_folder,
    weights_misfit,
)
from agent.onnx_export import export_onnx
from agent.own_data import OwnData
from agent.runtime import (
    AgentRuntime,
    Run,
    Timeouts,
    checkpoint,
    new_run_id,
    publish_telemetry,
)
from agent.runtime.heap import settled_heap
from agent.runtime.run_files import ending
from agent.workload import (
    Workload,
    build_workload,
    compute_slot,
    data_misfit,
    nominal_budgets,
    own_workload,
    round_work,
)
from firmware_profiles import DeviceProfile, load_profile
from protocol import Identity, ProtocolError, Transport, messages, topics
from protocol.fleet_logs import DEFAULT_LEVEL, publishing_logs
from protocol.logs import RejectionLog, claimed_sender
from protocol.signing import MemberKeys, Signer, keys_to_list, signer_for_run

log = logging.getLogger(__name__)


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
    keep_best: bool = False
    """`--keep-best`: keep the most accurate model current, whatever a run's `keep` says."""
    keep_runs: int = DEFAULT_KEEP_RUNS
    """How many ended runs' folders to keep (the current model's is kept in any case)."""
    fleet_logs: str | None = DEFAULT_LEVEL
    """Publish the log records of each run at this level and up (`protocol.fleet_logs`);
    None: none."""


ONNX_EXPORT = threading.Lock()
"""Held by an export: torch.onnx.export keeps its state in process globals, and agents
sharing a process (agent/host.py) may finish at once."""

REFUSAL_INTERVAL_S = 5.0
"""At most one "rejected" status for runs that fail their checks in this many seconds."""
ANNOUNCE_INTERVAL_S = 5.0
"""At most one answer to requests to announce this agent again in this many seconds."""
ROUND_LOG = "rounds.jsonl"
"""A run's round records in its folder (`Session.records_path`): the final accuracy."""


class RunBoard:
    """The fleet's retained run message as it changes (empty: no run is on), and which runs
    their signers called off."""

    def __init__(
        self,
        transport: Transport,
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
        self._called_off: dict[str, str] = {}
        """Run id -> who signed its cancel, for every cancelled run message seen."""
        self._watched: dict[str, tuple[str, threading.Event]] = {}
        """The run this agent is in: its id -> (its signer, the event its cancel sets)."""
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
        if message is not None and message.cancelled and not self._call_off(message, topic):
            return
        with self._changed:
            self._current = message
            self._changed.notify_all()

    def _call_off(self, cancel: messages.RunConfig, topic: str) -> bool:
        """Note a (checked) cancel, and end the run this agent is in if it is the one; False
        for a cancel of that run signed by another member than the run itself."""
        with self._changed:
            watched = self._watched.get(cancel.run_id)
            if watched is not None and watched[0] != cancel.sender:
                reason = f"the run was signed by {watched[0]!r}, the cancel by {cancel.sender!r}"
                self._rejections.reject("cancel", cancel.sender, topic, reason)
                return False
            self._called_off[cancel.run_id] = cancel.sender
        if watched is not None:
            watched[1].set()
        return True

    def watch(self, run: messages.RunConfig) -> threading.Event:
        """The event a cancel of `run` by its signer sets (at once if one came already):
        the session of the run this agent joins ends on it."""
        event = threading.Event()
        with self._changed:
            self._watched = {run.run_id: (run.sender, event)}  # one run at a time
            if self._called_off.get(run.run_id) == run.sender:
                event.set()
        return event

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


class Announcer:
    """Answers the coordinator's requests to announce this agent again (after `coordinator
    forget` cleared its retained presence and status, or a broker lost them): publishes its
    birth and kept statuses anew (`Transport.reassert`), at most once per
    ANNOUNCE_INTERVAL_S, for a member trusted to start runs (with keys per member)."""

    def __init__(self, transport: Transport, identity: Identity) -> None:
        self.transport = transport
        self.identity = identity
        self._answered_at = -ANNOUNCE_INTERVAL_S
        self._lock = threading.Lock()
        self._rejections = RejectionLog(log)
        transport.subscribe(topics.announce(identity.fleet, identity.sender), self._on_request)

    def _on_request(self, topic: str, payload: bytes) -> None:
        key, me = self.identity.key, self.identity.sender
        try:
            request = messages.decode(payload, key=key)
            if not isinstance(request, messages.Request) or request.fleet != self.identity.fleet:
                raise ProtocolError("not a request of this fleet")
            if request.target != me:
                raise ProtocolError(f"addressed to {request.target!r}, not to this agent")
            if isinstance(key, MemberKeys) and not key.may_run(request.sender):
                raise ProtocolError(f"{request.sender!r} is not trusted to start runs here")
        except ProtocolError as exc:
            self._rejections.reject("announce request", "?", topic, exc)
            return
        with self._lock:
            now = time.monotonic()
            if now - self._answered_at < ANNOUNCE_INTERVAL_S:
                return
            self._answered_at = now
        log.info("announcing again, as %s asked", request.sender)
        self.transport.reassert()


class AgentService:
    """One device's agent over a started transport: `serve()` until `stop` (or one run)."""

    def __init__(
        self,
        identity: Identity,
        transport: Transport,
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
        self.last_run: dict[str, Any] | None = None
        """How this process's last run ended (`run_files.ending`), carried by idle statuses."""
        self.models = ModelStore(options.state_dir)
        self.run_models = RunModels(self.models, self.me, options.keep_best, self.say)

    def serve(self) -> None:
        self.models.reconcile()
        board = RunBoard(self.transport, self.fleet, self.identity.key, self.reject, self.me)
        Announcer(self.transport, self.identity)
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
            key = signer_for_run(self.identity.key, offer)
            with publishing_logs(
                self.transport, self.identity, run.run_id, self.options.fleet_logs
            ):
                self.learn(run, self.timeouts_of(offer), key, board.watch(offer))
            self.runs_done += 1
            if self.options.once or self.stop.is_set():
                return
            self.publish_status("idle")
            self.say(f"waiting for the next run of fleet {self.fleet}")

    # ------------------------------------------------------------------ joining a run

    def accept(self, offer: messages.RunConfig) -> Run | None:
        """The run `offer` describes, if this agent is to take part in it; otherwise None,
        having said why (and, when its data does not fit, told the fleet)."""
        folder = run_folder(self.options.state_dir, offer.run_id)
        if offer.cancelled:
            self.forget_cancelled(offer.run_id, folder)
            return None
        if self.me not in offer.roster:
            self.left_out(offer)
            return None
        if (folder / FINISHED_MARK).exists():
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

    def left_out(self, offer: messages.RunConfig) -> None:
        """A run that does not name this agent: say why in one line, and when its data is
        why (a coordinator leaves out devices whose data does not fit), tell the fleet."""
        try:
            config = config_from_dict(offer.config)
            if config.on_devices:
                self.check_own_data(config)
        except ValueError as exc:
            self.reject(offer.run_id, str(exc), left_out=True)
            return
        self.say(f"run {offer.run_id} does not name this agent; waiting for the next run")

    def forget_cancelled(self, run_id: str, folder: Path) -> None:
        """A run called off before this agent joined it, or while it was down: never join
        it, and mark a run it was in, so no later start resumes it."""
        if folder.is_dir() and not ended(folder):
            (folder / CANCELLED_MARK).touch()
            self.say(f"run {run_id} was cancelled; not resuming it (its checkpoint is kept)")
        else:
            log.info("run %s is cancelled: not joining it", run_id)

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

    def reject(self, run_id: str, reason: str, *, left_out: bool = False) -> None:
        """Tell the fleet (in a status) and the user (in one line) that this agent does not
        take part in a run (`left_out`: one whose roster leaves it out, for `reason`)."""
        if left_out:
            self.say(
                f"not joining run {run_id} (it leaves this agent out): {reason}; "
                "waiting for the next run"
            )
        else:
            self.say(f"not joining run {run_id}: {reason}")
        log.info("not joining run %s: %s", run_id, reason)
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
        if state == "idle" and self.last_run is not None:
            figures["last_run"] = self.last_run
        if self.options.own is not None:
            figures.setdefault("data", self.options.own.describe())
        status = messages.Status(
            fleet=self.fleet, sender=self.me, run_id=run_id, state=state, metrics=figures
        )
        self.transport.publish(
            topics.status(self.fleet, self.me),
            messages.encode(status, key=self.identity.key),
            retain=True,
            keep=True,
        )
        if self.options.telemetry:
            publish_telemetry(self.transport, status)

    # ------------------------------------------------------------------ one run

    def learn(
        self, run: Run, timeouts: Timeouts, key: Signer | None, cancelled: threading.Event
    ) -> None:
        """Run the rounds of `run` (resuming from its checkpoint), keep the model, and mark
        the run finished once its model is final, or cancelled once `cancelled` ended it
        first. `key` checks the run's messages."""
        folder = run_folder(self.options.state_dir, run.run_id)
        cfg = run.config.learning
        self.say(
            f"run {run.run_id}: {cfg.strategy}, {len(run.roster)} agents, {cfg.rounds} rounds; "
            f"state in {folder}"
        )
        try:
            # Building the model runs it, and tracing it (torch.fx patches every module's
            # call while it traces) must not meet another agent's round or build in this
            # process: agents sharing a process build, trace and measure in turn.
            with compute_slot():
                workload = self.workload(run)
                emulated = self.me in nominal_budgets(run.config, workload, list(run.roster))
                # A real device trains where --device says; an emulated one where simulate does.
                if not emulated:
                    self.place(workload)
                costs = round_costs(run, self.me, workload, self.options, emulated, self.say)
            budget, throttle = budget_source(run, self.me, workload, self.options.device, costs)
        except ValueError as exc:
            self.reject(run.run_id, str(exc))
            return
        start_from = self.run_models.starting_point(run, workload)
        runtime = AgentRuntime(
            agent_id=self.me,
            fleet=self.fleet,
            run=run,
            workload=workload,
            transport=self.transport,
            state_dir=folder,
            timeouts=timeouts,
            key=key,
            on_round=functools.partial(self.report_round, workload.learner.facts.task.metric_name),
            on_finish=lambda state: self.run_models.keep(run, workload, state),
            stop=self.stop,
            budget=budget,
            throttle=throttle,
            costs=costs,
            telemetry=self.options.telemetry,
            cancelled=cancelled,
            start_from=start_from,
            say=self.say,
        )
        try:
            with settled_heap(), disk_full_as_error(folder):
                runtime.run()
                self.mark_ended(run, runtime.session.finished, cancelled, runtime.session.state)
                self.last_run = ending(runtime.session)
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

    def report_round(self, metric: str, record: dict[str, Any]) -> None:
        # A strategy that budgets nothing records no p_k (`agent.report.reported_p_k`).
        budget = "" if record["p_k"] is None else f"p_k {record['p_k']:.3f}, "
        self.say(
            f"round {record['round']}: {metric} {record['accuracy']:.4f}, {budget}"
            f"sparsity {record['sparsity']:.3f}, waited {record['wait_s']:.2f}s"
            + (f", stragglers {record['stragglers']}" if record["stragglers"] else "")
            + (f", staleness {stale:.2f}" if (stale := record.get("staleness")) is not None else "")
        )

    def mark_ended(
        self, run: Run, finished: bool, cancelled: threading.Event, state: AgentState
    ) -> None:
        """Mark the run's folder once the run is over for this agent, so no restart resumes
        it, and drop the folders retention no longer keeps."""
        folder = run_folder(self.options.state_dir, run.run_id)
        if finished:
            (folder / FINISHED_MARK).touch()
        elif cancelled.is_set() and not self.stop.is_set():
            (folder / CANCELLED_MARK).touch()
            self.say(
                f"run {run.run_id} cancelled after round {state.round}: its checkpoint is "
                "kept, the current model unchanged"
            )
        else:
            return
        deleted = self.models.prune(self.options.keep_runs)
        if deleted:
            log.info("deleted the folders of %d old runs: %s", len(deleted), ", ".join(deleted))


class RunModels:
    """What becomes of the models of one agent's runs: a run may start from the current
    one (`init = "previous"`), each finished run's is kept in its folder, and the policy picks
    the current one (`agent.model_store`)."""

    def __init__(
        self, store: ModelStore, me: str, keep_best: bool, say: Callable[[str], None]
    ) -> None:
        self.store = store
        self.me = me
        self.keep_best = keep_best
        self.say = say

    def starting_point(self, run: Run, workload: Workload) -> tuple[State, Masks | None] | None:
        """Under `init = "previous"`: this device's current model's weights (and masks), when
        they fit the run's model; None to start from the fleet's seed, having said why."""
        if run.config.init != "previous":
            return None
        learner, start = workload.learner, f"run {run.run_id}: starting from"
        strategy = run.config.learning.strategy
        if learner.traits.centralized and not central_strategy(strategy).trains_own:
            self.say(
                f"{start} the seed: {strategy} trains every round from the aggregator's "
                "global model, not from a device's own"
            )
            return None
        saved = self.store.start_weights()
        if saved is None:
            self.say(f"{start} the seed: this device has no current model to start from")
            return None
        kept, weights, masks = saved
        names = learner.facts.prunable if learner.sparse else None
        problem = weights_misfit(learner.facts.initial, names, weights, masks)
        if problem is not None:
            self.say(f"{start} the seed: the current model (run {kept.run_id}) {problem}")
            return None
        figure = "unknown" if kept.accuracy is None else f"{kept.accuracy:.4f}"
        self.say(f"{start} the current model (run {kept.run_id}, {kept.metric} {figure})")
        return weights, masks if learner.sparse else None

    def keep(self, run: Run, workload: Workload, state: AgentState) -> None:
        """Keep the personalized model in the run's folder and make it current if the
        policy says so (`agent.model_store`): `edge-agent predict` serves the current one."""
        folder = run_folder(self.store.state_dir, run.run_id)
        accuracy = checkpoint.read_records(folder / ROUND_LOG).get(state.round, {}).get("accuracy")
        if not isinstance(accuracy, (int, float)) or not math.isfinite(accuracy):
            accuracy = None
        kept = KeptModel(
            run_id=run.run_id,
            finished=time.time(),
            strategy=run.config.learning.strategy,
            model=workload.model_name,
            rounds=state.round,
            accuracy=None if accuracy is None else float(accuracy),
            metric=workload.learner.facts.task.metric_name,
            higher_is_better=workload.learner.facts.task.higher_is_better,
        )
        served = state.kept or Kept("", state.weights, state.masks, {}, "")
        with ONNX_EXPORT:
            path = self.store.keep(
                kept,
                served.weights,
                served.masks,
                lambda to: self._export(run, workload, served, state.round, to),
            )
        policy = "best" if self.keep_best else run.config.keep
        choice = self.store.settle(kept, policy, run.config.keep_margin)
        which = f" ({state.kept.name}: {state.kept.reason})" if state.kept else ""
        self.say(f"run {run.run_id}: model final{which}, kept as {path}")
        self.say(choice.reason)

    def _export(self, run: Run, workload: Workload, served: Kept, round_: int, path: Path) -> Path:
        """The kept model as ONNX, with what it is in its metadata (`kept`: which of the
        device's models it is)."""
        model, weights = served_model(workload.learner, served.weights, served.masks)
        return export_onnx(
            model,
            weights,
            workload.learner.facts.input_shape,
            path,
            metadata={
                "agent": self.me,
                "run_id": run.run_id,
                "round": str(round_),
                "kept": served.name,
                "model": workload.model_name,
                "strategy": run.config.learning.strategy,
                "task": run.config.task,
            },
        )


def wait_for_roster(
    transport: Transport, identity: Identity, expect: int, stop: threading.Event
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


def round_costs(
    run: Run,
    agent_id: str,
    workload: Workload,
    options: ServiceOptions,
    emulated: bool,
    say: Callable[[str], None],
) -> RoundCosts | None:
    """This agent's measured costs (`agent.device.calibration`, kept in its state folder),
    when something needs them: an emulated board's throttle, a real board's budget, or a
    `--reduce` that chooses by measurement. None otherwise, and for the centralized
    strategies, whose participants cut their rounds by the FLOP rules."""
    cfg = run.config.learning
    learner = workload.learner
    measured_mode = cfg.reduce in MEASURED_MODES
    if learner.traits.centralized or not (emulated or options.device or measured_mode):
        return None
    data = workload.data[agent_id]
    table = cached_costs(options.state_dir, learner.facts, data, measured_kinds(cfg.reduce), say)
    return RoundCosts(
        table,
        samples=len(data.y_train),
        epochs=cfg.epochs,
        batch_size=cfg.batch_size,
        extra_steps=cfg.rigl_batches if learner.sparse else 0,
        eval_samples=len(data.y_test),
    )


def budget_source(
    run: Run,
    agent_id: str,
    workload: Workload,
    device: DeviceProfile | None,
    costs: RoundCosts | None = None,
) -> tuple[Callable[[], Budget | None] | None, Throttle | None]:
    """Where p_k comes from, and whether this agent's speed and link are emulated.

    A run with `profiles` is an emulated fleet: each agent budgets as an idle board of its
    profile (the simulator computes the same) and is throttled to its speed and link.
    Otherwise an agent with a --profile is a real board and measures itself each round (its
    throttle is disabled: it only prices the round's energy), its time factor from its
    measured `costs` where it has them.
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
            device,
            readings[0],
            work,
            limits,
            compute=workload.learner.facts.device.type,
            measured_dense_s=costs.dense_s if costs else None,
            measured_fixed_s=costs.fixed_s if costs else 0.0,
        )

    # A real board runs at its own speed (a disabled throttle) but has a profile: its rounds'
    # energy is its measured training time at the profile's power.
    return measure, Throttle(device, enabled=False)
