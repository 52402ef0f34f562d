"""Broker authorization for a fleet: per-member credentials and the ACL of `protocol.acl`.

`coordinator broker-config` writes one folder that both brokers use:

    mosquitto.conf          listener, allow_anonymous false, password_file, acl_file
    passwords               mosquitto's password file (PBKDF2-SHA512, `$7$`, as mosquitto_passwd)
    acl                     mosquitto's acl_file: one `user` block per member
    members/<id>/password   the member's own password (0600), for --password-file
    members/<id>/broker.toml  its [broker] table (username, password_file, tls_ca), for --config
    members/<coordinator>/local.toml  the same for the coordinator's processes on the gateway:
                            mosquitto's second listener, on 127.0.0.1 (see `Listener`)

mosquitto reads the first three; the embedded broker (`coordinator serve --broker-auth DIR`)
reads `passwords` and `acl` (`BrokerAuth.load`). Each device gets only its own `members/<id>`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import secrets
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import click
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from protocol import topics
from protocol.acl import READ_ALL, Grant, fleet_grants, parse_acl, render_acl
from protocol.chunking import DEFAULT_CHUNK_SIZE
from protocol.cli import NAME, ConfigError, say
from protocol.errors import ProtocolError
from protocol.signing import check_connect_proof, parse_public, read_keys

log = logging.getLogger(__name__)

GATEWAY, COORDINATOR = "gateway", "coordinator"
"""The member ids of `coordinator serve` and of `coordinator run` (and emulate), which may
run side by side."""
COORDINATOR_IDS = (GATEWAY, COORDINATOR)
"""The coordinator's login may publish as either."""

PASSWORDS, ACL, CONF, MEMBERS = "passwords", "acl", "mosquitto.conf", "members"
LOCAL_CONFIG = "local.toml"
"""The coordinator's [broker] table for mosquitto's listener on 127.0.0.1 (`Listener`)."""

MAX_PACKET_BYTES = 4 * DEFAULT_CHUNK_SIZE
"""mosquitto's max_packet_size: a chunk frame with room to spare, far below its 256 MB default
that lets one client fill the broker's memory."""

_ITERATIONS = 101  # what mosquitto_passwd 2.0 writes; the count is stored in each hash
_SALT_BYTES = 12


class BrokerAuthError(ValueError):
    """A broker authorization folder that cannot be used (missing or malformed file)."""


def hash_password(password: str, iterations: int = _ITERATIONS) -> str:
    """A password hash in mosquitto's `$7$` format (PBKDF2-HMAC-SHA512), which mosquitto
    2.x and the embedded broker both check."""
    salt = secrets.token_bytes(_SALT_BYTES)
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations)
    encode = base64.b64encode
    return f"$7${iterations}${encode(salt).decode()}${encode(digest).decode()}"


def check_password(password: str, hashed: str) -> bool:
    """Whether `password` matches a `$7$` hash (False for any other or malformed hash)."""
    parts = hashed.split("$")
    if len(parts) != 5 or parts[1] != "7" or not parts[2].isdigit():
        return False
    try:
        salt, expected = base64.b64decode(parts[3]), base64.b64decode(parts[4])
    except ValueError:
        return False
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, int(parts[2]), len(expected))
    return hmac.compare_digest(digest, expected)


def parse_passwords(text: str, source: str = PASSWORDS) -> dict[str, str]:
    """user -> hash from a mosquitto password file; only `$7$` hashes are accepted."""
    users = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        user, _, hashed = line.partition(":")
        if not user or not hashed.startswith("$7$"):
            raise BrokerAuthError(
                f"{source}:{number}: expected `user:$7$...` (mosquitto_passwd of mosquitto 2)"
            )
        users[user] = hashed
    return users


@dataclass(frozen=True)
class BrokerAuth:
    """Who may log in (password hashes) and what each may publish and subscribe to."""

    passwords: dict[str, str]
    grants: dict[str, Grant]

    @classmethod
    def load(cls, folder: str | Path) -> BrokerAuth:
        """The `passwords` and `acl` files of a folder written by `coordinator broker-config`."""
        texts = []
        for name in (PASSWORDS, ACL):
            path = Path(folder) / name
            try:
                texts.append(path.read_text(encoding="utf-8"))
            except OSError as exc:
                raise BrokerAuthError(f"cannot read {path}: {exc.strerror or exc}") from None
        try:
            grants = parse_acl(texts[1], str(Path(folder) / ACL))
        except ProtocolError as exc:
            raise BrokerAuthError(str(exc)) from None
        passwords = parse_passwords(texts[0], str(Path(folder) / PASSWORDS))
        if not passwords:
            raise BrokerAuthError(f"{Path(folder) / PASSWORDS} holds no user")
        return cls(passwords, grants)

    def login(self, user: str | None, password: str | None) -> bool:
        """Whether this user name and password may connect (never anonymously)."""
        hashed = self.passwords.get(user or "")
        return hashed is not None and check_password(password or "", hashed)

    def may_publish(self, user: str | None, topic: str) -> bool:
        grant = self.grants.get(user or "")
        return grant is not None and grant.may_publish(topic)

    def may_subscribe(self, user: str | None, topic_filter: str) -> bool:
        grant = self.grants.get(user or "")
        return grant is not None and grant.may_subscribe(topic_filter)


