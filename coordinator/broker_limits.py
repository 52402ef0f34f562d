"""What the embedded broker may hold, bounded: connections, CONNECTs, retained messages, log lines.

A gateway's broker listens on the LAN, where a stranger can open connections without ever
logging in and a member can publish whatever its grant allows. Unbounded, either fills the
gateway: 1,100 idle connections exhausted its file descriptors (logins and the dashboard
timed out), 950 slow CONNECTs with 64 KB fields took 500 MiB, 1,000 retained 1 MB messages
took 1 GB, and the resulting errors wrote 117 MB of log in a minute. `BrokerBounds` states
the limits; `ConnectionBook` and `RetainedBook` keep the counts the broker checks against
them (plain bookkeeping, called from the broker's one event loop); `LineBudget` keeps a
flood of log lines from filling the disk.

The bound these give, under any mix of the floods above (`BrokerBounds.memory_bound`):
- descriptors: at most `connections` client sockets, itself at most the process's soft
  `RLIMIT_NOFILE` less `RESERVED_FDS` (the gateway's files, its own clients, the dashboard);
- a connection that has not logged in: at most `connect_timeout_s` seconds, a CONNECT of at
  most `connect_bytes`, `pending` of them at once and `pending_per_source` from one address;
- a member (a login, or an admitted key): at most `connections_per_member` connections, each
  holding at most one packet of `broker_config.MAX_PACKET_BYTES` being read, and at most
  `retained_bytes_per_member` retained, only on the topics the protocol retains;
- everything retained: at most `retained_bytes`.
"""

from __future__ import annotations

import logging
import resource
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from coordinator.broker_config import MAX_PACKET_BYTES
from protocol import topics
from protocol.errors import ProtocolError

MIB = 1024 * 1024
RESERVED_FDS = 64
"""Descriptors kept for the gateway's own files and clients: the broker takes no client past
the soft limit less these."""
STREAM_BUFFER_BYTES = 2 * 64 * 1024
"""What asyncio reads ahead of the broker per connection before it stops reading (twice a
StreamReader's default limit)."""
CONNECTION_OVERHEAD_BYTES = 24 * 1024
"""What one connection costs the broker beyond its buffers, taken high: 6.8 KiB of RSS each
measured for 250 connections waiting for their CONNECT (socket, transport, task); a logged-in
one's session and handler (not measured) are allowed the rest."""


@dataclass(frozen=True)
class BrokerBounds:
    """The embedded broker's limits; each has a default that fits a fleet of a few hundred
    devices on a gateway, and all are stated in `deploy.md`."""

    connections: int = 4096
    """Client connections at once (lowered to the descriptor limit, see `usable`)."""
    pending: int = 256
    """Connections that have not yet logged in, at once."""
    pending_per_source: int = 64
    """Of those, from one address (but the gateway's own, see LOCAL)."""
    connect_timeout_s: float = 10.0
    """A connection's CONNECT must arrive whole within this time, or it is closed."""
    connect_bytes: int = 16 * 1024
    """The largest CONNECT taken (an agent's is under 2 KB: ids, a proof, its last will)."""
    connections_per_member: int = 8
    """Connections of one member at once (an agent holds two: its own and its id's prober);
    the coordinator's login, which all of the gateway's commands share, is not counted."""
    anonymous_per_source: int = 32
    """Anonymous connections from one address, on a broker that admits them to read
    (per-device keys without logins)."""
    retained_bytes: int = 512 * MIB
    """Retained messages in all."""
    retained_bytes_per_member: int = 64 * MIB
    """Retained messages of one member (its presence, status, tallies and, with `--wire
    layers`, the layers of its latest models)."""

    def usable(self) -> BrokerBounds:
        """These bounds with `connections` lowered to what the descriptor limit allows."""
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return self
        allowed = max(16, soft - RESERVED_FDS)
        return self if self.connections <= allowed else replace(self, connections=allowed)

    def memory_bound(self, members: int) -> int:
        """The most the broker's connections and retained store hold, in bytes, with
        `members` members logged in: what a flood can add over an idle broker."""
        pending = self.pending * (self.connect_bytes + STREAM_BUFFER_BYTES)
        logged_in = min(self.connections, members * self.connections_per_member)
        per_connection = MAX_PACKET_BYTES + STREAM_BUFFER_BYTES + CONNECTION_OVERHEAD_BYTES
        retained = min(self.retained_bytes, members * self.retained_bytes_per_member)
        idle = self.connections * CONNECTION_OVERHEAD_BYTES
        return pending + idle + logged_in * per_connection + retained


