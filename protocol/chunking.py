"""Split messages into self-describing frames and reassemble them on the other side.

Brokers commonly refuse packets above 1 MB and stall other traffic while they forward a
huge one, so payloads above `chunk_size` travel as several frames. Every frame is a small
msgpack array followed by raw payload bytes:

    single frame:  ["efc", 1, id]                                          + payload
    chunk frame:   ["efc", 1, id, index, count, chunk_size, total, sha256] + payload slice

`id` is 16 random bytes, fresh for every message, so a QoS 1 redelivery (same id) is
recognised and dropped while a deliberate resend (new id) gets through. Every chunk carries
the whole header, so the receiver can validate the first chunk it sees, whichever it is, and
reject a chunk whose header disagrees with the others. The single frame costs 24 bytes and
skips the digest: TCP already protects one packet, the digest guards the reassembly.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import msgpack

from protocol.errors import ProtocolError
from protocol.limits import DEFAULT_LIMITS, Limits

MAGIC = "efc"
FRAME_VERSION = 1
DEFAULT_CHUNK_SIZE = 256 * 1024
"""256 KiB of payload per frame: well below the common 1 MB broker limit, with room."""

_ID_BYTES = 16
_DIGEST_BYTES = 32
_MAX_HEADER_BYTES = 96
_SINGLE_ITEMS = 3
_CHUNK_ITEMS = 8
_packer = msgpack.Packer(use_bin_type=True)


class FrameError(ProtocolError):
    """A rejected frame; `reason` is a short stable key for drop counters."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def fits_one_frame(size: int, chunk_size: int = DEFAULT_CHUNK_SIZE) -> bool:
    """Whether a payload of `size` bytes goes out as a single frame (as a retained message
    must: a broker retains packets, not messages)."""
    return size <= chunk_size