_REKEY = (
    " (another device with its id, or its bundle copied to a second board? A re-imaged device "
    "is admitted again with `coordinator admit ID KEY --replace`)"
)

PROOF_WINDOW_S = 600.0
"""How far a connect proof's time may be from the broker's clock: wide enough for a device
whose clock drifts, narrow enough that the proofs the broker must remember stay few."""
_PROOFS_KEPT = 4096


def _owners(grants: Iterable[Grant]) -> dict[str, str]:
    """client id (`<fleet>-<member>`) -> the user that alone may connect with it."""
    return {
        f"{fleet}-{member}": grant.user for grant in grants for fleet, member in grant.member_ids()
    }


class Admission:
    """Who may connect to the embedded broker, under which client id, and what each may do.

    With a `coordinator broker-config` folder, members log in with their passwords, and a
    login may use the client ids of the members it speaks as (`<fleet>-<id>`) or any other
    id (a prober's, a feed's), never another member's: MQTT lets a second connection with a
    client id close the first, so a member using another's id would take its session.

    With both (`coordinator serve`'s secure default), a member with an admitted key logs in
    with its connect proof and never with its password: a device's bundle copied to another
    board, or a re-imaged board with a new key, cannot take the member's client id (MQTT
    hands it to the newest connection) and with it the member's place in the fleet.

    With an admission list (`--admitted`, per-device keys) and no logins, anyone may connect
    anonymously to read and to probe for ids (`membership`), but a member's client id, and
    publishing as a member, take that member's connect proof (`protocol.signing`): user name
    = its id, password = a signature by its key over the client id and the time, fresh
    (within PROOF_WINDOW_S of the broker's clock) and newer than the last proof accepted for
    that client id, so a captured CONNECT cannot be replayed. A proven connection gets the
    member's grant (`protocol.acl.fleet_grants`), as a login does. `coordinator_key` is the
    coordinator's public key, which proves the coordinator's ids (gateway, coordinator).

    Both files are read again when they change (`refresh`, on each new connection), so a
    device admitted while the broker runs connects without a restart.
    """

    def __init__(
        self,
        folder: Path | None = None,
        admitted: Path | None = None,
        fleet: str = "default",
        coordinator_key: str | None = None,
    ) -> None:
        """Raises BrokerAuthError (one line) for an unusable folder or admission list."""
        self.folder, self.admitted, self.fleet = folder, admitted, fleet
        self.coordinator = (
            None if coordinator_key is None else parse_public(coordinator_key, "--coordinator-key")
        )
        self._proofs: dict[tuple[str, str], int] = {}
        self._seen: tuple[tuple[int, int, int], ...] = ()
        self._load()

    def _files(self) -> list[Path]:
        logins = [self.folder / PASSWORDS, self.folder / ACL] if self.folder is not None else []
        return logins + ([self.admitted] if self.admitted is not None else [])

    def _signature(self) -> tuple[tuple[int, int, int], ...]:
        stats = []
        for path in self._files():
            try:
                stat = path.stat()
            except OSError:
                stats.append((0, 0, 0))
                continue
            stats.append((stat.st_mtime_ns, stat.st_size, stat.st_ino))
        return tuple(stats)

    def _load(self) -> None:
        signature = self._signature()
        self.auth: BrokerAuth | None = None
        self.keys: dict[str, Ed25519PublicKey] = {}
        if self.folder is not None:
            self.auth = BrokerAuth.load(self.folder)
            grants = self.auth.grants
            self.keys = self._member_keys()
        else:
            try:
                admitted = read_keys(self.admitted) if self.admitted is not None else {}
                agents = [member for member in admitted if member not in COORDINATOR_IDS]
                login = GATEWAY if self.coordinator is not None else None
                listed = fleet_grants(self.fleet, agents, login, COORDINATOR_IDS)
            except ProtocolError as exc:
                raise BrokerAuthError(str(exc)) from None
            self.keys = {member: admitted[member] for member in agents}
            if self.coordinator is not None:
                self.keys.update(dict.fromkeys(COORDINATOR_IDS, self.coordinator))
            root = topics.fleet_root(self.fleet)
            probes = (f"{root}/probe/+", f"{root}/probe/+/answer")
            grants = {grant.user: grant for grant in listed} | {"": Grant("", (READ_ALL,), probes)}
        self.grants = grants
        self.owners = _owners(grants.values())
        self._seen = signature

    def _member_keys(self) -> dict[str, Ed25519PublicKey]:
        """The admitted keys of the folder's members (the coordinator's logins excepted):
        each of these members logs in with its connect proof, never its password."""
        if self.admitted is None or not self.admitted.exists():
            return {}
        try:
            admitted = read_keys(self.admitted)
        except ProtocolError as exc:
            raise BrokerAuthError(str(exc)) from None
        assert self.auth is not None
        members = set(self.auth.passwords) - set(COORDINATOR_IDS)
        return {member: key for member, key in admitted.items() if member in members}

    def refresh(self) -> None:
        """Read the files again if they changed; a file caught half written (or broken)
        leaves the last good reading in force, with a warning."""
        if self._signature() == self._seen:
            return
        try:
            self._load()
        except BrokerAuthError as exc:
            log.warning("broker authorization unchanged: %s", exc)
        else:
            log.info("broker authorization read again: %d members", len(self.owners))

    def principal(self, user: str | None) -> str:
        """Whose grant a connection of `user` gets ("" for an anonymous one)."""
        if self.auth is None and user in COORDINATOR_IDS:
            return GATEWAY
        return user or ""

    def refusal(self, client_id: str, user: str | None, password: str | None) -> str | None:
        """Why a CONNECT of `client_id` as `user` is refused, or None when it is admitted."""
        if self.auth is not None and user in self.keys:
            why = self._proof_refusal(client_id, user, password or "")
            if why is not None:
                return f"{why}: the device is not the one admitted as {user!r}" + _REKEY
        elif self.auth is not None:
            if not self.auth.login(user, password):
                return f"wrong password or unknown user {user!r}" if user else "no user name"
        elif user is not None:
            why = self._proof_refusal(client_id, user, password or "")
            if why is not None:
                return why
        owner = self.owners.get(client_id)
        if owner is not None and owner != self.principal(user):
            if user is None:
                return f"client id {client_id!r} is member {owner!r}'s: it takes its connect proof"
            return f"client id {client_id!r} is member {owner!r}'s, not {user!r}'s"
        return None

    def _proof_refusal(self, client_id: str, user: str, password: str) -> str | None:
        public = self.keys.get(user)
        if public is None:
            return f"{user!r} is not admitted (no public key for it)"
        try:
            when = check_connect_proof(public, client_id, password)
        except ProtocolError as exc:
            return str(exc)
        now_ms = time.time_ns() // 1_000_000
        off_s = (when - now_ms) / 1000
        if abs(off_s) > PROOF_WINDOW_S:
            return (
                f"connect proof {off_s:+.0f} s off the broker's clock (more than "
                f"{PROOF_WINDOW_S:.0f} s): check the device's clock"
            )
        key = (user, client_id)
        if when <= self._proofs.get(key, -1):
            return "replayed connect proof (not newer than the last one accepted)"
        if len(self._proofs) >= _PROOFS_KEPT:
            stale = now_ms - int(PROOF_WINDOW_S * 1000)
            self._proofs = {k: t for k, t in self._proofs.items() if t > stale}
        self._proofs[key] = when
        return None

    def may_publish(self, user: str | None, topic: str) -> bool:
        grant = self.grants.get(self.principal(user))
        return grant is not None and grant.may_publish(topic)

    def may_subscribe(self, user: str | None, topic_filter: str) -> bool:
        grant = self.grants.get(self.principal(user))
        return grant is not None and grant.may_subscribe(topic_filter)


