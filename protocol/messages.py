"""Typed protocol messages and their msgpack envelope.

Wire layout, one msgpack array of eight items:

    [version, type, fleet, sender, run_id, round, body, signature]

`body` is a map whose keys are the fields of the message class. `signature` is nil, or the
signature (`protocol.signing`: HMAC-SHA256 with a fleet key, Ed25519 with per-member keys)
over every encoded byte before it. Signing the encoded prefix lets a receiver verify a 20 MB
model without re-encoding it, and verify it before decoding: the signature is the fixed-size
tail of the message, and the sender whose key checks it is read from the first few bytes.
Tensor payloads travel as the bytes of `protocol.tensors.encode_tensors`, so this module
stays free of numpy and of any training code.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Iterable, Sequence
from enum import Enum
from typing import Any, ClassVar

import msgpack

from protocol.errors import ProtocolError
from protocol.limits import DEFAULT_LIMITS, Limits
from protocol.signing import Signer
from protocol.topics import check_name
from protocol.topics import parse as parse_topic
from protocol.version import PROTOCOL_VERSION

_ENVELOPE_ITEMS = 8
_BIN8 = 0xC4
_HEADER_PEEK_BYTES = 256
"""Enough for the array header, version, type, fleet and sender (names are <= 64 bytes)."""
_MAX_NESTING = 16


class MessageType(str, Enum):
    PRESENCE = "presence"
    STATUS = "status"
    RUN = "run"
    MODEL = "model"
    VOTE = "vote"
    DIVERGENCE = "divergence"
    REQUEST = "request"
    UPDATE = "update"
    GLOBAL = "global"
    TALLY = "tally"
    ABSENT = "absent"
    LOG = "log"
    KEYS = "keys"
    KEY_LIST = "keylist"
    SUPPORT = "support"
    SHARES = "shares"
    MASKED = "masked"
    SURVIVORS = "survivors"
    REVEAL = "reveal"
    CONSENT = "consent"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Message:
    """Header fields common to every message; subclasses add their body fields."""

    TYPE: ClassVar[MessageType]

    fleet: str
    sender: str
    run_id: str = ""
    round: int = 0

    def body(self) -> dict[str, Any]:
        """The fields after the header; a field still at its default is left out (the
        decoder fills it in), so optional fields cost nothing on the wire when unused."""
        return {
            f.name: value
            for f in dataclasses.fields(self)[4:]
            if (value := getattr(self, f.name)) != _default(f)
        }


@dataclasses.dataclass(frozen=True, kw_only=True)
class Presence(Message):
    """Retained birth message, and (online=False) the last will or a clean goodbye.

    `reason` tells an offline message's cause: "lost" (the will, sent by the broker; `since`
    is then when the member came online) or "shutdown" (`since` is when it stopped).

    `at` orders one member's presences against replays (`protocol.membership.PresenceClock`):
    the start of the connection a birth and its will belong to (both carry the same), the
    stop for a goodbye. `since` cannot: a connection's birth and will both carry its start,
    so a captured will replayed later would read as current. A member's stamps never go
    back, across its restarts too (`protocol.membership.StampFloor`), whatever its clock
    does. `answers`, in an answer to an id probe, is the probe's nonce: a prober accepts
    only answers naming its own, so a replayed birth or an old answer cannot block a
    restart. Both came with protocol version 2.
    """

    TYPE = MessageType.PRESENCE
    online: bool
    since: float
    role: str = "agent"
    profile: str = ""
    reason: str = ""
    at: float = 0.0
    answers: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Status(Message):
    """Retained per-agent status: what it is doing and the figures behind its decisions."""

    TYPE = MessageType.STATUS
    state: str
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    stopped: bool = False
    staleness: float | None = None
    """How many rounds stale, on average, what the agent's latest asynchronous round took
    in was; None (left out on the wire, as every optional field at its default) for a
    synchronous round, so such a status is the bytes it was before the field came and any
    build decodes it. A build from before the field refuses a status that carries it."""


FINAL_STATES = ("done", "stopped", "rejected", "failed", "cancelled")
"""The `Status.state`s in which an agent's part in its run is over."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig(Message):
    """Retained run configuration and roster published by a coordinator."""

    TYPE = MessageType.RUN
    roster: list[str]
    seed: int
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    timeouts: dict[str, float] = dataclasses.field(default_factory=dict)
    """The run's timeouts in seconds (`round_s`, `vote_s`, `linger_s`), which override the
    agents' own; empty: each agent keeps its own."""
    keys: dict[str, str] = dataclasses.field(default_factory=dict)
    """Per-member keys: the public key (`ed25519:...`) of every roster member and of the
    run's signer, vouched for by the signer; empty in a fleet without them."""
    keeper: str = ""
    """Who publishes the round tallies (`Tally`), so agents need not receive every other
    agent's votes and statuses: the coordinator; empty in a fleet without one (each agent
    follows every status and vote itself)."""
    cancelled: bool = False
    """The run's signer called it off (`coordinator cancel`): its agents end it after the
    round they are in, keep their checkpoint and current model, and go back to idle; an
    agent that sees it before joining never joins. Published retained in place of the run
    message, signed like it."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Model(Message):
    """An agent's (sparse) model after a round; `base_round` >= 0 marks a delta on that base."""

    TYPE = MessageType.MODEL
    tensors: bytes
    num_samples: int
    base_round: int = -1


