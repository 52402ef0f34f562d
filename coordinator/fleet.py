"""The coordinator's view of a fleet, built from retained presence and status messages.

MQTT presence is the source of truth for liveness: a retained birth says an agent is
online, its last will (or a clean goodbye) says it is not. This module only folds those
messages into a table; it neither connects nor waits.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from protocol import ProtocolError, messages, topics

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
    stopped: bool = False
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)


class FleetView:
    """Latest presence and status per (fleet, agent), fed with raw MQTT messages."""

    def __init__(self, key: bytes | None = None) -> None:
        self._key = key
        self._entries: dict[tuple[str, str], AgentEntry] = {}
        self.rejected = 0

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
            log.warning("ignoring message on %s: %s", topic, exc)
            return None
        if message.fleet != fleet or message.sender != fields["agent"]:
            self.rejected += 1
            log.warning("ignoring message on %s: sent by %s/%s", topic, fleet, message.sender)
            return None
        entry = self._entries.setdefault((fleet, message.sender), AgentEntry(fleet, message.sender))
        if isinstance(message, messages.Presence):
            entry.online, entry.since = message.online, message.since
            entry.role, entry.profile = message.role, message.profile or entry.profile
            entry.reason = message.reason
        elif isinstance(message, messages.Status):
            entry.state, entry.round, entry.stopped = message.state, message.round, message.stopped
            entry.metrics = message.metrics
        return entry

    def entries(self) -> list[AgentEntry]:
        return [self._entries[k] for k in sorted(self._entries)]


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
            f"{saved['saved_bytes']:,} bytes"
        )
    return text


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
