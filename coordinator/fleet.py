"""The coordinator's view of a fleet, built from retained presence and status messages.

MQTT presence is the source of truth for liveness: a retained birth says an agent is
online, its last will (or a clean goodbye) says it is not. This module only folds those
messages into a table (`fleet_table`: what `coordinator status` prints and `--watch` keeps
current); it neither connects nor waits.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import time
from collections.abc import Callable, Collection
from typing import Any

from rich import box
from rich.console import Console
from rich.filesize import decimal
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from coordinator.broker_config import COORDINATOR
from coordinator.status_figures import (
    MAX_ROUNDS,
    TOLD,
    checked,
    header_problem,
    presence_problems,
    status_metrics,
)
from protocol import ProtocolError, messages, topics
from protocol.limits import MAX_MEMBERS
from protocol.logs import RejectionLog, claimed_sender
from protocol.membership import SHUTDOWN, PresenceClock
from protocol.signing import Signer

log = logging.getLogger(__name__)


@dataclasses.dataclass
class AgentEntry:
    fleet: str
    agent: str
    online: bool = False
    since: float = 0.0
    role: str = "agent"
    profile: str = ""
    reason: str = ""
    state: str = ""
    round: int = 0
    run_id: str = ""
    stopped: bool = False
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)


class FleetView:
    """Latest presence and status per (fleet, agent), fed with raw MQTT messages."""

    def __init__(self, key: Signer | None = None) -> None:
        self._key = key
        self._entries: dict[tuple[str, str], AgentEntry] = {}
        self._clocks: dict[str, PresenceClock] = {}
        """fleet -> its members' presence clocks, kept when a member is forgotten, so that
        a presence recorded before a forget and replayed after it is still stale."""
        self.rejected = 0
        self.dropped = 0
        """Messages of members beyond MAX_MEMBERS, left out: anyone on an open broker can
        publish statuses under new names, and each would be kept."""
        self._rejections = RejectionLog(log)

    def feed(self, topic: str, payload: bytes) -> AgentEntry | None:
        """Apply one presence or status message; returns the entry it changed, if any.

        An empty retained payload is how MQTT clears a retained message: the agent is
        forgotten. Malformed messages are logged and counted, never raised.
        """
        try:
            fleet, kind, fields = topics.parse(topic)
            if kind not in ("presence", "status"):
                return None
            if not payload:
                self._entries.pop((fleet, fields["agent"]), None)
                return None
            message = messages.decode(payload, key=self._key)
        except ProtocolError as exc:
            self.rejected += 1
            self._rejections.reject("message", claimed_sender(topic), topic, exc)
            return None
        if message.fleet != fleet or message.sender != fields["agent"]:
            self.rejected += 1
            where = f"{message.fleet}/{message.sender}"
            self._rejections.reject(kind, fields["agent"], topic, f"signed as {where}")
            return None
        if isinstance(message, messages.Presence) and not self._clock(fleet).fresh(message):
            self.rejected += 1
            self._rejections.reject(kind, message.sender, topic, "older than its latest presence")
            return None
        if isinstance(message, messages.Presence) and command_ended(message):
            self._entries.pop((fleet, message.sender), None)
            return None
        if isinstance(message, messages.Status) and (problem := header_problem(message)):
            TOLD.tell(fleet, message.sender, [problem], "status ignored")
            return None
        key = (fleet, message.sender)
        if key not in self._entries and len(self._entries) >= MAX_MEMBERS:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("following %d members at most: leaving out the rest", MAX_MEMBERS)
            return None
        entry = self._entries.setdefault(key, AgentEntry(fleet, message.sender))
        if isinstance(message, messages.Presence):
            apply_presence(entry, message)
        elif isinstance(message, messages.Status):
            entry.state, entry.round, entry.stopped = message.state, message.round, message.stopped
            figures, problems = checked(status_metrics(message), message.round)
            TOLD.tell(fleet, message.sender, problems, "ignored")
            entry.metrics, entry.run_id = figures, message.run_id
        return entry

    def _clock(self, fleet: str) -> PresenceClock:
        if fleet not in self._clocks and len(self._clocks) >= MAX_MEMBERS:
            self._clocks.pop(next(iter(self._clocks)))  # the longest-followed fleet's
        return self._clocks.setdefault(fleet, PresenceClock())

    def entries(self) -> list[AgentEntry]:
        return [self._entries[k] for k in sorted(self._entries)]


def command_ended(presence: messages.Presence) -> bool:
    """Whether `presence` is the goodbye of a `coordinator run` that ended: a command, not a
    member that stays, so it leaves the fleet's table (as a forgotten agent does) rather
    than stand there offline beside the gateway after every run. One that crashed (its
    will, "lost") stays, to be seen."""
    return presence.sender == COORDINATOR and not presence.online and presence.reason == SHUTDOWN


def apply_presence(entry: AgentEntry, presence: messages.Presence) -> None:
    """Fold a presence into the member's entry; a role or profile no agent sends (rich
    markup, 900 kB) is told once and the one known before kept."""
    wrong = dict(presence_problems(presence))
    TOLD.tell(entry.fleet, entry.agent, list(wrong.items()), "ignored", kind="presence")
    entry.online, entry.since, entry.reason = presence.online, presence.since, presence.reason
    if "role" not in wrong:
        entry.role = presence.role
    if "profile" not in wrong:
        entry.profile = presence.profile or entry.profile


RUNS_FOLLOWED = 1000
"""Runs whose progress `FleetLog` keeps: anyone may name new runs in statuses, so it
forgets the oldest rather than grow."""


def remember(figures: dict[Any, Any], key: Any, value: Any) -> None:
    """Set `figures[key]`, dropping the oldest entry beyond `RUNS_FOLLOWED`."""
    figures[key] = value
    if len(figures) > RUNS_FOLLOWED:
        figures.pop(next(iter(figures)))


class FleetLog:
    """What `coordinator serve` tells its user as the fleet goes: a line when an agent's
    presence or state changes, and a line when a run starts or is cancelled, and as it
    reaches further rounds (every `progress_every_s` at most). Not a line per agent per
    round: fifty agents in a hundred-round run would print five thousand."""

    def __init__(self, key: Signer | None = None, progress_every_s: float = 30.0) -> None:
        self.view = FleetView(key=key)
        self._key = key
        self._every_s = progress_every_s
        self._said: dict[tuple[str, str], float] = {}
        """(fleet, run) -> when its progress was last told."""
        self._shown: dict[tuple[str, str], tuple[bool, str, str, bool]] = {}
        self._rounds: dict[tuple[str, str], int] = {}
        """(fleet, run) -> the run's rounds, from its run message."""
        self._furthest: dict[tuple[str, str], int] = {}
        self._runs: dict[str, tuple[str, bool]] = {}
        """fleet -> the run message last told of (a kept run message comes again on every
        reconnect of its coordinator)."""

    def feed(self, topic: str, payload: bytes) -> list[str]:
        """The lines one presence, status or run message calls for (often none)."""
        try:
            fleet, kind, _fields = topics.parse(topic)
        except ProtocolError:
            return []
        if kind == "run":
            return self._run(fleet, payload)
        entry = self.view.feed(topic, payload)
        if entry is None or entry.role != "agent" or not self._in_run(entry):
            return []
        lines = []
        key = (entry.fleet, entry.agent)
        shown = (entry.online, entry.reason, entry.state, entry.stopped)
        if self._shown.get(key) != shown:
            self._shown[key] = shown
            lines.append(self.describe(entry))
        run = (entry.fleet, entry.run_id)
        if entry.run_id and entry.state == "training" and entry.round > self._furthest.get(run, 0):
            remember(self._furthest, run, entry.round)
            now = time.monotonic()
            if now - self._said.get(run, -self._every_s) >= self._every_s:
                remember(self._said, run, now)
                lines.append(
                    f"{entry.fleet}: run {entry.run_id} at round {self._of(run, entry.round)}"
                )
        return lines

    def _in_run(self, entry: AgentEntry) -> bool:
        """Whether the agent's round is one its run has (any, for a run not seen): a member
        claiming round 5000 of a 10-round run moves no line."""
        rounds = self._rounds.get((entry.fleet, entry.run_id), MAX_ROUNDS)
        if entry.round <= rounds:
            return True
        why = f"must be at most run {entry.run_id}'s {rounds} rounds, got {entry.round}"
        TOLD.tell(entry.fleet, entry.agent, [("round", why)], "status ignored")
        return False

    def describe(self, entry: AgentEntry) -> str:
        """'lab/x1: online, training round 3/10': presence without its age (a log line
        carries its own time), the state and, in a run, the round."""
        presence = "online" if entry.online else "lost" if entry.reason == "lost" else "offline"
        if entry.since <= 0:
            presence = "presence unknown"
        state = describe_state(entry)
        if entry.round and entry.state in ("training", "done", "cancelled", "failed"):
            state += f" round {self._of((entry.fleet, entry.run_id), entry.round)}"
        return f"{entry.fleet}/{entry.agent}: {presence}" + (f", {state}" if state else "")

    def _of(self, run: tuple[str, str], round_: int) -> str:
        total = self._rounds.get(run)
        return f"{round_}/{total}" if total else str(round_)

    def _run(self, fleet: str, payload: bytes) -> list[str]:
        if not payload:
            return []
        try:
            run = messages.decode(payload, key=self._key)
        except ProtocolError:
            return []
        if not isinstance(run, messages.RunConfig) or run.fleet != fleet:
            return []
        if self._runs.get(fleet) == (run.run_id, run.cancelled):
            return []
        self._runs[fleet] = (run.run_id, run.cancelled)
        learning = run.config.get("learning", {})
        rounds = learning.get("rounds") if isinstance(learning, dict) else None
        if isinstance(rounds, int):
            remember(self._rounds, (fleet, run.run_id), rounds)
        if run.cancelled:
            return [f"{fleet}: run {run.run_id} cancelled"]
        strategy = learning.get("strategy", "?") if isinstance(learning, dict) else "?"
        return [
            f"{fleet}: run {run.run_id}: {strategy}, {len(run.roster)} agents, "
            f"{rounds if isinstance(rounds, int) else '?'} rounds"
        ]


