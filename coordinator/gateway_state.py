"""The gateway's own state: its key pair, admission list and broker logins, and how a
gateway command secures itself with them beyond loopback.

`coordinator serve` and `run` on a LAN address make this state on first start (in
`--state-dir`), sign with per-device keys and give each device its own broker login;
`coordinator admit` adds a device to all three at once and writes the bundle the device
starts with. The CLI (coordinator/cli.py) only chooses between this, the flags a user gave,
and `--open`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

from coordinator.broker_config import (
    COORDINATOR,
    COORDINATOR_IDS,
    GATEWAY,
    MEMBERS,
    BrokerAuth,
    BrokerAuthError,
    Listener,
    member_password,
    write_broker_config,
    write_file,
)
from coordinator.gateway_tls import CA_CERT, TLS_DIR, ca_certificate, gateway_names
from protocol import ConfigError, ProtocolError
from protocol.acl import fleet_grants
from protocol.cli import MQTT_PORT, MQTTS_PORT, BrokerSettings, loopback, say
from protocol.mqtt import TlsOptions
from protocol.signing import MemberKeys, public_line, read_keys

log = logging.getLogger(__name__)

SYSTEM_STATE = Path("/var/lib/edgefl")
IDENTITY, ADMITTED, BROKER_AUTH, FLEET_FILE = "coordinator.pem", "admitted.keys", "broker", "fleet"
"""The gateway's state folder: its key, admission list, broker logins (and in the broker
folder, the fleet its ACL is for)."""


def gateway_folder(state_dir: str | None) -> Path:
    """--state-dir, else /var/lib/edgefl for root or the service user (whose StateDirectory
    it is), else the user's own state folder."""
    if state_dir is not None:
        return Path(state_dir)
    if os.geteuid() == 0 or os.access(SYSTEM_STATE, os.W_OK):
        return SYSTEM_STATE
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "edgefl"


def identity_path(identity_file: str | None, state_dir: str | None) -> str:
    return identity_file or str(gateway_folder(state_dir) / IDENTITY)


@dataclasses.dataclass(frozen=True)
class FollowedKeys(MemberKeys):
    """The coordinator's keys, its admission list followed: a sender it does not know is
    looked up again when the list changed since it was read, so a device that `coordinator
    admit` adds while serve runs is seen (its log, its dashboard) without a restart."""

    admitted: str = ""
    _read: list[int] = dataclasses.field(default_factory=lambda: [0])
    """When the list was last read (its mtime in ns), in a list: the dataclass is frozen."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._read[0] = self._changed()

    def _changed(self) -> int:
        try:
            return os.stat(self.admitted).st_mtime_ns
        except OSError:
            return self._read[0]

    def verify(self, sender: str, data: bytes | memoryview, signature: bytes) -> None:
        if sender not in self.known and self._changed() != self._read[0]:
            self._read[0] = self._changed()
            try:
                listed = read_keys(Path(self.admitted))
            except ProtocolError as exc:
                log.warning("%s", exc)
            else:
                mine = {self.me, *self.aliases}
                added = {m: k for m, k in listed.items() if m not in mine}
                object.__setattr__(self, "known", {**self.known, **added})
        super().verify(sender, data, signature)


@dataclasses.dataclass(frozen=True)
class Guard:
    """How a gateway command signs, checks and logs in: the flags given, or what the
    gateway's state folder holds when it secures itself by default (`secure_by_default`)."""

    key_file: str | None
    admitted_file: str | None
    identity_file: str
    broker_auth: str | None = None
    state_folder: str | None = None
    """The gateway's state folder these came from (`secure_by_default`), whose CA makes the
    embedded broker's TLS certificate; None for what the flags named."""

    def chosen(self, settings: BrokerSettings) -> bool:
        """Whether the user said how (a key, an admission list, logins or a user name)."""
        given = (self.key_file, self.admitted_file, self.broker_auth, settings.username)
        return any(value is not None for value in given)


def secure_by_default(
    guard: Guard,
    settings: BrokerSettings,
    where: str,
    fleet: str,
    state_dir: str | None,
    *,
    prepare: bool,
) -> tuple[Guard, BrokerSettings]:
    """Beyond loopback (`where`, the broker's host), a gateway command that was told
    nothing of keys or logins uses the gateway's own: its key pair, admission list and
    broker logins in the state folder, made there first when it `prepare`s (serve, run);
    the settings then log in as the coordinator. On loopback, or told how, it is as given."""
    if guard.chosen(settings) or loopback(where):
        return guard, settings
    folder = gateway_folder(state_dir)
    if prepare:
        if prepare_gateway(folder, fleet):
            say(f"made the gateway's key, admission list and broker logins in [bold]{folder}[/]")
        say(
            f"fleet {fleet} is signed, with a broker login per member ({folder}); admit a "
            f"device with `coordinator admit ID KEY{state_flag(folder)}` (`edge-agent key` "
            "prints its ID and KEY)"
        )
    elif not (folder / BROKER_AUTH / FLEET_FILE).is_file():
        return guard, settings
    auth = folder / BROKER_AUTH
    secured = Guard(None, str(folder / ADMITTED), str(folder / IDENTITY), str(auth), str(folder))
    try:
        login = dataclasses.replace(
            settings, username=GATEWAY, password=member_password(auth, GATEWAY)
        )
    except BrokerAuthError as exc:
        raise ConfigError(str(exc)) from None
    return secured, over_tls(login, folder)


