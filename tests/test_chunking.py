"""Chunk framing and reassembly: order, duplicates, expiry, corruption and lying headers."""

from __future__ import annotations

import hashlib
import os
import random

import msgpack
import pytest

from protocol import (
    DEFAULT_CHUNK_SIZE,
    FRAME_VERSION,
    MAGIC,
    FrameError,
    Limits,
    ProtocolError,
    Reassembler,
    split,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def feed_all(reassembler: Reassembler, frames: list[bytes], source: str = "t") -> list[bytes]:
    return [p for f in frames if (p := reassembler.feed(source, f)) is not None]


def chunk_frame(
    *,
    message_id: bytes = b"i" * 16,
    index: int = 0,
    count: int = 2,
    chunk_size: int = 4,
    total: int = 8,
    digest: bytes = b"d" * 32,
    data: bytes = b"abcd",
) -> bytes:
    header = [MAGIC, FRAME_VERSION, message_id, index, count, chunk_size, total, digest]
    return msgpack.packb(header, use_bin_type=True) + data


def test_default_chunk_size_is_well_below_one_megabyte() -> None:
    assert DEFAULT_CHUNK_SIZE == 256 * 1024
    frame = split(os.urandom(DEFAULT_CHUNK_SIZE * 2))[0]
    assert len(frame) < DEFAULT_CHUNK_SIZE + 100


def test_small_payload_is_one_cheap_frame() -> None:
    (frame,) = split(b"vote", chunk_size=16)
    assert len(frame) - len(b"vote") <= 24
    assert Reassembler().feed("t", frame) == b"vote"


def test_empty_payload_round_trips() -> None:
    (frame,) = split(b"")
    assert Reassembler().feed("t", frame) == b""


@pytest.mark.parametrize("size", [4096, 4095, 4097, 1000 * 7, 1])
def test_shuffled_chunks_reassemble(size: int) -> None:
    payload = os.urandom(size)
    frames = split(payload, chunk_size=1000)
    assert len(frames) == -(-size // 1000)
    random.Random(size).shuffle(frames)
    reassembler = Reassembler()
    assert feed_all(reassembler, frames) == [payload]
    assert reassembler.buffered_bytes == 0 and reassembler.pending == 0


def test_exact_multiple_has_full_last_chunk() -> None:
    payload = os.urandom(3000)
    frames = split(payload, chunk_size=1000)
    assert len(frames) == 3
    assert len({len(f) for f in frames}) == 1
    assert feed_all(Reassembler(), frames) == [payload]


def test_interleaved_messages_and_sources_stay_apart() -> None:
    a, b = os.urandom(2500), os.urandom(2500)
    fa, fb = split(a, 1000), split(b, 1000)
    reassembler = Reassembler()
    out = feed_all(reassembler, [fa[0], fb[0], fa[1], fb[1], fb[2]], source="x")
    out += feed_all(reassembler, fa[2:], source="x")
    assert out == [b, a]
    # The same frames from another source are another message.
    assert feed_all(reassembler, fa, source="y") == [a]


def test_duplicate_chunks_are_harmless() -> None:
    payload = os.urandom(5000)
    frames = split(payload, 1000)
    reassembler = Reassembler()
    assert feed_all(reassembler, frames[:3] + frames[:3] + frames[3:]) == [payload]
    assert reassembler.counts["duplicates"] == 3


def test_redelivered_message_is_returned_once() -> None:
    payload = os.urandom(5000)
    frames = split(payload, 1000)
    small = split(b"small", 1000)
    reassembler = Reassembler()
    assert feed_all(reassembler, frames + small + frames + small + frames[:1]) == [
        payload,
        b"small",
    ]
    assert reassembler.counts["duplicates"] == len(frames) + 2
    assert reassembler.buffered_bytes == 0


def test_resending_the_same_bytes_is_a_new_message() -> None:
    reassembler = Reassembler()
    assert (
        feed_all(reassembler, split(b"x" * 3000, 1000) + split(b"x" * 3000, 1000))
        == [b"x" * 3000] * 2
    )


def test_completed_ids_are_forgotten_after_a_while() -> None:
    clock = FakeClock()
    reassembler = Reassembler(remember_s=10.0, clock=clock)
    frames = split(b"hello")
    assert feed_all(reassembler, frames) == [b"hello"]
    clock.now = 11.0
    assert feed_all(reassembler, frames) == [b"hello"]


def test_completed_id_memory_is_bounded() -> None:
    reassembler = Reassembler(max_remembered=2)
    first = split(b"first")
    assert len(feed_all(reassembler, first + split(b"second") + split(b"third"))) == 3
    assert feed_all(reassembler, first) == [b"first"]


def test_incomplete_message_expires() -> None:
    clock = FakeClock()
    reassembler = Reassembler(timeout_s=30.0, clock=clock)
    frames = split(os.urandom(3000), 1000)
    assert feed_all(reassembler, frames[:1]) == []
    clock.now = 20.0  # a new chunk refreshes the deadline, a duplicate does not
    assert feed_all(reassembler, frames[:2]) == []
    assert reassembler.buffered_bytes == 2000
    clock.now = 45.0
    assert feed_all(reassembler, frames[:1] + split(b"unrelated")) == [b"unrelated"]
    assert reassembler.pending == 1
    clock.now = 50.0
    assert feed_all(reassembler, split(b"later")) == [b"later"]
    assert reassembler.counts["expired"] == 1
    assert reassembler.buffered_bytes == 0 and reassembler.pending == 0
    # The last chunk alone starts over instead of completing the expired message.
    assert feed_all(reassembler, frames[2:]) == []


def test_memory_cap_evicts_oldest_partial_message() -> None:
    reassembler = Reassembler(max_buffered_bytes=5000)
    old, new = split(os.urandom(4000), 1000), split(os.urandom(4000), 1000)
    newer_payload = os.urandom(3000)
    newer = split(newer_payload, 1000)
    feed_all(reassembler, old[:3])
    feed_all(reassembler, new[:1])
    assert reassembler.buffered_bytes == 4000
    feed_all(reassembler, new[1:2])  # 5000: still fits
    assert reassembler.counts["evicted"] == 0
    assert feed_all(reassembler, newer) == [newer_payload]  # needs room: the oldest goes
    assert reassembler.counts["evicted"] == 1
    assert reassembler.buffered_bytes == 2000
    assert feed_all(reassembler, old[3:]) == []  # its earlier chunks are gone


def test_message_larger_than_memory_cap_is_rejected() -> None:
    reassembler = Reassembler(max_buffered_bytes=2000)
    with pytest.raises(FrameError) as err:
        reassembler.feed("t", split(os.urandom(3000), 1000)[0])
    assert err.value.reason == "too_large"


def test_corrupt_digest_is_rejected() -> None:
    payload = bytearray(os.urandom(3000))
    frames = split(payload, 1000)
    frames[1] = frames[1][:-1] + bytes([frames[1][-1] ^ 1])
    reassembler = Reassembler()
    feed_all(reassembler, [frames[0], frames[2]])
    with pytest.raises(ProtocolError) as err:
        reassembler.feed("t", frames[1])
    assert err.value.reason == "digest"
    assert reassembler.pending == 0 and reassembler.buffered_bytes == 0


def test_frame_error_is_a_protocol_error() -> None:
    assert issubclass(FrameError, ProtocolError)


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        (b"", "malformed"),
        (b"\x93", "malformed"),
        (b"plain text payload", "malformed"),
        (msgpack.packb({"a": 1}), "malformed"),
        (msgpack.packb(["xyz", 1, b"i" * 16]), "malformed"),
        (msgpack.packb([MAGIC, 2, b"i" * 16]), "unsupported_version"),
        (msgpack.packb([MAGIC, True, b"i" * 16]), "unsupported_version"),
        (msgpack.packb([MAGIC, 1, b"short"]), "malformed"),
        (msgpack.packb([MAGIC, 1, "i" * 16]), "malformed"),
        (chunk_frame(index=-1), "malformed"),
        (chunk_frame(index=True), "malformed"),
        (chunk_frame(digest=b"short"), "malformed"),
        (chunk_frame(index=2), "inconsistent"),
        (chunk_frame(index=5), "inconsistent"),
        (chunk_frame(count=3), "inconsistent"),
        (chunk_frame(count=1, total=4), "inconsistent"),
        (chunk_frame(chunk_size=0), "inconsistent"),
        (chunk_frame(total=9), "inconsistent"),
        (chunk_frame(data=b"abc"), "inconsistent"),
        (chunk_frame(index=1, data=b"abcdefgh"), "inconsistent"),
        (chunk_frame(count=3, total=1 << 40, chunk_size=1 << 39), "too_large"),
        (chunk_frame(count=1 << 20, total=1 << 22, chunk_size=4), "too_large"),
    ],
)
def test_lying_headers_are_rejected_before_buffering(frame: bytes, reason: str) -> None:
    reassembler = Reassembler(Limits(max_message_bytes=1 << 30, max_chunks=1 << 16))
    with pytest.raises(FrameError) as err:
        reassembler.feed("t", frame)
    assert err.value.reason == reason
    assert reassembler.pending == 0 and reassembler.buffered_bytes == 0


