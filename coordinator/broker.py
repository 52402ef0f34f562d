"""An embedded MQTT broker (amqtt) for a gateway that has none: `coordinator serve`.

amqtt is asyncio-based; the broker runs on its own event loop in its own thread so that the
coordinator's code stays synchronous. It keeps retained messages and wills in memory only:
after a restart, every agent republishes its retained presence when it reconnects. It binds
loopback unless told otherwise. Given a folder written by `coordinator broker-config`, it
admits only the members listed there, each with its password and its own client ids, and
enforces the fleet's ACL (`protocol.acl`) on every publish, subscription and last will,
through amqtt's plugin API; given an admission list of per-device keys instead, it takes a
member's connect proof for its client id and its topics (`broker_config.Admission`).

amqtt's broker is subclassed at six private points (session start: authentication before
the session table, keepalive and closing a refused connection; authentication; subscription
table; retained messages on connect; QoS of deliveries; the fan-out of a message; see
`_FleetBroker`) and its reader loop's fixed header is replaced (a packet over
`MAX_PACKET_BYTES` closes its connection unread), so pyproject.toml pins amqtt to the
versions tested.

Run `python -m coordinator.broker --port N [--auth DIR | --admitted FILE --fleet F]` for a
standalone broker process (tests use it to kill and restart a broker on the same port).
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import errno
import logging
import math
import signal
import socket
import ssl
import sys
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from amqtt.adapters import ReaderAdapter, WriterAdapter
from amqtt.broker import Broker, BrokerProtocolHandler
from amqtt.codecs_amqtt import read_or_raise
from amqtt.contexts import Action
from amqtt.errors import AMQTTError, MQTTError, NoDataError
from amqtt.mqtt.constants import QOS_0, QOS_1, QOS_2
from amqtt.mqtt.packet import CONNECT, MQTTFixedHeader
from amqtt.mqtt.protocol import handler as amqtt_handler
from amqtt.plugins.base import BaseAuthPlugin, BaseTopicPlugin
from amqtt.session import Session

from coordinator.broker_config import (
    COORDINATOR_IDS,
    MAX_PACKET_BYTES,
    Admission,
    BrokerAuthError,
)
from coordinator.broker_limits import (
    BrokerBounds,
    Connection,
    ConnectionBook,
    LineBudget,
    RetainedBook,
    raise_fd_limit,
)
from coordinator.gateway_tls import BrokerCertificate
from protocol import BrokerAddress
from protocol.cli import MQTTS_PORT
from protocol.logs import RejectionLog

log = logging.getLogger(__name__)

_WILDCARD_HOSTS = ("", "0.0.0.0", "::")
TLS_LISTENER = "tls"
_MODULE = "coordinator.broker"  # amqtt imports plugins by dotted path (not __main__'s name)


class BrokerStartError(OSError):
    """The embedded broker could not start (most often: the port is already taken)."""


class _SnapshotDict(dict):
    """A dict whose iteration walks a copy of its entries.

    amqtt walks its subscription table with awaits inside the loop (publishing retained
    messages to a client that connects, filtering each broadcast); another client that
    (un)subscribes meanwhile changes the table, and the walk dies with "dictionary changed
    size during iteration": a connecting client's session handler, or a broadcast, is lost.
    Seen with 16 or more agents connecting at once.
    """

    def __iter__(self) -> Iterator[Any]:
        return iter(list(dict.keys(self)))

    def keys(self) -> list[Any]:  # type: ignore[override]
        return list(dict.keys(self))

    def values(self) -> list[Any]:  # type: ignore[override]
        return list(dict.values(self))

    def items(self) -> list[tuple[Any, Any]]:  # type: ignore[override]
        return list(dict.items(self))

    def __repr__(self) -> str:
        """Brief: amqtt (0.12.1) logs the table's repr after every SUBSCRIBE, debug logging
        on or not, and the whole table's names every session of every filter. In a fleet
        whose agents subscribe to the next round's models every round, that was most of the
        embedded broker's CPU (an emulated DA-DPFL fleet of 100 agents)."""
        return f"<subscription table of {len(self)} filters>"


