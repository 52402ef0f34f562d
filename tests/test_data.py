"""Datasets, user loaders and partitions of agent.data."""

from __future__ import annotations

import pickle
import random
import struct
from pathlib import Path

import numpy as np
import pytest

from agent import data
from agent.data import (
    Dataset,
    load_cifar10,
    load_dataset,
    load_imagefolder,
    load_npz,
    partition,
)


@pytest.fixture(scope="module")
def digits() -> Dataset:
    return load_dataset("digits", seed=0)


def mix(y: np.ndarray) -> np.ndarray:
    return np.bincount(y, minlength=10) / max(len(y), 1)


def mean_classes(agents: list) -> float:
    return float(np.mean([len(np.unique(a.train.y)) for a in agents]))


# ---------------------------------------------------------------- built-in datasets


@pytest.mark.parametrize(
    ("spec", "n", "shape"),
    [
        ("digits", 1797, (1, 8, 8)),
        ("mnist1d", 5000, (1, 40)),
        ("synthetic", 6000, (60,)),
    ],
)
def test_builtin_datasets_load_with_shapes_and_classes(spec: str, n: int, shape: tuple) -> None:
    ds = load_dataset(spec, seed=0)
    assert (ds.name, len(ds), ds.input_shape, ds.num_classes) == (spec, n, shape, 10)
    assert ds.x.shape == (n, *shape) and ds.x.dtype == np.float32 and ds.y.dtype == np.int64
    assert set(np.unique(ds.y)) <= set(range(10)) and np.isfinite(ds.x).all()


def test_digits_scaled_to_unit_range(digits: Dataset) -> None:
    assert digits.x.min() == 0.0 and digits.x.max() == 1.0
    assert len(np.unique(digits.y)) == 10


def test_mnist1d_is_seeded_and_leaves_global_rng_alone() -> None:
    np.random.seed(123)
    random.seed(123)
    before_np, before_py = np.random.get_state()[1].copy(), random.getstate()
    a, b = data.load_mnist1d(seed=1), data.load_mnist1d(seed=1)
    c = data.load_mnist1d(seed=2)
    assert np.array_equal(a.x, b.x) and np.array_equal(a.y, b.y)
    assert not np.array_equal(a.x, c.x)
    assert np.array_equal(np.random.get_state()[1], before_np)
    assert random.getstate() == before_py


def test_synthetic_groups_are_non_iid_and_seeded() -> None:
    ds = load_dataset("synthetic", seed=0)
    assert ds.groups is not None and len(np.unique(ds.groups)) == 30
    mixes = [mix(ds.y[ds.groups == g]) for g in range(30)]
    tv = [0.5 * np.abs(mixes[i] - mixes[j]).sum() for i in range(30) for j in range(i)]
    assert np.mean(tv) > 0.5  # each device has its own label mix
    assert np.array_equal(load_dataset("synthetic", seed=0).x, ds.x)
    assert not np.array_equal(load_dataset("synthetic", seed=1).x, ds.x)
    custom = load_dataset("synthetic:0.5,0.5,12", seed=0)
    assert len(np.unique(custom.groups)) == 12


@pytest.mark.parametrize(
    "spec", ["mnist", "digits:3", "npz", "synthetic:1", "synthetic:a,b", "synthetic:1,1,2.5", ""]
)
def test_bad_dataset_specs_raise(spec: str) -> None:
    with pytest.raises(ValueError):
        load_dataset(spec, seed=0)


def test_unknown_dataset_lists_known_ones() -> None:
    with pytest.raises(ValueError, match="digits.*mnist1d.*synthetic.*npz:PATH"):
        load_dataset("imagenet", seed=0)


def test_dataset_rejects_non_finite_and_mismatched_arrays() -> None:
    x = np.zeros((4, 3), np.float32)
    y = np.array([0, 1, 0, 1], np.int64)
    with pytest.raises(ValueError, match="NaN"):
        Dataset("t", np.where(np.eye(4, 3) > 0, np.nan, x).astype(np.float32), y, 2, (3,))
    with pytest.raises(ValueError, match="one label per sample"):
        Dataset("t", x[:3], y, 2, (3,))
    with pytest.raises(ValueError, match="shape"):
        Dataset("t", x, y, 2, (4,))
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        Dataset("t", x, y + 1, 2, (3,))