def describe_presence(entry: AgentEntry, now: float | None = None) -> str:
    """Presence in words: since when online or offline, and whether it crashed or stopped."""
    if entry.online:
        return f"online since {describe_since(entry.since, now)}"
    if entry.reason == "lost":
        return f"lost (came online {describe_since(entry.since, now)})"
    return f"offline since {describe_since(entry.since, now)}"


def describe_state(entry: AgentEntry) -> str:
    """The agent's state in words; an agent that stopped early says when and what it saved."""
    error = entry.metrics.get("error")
    if entry.state == "rejected" and isinstance(error, str):
        return f"left out: {error[:200]}"
    if not entry.stopped:
        return entry.state
    text = f"stopped early after round {entry.round}"
    saved = entry.metrics.get("saved")
    if isinstance(saved, dict) and {"saved_rounds", "saved_flops", "saved_bytes"} <= saved.keys():
        text += (
            f": saved {saved['saved_rounds']} rounds, {saved['saved_flops']:.2e} FLOPs, "
            f"{decimal(saved['saved_bytes'])}"
        )
    return text


def state_word(entry: AgentEntry) -> str:
    """The state as one short word or two, for a table column (`describe_state` says more)."""
    return "left out" if entry.state == "rejected" else entry.state


def error_of(entry: AgentEntry) -> str | None:
    """Why the agent left a run out or failed, if its status says."""
    error = entry.metrics.get("error")
    return error if isinstance(error, str) and error else None