def _deliver_at_qos0(handler: BrokerProtocolHandler) -> None:
    """Make every message the broker sends this client go out at QoS 0.

    A QoS 1 delivery costs amqtt (0.12.1) a PUBACK to read and match and a 5 s timer; when
    the PUBACK comes later than that, amqtt logs the delivery as a failed task with its
    traceback (it was sent; it is not sent again). A broker fanning a round out (64 agents
    all-to-all: 133 MB a round through this one Python process) reads PUBACKs late, so it
    logged 6,179 tracebacks in 6 rounds and fell further behind; agents saw nothing arrive
    for two looks and asked again: 4.1x the algorithm's traffic, 1,180 re-sends, and
    accuracies off simulate's. At QoS 0 the same run sent 1.018x, with no re-send and
    simulate's accuracies (bench/emulate_traffic.py). edgefl's clients connect with a clean
    session, which holds nothing for them across a reconnect, so QoS 1 gave a connected
    client nothing that TCP does not; an agent that reconnects asks for what it missed
    (agent/runtime/asking.py). What clients publish to the broker keeps its QoS and its
    PUBACK. A client that wants messages held while it is away (a persistent session) needs
    another broker, such as mosquitto.
    """
    publish = handler.mqtt_publish

    async def publish_at_qos0(
        topic: str, data: bytes | bytearray, qos: int | None, retain: bool, *args: Any
    ) -> Any:
        return await publish(topic, data, QOS_0, retain, *args)

    handler.mqtt_publish = publish_at_qos0


class PacketTooLarge(Exception):
    """A packet longer than the broker takes: its connection is closed before its body is
    read (amqtt read any packet whole, up to MQTT's 256 MiB, into memory)."""


class _BoundedFixedHeader(MQTTFixedHeader):
    """The fixed header as amqtt's reader loop decodes it (every packet after a CONNECT),
    refusing a packet longer than `MAX_PACKET_BYTES`, mosquitto's `max_packet_size` in
    broker-config (a fleet's messages travel in chunks far below it), before a byte of its
    body is read. A CONNECT is bounded by its fields' own 16-bit lengths."""

    @classmethod
    async def from_stream(cls, reader: ReaderAdapter) -> Any:
        header = await super().from_stream(reader)
        if header is not None and header.remaining_length > MAX_PACKET_BYTES:
            raise PacketTooLarge(
                f"a packet of {header.remaining_length} bytes (over {MAX_PACKET_BYTES})"
            )
        return header


amqtt_handler.MQTTFixedHeader = _BoundedFixedHeader


class _ByteBack(ReaderAdapter):
    """`reader`, with the bytes already read from it given back first (the broker reads a
    connection's first byte itself, to refuse at once one that is not a CONNECT, and its
    CONNECT, to refuse it before amqtt touches the session it names), and a record of what
    is read through it (`read_so_far`: only the CONNECT is read through it)."""

    def __init__(self, first: bytes, reader: ReaderAdapter) -> None:
        self._first, self._reader = first, reader
        self.read_so_far = bytearray()

    async def read(self, n: int = -1) -> bytes:
        if not self._first or n == 0:
            data = await self._reader.read(n)
        elif n < 0:
            data, self._first = self._first + await self._reader.read(n), b""
        else:
            data, self._first = self._first[:n], self._first[n:]
            if len(data) < n:
                data += await self._reader.read(n - len(data))
        self.read_so_far += data
        return data

    def feed_eof(self) -> None:
        self._reader.feed_eof()


