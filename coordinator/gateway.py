"""`coordinator run FILE`: one run of a run file on a fleet of real devices.

Read top to bottom: wait until enough agents are online and idle (their retained statuses
say so and describe their data), leave out those whose data does not fit the run, fix the
roster and the configuration, conduct the run (`coordinator.conductor`), follow it until
every agent has finished (or is gone for good), and assemble the report from what the
agents published.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.experiment import DEFAULT_MIN_SAMPLES, ExperimentConfig, config_from_dict, config_to_dict
from agent.learning.strategies import strategy
from agent.own_data import misfit, parse_description
from agent.runfile import RunFile, run_timeouts
from agent.runtime import new_run_id
from agent.runtime.heap import settled_heap
from agent.time_to_target import with_time_to_target
from agent.user_code import is_import_path, load_callable
from agent.workload import fingerprinted
from coordinator.conductor import Conductor, Resumed, assemble_report, wait_until_finished
from coordinator.fleet import AgentEntry
from coordinator.runs import (
    SERVER_STATE,
    RunEntry,
    end_entry,
    load_records,
    run_dir,
    save_entry,
    save_records,
)
from coordinator.watch import FleetFeed
from protocol import MqttTransport, topics
from protocol.signing import Signer

Say = Callable[[str], None]


AVAILABLE = ("idle", "rejected")
"""States of an agent in no run: waiting for one, or left out of the last one."""


class RunFailed(RuntimeError):
    """The run could not start or finish; the message says why in one line."""


class RunStopped(RunFailed):
    """`coordinator run` was stopped (Ctrl-C, SIGTERM) before its run started: it is
    recorded as cancelled, as nothing of it ran."""


@dataclass(frozen=True)
class Roster:
    """Who takes part, and what the agents' data fixed when the run file did not."""

    agents: list[str]
    input_shape: tuple[int, ...] | None
    classes: int | None


def data_of(entry: AgentEntry) -> Mapping[str, Any]:
    data = entry.metrics.get("data")
    return data if isinstance(data, dict) else {}


INFERRED_CLASSES_LIMIT = 1000
"""The most classes a run takes from its agents' labels: a run file that wants more says so
(`classes`), so that no member's description alone builds a model of a million outputs."""
LABEL_COVERAGE = 4
"""A fleet's labels must cover at least 1 / LABEL_COVERAGE of the classes they imply: the
highest label of a member whose labels leave the fleet's set sparser is no class the fleet
has (labels 0-9 and one member's 99999 would make every device train 100,000 outputs)."""


def described_labels(entries: list[AgentEntry]) -> dict[str, list[int]]:
    """Each agent's labels, from a well-formed data description only (`parse_description`:
    a malformed one is its agent's misfit, said by `fitting`, never an error here)."""
    labels = {}
    for entry in entries:
        parsed = parse_description(data_of(entry))
        if not isinstance(parsed, str) and parsed[2]:
            labels[entry.agent] = parsed[2]
    return labels


def fleet_classes(labels: Mapping[str, list[int]]) -> tuple[int | None, dict[str, str]]:
    """The classes the agents' labels span, and the agents whose highest label no fleet
    explains, each with why: beyond `INFERRED_CLASSES_LIMIT`, or so far beyond the others'
    labels that the fleet's would cover less than 1 / `LABEL_COVERAGE` of the classes (a
    lone agent is its own evidence). None when no agent reports labels."""
    remaining = {agent: set(values) for agent, values in labels.items() if values}
    left_out: dict[str, str] = {}
    while remaining:
        top = max(remaining, key=lambda agent: (max(remaining[agent]), agent))
        highest = max(remaining[top])
        covered = len(set().union(*remaining.values()))
        sparse = len(remaining) > 1 and LABEL_COVERAGE * covered < highest + 1
        if highest < INFERRED_CLASSES_LIMIT and not sparse:
            return highest + 1, left_out
        others = [max(values) for agent, values in remaining.items() if agent != top]
        span = f"the fleet's labels 0-{max(others)}" if others else "any class a run infers"
        left_out[top] = (
            f"label {highest} lies far beyond {span} (a run file with classes = {highest + 1} "
            "takes it)"
        )
        del remaining[top]
    return None, left_out


