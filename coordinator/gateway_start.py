"""How `coordinator serve` and `coordinator run` start their gateway, written once: the
options they share as one value, then its keys and broker login (secure by default beyond
loopback), the coordinator's own key, and the broker (given, or embedded with its TLS
certificate), its mDNS advert, the dashboard and the fleet connection while in use.

The two commands take these steps in their own order, each with its own checks between them
(serve checks a given broker before anything is made, run finds its broker once secured,
and drops an interrupted run before its broker starts): so the start-up is a value whose
steps they call (`GatewayStart`), not one call. A module of its own so that `coordinator.cli`
keeps its commands; `coordinator.gateway` is what run does once started.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import socket
from collections.abc import Iterator
from pathlib import Path

import click

from coordinator.broker_config import (
    COORDINATOR,
    GATEWAY,
    BrokerAuthError,
    member_password,
)
from coordinator.cli_shared import dashboard
from coordinator.gateway_state import (
    FollowedKeys,
    Guard,
    identity_path,
    secure_by_default,
    warn_open,
)
from coordinator.gateway_tls import BrokerCertificate, broker_certificate, gateway_names
from protocol import (
    BrokerAddress,
    ConfigError,
    Identity,
    MqttTransport,
    ProtocolError,
    connect,
    leave,
    read_key,
)
from protocol.cli import BrokerSettings, loopback, say
from protocol.membership import STAMPS_FILE
from protocol.signing import MemberKeys, Signer, member_keys


@dataclasses.dataclass(frozen=True)
class GatewayOptions:
    """What serve and run are told of their gateway (`coordinator.cli.gateway_options`),
    named as the options are: one value, as both start the gateway from the same ones."""

    broker_settings: BrokerSettings
    host: str
    port: int
    broker_auth: str | None
    fleet: str
    mdns_interfaces: tuple[str, ...]
    key_file: str | None
    admitted_file: str | None
    identity_file: str | None
    state_dir: str | None
    open_fleet: bool
    http: str | None
    http_token: str | None


@dataclasses.dataclass(frozen=True)
class GatewayStart:
    """A gateway secured and not yet started: its options, the keys and logins it uses
    (`guard`), and the settings it reaches its broker with (which run may still point at a
    broker it finds, `coordinator.cli.run_broker`)."""

    options: GatewayOptions
    guard: Guard
    settings: BrokerSettings

    @classmethod
    def secured(cls, options: GatewayOptions) -> GatewayStart:
        """The keys and login: as given, open with --open (said), else secure by default
        beyond loopback (the broker given, or the embedded one's --host); logged in to
        their own embedded broker under --broker-auth."""
        given = Guard(
            options.key_file,
            options.admitted_file,
            identity_path(options.identity_file, options.state_dir),
            options.broker_auth,
        )
        settings = options.broker_settings
        where = settings.address.host if settings.address is not None else options.host
        guard = given
        if options.open_fleet:
            if not given.chosen(settings):
                warn_open(where)
        else:
            guard, settings = secure_by_default(
                given, settings, where, options.fleet, options.state_dir, prepare=True
            )
        return cls(options, guard, embedded_login(settings, guard.broker_auth))

    def signed(self, member: str) -> Identity:
        """The gateway's identity as `member` (run conducts as the coordinator, serve follows
        as the gateway), signing with the guard's key, made on first use."""
        guard = self.guard
        key = coordinator_signer(guard.key_file, guard.admitted_file, guard.identity_file)
        folder = guard.state_folder
        stamps = Path(folder) / f"{member}.{STAMPS_FILE}" if folder is not None else None
        return Identity(self.options.fleet, member, role="coordinator", key=key, stamps=stamps)

    @contextlib.contextmanager
    def joined(self, identity: Identity) -> Iterator[tuple[BrokerAddress, MqttTransport]]:
        """The broker and this gateway's connection to it as `identity`, with the mDNS
        advert and the dashboard, while in use; the goodbye is said before they stop."""
        options, settings, key = self.options, self.settings, identity.key
        host, port, fleet = options.host, options.port, options.fleet
        with (
            gateway_broker(
                settings, host, port, fleet, options.mdns_interfaces, self.guard, key
            ) as broker,
            dashboard(options.http, options.http_token, broker, settings, fleet, key),
        ):
            transport = join_fleet(broker, settings, identity)
            try:
                yield broker, transport
            finally:
                leave(transport, identity)


def coordinator_signer(
    key_file: str | None, admitted_file: str | None, identity_file: str, *, signs: bool = True
) -> Signer | None:
    """The fleet key, the coordinator's own key pair with its admission list, or nothing.
    A coordinator that `signs` (serve, run) makes its key on first use and says so: the
    devices must trust the new key; `status` only reads and never makes one."""
    if key_file and admitted_file:
        raise click.UsageError("give --key-file (one fleet key) or --admitted (a key per member)")
    if admitted_file is None:
        return read_key(key_file)
    if not Path(identity_file).exists():
        if not signs:
            raise click.ClickException(
                f"no coordinator key at {identity_file}: give --identity, the key file "
                "`coordinator serve` and `run` sign with"
            )
        say(
            f"made a new coordinator key {identity_file}; devices take runs only from a key "
            f"they trust: `coordinator key --identity {identity_file}` prints their trust lines"
        )
    try:
        keys = member_keys(
            COORDINATOR,
            Path(identity_file),
            Path(admitted_file),
            aliases=frozenset({GATEWAY}),
        )
    except ProtocolError as exc:
        raise click.ClickException(str(exc)) from None
    return FollowedKeys(
        keys.me, keys.private, keys.known, aliases=keys.aliases, admitted=admitted_file
    )


