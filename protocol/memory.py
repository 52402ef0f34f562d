"""A broker and transports in memory: a fleet in one process, with no broker process.

Tests run the real agent runtime on it. What reaches a handler, and when, is what
`MqttTransport` hands it over a broker, because the same parts do the work:

- topic filters with `+` and `#` match as the broker matches them (paho's matcher);
- retained messages: a topic's last retained publish is kept and an empty one clears it; a
  subscription gets the matching ones before anything published after it;
- payloads travel as frames (`protocol.chunking.split`) and a `Reassembler` makes them whole
  again, so the traffic counted (`stats`), the limits applied and the redeliveries dropped
  are MqttTransport's; a retained message this transport has seen already is not handed
  out again when a later subscription brings it back, as over a broker;
- handlers run on MqttTransport's dispatcher, one thread per transport, in arrival order and
  never on the publisher's thread, so a handler that publishes or blocks does so as on a
  device.

`duplicates` hands every message to the handlers twice. MqttTransport drops a QoS 1
redelivery by its frame id, but the same content comes again under new ids all the time (a
model sent again on request, statuses republished after a reconnect): handlers must be
idempotent, and a run with duplicates shows that they are. Not modelled: lost connections
(but for `reconnect`), births and wills (`protocol.membership` makes presence over MQTT),
ACLs, and the packet sizes a real broker refuses.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from protocol import topics
from protocol.chunking import Reassembler, fits_one_frame, split
from protocol.errors import ProtocolError
from protocol.limits import Limits
from protocol.mqtt import Counters, Dispatcher, Handler, TransportOptions
from protocol.transport import PublishHandle


class MemoryBroker:
    """What transports in one process share: who is connected and the retained messages.

    One lock guards it and every attached transport's subscriptions, so a subscription and
    the retained messages it brings are never overtaken by a publish."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._transports: list[MemoryTransport] = []
        self._retained: dict[str, bytes] = {}
        """Topic -> its retained frame (a broker retains packets, so one frame each)."""

    def attach(self, transport: MemoryTransport) -> None:
        """`transport` gets what is published from now on; the caller holds `lock`."""
        if transport not in self._transports:
            self._transports.append(transport)

    def detach(self, transport: MemoryTransport) -> None:
        """`transport` gets nothing more; the caller holds `lock`."""
        if transport in self._transports:
            self._transports.remove(transport)

    def route(self, topic: str, frames: list[bytes], retain: bool) -> None:
        """Keep (or clear) a retained frame, then deliver to every matching subscriber."""
        with self.lock:
            if retain and frames[0]:
                self._retained[topic] = frames[0]
            elif retain:
                self._retained.pop(topic, None)
            for transport in self._transports:
                for frame in frames:
                    transport.receive(topic, frame)

    def send_retained(self, transport: MemoryTransport, topic_filter: str) -> None:
        """The retained messages `topic_filter` matches, to `transport`; caller holds lock."""
        for topic, frame in self._retained.items():
            if topics.matches(topic_filter, topic):
                transport.receive(topic, frame)


class _Published:
    """What `publish` returns: the broker has a message as soon as it is published."""

    def wait_for_publish(self, timeout_s: float | None = None) -> bool:
        return True