@dataclass(frozen=True)
class Listener:
    """Where mosquitto listens, and its TLS files (all None: plain MQTT).

    `tied`: every login's client id is its user name (mosquitto's
    `use_username_as_clientid`), so a member logged in as d1 can no longer connect with
    d0's client id and close d0's connection: MQTT gives a client id's session to its
    latest connection. It also means that one login holds one connection on this listener;
    an agent keeps to that (`protocol.membership.connect` closes its prober first), but the
    coordinator's processes on the gateway (`serve`, `run`, `status`, the dashboard) all log
    in as the coordinator at once: they connect through `local_port`, a second listener on
    127.0.0.1 without the rule (their client ids stay their own), reachable only from the
    gateway itself. Options that mosquitto applies to all listeners (logins, ACL) stay
    shared (`per_listener_settings false`), as bridges (`coordinator bridge-config`) need.
    """

    port: int
    host: str | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None
    tied: bool = False
    """`coordinator broker-config` ties; bridged sites (`coordinator bridge-config`) share
    one bridge login, which a tie would let each leaf's bridge take from the others."""
    local_port: int | None = None
    local_users: tuple[str, ...] = ()
    """The logins that get a `members/<id>/local.toml` for `local_port` (the coordinator)."""

    def lines(self, folder: Path) -> list[str]:
        lines = [f"listener {self.port}" + (f" {self.host}" if self.host else "")]
        for key, path in (("certfile", self.tls_cert), ("keyfile", self.tls_key)):
            if path is not None:
                lines.append(f"{key} {path.resolve()}")
        if self.tls_ca is not None and self.tls_cert is not None:
            lines.append(f"cafile {self.tls_ca.resolve()}")
        if self.tied:
            lines.append("use_username_as_clientid true")
        if self.local_port is not None:
            lines.append(f"listener {self.local_port} 127.0.0.1")
        return lines + [
            "allow_anonymous false",
            f"password_file {(folder / PASSWORDS).resolve()}",
            f"acl_file {(folder / ACL).resolve()}",
            f"max_packet_size {MAX_PACKET_BYTES}",
        ]