def test_single_frame_above_message_limit_is_rejected() -> None:
    reassembler = Reassembler(Limits(max_message_bytes=10))
    with pytest.raises(FrameError) as err:
        reassembler.feed("t", split(b"x" * 11)[0])
    assert err.value.reason == "too_large"


def test_chunk_disagreeing_with_earlier_chunks_is_rejected() -> None:
    digest = hashlib.sha256(b"abcdefgh").digest()
    reassembler = Reassembler()
    assert reassembler.feed("t", chunk_frame(digest=digest)) is None
    for liar in (
        chunk_frame(index=1, digest=b"x" * 32, data=b"efgh"),
        chunk_frame(index=1, count=3, total=12, digest=digest, data=b"efgh"),
    ):
        with pytest.raises(FrameError) as err:
            reassembler.feed("t", liar)
        assert err.value.reason == "inconsistent"
    assert reassembler.feed("t", chunk_frame(index=1, digest=digest, data=b"efgh")) == b"abcdefgh"


def test_split_accepts_buffers_and_rejects_bad_chunk_size() -> None:
    payload = bytearray(os.urandom(2500))
    assert feed_all(Reassembler(), split(memoryview(payload), 1000)) == [bytes(payload)]
    with pytest.raises(ValueError):
        split(b"x", 0)
