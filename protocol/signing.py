"""Who may speak for whom: message signatures, with one fleet key or a key pair per member.

Two ways to sign a fleet's messages, chosen per fleet:

- `FleetKey`: one shared secret (HMAC-SHA256, `--key-file`). It proves a message came from
  *a* member of the fleet, not which one: any holder can sign as any other. Kept for labs and
  for fleets whose members trust each other (one owner, one image), where handing every device
  the same file is the whole setup.
- `MemberKeys`: each member has its own Ed25519 key pair, made in its state directory on
  first start (`--trust`, `--admitted`). A receiver checks a message against the key of the
  sender it claims, so a member can sign only as itself. The coordinator admits agents by
  their public keys and signs the run, whose roster lists every member's key; an agent accepts
  runs only from a key it was told to trust.

Either way the signature covers every byte of the message before it, header included (type,
fleet, sender, run id, round), and a receiver checks it on the raw bytes before decoding
anything (`protocol.messages.decode`). The topic a message travels on is a function of those
signed fields and is checked against them, so a message replayed on another topic, run or
round is rejected.

With per-member keys and no broker logins, a member proves its key to the embedded broker
when it connects (`connect_proof`): user name = its id, password =
`ed25519:<unix ms>:<base64 signature over b"edgefl-connect|<client id>|<unix ms>">`. The
signature binds the proof to the client id, the time to one moment: the broker accepts a
proof only if it is recent and newer than the last it accepted for that client, so a
captured CONNECT cannot be replayed (`check_connect_proof`).

A keys file (an admission list or a trust file) holds one member per line,
`ID ed25519:BASE64`, as `edge-agent key` and `coordinator key` print it; `#` starts a comment.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from protocol.errors import ProtocolError
from protocol.topics import check_name

PUBLIC_PREFIX = "ed25519:"
IDENTITY_FILE = "identity.pem"
"""A member's private key, in its state directory (it never leaves the device)."""
MIN_FLEET_KEY_BYTES = 16


class Signer(Protocol):
    """Signs this member's messages and checks everyone else's."""

    @property
    def signature_bytes(self) -> int:
        """The fixed size of every signature."""

    def sign(self, data: bytes) -> bytes: ...

    def verify(self, sender: str, data: bytes | memoryview, signature: bytes) -> None:
        """Raise ProtocolError unless `signature` is `sender`'s over `data`."""


@dataclass(frozen=True)
class FleetKey:
    """The fleet's shared secret: HMAC-SHA256 over the message, the sender not checked."""

    secret: bytes
    signature_bytes: int = 32

    def sign(self, data: bytes) -> bytes:
        return hmac.new(self.secret, data, hashlib.sha256).digest()

    def verify(self, sender: str, data: bytes | memoryview, signature: bytes) -> None:
        if not hmac.compare_digest(self.sign(bytes(data)), signature):
            raise ProtocolError("bad message signature")


@dataclass(frozen=True)
class MemberKeys:
    """This member's own key pair and the public keys it knows the members by.

    `runners` are the members whose run messages it accepts (the coordinators of its trust
    file); the keys a trusted run lists are added for that run only (`for_run`).
    """

    me: str
    private: Ed25519PrivateKey
    known: Mapping[str, Ed25519PublicKey] = field(default_factory=dict)
    runners: frozenset[str] = frozenset()
    aliases: frozenset[str] = frozenset()
    """Other ids this member also speaks as (a gateway's `serve` and `run` processes)."""
    signature_bytes: int = 64

    def __post_init__(self) -> None:
        known = dict(self.known)
        for me in {self.me, *self.aliases}:
            known[me] = self.private.public_key()
        object.__setattr__(self, "known", known)

    @property
    def public(self) -> str:
        return public_text(self.private.public_key())

    def sign(self, data: bytes) -> bytes:
        return self.private.sign(data)

    def verify(self, sender: str, data: bytes | memoryview, signature: bytes) -> None:
        public = self.known.get(sender)
        if public is None:
            raise ProtocolError(f"sender {sender!r} is not admitted (no public key for it)")
        try:
            public.verify(signature, bytes(data))
        except InvalidSignature:
            raise ProtocolError(f"bad signature for sender {sender!r}") from None

    def may_run(self, sender: str) -> bool:
        """Whether a run message signed by `sender` may start a run here."""
        return sender in self.runners

    def roster_keys(self, roster: list[str]) -> dict[str, str]:
        """The public keys a run message lists: the roster's and this member's own."""
        missing = [member for member in roster if member not in self.known]
        if missing:
            raise ProtocolError(f"no admitted public key for {', '.join(sorted(missing))}")
        return {member: public_text(self.known[member]) for member in {*roster, self.me}}

    def for_run(self, listed: Mapping[str, str]) -> MemberKeys:
        """These keys plus those a trusted run lists; a listed key that contradicts one
        known here is an error (ProtocolError), never a silent swap."""
        known = dict(self.known)
        for member, text in listed.items():
            public = parse_public(text, f"key of {member!r} in the run message")
            if member in known and _raw(known[member]) != _raw(public):
                raise ProtocolError(f"the run lists another key for {member!r} than trusted")
            known[member] = public
        return MemberKeys(self.me, self.private, known, self.runners, self.aliases)


