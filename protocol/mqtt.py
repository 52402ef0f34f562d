"""MQTT transport: a paho-mqtt client that chunks, reassembles, deduplicates and reconnects.

It carries opaque payloads (knows nothing of training or tensors) and provides:

- connection with capped exponential backoff, retried forever, the first attempt included,
  so an agent may start before its broker;
- a retained birth message republished on every (re)connect and a retained last will, each
  framed with a fresh message id every time so receivers never mistake a new presence for
  a redelivery of an old one;
- QoS 1 publishing of payloads of any size: above `chunk_size` they are split into frames
  (`protocol.chunking`), so one publish of a 20 MB model uploads it once for all subscribers;
- handlers that see each message once per message id, however often the broker redelivers
  it, and frames that are malformed or corrupt dropped with a logged reason and a counter;
- a bounded outgoing queue: `publish` waits for room and raises PublishQueueFull after
  `queue_timeout_s`, so a long broker outage cannot eat the device's memory.

Design choices: MQTT 3.1.1 (both amqtt and mosquitto speak it fully) with clean sessions;
subscriptions are restored by the client on every connect, which also works after a broker
restart that lost all sessions, where a persistent session would not help. The price: what
others publish while this client is offline is lost to it, except retained messages; the
protocol copes with that through straggler timeouts and retained status. Our own unacked
QoS 1 frames are kept and resent after a reconnect. Handlers run on one dispatcher thread,
in arrival order, never on paho's network thread, so a slow handler cannot stall keepalive
pings or acknowledgements (deliveries wait in a bounded queue for a slow handler).

Memory for what others send is bounded by `Limits`: message size, partial reassembly (in
total, in count and per topic) and the delivery queue; `set_limits` applies the limits the run's
model implies (`protocol.limits.limits_for_shapes`) once the run is known.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import math
import secrets
import socket
import ssl
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode

from protocol import topics
from protocol.chunking import DEFAULT_CHUNK_SIZE, Reassembler, fits_one_frame, split
from protocol.errors import ProtocolError
from protocol.limits import DEFAULT_LIMITS, Limits
from protocol.log_context import bound
from protocol.logs import RejectionLog, claimed_sender

log = logging.getLogger(__name__)
_DROPS = RejectionLog(log)
"""Warnings of dropped frames, one limit for the process (a receiver's transports share it)."""

Handler = Callable[[str, bytes], None]
"""Called with (topic, whole payload) once per message."""
Stamped = bytes | Callable[[float], bytes]
"""A birth's or a will's payload, or what makes it from the connection's start (wall clock,
seconds), made anew for every connection so that receivers can order them (a birth and
the will of one connection get the same start)."""
Credentials = Callable[[str], tuple[str, str]]
"""(user name, password) for a connection of this client id, asked before every connect:
a per-device key's connect proof is fresh each time (`protocol.signing.connect_proof`)."""


class PublishQueueFull(RuntimeError):
    """The outgoing queue stayed full for `queue_timeout_s` (broker gone or link too slow)."""


@dataclass(frozen=True)
class BrokerAddress:
    host: str
    port: int = 1883

    @classmethod
    def parse(cls, text: str, default_port: int = 1883) -> BrokerAddress:
        """Parse `host`, `host:port`, `[v6addr]` or `[v6addr]:port`."""
        text = text.strip()
        host, port = text, str(default_port)
        if text.startswith("["):
            end = text.find("]")
            if end < 0 or (text[end + 1 :] and not text[end + 1 :].startswith(":")):
                raise ValueError(f"bad broker address {text!r}: expected [v6addr] or [v6addr]:port")
            host, port = text[1:end], text[end + 2 :] or port
        elif text.count(":") == 1:
            host, port = text.split(":")
        elif ":" in text and not _is_ipv6(text):
            raise ValueError(
                f"bad broker address {text!r}: expected host, host:port or [v6addr]:port"
            )
        if not host or any(c.isspace() or c in "/@" for c in host):
            raise ValueError(f"bad broker address {text!r}: expected host or host:port")
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"bad broker port in {text!r}: expected a number in 1..65535")
        return cls(host, int(port))

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def _is_ipv6(text: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(text), ipaddress.IPv6Address)
    except ValueError:
        return False


@dataclass(frozen=True)
class TlsOptions:
    """Passed through to paho's tls_set; `insecure` skips the broker hostname check."""

    ca_certs: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    insecure: bool = False


