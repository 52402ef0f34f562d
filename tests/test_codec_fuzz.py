"""Deterministic fuzzing of decode_tensors: only ProtocolError, and bounded memory.

Seeded plain ``random`` (not hypothesis) keeps the run fast and reproducible. Memory is
measured with tracemalloc, which numpy reports its buffers to: under tight limits the decoder
may allocate a small multiple of its input plus what the limits allow, never more.
"""

from __future__ import annotations

import random
import tracemalloc
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest

from protocol import (
    DEFAULT_LIMITS,
    DecodedTensor,
    Limits,
    ProtocolError,
    decode_tensors,
    encode_tensors,
)

SEED = 0x5EED
CASES = 12_000
LIMITS = Limits(
    max_message_bytes=1 << 20,
    max_tensors=64,
    max_tensor_elements=1 << 14,
    max_total_elements=1 << 15,
    max_ndim=6,
    max_name_length=32,
)
# Dense outputs (8-byte values + mask) for every allowed element, plus slack for temporaries.
LIMIT_BYTES = 4 * 9 * LIMITS.max_total_elements + (256 << 10)
EVIL = [
    None, True, False, 0, 1, -1, 3, 6, 7, 255, 2**31, 2**32 - 1, 2**40, 2**63 - 1, -(2**63),
    2**64 - 1, 1.5, float("nan"), "", "x" * 300, "float32", "complex64", "object", b"",
    b"\x00" * 7, b"\xff" * 9, [], [None], [2**40], [2**20, 2**20, 2**20], [0, 2**62],
    [0, 2**40, 2**40], [-1, 5], [[1]],
    [1.0, 2], [1] * 9, {}, {"a": 1}, {1: [2]}, msgpack.ExtType(1, b"x"), [1], [2], [3, b"\xff"],
    [4, 2**40, b"", b""], [5, 1, b"", b"\x01"], [6, 3, b"\x00", b"\x07"], [9],
]  # fmt: skip


def corpus() -> list[tuple[bytes, dict]]:
    """Small valid messages using every mask kind, dtype and the fp16 option."""
    rng = np.random.default_rng(SEED)
    blocks = np.zeros((6, 20), dtype=bool)
    blocks[1:3] = True
    masks = {
        "full": np.ones((4, 5), bool),
        "empty": np.zeros((3, 3), bool),
        "bitmap": rng.random((7, 9)) < 0.5,
        "kept": rng.random(300) < 0.02,
        "dropped": rng.random(300) < 0.98,
        "runs": blocks,
    }
    messages = []
    for fp16 in (False, True):
        tensors = {
            name: rng.standard_normal(mask.shape).astype(np.float32) for name, mask in masks.items()
        }
        tensors |= {"scalar": np.float64(2.5), "nothing": np.zeros((0, 4), np.float32)}
        messages.append((encode_tensors(tensors, masks, fp16=fp16), tensors))
    mixed = {
        dtype: (rng.random(12) * 100).astype(dtype).reshape(3, 4)
        for dtype in ("bool", "uint8", "int8", "uint16", "int32", "uint64", "int64", "float16")
    }
    mixed_masks = {dtype: rng.random((3, 4)) < 0.3 for dtype in list(mixed)[::2]}
    messages.append((encode_tensors(mixed, mixed_masks), mixed))
    one = {"w": rng.standard_normal(40).astype(np.float32)}
    messages.append((encode_tensors(one, {"w": rng.random(40) < 0.1}), one))
    messages.append((encode_tensors({}), {}))
    return messages


def _paths(obj: object, path: tuple[int, ...] = ()) -> list[tuple[int, ...]]:
    found = [path]
    if isinstance(obj, list):
        for index, item in enumerate(obj):
            found += _paths(item, (*path, index))
    return found