def write_file(path: Path, text: str, mode: int) -> None:
    """Write `text` to `path` created with `mode` (a secret never exists world-readable)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(descriptor, "w", encoding="utf-8") as stream:
        stream.write(text)
    os.chmod(temporary, mode)
    temporary.replace(path)


def member_password(folder: str | Path, member: str) -> str:
    """The password of `member` in a broker-config folder: lets `coordinator serve
    --broker-auth DIR` log in to its own embedded broker as its coordinator login."""
    path = Path(folder) / MEMBERS / member / "password"
    try:
        password = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise BrokerAuthError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not password:
        raise BrokerAuthError(f"{path} is empty")
    return password


def _member_password(folder: Path, member: str) -> str:
    """The member's existing password (a re-run keeps every device working), else a new one."""
    if (folder / MEMBERS / member / "password").is_file():
        return member_password(folder, member)
    return secrets.token_urlsafe(24)


def _member_files(folder: Path, member: str, password: str, listener: Listener) -> None:
    home = folder / MEMBERS / member
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_file(home / "password", password + "\n", 0o600)
    table = f'[broker]\nusername = "{member}"\npassword_file = "password"\n'
    if listener.local_port is not None and member in listener.local_users:
        local = f'{table}broker = "127.0.0.1:{listener.local_port}"\n'
        write_file(home / LOCAL_CONFIG, local, 0o600)
    if listener.tls_ca is not None:
        shutil.copyfile(listener.tls_ca, home / "ca.pem")
        table += 'tls_ca = "ca.pem"\n'
    write_file(home / "broker.toml", table, 0o600)


def write_broker_config(
    folder: Path, fleet: str, grants: list[Grant], listener: Listener, force: bool = False
) -> None:
    """Write the folder described in this module's docstring for these grants.

    An existing configuration is rewritten only with `force`; members keep their passwords,
    and members no longer listed lose access (their folders are left for the operator)."""
    if not force and any((folder / name).exists() for name in (CONF, PASSWORDS, ACL)):
        raise BrokerAuthError(
            f"{folder} already holds a broker configuration; give --force to rewrite it "
            "(members keep their passwords)"
        )
    folder.mkdir(parents=True, exist_ok=True)
    hashes = []
    for grant in grants:
        password = _member_password(folder, grant.user)
        _member_files(folder, grant.user, password, listener)
        hashes.append(f"{grant.user}:{hash_password(password)}\n")
    header = f"edgefl broker ACL of fleet {fleet}, written by `coordinator broker-config`."
    write_file(folder / ACL, render_acl(grants, header), 0o640)
    write_file(folder / PASSWORDS, "".join(hashes), 0o640)
    conf = [f"# edgefl fleet {fleet}: written by `coordinator broker-config`"]
    conf += ["per_listener_settings false", *listener.lines(folder)]
    write_file(folder / CONF, "\n".join(conf) + "\n", 0o644)