@dataclass(frozen=True)
class TransportOptions:
    client_id: str | None = None
    """None: a random id. Two live clients with one id keep kicking each other off."""
    username: str | None = None
    password: str | None = None
    credentials: Credentials | None = None
    """Made before every (re)connect; replaces username and password when given."""
    tls: TlsOptions | None = None
    keepalive_s: int = 30
    """The broker declares the client dead (and publishes its will) after 1.5 x this."""
    backoff_min_s: float = 0.5
    backoff_max_s: float = 30.0
    chunk_size: int = DEFAULT_CHUNK_SIZE
    max_queued: int = 512
    """QoS 1 frames published but not yet acknowledged by the broker (512 x 256 KiB)."""
    queue_timeout_s: float = 30.0
    reassembly_timeout_s: float = 120.0
    limits: Limits = DEFAULT_LIMITS
    """Sizes of messages, of partial reassembly and of the delivery queue, from the start;
    `MqttTransport.set_limits` replaces them with the run's (`PRE_RUN_LIMITS` until then
    suits an agent: it receives no chunked message before its run)."""


class Publication:
    """A publish in flight; published once the broker acknowledged every QoS 1 frame of it.

    Mirrors paho's MQTTMessageInfo, except that wait_for_publish returns False on timeout
    instead of raising. QoS 0 publications count as published at once: nobody acks them.
    """

    def __init__(self, outgoing: _OutgoingQueue, frames: int) -> None:
        self._outgoing = outgoing
        self._remaining = frames

    def is_published(self) -> bool:
        return self._outgoing.until(lambda: self._remaining == 0, 0.0)

    def wait_for_publish(self, timeout_s: float | None = None) -> bool:
        """Block until published or timeout (None: no timeout); True when published."""
        return self._outgoing.until(lambda: self._remaining == 0, timeout_s)


class Counters:
    """A transport's traffic counters (its `stats`), counted from the network, dispatcher and
    caller threads alike."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def get(self, key: str) -> int:
        return self._counts[key]  # one dict read: atomic, no lock needed

    def stats(self, reassembly: Mapping[str, int]) -> dict[str, int]:
        """The counters, the reassembler's events (`reassembly.<event>`) and `reconnects`;
        the caller holds whatever guards `reassembly`."""
        with self._lock:
            stats = dict(self._counts)
        stats.update({f"reassembly.{k}": v for k, v in reassembly.items()})
        stats["reconnects"] = max(0, stats.get("connects", 0) - 1)
        return stats


class _OutgoingQueue:
    """The QoS 1 frames published but not yet acknowledged, and the waits on them.

    Kept apart from the transport because its locking is delicate. paho calls on_publish
    while holding its own message lock, and publish() takes that lock while we hold `_lock`,
    so `acknowledge` (called from on_publish) must not take `_lock`: it only appends the mid
    to `_acks` (under `_ack_cond`, to wake waiters) and `_settle()` matches acks to
    publications later, under `_lock`.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[int, Publication] = {}
        self._acks: deque[int] = deque()
        self._ack_cond = threading.Condition()
        self._ack_seq = 0

    def __len__(self) -> int:
        """Frames awaiting their acknowledgement."""
        return len(self._pending)

    def track(self, mid: int, publication: Publication) -> None:
        """Note a frame sent for `publication`; only from the `then` of `until`."""
        self._pending[mid] = publication

    def acknowledge(self, mid: int) -> None:
        """The broker acknowledged frame `mid` (paho's network thread: never blocks long)."""
        with self._ack_cond:
            self._acks.append(mid)
            self._ack_seq += 1
            self._ack_cond.notify_all()

    def until(
        self,
        ready: Callable[[], bool],
        timeout_s: float | None,
        then: Callable[[], None] | None = None,
    ) -> bool:
        """Wait until ready() holds under _lock (then run then() under it); False on timeout."""
        deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s
        while True:
            seq = self._ack_seq
            with self._lock:
                self._settle()
                if ready():
                    if then is not None:
                        then()
                    return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            with self._ack_cond:
                if self._ack_seq == seq:
                    self._ack_cond.wait(None if remaining == math.inf else remaining)

    def _settle(self) -> None:
        """Apply broker acknowledgements to their publications; caller holds _lock."""
        while self._acks:
            publication = self._pending.pop(self._acks.popleft(), None)
            if publication is not None:  # None: birth, QoS 0, or a mid from before a stop
                publication._remaining -= 1


_Delivery = tuple[str, bytes, list[Handler]]