# ---------------------------------------------------------------- npz


def test_npz_loader(tmp_path: Path) -> None:
    path = tmp_path / "d.npz"
    x = np.arange(5 * 2 * 3, dtype=np.uint8).reshape(5, 2, 3)
    np.savez(path, x=x, y=np.array([0, 1, 2, 1, 0]))
    ds = load_dataset(f"npz:{path}", seed=0)
    assert ds.input_shape == (2, 3) and ds.num_classes == 3 and len(ds) == 5
    assert np.allclose(ds.x, x / 255.0)
    np.savez(path, x=x.astype(np.float64), y=np.array([0, 1, 2, 1, 0]), num_classes=5)
    ds = load_npz(path)
    assert ds.num_classes == 5 and np.array_equal(ds.x, x.astype(np.float32))


@pytest.mark.parametrize(
    ("arrays", "match"),
    [
        ({"y": np.zeros(3, np.int64)}, r"missing array\(s\) \['x'\]"),
        ({"x": np.zeros((3, 2)), "y": np.zeros(4, np.int64)}, "3 samples but y has 4"),
        ({"x": np.zeros(3), "y": np.zeros(3, np.int64)}, "shape"),
        ({"x": np.zeros((3, 2)), "y": np.zeros((3, 1), np.int64)}, "1-D integer"),
        ({"x": np.zeros((3, 2)), "y": np.zeros(3, bool)}, "1-D integer"),
        ({"x": np.zeros((3, 2)), "y": np.zeros((3, 1, 1))}, "float array of shape"),
        ({"x": np.full((3, 2), np.inf), "y": np.array([0, 1, 1])}, "infinite"),
        ({"x": np.zeros((3, 2)), "y": np.array([0, -1, 1])}, ">= 0"),
    ],
)
def test_npz_errors(tmp_path: Path, arrays: dict, match: str) -> None:
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(ValueError, match=match):
        load_npz(path)


def test_npz_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_npz(tmp_path / "nope.npz")


# ---------------------------------------------------------------- image folder


def write_images(root: Path, counts: dict[str, int]) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    for name, count in counts.items():
        (root / name).mkdir(parents=True)
        for i in range(count):
            pixels = rng.integers(0, 256, (7, 5, 3), dtype=np.uint8)
            suffix = ".jpg" if i == 0 else ".png"
            Image.fromarray(pixels).save(root / name / f"{i}{suffix}")
        (root / name / "notes.txt").write_text("not an image")


def test_imagefolder_loader(tmp_path: Path) -> None:
    write_images(tmp_path, {"cat": 2, "ant": 3})
    ds = load_dataset(f"imagefolder:{tmp_path}", seed=0)
    assert ds.x.shape == (5, 3, 32, 32) and ds.class_names == ("ant", "cat")
    assert list(ds.y) == [0, 0, 0, 1, 1] and ds.x.min() >= 0.0 and ds.x.max() <= 1.0
    gray = load_imagefolder(tmp_path, size=(4, 6), grayscale=True)
    assert gray.x.shape == (5, 1, 4, 6) and gray.input_shape == (1, 4, 6)


def test_imagefolder_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_imagefolder(tmp_path / "missing")
    write_images(tmp_path / "one", {"a": 2})
    with pytest.raises(ValueError, match="at least 2 classes"):
        load_imagefolder(tmp_path / "one")
    write_images(tmp_path / "empty", {"a": 2})
    (tmp_path / "empty" / "b").mkdir()
    with pytest.raises(ValueError, match="no .png"):
        load_imagefolder(tmp_path / "empty")
    write_images(tmp_path / "broken", {"a": 1, "b": 1})
    (tmp_path / "broken" / "b" / "bad.png").write_bytes(b"not a png")
    with pytest.raises(ValueError, match="bad.png"):
        load_imagefolder(tmp_path / "broken")


# ---------------------------------------------------------------- CIFAR-10 python format


