"""The gateway's record of its runs: one folder per run under the runs folder.

The runs folder is `runs` in the gateway's state folder (`--state-dir`, see
`coordinator.gateway_state.gateway_folder`), beside the keys and logins of the fleet it ran
on, so two gateways (two state folders) keep two histories; `--runs-dir` or
$EDGEFL_RUNS_DIR put it elsewhere. Versions before kept every gateway's runs in
~/.edgefl/runs: the first command that looks in the default folder while it does not exist
yet moves that history there, and says so.

`coordinator run` writes `RUNS/RUN_ID/run.json` when the run starts and again as it goes
(state, rounds done), and keeps beside it what it needs to go on after a restart: the
records the agents reported (`records.json`) and, for a centralized strategy, the server
state after each round (`server.pt`). `coordinator runs` lists the folders, `coordinator
run --resume` continues the newest unfinished run of a run file, and `coordinator cancel`
finds the run it calls off here. A run whose process is gone without having ended it is
"interrupted": only a resume ends it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.files import atomic_write
from coordinator.gateway_state import gateway_folder
from protocol import ConfigError

RUNS = "runs"
"""The runs folder's name in the gateway's state folder."""
LEGACY_RUNS_DIR = Path.home() / ".edgefl" / "runs"
"""Where versions before kept the runs of every gateway of the user."""
RUNS_DIR_ENV = "EDGEFL_RUNS_DIR"
ENTRY = "run.json"
RECORDS = "records.json"
SERVER_STATE = "server.pt"

UNFINISHED = ("waiting", "running")
"""States of a run whose `coordinator run` is (or was, if it died) still at work."""
ENDED = ("done", "failed", "cancelled")
INTERRUPTED = "interrupted"
"""An unfinished run whose process is gone: `coordinator run --resume` continues it."""


@dataclass
class RunEntry:
    """One run as `coordinator runs` shows it (and `--json` prints it)."""

    run_id: str
    fleet: str
    strategy: str
    rounds: int
    run_file: str
    state: str = "waiting"
    rounds_done: int = 0
    agents: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.time)
    ended: float | None = None
    pid: int = field(default_factory=os.getpid)
    report: str = ""
    error: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    """The run's configuration as published (`config_to_dict`): a resume publishes it again."""
    timeouts: dict[str, float] = field(default_factory=dict)

    @property
    def shown_state(self) -> str:
        """The state, with "interrupted" for an unfinished run whose process is gone."""
        if self.state in UNFINISHED and not _alive(self.pid):
            return INTERRUPTED
        return self.state

    def summary(self) -> dict[str, Any]:
        """The fields `coordinator runs` prints (the configuration left out)."""
        row = dataclasses.asdict(self)
        for bulky in ("config", "timeouts", "pid"):
            row.pop(bulky)
        row["state"] = self.shown_state
        return row


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def runs_dir(
    given: str | Path | None = None,
    state_dir: str | None = None,
    say: Callable[[str], None] | None = None,
) -> Path:
    """The runs folder: `given` (--runs-dir), else $EDGEFL_RUNS_DIR, else `runs` in the
    gateway's state folder, where an older version's ~/.edgefl/runs is moved on first use
    once that folder exists (`say` tells of it, or of where they still are)."""
    if given:
        return Path(given)
    if os.environ.get(RUNS_DIR_ENV):
        return Path(os.environ[RUNS_DIR_ENV])
    folder = gateway_folder(state_dir)
    base = folder / RUNS
    if LEGACY_RUNS_DIR.is_dir() and load_entries(LEGACY_RUNS_DIR):
        if folder.is_dir() and not base.exists():  # a mistyped --state-dir moves nothing
            move_history(LEGACY_RUNS_DIR, base, say)
        elif say is not None:
            say(
                f"runs of an older version are still in {LEGACY_RUNS_DIR} (this gateway's are "
                f"in {base}): `--runs-dir {LEGACY_RUNS_DIR}` reaches them"
            )
    return base


def move_history(old: Path, new: Path, say: Callable[[str], None] | None) -> None:
    """Move the run history in `old` to `new` (a move, not a copy: resuming or cancelling
    one of its runs then finds it in one place only); a failure leaves it where it was."""
    try:
        new.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        shutil.move(str(old), str(new))
    except OSError as exc:
        raise ConfigError(f"cannot move the run history from {old} to {new}: {exc}") from None
    if say is not None:
        say(f"moved the run history of an older version from {old} to {new}")


def run_dir(base: Path, run_id: str) -> Path:
    return base / run_id


def save_entry(base: Path, entry: RunEntry) -> None:
    text = json.dumps(dataclasses.asdict(entry), indent=1, sort_keys=True).encode()
    atomic_write(run_dir(base, entry.run_id) / ENTRY, lambda handle: handle.write(text))


def end_entry(base: Path, entry: RunEntry, state: str, error: str = "") -> None:
    """Record that `entry` ended (done, failed or cancelled), and when."""
    entry.state, entry.error, entry.ended = state, error, time.time()
    save_entry(base, entry)


def load_entry(path: Path) -> RunEntry | None:
    """The entry in `path` (a run.json), None when it is missing or unreadable."""
    try:
        data = json.loads(path.read_text())
        names = {f.name for f in dataclasses.fields(RunEntry)}
        return RunEntry(**{k: v for k, v in data.items() if k in names})
    except (OSError, ValueError, TypeError):
        return None


def load_entries(base: Path) -> list[RunEntry]:
    """Every run recorded under `base`, oldest first."""
    if not base.is_dir():
        return []
    entries = [load_entry(p) for p in base.glob(f"*/{ENTRY}")]
    return sorted((e for e in entries if e is not None), key=lambda e: e.started)


def find_entry(base: Path, run_id: str) -> RunEntry | None:
    return load_entry(run_dir(base, run_id) / ENTRY) if run_id else None


def resumable(base: Path, run_file: str, fleet: str) -> RunEntry | None:
    """The newest interrupted run of `run_file` on `fleet` that had started (its roster
    fixed and published), if any: one interrupted while it waited for agents has nothing to
    go on with."""
    wanted = str(Path(run_file).resolve())
    for entry in reversed(load_entries(base)):
        if (
            entry.fleet == fleet
            and entry.run_file == wanted
            and entry.state == "running"
            and entry.shown_state == INTERRUPTED
        ):
            return entry
    return None


def save_records(base: Path, run_id: str, records: dict[str, dict[int, dict[str, Any]]]) -> None:
    """The round records the agents reported so far (a resumed run's report needs them)."""
    plain = {agent: {str(r): row for r, row in rows.items()} for agent, rows in records.items()}
    text = json.dumps(plain, sort_keys=True).encode()
    atomic_write(run_dir(base, run_id) / RECORDS, lambda handle: handle.write(text))


def load_records(base: Path, run_id: str) -> dict[str, dict[int, dict[str, Any]]]:
    try:
        plain = json.loads((run_dir(base, run_id) / RECORDS).read_text())
    except (OSError, ValueError):
        return {}
    return {agent: {int(r): row for r, row in rows.items()} for agent, rows in plain.items()}
