"""Being a member of a fleet on MQTT: a connection that announces itself and says goodbye.

Presence is the fleet's source of truth for liveness. A member's connection carries a
retained birth (republished on every reconnect) and a retained last will, which the broker
publishes if the member vanishes; a clean shutdown publishes a goodbye instead, so the
fleet can tell a crash ("lost") from a stop ("shutdown") and knows when the stop happened.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from protocol import messages, topics
from protocol.mqtt import BrokerAddress, MqttTransport, TransportOptions

LOST = "lost"
SHUTDOWN = "shutdown"


@dataclass(frozen=True)
class Identity:
    """Who a member is: its presence messages are built from this alone."""

    fleet: str
    sender: str
    role: str = "agent"
    profile: str = ""
    key: bytes | None = None
    since: float = field(default_factory=time.time)

    @property
    def topic(self) -> str:
        return topics.presence(self.fleet, self.sender)

    def presence(self, online: bool, reason: str = "", since: float | None = None) -> bytes:
        message = messages.Presence(
            fleet=self.fleet,
            sender=self.sender,
            online=online,
            since=self.since if since is None else since,
            role=self.role,
            profile=self.profile,
            reason=reason,
        )
        return messages.encode(message, key=self.key)


def connect(
    broker: BrokerAddress, identity: Identity, options: TransportOptions | None = None
) -> MqttTransport:
    """A started transport whose birth and will announce `identity`.

    The will's `since` is the time the member came online: the broker sends it later, at a
    moment the member cannot know, so readers show it as "lost after coming online then".
    """
    transport = MqttTransport(
        broker,
        options or TransportOptions(client_id=f"{identity.fleet}-{identity.sender}"),
        will=(identity.topic, identity.presence(False, LOST)),
        birth=(identity.topic, identity.presence(True)),
    )
    transport.start()
    return transport


def leave(transport: MqttTransport, identity: Identity, timeout_s: float = 5.0) -> None:
    """Publish the goodbye (when connected), wait for the broker to take it, disconnect."""
    if transport.connected:
        goodbye = identity.presence(False, SHUTDOWN, since=time.time())
        transport.publish(identity.topic, goodbye, retain=True).wait_for_publish(timeout_s)
    transport.stop()