def write_cifar_batch(
    path: Path, n: int, first_label: int = 0, columns: int = 3072, labels: list[int] | None = None
) -> None:
    data = np.random.default_rng(n).integers(0, 256, (n, columns), dtype=np.uint8)
    batch = {
        b"batch_label": b"fake",
        b"labels": labels or [(first_label + i) % 10 for i in range(n)],
        b"data": data,
        b"filenames": [b"img%d.png" % i for i in range(n)],
    }
    with path.open("wb") as fh:
        pickle.dump(batch, fh, protocol=2)


def test_cifar10_loader(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    write_cifar_batch(folder / "data_batch_1", 4)
    write_cifar_batch(folder / "test_batch", 3, first_label=7)
    for path in (tmp_path, folder):  # the download's root or its batches folder
        ds = load_dataset(f"cifar10:{path}", seed=0)
        assert ds.x.shape == (7, 3, 32, 32) and ds.num_classes == 10
        assert list(ds.y) == [0, 1, 2, 3, 7, 8, 9] and ds.class_names[0] == "airplane"
        assert ds.x.min() >= 0.0 and ds.x.max() <= 1.0


def python2_batch(data: np.ndarray, labels: list[int]) -> bytes:
    """The bytes Python 2's cPickle (protocol 2, numpy 1.x) writes for a batch dict, as in
    the official download: str objects, not unicode, and numpy.core names."""

    def s(b: bytes) -> bytes:
        return (b"U" + bytes([len(b)]) if len(b) < 256 else b"T" + struct.pack("<I", len(b))) + b

    def i(v: int) -> bytes:
        return b"J" + struct.pack("<i", v)

    dtype = (
        b"cnumpy\ndtype\n"
        + s(b"u1")
        + i(0)
        + i(1)
        + b"\x87R("
        + i(3)
        + s(b"|")
        + b"NNN"
        + i(-1)
        + i(-1)
        + i(0)
        + b"tb"
    )
    array = (
        b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\n"
        + i(0)
        + b"\x85"
        + s(b"b")
        + b"\x87R("
        + i(1)
        + i(data.shape[0])
        + i(data.shape[1])
        + b"\x86"
        + dtype
        + b"\x89"
        + s(data.tobytes())
        + b"tb"
    )
    return (
        b"\x80\x02}("
        + s(b"data")
        + array
        + s(b"labels")
        + b"]("
        + b"".join(map(i, labels))
        + b"eu."
    )


def test_cifar10_reads_python2_pickles(tmp_path: Path) -> None:
    data = np.random.default_rng(0).integers(0, 256, (3, 3072), dtype=np.uint8)
    (tmp_path / "data_batch_2").write_bytes(python2_batch(data, [9, 0, 4]))
    ds = load_cifar10(tmp_path)
    assert list(ds.y) == [9, 0, 4]
    assert np.array_equal(ds.x, data.reshape(3, 3, 32, 32) / np.float32(255))


def test_cifar10_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_cifar10(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="data_batch_1"):
        load_cifar10(tmp_path)
    write_cifar_batch(tmp_path / "data_batch_1", 2, columns=100)
    with pytest.raises(ValueError, match="3072"):
        load_cifar10(tmp_path)
    write_cifar_batch(tmp_path / "data_batch_1", 2, labels=[1, 2, 3])
    with pytest.raises(ValueError, match="labels"):
        load_cifar10(tmp_path)
    (tmp_path / "data_batch_1").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="not a CIFAR-10"):
        load_cifar10(tmp_path)


class _Exploit:
    def __reduce__(self) -> tuple:
        return (Path.touch, (Path("/tmp/agent-data-test-pwned"),))


def test_cifar10_refuses_pickled_code(tmp_path: Path) -> None:
    marker = Path("/tmp/agent-data-test-pwned")
    marker.unlink(missing_ok=True)
    (tmp_path / "data_batch_1").write_bytes(pickle.dumps({b"data": _Exploit()}, protocol=2))
    with pytest.raises(ValueError, match="forbidden"):
        load_cifar10(tmp_path)
    assert not marker.exists()


# ---------------------------------------------------------------- partitions


def test_iid_partition_is_balanced(digits: Dataset) -> None:
    agents = partition(digits, 10, "iid", seed=0)
    sizes = [len(a.train) + len(a.val) for a in agents]
    assert max(sizes) - min(sizes) <= 1
    assert mean_classes(agents) == 10
    for a in agents:
        assert np.abs(mix(a.train.y) - mix(digits.y)).max() < 0.1


