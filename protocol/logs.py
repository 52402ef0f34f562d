"""Warnings about rejected messages, rate-limited.

A message that fails its checks deserves one warning line to an operator. A flood of them
(an attacker on the broker, or a peer with the wrong key) must not fill a device's disk,
and each line is a few hundred bytes. So `RejectionLog` writes at most one warning per
(kind, claimed sender) per interval and at most `burst` per interval in all; the next
warning it writes says how many it left out since the last one. Nothing is stored per
rejected message, so a flood of distinct claimed senders costs no memory either.

The sender of a message that failed its checks is only what the message (or its topic)
claims: the line says "claimed sender", never names it as if it were established.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from protocol import topics
from protocol.errors import ProtocolError

INTERVAL_S = 10.0
"""At most one warning per (kind, claimed sender) in this many seconds."""
BURST = 5
"""At most this many warnings in one interval, whatever their senders."""
SHOWN_CHARS = 200
"""Topics and reasons are cut to this length: they may be an attacker's megabytes."""


def claimed_sender(topic: str) -> str:
    """The agent a fleet topic names as its sender, or '?' when it names none."""
    try:
        return topics.parse(topic)[2].get("agent", "?")
    except ProtocolError:
        return "?"


class RejectionLog:
    """Rate-limited "rejected ..." warnings for one receiver (thread-safe: the transport's
    network thread and its dispatcher both reject)."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        interval_s: float = INTERVAL_S,
        burst: int = BURST,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self._interval_s = interval_s
        self._burst = burst
        self._clock = clock
        self._lock = threading.Lock()
        self._warned: dict[tuple[str, str], float] = {}
        """(kind, claimed sender) -> when last warned, within the last interval only."""
        self._suppressed = 0

    def reject(self, kind: str, sender: str, where: str, reason: object) -> bool:
        """Warn that a `kind` message of claimed `sender`, seen on `where` (its topic), was
        rejected for `reason`, unless the limits say to only count it; returns whether a
        line was written."""
        key = (kind, sender[:SHOWN_CHARS])
        now = self._clock()
        with self._lock:
            self._warned = {k: t for k, t in self._warned.items() if now - t < self._interval_s}
            if key in self._warned or len(self._warned) >= self._burst:
                self._suppressed += 1
                return False
            self._warned[key] = now
            suppressed, self._suppressed = self._suppressed, 0
        since = f" ({suppressed} more rejected since the last warning)" if suppressed else ""
        self._log.warning(
            "rejected %s of claimed sender %r on %r: %s%s",
            kind,
            key[1],
            where[:SHOWN_CHARS],
            str(reason)[:SHOWN_CHARS],
            since,
        )
        return True