def over_tls(settings: BrokerSettings, folder: Path) -> BrokerSettings:
    """`settings` for the gateway's own broker at one of this machine's LAN addresses: over
    TLS against the gateway's CA, at the TLS port where the plain one was given or implied
    (the broker serves the LAN over TLS only). Any other broker, a TLS option given, or no
    CA yet: as given."""
    address, ca = settings.address, folder / TLS_DIR / CA_CERT
    if address is None or settings.tls is not None or not ca.is_file():
        return settings
    if address.host not in gateway_names():
        return settings
    port = MQTTS_PORT if address.port == MQTT_PORT else address.port
    return dataclasses.replace(
        settings,
        address=dataclasses.replace(address, port=port),
        tls=TlsOptions(ca_certs=str(ca)),
    )


def prepare_gateway(folder: Path, fleet: str) -> bool:
    """The gateway's key pair, admission list and broker logins for `fleet` in `folder`,
    each made the first time (a later start reuses them; another fleet rewrites the ACL
    for it, the members keeping their passwords); whether they were made now."""
    made = not (folder / BROKER_AUTH / FLEET_FILE).is_file()
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        (folder / ADMITTED).touch(mode=0o600, exist_ok=True)
        public_line(GATEWAY, folder / IDENTITY)  # makes the key pair
        if made or read_fleet(folder) != fleet:
            write_logins(folder, fleet, broker_agents(folder))
    except (OSError, ProtocolError, BrokerAuthError) as exc:
        raise ConfigError(f"cannot prepare the gateway's state in {folder}: {exc}") from None
    return made


def read_fleet(folder: Path) -> str:
    return (folder / BROKER_AUTH / FLEET_FILE).read_text(encoding="utf-8").strip()


def broker_agents(folder: Path) -> list[str]:
    """The agents the gateway's broker logins admit (none before the first admit)."""
    if not (folder / BROKER_AUTH / FLEET_FILE).is_file():
        return []
    users = BrokerAuth.load(folder / BROKER_AUTH).passwords
    return [user for user in users if user not in COORDINATOR_IDS]


def write_logins(folder: Path, fleet: str, agents: list[str]) -> None:
    """The broker folder (`coordinator broker-config`'s) with a login for the coordinator
    and each agent; members keep their passwords. The embedded broker reads it anew."""
    auth = folder / BROKER_AUTH
    grants = fleet_grants(fleet, agents, GATEWAY, COORDINATOR_IDS)
    write_broker_config(auth, fleet, grants, Listener(1883), force=True)
    write_file(auth / FLEET_FILE, fleet + "\n", 0o600)


def state_flag(folder: Path) -> str:
    """` --state-dir FOLDER` where the default would not find `folder`."""
    return "" if gateway_folder(None) == folder else f" --state-dir {folder}"


def warn_open(where: str) -> None:
    """What --open allows, said once at the start when the fleet is reachable beyond
    loopback."""
    if loopback(where):
        return
    say(
        f"[bold]--open[/]: the fleet on {where} is open: any machine that reaches the broker "
        "can connect without a login, read every model and status, start and cancel runs, "
        "send forged models and statuses in any agent's name, and take or block any agent "
        "id; nothing is signed. Use it only on a network you trust (without --open, a "
        "gateway beyond loopback signs with per-device keys and gives each device its own "
        "broker login: docs/deploy.md)."
    )


BUNDLE_CONFIG, BUNDLE_TRUST, BUNDLE_CA = "agent.toml", "trust.keys", "ca.pem"
"""A device's bundle, in its member folder: its `[broker]` table (no password: the device
logs in to the gateway's broker with a connect proof of its own key, so a copied bundle
logs no other board in; TLS checked against the gateway's CA, `ca.pem`) and the
coordinator keys it takes runs from; `edge-agent --config FOLDER/agent.toml` reads all."""


def write_bundle(folder: Path, agent_id: str) -> Path:
    """The bundle of `agent_id` (see BUNDLE_CONFIG) in its member folder, which
    `write_logins` made; returns the folder."""
    home = folder / BROKER_AUTH / MEMBERS / agent_id
    trust = [public_line(member, folder / IDENTITY) for member in (COORDINATOR, GATEWAY)]
    config = (
        f"# edgefl: the bundle of {agent_id}, written by `coordinator admit`. The device logs\n"
        "# in to the gateway's broker with its own key (never a password), over TLS (port\n"
        f"# {MQTTS_PORT}) checked against the gateway's CA, {BUNDLE_CA}; the coordinator keys\n"
        f'# it trusts are in {BUNDLE_TRUST}. Add broker = "..." to name the gateway.\n'
        f'[broker]\ntls_ca = "{BUNDLE_CA}"\n'
    )
    write_file(home / BUNDLE_CA, ca_certificate(folder).read_text(), 0o644)
    write_file(home / BUNDLE_CONFIG, config, 0o600)
    write_file(home / BUNDLE_TRUST, "\n".join(trust) + "\n", 0o600)
    return home