class Dispatcher:
    """Runs the handlers of whole messages on one thread, in arrival order.

    Never on paho's network thread, so a slow handler cannot stall keepalive pings or
    acknowledgements; a failing handler is logged and counted and does not stop the others.
    Deliveries wait in a bounded queue (`limits.max_queued_messages` and `max_queued_bytes`):
    when it is full, `put` refuses the new one, which its sender's protocol recovers (a
    request, a retained status republished every round). The defaults, and the bounds
    `limits_for_shapes` derives (several whole models), are far above what legitimate traffic
    queues: handlers only validate and store, while a flood could otherwise queue without end.
    """

    def __init__(self, name: str, count: Callable[[str], None], limits: Limits) -> None:
        self._count = count
        self.limits = limits
        self._deliveries: deque[_Delivery | None] = deque()
        self._queued_bytes = 0
        self._cond = threading.Condition()
        # The handlers' log lines are those of the agent that made this transport.
        self._thread = threading.Thread(target=bound(self._loop), name=name, daemon=True)
        self.started = False

    def start(self) -> None:
        self.started = True
        self._thread.start()

    def put(self, topic: str, payload: bytes, handlers: list[Handler]) -> bool:
        """Queue a delivery; False (and nothing queued) when the queue is full."""
        with self._cond:
            if (
                len(self._deliveries) >= self.limits.max_queued_messages
                or self._queued_bytes + len(payload) > self.limits.max_queued_bytes
            ):
                return False
            self._deliveries.append((topic, payload, handlers))
            self._queued_bytes += len(payload)
            self._cond.notify()
        return True

    def stop(self, timeout_s: float) -> None:
        """Run what is queued, then end the thread (waiting up to timeout_s for it)."""
        if self.started:
            with self._cond:
                self._deliveries.append(None)
                self._cond.notify()
            self._thread.join(timeout_s)

    def _next(self) -> _Delivery | None:
        with self._cond:
            self._cond.wait_for(lambda: bool(self._deliveries))
            delivery = self._deliveries.popleft()
            if delivery is not None:
                self._queued_bytes -= len(delivery[1])
            return delivery

    def _loop(self) -> None:
        while (delivery := self._next()) is not None:
            topic, payload, handlers = delivery
            for handler in handlers:
                try:
                    handler(topic, payload)
                except Exception:
                    self._count("handler_errors")
                    log.exception("handler %r failed on a message on %s", handler, topic)


@dataclass
class _Subscription:
    qos: int
    handlers: list[Handler]


class _SubscriptionTable:
    """The subscriptions, the connection state, and which SUBACKs are still awaited.

    One condition guards all three, so `wait_subscribed` sees them change together. With
    clean sessions the broker forgets subscriptions on every disconnect: `connected()` sends
    them all again.
    """

    def __init__(self, client: paho.Client) -> None:
        self._client = client
        self._cond = threading.Condition()
        self._subs: dict[str, _Subscription] = {}
        self._unacked: set[int] = set()
        self.is_connected = False
        self._refused = False

    def wait_connected(self, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.is_connected, timeout_s)

    def wait_subscribed(self, timeout_s: float, *, or_refused: bool = False) -> bool:
        with self._cond:
            self._cond.wait_for(
                lambda: (self.is_connected and not self._unacked) or (or_refused and self._refused),
                timeout_s,
            )
            return self.is_connected and not self._unacked

    def refused(self) -> None:
        """The broker refused a connection attempt: a waiter that asked to hear of it stops."""
        with self._cond:
            self._refused = True
            self._cond.notify_all()

    def add(self, topic_filter: str, handler: Handler, qos: int) -> None:
        with self._cond:
            sub = self._subs.setdefault(topic_filter, _Subscription(qos, []))
            sub.qos = max(sub.qos, qos)
            sub.handlers.append(handler)
            if self.is_connected:
                self._send_subscribe([(topic_filter, sub.qos)])

    def remove(self, topic_filter: str) -> None:
        with self._cond:
            if self._subs.pop(topic_filter, None) is not None and self.is_connected:
                self._client.unsubscribe(topic_filter)

    @contextlib.contextmanager
    def scoped(self) -> Iterator[None]:
        """Drop the handlers added inside (and the filters left without one) at its end."""
        with self._cond:
            mark = {f: len(sub.handlers) for f, sub in self._subs.items()}
        try:
            yield
        finally:
            with self._cond:
                for topic_filter, sub in list(self._subs.items()):
                    kept = mark.get(topic_filter, 0)
                    if kept == 0:
                        self.remove(topic_filter)
                    else:
                        del sub.handlers[kept:]

    def handlers_for(self, topic: str) -> list[Handler]:
        with self._cond:
            return [
                h for f, sub in self._subs.items() if topics.matches(f, topic) for h in sub.handlers
            ]

    def connected(self) -> None:
        """A (re)connect: subscribe to every filter again, on this new session."""
        with self._cond:
            self._unacked.clear()
            if self._subs:
                self._send_subscribe([(f, s.qos) for f, s in self._subs.items()])
            self.is_connected, self._refused = True, False
            self._cond.notify_all()

    def disconnected(self, *, lost: bool) -> None:
        """The connection ended; `lost` (not our stop): its SUBACKs will never come."""
        with self._cond:
            self.is_connected = False
            if lost:
                self._unacked.clear()
            self._cond.notify_all()

    def acknowledged(self, mid: int) -> None:
        """The broker answered the SUBSCRIBE `mid`."""
        with self._cond:
            self._unacked.discard(mid)
            self._cond.notify_all()

    def _send_subscribe(self, filters: list[tuple[str, int]]) -> None:
        """Caller holds _cond, so the SUBACK cannot be handled before the mid is noted."""
        rc, mid = self._client.subscribe(filters)
        log.debug("subscribing to %s: rc %s, mid %s", [f for f, _ in filters], rc, mid)
        if rc == MQTTErrorCode.MQTT_ERR_SUCCESS and mid is not None:
            self._unacked.add(mid)


