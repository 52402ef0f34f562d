"""Zeroconf (mDNS / DNS-SD) advertisement and browsing of agents and MQTT brokers.

Agents advertise `_edge-agent._tcp.local.` with a few TXT properties so that peers and a
broker can be found without configuration. Discovery only finds candidates: presence on MQTT
is the source of truth for liveness, because mDNS records outlive crashed hosts.

The coordinator announces its broker as `_mqtt._tcp.local.` with TXT properties naming the
fleets it serves, so that an agent started without `--broker` can pick its fleet's broker among
the other products' brokers on the LAN (see `choose_broker` for the rules).

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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import ifaddr
from zeroconf import Error as ZeroconfError
from zeroconf import ServiceBrowser, ServiceInfo, ServiceStateChange, Zeroconf

from protocol.errors import ProtocolError
from protocol.topics import check_name
from protocol.version import PROTOCOL_VERSION

AGENT_SERVICE = "_edge-agent._tcp.local."
BROKER_SERVICE = "_mqtt._tcp.local."
MAX_RECORDS = 1024
"""Services kept per type, so a noisy or hostile LAN cannot grow our view without bound."""

SETTLE_S = 1.0
"""After a usable broker is seen, how long `find_broker` still waits for one that names the
fleet: answers to one query arrive spread over a few hundred milliseconds."""
BROKER_PRODUCT = "edgefl"
BROKER_TXTVERS = "1"
"""Bumped only for an incompatible change of the broker TXT properties (RFC 6763 6.7)."""

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
            value = _text(properties, key)
            if value is None:
                raise ProtocolError(f"TXT property {key!r} is missing")
            fields[key] = value
        if not _PROTO.match(fields["proto"]):
            raise ProtocolError(f"invalid protocol version {fields['proto']!r}")
        return cls(
            agent_id=fields["id"],
            fleet=fields["fleet"],
            broker=fields["broker"],
            profile=fields["profile"],
            proto=int(fields["proto"]),
        )


def _text(properties: Mapping[bytes, bytes | None], key: str) -> str | None:
    """One TXT property as text, None when absent or without a value."""
    raw = properties.get(key.encode())
    if raw is None:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError(f"TXT property {key!r} is not UTF-8") from None


@dataclass(frozen=True)
class BrokerAdvert:
    """An MQTT broker seen on the LAN: one per address of each `_mqtt._tcp` service.

    `edgefl` is False for a broker another product announced (e.g. mosquitto through avahi,
    with no TXT properties); its `fleets` and `tls` are then unknown and left empty/False.
    Empty `fleets` on an edgefl broker means it serves any fleet.
    """

    host: str
    port: int
    tls: bool = False
    fleets: tuple[str, ...] = ()
    name: str = ""
    edgefl: bool = True

    def __post_init__(self) -> None:
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            raise ProtocolError(
                f"broker host {self.host!r} must be an IP address (it goes in an A record)"
            ) from None
        if type(self.port) is not int or not 1 <= self.port <= 65535:
            raise ProtocolError(f"broker port {self.port!r} out of range 1..65535")
        if not isinstance(self.fleets, tuple):
            raise ProtocolError(f"broker fleets {self.fleets!r} must be a tuple of fleet names")
        for fleet in self.fleets:
            check_name(fleet, "fleet")
        for key, value in self.to_txt().items():
            if len(key) + 1 + len(value.encode()) > _MAX_TXT_ENTRY:
                raise ProtocolError(f"TXT property {key!r} is longer than {_MAX_TXT_ENTRY} bytes")

    def to_txt(self) -> dict[str, str]:
        return {
            "txtvers": BROKER_TXTVERS,
            "product": BROKER_PRODUCT,
            "proto": str(PROTOCOL_VERSION),
            "fleets": ",".join(self.fleets),
            "tls": "1" if self.tls else "0",
        }

    @classmethod
    def from_txt(
        cls, host: str, port: int, name: str, properties: Mapping[bytes, bytes | None]
    ) -> BrokerAdvert:
        """Parse a broker's TXT properties; without `product=edgefl` it is another product's
        broker, and an edgefl one of another TXT or protocol version is an error."""
        if _text(properties, "product") != BROKER_PRODUCT:
            return cls(host, port, name=name, edgefl=False)
        txtvers, proto = _text(properties, "txtvers"), _text(properties, "proto")
        if txtvers != BROKER_TXTVERS:
            raise ProtocolError(f"broker TXT version {txtvers!r}, we read {BROKER_TXTVERS}")
        if proto != str(PROTOCOL_VERSION):
            raise ProtocolError(f"broker protocol version {proto!r}, we speak {PROTOCOL_VERSION}")
        tls = _text(properties, "tls")
        if tls not in ("0", "1"):
            raise ProtocolError(f"broker TXT property tls={tls!r}: expected 0 or 1")
        fleets = tuple(sorted({f for f in (_text(properties, "fleets") or "").split(",") if f}))
        return cls(host, port, tls=tls == "1", fleets=fleets, name=name)

    def serves(self, fleet: str) -> bool:
        """Whether this edgefl broker was announced for `fleet`, explicitly or as any fleet's."""
        return self.edgefl and (not self.fleets or fleet in self.fleets)


def _broker_order(advert: BrokerAdvert) -> tuple[int, bytes, int, str, tuple[str, ...], bool]:
    """A total order on adverts: IPv4 before IPv6, then by address, port and name."""
    ip = ipaddress.ip_address(advert.host)
    return (ip.version, ip.packed, advert.port, advert.name, advert.fleets, advert.tls)


