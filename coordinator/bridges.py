"""One fleet over several mosquitto brokers joined by mosquitto's own bridge feature.

A site is one mosquitto broker near a group of devices (a building, a shop floor, a rack).
`coordinator bridge-config` writes one folder per site:

    <out>/<site>/mosquitto.conf     its listener, limits, and (leaves only) the bridge

The first site is the hub; every other site is a leaf that bridges to the hub and to nothing
else. A star cannot loop: a message published on a leaf crosses to the hub once and from the
hub to each other leaf once, and `try_private` (mosquitto to mosquitto) keeps the hub from
echoing it back to the leaf it came from. The bridge carries the fleet's topics both ways at
QoS 1 with the retain flag kept, so the coordinator's retained run, and the agents' retained
presences and statuses, reach every site; `cleansession true` makes a leaf that restarts (or
loses its link) resubscribe and so receive the hub's retained messages again.

With `--agent` (as `coordinator broker-config`), each site folder is also a broker-config
folder (passwords, ACL, members/<id>), the same members with the same passwords on every site,
plus a `bridge` login whose grant covers the whole fleet: each leaf logs in to the hub as it
(its password is in the leaf's mosquitto.conf, then readable by its owner only).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import click

from coordinator.broker_config import (
    ACL,
    CONF,
    COORDINATOR_IDS,
    MAX_PACKET_BYTES,
    MEMBERS,
    PASSWORDS,
    BrokerAuthError,
    Listener,
    agent_ids,
    member_password,
    write_broker_config,
    write_file,
)
from protocol import topics
from protocol.acl import READ_ALL, Grant, fleet_grants
from protocol.cli import NAME, ConfigError, say
from protocol.errors import ProtocolError
from protocol.mqtt import BrokerAddress

BRIDGE = "bridge"
"""The login every leaf's bridge uses on the hub (and, for the ACL, on its own broker)."""

QUEUED_MESSAGES = 10_000
"""mosquitto's max_queued_messages (per client, default 1000). A bridge is one client that
carries a whole site's traffic: a round of a 1,000-agent fleet is a few thousand messages
(a model, a vote, a status per agent, and more while deliveries reach every agent), which
the default would silently drop while the link catches up."""

MAX_QUEUED = 1_000_000
"""The largest --max-queued: that many 256 KiB chunk frames are 256 GB already."""

KEEPALIVE_S = 30
"""The bridge's ping interval: a dead link is noticed within about 1.5x this, below the
default 60 s and well inside a round's timeout."""

RESTART_S = (2, 30)
"""The bridge reconnects after 2 s, backing off to 30 s (mosquitto's default starts at 5)."""


@dataclass(frozen=True)
class Site:
    """One broker of the fleet: its name (a folder name) and where it listens."""

    name: str
    address: BrokerAddress

    @classmethod
    def parse(cls, text: str) -> Site:
        """`NAME=HOST:PORT` (the port defaults to 1883)."""
        name, sep, address = text.partition("=")
        if not sep or not address:
            raise ValueError(f"bad site {text!r}: expected NAME=HOST[:PORT]")
        try:
            return cls(topics.check_name(name.strip(), "site"), BrokerAddress.parse(address))
        except ProtocolError as exc:
            raise ValueError(f"bad site {text!r}: {exc}") from None


def loopback_sites(count: int, base_port: int) -> list[Site]:
    """`count` sites on 127.0.0.1 at consecutive ports: `hub`, then `site1`, `site2`..."""
    if count < 2:
        raise ValueError(f"--sites {count}: a bridged fleet needs at least 2 sites")
    if base_port + count - 1 > 65535:
        raise ValueError(f"--base-port {base_port}: {count} sites run past port 65535")
    names = ["hub"] + [f"site{index}" for index in range(1, count)]
    return [Site(name, BrokerAddress("127.0.0.1", base_port + i)) for i, name in enumerate(names)]


def _loopback(host: str) -> bool:
    return host == "localhost" or host == "::1" or host.startswith("127.")


def check_sites(sites: Sequence[Site]) -> None:
    """At least a hub and a leaf, and no two sites with one name or one address."""
    if len(sites) < 2:
        raise ValueError("a bridged fleet needs at least 2 sites (the first is the hub)")
    for what, values in (
        ("name", [s.name for s in sites]),
        ("address", [str(s.address) for s in sites]),
    ):
        repeated = sorted({v for v in values if values.count(v) > 1})
        if repeated:
            raise ValueError(f"two sites share the {what} {', '.join(repeated)}")