@dataclasses.dataclass(frozen=True, kw_only=True)
class Vote(Message):
    """Pruning-time vote: 1 when the agent's model has settled this round."""

    TYPE = MessageType.VOTE
    vote: bool
    score: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class Divergence(Message):
    """Per-layer divergence between the trained and the received model (FedLDF)."""

    TYPE = MessageType.DIVERGENCE
    layers: list[str]
    values: list[float]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Request(Message):
    """Ask `target` for some layers of its model, or for its full model (`layers` empty).

    Sent to the aggregator, `fraction` > 0 asks for this round's part of the global model
    for the sender training that fraction of its neurons (FedSPU: the aggregator draws the
    same active neurons from the sender's seed); 0 asks it to re-send the round's broadcast.
    """

    TYPE = MessageType.REQUEST
    target: str
    layers: list[str] = dataclasses.field(default_factory=list)
    fraction: float = 0.0
    since: float = 0.0
    """When the asker's session began: an asker that restarted lost what was in flight to it
    and may be answered again (its target need not follow its presence to know)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Update(Message):
    """A participant's upload to the aggregator in a centralized strategy."""

    TYPE = MessageType.UPDATE
    tensors: bytes
    num_samples: int
    base_version: int = -1
    """FedBuff: the global version the update was trained from (its `round` is then the
    sender's own count of updates); -1 in a synchronous round, trained from the last one."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Global(Message):
    """The aggregate of a centralized round, published once for all participants."""

    TYPE = MessageType.GLOBAL
    tensors: bytes
    participants: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Keys(Message):
    """Secure aggregation (`protocol.secagg`), a participant's first step of a round: its
    two X25519 public keys (raw, 32 bytes: one to encrypt shares, one to agree on masks),
    its sample count, the weight of its vector in the sum, and the Ed25519 public key (raw)
    of its signature on the round's survivor list (`Consent`)."""

    TYPE = MessageType.KEYS
    cipher_key: bytes
    mask_key: bytes
    num_samples: int
    sign_key: bytes
    base_version: int = -1
    """FedBuff: the global version the member's update was trained from (its `round` is the
    cohort, the version the update goes into), so that the aggregator knows its staleness;
    -1 in a synchronous round."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class KeyList(Message):
    """The aggregator's list of the round's `Keys` (U1), each as its sender encoded and
    signed it, so that in a signed fleet the aggregator cannot substitute a key."""

    TYPE = MessageType.KEY_LIST
    keys: list[bytes]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shares(Message):
    """Secret shares, each encrypted for one member: a participant's to the aggregator
    (`peers`: their holders), or relayed by it to `target` (`peers`: who shared them)."""

    TYPE = MessageType.SHARES
    target: str
    peers: list[str]
    sealed: list[bytes]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Support(Message):
    """Secure aggregation over entries agreed before masking (FedAdam-Top and -SSM): the
    entries of the round's vector a participant's upload covers (its top-k masks), or the
    aggregator's union of those it collected, over which every participant then masks;
    a mask in `protocol.masks`' smallest encoding (`protocol.masks.pack_mask`)."""

    TYPE = MessageType.SUPPORT
    mask: bytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class Masked(Message):
    """A participant's masked vector: little-endian uint32 ring elements."""

    TYPE = MessageType.MASKED
    values: bytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class Survivors(Message):
    """The aggregator's list of who uploaded a masked vector this round (U3)."""

    TYPE = MessageType.SURVIVORS
    survivors: list[str]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Reveal(Message):
    """A survivor's shares that unmask the sum: one per `owners` member (of its self-mask
    seed if it survived, else of its mask-key seed)."""

    TYPE = MessageType.REVEAL
    owners: list[str]
    shares: list[bytes]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Consent(Message):
    """The consistency check on the survivor list (U3): a survivor's Ed25519 signature on it
    (`signers`: the sender alone), or the aggregator's forward of those it collected, which
    each survivor checks before it reveals (`protocol.secagg.Client.reveal`)."""

    TYPE = MessageType.CONSENT
    signers: list[str]
    signatures: list[bytes]


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return _NO_DEFAULT