def test_dirichlet_small_alpha_skews_labels(digits: Dataset) -> None:
    iid = mean_classes(partition(digits, 10, "iid", seed=0))
    skewed = partition(digits, 10, "dirichlet:0.1", seed=0)
    assert mean_classes(skewed) < iid - 3
    assert mean_classes(partition(digits, 10, "dirichlet:100", seed=0)) > iid - 0.5


def test_dirichlet_guarantees_min_samples(digits: Dataset) -> None:
    agents = partition(digits, 100, "dirichlet:0.01", seed=0, min_samples=12)
    assert min(len(a.train) + len(a.val) for a in agents) >= 12


@pytest.mark.parametrize("per_agent", [1, 2, 5])
def test_pathological_gives_exact_classes(digits: Dataset, per_agent: int) -> None:
    agents = partition(digits, 10, f"pathological:{per_agent}", seed=0)
    for a in agents:
        classes = set(np.unique(np.concatenate([a.train.y, a.val.y])))
        assert len(classes) == per_agent and set(np.unique(a.test.y)) <= classes
    used = np.concatenate([np.unique(a.train.y) for a in agents])
    assert np.bincount(used).max() - np.bincount(used).min() <= 1  # classes spread evenly


@pytest.mark.parametrize("spec", ["iid", "dirichlet:0.3", "pathological:2"])
def test_splits_are_disjoint_and_test_mix_matches_train(digits: Dataset, spec: str) -> None:
    agents = partition(digits, 8, spec, seed=3)
    shares = [np.concatenate([a.train.idx, a.val.idx]) for a in agents]
    assert len(np.unique(np.concatenate(shares))) == sum(len(s) for s in shares)
    all_test = np.concatenate([a.test.idx for a in agents])
    assert not np.isin(all_test, np.concatenate(shares)).any()
    for a, share in zip(agents, shares, strict=True):
        assert not np.intersect1d(a.train.idx, a.val.idx).size
        assert len(a.val) == int(len(share) * 0.3)
        assert np.array_equal(a.train.y, digits.y[a.train.idx])
        assert np.array_equal(a.test.x, digits.x[a.test.idx])
        assert len(a.test) == round(len(share) * 0.25)
        tv = 0.5 * np.abs(mix(a.train.y) - mix(a.test.y)).sum()
        assert tv <= 0.5 * len(np.unique(a.train.y)) / len(a.test) + 1e-9  # rounding only


def test_test_size_and_val_fraction_parameters(digits: Dataset) -> None:
    agents = partition(digits, 4, "dirichlet:0.5", seed=0, val_fraction=0.5, test_size=50)
    for a in agents:
        n = len(a.train) + len(a.val)
        assert len(a.val) == n // 2 and len(a.test) == 50
    assert all(len(a.val) == 0 for a in partition(digits, 4, "iid", seed=0, val_fraction=0))


def test_natural_partition_keeps_groups_whole() -> None:
    ds = load_dataset("synthetic", seed=0)
    agents = partition(ds, 7, "natural", seed=0)
    seen: set[int] = set()
    for a in agents:
        own = set(np.unique(ds.groups[np.concatenate([a.train.idx, a.val.idx])]))
        assert not own & seen and set(np.unique(ds.groups[a.test.idx])) <= own
        seen |= own
    assert len(seen) == 30


def test_partition_is_deterministic_for_a_seed(digits: Dataset) -> None:
    def indices(seed: int) -> list[np.ndarray]:
        return [
            i
            for a in partition(digits, 5, "dirichlet:0.5", seed=seed)
            for i in (a.train.idx, a.val.idx, a.test.idx)
        ]

    assert all(np.array_equal(p, q) for p, q in zip(indices(7), indices(7), strict=True))
    assert not all(np.array_equal(p, q) for p, q in zip(indices(7), indices(8), strict=True))