def reported_shape_and_classes(
    entries: list[AgentEntry], runfile: RunFile
) -> tuple[tuple[int, ...] | None, int | None, dict[str, str]]:
    """The input shape and number of classes of the run: the run file's, else the most
    common sample shape among the agents and the classes their labels span
    (`fleet_classes`), with the agents left out for an implausible label, each with why."""
    shape = runfile.values.get("input_shape")
    classes = runfile.values.get("classes")
    left_out: dict[str, str] = {}
    if shape is None:
        shapes = Counter(
            parsed[1]
            for e in entries
            if not isinstance(parsed := parse_description(data_of(e)), str)
        )
        shape = shapes.most_common(1)[0][0] if shapes else None
    if classes is None:
        classes, left_out = fleet_classes(described_labels(entries))
    return (tuple(shape) if shape else None), classes, left_out


def fitting(
    entries: list[AgentEntry], runfile: RunFile, seen: set[str], say: Say
) -> tuple[list[str], tuple[int, ...] | None, int | None]:
    """The idle agents whose data fits the run (each misfit said once), with the run's
    input shape and classes."""
    shape, classes, left_out = reported_shape_and_classes(entries, runfile)
    if runfile.dataset != "device":
        return [e.agent for e in entries], shape, classes
    fit = []
    for entry in entries:
        problem = left_out.get(entry.agent) or misfit(
            data_of(entry) or {"samples": 0},
            shape or (),
            classes or 0,
            int(runfile.values.get("min_samples", DEFAULT_MIN_SAMPLES)),
            task=str(runfile.values.get("task", "classification")),
        )
        if problem is None:
            fit.append(entry.agent)
        elif entry.agent not in seen:
            seen.add(entry.agent)
            say(f"agent {entry.agent} cannot join: {problem}")
    return fit, shape, classes


def choose_roster(
    available: list[AgentEntry], runfile: RunFile, seen: set[str], say: Say
) -> Roster | None:
    """The roster, once the agents available (online, in no run) allow one: the first
    `agents` whose data fits (by id), or, for `agent_ids`, those of them whose data fits
    once all of them are there (a misfit is left out and said once); None: wait on."""
    named = set(runfile.agent_ids or ())
    if named:
        available = [e for e in available if e.agent in named]
    fit, shape, classes = fitting(available, runfile, seen, say)
    if named:
        if {e.agent for e in available} >= named and fit:
            return Roster(sorted(fit), shape, classes)
        return None
    if len(fit) >= runfile.wanted:
        return Roster(sorted(fit)[: runfile.wanted], shape, classes)
    return None


def gather_roster(
    transport: MqttTransport,
    fleet: str,
    key: Signer | None,
    runfile: RunFile,
    stop: threading.Event,
    say: Say,
) -> Roster:
    """Wait (at most the run file's join timeout) for the agents the run wants."""
    feed = FleetFeed(transport, fleet, key)
    seen: set[str] = set()
    deadline = time.monotonic() + runfile.timeouts.join_s
    say(
        f"waiting for {runfile.wanted} agents of fleet {fleet} "
        f"(at most {runfile.timeouts.join_s:g} s)"
    )
    available: list[AgentEntry] = []
    try:
        while not stop.wait(0.5):
            available = [
                e
                for e in feed.entries()
                if e.fleet == fleet and e.role == "agent" and e.online and e.state in AVAILABLE
            ]
            roster = choose_roster(available, runfile, seen, say)
            if roster is not None:
                return roster
            if time.monotonic() > deadline:
                break
    finally:  # the run's own subscriptions follow on this transport
        transport.unsubscribe(topics.presence(fleet))
        transport.unsubscribe(topics.status(fleet))
    fit = fitting(available, runfile, set(), lambda _: None)[0]
    which = f" ({', '.join(sorted(fit))})" if fit else ""
    if stop.is_set():
        raise RunStopped(
            f"stopped while waiting for agents, before the run started: {len(fit)} of the "
            f"{runfile.wanted} it wants were online, idle and fit{which}"
        )
    raise RunFailed(
        f"only {len(fit)} of the {runfile.wanted} agents the run wants were online, idle and "
        f"fit within {runfile.timeouts.join_s:g} s{which}"
    )


