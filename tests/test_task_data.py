"""The data layer for every task: regression targets and unlabelled samples in npz, csv and
callable (python:) sources, their partition and local split, and `for_task` / `num_outputs`.
Labelled data must behave exactly as before; tests/test_data.py and tests/test_own_data.py
cover that."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from agent.data import (
    Dataset,
    for_task,
    load_dataset,
    load_npz,
    num_outputs,
    partition,
)
from agent.own_data import (
    OwnData,
    load_own_data,
    misfit,
    own_for_task,
    reloaded,
    split_own_data,
)


def regression_set(n: int = 120, d: int | None = None, seed: int = 0) -> Dataset:
    """n samples of 4 features with float targets (n,) or, given d, (n, d)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 4)).astype(np.float32)
    y = rng.standard_normal(n if d is None else (n, d)).astype(np.float32)
    return Dataset("reg", x, y, 0, (4,))


def labelled_set(n: int = 60) -> Dataset:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((n, 1, 6)).astype(np.float32)
    return Dataset("lab", x, np.arange(n, dtype=np.int64) % 3, 3, (1, 6), ("a", "b", "c"))


def write_source(folder: Path, name: str, body: str) -> Path:
    path = folder / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    return path


# ---------------------------------------------------------------- Dataset


def test_a_dataset_holds_labels_targets_or_nothing() -> None:
    assert labelled_set().has_labels
    assert not regression_set().has_labels
    assert not regression_set(d=3).has_labels
    x = np.zeros((5, 2), np.float32)
    bare = Dataset("bare", x, np.zeros((5, 0), np.float32), 0, (2,))
    assert not bare.has_labels and len(bare) == 5


@pytest.mark.parametrize(
    ("y", "classes", "problem"),
    [
        (np.array([0.0, np.nan, 1.0], np.float32), 0, "y holds NaN or infinite targets"),
        (np.zeros(3, np.float32), 2, "num_classes 0 and no class names"),
        (np.zeros((3, 1, 1), np.float32), 0, "one target or row of targets per sample"),
        (np.zeros(4, np.float32), 0, "x has 3 samples but y has shape"),
        (np.zeros(3, np.float64), 0, "y int64 .labels. or float32 .targets."),
    ],
)
def test_bad_targets_are_one_line(y: np.ndarray, classes: int, problem: str) -> None:
    with pytest.raises(ValueError, match=problem) as err:
        Dataset("t", np.zeros((3, 2), np.float32), y, classes, (2,))
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------- npz


def test_npz_with_float_y_holds_targets(tmp_path: Path) -> None:
    x = np.arange(12, dtype=np.float64).reshape(6, 2)
    np.savez(tmp_path / "one.npz", x=x, y=np.linspace(0, 1, 6))
    np.savez(tmp_path / "two.npz", x=x, y=np.ones((6, 3), np.float16))
    one = load_npz(tmp_path / "one.npz")
    assert one.y.dtype == np.float32 and one.y.shape == (6,) and one.num_classes == 0
    assert one.class_names == () and not one.has_labels
    two = load_dataset(f"npz:{tmp_path / 'two.npz'}", seed=0)
    assert two.y.dtype == np.float32 and two.y.shape == (6, 3)
    assert num_outputs(one, "regression") == 1 and num_outputs(two, "regression") == 3


def test_npz_without_y_holds_samples_alone(tmp_path: Path) -> None:
    np.savez(tmp_path / "x.npz", x=np.full((5, 2, 3), 255, np.uint8))
    ds = load_npz(tmp_path / "x.npz")
    assert ds.y.dtype == np.float32 and ds.y.shape == (5, 0)
    assert np.all(ds.x == 1.0) and ds.input_shape == (2, 3)
    assert num_outputs(ds, "reconstruction") == 6


@pytest.mark.parametrize(
    ("arrays", "problem"),
    [
        ({"x": np.zeros((3, 2)), "y": np.array([0.0, np.inf, 1.0])}, "NaN or infinite targets"),
        ({"x": np.zeros((3, 2)), "y": np.array([1e39, 0.0, 1.0])}, "NaN or infinite targets"),
        ({"x": np.zeros((3, 2)), "y": np.zeros(2)}, "3 samples but y has 2 targets"),
        ({"x": np.zeros((0, 2))}, "no samples"),
        ({"x": np.array([[np.nan, 0.0]])}, "x holds NaN"),
    ],
)
def test_bad_npz_targets_name_the_file(tmp_path: Path, arrays: dict, problem: str) -> None:
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(ValueError, match=problem) as err:
        load_npz(path)
    assert str(err.value).startswith(str(path)) and "\n" not in str(err.value)


