"""What the dashboard knows of the fleet: presence, latest status and every round seen.

`FleetState.feed` is an MQTT handler for the fleet's presence and status topics. Statuses
are retained and each carries its round's full record (`metrics["record"]`), so a watcher
that starts mid-run has every agent's latest round at once and each later round as it
comes (earlier rounds are in the agents' round logs, not on the broker). Readers take a
JSON-ready `snapshot()`; `version` grows on every change, so a reader can wait for the
next one instead of polling the table.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

from coordinator.fleet import AgentEntry, FleetView
from protocol import ProtocolError, messages, topics
from protocol.logs import RejectionLog
from protocol.signing import Signer

log = logging.getLogger(__name__)

MAX_AGENTS = 1_000
"""Members followed at most (over all fleets); messages of further ones are dropped."""
MAX_ROUNDS = 10_000
"""Rounds kept per agent; past that the oldest one received goes. With MAX_AGENTS this
bounds the series at 10 million points (a few GB at worst, for a fleet of a thousand
agents ten thousand rounds long)."""
SERIES = ("accuracy", "loss", "sparsity", "bytes_sent", "bytes_received", "energy_j")
"""Per-round figures kept from each record: what the charts draw."""
TOTALS = ("bytes_sent", "bytes_received", "train_flops", "energy_j")
"""Figures summed over every round received of the agent's latest run: the run's totals
(Prometheus counters, which start again at zero with each run, as a restarted process's
do)."""
ROUND_COST = ("train_s", "predicted_s", "peak_memory_mb", "epsilon")
"""The latest round's measured training seconds (by the device's clock), the seconds its
cost table predicted, its peak training memory [MiB] and its privacy loss so far (epsilon,
under `--dp sample` or `--dp client`)."""
_KINDS = ("presence", "status")


def number(value: Any) -> float | None:
    """A finite number as a float, anything else (text, bool, inf, a huge int) as None:
    what JSON and Prometheus can carry."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        result = float(value)
    except OverflowError:
        return None
    return result if math.isfinite(result) else None


def text(value: Any, limit: int = 200) -> str:
    return value[:limit] if isinstance(value, str) else ""


@dataclasses.dataclass
class AgentSeries:
    """The rounds received from one agent in its current run, and their totals."""

    run_id: str = ""
    strategy: str = ""
    """The run's strategy, as its statuses said it (an idle agent's status after the run
    names none, and the page's header still shows which run it was)."""
    points: dict[int, tuple[float | None, ...]] = dataclasses.field(default_factory=dict)
    """Per round, the SERIES figures of its record (the first copy received)."""
    totals: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(TOTALS, 0.0))
    last: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """The record of the latest round received."""
    last_round: int = 0

    def add(self, round_: int, record: Mapping[str, Any]) -> None:
        """Keep a round's record; a copy of a round already kept (a status re-sent after a
        restart) changes nothing."""
        if round_ in self.points:
            return
        if len(self.points) >= MAX_ROUNDS:
            del self.points[next(iter(self.points))]
        self.points[round_] = tuple(number(record.get(name)) for name in SERIES)
        for name in TOTALS:
            self.totals[name] += number(record.get(name)) or 0.0
        if round_ >= self.last_round:
            self.last, self.last_round = record, round_

    def as_dict(self) -> dict[str, list[Any]]:
        """Column lists ordered by round: `rounds` and one list per SERIES figure."""
        rounds = sorted(self.points)
        columns: dict[str, list[Any]] = {"rounds": rounds}
        for index, name in enumerate(SERIES):
            columns[name] = [self.points[r][index] for r in rounds]
        return columns


