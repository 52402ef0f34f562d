"""The model codec: an ordered set of named, optionally masked tensors as one msgpack message.

Wire form: ``[FORMAT, [record, ...]]`` with one record per tensor,
``[name, dtype, shape, mask, fp16, values]``: ``dtype`` a numpy dtype name, ``shape`` a list of
ints, ``mask`` nil (no mask sent) or a :mod:`protocol.masks` encoding, ``fp16`` true when float
values travel as float16, and ``values`` a bin of the kept values only, little-endian, in
flat C order. Blobs are msgpack bin, so a large model costs a handful of memcpys, not
per-element msgpack work.

The decoder checks every declared size against :class:`Limits` and against the others before
it builds any output: what it allocates ahead of validation is proportional to the input.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import msgpack
import numpy as np

from protocol.errors import ProtocolError
from protocol.limits import DEFAULT_LIMITS, Limits
from protocol.masks import EncodedMask, MaskKind, MaskPlan, bin_header, decode_mask, encode_mask

FORMAT = 1
DTYPES = frozenset(
    ["bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64"]
    + ["float16", "float32", "float64"]
)
_PACKED_DTYPES = {name: msgpack.packb(name) for name in DTYPES}
_FP16 = np.dtype("<f2")
# Boolean indexing beats flatnonzero+take only for nearly full masks (branch prediction).
_DENSE = 0.92
_SCATTER_SLICE = 1 << 17
"""Elements a decode scatters at a time (`_scatter`)."""


@dataclass(frozen=True, slots=True, eq=False)
class DecodedTensor:
    """A received tensor: dense ``values`` (zero where masked out) and the mask if one was sent."""

    values: np.ndarray
    mask: np.ndarray | None


def lower_bound_bytes(size: int, kept: int, value_bytes: int = 4) -> float:
    """Bytes any lossless code needs for ``kept`` raw values among ``size`` positions.

    That is the values themselves plus log2(binomial(size, kept)) bits to say which they are.
    """
    log2_choices = (
        math.lgamma(size + 1) - math.lgamma(kept + 1) - math.lgamma(size - kept + 1)
    ) / math.log(2)
    return kept * value_bytes + log2_choices / 8


def encode_tensors(
    tensors: Mapping[str, np.ndarray],
    masks: Mapping[str, np.ndarray] | None = None,
    *,
    fp16: bool = False,
) -> bytes:
    """Encode ``tensors`` in order; ``masks[name]`` (bool, same shape) selects kept values.

    ``fp16`` sends float32/float64 values as float16 (halving them); other dtypes are unchanged.
    Raises ValueError for unnamed tensors, unsupported dtypes, masks that are not bool arrays of
    the tensor's shape or name no tensor, and finite values that overflow float16.
    """
    masks = masks or {}
    unknown = set(masks) - set(tensors)
    if unknown:
        raise ValueError(f"masks for unknown tensors: {sorted(unknown)}")
    parts: list[bytes | np.ndarray] = [b"\x92", msgpack.packb(FORMAT), _array_header(len(tensors))]
    for name, array in tensors.items():
        parts += _encode_tensor(name, np.asarray(array), masks.get(name), fp16)
    # Arrays join through their buffer (`.data`): the same bytes, without a copy.
    return b"".join(part if isinstance(part, bytes) else part.data for part in parts)


def _array_header(length: int) -> bytes:
    if length < 16:
        return bytes([0x90 | length])
    if length < 1 << 16:
        return b"\xdc" + length.to_bytes(2, "big")
    return b"\xdd" + length.to_bytes(4, "big")


def _encode_tensor(
    name: str, array: np.ndarray, mask: np.ndarray | None, fp16: bool
) -> list[bytes | np.ndarray]:
    if not isinstance(name, str) or not name:
        raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
    dtype_name = array.dtype.name  # a slow property (numpy builds the string each time)
    if dtype_name not in DTYPES:
        raise ValueError(f"tensor {name!r}: unsupported dtype {array.dtype}")
    flat = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).reshape(-1)
    if mask is None:
        mask_parts: tuple[bytes | np.ndarray, ...] = (b"\xc0",)
        values = flat
    else:
        mask = np.asarray(mask)
        if mask.dtype != np.bool_ or mask.shape != array.shape:
            raise ValueError(
                f"tensor {name!r}: mask must be bool of shape {array.shape}, "
                f"got {mask.dtype} {mask.shape}"
            )
        flat_mask = np.ascontiguousarray(mask).reshape(-1)
        encoded = encode_mask(flat_mask)
        mask_parts = encoded.parts
        values = _gather(flat, flat_mask, encoded)
    half = fp16 and array.dtype.kind == "f" and array.dtype.itemsize > 2
    if half:
        values = _to_fp16(name, values)
    return [
        b"\x96",
        msgpack.packb(name),
        _PACKED_DTYPES[dtype_name],
        msgpack.packb(array.shape),
        *mask_parts,
        b"\xc3" if half else b"\xc2",
        bin_header(values.nbytes),
        values,
    ]


def _gather(flat: np.ndarray, mask: np.ndarray, encoded: EncodedMask) -> np.ndarray:
    if encoded.kind == MaskKind.FULL:
        return flat
    if encoded.indices is not None:
        return flat.take(encoded.indices)
    if encoded.kept >= _DENSE * flat.size:
        return flat[mask]
    return np.compress(mask, flat)


def _to_fp16(name: str, values: np.ndarray) -> np.ndarray:
    half = values.astype(_FP16)
    overflow = ~np.isfinite(half)
    if overflow.any() and np.isfinite(values[overflow]).any():
        raise ValueError(f"tensor {name!r}: finite values overflow float16")
    return half


@dataclass(frozen=True, slots=True, eq=False)
class _Plan:
    """A validated record; ``values`` is a zero-copy view of the received kept values."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    mask: MaskPlan | None
    values: np.ndarray


