"""An embedded MQTT broker (amqtt) for a gateway that has none: `coordinator serve`.

amqtt is asyncio-based; the broker runs on its own event loop in its own thread so that the
coordinator's code stays synchronous. It keeps retained messages and wills in memory only:
after a restart, every agent republishes its retained presence when it reconnects.

Run `python -m coordinator.broker --port N` for a standalone broker process (tests use it to
kill and restart a broker on the same port).
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import math
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from typing import Any

from amqtt.broker import Broker

from protocol import BrokerAddress

log = logging.getLogger(__name__)

_WILDCARD_HOSTS = ("", "0.0.0.0", "::")


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


class _KeepaliveBroker(Broker):
    """amqtt's broker with MQTT's keepalive rule enforced, and its subscription table safe to
    change while it is walked (see _SnapshotDict).

    amqtt notices a client that closed its socket, but never drops one that merely went
    silent (its read timeout handler does nothing). A device that loses power or network
    leaves exactly such a half-open connection, and its last will would never fire. Here a
    client silent for 1.5 x its keepalive is disconnected as MQTT 3.1.1 (3.1.2.10) requires,
    which publishes its will.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._subscriptions: _SnapshotDict = _SnapshotDict(self._subscriptions)

    async def _initialize_client_session(self, *args: Any, **kwargs: Any) -> Any:
        handler, session = await super()._initialize_client_session(*args, **kwargs)
        if session.keep_alive > 0:
            session.keep_alive = math.ceil(session.keep_alive * 1.5)

            def close_silent_client() -> None:
                log.info("client %s silent past its keepalive: disconnecting", session.client_id)
                asyncio.ensure_future(handler.handle_connection_closed())

            handler.handle_read_timeout = close_silent_client
        return handler, session


class EmbeddedBroker:
    """amqtt broker on (host, port) in a background thread; usable as a context manager.

    Anonymous clients are allowed, there is no topic ACL and no message size limit beyond
    MQTT's own; retained messages and last wills work.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 1883) -> None:
        if not 0 < port < 65536:
            raise ValueError(f"port must be in 1..65535, got {port}")
        self.host = host
        self.port = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._broker: Broker | None = None

    @property
    def address(self) -> BrokerAddress:
        """Where local clients reach this broker."""
        host = "127.0.0.1" if self.host in _WILDCARD_HOSTS else self.host
        return BrokerAddress(host, self.port)

    def start(self, timeout_s: float = 15.0) -> None:
        """Start listening; raises BrokerStartError if the port is taken or startup fails."""
        if self._thread is not None:
            raise RuntimeError("embedded broker already started")
        self._check_port()
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
            try:
                asyncio.run_coroutine_threadsafe(self._broker.shutdown(), self._loop).result(
                    timeout_s
                )
            except Exception:
                log.exception("embedded broker did not shut down cleanly")
            self._broker = None
        self._close_loop(timeout_s)
        log.info("embedded MQTT broker on %s:%d stopped", self.host, self.port)

    def __enter__(self) -> EmbeddedBroker:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    async def _start(self) -> Broker:
        bind = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        broker = _KeepaliveBroker(
            {
                "listeners": {"default": {"type": "tcp", "bind": bind}},
                "plugins": {
                    "amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}
                },
            }
        )
        await broker.start()
        return broker

    def _check_port(self) -> None:
        """Fail early and clearly on a taken port (amqtt would log a traceback first)."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        with socket.socket(family) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio does
            try:
                probe.bind((self.host, self.port))
            except OSError as exc:
                hint = (
                    ": the port is already in use (is another MQTT broker running? "
                    "choose another port)"
                    if exc.errno == errno.EADDRINUSE
                    else f": {exc.strerror}"
                )
                raise BrokerStartError(f"cannot listen on {self.host}:{self.port}{hint}") from exc

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
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    broker = EmbeddedBroker(args.host, args.port)
    try:
        broker.start()
    except BrokerStartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"ready {broker.host}:{broker.port}", flush=True)
    done.wait()
    broker.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
