"""The figures of a member's status, checked before the coordinator reads any of them.

The protocol only makes sure a status's `metrics` are plain finite data (`protocol.messages`).
Every reader on the coordinator's side (the fleet table, `serve`'s log, the dashboard and its
Prometheus series, `coordinator run`'s roster and report) then takes a figure for what its
name says, so one member's absurd claim would become what operators see: an accuracy of
7.0 or 1e300 in a fleet-wide mean, a negative byte counter, a p_k of 5, a 900 kB string
folded into the table, a round of 10^9 as the fleet's round, or rich markup that crashes
`coordinator status`. `checked` keeps each figure that is plausible for what an agent
reports (`agent.runtime.session.STATUS_FIGURES`, `agent.report.AgentRound`), leaves out the
others, and says why in one line each; `tell` writes such a line once per member and
figure in the whole process, however many readers (serve's log and its dashboard, run's
roster and its conductor) come across the same status.

Figures no reader here uses pass unchecked (a newer agent's), `data` too: `agent.own_data.
parse_description` checks it where a run is built.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import unicodedata
from collections.abc import Callable, Mapping
from typing import Any

from protocol import ProtocolError
from protocol.limits import MAX_MEMBERS, MAX_ROUNDS, WEEK_S
from protocol.logs import BURST, INTERVAL_S
from protocol.messages import Presence, Status
from protocol.topics import check_name

log = logging.getLogger(__name__)

MAX_BYTES = 1 << 50
"""A round's traffic: a pebibyte is beyond any device link."""
MAX_FLOPS = 1e21
"""A round's training: a zettaFLOP is a week of a 1.6 PFLOP/s machine."""
MAX_JOULES = 1e10
"""A round's energy: ten gigajoules is a week at 16 kW."""
MAX_MIB = float(1 << 24)
"""A round's peak memory [MiB]: 16 TiB."""
MIN_PREDICTED_S = 1e-6
"""No cost table predicts a round under a microsecond; a smaller prediction would make the
measured-over-predicted ratio (a Prometheus gauge) astronomical."""
MAX_MAGNITUDE = 1e12
"""A loss, a vote score or a metric other than accuracy (mae, reconstruction error, a run's
own) of larger magnitude is no result a model gives."""
MAX_EPSILON = 1e9
"""A privacy loss epsilon beyond a billion is no accountant's figure (one past a few dozen
already protects nothing)."""
MAX_UNIX_S = 1e10
"""A time stamp beyond the year 2286 is none."""
LABEL_CHARS = 64
REASON_CHARS = 2000
"""The longest label (limited_by, reduction, kept, metric) and reason (error, kept_why...)."""
STRATEGY_CHARS = 200
"""The longest strategy: a shipped one's name or a user's class's import path."""
_LABEL = re.compile(r"^[A-Za-z0-9_ .,:+()/-]*$")
"""What a label such as "time (floored)" or "prefix+steps" is made of: no markup brackets,
no control characters."""
_VOTES = re.compile(r"^[01]*$")
_ROW = re.compile(r"\[\d+\]")
"""A record's index in a figure's name ("records[12].accuracy"): told once for all rows."""

Check = Callable[[Any], str | None]
"""Why a figure's value is not plausible ("must be ..."), or None when it is."""


def number_in(low: float, high: float, *, whole: bool = False) -> Check:
    """A check that a figure is a number (`whole`: an integer) within [low, high]."""
    kind = "a whole number" if whole else "a number"
    shown = f"[{low:,}, {high:,}]" if whole else f"[{low:g}, {high:g}]"

    def check(value: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)):
            return f"must be {kind} in {shown}"
        return None if low <= value <= high else f"must be {kind} in {shown}"

    return check


def label(value: Any) -> str | None:
    """A short word or two: what a table column, a log line or a Prometheus label shows."""
    if isinstance(value, str) and len(value) <= LABEL_CHARS and _LABEL.match(value):
        return None
    return f"must be a label of at most {LABEL_CHARS} letters, digits and _ .,:+()/-"


def reason(value: Any) -> str | None:
    """A sentence or a few, without control characters (a terminal would obey an escape
    sequence in one) other than line breaks and tabs."""
    if (
        isinstance(value, str)
        and len(value) <= REASON_CHARS
        and not any(unicodedata.category(c)[0] == "C" and c not in "\n\t" for c in value)
    ):
        return None
    return f"must be text of at most {REASON_CHARS:,} printable characters"