def embedded_login(settings: BrokerSettings, auth: str | None) -> BrokerSettings:
    """Settings that log `serve` and `run` in to their own embedded broker under its
    --broker-auth (as the gateway), unless they name a broker or a user of their own."""
    if auth is None or settings.address is not None or settings.username is not None:
        return settings
    try:
        password = member_password(auth, GATEWAY)
    except BrokerAuthError as exc:
        raise ConfigError(str(exc)) from None
    return dataclasses.replace(settings, username=GATEWAY, password=password)


def gateway_certificate(
    guard: Guard | None, host: str, mdns_interfaces: tuple[str, ...]
) -> BrokerCertificate | None:
    """The TLS certificate of the embedded broker beyond loopback under the gateway's own
    logins (its secure default), issued now from the gateway's CA for the names devices
    may use; None on loopback, or under logins given by --broker-auth."""
    if guard is None or guard.state_folder is None or loopback(host):
        return None
    folder = Path(guard.state_folder)
    try:
        return broker_certificate(folder, gateway_names(host, *mdns_interfaces))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot make the broker's TLS certificate in {folder}: {exc}") from None


@contextlib.contextmanager
def gateway_broker(
    settings: BrokerSettings,
    host: str,
    port: int,
    fleet: str,
    mdns_interfaces: tuple[str, ...],
    guard: Guard | None = None,
    key: Signer | None = None,
) -> Iterator[BrokerAddress]:
    """The fleet's broker: the one the settings name, else an embedded amqtt broker started
    here (with the guard's logins and ACL, or its admission list: a member's client id then
    takes that member's key, `key`'s for the coordinator's own); announced over mDNS on the
    given interfaces while in use."""
    from coordinator.broker import EmbeddedBroker

    embedded = None
    broker = settings.address
    if broker is None:
        if mdns_interfaces and loopback(host):
            raise ConfigError(
                "--mdns announces the broker to the LAN, but it listens on loopback: give "
                "--host (the LAN address or 0.0.0.0)"
            )
        try:
            embedded = EmbeddedBroker(
                host=host,
                port=port,
                auth=guard.broker_auth if guard else None,
                admitted=guard.admitted_file if guard else None,
                fleet=fleet,
                coordinator_key=key.public if isinstance(key, MemberKeys) else None,
                tls=gateway_certificate(guard, host, mdns_interfaces),
            )
        except BrokerAuthError as exc:
            raise ConfigError(str(exc)) from None
        try:
            embedded.start()
        except OSError as exc:
            raise click.ClickException(
                f"cannot start the embedded broker on {host}:{port}: {exc}"
            ) from None
        if embedded.tls is not None:
            say(
                f"embedded MQTT broker listening on [bold]{host}:{embedded.tls_port}[/] over TLS "
                f"(its CA for the devices' bundles: {embedded.tls.ca}), "
                f"and in clear on 127.0.0.1:{port} for this machine alone"
            )
        else:
            say(f"embedded MQTT broker listening on [bold]{host}:{port}[/]")
        broker = embedded.address
    else:
        say(f"using MQTT broker at [bold]{settings.describe()}[/]")
    discovery = None
    try:
        if mdns_interfaces:
            from protocol.discovery import Discovery

            try:
                discovery = Discovery(interfaces=list(mdns_interfaces))
            except ValueError as exc:
                raise click.BadParameter(str(exc), param_hint="--mdns") from None
            # An mDNS address record needs an IP: the embedded broker is reached on the
            # interface it is announced on; an external broker's host name is resolved here.
            announced = mdns_interfaces[0] if embedded else socket.gethostbyname(broker.host)
            if ipaddress.ip_address(announced).is_loopback:  # on this host: reached on the LAN
                announced = mdns_interfaces[0]
            tls = embedded.tls_address if embedded else None  # devices reach it over TLS
            discovery.advertise_broker(
                announced,
                (tls or broker).port,
                fleets=[fleet],
                tls=tls is not None or settings.tls is not None,
            )
            say(f"announcing the broker over mDNS on {', '.join(mdns_interfaces)}")
        yield broker
    finally:
        if discovery is not None:
            discovery.close()
        if embedded is not None:
            embedded.stop()


def join_fleet(
    broker: BrokerAddress, settings: BrokerSettings, identity: Identity
) -> MqttTransport:
    """Connect as `identity` (proving its key to a broker that checks keys, when it has no
    login); a second process under the same name is a one-line error."""
    try:
        return connect(broker, identity, settings.transport_options(None))
    except ProtocolError as exc:  # a duplicate id, or refused credentials
        raise click.ClickException(str(exc)) from None
