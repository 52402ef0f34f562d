"""An agent's log records, published to its fleet for the length of a run.

A failed run should not mean logging in to every board: while an agent takes part in a run,
`publishing_logs` attaches a `FleetLogHandler` to the root logger that sends the agent's
records (`messages.Log`, signed like every message) on its log topic, and the gateway keeps
them (`coordinator.agent_logs`, `coordinator logs`).

A device's log must never cost it its run, so the handler:
- filters by level (`DEFAULT_LEVEL` unless told; a record below the process's own log level
  is never made at all);
- takes only this agent's records, those `protocol.log_context` says are about it (its
  run's thread, its connection's network and dispatcher threads): several agents may
  share a process (`agent.host`, the Python API), each with its own handler;
- is rate-limited (`RECORDS_PER_INTERVAL` per `INTERVAL_S`) and bounded (each message cut
  to `MAX_MESSAGE_CHARS`, at most `QUEUE_RECORDS` waiting), counting what it leaves out and
  saying so in the next record it sends (`Log.dropped`);
- never blocks the thread that logs: records wait in a queue that a thread of its own
  publishes (QoS 0, like telemetry), and a full queue drops;
- is never recursive: what its own thread logs (publishing, encoding) is never published.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from protocol import messages, topics
from protocol.errors import ProtocolError
from protocol.log_context import agent_of
from protocol.membership import Identity
from protocol.transport import Transport

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
"""The level names a record may carry; a record with another one is rejected."""
DEFAULT_LEVEL = "WARNING"
"""What an agent publishes unless told: what its own console shows by default, and what an
operator needs to find why a run failed, without the per-round INFO chatter of a fleet."""
MAX_MESSAGE_CHARS = 1000
"""Longer messages (a traceback, a dumped config) are cut to this many characters."""
RECORDS_PER_INTERVAL = 20
INTERVAL_S = 10.0
"""At most RECORDS_PER_INTERVAL records per INTERVAL_S from one agent: a warning in a loop
must not flood the broker nor the gateway's disk."""
QUEUE_RECORDS = 100
"""Records waiting to be published at most; beyond it they are dropped and counted."""
MAX_TIME_S = 1e10
"""A record's time (Unix seconds) is at most this (year 2286): a forged one past it would
break every reader's date formatting."""
CLOSE_WAIT_S = 2.0
"""How long the end of a run waits for the records still queued to go out."""
_CUT = " ... [cut]"


