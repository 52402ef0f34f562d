"""What an agent keeps of a run in the run's folder, and reads back: the checkpoint a restart
resumes from, the round log (`rounds.jsonl`), and what the statuses say of them (the
savings of an early stop, the newest records, how the run ended for the agent).

The checkpoint and the log are written in that order: a crash before the checkpoint redoes
the round; a crash between the two is repaired by `restore`, which logs the checkpoint's
record if it is missing, so no round is ever lost or logged twice.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from agent.learning import StopWatch
from agent.learning.kept import restored_kept, restored_shadow
from agent.report import early_stop_savings
from agent.runtime import checkpoint

if TYPE_CHECKING:
    import threading
    from pathlib import Path

    from agent.learning import AgentState, EarlyStop, StrategyConfig

log = logging.getLogger(__name__)

RECORDS_IN_FINAL_STATUS = 200
"""Round records an agent's final status repeats (about 0.5 kB each, so well within a
status's 1 MiB limit)."""


class RunId(Protocol):
    """The run an agent takes part in, as far as its files go: its id."""

    @property
    def run_id(self) -> str: ...


class AgentRun(Protocol):
    """What the run's files read of an agent's session (`agent.runtime.session.Session`) and
    what `restore` writes back into it: typed here by what is used, so that this module,
    which the session imports, does not import the session back."""

    state: AgentState
    early: EarlyStop
    stopped_round: int | None

    @property
    def me(self) -> str: ...

    @property
    def run_info(self) -> RunId: ...

    @property
    def cfg(self) -> StrategyConfig: ...

    @property
    def checkpoint_path(self) -> Path: ...

    @property
    def records_path(self) -> Path: ...

    @property
    def say(self) -> Callable[[str], None]: ...

    @property
    def finished(self) -> bool: ...

    @property
    def cancelled(self) -> threading.Event: ...


class Checkpointed(Protocol):
    """What a topology's rounds (`agent.runtime.session.RoundDriver`) keep in the checkpoint."""

    def checkpoint(self, round_: int) -> dict[str, Any]:
        """The driver's state to persist with round `round_`."""

    def restore(self, saved: dict[str, Any]) -> None:
        """Read back what `checkpoint` saved."""


def persist(session: AgentRun, driver: Checkpointed, round_: int, record: dict[str, Any]) -> None:
    """Checkpoint (with the round's record), then log the record. A full disk raises
    `DiskFullError` and leaves the previous checkpoint in place."""
    checkpoint.save(
        session.checkpoint_path,
        {
            "run_id": session.run_info.run_id,
            "agent": session.me,
            "round": round_,
            "weights": session.state.weights,
            "masks": session.state.masks or {},
            "distances": session.state.distances,
            "dp_steps": session.state.dp_steps,
            "local_model": session.state.shadow.saved() if session.state.shadow else None,
            "kept_model": session.state.kept.saved() if session.state.kept else None,
            "averaged_model": session.state.averaged,
            "stop_watch": dataclasses.asdict(session.early.watch),
            "record": record,
            **driver.checkpoint(round_),
        },
    )
    checkpoint.append_record(session.records_path, record)


def restore(session: AgentRun, driver: Checkpointed) -> int:
    """Resume `session` from the checkpoint of its run, if any; returns the last completed
    round."""
    saved = checkpoint.load(session.checkpoint_path)
    if saved is None:
        return 0
    if saved["run_id"] != session.run_info.run_id or saved["agent"] != session.me:
        log.warning("ignoring checkpoint of another run or agent in %s", session.checkpoint_path)
        return 0
    # The log may end torn (a crash or a full disk mid-line): repaired before appending.
    if saved["round"] not in checkpoint.repair_records(session.records_path):
        checkpoint.append_record(session.records_path, saved["record"])
    session.state = dataclasses.replace(
        session.state,
        weights=saved["weights"],
        masks=saved["masks"] or None,
        distances=list(saved["distances"]),
        dp_steps=int(saved.get("dp_steps", 0)),
        round=saved["round"],
        shadow=restored_shadow(saved.get("local_model")),
        kept=restored_kept(saved.get("kept_model")),
        averaged=saved.get("averaged_model"),
    )
    session.early.watch = StopWatch(**saved.get("stop_watch", {}))
    if saved["record"].get("stopped"):
        session.stopped_round = int(saved["round"])
    driver.restore(saved)
    session.say(
        f"run {session.run_info.run_id}: resuming after round {saved['round']} of "
        f"{session.cfg.rounds} from its checkpoint"
    )
    return int(saved["round"])


def recent_records(session: AgentRun) -> list[dict[str, Any]]:
    """The newest `RECORDS_IN_FINAL_STATUS` round records, for the final status: a
    coordinator that was down while some rounds' statuses went by fills its report from
    them (a retained status keeps only the latest round's)."""
    records = checkpoint.read_records(session.records_path)
    return [records[r] for r in sorted(records)[-RECORDS_IN_FINAL_STATUS:]]


def savings(session: AgentRun, round_: int) -> dict[str, Any]:
    """What stopping after `round_` saves, for the status (from the round log)."""
    records = checkpoint.read_records(session.records_path)
    ran: list[Mapping[str, Any]] = [records[r] for r in sorted(records) if r <= round_]
    return {"saved": early_stop_savings(ran, round_, session.cfg.rounds)}


def ending(session: AgentRun) -> dict[str, Any] | None:
    """How the run ended for this agent, for its idle statuses until the next run (a
    coordinator that comes back after the run's end reads its final state there); None if
    it did not end (the process is stopping: a restart resumes it)."""
    if session.stopped_round is not None:
        state = "stopped"
    elif session.finished:
        state = "done"
    elif session.cancelled.is_set():
        state = "cancelled"
    else:
        return None
    return {
        "run_id": session.run_info.run_id,
        "state": state,
        "round": session.state.round,
        "records": recent_records(session),
    }