# ---------------------------------------------------------------- for_task, num_outputs


def test_for_task_classification_keeps_a_labelled_dataset() -> None:
    ds = labelled_set()
    assert for_task(ds, "classification") is ds
    assert num_outputs(ds, "classification") == 3


def test_for_task_regression_takes_labels_as_targets() -> None:
    ds = labelled_set()
    reg = for_task(ds, "regression")
    assert reg.y.dtype == np.float32 and reg.y.shape == (len(ds),)
    assert np.array_equal(reg.y, ds.y.astype(np.float32))
    assert reg.num_classes == 0 and reg.class_names == () and reg.x is ds.x
    assert num_outputs(ds, "regression") == 1
    targets = regression_set(d=2)
    assert for_task(targets, "regression") is targets


def test_for_task_reconstruction_drops_y_and_keeps_groups() -> None:
    ds = labelled_set()
    grouped = Dataset(
        ds.name, ds.x, ds.y, 3, ds.input_shape, groups=np.arange(len(ds), dtype=np.int64) % 4
    )
    rec = for_task(grouped, "reconstruction")
    assert rec.y.shape == (len(ds), 0) and rec.y.dtype == np.float32
    assert rec.groups is grouped.groups and rec.num_classes == 0
    assert for_task(rec, "reconstruction") is rec
    assert num_outputs(rec, "reconstruction") == 6


def test_for_task_refuses_what_a_dataset_cannot_serve() -> None:
    with pytest.raises(ValueError, match="'reg' has float targets.*integer class labels"):
        for_task(regression_set(), "classification")
    with pytest.raises(ValueError, match="integer class labels"):
        num_outputs(regression_set(), "classification")
    bare = for_task(regression_set(), "reconstruction")
    with pytest.raises(ValueError, match="regression needs targets y"):
        for_task(bare, "regression")
    with pytest.raises(ValueError, match="task must be one of"):
        for_task(bare, "segmentation")


# ---------------------------------------------------------------- partition


def test_iid_partition_of_a_regression_set_deals_every_sample_once() -> None:
    ds = regression_set(200)
    parts = partition(ds, 4, "iid", seed=3)
    shares = [np.concatenate([p.train.idx, p.val.idx]) for p in parts]
    dealt = np.concatenate(shares)
    assert len(dealt) == len(set(dealt.tolist())) == 160  # test_fraction 0.2 held out
    tests = np.concatenate([p.test.idx for p in parts])
    assert not set(tests.tolist()) & set(dealt.tolist())
    for part, share in zip(parts, shares, strict=True):
        assert len(part.val) == int(len(share) * 0.3)
        assert len(part.test) == round(len(share) * 0.2 / 0.8)
        for split in (part.train, part.val, part.test):
            assert split.y.dtype == np.float32
            assert np.array_equal(split.y, ds.y[split.idx])
        assert part.num_classes == 0
    again = partition(ds, 4, "iid", seed=3)
    assert all(np.array_equal(a.train.idx, b.train.idx) for a, b in zip(parts, again, strict=True))


def test_natural_partition_of_unlabelled_groups() -> None:
    base = for_task(regression_set(90), "reconstruction")
    groups = np.arange(90, dtype=np.int64) % 6
    ds = Dataset("g", base.x, base.y, 0, base.input_shape, groups=groups)
    parts = partition(ds, 3, "natural", seed=0)
    for part in parts:
        assert part.train.y.shape == (len(part.train), 0)
        mine = set(groups[part.train.idx].tolist())
        assert len(mine) == 2 and set(groups[part.test.idx].tolist()) <= mine


@pytest.mark.parametrize("spec", ["dirichlet:0.3", "pathological:2"])
def test_label_skew_partitions_need_labels(spec: str) -> None:
    with pytest.raises(ValueError, match=f"partition {spec} needs class labels; .* iid or natural"):
        partition(regression_set(), 3, spec, seed=0)


# ---------------------------------------------------------------- python: sources


SOURCE = """
    import numpy as np
    import torch

    calls = 0

    def regression(seed):
        rng = np.random.default_rng(seed)
        return rng.standard_normal((40, 3)), torch.tensor(rng.standard_normal(40))

    def growing():
        global calls
        calls += 1
        n = 20 * (calls + 1)
        return {"x": torch.ones(n, 2, requires_grad=True), "y": np.arange(n) % 2}

    def samples(**kwargs):
        return np.zeros((8, 1, 4), np.uint8)

    def grouped():
        return {"x": np.ones((30, 2)), "groups": np.arange(30) % 3}

    def broken():
        raise RuntimeError("sensor offline")

    def words():
        return "not data"

    def misnamed():
        return {"x": np.ones((4, 2)), "labels": np.zeros(4)}

    def three():
        return np.ones((4, 2)), np.zeros(4), np.zeros(4)

    def flags():
        return np.ones((4, 2)), np.zeros(4, bool)

    def flat():
        return np.ones(4)
"""