def strategy_name(value: Any) -> str | None:
    """A strategy's name, or a user's class's import path (``mypkg.mod:Class``,
    ``./strategy.py:Class``): a label's characters, longer."""
    if isinstance(value, str) and len(value) <= STRATEGY_CHARS and _LABEL.match(value):
        return None
    return f"must be a strategy's name or import path of at most {STRATEGY_CHARS} characters"


def member_name(value: Any) -> str | None:
    try:
        check_name(value)
    except ProtocolError:
        return "must be a member's name"
    return None


def member_names(value: Any) -> str | None:
    """Whom an agent went on without, or quarantined: members' names, a fleet's at most."""
    if not isinstance(value, list) or len(value) > MAX_MEMBERS:
        return f"must be a list of at most {MAX_MEMBERS:,} members' names"
    return "must be a list of members' names" if any(map(member_name, value)) else None


def flag(value: Any) -> str | None:
    return None if isinstance(value, bool) else "must be true or false"


def votes(value: Any) -> str | None:
    if isinstance(value, str) and len(value) <= MAX_ROUNDS and _VOTES.match(value):
        return None
    return f"must be at most {MAX_ROUNDS:,} digits 0 and 1"


SHARE = number_in(0, 1)
SECONDS = number_in(0, WEEK_S)
MAGNITUDE = number_in(-MAX_MAGNITUDE, MAX_MAGNITUDE)
ROUND = number_in(0, MAX_ROUNDS, whole=True)
BYTES = number_in(0, MAX_BYTES, whole=True)
FLOPS = number_in(0, MAX_FLOPS)
JOULES = number_in(0, MAX_JOULES)

ROUND_FIGURES: dict[str, Check] = {
    "round": number_in(1, MAX_ROUNDS, whole=True),
    "agent": member_name,
    "loss": MAGNITUDE,
    "train_loss": MAGNITUDE,
    "score": MAGNITUDE,
    "sparsity": SHARE,
    "p_k": SHARE,
    "density_cap": SHARE,
    "active_fraction": SHARE,
    "bytes_sent": BYTES,
    "bytes_received": BYTES,
    "nonzeros_sent": BYTES,
    "train_flops": FLOPS,
    "fallback_flops": FLOPS,
    "energy_j": JOULES,
    "radio_energy_j": JOULES,
    "train_s": SECONDS,
    "predicted_s": number_in(MIN_PREDICTED_S, WEEK_S),
    "wait_s": SECONDS,
    "throttled_s": SECONDS,
    "peak_memory_mb": number_in(0, MAX_MIB),
    "finished_at": number_in(0, MAX_UNIX_S),
    "t_star": ROUND,
    "epsilon": number_in(0, MAX_EPSILON),
    "staleness": number_in(0, MAX_ROUNDS),
    "vote": flag,
    "pruned": flag,
    "stopped": flag,
    "limited_by": label,
    "reduction": label,
    "kept": label,
    "metric": label,
    "strategy": strategy_name,
    "dp": label,
    "energy_source": label,
    "reduction_why": reason,
    "kept_why": reason,
    "stop_reason": reason,
    "stragglers": member_names,
    "quarantined": member_names,
}
"""A round's figures (a status's and its record's, `agent.report.AgentRound`) and their
checks; `accuracy` and `strategy_accuracy` depend on the metric (`metric_check`)."""

SAVED: dict[str, Check] = {
    "round": ROUND,
    "saved_rounds": ROUND,
    "saved_flops": number_in(0, MAX_FLOPS * MAX_ROUNDS),
    "saved_bytes": number_in(0, MAX_BYTES * MAX_ROUNDS, whole=True),
    "saved_energy_j": number_in(0, MAX_JOULES * MAX_ROUNDS),
}
"""What stopping early saved (`agent.report.early_stop_savings`): the rounds not run times a
round's figures."""

METRIC_FIGURES = ("accuracy", "strategy_accuracy")
"""The task's metric after the round, of the model kept and of the strategy's own."""

REQUIRED = ("round", "agent", "accuracy", "loss", "sparsity")
"""The figures without which a round record is no round of a report (`AgentRound`'s fields
without a default; train_loss too, which may be None)."""
SUMMED = ("accuracy", "sparsity", "bytes_sent", "bytes_received", "train_flops")
"""Figures a report adds up (`agent.report.summarize`): None there is no figure at all."""


def metric_check(metric: str) -> Check:
    """Accuracy is a share; another task's metric (mae, reconstruction_error, a run's own)
    only a number of plausible magnitude."""
    return SHARE if metric == "accuracy" else MAGNITUDE