def footnotes(entries: list[AgentEntry]) -> dict[tuple[str, str], int]:
    """A number per distinct reason an agent gives for being left out or failing, keyed by
    agent: a table shows the number beside the state and the reason once below, so that a
    reason of 200 characters (or the same one from fifty agents) does not widen the table."""
    numbers: dict[str, int] = {}
    marks = {}
    for entry in entries:
        error = error_of(entry)
        if error is not None:
            marks[(entry.fleet, entry.agent)] = numbers.setdefault(error, len(numbers) + 1)
    return marks


def describe_since(since: float, now: float | None = None) -> str:
    """A short human age such as '42s ago' or '3h05m ago' for a Unix timestamp."""
    if since <= 0:
        return "unknown"
    age = max(0, int((time.time() if now is None else now) - since))
    if age < 60:
        return f"{age}s ago"
    if age < 3600:
        return f"{age // 60}m{age % 60:02d}s ago"
    if age < 86400:
        return f"{age // 3600}h{age % 3600 // 60:02d}m ago"
    return f"{age // 86400}d{age % 86400 // 3600:02d}h ago"


def figure(entry: AgentEntry, name: str) -> float | None:
    """A number of the agent's latest round from its status, or None where it has none (an
    idle, ready or rejected agent, or a figure that was not finite)."""
    value = entry.metrics.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def describe_budget(entry: AgentEntry) -> str:
    """p_k, the share of the model the device could afford, and what limited it, if anything."""
    p_k = figure(entry, "p_k")
    if p_k is None:
        return ""
    limited_by = entry.metrics.get("limited_by")
    reason = f" ({limited_by})" if isinstance(limited_by, str) and limited_by != "none" else ""
    return f"{p_k:.2f}{reason}"