def mutate_structure(rnd: random.Random, data: bytes) -> bytes:
    """Replace, drop, duplicate or nudge one node of the unpacked message and repack it."""
    root = [msgpack.unpackb(data, raw=False, strict_map_key=False)]
    path = (0, *rnd.choice(_paths(root[0])))
    parent = root
    for index in path[:-1]:
        parent = parent[index]
    key, node = path[-1], parent[path[-1]]
    action = rnd.randrange(5)
    if action == 0 or (action == 1 and len(parent) < 2):
        parent[key] = rnd.choice(EVIL)
    elif action == 1:
        del parent[key]
    elif action == 2:
        parent.insert(key, rnd.choice([node, *EVIL]))
    elif action == 3 and type(node) is int:
        nudged = rnd.choice([node + 1, node - 1, node * 2, -node, node + 2**32, node << 30])
        parent[key] = max(-(2**63), min(nudged, 2**64 - 1))  # what msgpack can carry
    elif action == 3 and type(node) is bytes and node and rnd.random() < 0.7:
        flipped = bytearray(node)
        flipped[rnd.randrange(len(node))] ^= 1 << rnd.randrange(8)
        parent[key] = bytes(flipped)
    elif action == 3 and type(node) is bytes:
        parent[key] = node[: rnd.randrange(len(node) + 1)] + rnd.randbytes(rnd.randrange(3))
    else:
        parent[key] = [node] if rnd.random() < 0.8 else {"k": node}
    return msgpack.packb(root[0], use_bin_type=True)


def mutate_mask(rnd: random.Random, data: bytes) -> bytes:
    """Flip a bit in, or nudge the count of, an encoded mask: the deepest checks."""
    message = msgpack.unpackb(data, raw=False)
    masks = [record[3] for record in message[1] if record[3] and len(record[3]) > 1]
    if not masks:
        return data
    mask = rnd.choice(masks)
    field = rnd.randrange(1, len(mask))
    if type(mask[field]) is int:
        mask[field] += rnd.choice([-1, 1])
    elif mask[field]:
        flipped = bytearray(mask[field])
        flipped[rnd.randrange(len(flipped))] ^= 1 << rnd.randrange(8)
        mask[field] = bytes(flipped)
    return msgpack.packb(message, use_bin_type=True)


def random_structure(rnd: random.Random, depth: int = 0) -> object:
    if depth > 3 or rnd.random() < 0.4:
        return rnd.choice(EVIL)
    return [random_structure(rnd, depth + 1) for _ in range(rnd.randrange(8))]


def random_record(rnd: random.Random) -> list:
    shape = [rnd.choice([0, 1, 2, 5, 2**14, 2**40, 2**62, -1]) for _ in range(rnd.randrange(4))]
    values = rnd.randbytes(rnd.choice([0, 1, 4, 8, 20, 64]))
    mask = rnd.choice([None, *EVIL[-9:], [3, rnd.randbytes(rnd.randrange(4))]])
    dtype = rnd.choice(["float32", "float16", "bool", "int64", "float128", 7])
    return [rnd.choice(["w", "", "x" * 40, b"w"]), dtype, shape, mask, rnd.random() < 0.2, values]


def byte_mutations(rnd: random.Random, data: bytes, other: bytes) -> bytes:
    buf = bytearray(data)
    choice = rnd.randrange(7)
    if choice == 0 and buf:
        for _ in range(rnd.randint(1, 4)):
            buf[rnd.randrange(len(buf))] ^= 1 << rnd.randrange(8)
    elif choice == 1 and buf:
        for _ in range(rnd.randint(1, 3)):
            buf[rnd.randrange(len(buf))] = rnd.choice([0, 0xFF, 0x7F, 0x80, 0xC0, 0xC6, 0xDD, 0xCF])
    elif choice == 2:
        del buf[rnd.randrange(len(buf) + 1) :]
    elif choice == 3:
        buf += rnd.randbytes(rnd.randint(1, 64))
    elif choice == 4 and buf:
        start = rnd.randrange(len(buf))
        del buf[start : start + rnd.randint(1, 16)]
    elif choice == 5:
        buf = buf[: rnd.randrange(len(buf) + 1)] + other[rnd.randrange(len(other) + 1) :]
    else:
        at = rnd.randrange(len(buf) + 1)
        buf[at:at] = rnd.randbytes(rnd.randint(1, 8))
    return bytes(buf)