class _FleetBroker(Broker):
    """amqtt's broker with MQTT's keepalive rule enforced, a connection it refuses closed (see
    `_initialize_client_session`), its subscription table safe to change while it is walked
    (see _SnapshotDict), retained messages sent only to the subscriptions they match, every
    delivery at QoS 0 (see `_deliver_at_qos0`), and a message's fan-out without the cost of
    amqtt's debug lines (see `_run_broadcast`).

    amqtt notices a client that closed its socket, but never drops one that merely went
    silent (its read timeout handler does nothing). A device that loses power or network
    leaves exactly such a half-open connection, and its last will would never fire. Here a
    client silent for 1.5 x its keepalive is disconnected as MQTT 3.1.1 (3.1.2.10) requires,
    which publishes its will.
    """

    def __init__(
        self,
        config: dict[str, Any],
        bounds: BrokerBounds,
        guarded: bool,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        super().__init__(config)
        self.tls = tls
        self._subscriptions: _SnapshotDict = _SnapshotDict(self._subscriptions)
        self.bounds, self.guarded = bounds, guarded
        self.connections = ConnectionBook(bounds, exempt=frozenset(COORDINATOR_IDS))
        self.retained = RetainedBook(bounds, topics_only=guarded)
        self.refusals = RejectionLog(log)

    _connection: contextvars.ContextVar[Connection] = contextvars.ContextVar("connection")
    """The book's entry of the connection being served, per connection (its own task)."""

    async def stream_connected(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, listener_name: str
    ) -> None:
        """amqtt's, within `BrokerBounds` (see `ConnectionBook`): a connection past them is
        closed unread, and every connection's socket is closed when it ends (amqtt left one
        whose client closed before its CONNECT open, in CLOSE-WAIT, until the garbage
        collector ran)."""
        peer = writer.get_extra_info("peername")
        source = str(peer[0]) if peer else "?"
        connection, why = self.connections.open(source, writer.transport.abort)
        if connection is None:
            self.refusals.reject("connection", source, "", f"closed unread: {why}")
            writer.transport.abort()
            return
        self._connection.set(connection)
        try:
            if listener_name == TLS_LISTENER:
                secured = await self._start_tls(reader, writer, source)
                if secured is None:
                    return
                writer = secured
            await super().stream_connected(reader, writer, listener_name)
        finally:
            self.connections.close(connection)
            if not writer.is_closing():
                writer.transport.abort()

    async def _start_tls(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, source: str
    ) -> asyncio.StreamWriter | None:
        """The TLS handshake of a connection to the TLS listener, within the CONNECT
        timeout; the writer over TLS (the reader reads through it as before), or None.

        It is done here, on a connection the book already counts, rather than by the
        listening socket: asyncio waits 60 s for a handshake that stalls, outside any count,
        so a flood of them would hold the descriptors the bounds protect. (Python 3.11's
        `StreamWriter.start_tls` takes a server's stream for a client's: hence the loop's.)"""
        assert self.tls is not None
        protocol = writer.transport.get_protocol()
        timeout_s = self.bounds.connect_timeout_s
        try:
            secured = await asyncio.get_running_loop().start_tls(
                writer.transport,
                protocol,
                self.tls,
                server_side=True,
                ssl_handshake_timeout=timeout_s,
            )
        except (OSError, ssl.SSLError, asyncio.TimeoutError, ConnectionError) as exc:
            self.refusals.reject("connection", source, "", f"no TLS handshake: {exc!r}")
            return None
        if secured is None:
            return None
        self._connection.get().abort = secured.abort
        return asyncio.StreamWriter(secured, protocol, reader, asyncio.get_running_loop())

    async def _initialize_client_session(
        self, reader: ReaderAdapter, writer: WriterAdapter, *args: Any
    ) -> Any:
        """`_open_session`, which must end within the CONNECT timeout: a connection that
        never completes its CONNECT (idle, or sending it a byte at a time) is closed."""
        try:
            return await asyncio.wait_for(
                self._open_session(reader, writer, *args), self.bounds.connect_timeout_s
            )
        except asyncio.TimeoutError:
            await writer.close()
            source = self._connection.get().source
            why = f"no whole CONNECT within {self.bounds.connect_timeout_s:g} s"
            self.refusals.reject("connection", source, "", why)
            raise AMQTTError(_REFUSED) from None

    async def _read_connect_header(self, reader: ReaderAdapter, writer: WriterAdapter) -> bytes:
        """The fixed header of the first packet, which must be a CONNECT of at most
        `BrokerBounds.connect_bytes` (its fields' 16-bit lengths allow 320 KB)."""
        header = bytearray(await read_or_raise(reader, 1))
        if header[0] >> 4 != CONNECT:
            await writer.close()
            raise AMQTTError(f"[MQTT-3.1.0-1] first packet of type {header[0] >> 4}, not CONNECT")
        length, scale = 0, 1
        for _ in range(4):
            byte = (await read_or_raise(reader, 1))[0]
            header.append(byte)
            length, scale = length + (byte & 0x7F) * scale, scale * 128
            if not byte & 0x80:
                break
        if length > self.bounds.connect_bytes:
            await writer.close()
            source = self._connection.get().source
            why = f"a CONNECT of {length} bytes (over {self.bounds.connect_bytes})"
            self.refusals.reject("connection", source, "", why)
            raise AMQTTError(_REFUSED)
        return bytes(header)

    async def _open_session(self, reader: ReaderAdapter, writer: WriterAdapter, *args: Any) -> Any:
        """amqtt's session start, and three rules of MQTT 3.1.1 it leaves out. A connection
        whose first packet is not a CONNECT is closed at once (3.1.0-1), and so is one whose
        CONNECT is refused: amqtt (0.12.1) read on, as a CONNECT, whatever came (a PUBLISH
        that paho's reconnect had let out ahead of its CONNECT), waited for bytes that never
        came and left the connection open, and the client waited out its keep-alive (30 s
        for edgefl's) for a CONNACK. A CONNECT is authenticated before its client id's
        session is touched (3.2.2.4: a refused CONNECT changes nothing): amqtt dropped the
        session of the client id first and refused after, so a refused client with another
        member's client id still took that member's session (it stayed connected and
        received nothing). And a silent client is dropped (below)."""
        first = await self._read_connect_header(reader, writer)
        try:
            client_id = await self._admit(_ByteBack(first, reader), writer)
            await self._close_taken_over(client_id)
            handler, session = await super()._initialize_client_session(
                _ByteBack(bytes(self._connect.get()), reader), writer, *args
            )
        except (AMQTTError, MQTTError, NoDataError):
            await writer.close()
            raise
        session.fleet_admitted = True  # see `_authenticate`
        if session.keep_alive > 0:
            session.keep_alive = math.ceil(session.keep_alive * 1.5)

            def close_silent_client() -> None:
                log.info("client %s silent past its keepalive: disconnecting", session.client_id)
                asyncio.ensure_future(handler.handle_connection_closed())

            handler.handle_read_timeout = close_silent_client
        _deliver_at_qos0(handler)
        return handler, session

    _connect: contextvars.ContextVar[bytes] = contextvars.ContextVar("connect")
    """The CONNECT packet being admitted, per connection (each runs in its own task)."""

    async def _admit(self, reader: _ByteBack, writer: WriterAdapter) -> str:
        """Read the CONNECT and authenticate it; its client id. A refused one gets its
        CONNACK (not authorized) and AMQTTError, before amqtt looks its client id up."""
        handler, session = await BrokerProtocolHandler.init_from_connect(
            reader, writer, self.plugins_manager
        )
        self._connect.set(bytes(reader.read_so_far))
        admitted = await super()._authenticate(session, None)
        if admitted:
            connection = self._connection.get()
            why = self.connections.log_in(connection, session.username, self.guarded)
            if why is not None:
                self.refusals.reject("connect", connection.source, session.client_id, why)
                admitted = False
        if not admitted:
            handler.attach(session, reader, writer)
            await handler.mqtt_connack_authorize(False)
            raise AMQTTError(_REFUSED)
        return str(session.client_id or "")

    async def _close_taken_over(self, client_id: str) -> None:
        """Close the connection that holds `client_id`, which an admitted CONNECT takes
        (MQTT 3.1.4-2), without its last will (the member is back, not gone). amqtt
        (0.12.1) dropped the old session of a clean-session client but left its connection
        open and its handler running: the old client stayed connected, received nothing
        and never learned why; closed, it reconnects, and one that keeps being taken over
        says so (`protocol.mqtt`)."""
        held = self._sessions.get(client_id) if client_id else None
        if held is None:
            return
        old_session, old_handler = held
        if old_handler is None or old_handler.writer is None:
            return
        log.info("client id %s taken by a new connection: closing its old one", client_id)
        old_session.will_flag = False
        await old_handler.writer.close()

    async def _authenticate(self, session: Session, listener: Any) -> bool:
        """The verdict of `_admit` (a connect proof is good once: asked again, it would
        read as a replay)."""
        if getattr(session, "fleet_admitted", False):
            session.fleet_admitted = False
            return True
        return await super()._authenticate(session, listener)

    async def _stop_handler(self, handler: BrokerProtocolHandler) -> None:
        """amqtt's, with the client's input ended first. amqtt stops a handler by
        cancelling its reader and waiting for it to finish; on Python before 3.12 a cancel
        that meets a packet just read inside `asyncio.wait_for` is lost, and the reader
        waited for the client's next packet: a broker stopped while agents were sending
        hung for its whole shutdown timeout (15 s) and logged tracebacks. At end of input
        the reader ends at once."""
        if handler.reader is not None:
            handler.reader.feed_eof()
        await super()._stop_handler(handler)

    async def retain_message(
        self,
        source_session: Session | None,
        topic_name: str | None,
        data: bytes | bytearray | None,
        qos: int | None = None,
    ) -> None:
        """amqtt's, within the retained store's bounds (`RetainedBook`): a message past
        them is delivered but not retained, with a (rate-limited) line naming its owner."""
        if topic_name is not None and data:
            session = source_session
            owner = "" if session is None else session.username or session.client_id or ""
            why = self.retained.admit(owner, topic_name, len(data))
            if why is not None:
                self.refusals.reject("retained message", owner or "(broker)", topic_name, why)
                return
        elif topic_name is not None:
            self.retained.forget(topic_name)
        await super().retain_message(source_session, topic_name, data, qos)

    async def add_subscription(self, subscription: tuple[str, int], session: Session) -> int:
        """Grant QoS 0 to every subscription: see `_deliver_at_qos0`."""
        return await super().add_subscription((subscription[0], QOS_0), session)

    async def _run_broadcast(self, running_tasks: deque[asyncio.Task[Any]]) -> None:
        """Send one published message to every subscription it matches: amqtt's (0.12.1)
        rules, without its debug lines.

        amqtt builds three debug messages for each message and each filter in the table
        whether debug logging is on or not, and the first one holds the message itself: a
        34 kB model became a 100 kB string. That was 0.28 ms of the broker's CPU for every
        message published, more than half of what a message with one receiver costs
        (bench/broker_cost.py). The rules are amqtt's: the subscriptions whose filter
        matches, each receiver's RECEIVE check (the fleet's ACL), a QoS 1/2 message kept
        for a persistent session that is away, and delivery to connected sessions only.
        """
        broadcast = await self._broadcast_queue.get()
        topic = broadcast["topic"]
        for a_filter, subscriptions in self._subscriptions.items():
            # No call of amqtt's `_matches` (most of the cost) for a filter without wildcards.
            wild = "+" in a_filter or "#" in a_filter
            if a_filter != topic and (not wild or not self._matches(topic, a_filter)):
                continue
            for receiver, granted_qos in subscriptions:
                qos = broadcast.get("qos", granted_qos)
                if not await self._topic_filtering(receiver, topic=topic, action=Action.RECEIVE):
                    log.info("%s not allowed to receive %s", receiver.client_id, topic)
                    continue
                connected = receiver.transitions.state == "connected"
                if (
                    not connected
                    and not receiver.clean_session
                    and qos in (QOS_1, QOS_2)
                    and not receiver.is_anonymous
                ):
                    await self._retain_broadcast_message(broadcast, qos, receiver)
                    continue
                handler = self._get_handler(receiver) if connected else None
                if handler:
                    running_tasks.append(
                        asyncio.ensure_future(
                            handler.mqtt_publish(topic, broadcast["data"], qos, retain=False)
                        )
                    )

    async def _publish_retained_messages_for_subscription(
        self, subscription: tuple[str, int], session: Session
    ) -> None:
        """Send the retained messages of `subscription` only if `session` holds it.

        On every connect amqtt (0.12.1) calls this for every filter that any client holds,
        so a new client received the retained messages of topics it never subscribed to
        (another fleet's presence, a run). A subscription (SUBSCRIBE) is registered before
        this is called, so a session's own filters pass.
        """
        holders = self._subscriptions.get(subscription[0], [])
        if not any(held.client_id == session.client_id for held, _qos in holders):
            return
        if "+" in subscription[0] or "#" in subscription[0]:
            await super()._publish_retained_messages_for_subscription(subscription, session)
        else:
            await _send_retained_of(self, subscription, session)


async def _send_retained_of(
    broker: Broker, subscription: tuple[str, int], session: Session
) -> None:
    """amqtt's sending of the retained messages a new subscription matches, for a filter
    without wildcards: only its own topic's. amqtt walks every retained message, a debug
    line built for each, which was most of the cost of a SUBSCRIBE."""
    topic, qos = subscription
    retained = broker._retained_messages.get(topic)
    handler = broker._get_handler(session)
    if retained is not None and handler:
        publish = handler.mqtt_publish(
            retained.topic, retained.data, min(qos, retained.qos or qos), retain=True
        )
        await asyncio.wait([asyncio.Task(publish)])


class FleetGuardPlugin(BaseAuthPlugin, BaseTopicPlugin):
    """Who may connect and as whom, and where each may publish and subscribe: the rules of
    `coordinator.broker_config.Admission` (logins of a `coordinator broker-config` folder,
    or the connect proofs of per-device keys), enforced on every CONNECT, last will,
    publish and subscription. One plugin for both checks, so that they read one Admission
    (reloaded when its files change). A publish outside its grant is dropped, undelivered;
    a retained publish or a clear is a publish, so a retained status or run is overwritten
    only by its owner."""

    @dataclass
    class Config:
        folder: str = ""
        admitted: str = ""
        fleet: str = "default"
        coordinator_key: str = ""

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        config = self.config
        self.admission = Admission(
            Path(config.folder) if config.folder else None,
            Path(config.admitted) if config.admitted else None,
            config.fleet,
            config.coordinator_key or None,
        )
        self.refusals = RejectionLog(log)
        """A client refused in a loop (or publishing outside its grant) must not fill the
        gateway's log."""

    async def authenticate(self, *, session: Session) -> bool:
        admission, user = self.admission, session.username
        admission.refresh()
        why = admission.refusal(session.client_id, user, session.password)
        if why is not None:
            where = f"client {session.client_id} from {session.remote_address or '?'}"
            self.refusals.reject("connect", user or "(anonymous)", where, why)
            return False
        will = session.will_topic or ""
        if session.will_flag and not admission.may_publish(user, will):
            self.refusals.reject("connect", str(user), will, "last will on another's topic")
            return False
        return True

    async def topic_filtering(
        self, *, session: Session | None = None, topic: str | None = None, action: Any = None
    ) -> bool:
        user = session.username if session is not None else None
        if action == Action.RECEIVE:
            return True  # checked when it was published, and when subscribed
        allowed = (
            self.admission.may_publish(user, topic or "")
            if action == Action.PUBLISH
            else self.admission.may_subscribe(user, topic or "")
        )
        if not allowed:
            what = f"{getattr(action, 'value', action)} (denied)"
            self.refusals.reject(what, str(user), topic or "", "no grant")
        return allowed


class _NoOneLeftToTell(logging.Filter):
    """Drops amqtt's "N messages not broadcasted" while the broker shuts down.

    amqtt closes every client's session before it stops its fan-out, and closing a session
    queues that client's last will: the messages left in the queue had no receiver left, so
    losing them loses nothing, yet amqtt warned of them at every stop with clients connected
    (twice). Everything else amqtt logs meanwhile passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().endswith("messages not broadcasted"):
            log.debug("at shutdown: %s (no client was left to receive them)", record.getMessage())
            return False
        return True


_REFUSED = "refused at CONNECT"


class _ProbesAreNotClients(logging.Filter):
    """Drops amqtt's warning of a connection closed before it sent a byte: a TCP probe (a
    health check, or `protocol.mqtt.unreachable`, which every `coordinator` command that
    is given a broker runs first), not a client that failed; and of a connection refused at
    its CONNECT, which `FleetGuardPlugin` has told already (rate-limited). A client that
    sent anything and failed otherwise is still warned of."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() not in (
            "Failed to initialize client session: No more data",
            f"Failed to initialize client session: {_REFUSED}",
        )