def checked_round(
    figures: Mapping[str, Any], metric: str, where: str = ""
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """`figures` without those that fail their checks (None is no figure, and passes), and
    (name, why) for each one left out; `where` prefixes the names ("record.")."""
    checks = ROUND_FIGURES | dict.fromkeys(METRIC_FIGURES, metric_check(metric))
    kept: dict[str, Any] = {}
    problems = []
    for name, value in figures.items():
        check = checks.get(name)
        why = None if value is None or check is None else check(value)
        if why is None:
            kept[name] = value
        else:
            problems.append((where + name, f"{why}, got {shown(value)}"))
    return kept, problems


def checked_saved(value: Any) -> str | None:
    """The savings of an agent that stopped early, whole or not at all (a table shows all
    three of rounds, FLOPs and bytes)."""
    if not isinstance(value, dict):
        return "must be a map of what stopping early saved"
    for name, check in SAVED.items():
        figure = value.get(name)
        if (figure is not None or name != "saved_energy_j") and (why := check(figure)):
            return f"{name} {why}, got {shown(figure)}"
    return None


def checked_records(
    rows: Any, metric: str, where: str
) -> tuple[list[dict[str, Any]] | None, list[tuple[str, str]]]:
    """A list of round records, each with its implausible figures left out; None (with why)
    for anything else."""
    if not isinstance(rows, list) or len(rows) > MAX_ROUNDS:
        return None, [(where, f"must be a list of round records, got {shown(rows)}")]
    kept, problems = [], []
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            problems.append((f"{where}[{index}]", f"must be a round record, got {shown(row)}"))
            continue
        figures, wrong = checked_round(row, metric, f"{where}[{index}].")
        kept.append(figures)
        problems += wrong
    return kept, problems


def checked_last_run(value: Any, metric: str) -> tuple[Any, list[tuple[str, str]]]:
    """How the agent's last run ended (`agent.runtime.run_files.ending`), for an idle status:
    its id, final state and round checked, its records as `checked_records` leaves them."""
    if not isinstance(value, dict):
        return None, [("last_run", f"must be a map, got {shown(value)}")]
    for name, check in (("run_id", member_name), ("state", member_name), ("round", ROUND)):
        if why := check(value.get(name)):
            return None, [(f"last_run.{name}", f"{why}, got {shown(value.get(name))}")]
    records, problems = checked_records(value.get("records", []), metric, "last_run.records")
    return {**value, "records": records or []}, problems


def checked(
    metrics: Mapping[str, Any], round_: int, metric: str | None = None
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """A status's `metrics` with every implausible figure left out, and (figure, why) for each.

    `metric`: the run's metric, which decides whether accuracy is a share; None takes the
    status's own (`metric`), accuracy when it names none. Its round `record` must be of the
    status's `round_`; `error`, a reason; `saved` and `last_run` are kept whole or not at all.
    """
    if metric is None:
        claimed = metrics.get("metric")
        metric = claimed if isinstance(claimed, str) and label(claimed) is None else "accuracy"
    own = {k: v for k, v in metrics.items() if k in ROUND_FIGURES or k in METRIC_FIGURES}
    figures, problems = checked_round(own, metric)
    for name, value in metrics.items():
        if name not in own:
            wrong, kept = other_figure(name, value, round_, metric)
            problems += wrong
            if kept is not None or value is None:
                figures[name] = kept
    return figures, problems


def other_figure(
    name: str, value: Any, round_: int, metric: str
) -> tuple[list[tuple[str, str]], Any]:
    """The problems of one figure that is not a round's own, and what is kept of it."""
    if value is None:
        return [], None
    if name == "record":
        if not isinstance(value, dict):
            return [(name, f"must be a round record, got {shown(value)}")], None
        if value.get("round", round_) != round_:
            got = shown(value.get("round"))
            return [(name, f"must be of the status's round {round_}, got round {got}")], None
        record, problems = checked_round(value, metric, "record.")
        return problems, record
    if name == "records":
        rows, problems = checked_records(value, metric, name)
        return problems, rows
    if name == "last_run":
        ending, problems = checked_last_run(value, metric)
        return problems, ending
    checks: dict[str, Check] = {"error": reason, "saved": checked_saved, "votes": votes}
    why = checks[name](value) if name in checks else None
    if why is None:
        return [], value
    return [(name, why if name == "saved" else f"{why}, got {shown(value)}")], None


def incomplete(record: Mapping[str, Any]) -> str | None:
    """Why a checked round record cannot be a round of a report: a figure it must have is
    missing (or was left out), or one the report adds up is None; None when it can."""
    missing = [name for name in REQUIRED if record.get(name) is None]
    missing += [name for name in SUMMED if name in record and record[name] is None]
    if "train_loss" not in record:
        missing.append("train_loss")
    return f"lacks {', '.join(sorted(set(missing)))}" if missing else None


def status_metrics(status: Status) -> dict[str, Any]:
    """A status's metrics with its typed round figure among them (`staleness`, when it has
    one), so that every reader takes the latest round's figures from one map."""
    if status.staleness is None:
        return status.metrics
    return {**status.metrics, "staleness": status.staleness}


def header_problem(status: Status) -> tuple[str, str] | None:
    """(field, why) when a status's header is none an agent sends: a state or run id that is
    not a name, a round beyond any run's; None when it is plausible."""
    if why := member_name(status.state):
        return "state", f"{why}, got {shown(status.state)}"
    if status.run_id and (why := member_name(status.run_id)):
        return "run_id", f"{why}, got {shown(status.run_id)}"
    if why := ROUND(status.round):
        return "round", f"{why}, got {shown(status.round)}"
    return None


def presence_problems(presence: Presence) -> list[tuple[str, str]]:
    """(field, why) of a presence's role and device profile that are none an agent sends:
    the fleet table shows both, and a profile of rich markup would crash it."""
    problems = []
    if why := member_name(presence.role):
        problems.append(("role", f"{why}, got {shown(presence.role)}"))
    if presence.profile and (why := label(presence.profile)):
        problems.append(("profile", f"{why}, got {shown(presence.profile)}"))
    return problems


def shown(value: Any) -> str:
    """A figure as a log line may show it: short values as they are, long ones described."""
    if isinstance(value, str) and len(value) > 40:
        return f"text of {len(value):,} characters"
    if isinstance(value, (list, dict)) and len(repr(value)) > 40:
        kind = "a list" if isinstance(value, list) else "a map"
        return f"{kind} of {len(value):,} items"
    return ascii(value)


class FigureLog:
    """One warning line per member and figure left out, however often it is sent again and
    however many readers see it (a record's figure once for all its rounds).

    Like `protocol.logs.RejectionLog`, it writes at most `burst` lines per `interval_s`: on
    an open broker anyone may publish statuses under thousands of names. A line held back is
    not remembered, so it is written when the status comes again (every round). At most
    `remembered` (member, figure) pairs are kept, the oldest forgotten first (and told
    again, should it come back)."""

    def __init__(
        self,
        logger: logging.Logger = log,
        *,
        interval_s: float = INTERVAL_S,
        burst: int = 4 * BURST,
        remembered: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self._interval_s, self._burst, self._remembered = interval_s, burst, remembered
        self._clock = clock
        self._told: dict[tuple[str, str, str], None] = {}
        self._window: tuple[float, int] = (-interval_s, 0)
        """When the current interval began, and the lines written in it."""
        self._lock = threading.Lock()

    def tell(
        self,
        fleet: str,
        agent: str,
        problems: list[tuple[str, str]],
        what: str,
        kind: str = "status",
    ) -> int:
        """Warn of each (figure, why) of a `kind` message not told yet for `fleet`/`agent`,
        ending with `what` ("ignored"); returns how many lines were written."""
        written = 0
        for figure, why in problems:
            if self._first(fleet, agent, f"{kind}.{_ROW.sub('[]', figure)}"):
                self._log.warning(
                    "agent %s/%s's %s: %r %s - %s", fleet, agent, kind, figure, why, what
                )
                written += 1
        return written

    def _first(self, fleet: str, agent: str, figure: str) -> bool:
        """Whether to tell of `figure` now: not told yet, and the interval's lines not spent."""
        key = (fleet, agent, figure)
        now = self._clock()
        with self._lock:
            began, lines = self._window
            if now - began >= self._interval_s:
                began, lines = now, 0
            if key in self._told or lines >= self._burst:
                return False
            self._window = (began, lines + 1)
            self._told[key] = None
            if len(self._told) > self._remembered:
                del self._told[next(iter(self._told))]
            return True

    def clear(self) -> None:
        with self._lock:
            self._told.clear()
            self._window = (-self._interval_s, 0)


TOLD = FigureLog()
"""The process's log of figures left out (`FigureLog`)."""
