"""Round trips, mask-encoding choice, shape pinning and finiteness of the tensor codec."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from protocol import (
    DTYPES,
    Limits,
    MaskKind,
    ProtocolError,
    bitmap_size,
    decode_mask,
    decode_tensors,
    elias_fano_size,
    encode_mask,
    encode_tensors,
    lower_bound_bytes,
)

FLOATS = ("float16", "float32", "float64")


@st.composite
def masks_for(draw: st.DrawFn, shape: tuple[int, ...]) -> np.ndarray:
    """Random masks of any density, and run-structured ones (pruned blocks)."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    size = math.prod(shape)
    if draw(st.booleans()):
        density = draw(st.sampled_from([0.0, 1.0]) | st.floats(0.0, 1.0))
        return rng.random(shape) < density
    flips = rng.random(size) < draw(st.floats(0.0, 0.2))
    return (np.cumsum(flips) % 2 == 1).reshape(shape)


@st.composite
def models(draw: st.DrawFn) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    tensors: dict[str, np.ndarray] = {}
    masks: dict[str, np.ndarray] = {}
    names = draw(st.lists(st.text(min_size=1, max_size=12), min_size=0, max_size=5, unique=True))
    for name in names:
        dtype = np.dtype(draw(st.sampled_from(sorted(DTYPES))))
        shape = draw(hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=7))
        elements = st.floats(-6e4, 6e4, width=32) if dtype.kind == "f" else None
        tensors[name] = draw(hnp.arrays(dtype, shape, elements=elements))
        if draw(st.booleans()):
            masks[name] = draw(masks_for(shape))
    return tensors, masks


def _expected(array: np.ndarray, mask: np.ndarray | None, fp16: bool) -> np.ndarray:
    if fp16 and array.dtype.kind == "f":
        array = array.astype(np.float16).astype(array.dtype)
    return array if mask is None else np.where(mask, array, np.zeros((), array.dtype))


@settings(max_examples=300, deadline=None)
@given(models(), st.booleans())
def test_round_trip_is_exact(model, fp16):
    tensors, masks = model
    decoded = decode_tensors(encode_tensors(tensors, masks, fp16=fp16))
    assert list(decoded) == list(tensors)
    for name, array in tensors.items():
        got, mask = decoded[name], masks.get(name)
        want = _expected(array, mask, fp16)
        assert got.values.dtype == array.dtype and got.values.shape == array.shape
        assert got.values.tobytes() == want.tobytes()  # bit-exact, signed zeros and NaNs too
        assert got.values.flags.writeable
        if mask is None:
            assert got.mask is None
        else:
            assert got.mask.dtype == np.bool_ and np.array_equal(got.mask, mask)


def test_large_tensors_of_every_mask_kind_decode_exactly_and_independently():
    """The decoder writes every tensor of a message into shared buffers, a bitmap a slice at
    a time: tensors past a slice (sizes not a multiple of 8) decode exactly, and each
    decoded tensor is the caller's own (writing to one changes no other)."""
    rng = np.random.default_rng(5)
    size = 300_001  # more than two of the decoder's slices, a partial byte at the end
    runs = np.cumsum(rng.random(size) < 0.001) % 2 == 1
    masks = {
        "bitmap": rng.random(size) < 0.5,
        "kept": rng.random(size) < 0.02,
        "dropped": rng.random(size) < 0.98,
        "runs": runs,
        "full": np.ones(size, dtype=bool),
        "empty": np.zeros(size, dtype=bool),
    }
    tensors = {name: rng.standard_normal(size).astype(np.float32) for name in masks}
    tensors |= {"ints": rng.integers(-9, 9, size=(7, 3)), "dense": np.arange(5.0)}
    decoded = decode_tensors(encode_tensors(tensors, masks))
    kinds = {encode_mask(mask).kind.name for mask in masks.values()}
    assert kinds == {"BITMAP", "EF_KEPT", "EF_DROPPED", "EF_RUNS", "FULL", "EMPTY"}
    for name, array in tensors.items():
        want = _expected(array, masks.get(name), False)
        assert decoded[name].values.tobytes() == want.tobytes(), name
        if name in masks:
            assert np.array_equal(decoded[name].mask, masks[name]), name
    before = {
        name: (t.values.copy(), None if t.mask is None else t.mask.copy())
        for name, t in decoded.items()
    }
    first = decoded["bitmap"]
    first.values[...] = 7
    first.mask[...] = False
    del before["bitmap"]
    for name, (values, mask) in before.items():
        assert np.array_equal(decoded[name].values, values), name
        assert mask is None or np.array_equal(decoded[name].mask, mask), name


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 3000).flatmap(lambda size: masks_for((size,))))
def test_mask_encoding_round_trips_and_is_smallest(mask):
    encoded = encode_mask(mask)
    plan = decode_mask(msgpack.unpackb(b"".join(encoded.parts)), mask.size)
    assert plan.kind == encoded.kind and plan.kept == encoded.kept == mask.sum()
    assert np.array_equal(plan.expand(), mask)
    if encoded.kind in (MaskKind.FULL, MaskKind.EMPTY):
        return
    kept, size = int(mask.sum()), mask.size
    runs = int(np.count_nonzero(np.diff(mask, prepend=False)))
    candidates = [bitmap_size(size), elias_fano_size(kept, size)]
    candidates += [elias_fano_size(size - kept, size), elias_fano_size(runs, size)]
    payload = sum(part.nbytes for part in encoded.parts if isinstance(part, np.ndarray))
    assert payload == min(candidates)