def _raw(public: Ed25519PublicKey) -> bytes:
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def public_text(public: Ed25519PublicKey) -> str:
    return PUBLIC_PREFIX + base64.b64encode(_raw(public)).decode("ascii")


def parse_public(text: str, where: str) -> Ed25519PublicKey:
    """A public key as `public_text` writes it; ProtocolError naming `where` otherwise."""
    if not isinstance(text, str) or not text.startswith(PUBLIC_PREFIX):
        raise ProtocolError(f"{where}: expected {PUBLIC_PREFIX}BASE64, got {str(text)[:60]!r}")
    try:
        raw = base64.b64decode(text[len(PUBLIC_PREFIX) :], validate=True)
    except binascii.Error:
        raw = b""
    if len(raw) != 32:
        raise ProtocolError(f"{where}: not a 32-byte Ed25519 public key")
    return Ed25519PublicKey.from_public_bytes(raw)


def load_or_create_private(path: Path) -> Ed25519PrivateKey:
    """The member's private key at `path` (PEM), made there (mode 0600) on first use."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return _create_private(path)
    except OSError as exc:
        raise ProtocolError(f"cannot read the private key {path}: {exc.strerror}") from None
    try:
        private = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        raise ProtocolError(f"{path} is not an unencrypted PEM private key") from None
    if not isinstance(private, Ed25519PrivateKey):
        raise ProtocolError(f"{path} holds a {type(private).__name__}, not an Ed25519 key")
    return private


def _create_private(path: Path) -> Ed25519PrivateKey:
    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    _write_whole(path, pem, 0o600)
    return private


def _write_whole(path: Path, data: bytes, mode: int) -> None:
    """`data` at `path`, whole or not at all (a reader never sees half a file), created with
    `mode` (a private key is never readable by others, not even while it is written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.chmod(temporary, mode)
    os.replace(temporary, path)


def read_keys(path: Path) -> dict[str, Ed25519PublicKey]:
    """The members of a keys file (`ID ed25519:BASE64` per line); ProtocolError naming the
    file and line of the first bad one."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ProtocolError(f"cannot read the keys file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ProtocolError(f"{path} is not a text file of keys") from None
    keys: dict[str, Ed25519PublicKey] = {}
    for number, line in enumerate(lines, start=1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        where = f"{path}:{number}"
        parts = text.split()
        if len(parts) != 2:
            raise ProtocolError(f"{where}: expected 'ID {PUBLIC_PREFIX}BASE64'")
        member, public = parts
        try:
            check_name(member, "member id")
        except ProtocolError as exc:
            raise ProtocolError(f"{where}: {exc}") from None
        if member in keys:
            raise ProtocolError(f"{where}: {member!r} is listed twice")
        keys[member] = parse_public(public, where)
    return keys


def key_line(member: str, public: str) -> str:
    """One line of a keys file."""
    return f"{check_name(member, 'member id')} {public}"


def add_key(path: Path, member: str, public: str, replace: bool = False) -> bool:
    """Admit `member` with `public` in the keys file at `path` (made if missing): False when
    it is there already with this key; ProtocolError when it is there with another, unless
    `replace` (a re-imaged device's new key takes the old one's place)."""
    parse_public(public, "the public key")
    known = read_keys(path) if path.exists() else {}
    if member in known:
        if public_text(known[member]) == public:
            return False
        if not replace:
            raise ProtocolError(
                f"{member!r} is already admitted with another key in {path}: give --replace "
                "to admit it with this one instead (a re-imaged device)"
            )
        lines = path.read_text(encoding="utf-8").splitlines()
        kept = [line for line in lines if line.split()[:1] != [member]]
        text = "".join(f"{line}\n" for line in [*kept, key_line(member, public)])
        _write_whole(path, text.encode("utf-8"), path.stat().st_mode & 0o777)  # read live
        return True
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as handle:
        handle.write(key_line(member, public) + "\n")
    return True


def member_keys(
    me: str,
    private_path: Path,
    keys_path: Path | None,
    runners: bool = False,
    aliases: frozenset[str] = frozenset(),
) -> MemberKeys:
    """The signer of member `me` (also known as `aliases`): its key pair at `private_path`
    and the members of `keys_path`, who may also start runs here when `runners` (an agent's
    trust file)."""
    known = read_keys(keys_path) if keys_path is not None else {}
    private = load_or_create_private(private_path)
    mine = known.get(me)
    if mine is not None and _raw(mine) != _raw(private.public_key()):
        raise ProtocolError(
            f"{keys_path} lists another public key for {me!r} than this member's own "
            f"({private_path})"
        )
    runs_from = frozenset({*known, me}) if runners else frozenset()
    return MemberKeys(me, private, known, runs_from, aliases)


def keys_to_list(signer: Signer | None, roster: list[str]) -> dict[str, str]:
    """What a run message signed by `signer` lists for `roster`: their public keys with
    per-member keys, nothing otherwise. ProtocolError if a member was never admitted."""
    return signer.roster_keys(roster) if isinstance(signer, MemberKeys) else {}


def signer_for_run(signer: Signer | None, run: Any) -> Signer | None:
    """The signer that checks the messages of `run` (a RunConfig): with per-member keys, one
    that also knows the members the run lists, once the run's own signer is trusted here to
    start runs (ProtocolError otherwise); any other signer as it is."""
    if not isinstance(signer, MemberKeys):
        return signer
    if not signer.may_run(run.sender):
        raise ProtocolError(
            f"run signed by {run.sender!r}, which this agent does not trust to start runs "
            "(not in its --trust file)"
        )
    return signer.for_run(run.keys)


def public_line(member: str, private_path: Path) -> str:
    """The keys-file line of `member` whose private key is at `private_path` (made there on
    first use): what `edge-agent key` and `coordinator key` print for others to add."""
    return key_line(member, public_text(load_or_create_private(private_path).public_key()))


_PROOF_CONTEXT = b"edgefl-connect|"


def _proof_bytes(client_id: str, when_ms: int) -> bytes:
    return _PROOF_CONTEXT + client_id.encode() + b"|" + str(when_ms).encode()


def connect_proof(keys: MemberKeys) -> Callable[[str], tuple[str, str]]:
    """The credentials (user name, password) with which `keys`' member proves its key to
    the embedded broker, made anew for every connect (`TransportOptions.credentials`): the
    time in them never repeats within this process, so none is refused as a replay."""
    lock, last = threading.Lock(), [0]

    def credentials(client_id: str) -> tuple[str, str]:
        with lock:
            last[0] = when = max(time.time_ns() // 1_000_000, last[0] + 1)
        signature = base64.b64encode(keys.sign(_proof_bytes(client_id, when))).decode("ascii")
        return keys.me, f"{PUBLIC_PREFIX}{when}:{signature}"

    return credentials


def check_connect_proof(public: Ed25519PublicKey, client_id: str, password: str) -> int:
    """The time (unix ms) of a connect proof by the holder of `public` for `client_id`;
    ProtocolError if `password` is not one. Its freshness is the caller's to judge."""
    head, _, signature = password.removeprefix(PUBLIC_PREFIX).partition(":")
    if not password.startswith(PUBLIC_PREFIX) or not head.isdigit() or len(head) > 15:
        raise ProtocolError(f"not a connect proof ({PUBLIC_PREFIX}<unix ms>:<signature>)")
    try:
        public.verify(
            base64.b64decode(signature, validate=True), _proof_bytes(client_id, int(head))
        )
    except (binascii.Error, InvalidSignature):
        raise ProtocolError("the connect proof is not signed by this member's key") from None
    return int(head)