@pytest.mark.parametrize(
    ("num_agents", "spec", "match"),
    [
        (5, "dirichlet:-1", "ALPHA > 0"),
        (5, "dirichlet:0", "ALPHA > 0"),
        (5, "dirichlet:abc", "ALPHA > 0"),
        (5, "dirichlet:inf", "ALPHA > 0"),
        (5, "pathological:0", r"\[1, 10\]"),
        (5, "pathological:11", r"\[1, 10\]"),
        (5, "pathological:1.5", r"\[1, 10\]"),
        (5, "iid:2", "no argument"),
        (5, "shards", "unknown partition"),
        (5, "natural", "groups"),
        (0, "iid", ">= 1"),
        (2000, "iid", "only 1797 samples"),
        (500, "iid", "more than"),
        (140, "pathological:1", "min_samples"),
    ],
)
def test_bad_partitions_raise(digits: Dataset, num_agents: int, spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        partition(digits, num_agents, spec, seed=0)


def test_bad_partition_parameters_raise(digits: Dataset) -> None:
    for kwargs in ({"val_fraction": 1.0}, {"test_fraction": 0.0}, {"min_samples": 0}):
        with pytest.raises(ValueError):
            partition(digits, 2, "iid", seed=0, **kwargs)


# ---------------------------------------------------------------- dataset cache


def tiny(name: str = "tiny") -> Dataset:
    x = np.arange(12, dtype=np.float32).reshape(6, 1, 2)
    y = np.array([0, 1, 0, 1, 2, 2], dtype=np.int64)
    return Dataset(name, x, y, 3, (1, 2), ("a", "b", "c"), np.arange(6, dtype=np.int64))


def counting(make):
    calls = []

    def wrapped():
        calls.append(1)
        return make()

    return wrapped, calls


def assert_same(a: Dataset, b: Dataset) -> None:
    assert (a.name, a.num_classes, a.input_shape, a.class_names) == (
        b.name,
        b.num_classes,
        b.input_shape,
        b.class_names,
    )
    assert np.array_equal(a.x, b.x) and np.array_equal(a.y, b.y)
    assert (a.groups is None) == (b.groups is None)
    if a.groups is not None:
        assert np.array_equal(a.groups, b.groups)


def test_cache_makes_a_dataset_once(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(data.CACHE_ENV, str(tmp_path))
    make, calls = counting(tiny)
    first, second = data.cached("k", make), data.cached("k", make)
    assert len(calls) == 1
    assert_same(first, tiny())
    assert_same(second, tiny())


def test_cached_mnist1d_equals_the_generated_one(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(data.CACHE_ENV, str(tmp_path))
    load_dataset("mnist1d", seed=3)
    assert len(list(tmp_path.glob("mnist1d*-seed3-*.npz"))) == 1
    assert_same(load_dataset("mnist1d", seed=3), data.load_mnist1d(3))


def test_unreadable_cache_file_is_made_again(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv(data.CACHE_ENV, str(tmp_path))
    data.cached("k", tiny)
    (cache_file,) = tmp_path.glob("k-*.npz")
    cache_file.write_bytes(b"PK\x03\x04 truncated")
    make, calls = counting(tiny)
    assert_same(data.cached("k", make), tiny())
    assert len(calls) == 1 and "unreadable" in caplog.text
    assert_same(data.cached("k", make), tiny())
    assert len(calls) == 1


def test_unwritable_or_disabled_cache_still_gives_the_data(tmp_path, monkeypatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(data.CACHE_ENV, str(blocker / "cache"))
    assert_same(data.cached("k", tiny), tiny())
    monkeypatch.setenv(data.CACHE_ENV, "")
    make, calls = counting(tiny)
    data.cached("k", make), data.cached("k", make)
    assert len(calls) == 2


def test_the_same_values_get_the_same_memory_layout() -> None:
    """Torch kernels depend on strides, so two layouts of one dataset would train apart."""
    flat = np.random.default_rng(0).random((40, 8), dtype=np.float32)
    y = np.arange(40, dtype=np.int64) % 4
    views = [flat[:, None, :], flat.reshape(40, 1, 8).copy()]
    assert views[0].strides != views[1].strides
    parts = [partition(Dataset("d", x, y, 4, (1, 8)), 2, "iid", seed=0) for x in views]
    for a, b in zip(*parts, strict=True):
        assert a.train.x.strides == b.train.x.strides and a.test.x.strides == b.test.x.strides
