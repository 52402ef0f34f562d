"""Zeroconf (mDNS / DNS-SD) advertisement and browsing of agents and MQTT brokers.

Agents advertise `_edge-agent._tcp.local.` with a few TXT properties so that peers and a
broker can be found without configuration. Discovery only finds candidates: presence on MQTT
is the source of truth for liveness, because mDNS records outlive crashed hosts.

Zeroconf is bound to the interface addresses the caller names and never to all interfaces by
default, so tests and emulation can keep every multicast packet on loopback.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from zeroconf import Error as ZeroconfError
from zeroconf import ServiceBrowser, ServiceInfo, ServiceStateChange, Zeroconf

from protocol.errors import ProtocolError
from protocol.topics import check_name
from protocol.version import PROTOCOL_VERSION

AGENT_SERVICE = "_edge-agent._tcp.local."
BROKER_SERVICE = "_mqtt._tcp.local."
MAX_RECORDS = 1024
"""Services kept per type, so a noisy or hostile LAN cannot grow our view without bound."""

_RESOLVE_TIMEOUT_MS = 3000
_MAX_LABEL = 63
_MAX_TXT_ENTRY = 255
_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252})):([0-9]{1,5})$")
_PROTO = re.compile(r"^[0-9]{1,9}$")

log = logging.getLogger(__name__)
_T = TypeVar("_T")


def split_host_port(text: str) -> tuple[str, int]:
    """Split `host:port` (IPv6 as `[addr]:port`) as carried in the `broker` TXT property."""
    match = _HOST_PORT.match(text) if isinstance(text, str) else None
    if match is None:
        raise ProtocolError(f"invalid broker {text!r}: expected host:port")
    host, port = match.group(1), int(match.group(2))
    if host.startswith("["):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ProtocolError(f"invalid broker {text!r}: bad IPv6 address") from None
    if not 1 <= port <= 65535:
        raise ProtocolError(f"invalid broker {text!r}: port out of range")
    return host, port


@dataclass(frozen=True)
class AgentAdvert:
    """What an agent tells the LAN about itself; every field is checked on both ends."""

    agent_id: str
    fleet: str
    broker: str
    profile: str
    proto: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        check_name(self.agent_id, "agent")
        check_name(self.fleet, "fleet")
        if self.profile:  # empty when the agent runs without a device profile
            check_name(self.profile, "profile")
        split_host_port(self.broker)
        if type(self.proto) is not int or not 0 <= self.proto < 10**9:
            raise ProtocolError(f"invalid protocol version {self.proto!r}")
        for key, value in self.to_txt().items():
            if len(key) + 1 + len(value.encode()) > _MAX_TXT_ENTRY:
                raise ProtocolError(f"TXT property {key!r} is longer than {_MAX_TXT_ENTRY} bytes")

    def to_txt(self) -> dict[str, str]:
        return {
            "id": self.agent_id,
            "fleet": self.fleet,
            "broker": self.broker,
            "profile": self.profile,
            "proto": str(self.proto),
        }

    @classmethod
    def from_txt(cls, properties: Mapping[bytes, bytes | None]) -> AgentAdvert:
        """Parse TXT properties from the network; unknown keys are ignored for forward compat."""
        fields: dict[str, str] = {}
        for key in ("id", "fleet", "broker", "profile", "proto"):
            raw = properties.get(key.encode())
            if raw is None:
                raise ProtocolError(f"TXT property {key!r} is missing")
            try:
                fields[key] = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ProtocolError(f"TXT property {key!r} is not UTF-8") from None
        if not _PROTO.match(fields["proto"]):
            raise ProtocolError(f"invalid protocol version {fields['proto']!r}")
        return cls(
            agent_id=fields["id"],
            fleet=fields["fleet"],
            broker=fields["broker"],
            profile=fields["profile"],
            proto=int(fields["proto"]),
        )


def _instance_label(text: str) -> str:
    """A DNS label holds at most 63 bytes; longer names are replaced by a stable digest."""
    if len(text.encode()) <= _MAX_LABEL:
        return text
    return "edgefl-" + hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _check_interfaces(interfaces: Sequence[str]) -> list[str]:
    if isinstance(interfaces, str) or not interfaces:
        raise ValueError("interfaces must be a non-empty list of IP addresses to bind mDNS to")
    checked = []
    for address in interfaces:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            raise ValueError(f"interface {address!r} is not an IP address") from None
        if ip.is_unspecified:
            raise ValueError(
                f"interface {address!r} would bind every interface; name the addresses explicitly"
            )
        checked.append(str(address))
    return checked


class Discovery:
    """One zeroconf stack bound to the given interface addresses, advertising and browsing.

    The peer and broker views are kept current by listener callbacks that run on zeroconf's
    browser threads; readers get copies, so they never see a view being changed.
    """

    def __init__(self, interfaces: Sequence[str]) -> None:
        self._addresses = _check_interfaces(interfaces)
        self._zc = Zeroconf(interfaces=list(self._addresses))
        self._changed = threading.Condition()
        self._agents: dict[str, AgentAdvert] = {}
        self._brokers: dict[str, list[tuple[str, int]]] = {}
        self._own: dict[str, ServiceInfo] = {}
        self._closed = False
        self._browsers = [
            ServiceBrowser(self._zc, kind, handlers=[self._on_change])
            for kind in (AGENT_SERVICE, BROKER_SERVICE)
        ]

    def advertise_agent(self, advert: AgentAdvert) -> None:
        """Announce this agent, or re-announce it with new properties; blocks ~1.7 s.

        Agents accept no inbound connections, so the SRV port is 0; peers reach them through
        the broker named in the TXT properties.
        """
        label = _instance_label(f"{advert.agent_id}@{advert.fleet}")
        self._publish(f"{label}.{AGENT_SERVICE}", AGENT_SERVICE, 0, advert.to_txt())

    def advertise_broker(self, host: str, port: int) -> None:
        """Announce an MQTT broker (e.g. the coordinator's embedded one) at an IP address."""
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(
                f"broker host {host!r} must be an IP address (it goes in an A record)"
            ) from None
        if not 1 <= port <= 65535:
            raise ValueError(f"broker port {port} out of range")
        label = _instance_label(f"edgefl-broker-{host}-{port}")
        self._publish(f"{label}.{BROKER_SERVICE}", BROKER_SERVICE, port, {}, host)

    def peers(self, fleet: str) -> dict[str, AgentAdvert]:
        """Agents of `fleet` seen on the LAN, by agent id, excluding those advertised here."""
        check_name(fleet, "fleet")
        with self._changed:
            own = {info.key for info in self._own.values()}
            return {
                advert.agent_id: advert
                for key, advert in self._agents.items()
                if advert.fleet == fleet and key not in own
            }

    def wait_for_peers(self, fleet: str, n: int, timeout: float) -> dict[str, AgentAdvert]:
        """Wait until at least `n` peers of `fleet` are seen; returns the view, which holds
        fewer than `n` peers if the timeout passed first."""
        return self._wait(lambda: self.peers(fleet), lambda view: len(view) >= n, timeout)

    def brokers(self) -> list[tuple[str, int]]:
        """(address, port) of every MQTT broker advertised on the LAN, sorted."""
        with self._changed:
            return sorted({entry for entries in self._brokers.values() for entry in entries})

    def close(self) -> None:
        """Withdraw our services (goodbye packets, so peers drop them at once) and stop."""
        with self._changed:
            if self._closed:
                return
            self._closed = True
            self._changed.notify_all()
        for browser in self._browsers:
            browser.cancel()
        self._zc.close()  # unregisters our services first, which sends the goodbyes

    def __enter__(self) -> Discovery:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _publish(
        self,
        name: str,
        kind: str,
        port: int,
        txt: dict[str, str],
        host: str | None = None,
    ) -> None:
        addresses = [host] if host is not None else self._addresses
        with self._changed:
            if self._closed:
                raise RuntimeError("discovery is closed")
            previous = self._own.get(name)
            # Keyed by the name we asked for: zeroconf renames `info` in place on a conflict.
            info = ServiceInfo(
                kind,
                name if previous is None else previous.name,
                port=port,
                properties=txt,
                server=None if previous is None else previous.server,
                addresses=[ipaddress.ip_address(address).packed for address in addresses],
            )
            self._own[name] = info
        try:
            if previous is None:
                self._zc.register_service(info, allow_name_change=True)
            else:
                self._zc.update_service(info)
        except BaseException:
            with self._changed:
                if previous is None:
                    del self._own[name]
            raise

    def _wait(self, read: Callable[[], _T], done: Callable[[_T], bool], timeout: float) -> _T:
        deadline = time.monotonic() + timeout
        with self._changed:
            view = read()
            while not done(view) and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._changed.wait(remaining)
                view = read()
            return view

    def _on_change(
        self,
        zeroconf: Zeroconf,
        service_type: str,
        name: str,
        state_change: ServiceStateChange,
    ) -> None:
        """Browser callback: resolve added/updated services, drop removed or invalid ones."""
        views: dict[str, dict] = {AGENT_SERVICE: self._agents, BROKER_SERVICE: self._brokers}
        view = views[service_type]
        entry: AgentAdvert | list[tuple[str, int]] | None = None
        if state_change is not ServiceStateChange.Removed:
            try:
                entry = self._resolve(zeroconf, service_type, name)
            except (ValueError, ZeroconfError) as exc:
                log.debug("ignoring %s: %s", name, exc)
        key = name.lower()  # DNS names compare case-insensitively
        with self._changed:
            if entry is None:
                view.pop(key, None)
            elif key in view or len(view) < MAX_RECORDS:
                view[key] = entry
            else:
                log.debug("ignoring %s: already %d services of this type", name, MAX_RECORDS)
            self._changed.notify_all()

    @staticmethod
    def _resolve(
        zeroconf: Zeroconf, service_type: str, name: str
    ) -> AgentAdvert | list[tuple[str, int]]:
        info = zeroconf.get_service_info(service_type, name, timeout=_RESOLVE_TIMEOUT_MS)
        if info is None:
            raise ProtocolError("did not resolve")
        if service_type == BROKER_SERVICE:
            if info.port is None or not 1 <= info.port <= 65535:
                raise ProtocolError(f"broker port {info.port!r} out of range")
            addresses = info.parsed_addresses()
            if not addresses:
                raise ProtocolError("broker has no address")
            return [(address, info.port) for address in addresses]
        advert = AgentAdvert.from_txt(info.properties)
        if advert.proto != PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version {advert.proto}, we speak {PROTOCOL_VERSION}")
        return advert