def run_limit_s(config: ExperimentConfig, runfile: RunFile) -> float:
    """How long a run may take before the coordinator gives up on who has not finished."""
    t = runfile.timeouts
    return 120.0 + config.learning.rounds * (t.round_s + t.vote_s + 30.0)


def why_failed(conductor: Conductor, unfinished: list[str]) -> dict[str, str]:
    """Why each agent that did not finish the run did not: the error it reported, the state
    it ended in, that it went offline, or that it was still at work when the run ended."""
    failed = {}
    for agent, p in conductor.agents.items():
        if p.state in ("rejected", "failed"):
            failed[agent] = f"{p.state}: {p.error}" if p.error else p.state
        elif agent in unfinished:
            failed[agent] = (
                "went offline" if agent in conductor.offline
                else f"still {p.state} when the run ended" if p.state
                else "never reported"
            )  # fmt: skip
    return failed


@dataclass(frozen=True)
class Registry:
    """Where `coordinator run` keeps its runs (`coordinator.runs`), and the report's path."""

    base: Path
    report_path: str = ""


def load_for_run(runfile: RunFile) -> RunFile:
    """The run file (`load_run_file`'s), with its model's code loaded where the coordinator
    builds the model (its file and function exist): the model itself is built once the
    agents said their data's shape, so a missing file would be said only after every agent
    was waited for. ValueError with one line else."""
    config = runfile.outline()
    model = config.model
    # Only where this process builds the model: its fingerprint (devices' own data) or the
    # aggregate (centralized); otherwise only the devices import the code.
    builds = config.on_devices or strategy(config.learning.strategy).centralized
    if model and is_import_path(model) and builds:
        try:
            load_callable(model, "model")
        except ValueError as exc:
            raise ValueError(f"{runfile.path}: {exc}") from None
    return runfile


def begin(
    runfile: RunFile,
    transport: MqttTransport,
    fleet: str,
    key: Signer | None,
    stop: threading.Event,
    say: Say,
    registry: Registry | None,
) -> tuple[RunEntry, ExperimentConfig]:
    """A new run: its registry entry (waiting) while the roster forms, then its config."""
    config = runfile.outline()  # only the strategy and rounds count here
    entry = RunEntry(
        run_id=new_run_id(),
        fleet=fleet,
        strategy=config.learning.strategy,
        rounds=config.learning.rounds,
        run_file=str(Path(runfile.path).resolve()),
        report=registry.report_path if registry else "",
    )
    note(registry, entry)
    try:
        roster = gather_roster(transport, fleet, key, runfile, stop, say)
    except RunFailed as exc:
        end(registry, entry, "cancelled" if isinstance(exc, RunStopped) else "failed", str(exc))
        raise
    config = fingerprinted(runfile.config(len(roster.agents), roster.input_shape, roster.classes))
    entry.agents, entry.config = roster.agents, config_to_dict(config)
    return entry, config


def note(registry: Registry | None, entry: RunEntry) -> None:
    if registry is not None:
        save_entry(registry.base, entry)


def end(registry: Registry | None, entry: RunEntry, state: str, error: str = "") -> None:
    if registry is not None:
        end_entry(registry.base, entry, state, error)