_PROBES = _ProbesAreNotClients()
_LINES = LineBudget()


def _budget_log_lines() -> None:
    """Put the broker's loggers (amqtt's, asyncio's, this module's) under one `LineBudget`:
    a filter applies to the records of the logger it is added to, not of its children."""
    names = [name for name in logging.root.manager.loggerDict if name.startswith("amqtt")]
    for name in [*names, "asyncio", "transitions", __name__]:
        logger = logging.getLogger(name)
        if _LINES not in logger.filters:
            logger.addFilter(_LINES)


class EmbeddedBroker:
    """amqtt broker on (host, port) in a background thread; usable as a context manager.

    Without `auth` or `admitted`, anonymous clients are allowed and there is no topic ACL
    (a loopback broker for `emulate`). With `auth`, a folder written by `coordinator
    broker-config`, only its members log in, each with its password and its own client ids,
    and each publishes only on its own topics and reads only its fleet's. With `admitted`
    (per-device keys of `fleet`), a member's client id and topics take its connect proof
    (with `auth` too: in place of its password); see `coordinator.broker_config.Admission`.
    Retained messages and last wills work, within `bounds`.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 1883,
        auth: str | Path | None = None,
        *,
        admitted: str | Path | None = None,
        fleet: str = "default",
        coordinator_key: str | None = None,
        bounds: BrokerBounds | None = None,
        tls: BrokerCertificate | None = None,
        tls_port: int = MQTTS_PORT,
    ) -> None:
        """Raises BrokerAuthError (a ValueError, one line) for an unusable `auth` folder or
        `admitted` list. `bounds`: what it may hold (`coordinator.broker_limits`). With
        `tls`, it listens on (host, tls_port) over TLS only, and in clear on loopback
        (127.0.0.1, `port`) alone, for the gateway's own commands."""
        if not 0 < port < 65536:
            raise ValueError(f"port must be in 1..65535, got {port}")
        self.host = host
        self.port = port
        self.auth = None if auth is None else Path(auth)
        self.admitted = None if admitted is None else Path(admitted)
        self._guard: dict[str, str] | None = None
        if self.auth is not None or self.admitted is not None:
            # Fail here, in one line, not inside amqtt's startup.
            Admission(self.auth, self.admitted, fleet, coordinator_key)
            self._guard = {
                "folder": str(self.auth or ""),
                "admitted": str(self.admitted or ""),
                "fleet": fleet,
                "coordinator_key": coordinator_key or "",
            }
        self.bounds = bounds or BrokerBounds()
        self.tls, self.tls_port = tls, tls_port
        if tls is not None and not 0 < tls_port < 65536:
            raise ValueError(f"TLS port must be in 1..65535, got {tls_port}")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._broker: Broker | None = None

    @property
    def address(self) -> BrokerAddress:
        """Where local clients reach this broker (in clear: on loopback when it has TLS)."""
        wildcard = self.host in _WILDCARD_HOSTS or self.tls is not None
        return BrokerAddress("127.0.0.1" if wildcard else self.host, self.port)

    @property
    def tls_address(self) -> BrokerAddress | None:
        """Where devices reach it over TLS (None without TLS)."""
        if self.tls is None:
            return None
        host = "127.0.0.1" if self.host in _WILDCARD_HOSTS else self.host
        return BrokerAddress(host, self.tls_port)

    def start(self, timeout_s: float = 15.0) -> None:
        """Start listening; raises BrokerStartError if the port is taken or startup fails."""
        if self._thread is not None:
            raise RuntimeError("embedded broker already started")
        self._check_port()
        amqtt_log = logging.getLogger("amqtt.broker")
        if _PROBES not in amqtt_log.filters:
            amqtt_log.addFilter(_PROBES)
        _budget_log_lines()
        raise_fd_limit()
        loop = asyncio.new_event_loop()
        thread = threading.Thread(
            target=loop.run_forever, name=f"amqtt-broker-{self.port}", daemon=True
        )
        thread.start()
        self._loop, self._thread = loop, thread
        try:
            self._broker = asyncio.run_coroutine_threadsafe(self._start(), loop).result(timeout_s)
        except Exception as exc:
            self._close_loop()
            raise BrokerStartError(
                f"embedded broker failed to start on {self.host}:{self.port}: {exc}"
            ) from exc
        log.info("embedded MQTT broker listening on %s:%d", self.host, self.port)

    def stop(self, timeout_s: float = 15.0) -> None:
        """Close every client connection and the listener; a stopped broker can start again."""
        if self._loop is None:
            return
        if self._broker is not None:
            quiet = _NoOneLeftToTell()
            amqtt_log = logging.getLogger("amqtt.broker")
            amqtt_log.addFilter(quiet)
            try:
                asyncio.run_coroutine_threadsafe(self._broker.shutdown(), self._loop).result(
                    timeout_s
                )
            except Exception:
                log.exception("embedded broker did not shut down cleanly")
            finally:
                amqtt_log.removeFilter(quiet)
            self._broker = None
        self._close_loop(timeout_s)
        log.info("embedded MQTT broker on %s:%d stopped", self.host, self.port)

    def __enter__(self) -> EmbeddedBroker:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _listeners(self) -> dict[str, dict[str, str]]:
        """amqtt's listeners: one in clear on (host, port), or with TLS one on loopback in
        clear and one on (host, tls_port) that `_FleetBroker` upgrades to TLS."""

        def bind(host: str, port: int) -> dict[str, str]:
            return {"type": "tcp", "bind": f"[{host}]:{port}" if ":" in host else f"{host}:{port}"}

        if self.tls is None:
            return {"default": bind(self.host, self.port)}
        return {
            "default": bind("127.0.0.1", self.port),
            TLS_LISTENER: bind(self.host, self.tls_port),
        }

    def _tls_context(self) -> ssl.SSLContext | None:
        if self.tls is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.tls.cert, self.tls.key)
        return context

    async def _start(self) -> Broker:
        plugins: dict[str, dict[str, Any]] = {
            "amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}
        }
        if self._guard is not None:
            plugins = {f"{_MODULE}.FleetGuardPlugin": self._guard}
        broker = _FleetBroker(
            {"listeners": self._listeners(), "plugins": plugins},
            self.bounds.usable(),
            guarded=self._guard is not None,
            tls=self._tls_context(),
        )
        await broker.start()
        return broker

    def _check_port(self) -> None:
        """Fail early and clearly on a taken port (amqtt would log a traceback first)."""
        if self.tls is None:
            self._check_bind(self.host, self.port)
        else:
            self._check_bind("127.0.0.1", self.port)
            self._check_bind(self.host, self.tls_port)

    @staticmethod
    def _check_bind(host: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio does
            try:
                probe.bind((host, port))
            except OSError as exc:
                hint = (
                    ": the port is already in use (is another MQTT broker running? "
                    "choose another port)"
                    if exc.errno == errno.EADDRINUSE
                    else f": {exc.strerror}"
                )
                raise BrokerStartError(f"cannot listen on {host}:{port}{hint}") from exc

    def _close_loop(self, timeout_s: float = 15.0) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return

        async def cancel_leftovers() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(cancel_leftovers(), loop).result(timeout_s)
        except Exception:
            log.exception("embedded broker left tasks behind")
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout_s)
        if not thread.is_alive():
            loop.close()
        self._loop = self._thread = None


def main(argv: list[str] | None = None) -> int:
    """Run a standalone broker until SIGTERM or SIGINT; prints `ready HOST:PORT` when up."""
    parser = argparse.ArgumentParser(prog="python -m coordinator.broker", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=1883)
    parser.add_argument("--auth", metavar="DIR", help="folder of `coordinator broker-config`")
    parser.add_argument("--admitted", metavar="FILE", help="admitted keys (no --auth)")
    parser.add_argument("--fleet", default="default", help="the fleet of --admitted")
    parser.add_argument("--coordinator-key", help="the coordinator's public key (ed25519:...)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    try:
        broker = EmbeddedBroker(
            args.host,
            args.port,
            args.auth,
            admitted=args.admitted,
            fleet=args.fleet,
            coordinator_key=args.coordinator_key,
        )
        broker.start()
    except (BrokerStartError, BrokerAuthError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"ready {broker.host}:{broker.port}", flush=True)
    done.wait()
    broker.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