_NO_DEFAULT = object()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tally(Message):
    """What the fleet reported of round `round` (0: who is ready to start), published once by
    the run's keeper when every agent still in the run reported it (or the wait ran out).

    The sets are bitmaps over the run's sorted roster (bit i of byte i // 8, least
    significant first): `done` reported the round finished (round 0: ready), `voted` voted
    in it and `yes` voted 1 (ALGORITHMS.md 1.7). `stopped`: every agent stopped early so
    far, with its last round; `left`: agents that will not take part (their data does not
    fit the run)."""

    TYPE = MessageType.TALLY
    done: bytes
    voted: bytes = b""
    yes: bytes = b""
    stopped: dict[str, int] = dataclasses.field(default_factory=dict)
    left: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Absent(Message):
    """The run's keeper's word on who of the run is gone, retained, republished (whole)
    whenever that changes: the agents of a run with a keeper follow this instead of every
    presence of the fleet (K presences to each agent, K^2 at a run's start).

    `gone`: a bitmap over the run's sorted roster (as `Tally`'s) of every agent that took
    part, has not finished the run and is gone: it left, or crashed and did not come back
    within the grace (`protocol.membership.CRASH_GRACE_S`). A bitmap, so that a thousand
    agents each read a fleet-wide outage in 125 bytes, not a thousand names."""

    TYPE = MessageType.ABSENT
    gone: bytes = b""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Log(Message):
    """One of an agent's log records during its run (`run_id`), for the gateway to keep
    (`protocol.fleet_logs`): `time` is the record's (Unix seconds), `level` its name,
    `message` its text, cut to `fleet_logs.MAX_MESSAGE_CHARS`. `dropped`: how many records
    the agent left out (rate limit, full queue) since the one before this."""

    TYPE = MessageType.LOG
    time: float
    level: str
    message: str
    logger: str = ""
    dropped: int = 0


MESSAGE_CLASSES: dict[str, type[Message]] = {
    cls.TYPE.value: cls
    for cls in (
        Presence,
        Status,
        RunConfig,
        Model,
        Vote,
        Divergence,
        Request,
        Update,
        Global,
        Tally,
        Absent,
        Log,
        Keys,
        KeyList,
        Shares,
        Support,
        Masked,
        Survivors,
        Reveal,
        Consent,
    )
}