def decode_tensors(
    data: bytes | memoryview,
    *,
    limits: Limits = DEFAULT_LIMITS,
    expected: Mapping[str, tuple[tuple[int, ...], str]] | None = None,
    require_finite: bool = False,
    partial: bool = False,
) -> dict[str, DecodedTensor]:
    """Decode a message from :func:`encode_tensors`, in the order it was encoded.

    ``expected`` maps every name the message must hold (no more, no fewer, any order; with
    ``partial``, any of them but at least one) to its ``(shape, dtype)``. ``require_finite``
    rejects NaN and infinite values. Any malformed, oversized or unexpected input raises
    :class:`ProtocolError`; all records are validated before any dense output is allocated.
    """
    records = _unpack(data, limits)
    plans: list[_Plan] = []
    names: set[str] = set()
    total = 0
    for index, record in enumerate(records):
        try:
            plan = _parse(record, limits, expected, require_finite)
        except ProtocolError as exc:
            name = record[0] if type(record) is list and record and type(record[0]) is str else ""
            raise ProtocolError(f"tensor {index} {_brief(name)}: {exc}") from None
        if plan.name in names:
            raise ProtocolError(f"duplicate tensor name {plan.name!r}")
        names.add(plan.name)
        total += math.prod(plan.shape)
        if total > limits.max_total_elements:
            raise ProtocolError(f"more than {limits.max_total_elements} elements in total")
        plans.append(plan)
    if expected is not None and partial and not names:
        raise ProtocolError("no tensors: a partial message holds at least one expected tensor")
    if expected is not None and not partial and names != set(expected):
        missing = sorted(set(expected) - names)[:8]
        raise ProtocolError(f"missing expected tensors {missing}")
    try:
        return _build(plans)
    except MemoryError:  # within limits, but more than this device has
        raise ProtocolError("not enough memory for the declared tensors") from None