def follow(
    conductor: Conductor,
    config: ExperimentConfig,
    runfile: RunFile,
    stop: threading.Event,
    progress: Callable[[int, int], None] | None,
    keep: Callable[[], None],
) -> list[str]:
    """Follow the run to its end (see `wait_until_finished`), keeping its records as they
    come (`keep`), so that a restart of this process loses none; returns the unfinished."""
    total = config.learning.rounds * len(conductor.roster)
    done = [-1]

    def advanced(now: int) -> None:
        if now != done[0]:
            done[0] = now
            keep()
        if progress is not None:
            progress(now, total)

    with settled_heap():  # its collection runs while the agents build their workloads
        return wait_until_finished(
            conductor,
            run_limit_s(config, runfile),
            advanced,
            stop=stop,
            gone_after_s=runfile.timeouts.round_s + runfile.timeouts.vote_s,
        )


def conduct(
    runfile: RunFile,
    transport: MqttTransport,
    fleet: str,
    key: Signer | None,
    stop: threading.Event,
    say: Say,
    progress: Callable[[int, int], None] | None = None,
    *,
    registry: Registry | None = None,
    resume: RunEntry | None = None,
) -> dict[str, Any]:
    """Run `runfile` on the fleet (or go on with the interrupted run `resume`) and return
    the report (`simulate`'s schema). With a `registry`, the run is recorded there as it
    goes, with what a resume needs."""
    resumed = None
    if resume is None:
        entry, config = begin(runfile, transport, fleet, key, stop, say, registry)
    else:
        entry, config = resume, config_from_dict(resume.config)
        entry.pid, entry.report = os.getpid(), registry.report_path if registry else ""
        resumed = Resumed(load_records(registry.base, entry.run_id) if registry else {})
    folder = run_dir(registry.base, entry.run_id) if registry else None
    conductor = Conductor(
        fleet=fleet,
        roster=entry.agents,
        config=config,
        transport=transport,
        key=key,
        round_timeout_s=runfile.timeouts.round_s,
        run_id=entry.run_id,
        timeouts=run_timeouts(runfile.timeouts),
        resumed=resumed,
        state_path=folder / SERVER_STATE if folder else None,
        log_folder=folder,
    )
    say(
        f"{'resuming run' if resume else 'run'} {conductor.run_id}: {config.learning.strategy}, "
        f"{len(entry.agents)} agents ({', '.join(entry.agents)}), {config.learning.rounds} rounds"
    )

    def keep() -> None:
        entry.rounds_done = conductor.last_round()
        if registry is not None:
            save_records(registry.base, entry.run_id, conductor.records())
        note(registry, entry)

    entry.state = "running"
    note(registry, entry)
    started = time.perf_counter()
    conductor.start()
    interrupted = False
    try:
        unfinished = follow(conductor, config, runfile, stop, progress, keep)
        # Stopped (Ctrl-C, SIGTERM) with the run still on: the entry stays unfinished and
        # the run message stays up, so agents that restart meanwhile find their run and
        # `coordinator run --resume` goes on with it.
        interrupted = stop.is_set() and bool(unfinished) and not conductor.cancelled
    except RuntimeError as exc:
        end(registry, entry, "failed", str(exc))
        raise
    finally:
        conductor.close(clear=not interrupted)
    keep()
    report = report_of(conductor, config, entry, runfile, time.perf_counter() - started)
    report["summary"]["interrupted"] = interrupted
    if not interrupted:
        failed = report["summary"]["failed_agents"]
        end(registry, entry, "cancelled" if conductor.cancelled else "failed" if failed else "done")
    return report


def report_of(
    conductor: Conductor,
    config: ExperimentConfig,
    entry: RunEntry,
    runfile: RunFile,
    wall_s: float,
) -> dict[str, Any]:
    failed = why_failed(conductor, conductor.unfinished())
    report = assemble_report(
        config, entry.agents, conductor.records(), conductor.aggregated(), wall_s, failed
    )
    report["summary"]["failed_agents"] = failed
    report["summary"]["cancelled"] = conductor.cancelled
    if conductor.cancelled:
        report["summary"]["cancelled_after"] = conductor.ended_rounds()
    with_time_to_target(report, None, entry.started)
    return {
        "config": {
            **dataclasses.asdict(config),
            "roster": entry.agents,
            "run_id": entry.run_id,
            "fleet": entry.fleet,
            "run_file": str(runfile.path),
        },
        **report,
    }