class MemoryTransport:
    """A `Transport` to a `MemoryBroker`; starts, stops and counts as `MqttTransport` does.
    `qos` is taken and ignored: nothing is lost in memory."""

    def __init__(
        self,
        broker: MemoryBroker,
        client_id: str,
        options: TransportOptions | None = None,
        *,
        duplicates: bool = False,
    ) -> None:
        self.broker = broker
        self.client_id = client_id
        self.options = options = options or TransportOptions(client_id=client_id)
        self.duplicates = duplicates
        self._subs: dict[str, list[Handler]] = {}
        self._kept: dict[str, tuple[bytes, bool]] = {}
        """Retained messages published with `keep`: topic -> (payload, framed)."""
        self._counters = Counters()
        self._count = self._counters.count
        self._reassembler = Reassembler(options.limits, options.reassembly_timeout_s)
        self._dispatcher = Dispatcher(f"memory-dispatch-{client_id}", self._count, options.limits)
        self.connected = False
        self._stopped = False

    def start(self) -> None:
        self._dispatcher.start()
        self.reconnect()

    def reconnect(self) -> None:
        """Connect (again), as MqttTransport does after a lost connection: `connects` grows,
        every subscription brings the retained messages it matches (those seen already are
        dropped, as over a broker), and the kept retained messages are published again."""
        if self._stopped:
            raise RuntimeError("transport is stopped")
        self._count("connects")
        with self.broker.lock:
            self.connected = True
            self.broker.attach(self)
            for topic_filter in self._subs:
                self.broker.send_retained(self, topic_filter)
        self.reassert()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Disconnect, then run the handlers of what was delivered before (as MqttTransport
        does: a clean stop)."""
        if self._stopped:
            return
        with self.broker.lock:
            self._stopped, self.connected = True, False
            self.broker.detach(self)
        self._dispatcher.stop(timeout_s)

    def drop_link(self, seconds: float) -> None:
        """Receive nothing for `seconds`, then `reconnect`, as `MqttTransport.drop_link`
        does over a broker (no will here; what this side publishes meanwhile still goes out)."""
        if self._stopped:
            return
        with self.broker.lock:
            self.connected = False
            self.broker.detach(self)
        timer = threading.Timer(seconds, self._reconnect_unless_stopped)
        timer.daemon = True
        timer.start()

    def _reconnect_unless_stopped(self) -> None:
        if not self._stopped:
            self.reconnect()

    def __enter__(self) -> MemoryTransport:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def connects(self) -> int:
        return self._counters.get("connects")

    def wait_subscribed(self, timeout_s: float) -> bool:
        """Subscriptions take at once here, once connected."""
        return self.connected

    @property
    def limits(self) -> Limits:
        return self._reassembler.limits

    def set_limits(self, limits: Limits) -> None:
        with self.broker.lock:
            self._reassembler.set_limits(limits)
        self._dispatcher.limits = limits

    @property
    def stats(self) -> dict[str, int]:
        """MqttTransport's counters (`MqttTransport.stats`)."""
        with self.broker.lock:  # guards the reassembler, as `receive` runs under it
            return self._counters.stats(self._reassembler.counts)

    # -- publishing ------------------------------------------------------------------------

    def publish(
        self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False, keep: bool = False
    ) -> PublishHandle:
        frames = split(payload, self.options.chunk_size)
        if retain and len(frames) > 1:
            raise ValueError(f"retained payload of {len(payload)} bytes exceeds one frame")
        self._note_kept(topic, payload, retain, keep, framed=True)
        return self._send(topic, frames, retain)

    def publish_plain(
        self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False, keep: bool = False
    ) -> PublishHandle:
        if not fits_one_frame(len(payload), self.options.chunk_size):
            raise ValueError(f"plain payload of {len(payload)} bytes exceeds one frame")
        self._note_kept(topic, payload, retain, keep, framed=False)
        return self._send(topic, [payload], retain)

    def clear_retained(self, topic: str) -> PublishHandle:
        self._note_kept(topic, b"", retain=True, keep=False, framed=False)
        return self._send(topic, [b""], retain=True)

    def reassert(self) -> None:
        with self.broker.lock:
            kept = list(self._kept.items())
        for topic, (payload, framed) in kept:
            frames = split(payload, self.options.chunk_size) if framed else [payload]
            self._route(topic, frames, retain=True)  # frames, not messages, as MqttTransport

    def _note_kept(
        self, topic: str, payload: bytes, retain: bool, keep: bool, framed: bool
    ) -> None:
        if keep and not retain:
            raise ValueError("only a retained message is kept for reconnects")
        with self.broker.lock:
            if keep:
                self._kept[topic] = (payload, framed)
            else:
                self._kept.pop(topic, None)

    def _send(self, topic: str, frames: list[bytes], retain: bool) -> PublishHandle:
        self._count("published_messages")
        return self._route(topic, frames, retain)

    def _route(self, topic: str, frames: list[bytes], retain: bool) -> PublishHandle:
        if self._stopped:
            raise RuntimeError("transport is stopped")
        self._count("published_frames", len(frames))
        self._count("published_bytes", sum(map(len, frames)))
        self.broker.route(topic, frames, retain)
        return _Published()

    # -- subscribing -----------------------------------------------------------------------

    def subscribe(self, topic_filter: str, handler: Handler, qos: int = 1) -> None:
        with self.broker.lock:
            self._subs.setdefault(topic_filter, []).append(handler)
            if self.connected:
                self.broker.send_retained(self, topic_filter)

    def unsubscribe(self, topic_filter: str) -> None:
        with self.broker.lock:
            self._subs.pop(topic_filter, None)

    @contextlib.contextmanager
    def scoped_subscriptions(self) -> Iterator[None]:
        with self.broker.lock:
            mark = {f: len(handlers) for f, handlers in self._subs.items()}
        try:
            yield
        finally:
            with self.broker.lock:
                for topic_filter, handlers in list(self._subs.items()):
                    if mark.get(topic_filter, 0):
                        del handlers[mark[topic_filter] :]
                    else:
                        del self._subs[topic_filter]

    def receive(self, topic: str, frame: bytes) -> None:
        """A frame the broker routes here, under its lock (MqttTransport's `_on_message`):
        only what a subscription matches; whole messages go to the dispatcher."""
        handlers = [h for f, hs in self._subs.items() if topics.matches(f, topic) for h in hs]
        if not handlers:
            return
        self._count("received_frames")
        self._count("received_bytes", len(frame))
        if not frame:
            self._count("cleared_retained")
            return
        try:
            payload = self._reassembler.feed(topic, frame)
        except ProtocolError as exc:
            self._count("dropped_frames")
            self._count(f"dropped.{getattr(exc, 'reason', 'malformed')}")
            return
        if payload is None:
            return
        self._count("received_messages")
        for _ in range(2 if self.duplicates else 1):
            if not self._dispatcher.put(topic, payload, handlers):
                self._count("dropped_messages")
                self._count("dropped.queue_full")
