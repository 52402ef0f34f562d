"""A device's own data (agent.own_data): loading each format, clear errors for bad files,
the fit check against a run, and the local seeded stratified split."""

from __future__ import annotations

from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

from agent.learning import LocalData
from agent.own_data import OwnData, load_own_data, misfit, split_own_data


def write_images(root: Path, classes: dict[str, int], size: tuple[int, int] = (7, 9)) -> None:
    """`count` tiny random RGB PNGs in root/<class>/ for each class."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for name, count in classes.items():
        (root / name).mkdir(parents=True)
        for i in range(count):
            pixels = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i}.png")


def own(y: list[int] | np.ndarray) -> OwnData:
    """Data whose first feature is the sample's index, so splits can be traced back."""
    y = np.asarray(y, dtype=np.int64)
    x = np.stack([np.arange(len(y)), np.zeros(len(y))], axis=1).astype(np.float32)
    return OwnData("mem", x, y)


def indices(data: LocalData) -> list[set[int]]:
    return [set(x[:, 0].int().tolist()) for x in (data.x_train, data.x_val, data.x_test)]


# ---------------------------------------------------------------- loading each format


def test_npz_loads_whole_with_uint8_scaled(tmp_path: Path) -> None:
    file = tmp_path / "d.npz"
    x = np.full((6, 1, 2, 3), 255, dtype=np.uint8)
    np.savez(file, x=x, y=np.array([0, 1, 2, 0, 1, 2], dtype=np.int32))
    data = load_own_data(file)
    assert data.x.dtype == np.float32 and data.y.dtype == np.int64
    assert data.x.flags.c_contiguous and float(data.x.max()) == 1.0
    assert (data.samples, data.input_shape, data.labels) == (6, (1, 2, 3), (0, 1, 2))
    assert data.path == str(file)


def test_describe_is_plain_msgpack_data_without_counts(tmp_path: Path) -> None:
    file = tmp_path / "d.npz"
    np.savez(file, x=np.zeros((5, 4)), y=np.array([3, 3, 3, 7, 7]))
    description = load_own_data(file).describe()
    assert description == {"samples": 5, "shape": [4], "labels": [3, 7]}
    assert msgpack.unpackb(msgpack.packb(description)) == description


def test_csv_loads_features_and_label_column(tmp_path: Path) -> None:
    file = tmp_path / "d.csv"
    file.write_text("a, label ,b\n1.5,2,3\n\n-4,0.0,5e1\n")
    data = load_own_data(file)
    np.testing.assert_array_equal(data.x, [[1.5, 3.0], [-4.0, 50.0]])
    assert data.y.tolist() == [2, 0]
    assert data.input_shape == (2,)


@pytest.mark.parametrize(("shape", "mode"), [((1, 4, 6), "L"), ((3, 5, 5), "RGB")])
def test_image_folder_is_decoded_to_the_requested_shape(
    tmp_path: Path, shape: tuple[int, int, int], mode: str
) -> None:
    write_images(tmp_path, {"cat": 2, "dog": 3})
    data = load_own_data(tmp_path, input_shape=shape)
    assert data.x.shape == (5, *shape)
    assert data.y.tolist() == [0, 0, 1, 1, 1]  # sorted names -> 0..C-1
    assert float(data.x.min()) >= 0.0 and float(data.x.max()) <= 1.0


def test_image_folder_default_shape_is_rgb_32(tmp_path: Path) -> None:
    write_images(tmp_path, {"a": 1, "b": 1})
    assert load_own_data(tmp_path).input_shape == (3, 32, 32)


def test_image_folders_named_by_integers_keep_their_labels(tmp_path: Path) -> None:
    """A device lacking classes 0-2 still labels its images 3 and 10, not 0 and 1."""
    write_images(tmp_path, {"3": 2, "10": 1})
    data = load_own_data(tmp_path, input_shape=(1, 4, 4))
    assert sorted(data.y.tolist()) == [3, 3, 10]
    assert data.labels == (3, 10)


def test_image_folder_cannot_fit_a_flat_input_shape(tmp_path: Path) -> None:
    write_images(tmp_path, {"a": 1, "b": 1})
    with pytest.raises(ValueError, match=r"image folder gives samples of shape.*\(40,\)") as err:
        load_own_data(tmp_path, input_shape=(40,))
    assert str(tmp_path) in str(err.value)


# ---------------------------------------------------------------- bad inputs