class FleetState:
    """Thread-safe fleet table and round series, fed with raw MQTT messages.

    `fleet`: follow that fleet only (None: every fleet the subscription delivers);
    `key`: the fleet key that signs messages, when the fleet uses one.
    """

    def __init__(self, fleet: str | None = None, key: Signer | None = None) -> None:
        self.fleet = fleet
        self._key = key
        self._view = FleetView(key)
        self._rejections = RejectionLog(log)
        self._series: dict[tuple[str, str], AgentSeries] = {}
        self._changed = threading.Condition()
        self._version = 0
        self.dropped = 0
        """Messages of members beyond MAX_AGENTS, left out."""

    @property
    def version(self) -> int:
        with self._changed:
            return self._version

    @property
    def rejected(self) -> int:
        """Messages that failed to decode or authenticate."""
        with self._changed:
            return self._view.rejected

    def feed(self, topic: str, payload: bytes) -> None:
        """Apply one presence or status message (a transport handler); anything else, or a
        message of another fleet, is ignored."""
        try:
            fleet, kind, fields = topics.parse(topic)
        except ProtocolError as exc:
            self._rejections.reject("message", "?", topic, exc)
            return
        if kind not in _KINDS or self.fleet not in (None, fleet):
            return
        key = (fleet, fields["agent"])
        with self._changed:
            if key not in self._series and len(self._series) >= MAX_AGENTS:
                self.dropped += 1
                if self.dropped == 1:
                    log.warning("following %d members at most: leaving out the rest", MAX_AGENTS)
                return
            if not self._apply(key, kind, topic, payload):
                return
            self._version += 1
            self._changed.notify_all()

    def _apply(self, key: tuple[str, str], kind: str, topic: str, payload: bytes) -> bool:
        """Fold the message in; False when it changed nothing (rejected, or clearing a
        member never seen)."""
        entry = self._view.feed(topic, payload)
        if entry is None:
            return not payload and self._series.pop(key, None) is not None
        series = self._series.setdefault(key, AgentSeries())
        if kind == "status":
            self._add_record(key, series, entry, payload)
        return True

    def _add_record(
        self, key: tuple[str, str], series: AgentSeries, entry: AgentEntry, payload: bytes
    ) -> None:
        """Keep the status's round record; a status of a new run starts the series anew."""
        run_id = messages.decode(payload, key=self._key).run_id
        if run_id and run_id != series.run_id:
            series = self._series[key] = AgentSeries(run_id=run_id)
        strategy = entry.metrics.get("strategy")
        if isinstance(strategy, str) and strategy:
            series.strategy = text(strategy)
        record = entry.metrics.get("record")
        if isinstance(record, dict) and entry.round >= 1:
            series.add(entry.round, record)

    def wait_for_change(self, version: int, timeout_s: float | None = None) -> int:
        """Block until the version differs from `version` or `timeout_s` passes; returns
        the version now."""
        with self._changed:
            self._changed.wait_for(lambda: self._version != version, timeout_s)
            return self._version

    def snapshot(self, series: bool = True) -> dict[str, Any]:
        """The fleet as plain JSON data: `fleets` (summaries), `agents` (table rows, each
        with its `series` unless told not to), `members` (non-agents such as the
        coordinator), the `version` and the server's clock `now`."""
        with self._changed:
            rows = [
                agent_row(entry, self._series.get((entry.fleet, entry.agent)), series)
                for entry in self._view.entries()
            ]
            version = self._version
        agents = [row for row in rows if row["role"] == "agent"]
        return {
            "version": version,
            "now": time.time(),
            "fleets": fleet_summaries(agents),
            "agents": agents,
            "members": [row for row in rows if row["role"] != "agent"],
        }


def presence_word(entry: AgentEntry) -> str:
    """online, offline (said goodbye), lost (its will: it vanished) or unknown (no presence
    message seen yet)."""
    if entry.online:
        return "online"
    if entry.since <= 0:
        return "unknown"
    return "lost" if entry.reason == "lost" else "offline"


def savings(entry: AgentEntry) -> dict[str, Any] | None:
    """What stopping early saved (rounds, FLOPs, bytes, energy), for a stopped agent."""
    saved = entry.metrics.get("saved")
    if not entry.stopped or not isinstance(saved, dict):
        return None
    return {
        "round": saved["round"] if isinstance(saved.get("round"), int) else entry.round,
        "rounds": number(saved.get("saved_rounds")),
        "flops": number(saved.get("saved_flops")),
        "bytes": number(saved.get("saved_bytes")),
        "energy_j": number(saved.get("saved_energy_j")),
    }