def choose_broker(adverts: Iterable[BrokerAdvert], fleet: str) -> BrokerAdvert | None:
    """The broker an agent of `fleet` should use, or None.

    Preference: an edgefl broker that names the fleet, then an edgefl broker for any fleet.
    Another product's broker (no `product=edgefl`) is a fallback only while no edgefl broker
    at all is seen, so that a plain mosquitto announced by avahi still works, but on a LAN
    where a coordinator announces, an unrelated broker (home automation...) is never chosen,
    not even when the coordinators seen serve other fleets only. Ties go to the lowest
    address, then port and name, so every agent of the fleet makes the same choice.
    """
    check_name(fleet, "fleet")
    adverts = list(adverts)
    if any(advert.edgefl for advert in adverts):
        adverts = [advert for advert in adverts if advert.serves(fleet)]
    if not adverts:
        return None
    return min(adverts, key=lambda a: (fleet not in a.fleets, *_broker_order(a)))


def discover_broker(
    fleet: str, interfaces: Sequence[str], timeout: float = 10.0
) -> BrokerAdvert | None:
    """Browse mDNS on `interfaces` for the broker of `fleet` (see `Discovery.find_broker`)."""
    check_name(fleet, "fleet")
    with Discovery(interfaces) as discovery:
        return discovery.find_broker(fleet, timeout)


def _instance_label(text: str) -> str:
    """A DNS label holds at most 63 bytes; longer names are replaced by a stable digest."""
    if len(text.encode()) <= _MAX_LABEL:
        return text
    return "edgefl-" + hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _host_addresses() -> set[bytes]:
    """Packed IP addresses of this host's interfaces (in the current network namespace)."""
    found = set()
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            text = ip.ip if isinstance(ip.ip, str) else ip.ip[0]
            found.add(ipaddress.ip_address(text.split("%")[0]).packed)
    return found


def _check_interfaces(interfaces: Sequence[str]) -> list[str]:
    """Refuse what would bind mDNS to every interface, or fail later with a bare OSError."""
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
        if ip.packed not in _host_addresses():
            raise ValueError(f"interface {address!r} is not an IP address of this host")
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
        self._brokers: dict[str, list[BrokerAdvert]] = {}
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

    def advertise_broker(
        self, host: str, port: int, *, fleets: Sequence[str] = (), tls: bool = False
    ) -> None:
        """Announce an MQTT broker (e.g. the coordinator's embedded one) at an IP address, for
        `fleets` (none: any fleet); announcing the same host and port again updates it."""
        if isinstance(fleets, str):
            raise ValueError(f"broker fleets {fleets!r} must be a list of fleet names")
        advert = BrokerAdvert(host, port, tls=tls, fleets=tuple(sorted(set(fleets))))
        label = _instance_label(f"edgefl-broker-{host}-{port}")
        self._publish(f"{label}.{BROKER_SERVICE}", BROKER_SERVICE, port, advert.to_txt(), host)

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

    def agents(self) -> dict[tuple[str, str], AgentAdvert]:
        """Every agent seen, of every fleet and including those advertised here, by (fleet,
        agent id): what `coordinator status` shows beside MQTT presence."""
        with self._changed:
            return {(a.fleet, a.agent_id): a for _, a in sorted(self._agents.items())}

    def brokers(self) -> list[tuple[str, int]]:
        """(address, port) of every MQTT broker advertised on the LAN, sorted."""
        return sorted({(advert.host, advert.port) for advert in self.broker_adverts()})

    def broker_adverts(self) -> list[BrokerAdvert]:
        """Every MQTT broker advertised on the LAN, edgefl's and others', one per address."""
        with self._changed:
            adverts = [advert for entries in self._brokers.values() for advert in entries]
        return sorted(adverts, key=_broker_order)

    def find_broker(self, fleet: str, timeout: float) -> BrokerAdvert | None:
        """Wait up to `timeout` s for a broker `fleet` can use (see `choose_broker`).

        Returns as soon as one names the fleet; a broker for any fleet, or another product's,
        is returned after waiting `SETTLE_S` more for a better one. None after the timeout.
        """
        check_name(fleet, "fleet")
        deadline = time.monotonic() + timeout

        def choice() -> BrokerAdvert | None:
            return choose_broker(self.broker_adverts(), fleet)

        found = self._wait(choice, lambda advert: advert is not None, timeout)
        if found is None or fleet in found.fleets:
            return found
        settle = min(SETTLE_S, deadline - time.monotonic())
        return self._wait(choice, lambda a: a is not None and fleet in a.fleets, settle)

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
        entry: AgentAdvert | list[BrokerAdvert] | None = None
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
    ) -> AgentAdvert | list[BrokerAdvert]:
        info = zeroconf.get_service_info(service_type, name, timeout=_RESOLVE_TIMEOUT_MS)
        if info is None:
            raise ProtocolError("did not resolve")
        if service_type == BROKER_SERVICE:
            if info.port is None or not 1 <= info.port <= 65535:
                raise ProtocolError(f"broker port {info.port!r} out of range")
            addresses = info.parsed_addresses()
            if not addresses:
                raise ProtocolError("broker has no address")
            instance = name.removesuffix(f".{service_type}")
            return [
                BrokerAdvert.from_txt(address, info.port, instance, info.properties)
                for address in addresses
            ]
        advert = AgentAdvert.from_txt(info.properties)
        if advert.proto != PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version {advert.proto}, we speak {PROTOCOL_VERSION}")
        return advert