GOOD_X = np.zeros((3, 2), dtype=np.float32)
BAD_FILES: list[tuple[str, object, str]] = [
    ("missing.npz", None, "no such file"),
    ("data.txt", "1,2\n", "unknown data format '.txt'"),
    ("corrupt.npz", b"PK\x03\x04 definitely not a zip", "not a readable .npz"),
    ("garbage.npz", b"\x00\x01\x02", "not a readable .npz"),
    ("nox.npz", {"y": np.arange(3)}, r"missing array\(s\) \['x'\]"),
    ("nan.npz", {"x": np.array([[0, np.nan]] * 3), "y": np.arange(3)}, "NaN or infinite"),
    ("neg.npz", {"x": GOOD_X, "y": np.array([0, -1, 1])}, "labels must be class indices >= 0"),
    ("complex.npz", {"x": GOOD_X, "y": np.ones(3, complex)}, "integer class labels or float"),
    ("nany.npz", {"x": GOOD_X, "y": np.array([0.0, np.nan, 1.0])}, "NaN or infinite targets"),
    ("cube.npz", {"x": GOOD_X, "y": np.zeros((3, 1, 1))}, r"\(samples, d\), got"),
    ("short.npz", {"x": GOOD_X, "y": np.arange(2)}, "3 samples but y has 2 labels"),
    ("cell.csv", "a,b,label\n1,2,0\n3,abc,1\n", "line 3, column 'b': 'abc' is not a finite"),
    ("nan.csv", "a,label\nnan,0\n", "line 2, column 'a': 'nan' is not a finite"),
    ("nolabel.csv", "a,b\n1,2\n", "exactly one 'label' column .* or one 'target' .*found: a, b"),
    ("both.csv", "a,label,target\n1,0,2\n", "exactly one 'label' column .*found: a, label, t"),
    ("target.csv", "a,target\n1,x\n", "line 2, column 'target': 'x' is not a finite"),
    ("huge.csv", "a,target\n1,1e39\n", "line 2, column 'target': '1e39' is too large"),
    ("neg.csv", "a,label\n1,0\n2,-2\n", "labels must be class indices >= 0, got -2"),
    ("half.csv", "a,label\n1,2.5\n", "line 2, column 'label': '2.5' is not an integer"),
    ("ragged.csv", "a,label\n1,0\n1,2,3\n", "line 3 has 3 cells"),
    ("empty.csv", "", "found: nothing"),
    ("header.csv", "a,label\n", "no samples"),
    ("latin1.csv", "a,label\n\xe9,0\n".encode("latin-1"), "not a UTF-8 text file"),
]


@pytest.mark.parametrize(("name", "content", "problem"), BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_a_bad_file_is_one_line_naming_it_and_the_problem(
    tmp_path: Path, name: str, content: object, problem: str
) -> None:
    file = tmp_path / name
    if isinstance(content, dict):
        np.savez(file, **content)
    elif isinstance(content, bytes):
        file.write_bytes(content)
    elif isinstance(content, str):
        file.write_text(content)
    with pytest.raises(ValueError, match=problem) as err:
        load_own_data(file)
    message = str(err.value)
    assert message.startswith(str(file)) and "\n" not in message


def test_an_npy_array_saved_as_npz_is_rejected(tmp_path: Path) -> None:
    file = tmp_path / "one.npz"
    with file.open("wb") as f:
        np.save(f, GOOD_X)
    with pytest.raises(ValueError, match="not a readable .npz.*not a zip archive"):
        load_own_data(file)


def test_image_folder_with_clashing_integer_names(tmp_path: Path) -> None:
    write_images(tmp_path, {"1": 1, "01": 1})
    with pytest.raises(ValueError, match="two class folders name the same label"):
        load_own_data(tmp_path, input_shape=(1, 2, 2))


# ---------------------------------------------------------------- fit to a run


FIT = {"samples": 20, "shape": [1, 40], "labels": [0, 3, 9]}


def test_misfit_accepts_data_that_fits() -> None:
    assert misfit(FIT, (1, 40), classes=10, min_samples=10) is None
    assert misfit({**FIT, "shape": (1, 40)}, [1, 40], classes=10, min_samples=20) is None


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"shape": [3, 32, 32]}, "samples have shape (3, 32, 32), the run's model takes (1, 40)"),
        ({"labels": [0, 12, 15]}, "labels 12 and 15 lie outside the run's 10 classes"),
        ({"labels": [10]}, "label 10 lies outside the run's 10 classes"),
        (
            {"labels": list(range(5, 16))},
            "labels 10, 11, 12, 13 and 2 more lie outside the run's 10 classes",
        ),
        ({"samples": 7}, "7 samples, the run needs at least 10"),
        ({"samples": 1, "labels": [0]}, "1 sample, the run needs at least 10"),
    ],
)
def test_misfit_says_why_data_does_not_fit(change: dict[str, object], reason: str) -> None:
    assert misfit({**FIT, **change}, (1, 40), classes=10, min_samples=10) == reason