@pytest.fixture
def module_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """An importable module (unique per test, so no test sees another's state)."""
    name = f"edgefl_source_{tmp_path.name.replace('-', '_')}"
    write_source(tmp_path, name, SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_a_module_source_gets_the_seed_and_converts_tensors(module_source: str) -> None:
    ds = load_dataset(f"python:{module_source}:regression", seed=5)
    assert ds.name == f"python:{module_source}:regression"
    assert ds.x.dtype == np.float32 and ds.x.flags.c_contiguous and ds.x.shape == (40, 3)
    assert ds.y.dtype == np.float32 and ds.y.shape == (40,) and not ds.has_labels
    expected = np.random.default_rng(5).standard_normal((40, 3)).astype(np.float32)
    assert np.array_equal(ds.x, expected)
    other = load_dataset(f"python:{module_source}:regression", seed=6)
    assert not np.array_equal(ds.x, other.x)


def test_a_source_is_called_again_on_every_load(module_source: str) -> None:
    first = load_dataset(f"python:{module_source}:growing", seed=0)
    second = load_dataset(f"python:{module_source}:growing", seed=0)
    assert (len(first), len(second)) == (40, 60)
    assert second.has_labels and second.num_classes == 2 and second.y.dtype == np.int64


def test_a_file_source_relative_to_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_source(tmp_path, "mysensor", SOURCE)
    monkeypatch.chdir(tmp_path)
    ds = load_dataset("python:./mysensor.py:samples", seed=1)
    assert ds.y.shape == (8, 0) and ds.input_shape == (1, 4)
    assert ds.x.dtype == np.float32  # uint8 converted, not scaled: the source scales its own
    grouped = load_dataset(f"python:{tmp_path / 'mysensor.py'}:grouped", seed=1)
    assert grouped.groups is not None and grouped.groups.dtype == np.int64
    assert len(partition(grouped, 3, "natural", seed=0, min_samples=3)) == 3


@pytest.mark.parametrize(
    ("function", "problem"),
    [
        ("broken", "failed: RuntimeError: sensor offline$"),
        ("words", "returned str; expected x, .x, y. or a dict"),
        ("misnamed", r"returned a dict with keys \['labels', 'x'\]; expected"),
        ("three", "returned a tuple of 3 items; expected"),
        ("flags", "returned y of bool; expected integer class labels or float targets"),
        ("flat", r"returned x of float64 \(4,\); expected numbers of shape \(n, ...\)"),
        ("absent", "has no absent"),
    ],
)
def test_a_bad_source_is_one_line_naming_it(
    module_source: str, function: str, problem: str
) -> None:
    with pytest.raises(ValueError, match=problem) as err:
        load_dataset(f"python:{module_source}:{function}", seed=0)
    message = str(err.value)
    assert module_source in message and "\n" not in message


def test_an_unimportable_source_is_one_line() -> None:
    with pytest.raises(ValueError, match="no_such_module_xyz") as err:
        load_dataset("python:no_such_module_xyz:load", seed=0)
    assert "\n" not in str(err.value)


def test_unknown_dataset_lists_python_sources() -> None:
    with pytest.raises(ValueError, match="python:MODULE:FUNCTION$"):
        load_dataset("nope", seed=0)


# ---------------------------------------------------------------- device data


def test_device_csv_with_a_target_column(tmp_path: Path) -> None:
    file = tmp_path / "temps.csv"
    file.write_text("hour,target,load\n1,20.5,0.3\n\n2,21.25,0.4\n3,-1e3,0.5\n")
    own = load_own_data(file)
    assert own.y.dtype == np.float32 and np.array_equal(own.y, [20.5, 21.25, -1000.0])
    assert np.array_equal(own.x, np.array([[1, 0.3], [2, 0.4], [3, 0.5]], np.float32))
    assert own.describe() == {"samples": 3, "shape": [2], "labels": [], "targets": 1}


def test_device_npz_with_float_or_no_y(tmp_path: Path) -> None:
    np.savez(tmp_path / "reg.npz", x=np.ones((6, 2)), y=np.ones((6, 2)))
    np.savez(tmp_path / "bare.npz", x=np.ones((6, 2)))
    reg, bare = load_own_data(tmp_path / "reg.npz"), load_own_data(tmp_path / "bare.npz")
    assert reg.y.shape == (6, 2) and reg.describe()["targets"] == 2
    assert bare.y.shape == (6, 0) and bare.describe() == {
        "samples": 6,
        "shape": [2],
        "labels": [],
        "targets": 0,
    }


def test_a_device_python_source_is_called_again_on_every_load(module_source: str) -> None:
    spec = f"python:{module_source}:growing"
    first = load_own_data(spec)
    assert first.path == spec and first.samples == 40 and first.has_labels
    assert load_own_data(spec).samples == 60
    assert reloaded(first).samples == 80
    unseeded = load_own_data(f"python:{module_source}:samples")  # **kwargs: no seed given
    assert unseeded.y.shape == (8, 0)
    with pytest.raises(ValueError, match="failed: RuntimeError: sensor offline"):
        load_own_data(f"python:{module_source}:broken")


def test_reloaded_keeps_file_data(tmp_path: Path) -> None:
    np.savez(tmp_path / "d.npz", x=np.ones((6, 2)), y=np.arange(6) % 2)
    own = load_own_data(tmp_path / "d.npz")
    assert reloaded(own) is own


def test_a_device_split_without_labels_is_random_with_the_same_sizes() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((50, 3)).astype(np.float32)
    own = OwnData("mem", x, rng.standard_normal((50, 2)).astype(np.float32))
    local = split_own_data(own, 7, "dev-1")
    assert (len(local.x_train), len(local.x_test), len(local.x_val)) == (35, 10, 5)
    assert local.y_train.dtype == torch.float32 and local.y_train.shape == (35, 2)
    seen = torch.cat([local.x_train, local.x_test, local.x_val])
    assert sorted(map(tuple, seen.tolist())) == sorted(map(tuple, torch.from_numpy(x).tolist()))
    again = split_own_data(own, 7, "dev-1")
    assert torch.equal(local.x_test, again.x_test)
    assert not torch.equal(local.x_test, split_own_data(own, 7, "dev-2").x_test)


def test_own_for_task() -> None:
    x = np.ones((4, 2), np.float32)
    labelled = OwnData("mem", x, np.array([0, 1, 1, 0]))
    assert own_for_task(labelled, "classification") is labelled
    assert own_for_task(labelled, "regression").y.dtype == np.float32
    assert own_for_task(labelled, "reconstruction").y.shape == (4, 0)
    targets = OwnData("mem", x, np.ones(4, np.float32))
    with pytest.raises(ValueError, match="mem: a classification run needs y to be integer"):
        own_for_task(targets, "classification")
    with pytest.raises(ValueError, match="mem: regression needs targets y"):
        own_for_task(own_for_task(targets, "reconstruction"), "regression")


def test_misfit_for_data_without_labels() -> None:
    targets = {"samples": 30, "shape": [4], "labels": [], "targets": 1}
    bare = {**targets, "targets": 0}
    labelled = {"samples": 30, "shape": [4], "labels": [0, 1]}
    assert misfit(targets, (4,), 0, 10) is None  # no task: no classes check without labels
    assert misfit(targets, (4,), 0, 10, task="regression", targets=1) is None
    assert misfit(bare, (4,), 0, 10, task="reconstruction") is None
    assert misfit(labelled, (4,), 0, 10, task="regression") is None
    assert misfit(labelled, (4,), 0, 10, task="reconstruction") is None
    assert "no class labels" in str(misfit(targets, (4,), 3, 10, task="classification"))
    assert "no targets y" in str(misfit(bare, (4,), 0, 10, task="regression"))
    assert (
        misfit(targets, (4,), 0, 10, task="regression", targets=2)
        == "1 target per sample, the run's model predicts 2"
    )
    assert "shape" in str(misfit(targets, (5,), 0, 10, task="regression"))
    assert "at least 40" in str(misfit(bare, (4,), 0, 40, task="reconstruction"))
    assert "lies outside" in str(misfit(labelled, (4,), 1, 10, task="classification"))


@pytest.mark.parametrize(
    ("description", "problem"),
    [
        ({"samples": 3, "shape": [2], "labels": [1], "targets": 1}, "labels beside 'targets'"),
        ({"samples": 3, "shape": [2], "labels": [], "targets": -1}, "'targets' must be"),
        ({"samples": 3, "shape": [2], "labels": [], "targets": True}, "'targets' must be"),
    ],
)
def test_a_malformed_targets_description(description: dict, problem: str) -> None:
    assert problem in str(misfit(description, (2,), 2, 1))