@dataclass(frozen=True)
class BridgeOptions:
    """What the bridges carry and the limits each site's broker applies."""

    fleet: str | None = None
    """Bridge only this fleet's topics (None: every fleet, `fl/v1/#`)."""
    keepalive_s: int = KEEPALIVE_S
    queued_messages: int = QUEUED_MESSAGES

    @property
    def pattern(self) -> str:
        return f"{topics.fleet_root(self.fleet)}/#" if self.fleet else f"{topics.PREFIX}/#"


def bridge_lines(
    leaf: Site, hub: Site, options: BridgeOptions, password: str | None = None
) -> list[str]:
    """The `connection` section of a leaf's configuration: its bridge to the hub."""
    name = f"{leaf.name}-to-{hub.name}"
    lines = [
        "",
        f"connection {name}",
        # mosquitto's host:port, never [v6]:port; for an IPv6 hub the port is required.
        f"address {hub.address.host}:{hub.address.port}",
        f"remote_clientid {name}",
        f"local_clientid local.{name}",
        f"topic {options.pattern} both 1",
        "try_private true",
        "cleansession true",
        "bridge_outgoing_retain true",
        f"bridge_max_packet_size {MAX_PACKET_BYTES}",
        f"keepalive_interval {options.keepalive_s}",
        "restart_timeout {} {}".format(*RESTART_S),
        "start_type automatic",
    ]
    if password is not None:
        lines += [f"remote_username {BRIDGE}", f"remote_password {password}"]
        lines.append(f"local_username {BRIDGE}")
    return lines


def bridge_grant(fleet: str) -> Grant:
    """The bridges' login: reads and writes all of the fleet's topics (it republishes every
    member's messages), and the state of its own connection."""
    state = "$SYS/broker/connection/+/state"
    return Grant(BRIDGE, (READ_ALL, state), (f"{topics.fleet_root(fleet)}/#", state))


def _refuse_existing(folder: Path, force: bool) -> None:
    if not force and (folder / CONF).exists():
        raise BrokerAuthError(
            f"{folder} already holds a broker configuration; give --force to rewrite it"
        )


def _anonymous_site(folder: Path, site: Site, force: bool) -> None:
    """A site any client may join: for loopback, or a network closed to others."""
    _refuse_existing(folder, force)
    conf = [
        "# edgefl bridged site: written by `coordinator bridge-config`",
        "per_listener_settings false",
        f"listener {site.address.port} {site.address.host}",
        "allow_anonymous true",
        f"max_packet_size {MAX_PACKET_BYTES}",
    ]
    folder.mkdir(parents=True, exist_ok=True)
    write_file(folder / CONF, "\n".join(conf) + "\n", 0o644)


def _secured_sites(
    out: Path, sites: Sequence[Site], fleet: str, grants: list[Grant], force: bool
) -> str:
    """A broker-config folder per site for `grants` and the bridges' login, the same
    members with the same passwords on every site (each leaf first takes the hub's);
    returns the bridges' password."""
    grants = [*grants, bridge_grant(fleet)]
    hub = out / sites[0].name
    for site in sites:
        folder = out / site.name
        if folder != hub:
            _refuse_existing(folder, force)
            shutil.copytree(hub / MEMBERS, folder / MEMBERS, dirs_exist_ok=True)
        listener = Listener(site.address.port, site.address.host)
        write_broker_config(folder, fleet, grants, listener, force)
    return member_password(hub, BRIDGE)


def write_bridge_config(
    out: Path,
    sites: Sequence[Site],
    options: BridgeOptions,
    grants: list[Grant] | None = None,
    force: bool = False,
) -> list[Path]:
    """Write each site's folder (this module's docstring); returns their configurations,
    hub first. With `grants` (which need `options.fleet`), every site enforces them."""
    check_sites(sites)
    password = None
    if grants is None:
        for site in sites:
            _anonymous_site(out / site.name, site, force)
    elif options.fleet is None:
        raise ValueError("logins and an ACL are per fleet: give the fleet")
    else:
        password = _secured_sites(out, sites, options.fleet, grants, force)
    hub, confs = sites[0], []
    for site in sites:
        conf = out / site.name / CONF
        # A bridge is one client that carries a whole site's traffic (QUEUED_MESSAGES).
        lines = [f"max_queued_messages {options.queued_messages}"]
        if site is not hub:
            lines += bridge_lines(site, hub, options, password)
        text = conf.read_text(encoding="utf-8") + "\n".join(lines) + "\n"
        # A leaf's configuration may hold the bridge's password: then only its owner reads it.
        write_file(conf, text, 0o600 if password and site is not hub else 0o644)
        confs.append(conf)
    return confs