CALLBACKS = (
    "pre_connect",
    "connect",
    "connect_fail",
    "disconnect",
    "subscribe",
    "publish",
    "message",
)
"""The paho events a transport handles, each in its `_on_<event>` method."""


class _KeptRetained:
    """Retained messages published with `keep`: the latest payload of each topic, and
    whether it is framed (framed anew for every publish, so that no receiver takes it for a
    redelivery of what it has seen)."""

    def __init__(self) -> None:
        self._kept: dict[str, tuple[bytes, bool]] = {}
        self._lock = threading.Lock()

    def note(self, topic: str, payload: bytes, retain: bool, keep: bool, framed: bool) -> None:
        """A publish on `topic`: kept, or (a newer message not kept) the kept one dropped."""
        if keep and not retain:
            raise ValueError("only a retained message is kept for reconnects")
        with self._lock:
            if keep:
                self._kept[topic] = (payload, framed)
            else:
                self._kept.pop(topic, None)

    def publish(
        self,
        client: paho.Client,
        birth: tuple[str, bytes] | None,
        chunk_size: int,
        count: Callable[[str, int], None],
    ) -> None:
        """Publish the birth and the kept messages, retained with QoS 1, through `client`."""
        with self._lock:
            kept = list(self._kept.items())
        if birth is not None:
            kept.insert(0, (birth[0], (birth[1], True)))
        for topic, (payload, framed) in kept:
            frame = split(payload, chunk_size)[0] if framed else payload
            client.publish(topic, frame, qos=1, retain=True)
            count("published_frames", 1)
            count("published_bytes", len(frame))


class Announcements:
    """A client's birth and will (each one retained frame, see `Stamped`), made for each
    connection, and the credentials it connects with."""

    def __init__(
        self,
        will: tuple[str, Stamped] | None,
        birth: tuple[str, Stamped] | None,
        options: TransportOptions,
    ) -> None:
        self._will, self._birth, self._options = will, birth, options
        self.stamp = time.time()
        """When the current (or last) connection began; never goes back."""
        for name, message in (("will", will), ("birth", birth)):
            made = self._made(message)
            if made is not None and len(made[1]) > options.chunk_size:
                raise ValueError(f"{name} payload must fit in one frame ({options.chunk_size} B)")

    def _made(self, message: tuple[str, Stamped] | None) -> tuple[str, bytes] | None:
        if message is None:
            return None
        topic, payload = message
        return topic, payload(self.stamp) if callable(payload) else payload

    def birth(self) -> tuple[str, bytes] | None:
        """The birth of the current connection."""
        return self._made(self._birth)

    def prepare(self, client: paho.Client, client_id: str) -> None:
        """Before a (re)connect: a new stamp, the will and credentials made for it."""
        self.stamp = max(time.time(), self.stamp + 1e-3)
        will = self._made(self._will)
        if will is not None:
            frame = split(will[1], self._options.chunk_size)[0]
            client.will_set(will[0], frame, qos=1, retain=True)
        if self._options.credentials is not None:
            client.username_pw_set(*self._options.credentials(client_id))


TAKEN_OVER_LOSSES, TAKEN_OVER_WINDOW_S = 3, 60.0
"""A connection the broker accepts and then drops this many times within this window is
being taken over: MQTT hands a client id to its newest connection and tells the older one
nothing, so two clients with one id take it from each other in turn."""