@pytest.mark.parametrize(
    ("density", "kind"),
    [
        (0.0, MaskKind.EMPTY),
        (0.001, MaskKind.EF_KEPT),
        (0.01, MaskKind.EF_KEPT),
        (0.1, MaskKind.EF_KEPT),
        (0.5, MaskKind.BITMAP),
        (0.7, MaskKind.BITMAP),
        (0.9, MaskKind.EF_DROPPED),
        (0.999, MaskKind.EF_DROPPED),
        (1.0, MaskKind.FULL),
    ],
)
def test_picks_encoding_by_density(density, kind):
    mask = np.random.default_rng(0).random(100_000) < density
    encoded = encode_mask(mask)
    assert encoded.kind == kind
    if kind in (MaskKind.FULL, MaskKind.EMPTY):
        assert len(b"".join(encoded.parts)) == 2  # a bare tag
    decoded = decode_tensors(encode_tensors({"w": np.ones(mask.size, np.float32)}, {"w": mask}))
    assert np.array_equal(decoded["w"].mask, mask)


def test_structured_mask_picks_runs():
    mask = np.zeros((256, 64, 3, 3), dtype=bool)
    mask[::3] = True  # every third output channel kept
    assert encode_mask(mask.reshape(-1)).kind == MaskKind.EF_RUNS
    encoded = encode_tensors({"w": np.ones(mask.shape, np.float32)}, {"w": mask})
    assert len(encoded) < 4 * mask.sum() + 1000
    assert np.array_equal(decode_tensors(encoded)["w"].mask, mask)


@pytest.mark.parametrize("density", [0.01, 0.05, 0.3, 0.5, 0.9, 0.99])
def test_size_is_near_the_information_bound(density):
    rng = np.random.default_rng(1)
    tensors = {f"t{i}": rng.standard_normal((300, 1000), dtype=np.float32) for i in range(3)}
    masks = {name: rng.random(array.shape) < density for name, array in tensors.items()}
    kept = sum(int(mask.sum()) for mask in masks.values())
    bound = lower_bound_bytes(900_000, kept)
    assert len(encode_tensors(tensors, masks)) <= 1.05 * bound


def test_expected_pins_names_shapes_and_dtypes():
    tensors = {"a": np.zeros((2, 3), np.float32), "b": np.zeros(4, np.int64)}
    data = encode_tensors(tensors)
    exact = {"b": ((4,), "int64"), "a": ((2, 3), "float32")}
    assert list(decode_tensors(data, expected=exact)) == ["a", "b"]
    wrong = [
        {"a": ((3, 2), "float32"), "b": ((4,), "int64")},
        {"a": ((2, 3), "float64"), "b": ((4,), "int64")},
        {"a": ((2, 3), "float32")},
        {**exact, "c": ((1,), "uint8")},
    ]
    for expected in wrong:
        with pytest.raises(ProtocolError):
            decode_tensors(data, expected=expected)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("fp16", [False, True])
def test_require_finite_rejects_nan_and_inf(dtype, bad, fp16):
    array = np.arange(10, dtype=dtype)
    array[3] = bad
    data = encode_tensors({"w": array}, fp16=fp16)
    with pytest.raises(ProtocolError, match="finite"):
        decode_tensors(data, require_finite=True)
    assert np.array_equal(decode_tensors(data)["w"].values, array, equal_nan=True)
    mask = np.arange(10) != 3  # a masked-out NaN never travels
    masked = decode_tensors(
        encode_tensors({"w": array}, {"w": mask}, fp16=fp16), require_finite=True
    )
    assert masked["w"].values[3] == 0


@pytest.mark.parametrize(
    ("tensors", "masks"),
    [
        ({"": np.zeros(2)}, None),
        ({"a": np.zeros(2, np.complex64)}, None),
        ({"a": np.zeros(2)}, {"b": np.ones(2, bool)}),
        ({"a": np.zeros(2)}, {"a": np.ones(3, bool)}),
        ({"a": np.zeros(2)}, {"a": np.ones(2, np.uint8)}),
    ],
)
def test_encoder_rejects_what_it_cannot_send(tensors, masks):
    with pytest.raises(ValueError):
        encode_tensors(tensors, masks)


def test_fp16_overflow_is_an_error_not_an_infinity():
    with pytest.raises(ValueError, match="float16"):
        encode_tensors({"w": np.array([1e6], np.float32)}, fp16=True)


def test_encodes_views_and_foreign_byte_order():
    base = np.arange(24, dtype=">f4").reshape(4, 6)
    tensors = {"t": base.T, "s": base[::2, 1::2], "b": base.astype(">i8")}
    masks = {"t": (base.T % 3) > 0}
    decoded = decode_tensors(encode_tensors(tensors, masks))
    for name, array in tensors.items():
        want = np.where(masks[name], array, 0) if name in masks else array
        assert np.array_equal(decoded[name].values, want) and decoded[name].values.dtype.isnative


def test_accepts_any_contiguous_buffer():
    data = encode_tensors({"w": np.arange(5, dtype=np.int32)})
    for buffer in (data, bytearray(data), memoryview(data), np.frombuffer(data, np.uint8)):
        assert np.array_equal(decode_tensors(buffer)["w"].values, np.arange(5))


@pytest.mark.parametrize(
    "limits",
    [
        Limits(max_tensors=1),
        Limits(max_tensor_elements=99),
        Limits(max_total_elements=150),
        Limits(max_ndim=1),
        Limits(max_name_length=3),
        Limits(max_message_bytes=500),
    ],
)
def test_limits_are_enforced(limits):
    tensors = {"abcd": np.zeros((10, 10), np.float32), "e": np.zeros(100, np.float32)}
    data = encode_tensors(tensors)
    decode_tensors(data)
    with pytest.raises(ProtocolError):
        decode_tensors(data, limits=limits)