def generate(rnd: random.Random, messages: list[tuple[bytes, dict]]) -> tuple[str, bytes]:
    data = rnd.choice(messages)[0]
    kind = rnd.choices(["bytes", "structure", "mask", "random", "records"], [40, 35, 10, 5, 10])[0]
    if kind == "bytes":
        return kind, byte_mutations(rnd, data, rnd.choice(messages)[0])
    if kind == "structure":
        for _ in range(rnd.randint(1, 3)):
            data = mutate_structure(rnd, data)
        return kind, data
    if kind == "mask":
        return kind, mutate_mask(rnd, data)
    if kind == "random":
        return kind, msgpack.packb(random_structure(rnd), use_bin_type=True)
    records = [random_record(rnd) for _ in range(rnd.randrange(1, 4))]
    return kind, msgpack.packb([1, records], use_bin_type=True)


def decode_within_memory(data: bytes, limits: Limits, budget: int, **options) -> str:
    """Decode; 'ok' or 'rejected'. Fails the test on other errors or on excess memory."""
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    try:
        decoded = decode_tensors(data, limits=limits, **options)
        outcome = "ok"
    except ProtocolError:
        decoded, outcome = {}, "rejected"
    peak = tracemalloc.get_traced_memory()[1] - before
    assert peak <= budget, f"decoder peaked at {peak} bytes for a {len(data)}-byte input"
    for tensor in decoded.values():
        assert isinstance(tensor, DecodedTensor) and isinstance(tensor.values, np.ndarray)
    return outcome


@pytest.fixture
def traced() -> Iterator[None]:
    tracemalloc.start()
    yield
    tracemalloc.stop()


def test_fuzzed_payloads_raise_only_protocol_error(traced):
    rnd = random.Random(SEED)
    messages = corpus()
    for data, _ in messages:
        assert decode_within_memory(data, LIMITS, LIMIT_BYTES) == "ok"
    outcomes = {"ok": 0, "rejected": 0}
    for case in range(CASES):
        kind, data = generate(rnd, messages)
        options = {}
        if rnd.random() < 0.2:
            options["require_finite"] = True
        if rnd.random() < 0.1:
            tensors = rnd.choice(messages)[1]
            options["expected"] = {name: (a.shape, a.dtype.name) for name, a in tensors.items()}
        try:
            outcome = decode_within_memory(data, LIMITS, 8 * len(data) + LIMIT_BYTES, **options)
        except AssertionError:
            raise
        except Exception as exc:  # anything but ProtocolError is a bug
            pytest.fail(f"case {case} ({kind}) raised {exc!r} for {data[:120].hex()}")
        outcomes[outcome] += 1
    assert outcomes["ok"] > CASES // 20 and outcomes["rejected"] > CASES // 2, outcomes


def _record(shape: list, mask: object, values: bytes = b"", dtype: str = "float64") -> bytes:
    return msgpack.packb([1, [["w", dtype, shape, mask, False, values]]], use_bin_type=True)


HOSTILE = {
    "2^40 elements": _record([2**40], [2]),
    "2^40 as a product": _record([2**20, 2**20], None),
    "2^64 dim": _record([2**64 - 1], [2]),
    "zero-size with 2^62 dims": _record([0, 2**62, 2**62], [2]),
    "negative dim": _record([-(2**40), -(2**40)], [2]),
    "limit-sized bitmap, no bits": _record([DEFAULT_LIMITS.max_tensor_elements], [3, b""]),
    "EF count 2^40": _record([1000], [4, 2**40, b"", b""]),
    "EF count beyond size": _record([1000], [4, 1001, b"", b"\xff" * 250]),
    "values for 2^28 elements missing": _record([2**28], None, b"\x00" * 8),
    "array header 2^32-1": b"\x92\x01\xdd\xff\xff\xff\xff",
    "bin header 4 GiB": b"\x92\x01\x91\x96\xa1w\xa7float64\x91\x01\xc0\xc2\xc6\xff\xff\xff\xff",
    "str header 4 GiB": b"\x92\x01\x91\x96\xdb\xff\xff\xff\xff",
    "deep nesting": b"\x91" * 100_000 + b"\xc0",
    "map": msgpack.packb({"tensors": []}),
    "ext": msgpack.packb(msgpack.ExtType(5, b"\x00" * 16)),
    "not bytes": "a string",
    "many tensors": msgpack.packb([1, [None] * (DEFAULT_LIMITS.max_tensors + 1)]),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_declarations_are_rejected_without_allocating(traced, name):
    data = HOSTILE[name]
    budget = 8 * len(data) + (64 << 10)
    assert decode_within_memory(data, DEFAULT_LIMITS, budget) == "rejected"