def raise_fd_limit(wanted: int = 65536) -> int:
    """Raise this process's soft descriptor limit towards its hard limit (a gateway's shell
    often leaves 1024 of a hard 1M), to at most `wanted`; returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


LOCAL = ("127.0.0.1", "::1")
"""The addresses of the gateway's own processes (`coordinator emulate` starts a fleet of
agents there at once): not held to `pending_per_source`."""


@dataclass(eq=False)
class Connection:
    """One client connection's place in the book: where from, and (once logged in) as whom."""

    source: str
    abort: Callable[[], None]
    """Closes the connection at once (its task then ends and `ConnectionBook.close` runs)."""
    member: str | None = None
    anonymous: bool = False
    logged_in: bool = False
    closed: bool = False


@dataclass
class ConnectionBook:
    """Who holds the broker's connections: the counts `BrokerBounds` limits.

    When `pending` connections wait for their CONNECT, a new one closes the one that has
    waited longest from the address that has most waiting (an address's own are refused
    past `pending_per_source`): a flood from a few addresses then closes its own
    connections, never a device's (one waiting from its address, for milliseconds), and
    a flood from many holds a slot only while it keeps opening connections."""

    bounds: BrokerBounds
    exempt: frozenset[str] = frozenset()
    """Members whose connections are not counted (the coordinator's login)."""
    total: int = 0
    waiting: dict[str, dict[Connection, None]] = field(default_factory=dict)
    """Connections not yet logged in, per address, oldest first."""
    pending: Counter[str] = field(default_factory=Counter)
    members: Counter[str] = field(default_factory=Counter)
    anonymous: Counter[str] = field(default_factory=Counter)

    def open(self, source: str, abort: Callable[[], None]) -> tuple[Connection | None, str | None]:
        """A new connection from `source`, or why it is closed unread."""
        if self.total >= self.bounds.connections:
            return None, f"{self.total} connections (the most the broker takes)"
        if self.pending[source] >= self.bounds.pending_per_source and source not in LOCAL:
            return None, f"{self.bounds.pending_per_source} connections not yet logged in from it"
        if self.pending.total() >= self.bounds.pending:
            busiest, _count = self.pending.most_common(1)[0]
            oldest = next(iter(self.waiting[busiest]))
            self.close(oldest)
            oldest.abort()
        connection = Connection(source, abort)
        self.total += 1
        self.pending[source] += 1
        self.waiting.setdefault(source, {})[connection] = None
        return connection, None

    def log_in(self, connection: Connection, member: str | None, guarded: bool) -> str | None:
        """Count `connection` as `member`'s (None: anonymous), or say why it is refused."""
        if connection.closed:
            return "closed while it logged in (more connections waited than the broker takes)"
        if guarded and member is None:
            if self.anonymous[connection.source] >= self.bounds.anonymous_per_source:
                return f"{self.bounds.anonymous_per_source} anonymous connections from it"
            self.anonymous[connection.source] += 1
            connection.anonymous = True
        elif guarded and member not in self.exempt:
            assert member is not None
            if self.members[member] >= self.bounds.connections_per_member:
                return f"member {member!r} already holds {self.bounds.connections_per_member}"
            self.members[member] += 1
            connection.member = member
        self._stop_waiting(connection)
        connection.logged_in = True
        return None

    def _stop_waiting(self, connection: Connection) -> None:
        _decrement(self.pending, connection.source)
        waiting = self.waiting[connection.source]
        del waiting[connection]
        if not waiting:
            del self.waiting[connection.source]

    def close(self, connection: Connection) -> None:
        """`connection` ended (a second call changes nothing)."""
        if connection.closed:
            return
        connection.closed = True
        self.total -= 1
        if not connection.logged_in:
            self._stop_waiting(connection)
        elif connection.anonymous:
            _decrement(self.anonymous, connection.source)
        elif connection.member is not None:
            _decrement(self.members, connection.member)