def seconds(value: float) -> str:
    """Seconds as '12.3', or to two significant digits below one ('0.041')."""
    return f"{value:.1f}" if value >= 1 else f"{value:.2g}"


def describe_train_s(entry: AgentEntry) -> str:
    """The round's measured training seconds over what its cost table predicted, as
    '12.3/11.0' (the measured figure alone when there was no prediction)."""
    measured = figure(entry, "train_s")
    if measured is None:
        return ""
    predicted = figure(entry, "predicted_s")
    return seconds(measured) + ("" if predicted is None else f"/{seconds(predicted)}")


def reduction_of(entry: AgentEntry) -> str:
    """What the budget made the round do ('prefix', 'width+steps', ...), '' if not said."""
    reduction = entry.metrics.get("reduction")
    return escape(reduction[:32]) if isinstance(reduction, str) else ""


def kept_of(entry: AgentEntry) -> str:
    """Which of its models the agent keeps and serves (personal, fleet, local), '' if not
    said (`agent.learning.fallback`)."""
    kept = entry.metrics.get("kept")
    return escape(kept[:16]) if isinstance(kept, str) else ""


def describe_bytes(entry: AgentEntry, name: str) -> str:
    """A round's traffic in decimal units (kB, MB), as link speeds are quoted."""
    value = figure(entry, name)
    return "" if value is None else decimal(int(value))


def describe_stragglers(entry: AgentEntry, shown: int = 2, name: str = "stragglers") -> str:
    """Who this agent went on without in its latest round (or, `name` "quarantined", whom it
    stopped listening to for the run); a long list ends in '+N'."""
    names = entry.metrics.get(name)
    if not isinstance(names, list) or not names:
        return ""
    text = ", ".join(str(name) for name in names[:shown])
    return f"{text} +{len(names) - shown}" if len(names) > shown else text


def describe_number(entry: AgentEntry, name: str, form: str) -> str:
    value = figure(entry, name)
    return "" if value is None else form.format(value)


def describe_metric(entry: AgentEntry) -> str:
    """The task's metric: accuracy as it was, another (mae, reconstruction_error) named."""
    metric = entry.metrics.get("metric")
    shown = describe_number(entry, "accuracy", "{:.3f}")
    if not shown or not isinstance(metric, str) or metric == "accuracy":
        return shown
    return f"{shown} {escape(metric[:32])}"


Cell = Callable[[AgentEntry], str]

COLUMNS: dict[str, Cell] = {
    "fleet": lambda e: e.fleet,
    "agent": lambda e: e.agent if e.role == "agent" else f"{e.agent} [dim]({e.role})[/]",
    "presence": lambda e: f"[{'green' if e.online else 'red'}]{describe_presence(e)}[/]",
    "state": lambda e: describe_state(e) if error_of(e) is None else state_word(e),
    "round": lambda e: str(e.round) if e.state and e.round else "",
    "accuracy": lambda e: describe_metric(e),
    "kept": kept_of,
    "sparsity": lambda e: describe_number(e, "sparsity", "{:.1%}"),
    "p_k": describe_budget,
    "train s": describe_train_s,
    "reduction": reduction_of,
    "sent": lambda e: describe_bytes(e, "bytes_sent"),
    "received": lambda e: describe_bytes(e, "bytes_received"),
    "energy": lambda e: describe_number(e, "energy_j", "{:.1f} J"),
    "epsilon": lambda e: describe_number(e, "epsilon", "{:.2f}"),
    "staleness": lambda e: describe_number(e, "staleness", "{:.1f}"),
    "stragglers": describe_stragglers,
    "quarantined": lambda e: describe_stragglers(e, name="quarantined"),
    "profile": lambda e: e.profile,
}
"""The table's columns and how each shows an agent; the figures are of its latest round."""

TEXT_COLUMNS = frozenset(
    {"fleet", "agent", "state", "stragglers", "quarantined", "reduction", "profile"}
)
"""Columns that wrap; presence and the figures never do."""

WRAP_FLOOR = 13
"""A wrapping column narrower than this reads badly: a word or two a line."""