def agent_row(entry: AgentEntry, series: AgentSeries | None, with_series: bool) -> dict[str, Any]:
    """One member's table row; figures that are missing or not finite numbers are None."""
    series = series or AgentSeries()
    record = entry.metrics.get("record")
    # The latest status, its round's record, else the latest round received (a status
    # such as a restarted agent's "stopped" carries no record).
    sources = (entry.metrics, record if isinstance(record, dict) else {}, series.last)

    def figure(name: str) -> Any:
        return next((source[name] for source in sources if name in source), None)

    def names(name: str) -> list[str]:
        listed = figure(name)
        return [s for s in listed if isinstance(s, str)][:64] if isinstance(listed, list) else []

    row: dict[str, Any] = {
        "fleet": entry.fleet,
        "agent": entry.agent,
        "role": text(entry.role, 64),
        "profile": text(entry.profile, 64),
        "online": entry.online,
        "presence": presence_word(entry),
        "since": number(entry.since),
        "state": text(entry.state, 64),
        # An agent back to idle after a run says round 0: show the run's last round.
        "round": entry.round or series.last_round,
        "run_id": series.run_id,
        "strategy": series.strategy,
        **{name: number(figure(name)) for name in ("accuracy", "loss", "sparsity", "p_k")},
        # The round's measured cost against the cost table's prediction (None from an
        # agent that does not measure it) and what its budget made it do.
        **{name: number(figure(name)) for name in ROUND_COST},
        # How many rounds stale what its latest asynchronous round took in was, on average
        # (None: a synchronous round).
        "staleness": number(figure("staleness")),
        "reduction": text(figure("reduction"), 64),
        "reduction_why": text(figure("reduction_why")),
        # Which of its models the agent keeps and serves (personal, fleet, local) and why.
        "kept": text(figure("kept"), 64),
        "kept_why": text(figure("kept_why")),
        # What "accuracy" holds: the run task's metric (mae, reconstruction_error, ...).
        "metric": text(figure("metric"), 64) or "accuracy",
        # The run's DP mode (sample, client), which says whose epsilon `epsilon` is.
        "dp": text(figure("dp"), 16),
        "limited_by": text(figure("limited_by"), 64),
        "bytes_sent": series.totals["bytes_sent"],
        "bytes_received": series.totals["bytes_received"],
        "train_flops": series.totals["train_flops"],
        "energy_j": number(figure("energy_j")),
        "energy_total_j": series.totals["energy_j"] if figure("energy_j") is not None else None,
        "stragglers": names("stragglers"),
        "quarantined": names("quarantined"),
        "stopped": entry.stopped,
        "saved": savings(entry),
        "error": text(entry.metrics.get("error"), 500),
    }
    if with_series:
        row["series"] = series.as_dict()
    return row


def most_said(rows: list[dict[str, Any]], name: str) -> str:
    """The value of `name` most of the rows give (their run, their strategy), "" if none."""
    said = Counter(row[name] for row in rows if row[name])
    return said.most_common(1)[0][0] if said else ""


def fleet_summaries(agents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per fleet: agents known, online and stopped, the furthest round, the run and strategy
    most of its agents are in, the mean of the metric most of them report (a member
    naming another metric is left out of the mean: an mae is no accuracy) and its epsilon
    (`fleet_epsilon`)."""
    summaries = []
    for fleet in sorted({row["fleet"] for row in agents}):
        rows = [row for row in agents if row["fleet"] == fleet]
        metrics = Counter(row["metric"] for row in rows if row["accuracy"] is not None)
        metric = metrics.most_common(1)[0][0] if metrics else "accuracy"
        accuracies = [
            row["accuracy"]
            for row in rows
            if row["accuracy"] is not None and row["metric"] == metric
        ]
        summaries.append(
            {
                "fleet": fleet,
                "agents": len(rows),
                "online": sum(row["online"] for row in rows),
                "stopped": sum(row["stopped"] for row in rows),
                "round": max(row["round"] for row in rows),
                "mean_accuracy": sum(accuracies) / len(accuracies) if accuracies else None,
                "metric": metric,
                "run_id": most_said(rows, "run_id"),
                "strategy": most_said(rows, "strategy"),
                **fleet_epsilon(rows),
            }
        )
    return summaries


def fleet_epsilon(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The fleet's privacy loss so far: the largest epsilon its members report (under `--dp
    sample` each device's own, and the fleet's guarantee is its weakest member's; under
    `--dp client` the run's, which every participant reports alike) and the DP mode most
    of them say; nothing without DP."""
    reported = [row["epsilon"] for row in rows if row["epsilon"] is not None]
    return {"epsilon": max(reported), "dp": most_said(rows, "dp")} if reported else {}
