"""What the agent and the coordinator use of a transport, whatever carries the bytes.

`MqttTransport` (`protocol.mqtt`) is what devices and the coordinator connect with;
`MemoryTransport` (`protocol.memory`) runs a fleet in one process without a broker, so tests
can run the real runtime with no broker process. The modules that only take a started
transport (the agent's runtime and service, the coordinator's aggregator, conductor and
tallies) are typed with `Transport`, so either serves them. Whoever builds a connection, or
needs what is MQTT's alone (a broker address, a refused connection, `abort`), keeps
`MqttTransport`. Structural typing: neither transport names this protocol, mypy checks that
each one has what it lists.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # annotations only: importing the protocol loads no MQTT client
    from protocol.limits import Limits
    from protocol.mqtt import Handler, TransportOptions


class PublishHandle(Protocol):
    """What `publish` returns: a way to wait until the broker has the message (a coordinator
    clearing its run waits for that before it disconnects)."""

    def wait_for_publish(self, timeout_s: float | None = None) -> bool:
        """Block until published or timeout (None: no timeout); True when published."""
        ...


class Transport(Protocol):
    """A started connection to a fleet's topics; see `MqttTransport` for the guarantees
    (whole messages, once each, handlers on one dispatcher thread in arrival order)."""

    @property
    def options(self) -> TransportOptions:
        """Its chunk size decides whether a payload fits one frame (a retained one must)."""
        ...

    @property
    def connected(self) -> bool: ...

    @property
    def connects(self) -> int:
        """Connections made: a change is a reconnect, after which peers are asked again for
        what may have been lost meanwhile."""
        ...

    @property
    def limits(self) -> Limits: ...

    def set_limits(self, limits: Limits) -> None:
        """Apply the limits a run's model implies to what others send from now on."""
        ...

    @property
    def stats(self) -> dict[str, int]:
        """Counters: published_/received_ messages, frames and bytes (a round's traffic)."""
        ...

    def publish(
        self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False, keep: bool = False
    ) -> PublishHandle:
        """Publish `payload`; `keep` (retained only): published again by `reassert`."""
        ...

    def publish_plain(
        self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False, keep: bool = False
    ) -> PublishHandle:
        """`payload` without the frame header, for readers outside the fleet."""
        ...

    def clear_retained(self, topic: str) -> PublishHandle:
        """Delete the retained message on `topic`."""
        ...

    def reassert(self) -> None:
        """Publish the birth and every kept retained message again."""
        ...

    def drop_link(self, seconds: float) -> None:
        """Lose the connection as a dropped link would, and connect again after `seconds`
        (an emulated device's availability)."""
        ...

    def subscribe(self, topic_filter: str, handler: Handler, qos: int = 1) -> None:
        """Call handler(topic, payload) for each whole message matching topic_filter."""
        ...

    def unsubscribe(self, topic_filter: str) -> None:
        """Drop every handler of topic_filter."""
        ...

    def wait_subscribed(self, timeout_s: float) -> bool:
        """Wait until every subscription takes (retained messages come only then)."""
        ...

    def scoped_subscriptions(self) -> AbstractContextManager[None]:
        """Drop every handler subscribed inside, at its end: a process that lives through
        many runs would otherwise keep each old run's handlers, state and deliveries."""
        ...