def cut(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`message` cut to `limit` characters, saying so at its end when it was."""
    return message if len(message) <= limit else message[: limit - len(_CUT)] + _CUT


class RateLimit:
    """At most `records` per fixed window of `interval_s` (thread-safe)."""

    def __init__(
        self,
        records: int = RECORDS_PER_INTERVAL,
        interval_s: float = INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.records, self.interval_s, self._clock = records, interval_s, clock
        self._lock = threading.Lock()
        self._window_start = clock()
        self._used = 0

    def allow(self) -> bool:
        now = self._clock()
        with self._lock:
            if now - self._window_start >= self.interval_s:
                self._window_start, self._used = now, 0
            if self._used >= self.records:
                return False
            self._used += 1
            return True


class FleetLogHandler(logging.Handler):
    """Publishes the records of `identity`'s threads for run `run_id` (see the module)."""

    def __init__(
        self,
        transport: Transport,
        identity: Identity,
        run_id: str,
        level: str = DEFAULT_LEVEL,
        *,
        limit: RateLimit | None = None,
        queue_records: int = QUEUE_RECORDS,
    ) -> None:
        super().__init__(logging.getLevelName(check_level(level)))
        self._transport, self._identity, self._run_id = transport, identity, run_id
        self._topic = topics.log(identity.fleet, identity.sender)
        self._limit = limit or RateLimit()
        self._queue: queue.Queue[messages.Log | None] = queue.Queue(queue_records)
        self._dropped = 0
        self._count_lock = threading.Lock()
        self._sender = threading.Thread(
            target=self._publish_queued,
            name=f"fleet-log-{identity.fleet}-{identity.sender}",
            daemon=True,
        )
        self._sender.start()

    def owns(self, record: logging.LogRecord) -> bool:
        """Whether this agent made `record`: the agent its thread works for
        (`protocol.log_context`), never this handler's own thread (what publishing logs
        stays here: no recursion)."""
        return record.thread != self._sender.ident and agent_of(record) == self._identity.sender

    def emit(self, record: logging.LogRecord) -> None:
        if not self.owns(record):
            return
        if not self._limit.allow():
            self._drop()
            return
        try:
            text = record.getMessage()
            if record.exc_info:
                text = f"{text}\n{logging.Formatter().formatException(record.exc_info)}"
            with self._count_lock:
                dropped, self._dropped = self._dropped, 0
            log = messages.Log(
                fleet=self._identity.fleet,
                sender=self._identity.sender,
                run_id=self._run_id,
                time=record.created,
                level=record.levelname if record.levelname in LEVELS else "WARNING",
                message=cut(text),
                logger=record.name[:100],
                dropped=dropped,
            )
            self._queue.put_nowait(log)
        except queue.Full:
            self._drop(1 + dropped)
        except Exception:  # a record that cannot be put into a message: never the caller's
            self._drop()

    @property
    def dropped(self) -> int:
        """Records left out since the last one sent."""
        with self._count_lock:
            return self._dropped

    def _drop(self, records: int = 1) -> None:
        with self._count_lock:
            self._dropped += records

    def _publish_queued(self) -> None:
        """Publish what is queued; when nothing came for a whole interval, say how many
        records were left out (a flood that stopped is said before the run ends)."""
        while True:
            try:
                log = self._queue.get(timeout=self._limit.interval_s)
            except queue.Empty:
                note = self._dropped_note() if self.dropped and self._limit.allow() else None
                if note is not None:
                    self._publish(note)
                continue
            if log is None:
                return
            self._publish(log)

    def _publish(self, log: messages.Log) -> None:
        try:
            payload = messages.encode(log, key=self._identity.key)
            self._transport.publish(self._topic, payload, qos=0)
        except Exception:  # a stopped transport, a full queue: the record is lost
            self._drop(1 + log.dropped)

    def close(self) -> None:
        """Publish what is queued (and how many records were left out), then stop."""
        note = self._dropped_note()
        if note is not None:  # waits its turn: a queue still full when the run ends drops it
            with contextlib.suppress(queue.Full):
                self._queue.put(note, timeout=CLOSE_WAIT_S)
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=CLOSE_WAIT_S)
        self._sender.join(CLOSE_WAIT_S)
        super().close()

    def _dropped_note(self) -> messages.Log | None:
        """A record saying how many were left out since the last one sent, if any were."""
        with self._count_lock:
            dropped, self._dropped = self._dropped, 0
        if not dropped:
            return None
        return messages.Log(
            fleet=self._identity.fleet,
            sender=self._identity.sender,
            run_id=self._run_id,
            time=time.time(),
            level="WARNING",
            message=f"log records left out (at most {self._limit.records} per "
            f"{self._limit.interval_s:g} s are sent)",
            dropped=dropped,
        )


def check_level(level: str) -> str:
    """`level` as one of LEVELS (any case); ValueError for another."""
    name = level.upper()
    if name not in LEVELS:
        raise ValueError(f"unknown log level {level!r}; expected one of {', '.join(LEVELS)}")
    return name


@contextlib.contextmanager
def publishing_logs(
    transport: Transport, identity: Identity, run_id: str, level: str | None
) -> Iterator[None]:
    """While in use, the calling thread's agent publishes its records of run `run_id` at
    `level` and above (None: nothing is published)."""
    if level is None:
        yield
        return
    handler = FleetLogHandler(transport, identity, run_id, level)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
        handler.close()


def checked(log: messages.Log) -> dict[str, Any]:
    """A received record as the row the gateway keeps; ProtocolError if it breaks the
    bounds an agent keeps (a forged or foreign sender's record)."""
    if log.level not in LEVELS:
        raise ProtocolError(f"log level {log.level!r:.40} is none of {', '.join(LEVELS)}")
    if len(log.message) > MAX_MESSAGE_CHARS or len(log.logger) > 100:
        raise ProtocolError(f"log record longer than {MAX_MESSAGE_CHARS} characters")
    if log.dropped < 0 or not log.run_id:
        raise ProtocolError("log record without a run, or with a negative count")
    if not 0 <= log.time <= MAX_TIME_S:
        raise ProtocolError(f"log record's time {log.time:.6g} is no time of this era")
    return {
        "time": log.time,
        "agent": log.sender,
        "level": log.level,
        "message": log.message,
        "logger": log.logger,
        "dropped": log.dropped,
    }
