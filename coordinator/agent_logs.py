"""The fleet's logs in one place: the agents' log records of a run, kept by the gateway.

Agents publish their records while they take part in a run (`protocol.fleet_logs`). The
process that conducts the run (`coordinator run`, `coordinator emulate`: the `Conductor`) is
the one that owns the run's folder, so it alone writes them, one writer per file: a
`LogKeeper` checks each record like any other message (signature, sender against its topic,
the run and its roster, the bounds an agent keeps) and appends it to the sender's JSON-lines
file under `RUN_FOLDER/logs/`. Each file is bounded: past `MAX_FILE_BYTES` it rotates to
`AGENT.jsonl.1` (the one before is dropped), so an agent costs the gateway at most twice
that per run, whatever it sends. `coordinator logs` reads them (`LogFollower`);
the dashboard keeps the latest records of each agent in memory (`RecentLogs`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from coordinator.runs import find_entry, load_entries, run_dir
from protocol import messages, topics
from protocol.errors import ProtocolError
from protocol.fleet_logs import checked
from protocol.logs import RejectionLog, claimed_sender
from protocol.signing import Signer
from protocol.transport import Transport

log = logging.getLogger(__name__)

LOGS = "logs"
"""The folder of a run's log files, in the run's folder."""
SUFFIX = ".jsonl"
ROTATED = ".jsonl.1"
MAX_FILE_BYTES = 512 * 1024
"""An agent's log file rotates past this size: at most twice this per agent and run."""
MAX_LINE_BYTES = 16 * 1024
"""More than any kept line: a record's message is cut to `fleet_logs.MAX_MESSAGE_CHARS`."""
RECENT_RECORDS = 50
"""Records of each agent the dashboard keeps (its latest run's; the run's files keep all)."""
RECENT_AGENTS = 1_000
"""Agents the dashboard keeps records of, as many as it shows (`dashboard.state.MAX_AGENTS`):
an open broker's made-up senders must not grow it without end (at most about 85 MB)."""


def verified(
    topic: str, payload: bytes, fleet: str, key: Signer | None
) -> tuple[str, dict[str, Any]]:
    """The run id and the row of a log message on `topic`; ProtocolError if it fails the
    checks any message of the fleet passes, or breaks an agent's bounds."""
    message = messages.decode_on_topic(topic, payload, "log", fleet, key)
    assert isinstance(message, messages.Log)
    return message.run_id, checked(message)


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
"""Control characters but newline and tab, and the marks that reorder text: a device's
message must not drive the operator's terminal (escape sequences) nor disguise itself."""