class _Losses:
    """A connection's story in the log: a refusal (`refusal`), each connection the broker
    dropped after accepting it and, when it comes back, after how long; and when they look
    taken over: the last TAKEN_OVER_LOSSES came within
    the window (said at most once a window, counted in the transport's stats as
    `taken_over`). A connection the broker refused was never accepted: not a loss."""

    def __init__(
        self,
        broker: BrokerAddress,
        client_id: str,
        count: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._broker, self._client_id, self._count, self._clock = broker, client_id, count, clock
        self._losses: deque[float] = deque(maxlen=TAKEN_OVER_LOSSES)
        self._said = -math.inf
        self._since: float | None = None
        """When the connection was lost, until it is back."""
        self._accepted = False
        """Whether the broker accepted the current connection (paho reports a refused one
        as a connection, then its end)."""
        self.refused: str | None = None
        """Why the broker refused the last attempt, if it did; None once one is accepted."""

    def refusal(self, reason: str, connected_before: bool) -> None:
        """The broker refused a connection. Said once: before a first connection by whoever
        waits for it, in one line (`protocol.membership.connect`), so only at INFO here;
        after one (credentials revoked since), as a warning."""
        level = logging.WARNING if connected_before and self.refused is None else logging.INFO
        self.refused = reason
        log.log(level, "MQTT broker %s refused the connection: %s", self._broker, reason)

    def accepted(self) -> None:
        """The broker accepted a connection: if one was lost, say it is back, and when."""
        self.refused, self._accepted = None, True
        if self._since is not None:
            lasted = self._clock() - self._since
            log.warning("reconnected to MQTT broker %s after %.1f s", self._broker, lasted)
            self._since = None

    def ended(self, reason: Any) -> None:
        """A connection ended, not by `stop`: a loss if the broker had accepted it."""
        accepted, self._accepted = self._accepted, False
        if accepted:
            self.lost(reason)

    def lost(self, reason: Any) -> None:
        log.warning("lost MQTT broker %s (%s); reconnecting", self._broker, _why_lost(reason))
        now = self._clock()
        if self._since is None:
            self._since = now
        self._losses.append(now)
        burst = len(self._losses) == TAKEN_OVER_LOSSES
        if not burst or now - self._losses[0] > TAKEN_OVER_WINDOW_S:
            return
        self._losses.clear()
        if now - self._said <= TAKEN_OVER_WINDOW_S:
            return
        self._said = now
        self._count("taken_over")
        log.warning(
            "MQTT broker %s dropped this connection %d times in %.0f s, each time after "
            "accepting it: if the network is steady, another client uses client id %r "
            "(a second process, or a board with this device's id and key such as a copied "
            "SD card): stop it, or give this device a new key and admit it again with "
            "`coordinator admit ID KEY --replace`",
            self._broker, TAKEN_OVER_LOSSES, TAKEN_OVER_WINDOW_S, self._client_id,
        )  # fmt: skip


def _why_lost(reason: Any) -> str:
    """paho's reason for a lost MQTT 3.1.1 connection in words: it names a dropped socket
    (the broker gone, the network down) "Unspecified error"."""
    text = str(reason)
    return "connection dropped" if text == "Unspecified error" else text


class _LinkDrops:
    """`MqttTransport.drop_link`: an emulated device's link that drops
    (`agent.runtime.dozing`), a mixin that keeps the transport's class to its concerns."""

    options: TransportOptions
    _client: paho.Client
    _stopped: bool

    def drop_link(self, seconds: float) -> None:
        """Lose the connection as a dropped link would (no DISCONNECT: the broker publishes
        the will), and connect again after `seconds`: paho's backoff, set to that for this
        loss alone, then set back once the reconnect is due."""
        if self._stopped:
            return
        delay = max(1, math.ceil(seconds))  # paho sleeps its backoff in whole seconds
        self._client.reconnect_delay_set(delay, delay)
        sock = self._client.socket()
        if isinstance(sock, socket.socket):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        restore = threading.Timer(delay + 0.5, _set_backoff, (self._client, self.options))
        restore.daemon = True
        restore.start()


class MqttTransport(_LinkDrops):
    """One connection to one broker; see the module docstring for what it guarantees.

    `will` and `birth` are (topic, payload) pairs, both retained with QoS 1 and small (one
    frame); a payload may be made per connection (`Stamped`). A clean `stop()` does not
    fire the will (MQTT semantics): publish the offline presence yourself first and wait
    for it: `transport.publish(...).wait_for_publish(5)`.
    """

    def __init__(
        self,
        broker: BrokerAddress,
        options: TransportOptions | None = None,
        *,
        will: tuple[str, Stamped] | None = None,
        birth: tuple[str, Stamped] | None = None,
    ) -> None:
        self.broker = broker
        self.options = options = options or TransportOptions()
        self.announced = Announcements(will, birth, options)
        self._kept = _KeptRetained()
        self.client_id = options.client_id or f"edgefl-{secrets.token_hex(6)}"
        self._reassembler = Reassembler(options.limits, options.reassembly_timeout_s)
        self._counters = Counters()
        self._count = self._counters.count
        self._outgoing = _OutgoingQueue()
        self._losses = _Losses(broker, self.client_id, self._count)
        self._stopped = False
        self._reassembly_lock = threading.Lock()
        dispatching = f"mqtt-dispatch-{self.client_id}"
        self._dispatcher = Dispatcher(dispatching, self._count, options.limits)
        self._client = _new_client(self.client_id, options)
        self._subscriptions = _SubscriptionTable(self._client)
        for event in CALLBACKS:  # on paho's thread, in the scope of the agent making this
            setattr(self._client, f"on_{event}", bound(getattr(self, f"_on_{event}")))

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start connecting in the background; returns at once (see wait_connected)."""
        if self._dispatcher.started or self._stopped:
            raise RuntimeError("a transport starts once")
        self._dispatcher.start()
        self._client.connect_async(self.broker.host, self.broker.port, self.options.keepalive_s)
        self._client.loop_start()
        log.info("connecting to MQTT broker %s as %s", self.broker, self.client_id)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Disconnect cleanly (no will), stop the network thread, drain pending handlers."""
        if self._stopped:
            return
        self._stopped = True
        self._client.disconnect()
        self._client.loop_stop()
        self._subscriptions.disconnected(lost=False)
        self._dispatcher.stop(timeout_s)
        log.info("disconnected from MQTT broker %s", self.broker)

    def abort(self) -> None:
        """Cut the connection as a crash would (fault tests of agents sharing a process): no
        DISCONNECT packet, so the broker publishes the member's last will; no reconnect;
        later publishes fail and nothing more reaches the handlers."""
        if self._stopped:
            return
        self._stopped = True
        _cut(self._client)
        self._subscriptions.disconnected(lost=True)
        self._dispatcher.stop(0.0)

    def __enter__(self) -> MqttTransport:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def connected(self) -> bool:
        return self._subscriptions.is_connected

    @property
    def refused(self) -> str | None:
        """Why the broker refused the last connection attempt (bad credentials, ...), if it
        did; None once a connection is accepted. Whoever waits for the connection says it."""
        return self._losses.refused

    def wait_connected(self, timeout_s: float) -> bool:
        return self._subscriptions.wait_connected(timeout_s)

    def wait_subscribed(self, timeout_s: float, *, or_refused: bool = False) -> bool:
        """Until connected and subscribed (with `or_refused`: or refused)."""
        return self._subscriptions.wait_subscribed(timeout_s, or_refused=or_refused)

    @property
    def limits(self) -> Limits:
        """The limits in force (`set_limits` changes them)."""
        return self._reassembler.limits

    def set_limits(self, limits: Limits) -> None:
        """Apply `limits` (`protocol.limits.limits_for_shapes` of the run's model) to
        reassembly and the delivery queue from now on: partial messages above them are
        dropped at once. Any thread, at any time; messages already queued stay queued."""
        with self._reassembly_lock:
            self._reassembler.set_limits(limits)
        self._dispatcher.limits = limits
        log.info("limits: %s", limits)

    @property
    def stats(self) -> dict[str, int]:
        """Counters: published_/received_ messages, frames, bytes; connects, reconnects;
        dropped_frames, dropped_messages (delivery queue full) and dropped.<reason>;
        handler_errors; reassembly.<event>."""
        with self._reassembly_lock:
            return self._counters.stats(self._reassembler.counts)

    @property
    def connects(self) -> int:
        """Connections made: a change is a reconnect (the broker may have dropped our queue)."""
        return self._counters.get("connects")

    def scoped_subscriptions(self) -> contextlib.AbstractContextManager[None]:
        """Drop every handler subscribed inside, at its end: a process that lives through
        many runs would otherwise keep each old run's handlers, state and deliveries."""
        return self._subscriptions.scoped()

    # -- publishing ------------------------------------------------------------------------

    def publish(
        self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False, keep: bool = False
    ) -> Publication:
        """Publish `payload` (chunked above chunk_size) and return at once when it is queued.

        QoS 1 frames wait in a bounded queue until the broker acknowledges them, and are
        resent after a reconnect. When the queue lacks room for all frames of this message,
        this waits up to queue_timeout_s and then raises PublishQueueFull; a message with
        more frames than max_queued can never fit and raises ValueError. Retained messages
        must fit in one frame (a broker retains packets, not messages).

        `keep` (retained only): this client's current state on `topic`, published again on
        every reconnect (a broker restarted without persistence lost it) and `reassert`.
        """
        frames = split(payload, self.options.chunk_size)
        if retain and len(frames) > 1:
            raise ValueError(
                f"retained payload of {len(payload)} bytes exceeds one frame "
                f"({self.options.chunk_size} bytes)"
            )
        self._kept.note(topic, payload, retain, keep, framed=True)
        return self._send(topic, frames, qos, retain)

    def publish_plain(
        self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False, keep: bool = False
    ) -> Publication:
        """`payload` as it is, without the frame header: for readers outside the fleet (the
        JSON telemetry mirror), which must fit one frame."""
        if not fits_one_frame(len(payload), self.options.chunk_size):
            raise ValueError(f"plain payload of {len(payload)} bytes exceeds one frame")
        self._kept.note(topic, payload, retain, keep, framed=False)
        return self._send(topic, [payload], qos, retain)

    def reassert(self) -> None:
        """Publish the birth and every kept retained message again (done on every connect):
        after a broker restart, or after someone cleared them (`coordinator forget`)."""
        birth = self.announced.birth()
        self._kept.publish(self._client, birth, self.options.chunk_size, self._count)

    def clear_retained(self, topic: str) -> Publication:
        """Delete the broker's retained message on `topic`: a retained publish with an empty
        payload (MQTT 3.1.1, 3.3.1.3), which is not a frame; receivers skip it."""
        self._kept.note(topic, b"", retain=True, keep=False, framed=False)
        return self._send(topic, [b""], qos=1, retain=True)

    def _send(self, topic: str, frames: list[bytes], qos: int, retain: bool) -> Publication:
        if self._stopped:
            raise RuntimeError("transport is stopped")
        tracked = len(frames) if qos > 0 else 0
        if tracked > self.options.max_queued:
            raise ValueError(
                f"message of {len(frames)} frames can never fit the outgoing queue of "
                f"{self.options.max_queued}: raise max_queued or chunk_size"
            )
        publication = Publication(self._outgoing, tracked)

        def send() -> None:
            for frame in frames:
                info = self._client.publish(topic, frame, qos=qos, retain=retain)
                if qos > 0:
                    self._outgoing.track(info.mid, publication)
                elif info.rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
                    self._count("dropped_qos0_frames")

        if not self._outgoing.until(
            lambda: len(self._outgoing) + tracked <= self.options.max_queued,
            self.options.queue_timeout_s,
            then=send,
        ):
            raise PublishQueueFull(
                f"outgoing queue full ({len(self._outgoing)} of {self.options.max_queued} "
                f"frames unacknowledged for {self.options.queue_timeout_s} s); "
                f"connected={self.connected}"
            )
        self._count("published_messages")
        self._count("published_frames", len(frames))
        self._count("published_bytes", sum(map(len, frames)))
        return publication

    # -- subscribing -----------------------------------------------------------------------

    def subscribe(self, topic_filter: str, handler: Handler, qos: int = 1) -> None:
        """Call handler(topic, payload) for each whole message matching topic_filter.

        Handlers run on the dispatcher thread, one message at a time in arrival order; an
        exception is logged and counted and does not stop the others. The subscription is
        restored on every reconnect; see wait_subscribed.
        """
        self._subscriptions.add(topic_filter, handler, qos)

    def unsubscribe(self, topic_filter: str) -> None:
        """Drop every handler of topic_filter and the broker subscription."""
        self._subscriptions.remove(topic_filter)

    # -- paho callbacks (network thread: quick, never raise) ---------------------------------

    def _on_pre_connect(self, client: paho.Client, userdata: Any) -> None:
        self.announced.prepare(client, self.client_id)

    def _on_connect(
        self, client: paho.Client, userdata: Any, flags: Any, reason: Any, properties: Any
    ) -> None:
        if reason.is_failure:
            self._losses.refusal(str(reason), connected_before=self.connects > 0)
            self._subscriptions.refused()
            return
        self._losses.accepted()
        self._count("connects")
        log.info("connected to MQTT broker %s", self.broker)
        self.reassert()
        self._subscriptions.connected()

    def _on_connect_fail(self, client: paho.Client, userdata: Any) -> None:
        log.debug("MQTT broker %s unreachable; retrying with backoff", self.broker)

    def _on_disconnect(
        self, client: paho.Client, userdata: Any, flags: Any, reason: Any, properties: Any
    ) -> None:
        self._subscriptions.disconnected(lost=True)
        if not self._stopped:
            self._losses.ended(reason)

    def _on_subscribe(
        self, client: paho.Client, userdata: Any, mid: int, reasons: list[Any], properties: Any
    ) -> None:
        refused = [r for r in reasons if r.is_failure]
        if refused:
            log.error("MQTT broker %s refused a subscription: %s", self.broker, refused)
            self._count("subscribe_refused", len(refused))
        self._subscriptions.acknowledged(mid)

    def _on_publish(
        self, client: paho.Client, userdata: Any, mid: int, reason: Any, properties: Any
    ) -> None:
        self._outgoing.acknowledge(mid)

    def _on_message(self, client: paho.Client, userdata: Any, message: paho.MQTTMessage) -> None:
        topic = "<not utf-8>"
        try:
            self._count("received_frames")
            self._count("received_bytes", len(message.payload))
            topic = message.topic
            if not message.payload:  # a retained message being cleared: no frame, no message
                self._count("cleared_retained")
                return
            handlers = self._subscriptions.handlers_for(topic)
            if not handlers:
                # Some brokers (amqtt) push retained messages a client never subscribed to.
                # Feeding them would mark their ids as seen and swallow the real delivery
                # that follows the subscription.
                self._count("unsubscribed_frames")
                return
            with self._reassembly_lock:
                payload = self._reassembler.feed(topic, message.payload)
        except (ProtocolError, UnicodeDecodeError) as exc:
            self._drop(getattr(exc, "reason", "malformed"), exc, topic)
            return
        except Exception as exc:  # never let a bad frame kill the network thread
            self._drop("internal", exc, topic)
            return
        if payload is None:
            return
        self._count("received_messages")
        log.debug("received %d bytes on %s", len(payload), topic)
        if not self._dispatcher.put(topic, payload, handlers):
            self._drop("queue_full", ProtocolError("delivery queue full"), topic, "message")

    def _drop(self, reason: str, exc: Exception, topic: str, what: str = "frame") -> None:
        """Count a frame that failed reassembly, or a message the full delivery queue
        refused; warn of it (rate-limited: a flood of garbage must not fill the log)."""
        self._count(f"dropped_{what}s")
        self._count(f"dropped.{reason}")
        _DROPS.reject(f"{what} ({reason})", claimed_sender(topic), topic, exc)


def _not_resolving(broker: BrokerAddress, exc: socket.gaierror) -> str:
    return f"the broker's name {broker.host!r} does not resolve ({exc.strerror or exc})"


def unresolved(broker: BrokerAddress) -> str | None:
    """Why `broker`'s name does not resolve (a mistyped host), in words; None if it does."""
    try:
        socket.getaddrinfo(broker.host, broker.port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return _not_resolving(broker, exc)
    return None


def unreachable(broker: BrokerAddress, timeout_s: float = 3.0) -> str | None:
    """Why nothing answers at `broker` (a name that does not resolve, a refused or timed
    out connection), in words for the user; None when a TCP connection opens.

    paho retries a dead address silently and forever, which is right for a device (its
    gateway may come up later) but leaves a user who mistyped the address with nothing to go
    on: the programs ask this first and say it."""
    try:
        infos = socket.getaddrinfo(broker.host, broker.port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return _not_resolving(broker, exc)
    reasons = []
    for family, kind, proto, _name, address in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.settimeout(timeout_s)
                probe.connect(address)
                return None
        except OSError as exc:
            reasons.append(exc.strerror or type(exc).__name__)
    why = reasons[0] if reasons else "no address"
    return f"no MQTT broker answers at {broker} ({why.lower()})"


def tls_problem(broker: BrokerAddress, tls: TlsOptions, timeout_s: float = 5.0) -> str | None:
    """Why a TLS handshake with `broker` fails (an untrusted or mismatched certificate, a
    plain-MQTT port), or None if it succeeds or the broker cannot be reached at all.

    paho only reports that a connection failed; a user who gave the wrong CA file or the
    wrong address deserves the reason."""
    context = ssl.create_default_context(cafile=tls.ca_certs)
    if tls.certfile:
        context.load_cert_chain(tls.certfile, tls.keyfile)
    if tls.insecure:
        context.check_hostname = False
    try:
        with (
            socket.create_connection((broker.host, broker.port), timeout_s) as raw,
            context.wrap_socket(raw, server_hostname=broker.host),
        ):
            return None
    except ssl.SSLError as exc:
        return f"TLS handshake with {broker} failed: {exc.reason or exc}"
    except OSError:
        return None


def _new_client(client_id: str, options: TransportOptions) -> paho.Client:
    """A paho client configured from `options` (MQTT 3.1.1, clean session), callbacks unset."""
    client = paho.Client(
        CallbackAPIVersion.VERSION2,
        client_id=client_id,
        clean_session=True,
        protocol=paho.MQTTv311,
    )
    client.suppress_exceptions = True
    # paho annotates the delays as int, but takes (and we want) fractions of a second.
    _set_backoff(client, options)
    if options.username is not None:
        client.username_pw_set(options.username, options.password)
    if options.tls is not None:
        client.tls_set(
            ca_certs=options.tls.ca_certs,
            certfile=options.tls.certfile,
            keyfile=options.tls.keyfile,
        )
        client.tls_insecure_set(options.tls.insecure)
    return client


def _set_backoff(client: paho.Client, options: TransportOptions) -> None:
    """paho's reconnect backoff, from the transport's options."""
    client.reconnect_delay_set(options.backoff_min_s, options.backoff_max_s)  # type: ignore[arg-type]


def _cut(client: Any) -> None:
    """End paho's network thread without a goodbye (paho has no public way): it is told to
    end and not reconnect, then the socket is shut under it, which ends its wait at once."""
    client._thread_terminate = True
    client._reconnect_on_failure = False
    sock = client.socket()
    if isinstance(sock, socket.socket):  # TLS sockets too
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
    client.loop_stop()