def agent_ids(agents: Iterable[str], agents_file: str | None) -> list[str]:
    """The agents named by --agent and by --agents-file (one id a line, # comments)."""
    names = list(agents)
    if agents_file is not None:
        try:
            text = Path(agents_file).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read {agents_file}: {exc.strerror or exc}") from None
        names += [line.split("#")[0].strip() for line in text.splitlines()]
    try:
        return [topics.check_name(name, "agent") for name in dict.fromkeys(names) if name]
    except ProtocolError as exc:
        raise ConfigError(str(exc)) from None


@click.command("broker-config")
@click.option("--out", "out", required=True, type=click.Path(file_okay=False), help="Folder.")
@click.option("--fleet", default="default", show_default=True, type=NAME, help="The fleet.")
@click.option("--agent", "agents", multiple=True, type=NAME, help="An agent id (repeatable).")
@click.option("--agents-file", type=click.Path(exists=True, dir_okay=False), help="Agent ids.")
@click.option(
    "--coordinator",
    default="gateway",
    show_default=True,
    type=NAME,
    help="Login of `coordinator serve` and `run` (may publish the run and global models).",
)
@click.option("--no-coordinator", is_flag=True, help="A fleet without one: agents publish the run.")
@click.option("--port", type=click.IntRange(1, 65535), help="[default: 1883, 8883 with TLS]")
@click.option("--host", help="Address mosquitto listens on [default: every interface].")
@click.option(
    "--local-port",
    type=click.IntRange(1, 65535),
    help="mosquitto's listener on 127.0.0.1 for the coordinator's processes [default: --port + 1].",
)
@click.option("--tls-cert", type=click.Path(exists=True, dir_okay=False), help="Broker cert.")
@click.option("--tls-key", type=click.Path(exists=True, dir_okay=False), help="Its key.")
@click.option("--tls-ca", type=click.Path(exists=True, dir_okay=False), help="CA for devices.")
@click.option("--force", is_flag=True, help="Rewrite an existing configuration.")
def broker_config(
    out: str,
    fleet: str,
    agents: tuple[str, ...],
    agents_file: str | None,
    coordinator: str,
    no_coordinator: bool,
    port: int | None,
    host: str | None,
    local_port: int | None,
    tls_cert: str | None,
    tls_key: str | None,
    tls_ca: str | None,
    force: bool,
) -> None:
    """Write per-member broker credentials and the fleet's ACL (each member publishes only
    on its own topics) for mosquitto and the embedded broker."""
    names = agent_ids(agents, agents_file)
    if not names:
        raise ConfigError("no agent given: use --agent ID (repeatable) or --agents-file FILE")
    if (tls_cert is None) != (tls_key is None):
        raise ConfigError("--tls-cert and --tls-key go together")
    login = None if no_coordinator else coordinator
    if login is not None and set(names) & {login, *COORDINATOR_IDS}:
        raise ConfigError(
            f"agent ids must differ from the coordinator's: {login}, " + ", ".join(COORDINATOR_IDS)
        )
    taken = set(names) & {f"{fleet}-{member}" for member in COORDINATOR_IDS}
    if taken:  # mosquitto makes an agent's login its client id: it would be the coordinator's
        raise ConfigError(f"agent id {sorted(taken)[0]} is the client id of the coordinator")
    cert, key, ca = (
        None if value is None else Path(value) for value in (tls_cert, tls_key, tls_ca)
    )
    port = port or (8883 if tls_cert else 1883)
    local = None if login is None else (local_port or (port + 1 if port < 65535 else port - 1))
    if local == port:
        raise ConfigError("--local-port must differ from --port")
    users = () if login is None else (login,)
    listener = Listener(port, host, cert, key, ca, tied=True, local_port=local, local_users=users)
    try:
        grants = fleet_grants(fleet, names, login, COORDINATOR_IDS)
        write_broker_config(Path(out), fleet, grants, listener, force)
    except (ProtocolError, BrokerAuthError) as exc:
        raise ConfigError(str(exc)) from None
    except OSError as exc:
        raise ConfigError(f"cannot write {out}: {exc.strerror or exc}") from None
    say(f"wrote the broker configuration of {len(grants)} members to [bold]{out}[/]")
    say(f"mosquitto: `mosquitto -c {Path(out).resolve() / CONF}`")
    if login is not None:
        say(
            f"the coordinator's commands on this gateway, with mosquitto: "
            f"--config {out}/{MEMBERS}/{login}/{LOCAL_CONFIG} (127.0.0.1:{local})"
        )
    say(f"embedded broker: `coordinator serve --broker-auth {out}`")
    say(f"give each device only its own {out}/{MEMBERS}/<id> (`edge-agent --config broker.toml`)")