@pytest.mark.parametrize(
    "description",
    [
        None,
        [1, 2],
        {},
        {**FIT, "samples": True},
        {**FIT, "samples": "20"},
        {**FIT, "samples": -1},
        {**FIT, "shape": "1x40"},
        {**FIT, "shape": []},
        {**FIT, "shape": [1, 0]},
        {**FIT, "shape": [1.0, 40]},
        {**FIT, "labels": None},
        {**FIT, "labels": [0, -1]},
        {**FIT, "labels": [0, "1"]},
        {**FIT, "labels": []},
        {**FIT, "samples": 2, "labels": [0, 1, 2]},
    ],
)
def test_misfit_reports_a_malformed_description_without_raising(description: object) -> None:
    reason = misfit(description, (1, 40), classes=10, min_samples=10)  # type: ignore[arg-type]
    assert reason is not None and reason.startswith("the device's data description is malformed")


# ---------------------------------------------------------------- local split


LABELS = np.repeat(np.arange(5), [30, 12, 5, 2, 1])


def test_split_is_deterministic_for_seed_and_agent() -> None:
    data = own(LABELS)
    a, b = split_own_data(data, 7, "pi-1"), split_own_data(data, 7, "pi-1")
    assert indices(a) == indices(b)
    assert torch.equal(a.y_train, b.y_train)
    assert indices(split_own_data(data, 7, "pi-2")) != indices(a)
    assert indices(split_own_data(data, 8, "pi-1")) != indices(a)


def test_split_is_disjoint_covers_all_and_is_stratified() -> None:
    data = own(LABELS)
    split = split_own_data(data, 0, "pi")
    train, val, test = indices(split)
    assert not (train & val or train & test or val & test)
    assert train | val | test == set(range(len(LABELS)))
    for x, y in [
        (split.x_train, split.y_train),
        (split.x_val, split.y_val),
        (split.x_test, split.y_test),
    ]:
        assert y.tolist() == LABELS[x[:, 0].long().numpy()].tolist()  # labels travel with x
    train_labels, test_labels = set(split.y_train.tolist()), set(split.y_test.tolist())
    assert train_labels == {0, 1, 2, 3, 4}  # every label keeps a training sample
    assert {0, 1, 2} <= test_labels  # every label with >= 5 samples is tested
    counts = [len(s) for s in (train, val, test)]
    assert counts == [35, 5, 10]  # test 6+2+1+1+0, val 3+1+1+0+0 (0.5 rounds up)


def test_split_of_tiny_data() -> None:
    two_classes = split_own_data(own([0, 0, 1]), 0, "pi")
    assert [len(s) for s in indices(two_classes)] == [2, 0, 1]
    assert sorted(two_classes.y_train.tolist()) == [0, 1]
    one_class = split_own_data(own([4, 4, 4]), 0, "pi")
    assert [len(s) for s in indices(one_class)] == [1, 1, 1]  # val falls back to one sample
    single = split_own_data(own([2]), 0, "pi")
    assert [len(s) for s in indices(single)] == [1, 0, 0]


def test_split_rejects_impossible_fractions() -> None:
    with pytest.raises(ValueError, match="sum < 1"):
        split_own_data(own([0, 1]), 0, "pi", test_fraction=0.6, val_fraction=0.4)


def test_own_data_rejects_malformed_arrays() -> None:
    x = np.zeros((4, 2), dtype=np.float32)
    with pytest.raises(ValueError, match="mem: x must be float32"):
        OwnData("mem", x.astype(np.float64), np.zeros(4, np.int64))
    with pytest.raises(ValueError, match="mem: x must be C-contiguous"):
        OwnData("mem", np.asfortranarray(np.zeros((4, 2, 3), np.float32)), np.zeros(4, np.int64))
    with pytest.raises(ValueError, match="mem: no samples"):
        OwnData("mem", x[:0], np.zeros(0, np.int64))