LEFT_OUT_FIRST = (
    "profile",
    "epsilon",
    "staleness",
    "kept",
    "energy",
    "stragglers",
    "quarantined",
    "reduction",
    "received",
    "sent",
    "train s",
    "sparsity",
)
"""The columns a table too wide for its width drops, in this order."""


def fleet_table(
    entries: list[AgentEntry],
    seen: Collection[tuple[str, str]] | None = None,
    caption: str | None = None,
    width: int | None = None,
) -> Table:
    """The fleet as a table, one row per agent with its latest round's figures; `seen`:
    the (fleet, agent) pairs mDNS sees, which adds that column.

    A single fleet goes in the title rather than a column, the quarantined column shows
    only when some agent quarantined someone, "train s" (measured/predicted) only when some
    agent measures its training, "reduction" only when some agent's budget reduced its
    round (not all "none"), and epsilon and staleness only when some agent reports one
    (`--dp`; asynchronous rounds). To fit `width`, columns are left out
    (`LEFT_OUT_FIRST`; the caption says which) rather than folded letter by letter.
    """
    hidden = {
        "fleet": len({e.fleet for e in entries}) < 2,
        "quarantined": not any(e.metrics.get("quarantined") for e in entries),
        "train s": not any(figure(e, "train_s") is not None for e in entries),
        "reduction": all(reduction_of(e) in ("", "none") for e in entries),
        "kept": not any(kept_of(e) for e in entries),
        "epsilon": not any(figure(e, "epsilon") is not None for e in entries),
        "staleness": not any(figure(e, "staleness") is not None for e in entries),
    }
    names = [name for name in COLUMNS if not hidden.get(name, False)]
    left_out: list[str] = []
    while width is not None and needed_width(entries, names, seen) > width:
        drop = next((name for name in LEFT_OUT_FIRST if name in names), None)
        if drop is None:
            break
        names.remove(drop)
        left_out.append(drop)
    return build_table(entries, names, seen, caption, left_out=left_out)


def needed_width(
    entries: list[AgentEntry], names: list[str], seen: Collection[tuple[str, str]] | None
) -> int:
    """The width at which rich, which narrows the widest wrapping columns first, leaves none
    of them narrower than WRAP_FLOOR (or than its widest cell) and wraps no figure."""
    probe = build_table(entries, names, seen, None, floor=WRAP_FLOOR)
    return Console(width=10_000, file=io.StringIO()).measure(probe).maximum


def build_table(
    entries: list[AgentEntry],
    names: list[str],
    seen: Collection[tuple[str, str]] | None,
    caption: str | None,
    *,
    left_out: list[str] | None = None,
    floor: int | None = None,
) -> Table:
    """The table of `entries` with the columns `names` (and mDNS with `seen`); `floor`: the
    widest a wrapping column may be, to measure the narrowest useful table."""
    fleets = sorted({e.fleet for e in entries})
    notes = [caption] if caption else []
    if left_out:
        notes.append(f"too narrow for {', '.join(left_out)}")
    marks = footnotes(entries)
    table = Table(
        title=f"fleet {fleets[0]}" if len(fleets) == 1 else None,
        caption=table_caption(" · ".join(notes), entries, marks),
        caption_justify="left" if marks else "center",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    for name in names:
        if name in TEXT_COLUMNS:
            table.add_column(name, overflow="fold", max_width=floor)
        else:
            table.add_column(name, justify="left" if name == "presence" else "right", no_wrap=True)
    if seen is not None:
        table.add_column("mDNS", no_wrap=True)
    for e in entries:
        mdns = [("seen" if (e.fleet, e.agent) in seen else "not seen")] if seen is not None else []
        cells = [COLUMNS[name](e) for name in names]
        if "state" in names and (e.fleet, e.agent) in marks:
            cells[names.index("state")] += f" [{marks[e.fleet, e.agent]}]"
        table.add_row(*cells, *mdns)
    return table


def table_caption(
    notes: str, entries: list[AgentEntry], marks: dict[tuple[str, str], int]
) -> Text | None:
    """The caption: `notes` (rich markup), then one line per footnote, each cut to the
    table's width with an ellipsis rather than wrapped."""
    if not notes and not marks:
        return None
    text = Text.from_markup(notes) if notes else Text()
    reasons = {number: error_of(e) for e in entries if (number := marks.get((e.fleet, e.agent)))}
    for number, reason in sorted(reasons.items()):
        if text:
            text.append("\n")
        text.append(f"[{number}] {reason}")
    text.no_wrap, text.overflow = True, "ellipsis"
    return text