def split(
    payload: bytes | bytearray | memoryview, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> list[bytes]:
    """Frame `payload`: one single frame when it fits in `chunk_size`, chunk frames otherwise.

    Each frame is built with one copy of its slice of the payload.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    data = memoryview(payload).cast("B")
    message_id = os.urandom(_ID_BYTES)
    total = len(data)
    if fits_one_frame(total, chunk_size):
        return [b"".join((_packer.pack([MAGIC, FRAME_VERSION, message_id]), data))]
    digest = hashlib.sha256(data).digest()
    count = -(-total // chunk_size)
    return [
        b"".join(
            (
                _packer.pack(
                    [MAGIC, FRAME_VERSION, message_id, index, count, chunk_size, total, digest]
                ),
                data[index * chunk_size : (index + 1) * chunk_size],
            )
        )
        for index in range(count)
    ]


@dataclass(frozen=True)
class _Header:
    message_id: bytes
    single: bool
    index: int = 0
    count: int = 1
    chunk_size: int = 0
    total: int = 0
    digest: bytes = b""

    @property
    def shape(self) -> tuple[int, int, int, bytes]:
        """What every chunk of one message must agree on."""
        return self.count, self.chunk_size, self.total, self.digest


@dataclass
class _Partial:
    shape: tuple[int, int, int, bytes]
    last_seen: float
    chunks: dict[int, memoryview] = field(default_factory=dict)
    size: int = 0


class Reassembler:
    """Collects chunk frames per (source, message id) and returns each whole payload once.

    `source` is whatever names the sender's stream (the transport uses the MQTT topic).
    Duplicate chunks and redelivered messages are dropped and counted; a partial message
    with no new chunk for `timeout_s` expires. Memory is bounded three ways, each counted
    when it evicts the least recently active partial messages: their payload bytes together
    (`max_buffered_bytes`, by default `limits.max_partial_bytes`), their number
    (`limits.max_partials`), and their number per source (`limits.max_partials_per_source`,
    so a flood on one topic evicts its own partials before anyone else's). Completed ids are
    remembered for `remember_s` (at most `max_remembered` of them). Headers are checked
    against `limits` before any chunk is stored, and nothing is preallocated from a header,
    so a lying sender costs at most the bytes it actually sends, within those bounds. Not
    thread-safe: feed it from one thread (`set_limits` included).
    """

    def __init__(
        self,
        limits: Limits = DEFAULT_LIMITS,
        timeout_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
        *,
        max_buffered_bytes: int | None = None,
        remember_s: float = 600.0,
        max_remembered: int = 4096,
    ) -> None:
        self.limits = limits
        self.timeout_s = timeout_s
        self.max_buffered_bytes = (
            limits.max_partial_bytes if max_buffered_bytes is None else max_buffered_bytes
        )
        self.remember_s = remember_s
        self.max_remembered = max_remembered
        self._clock = clock
        self._partials: OrderedDict[tuple[str, bytes], _Partial] = OrderedDict()
        self._by_source: dict[str, OrderedDict[bytes, None]] = {}
        """Each source's partial message ids, oldest first."""
        self._completed: OrderedDict[tuple[str, bytes], float] = OrderedDict()
        self._buffered = 0
        self.counts: Counter[str] = Counter(duplicates=0, expired=0, evicted=0)

    @property
    def buffered_bytes(self) -> int:
        """Payload bytes held by incomplete messages."""
        return self._buffered

    @property
    def pending(self) -> int:
        """Number of incomplete messages."""
        return len(self._partials)

    def set_limits(self, limits: Limits) -> None:
        """Apply new limits (the run's, once its model is known); partial messages that no
        longer fit are dropped at once and counted as evicted."""
        self.limits = limits
        self.max_buffered_bytes = limits.max_partial_bytes
        for key, partial in list(self._partials.items()):
            if partial.shape[2] > limits.max_message_bytes:
                self._drop(key)
                self.counts["evicted"] += 1
        self._make_room(0, keep=None)

    def feed(self, source: str, frame: bytes | bytearray | memoryview) -> bytes | None:
        """Take one frame; return the whole payload when this frame completes a new message.

        Raises FrameError (a ProtocolError) for a malformed, oversized, inconsistent or
        corrupt frame; the frame is dropped and the other messages are unaffected.
        """
        now = self._clock()
        self._expire(now)
        header, data = _parse(frame)
        key = (source, header.message_id)
        if key in self._completed:
            self.counts["duplicates"] += 1
            return None
        if header.single:
            if len(data) > self.limits.max_message_bytes:
                raise FrameError(
                    "too_large",
                    f"message of {len(data)} bytes exceeds the limit of "
                    f"{self.limits.max_message_bytes}",
                )
            self._remember(key, now)
            return bytes(data)
        partial = self._partials.get(key)
        if partial is None:
            self._check_shape(header)
        elif partial.shape != header.shape:
            raise FrameError(
                "inconsistent", f"chunk {header.index} disagrees with earlier chunks of its message"
            )
        self._check_slice(header, data)
        if partial is None:
            self._make_source_room(source)
            partial = self._partials[key] = _Partial(header.shape, now)
            self._by_source.setdefault(source, OrderedDict())[header.message_id] = None
        elif header.index in partial.chunks:
            self.counts["duplicates"] += 1
            return None
        self._make_room(len(data), keep=key)
        partial.chunks[header.index] = data
        partial.size += len(data)
        partial.last_seen = now
        self._buffered += len(data)
        self._partials.move_to_end(key)
        if len(partial.chunks) < header.count:
            return None
        self._drop(key)
        payload = b"".join(partial.chunks[i] for i in range(header.count))
        if hashlib.sha256(payload).digest() != header.digest:
            raise FrameError(
                "digest", f"reassembled message of {len(payload)} bytes fails its digest"
            )
        self._remember(key, now)
        return payload

    def _check_shape(self, header: _Header) -> None:
        count, chunk_size, total = header.count, header.chunk_size, header.total
        if total > self.limits.max_message_bytes or total > self.max_buffered_bytes:
            raise FrameError(
                "too_large",
                f"message of {total} bytes exceeds the limit of "
                f"{min(self.limits.max_message_bytes, self.max_buffered_bytes)}",
            )
        if count > self.limits.max_chunks:
            raise FrameError(
                "too_large",
                f"message of {count} chunks exceeds the limit of {self.limits.max_chunks}",
            )
        if chunk_size < 1 or count < 2 or count != -(-total // chunk_size):
            raise FrameError(
                "inconsistent",
                f"{count} chunks of {chunk_size} bytes cannot hold a message of {total} bytes",
            )

    @staticmethod
    def _check_slice(header: _Header, data: memoryview) -> None:
        if header.index >= header.count:
            raise FrameError("inconsistent", f"chunk index {header.index} >= count {header.count}")
        last = header.count - 1
        expected = (
            header.chunk_size if header.index < last else header.total - last * header.chunk_size
        )
        if len(data) != expected:
            raise FrameError(
                "inconsistent",
                f"chunk {header.index} holds {len(data)} bytes, its header implies {expected}",
            )

    def _make_source_room(self, source: str) -> None:
        """Before a new partial message of `source`: evict its oldest beyond the per-source
        bound, then the least recently active anywhere beyond the overall count."""
        ids = self._by_source.get(source)
        while ids and len(ids) >= self.limits.max_partials_per_source:
            self._drop((source, next(iter(ids))))
            self.counts["evicted_source"] += 1
        while self._partials and len(self._partials) >= self.limits.max_partials:
            self._drop(next(iter(self._partials)))
            self.counts["evicted"] += 1

    def _make_room(self, size: int, keep: tuple[str, bytes] | None) -> None:
        for key in list(self._partials):
            if self._buffered + size <= self.max_buffered_bytes:
                return
            if key != keep:
                self._drop(key)
                self.counts["evicted"] += 1

    def _expire(self, now: float) -> None:
        while self._partials:
            key, partial = next(iter(self._partials.items()))
            if now - partial.last_seen < self.timeout_s:
                break
            self._drop(key)
            self.counts["expired"] += 1
        while self._completed:
            key, when = next(iter(self._completed.items()))
            if now - when < self.remember_s:
                break
            del self._completed[key]

    def _drop(self, key: tuple[str, bytes]) -> None:
        self._buffered -= self._partials.pop(key).size
        ids = self._by_source[key[0]]
        del ids[key[1]]
        if not ids:
            del self._by_source[key[0]]

    def _remember(self, key: tuple[str, bytes], now: float) -> None:
        self._completed[key] = now
        while len(self._completed) > self.max_remembered:
            self._completed.popitem(last=False)


def _parse(frame: bytes | bytearray | memoryview) -> tuple[_Header, memoryview]:
    """Decode and type-check a frame header; return it with a view of the payload bytes."""
    view = memoryview(frame).cast("B")
    unpacker = msgpack.Unpacker(
        raw=False,
        max_buffer_size=_MAX_HEADER_BYTES,
        max_str_len=len(MAGIC),
        max_bin_len=_DIGEST_BYTES,
        max_array_len=_CHUNK_ITEMS,
        max_map_len=0,
        max_ext_len=0,
    )
    unpacker.feed(view[:_MAX_HEADER_BYTES])
    try:
        items = unpacker.unpack()
    except Exception as exc:  # msgpack raises many types for malformed input
        raise FrameError("malformed", f"no frame header: {type(exc).__name__}") from None
    if not isinstance(items, list) or len(items) not in (_SINGLE_ITEMS, _CHUNK_ITEMS):
        raise FrameError("malformed", "frame header must be an array of 3 or 8 items")
    if items[0] != MAGIC:
        raise FrameError("malformed", "not a frame (bad magic)")
    if items[1] != FRAME_VERSION or isinstance(items[1], bool):
        raise FrameError(
            "unsupported_version",
            f"unsupported frame version {items[1]!r} (this build reads {FRAME_VERSION})",
        )
    message_id = items[2]
    if not isinstance(message_id, bytes) or len(message_id) != _ID_BYTES:
        raise FrameError("malformed", f"message id must be {_ID_BYTES} bytes")
    data = view[unpacker.tell() :]
    if len(items) == _SINGLE_ITEMS:
        return _Header(message_id, single=True), data
    index, count, chunk_size, total, digest = items[3:]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in items[3:7]):
        raise FrameError("malformed", "chunk index, count, size and total must be integers >= 0")
    if not isinstance(digest, bytes) or len(digest) != _DIGEST_BYTES:
        raise FrameError("malformed", f"digest must be {_DIGEST_BYTES} bytes of sha256")
    return _Header(message_id, False, index, count, chunk_size, total, digest), data
