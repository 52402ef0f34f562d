"""Binary-mask encodings for sparse tensors, each picked when it is the smallest.

A mask says which elements of a flattened tensor are kept. Random masks cost close to their
entropy with a bitmap near density 1/2 and with Elias-Fano codes of the kept (sparse) or the
dropped (dense) positions elsewhere; structured masks (pruned channels, blocks) are cheapest as
Elias-Fano codes of the positions where the mask flips. Full and empty masks are a bare tag.

Wire form (msgpack): ``[kind]`` for FULL and EMPTY, ``[BITMAP, bits]`` and
``[kind, count, low, high]`` for the Elias-Fano kinds. Bit strings are little-endian
(``np.packbits(..., bitorder="little")``) with zero padding. An Elias-Fano code of ``count``
strictly increasing positions below ``size`` stores the ``l = floor(log2(size / count))`` low
bits of each position packed in ``low``, and the rest in unary in ``high``: the i-th position
sets bit ``(position >> l) + i``, so ``high`` is ``count + ((size - 1) >> l) + 1`` bits long.
``l`` is derived from ``count`` and ``size``, never sent, so it cannot be inconsistent.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import msgpack
import numpy as np

from protocol.errors import ProtocolError


class MaskKind(IntEnum):
    FULL = 1
    EMPTY = 2
    BITMAP = 3
    EF_KEPT = 4
    EF_DROPPED = 5
    EF_RUNS = 6


def bin_header(length: int) -> bytes:
    """msgpack bin header, so large blobs can be joined into a message without re-packing."""
    if length < 1 << 8:
        return b"\xc4" + length.to_bytes(1, "big")
    if length < 1 << 16:
        return b"\xc5" + length.to_bytes(2, "big")
    return b"\xc6" + length.to_bytes(4, "big")


def bitmap_size(size: int) -> int:
    return (size + 7) // 8


def _low_bits(count: int, size: int) -> int:
    return (size // count).bit_length() - 1


def _high_bits(count: int, size: int, low: int) -> int:
    return count + ((size - 1) >> low) + 1


def elias_fano_size(count: int, size: int) -> int:
    """Payload bytes of an Elias-Fano code of ``count`` (>= 1) positions below ``size``."""
    low = _low_bits(count, size)
    return (count * low + 7) // 8 + (_high_bits(count, size, low) + 7) // 8


@dataclass(frozen=True, slots=True, eq=False)
class EncodedMask:
    """A mask ready for the wire; ``indices`` are the kept positions when they were computed."""

    kind: MaskKind
    kept: int
    parts: tuple[bytes | np.ndarray, ...]
    indices: np.ndarray | None = None


def encode_mask(mask: np.ndarray) -> EncodedMask:
    """Encode a flat contiguous bool mask with whichever encoding is smallest.

    Sizes are computed from counts alone (kept, dropped, flips), so only the chosen encoding
    is built; counting flips works on the packed bitmap and costs ~n/8 byte operations.
    """
    size = mask.size
    kept = int(np.count_nonzero(mask))
    if kept == size:
        return EncodedMask(MaskKind.FULL, kept, (msgpack.packb([MaskKind.FULL]),))
    if kept == 0:
        return EncodedMask(MaskKind.EMPTY, kept, (msgpack.packb([MaskKind.EMPTY]),))
    packed = np.packbits(mask, bitorder="little")
    flips = _flips(packed, size)
    runs = int(np.bitwise_count(flips).sum())
    sizes = {
        MaskKind.BITMAP: packed.size,
        MaskKind.EF_KEPT: elias_fano_size(kept, size),
        MaskKind.EF_DROPPED: elias_fano_size(size - kept, size),
        MaskKind.EF_RUNS: elias_fano_size(runs, size),
    }
    kind = min(sizes, key=sizes.__getitem__)
    if kind == MaskKind.BITMAP:
        parts: tuple[bytes | np.ndarray, ...] = (
            b"\x92",
            msgpack.packb(kind),
            bin_header(packed.size),
            packed,
        )
        return EncodedMask(kind, kept, parts)
    if kind == MaskKind.EF_KEPT:
        positions = np.flatnonzero(mask)
    elif kind == MaskKind.EF_DROPPED:
        positions = np.flatnonzero(~mask)
    else:
        positions = np.flatnonzero(np.unpackbits(flips, count=size, bitorder="little"))
    low, high = _ef_encode(positions, size)
    parts = (
        b"\x94",
        msgpack.packb(kind),
        msgpack.packb(positions.size),
        bin_header(low.size),
        low,
        bin_header(high.size),
        high,
    )
    return EncodedMask(kind, kept, parts, positions if kind == MaskKind.EF_KEPT else None)


def _flips(packed: np.ndarray, size: int) -> np.ndarray:
    """Packed bits that are set where the mask differs from the bit before it (bit -1 is 0)."""
    carry = np.zeros_like(packed)
    carry[1:] = packed[:-1] >> 7
    flips = packed ^ (packed << 1) ^ carry
    if size % 8:
        flips[-1] &= (1 << (size % 8)) - 1
    return flips


def _ef_encode(positions: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    count = positions.size
    low = _low_bits(count, size)
    upper = np.zeros(_high_bits(count, size, low), dtype=bool)
    upper[(positions >> low) + np.arange(count)] = True
    high = np.packbits(upper, bitorder="little")
    bits = np.empty((count, low), dtype=np.uint8)
    for bit in range(low):  # a loop over bit columns beats unpacking each position's bytes
        bits[:, bit] = (positions >> bit) & 1
    return np.packbits(bits, bitorder="little"), high


@dataclass(frozen=True, slots=True, eq=False)
class MaskPlan:
    """A validated mask that has not been expanded yet: everything held is input-sized."""

    kind: MaskKind
    size: int
    kept: int
    bits: np.ndarray | None = None
    positions: np.ndarray | None = None

    def expand(self, out: np.ndarray | None = None) -> np.ndarray:
        """The flat bool mask (``size`` bytes), written into ``out`` when given (a flat bool
        array of ``size`` elements: the decoder's slice of one buffer for a message's masks)."""
        mask = np.empty(self.size, dtype=bool) if out is None else out
        if self.kind in (MaskKind.FULL, MaskKind.EMPTY):
            mask.fill(self.kind == MaskKind.FULL)
        elif self.kind == MaskKind.BITMAP:
            assert self.bits is not None  # decode_mask gives every bitmap its bits
            _unpack_into(self.bits, mask)
        else:
            assert self.positions is not None  # and every Elias-Fano kind its positions
            if self.kind == MaskKind.EF_RUNS:
                lengths = np.diff(self.positions, prepend=0, append=self.size)
                mask[...] = np.repeat(np.arange(lengths.size) % 2 == 1, lengths)
            else:
                dense = self.kind == MaskKind.EF_DROPPED
                mask.fill(dense)
                mask[self.positions] = not dense
        return mask


_UNPACK_SLICE = 1 << 17
"""Bits `_unpack_into` unpacks at a time (a multiple of 8)."""


def _unpack_into(bits: np.ndarray, out: np.ndarray) -> None:
    """``out[:] = unpackbits(bits)`` a slice at a time: each slice's unpacked bytes are a small
    buffer the allocator reuses, where the whole mask's would be a fresh ``size``-byte one
    whose pages fault in (and then a second copy into ``out``)."""
    for begin in range(0, out.size, _UNPACK_SLICE):
        end = min(begin + _UNPACK_SLICE, out.size)
        chunk = bits[begin // 8 : (end + 7) // 8]
        out[begin:end] = np.unpackbits(chunk, count=end - begin, bitorder="little").view(bool)


def decode_mask(obj: object, size: int) -> MaskPlan:
    """Validate an unpacked mask for a tensor of ``size`` elements, allocating only O(input)."""
    if type(obj) is not list or not obj or type(obj[0]) is not int:
        raise ProtocolError("mask must be an array starting with an integer kind")
    try:
        kind = MaskKind(obj[0])
    except ValueError:
        raise ProtocolError(f"unknown mask kind {obj[0]}") from None
    arity = {MaskKind.FULL: 1, MaskKind.EMPTY: 1, MaskKind.BITMAP: 2}.get(kind, 4)
    if len(obj) != arity:
        raise ProtocolError(f"mask kind {kind.name} takes {arity} fields, got {len(obj)}")
    if kind == MaskKind.FULL:
        return MaskPlan(kind, size, size)
    if kind == MaskKind.EMPTY:
        return MaskPlan(kind, size, 0)
    if kind == MaskKind.BITMAP:
        bits = _bits(obj[1], bitmap_size(size), size, "bitmap")
        return MaskPlan(kind, size, int(np.bitwise_count(bits).sum()), bits=bits)
    count, low, high = obj[1], obj[2], obj[3]
    if type(count) is not int or not 1 <= count <= size:
        shown = count if type(count) is int else type(count).__name__
        raise ProtocolError(f"Elias-Fano count {shown} not in [1, {size}]")
    positions = _ef_decode(count, size, low, high)
    if kind == MaskKind.EF_KEPT:
        kept = count
    elif kind == MaskKind.EF_DROPPED:
        kept = size - count
    else:
        ends = positions[1::2].sum(dtype=np.int64) + (size if count % 2 else 0)
        kept = int(ends - positions[0::2].sum(dtype=np.int64))
    return MaskPlan(kind, size, kept, positions=positions)


def _bits(blob: object, length: int, nbits: int, what: str) -> np.ndarray:
    if type(blob) is not bytes or len(blob) != length:
        got = len(blob) if type(blob) is bytes else type(blob).__name__
        raise ProtocolError(f"{what} must be {length} bytes, got {got}")
    bits = np.frombuffer(blob, dtype=np.uint8)
    if nbits % 8 and bits[-1] >> (nbits % 8):
        raise ProtocolError(f"{what} padding bits are not zero")
    return bits


def _ef_decode(count: int, size: int, low_blob: object, high_blob: object) -> np.ndarray:
    low = _low_bits(count, size)
    nhigh = _high_bits(count, size, low)
    high = _bits(high_blob, (nhigh + 7) // 8, nhigh, "Elias-Fano high bits")
    lows = _bits(low_blob, (count * low + 7) // 8, count * low, "Elias-Fano low bits")
    if int(np.bitwise_count(high).sum()) != count:
        raise ProtocolError("Elias-Fano high bits do not hold exactly count ones")
    upper = np.flatnonzero(np.unpackbits(high, count=nhigh, bitorder="little"))
    positions = (upper - np.arange(count)) << low
    bits = np.unpackbits(lows, count=count * low, bitorder="little").reshape(count, low)
    for bit in range(low):
        positions |= bits[:, bit].astype(np.int64) << bit
    if positions[-1] >= size or not (positions[1:] > positions[:-1]).all():
        raise ProtocolError("Elias-Fano positions are not strictly increasing below the size")
    return positions


def pack_mask(mask: np.ndarray) -> bytes:
    """A flat bool mask as one msgpack value (`encode_mask`'s smallest encoding), for a
    message field of its own (`protocol.messages.Support`)."""
    parts = encode_mask(np.ascontiguousarray(mask, dtype=bool)).parts
    return b"".join(bytes(p) if isinstance(p, bytes) else p.tobytes() for p in parts)


def unpack_mask(data: bytes, size: int) -> np.ndarray:
    """A `pack_mask` value back to a flat bool mask of `size` entries; ProtocolError if it
    is not one (checked before the mask is allocated)."""
    try:
        obj = msgpack.unpackb(
            data, raw=False, use_list=True, max_str_len=0, max_bin_len=len(data),
            max_array_len=4, max_map_len=0, max_ext_len=0,
        )  # fmt: skip
    except Exception as exc:  # msgpack raises many types; all mean the same to a receiver
        raise ProtocolError(f"invalid mask: {type(exc).__name__}: {exc}") from None
    return decode_mask(obj, size).expand()