def line_of(row: dict[str, Any]) -> str:
    """One record as `coordinator logs` and the dashboard print it: time, agent, level and
    message, and how many records the agent left out before it."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(row.get("time", 0))))
    # Its later lines indented: a message cannot pass for another agent's record.
    text = _CONTROL.sub("?", str(row.get("message", ""))).replace("\n", "\n    ")
    if row.get("dropped"):
        text += f" [{row['dropped']} earlier records left out]"
    return f"{when} {row.get('level', '?'):<8} {row.get('agent', '?')}: {text}"


class LogKeeper:
    """Keeps the log records of run `run_id` of `roster` in `folder/logs/` (see the module)."""

    def __init__(
        self,
        fleet: str,
        run_id: str,
        roster: Iterable[str],
        folder: Path,
        key: Signer | None,
        max_file_bytes: int = MAX_FILE_BYTES,
    ) -> None:
        self.fleet, self.run_id, self.key = fleet, run_id, key
        self.roster = frozenset(roster)
        self.folder = folder / LOGS
        self.max_file_bytes = max_file_bytes
        self.kept = 0
        self.rejected = 0
        self._rejections = RejectionLog(log)
        self._lock = threading.Lock()

    def subscribe(self, transport: Transport) -> None:
        transport.subscribe(topics.log(self.fleet), self.feed, qos=0)

    def unsubscribe(self, transport: Transport) -> None:
        transport.unsubscribe(topics.log(self.fleet))

    def feed(self, topic: str, payload: bytes) -> None:
        """Keep one record (a transport handler); a forged or foreign one is counted and
        said (rate-limited), one of another run is ignored."""
        try:
            run_id, row = verified(topic, payload, self.fleet, self.key)
        except ProtocolError as exc:
            self.rejected += 1
            self._rejections.reject("log record", claimed_sender(topic), topic, exc)
            return
        if run_id != self.run_id or row["agent"] not in self.roster:
            return
        line = (json.dumps(row, sort_keys=True) + "\n").encode()
        with self._lock:
            try:
                self._append(row["agent"], line)
            except OSError as exc:  # a full disk costs the logs, never the run
                self._rejections.reject("log record", row["agent"], topic, f"not kept: {exc}")
                return
            self.kept += 1

    def _append(self, agent: str, line: bytes) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{agent}{SUFFIX}"
        size = path.stat().st_size if path.exists() else 0
        if size and size + len(line) > self.max_file_bytes:
            os.replace(path, self.folder / f"{agent}{ROTATED}")
        with open(path, "ab") as handle:
            handle.write(line)


def agents_logged(run_folder: Path) -> list[str]:
    """The agents with records in the run kept in `run_folder`, sorted."""
    folder = run_folder / LOGS
    if not folder.is_dir():
        return []
    names = (p.name for p in folder.iterdir())
    return sorted(name.removesuffix(SUFFIX) for name in names if name.endswith(SUFFIX))


def parse_lines(data: bytes) -> list[dict[str, Any]]:
    """The rows of whole JSON lines in `data`; a damaged line is skipped."""
    rows = []
    for raw in data.splitlines():
        try:
            row = json.loads(raw)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def known_runs(base: Path) -> list[str]:
    """The runs under the runs folder `base` that `coordinator logs` can show (recorded by
    `coordinator run`, or holding log records), oldest first."""
    if not base.is_dir():
        return []
    started = {entry.run_id: entry.started for entry in load_entries(base)}
    for folder in base.iterdir():
        if folder.name not in started and (folder / LOGS).is_dir():
            started[folder.name] = (folder / LOGS).stat().st_mtime
    return sorted(started, key=lambda run_id: (started[run_id], run_id))


def run_to_show(base: Path, run_id: str | None) -> str:
    """`run_id`, or the latest run when None; ValueError with the known ones else."""
    runs = known_runs(base)
    if not runs:
        raise ValueError(f"no runs recorded in {base}")
    if run_id is None:
        return runs[-1]
    if run_id not in runs:
        raise ValueError(f"no run {run_id} in {base}; known runs: {', '.join(runs[-10:])}")
    return run_id


def run_agents(base: Path, run_id: str) -> list[str]:
    """The agents of a run: its roster as recorded, and any agent with records in it."""
    entry = find_entry(base, run_id)
    return sorted(set(entry.agents if entry else []) | set(agents_logged(run_dir(base, run_id))))


class LogFollower:
    """New records of `agents` in a run as they are kept (`coordinator logs --follow`):
    each file is read from where the last call stopped, through a rotation too."""

    def __init__(self, run_folder: Path, agents: Iterable[str] | None) -> None:
        self.folder = run_folder / LOGS
        self.agents = None if agents is None else set(agents)
        self._read: dict[str, tuple[bytes, int]] = {}
        """agent -> (first line, bytes read) of the file it was last read from: a file
        with another first line is a new one (inode numbers are reused at once)."""

    def first_rows(self) -> list[dict[str, Any]]:
        """Every record kept so far (the rotated files' too); `new_rows` goes on from here."""
        rows: list[dict[str, Any]] = []
        for agent in self._agents():
            with _missing_meanwhile():
                rows += parse_lines((self.folder / f"{agent}{ROTATED}").read_bytes())
        return sorted(rows + self.new_rows(), key=lambda row: float(row.get("time", 0)))

    def new_rows(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        for agent in self._agents():
            rows += self._new_of(agent)
        return sorted(rows, key=lambda row: float(row.get("time", 0)))

    def _agents(self) -> list[str]:
        present = agents_logged(self.folder.parent)
        return [a for a in present if self.agents is None or a in self.agents]

    def _new_of(self, agent: str) -> list[dict[str, Any]]:
        head, done = self._read.get(agent, (b"", 0))
        rows: list[dict[str, Any]] = []
        current = self.folder / f"{agent}{SUFFIX}"
        now = _first_line(current)
        if head and now != head:  # the file read so far rotated: its rest first
            rotated = self.folder / f"{agent}{ROTATED}"
            with _missing_meanwhile():
                rows += parse_lines(_tail(rotated, done if _first_line(rotated) == head else 0))
            done = 0
        with _missing_meanwhile():
            data = _tail(current, done)
            whole = data[: data.rfind(b"\n") + 1]  # a line being written is read next time
            rows += parse_lines(whole)
            self._read[agent] = (now, done + len(whole))
        return rows


def _missing_meanwhile() -> contextlib.suppress:
    """Files come and go as they rotate: one gone meanwhile is read next time."""
    return contextlib.suppress(FileNotFoundError)


def _first_line(path: Path) -> bytes:
    """The first line of a log file (its records carry their time: no two files share
    one), empty when it is missing or has none yet."""
    try:
        with open(path, "rb") as handle:
            start = handle.read(MAX_LINE_BYTES)
    except FileNotFoundError:
        return b""
    end = start.find(b"\n")
    return start[: end + 1] if end >= 0 else b""


def _tail(path: Path, offset: int) -> bytes:
    with open(path, "rb") as handle:
        handle.seek(offset)
        return handle.read()


class RecentLogs:
    """The latest records of each agent's latest run, in memory, for the dashboard."""

    def __init__(self, fleet: str, key: Signer | None, per_agent: int = RECENT_RECORDS) -> None:
        self.fleet, self.key, self.per_agent = fleet, key, per_agent
        self._lock = threading.Lock()
        self._rows: dict[str, tuple[str, deque[dict[str, Any]]]] = {}
        self._rejections = RejectionLog(log)

    def feed(self, topic: str, payload: bytes) -> None:
        try:
            run_id, row = verified(topic, payload, self.fleet, self.key)
        except ProtocolError as exc:
            self._rejections.reject("log record", claimed_sender(topic), topic, exc)
            return
        with self._lock:
            held = self._rows.get(row["agent"])
            if held is None and len(self._rows) >= RECENT_AGENTS:
                return
            if held is None or held[0] != run_id:
                held = self._rows[row["agent"]] = (run_id, deque(maxlen=self.per_agent))
            held[1].append(row)

    def of(self, agent: str) -> tuple[str, list[dict[str, Any]]]:
        """The run id and records of `agent`'s latest run ("" and none if it sent none)."""
        with self._lock:
            run_id, rows = self._rows.get(agent, ("", deque()))
            return run_id, list(rows)