def _sites(site_texts: tuple[str, ...], count: int | None, base_port: int) -> list[Site]:
    if site_texts and count is not None:
        raise ConfigError("give --site (repeatable) or --sites N, not both")
    try:
        if count is not None:
            return loopback_sites(count, base_port)
        if not site_texts:
            raise ConfigError(
                "no site given: use --site NAME=HOST:PORT (repeatable, the first is the hub) "
                "or --sites N for N brokers on loopback"
            )
        sites = [Site.parse(text) for text in site_texts]
        check_sites(sites)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return sites


def _grants(
    fleet: str | None, agents: tuple[str, ...], agents_file: str | None, coordinator: str
) -> list[Grant] | None:
    """The fleet's grants when agents are named (logins and ACL on every site), else None."""
    names = agent_ids(agents, agents_file)
    if not names:
        return None
    if fleet is None:
        raise ConfigError("--agent needs --fleet: logins and the ACL are per fleet")
    if set(names) & {coordinator, BRIDGE, *COORDINATOR_IDS}:
        reserved = ", ".join([coordinator, BRIDGE, *COORDINATOR_IDS])
        raise ConfigError(f"agent ids must differ from the reserved logins: {reserved}")
    try:
        return fleet_grants(fleet, names, coordinator, COORDINATOR_IDS)
    except ProtocolError as exc:
        raise ConfigError(str(exc)) from None


@click.command("bridge-config")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Folder.")
@click.option(
    "--site",
    "site_texts",
    multiple=True,
    metavar="NAME=HOST:PORT",
    help="A site's broker (repeatable); the first is the hub the others bridge to.",
)
@click.option(
    "--sites", "count", type=int, metavar="N", help="N brokers on 127.0.0.1: hub, site1, ..."
)
@click.option(
    "--base-port",
    default=1883,
    show_default=True,
    type=click.IntRange(1, 65535),
    help="With --sites: the hub's port, the leaves' the next ones.",
)
@click.option("--fleet", type=NAME, help="Bridge only this fleet [default: every fleet].")
@click.option("--agent", "agents", multiple=True, type=NAME, help="An agent id (repeatable).")
@click.option("--agents-file", type=click.Path(exists=True, dir_okay=False), help="Agent ids.")
@click.option("--coordinator", default="gateway", show_default=True, type=NAME, help="Its login.")
@click.option(
    "--keepalive",
    default=KEEPALIVE_S,
    show_default=True,
    type=click.IntRange(5, 65535),
    help="Seconds between the bridge's pings (MQTT allows 65535 at most).",
)
@click.option(
    "--max-queued",
    default=QUEUED_MESSAGES,
    show_default=True,
    type=click.IntRange(1, MAX_QUEUED),
    help="mosquitto's per-client queue: above a round's messages of the fleet.",
)
@click.option("--force", is_flag=True, help="Rewrite existing configurations.")
def bridge_config(
    out: str,
    site_texts: tuple[str, ...],
    count: int | None,
    base_port: int,
    fleet: str | None,
    agents: tuple[str, ...],
    agents_file: str | None,
    coordinator: str,
    keepalive: int,
    max_queued: int,
    force: bool,
) -> None:
    """Write mosquitto configurations for one fleet over several sites: each leaf bridges
    the fleet's topics to the hub (with --agent: logins and the ACL on every site)."""
    sites = _sites(site_texts, count, base_port)
    grants = _grants(fleet, agents, agents_file, coordinator)
    options = BridgeOptions(fleet, keepalive, max_queued)
    try:
        confs = write_bridge_config(Path(out), sites, options, grants, force)
    except (ValueError, BrokerAuthError) as exc:
        raise ConfigError(str(exc)) from None
    except OSError as exc:
        raise ConfigError(f"cannot write {out}: {exc.strerror or exc}") from None
    say(f"wrote {len(sites)} bridged sites to [bold]{out}[/] (hub: {sites[0].name})")
    for site, conf in zip(sites, confs, strict=True):
        say(f"{site.name}: `mosquitto -c {conf.resolve()}`, devices: --broker {site.address}")
    if grants is not None:
        say(f"give each device only its own {out}/<site>/{MEMBERS}/<id> (same on every site)")
    say(f"files per site: {CONF}" + (f", {PASSWORDS}, {ACL}" if grants else ""))
    if grants is None and any(not _loopback(site.address.host) for site in sites):
        say(
            "[yellow]anonymous sites[/]: any client that reaches them may join the fleet; give "
            "--fleet and --agent for logins and an ACL"
        )