def _decrement(counter: Counter[str], key: str) -> None:
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]


RETAINED_KINDS = ("presence", "status", "absent", "telemetry", "run", "tally", "model")
"""The topics the protocol publishes retained: births and wills, statuses (and their JSON
copies), the keeper's absence notice, the run, tallies, and the layers of `--wire layers`."""


def retained_by_protocol(topic: str) -> bool:
    """Whether `topic` is one the protocol retains (see RETAINED_KINDS)."""
    parts = topic.split("/")
    if len(parts) < 4 or "/".join(parts[:2]) != topics.PREFIX:
        return False
    if parts[3] == "telemetry" and len(parts) == 5:
        return True
    try:
        return topics.parse(topic)[1] in RETAINED_KINDS
    except ProtocolError:
        return False


@dataclass
class RetainedBook:
    """Who holds how much of the retained store, so that `admit` can keep it in bounds."""

    bounds: BrokerBounds
    topics_only: bool = False
    """Take retained messages only on the protocol's retained topics (a guarded broker)."""
    held: dict[str, tuple[str, int]] = field(default_factory=dict)
    """topic -> (owner, bytes)."""
    by_owner: Counter[str] = field(default_factory=Counter)
    total: int = 0

    def admit(self, owner: str, topic: str, size: int) -> str | None:
        """Record `owner`'s retained message of `size` bytes on `topic` (replacing the one
        held there), or say why it is not retained (it is still delivered)."""
        if self.topics_only and not retained_by_protocol(topic):
            return "not a topic the protocol retains"
        old_owner, old_size = self.held.get(topic, (owner, 0))
        mine = self.by_owner[owner] - (old_size if old_owner == owner else 0) + size
        if mine > self.bounds.retained_bytes_per_member:
            return f"over {self.bounds.retained_bytes_per_member // MIB} MiB retained by one member"
        if self.total - old_size + size > self.bounds.retained_bytes:
            return f"over {self.bounds.retained_bytes // MIB} MiB retained in all"
        self.forget(topic)
        self.held[topic] = (owner, size)
        self.by_owner[owner] += size
        self.total += size
        return None

    def forget(self, topic: str) -> None:
        """The retained message on `topic` was cleared."""
        owner, size = self.held.pop(topic, ("", 0))
        self.total -= size
        self.by_owner[owner] -= size
        if self.by_owner[owner] <= 0:
            del self.by_owner[owner]


class LineBudget(logging.Filter):
    """At most `per_line` records of one logger and message template, and `in_all` records
    in all, every `interval_s`; the next record let through says how many were left out.

    A flood (connections refused by thousands, a client failing in a loop) otherwise writes
    one line, or one traceback, per event: 117 MB of log in a minute."""

    def __init__(
        self,
        per_line: int = 5,
        in_all: int = 50,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.per_line, self.in_all, self.interval_s = per_line, in_all, interval_s
        self._clock = clock
        self._window_start = clock()
        self._seen: Counter[tuple[str, str]] = Counter()
        self._passed = 0
        self._dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        now = self._clock()
        if now - self._window_start >= self.interval_s:
            self._window_start, self._seen, self._passed = now, Counter(), 0
        key = (record.name, str(record.msg)[:40])  # f-strings: their first words
        self._seen[key] += 1
        if self._seen[key] > self.per_line or self._passed >= self.in_all:
            self._dropped += 1
            return False
        self._passed += 1
        if self._dropped:
            record.msg = f"{record.msg} ({self._dropped} similar log lines left out before it)"
            self._dropped = 0
        return True