def bitmap(members: Iterable[str], roster: Sequence[str]) -> bytes:
    """`members` as a bitmap over `roster` (see `Tally`); members outside it are left out."""
    index = {agent: i for i, agent in enumerate(roster)}
    bits = bytearray((len(roster) + 7) // 8)
    for agent in members:
        if (i := index.get(agent)) is not None:
            bits[i // 8] |= 1 << (i % 8)
    return bytes(bits)


def members(bits: bytes, roster: Sequence[str]) -> set[str]:
    """The members of `roster` a `bitmap` holds; bits past the roster are ignored."""
    return {
        agent
        for i, agent in enumerate(roster)
        if i // 8 < len(bits) and bits[i // 8] >> (i % 8) & 1
    }


def encode(message: Message, *, key: Signer | None = None) -> bytes:
    """Encode a message; with a signer, append its signature so receivers can authenticate
    it."""
    _check_fields(message)
    packer = msgpack.Packer(use_bin_type=True)
    head = packer.pack_array_header(_ENVELOPE_ITEMS) + b"".join(
        packer.pack(item)
        for item in (
            PROTOCOL_VERSION,
            message.TYPE.value,
            message.fleet,
            message.sender,
            message.run_id,
            message.round,
            message.body(),
        )
    )
    if key is None:
        return head + packer.pack(None)
    return head + packer.pack(key.sign(head))


def decode(
    data: bytes | bytearray | memoryview,
    *,
    key: Signer | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> Message:
    """Decode and validate untrusted bytes; raises ProtocolError and nothing else.

    With a signer, the signature is checked on the raw bytes before anything is unpacked."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"message must be bytes, not {type(data).__name__}")
    data = bytes(data)
    if len(data) > limits.max_message_bytes:
        raise ProtocolError(
            f"message of {len(data)} bytes exceeds the limit of {limits.max_message_bytes}"
        )
    if key is not None:
        _verify(data, key)
    items = _unpack(data, limits)
    if not isinstance(items, list) or len(items) != _ENVELOPE_ITEMS:
        raise ProtocolError(f"envelope must be an array of {_ENVELOPE_ITEMS} items")
    version, type_, fleet, sender, run_id, round_, body, _signature = items
    _check_version(version)
    cls = MESSAGE_CLASSES.get(type_) if isinstance(type_, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {type_!r}")
    if not isinstance(body, dict):
        raise ProtocolError(f"{type_} body must be a map")
    header = {"fleet": fleet, "sender": sender, "run_id": run_id, "round": round_}
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(body) - names
    if unknown or set(body) & set(header):
        raise ProtocolError(f"{type_} body has unexpected fields {sorted(map(str, unknown))}")
    try:
        message = cls(**header, **body)
    except TypeError as exc:
        raise ProtocolError(f"{type_} message is incomplete: {exc}") from None
    _check_fields(message)
    return message


def decode_on_topic(
    topic: str, payload: bytes, kind: str, fleet: str, key: Signer | None
) -> Message:
    """A message of `kind` received on `topic`, checked against it: its type, fleet, sender,
    round and (for a request) target must be what the topic says, so that nobody can publish
    under another agent's topic. ProtocolError if it does not decode or does not match."""
    topic_fleet, topic_kind, fields = parse_topic(topic)
    message = decode(payload, key=key)
    if (
        topic_kind != kind
        or message.TYPE.value != kind
        or topic_fleet != fleet
        or message.fleet != fleet
        or message.sender != fields.get("agent")
        or fields.get("round", str(message.round)) != str(message.round)
        or (isinstance(message, (Request, Shares)) and fields.get("to") != message.target)
    ):
        raise ProtocolError(f"{kind} message does not match its topic")
    return message


def _unpack(data: bytes, limits: Limits) -> Any:
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_bin_len=limits.max_message_bytes,
            max_str_len=1 << 20,
            max_array_len=1 << 20,
            max_map_len=1 << 16,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises many types for malformed input
        raise ProtocolError(f"malformed msgpack: {type(exc).__name__}: {exc}") from None


def _check_version(version: Any) -> None:
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"unsupported protocol version {version!r} (this build speaks {PROTOCOL_VERSION})"
        )


def _verify(data: bytes, key: Signer) -> None:
    """Check the signature tail against the claimed sender's key, unpacking nothing but
    the first four header items (a forged 100 MB message costs a hash, not a decode)."""
    size = key.signature_bytes
    start = len(data) - size
    if start < 3 or data[start - 2] != _BIN8 or data[start - 1] != size:
        raise ProtocolError("message is not signed but this fleet requires signatures")
    signed = memoryview(data)[: start - 2]
    key.verify(_claimed_sender(signed), signed, data[start:])


def _claimed_sender(head: memoryview) -> str:
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=_HEADER_PEEK_BYTES)
    unpacker.feed(head[:_HEADER_PEEK_BYTES])
    try:
        if unpacker.read_array_header() != _ENVELOPE_ITEMS:
            raise ProtocolError(f"envelope must be an array of {_ENVELOPE_ITEMS} items")
        _check_version(unpacker.unpack())
        _type, _fleet, sender = unpacker.unpack(), unpacker.unpack(), unpacker.unpack()
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises many types for malformed input
        raise ProtocolError(f"malformed message header: {type(exc).__name__}") from None
    if not isinstance(sender, str):
        raise ProtocolError("message sender must be a string")
    return sender


_FIELD_HINTS: dict[type[Message], tuple[tuple[str, Any], ...]] = {}


def _field_hints(cls: type[Message]) -> tuple[tuple[str, Any], ...]:
    """(name, resolved annotation) of every field of a message class, resolved once: string
    annotations cost more to evaluate than a whole small message costs to encode."""
    cached = _FIELD_HINTS.get(cls)
    if cached is None:
        hints = typing.get_type_hints(cls)
        cached = tuple((field.name, hints[field.name]) for field in dataclasses.fields(cls))
        _FIELD_HINTS[cls] = cached
    return cached


def _check_fields(message: Message) -> None:
    """Check every field against its annotation, so handlers can trust what they get."""
    check_name(message.fleet, "fleet")
    check_name(message.sender, "sender")
    hints = dict(_field_hints(type(message)))
    for field in dataclasses.fields(message):
        value = getattr(message, field.name)
        if not _conforms(value, hints[field.name]):
            hint = hints[field.name]
            expected = hint.__name__ if isinstance(hint, type) else str(hint)
            raise ProtocolError(
                f"{message.TYPE.value}.{field.name} must be {expected} (finite numbers, "
                f"plain data), got {value!r:.80}"
            )
    if isinstance(message, Divergence) and len(message.layers) != len(message.values):
        raise ProtocolError("divergence has a different number of layers and values")
    if isinstance(message, Shares) and len(message.peers) != len(message.sealed):
        raise ProtocolError("shares has a different number of peers and shares")
    if isinstance(message, Reveal) and len(message.owners) != len(message.shares):
        raise ProtocolError("reveal has a different number of owners and shares")
    if isinstance(message, Consent) and len(message.signers) != len(message.signatures):
        raise ProtocolError("consent has a different number of signers and signatures")
    if message.round < 0:
        raise ProtocolError(f"round must be >= 0, got {message.round}")


def _conforms(value: Any, hint: Any, depth: int = 0) -> bool:
    if depth > _MAX_NESTING:
        return False
    origin = typing.get_origin(hint)
    if hint is Any:
        return _is_plain_data(value, depth)
    if hint is float:
        return (
            isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        )
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_conforms(v, item, depth + 1) for v in value)
    if origin is dict:
        _, item = typing.get_args(hint)
        return isinstance(value, dict) and all(
            isinstance(k, str) and _conforms(v, item, depth + 1) for k, v in value.items()
        )
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, h, depth) for h in typing.get_args(hint))
    return isinstance(value, hint)


def _is_plain_data(value: Any, depth: int) -> bool:
    """JSON-like data: what a config or a metrics map may hold, finite numbers only."""
    if depth > _MAX_NESTING:
        return False
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_is_plain_data(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain_data(v, depth + 1) for k, v in value.items())
    return False