def _unpack(data: bytes | memoryview, limits: Limits) -> list:
    try:
        view = memoryview(data).cast("B")
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"tensor message must be contiguous bytes: {exc}") from None
    if view.nbytes > limits.max_message_bytes:
        raise ProtocolError(f"message of {view.nbytes} bytes exceeds {limits.max_message_bytes}")
    try:
        message = msgpack.unpackb(
            view,
            raw=False,
            use_list=True,
            max_str_len=4 * limits.max_name_length,
            max_bin_len=view.nbytes,
            max_array_len=max(limits.max_tensors, limits.max_ndim, 6),
            max_map_len=0,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises many types; all mean the same to a receiver
        raise ProtocolError(f"invalid msgpack: {type(exc).__name__}: {exc}") from None
    if type(message) is not list or len(message) != 2 or type(message[1]) is not list:
        raise ProtocolError("tensor message must be [format, [records]]")
    if type(message[0]) is not int or message[0] != FORMAT:
        raise ProtocolError(f"unsupported tensor format {_brief(message[0])}")
    if len(message[1]) > limits.max_tensors:
        raise ProtocolError(f"{len(message[1])} tensors exceed the limit {limits.max_tensors}")
    return message[1]


def _brief(value: object) -> str:
    """Untrusted values in error messages, cut short so logs stay readable."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _parse(
    record: object,
    limits: Limits,
    expected: Mapping[str, tuple[tuple[int, ...], str]] | None,
    require_finite: bool,
) -> _Plan:
    if type(record) is not list or len(record) != 6:
        raise ProtocolError("record must be [name, dtype, shape, mask, fp16, values]")
    name, dtype_name, shape, mask, half, payload = record
    if type(name) is not str or not 1 <= len(name) <= limits.max_name_length:
        raise ProtocolError(f"name must be a string of 1 to {limits.max_name_length} chars")
    if type(dtype_name) is not str or dtype_name not in DTYPES:
        raise ProtocolError(f"unsupported dtype {_brief(dtype_name)}")
    dtype = np.dtype(dtype_name)
    if type(shape) is not list or len(shape) > limits.max_ndim:
        raise ProtocolError(f"shape must be a list of at most {limits.max_ndim} dims")
    if any(type(dim) is not int or dim < 0 for dim in shape):
        raise ProtocolError(f"shape {_brief(shape)} must hold non-negative integers")
    shape = tuple(shape)
    size = math.prod(shape)
    # Zero-size tensors count their other dims too: numpy cannot even describe (0, 2**62).
    if math.prod(dim for dim in shape if dim) > limits.max_tensor_elements:
        raise ProtocolError(f"shape {list(shape)} exceeds {limits.max_tensor_elements} elements")
    if expected is not None:
        if name not in expected:
            raise ProtocolError("not an expected tensor")
        want_shape, want_dtype = expected[name]
        if shape != tuple(want_shape) or dtype != np.dtype(want_dtype):
            raise ProtocolError(
                f"got {dtype_name}{list(shape)}, expected {np.dtype(want_dtype)}{list(want_shape)}"
            )
    plan = None if mask is None else decode_mask(mask, size)
    kept = size if plan is None else plan.kept
    if type(half) is not bool or (half and dtype.kind != "f"):
        raise ProtocolError("fp16 flag must be a bool, true only for float dtypes")
    wire = _FP16 if half else dtype.newbyteorder("<")
    if type(payload) is not bytes or len(payload) != kept * wire.itemsize:
        got = len(payload) if type(payload) is bytes else type(payload).__name__
        raise ProtocolError(f"values must be {kept} x {wire.itemsize} bytes, got {got}")
    values = np.frombuffer(payload, dtype=wire)
    if dtype.kind == "b" and values.size and values.view(np.uint8).max() > 1:
        raise ProtocolError("bool values must be 0 or 1")
    if require_finite and dtype.kind == "f" and not np.isfinite(values).all():
        raise ProtocolError("values are not all finite")
    return _Plan(name, dtype, shape, plan, values)


def _build(plans: list[_Plan]) -> dict[str, DecodedTensor]:
    """Every tensor's dense values as a slice of one zeroed buffer per dtype, and every sent
    mask as a slice of one bool buffer: a message's output is a few large allocations, not
    two per tensor. Per-tensor arrays came from the heap top, which glibc hands back to the
    kernel once a decoded model is freed, so the next decode faulted every page in again
    (about half its CPU); a large buffer is numpy's own (huge-page backed where the kernel
    allows) and faults in a few pages. A tensor the caller keeps keeps its whole buffer."""
    sizes = [math.prod(plan.shape) for plan in plans]
    totals: dict[np.dtype, int] = {}
    for plan, size in zip(plans, sizes, strict=True):
        totals[plan.dtype] = totals.get(plan.dtype, 0) + size
    buffers = {dtype: np.zeros(total, dtype=dtype) for dtype, total in totals.items()}
    sent = sum(size for plan, size in zip(plans, sizes, strict=True) if plan.mask is not None)
    mask_buffer = np.empty(sent, dtype=bool)  # every mask writes all of its slice
    offsets = dict.fromkeys(totals, 0)
    mask_offset = 0
    decoded = {}
    for plan, size in zip(plans, sizes, strict=True):
        start = offsets[plan.dtype]
        offsets[plan.dtype] = start + size
        dense = buffers[plan.dtype][start : start + size]
        mask = None
        if plan.mask is not None:
            mask = mask_buffer[mask_offset : mask_offset + size]
            mask_offset += size
        _fill(plan, dense, mask)
        shaped = None if mask is None else mask.reshape(plan.shape)
        decoded[plan.name] = DecodedTensor(dense.reshape(plan.shape), shaped)
    return decoded


def _fill(plan: _Plan, dense: np.ndarray, mask: np.ndarray | None) -> None:
    """Write one tensor's dense values (flat, zeroed) and its mask (flat, any content) from
    its received record."""
    mask_plan, values = plan.mask, plan.values
    if mask_plan is None or mask_plan.kind == MaskKind.FULL:
        dense[...] = values
        if mask is not None:
            mask.fill(True)
        return
    assert mask is not None  # a sent mask always has its slice
    if mask_plan.kind == MaskKind.EF_KEPT:
        dense[mask_plan.positions] = values
        mask.fill(False)
        mask[mask_plan.positions] = True
    elif mask_plan.kind == MaskKind.BITMAP and mask_plan.kept < _DENSE * mask_plan.size:
        assert mask_plan.bits is not None  # decode_mask gives every bitmap its bits
        _unpack_scatter(mask_plan.bits, mask, dense, values)
    else:
        mask_plan.expand(out=mask)
        if mask_plan.kept >= _DENSE * mask_plan.size:
            dense[mask] = values
        elif mask_plan.kept:
            _scatter(dense, mask, values)


def _scatter(dense: np.ndarray, mask: np.ndarray, values: np.ndarray) -> None:
    """``dense[mask] = values`` for a mask neither nearly full nor nearly empty, a slice at a
    time: each slice's kept positions (int64, 8 bytes an entry) stay in the cache and reuse
    one small buffer, where the whole tensor's would be a fresh allocation larger than the
    output, and faulting its pages in cost more than the scatter itself."""
    start = 0
    for begin in range(0, mask.size, _SCATTER_SLICE):
        end = begin + _SCATTER_SLICE
        positions = mask[begin:end].nonzero()[0]
        dense[begin:end][positions] = values[start : start + positions.size]
        start += positions.size


def _unpack_scatter(
    bits: np.ndarray, mask: np.ndarray, dense: np.ndarray, values: np.ndarray
) -> None:
    """A bitmap's mask and values in one pass, a slice at a time (`_scatter`'s reasons): each
    slice is unpacked into ``mask`` and scattered into ``dense`` while it is in the cache,
    where unpacking the whole mask and then scattering read it back from memory."""
    start = 0
    for begin in range(0, mask.size, _SCATTER_SLICE):
        end = min(begin + _SCATTER_SLICE, mask.size)
        unpacked = np.unpackbits(
            bits[begin // 8 : (end + 7) // 8], count=end - begin, bitorder="little"
        ).view(bool)
        mask[begin:end] = unpacked
        positions = unpacked.nonzero()[0]
        dense[begin:end][positions] = values[start : start + positions.size]
        start += positions.size
