"""A device's own data (`edge-agent --data PATH`): loaded whole, described, checked against a
run, and split locally into train, validation and test.

None of it leaves the device: the agent publishes only `OwnData.describe()` (sample count,
sample shape, the labels present), so that the coordinator can tell before a run whether the
device's data fits the run's model (`misfit`). The split is seeded by the run's seed and the
agent's id, so a restarted agent trains and tests on exactly what it did before.
"""

from __future__ import annotations

import csv
import hashlib
import math
import reprlib
import zipfile
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import numpy as np
import torch

from agent.data import load_imagefolder
from agent.learning import LocalData

LABEL_COLUMN = "label"
FORMATS = "an .npz file (x, y), a .csv file (feature columns and a 'label' column) or a folder"
"""What --data accepts, for error messages."""
_SHOWN_LABELS = 4


@dataclass(frozen=True, eq=False)
class OwnData:
    """All of one device's samples: x float32 (n, *input_shape), C-contiguous and finite;
    y int64 class indices >= 0. Construction validates, so every loader's output is sound.
    Compares by identity (arrays have no single truth value)."""

    path: str
    x: np.ndarray
    y: np.ndarray

    def __post_init__(self) -> None:
        x, y = self.x, self.y
        if x.dtype != np.float32 or y.dtype != np.int64:
            raise ValueError(
                f"{self.path}: x must be float32 and y int64, got {x.dtype}, {y.dtype}"
            )
        if x.ndim < 2 or y.ndim != 1:
            raise ValueError(
                f"{self.path}: x must have shape (samples, ...) and y (samples,), "
                f"got {x.shape} and {y.shape}"
            )
        if len(x) != len(y):
            raise ValueError(f"{self.path}: x has {len(x)} samples but y has {len(y)} labels")
        if len(y) == 0:
            raise ValueError(f"{self.path}: no samples")
        if y.min() < 0:
            raise ValueError(f"{self.path}: labels must be class indices >= 0, got {y.min()}")
        if not x.flags.c_contiguous:
            raise ValueError(f"{self.path}: x must be C-contiguous")
        if not np.isfinite(x).all():
            raise ValueError(f"{self.path}: x holds NaN or infinite values")

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.x.shape[1:])

    @property
    def samples(self) -> int:
        return len(self.y)

    @property
    def labels(self) -> tuple[int, ...]:
        """The distinct labels present, sorted."""
        return tuple(int(label) for label in np.unique(self.y))

    def describe(self) -> dict[str, Any]:
        """What the agent publishes of its data: enough to check the fit to a run, and no
        more (no per-class counts, which would reveal the device's label mix)."""
        return {
            "samples": self.samples,
            "shape": list(self.input_shape),
            "labels": list(self.labels),
        }


# ---------------------------------------------------------------- loading


def load_own_data(path: str | Path, input_shape: tuple[int, ...] | None = None) -> OwnData:
    """The data at `path`, whole; ValueError with one line naming the file if it is unusable.

    - A folder: one sub-folder of images per class (see `_read_images`). Images are decoded
      to `input_shape` = (C, H, W), C 1 for grayscale or 3 for RGB, when given; else to
      `load_imagefolder`'s default, 3x32x32.
    - `.npz`: arrays `x` (n, ...) channels first, any numeric type (uint8 is scaled to
      [0, 1], as `load_npz` does), and `y` (n,) integer labels. No pickles are loaded.
    - `.csv`: a header row; a `label` column of integer class indices and numeric feature
      columns, giving x of shape (n, features) (see `_read_csv`).

    `input_shape` shapes only images: .npz and .csv samples keep their stored shape, which
    `misfit` compares with the run's.
    """
    file = Path(path)
    if file.is_dir():
        x, y = _read_images(file, input_shape)
    elif not file.exists():
        raise ValueError(f"{file}: no such file or folder; --data takes {FORMATS}")
    elif file.suffix.lower() == ".npz":
        x, y = _read_npz(file)
    elif file.suffix.lower() == ".csv":
        x, y = _read_csv(file)
    else:
        raise ValueError(f"{file}: unknown data format {file.suffix!r}; --data takes {FORMATS}")
    return OwnData(str(file), x, y)


def _read_npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """x as C-ordered float32 (uint8 scaled to [0, 1]) and y as int64, from an .npz."""
    try:
        if not zipfile.is_zipfile(path):  # np.load would also take .npy and pickles
            raise ValueError("not a zip archive of named arrays")
        with np.load(path, allow_pickle=False) as npz:
            missing = sorted({"x", "y"} - set(npz.files))
            x, y = (None, None) if missing else (npz["x"], npz["y"])
    except (OSError, EOFError, ValueError, zipfile.BadZipFile, zlib.error) as exc:
        raise ValueError(f"{path}: not a readable .npz archive ({exc})") from None
    if x is None or y is None:
        raise ValueError(f"{path}: missing array(s) {missing}; it must hold x and y")
    if x.dtype.kind not in "iuf":
        raise ValueError(f"{path}: x must be numeric, got {x.dtype}")
    if y.dtype.kind not in "iu":
        raise ValueError(f"{path}: y must hold integer class labels, got {y.dtype}")
    if y.dtype == np.uint64 and len(y) and y.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{path}: label {y.max()} is too large")
    xf = np.array(x, dtype=np.float32, order="C")
    if x.dtype == np.uint8:
        xf /= 255.0
    return xf, y.astype(np.int64)


def _read_csv(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """x (n, features) float32 and y int64 from a .csv with a header row; blank lines are
    skipped, and a bad cell is named by its line and column."""
    xs: list[list[float]] = []
    ys: list[int] = []
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            rows = csv.reader(f)
            header = [name.strip() for name in next(rows, [])]
            at = _label_index(path, header)
            for row in rows:
                if not any(cell.strip() for cell in row):
                    continue
                where = f"{path}: line {rows.line_num}"
                if len(row) != len(header):
                    raise ValueError(f"{where} has {len(row)} cells, the header has {len(header)}")
                ys.append(_parse_label(where, row[at]))
                xs.append(
                    [
                        _parse_feature(where, name, cell)
                        for i, (name, cell) in enumerate(zip(header, row, strict=True))
                        if i != at
                    ]
                )
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a UTF-8 text file") from None
    except csv.Error as exc:
        raise ValueError(f"{path}: not a readable .csv file ({exc})") from None
    if not ys:
        raise ValueError(f"{path}: no samples below the header row")
    return np.asarray(xs, dtype=np.float32), np.asarray(ys, dtype=np.int64)


def _label_index(path: Path, header: list[str]) -> int:
    """Position of the one `label` column; at least one feature column must remain."""
    if header.count(LABEL_COLUMN) != 1:
        found = ", ".join(header) if header else "nothing"
        raise ValueError(
            f"{path}: the header row must name exactly one {LABEL_COLUMN!r} column (found: {found})"
        )
    if len(header) < 2:
        raise ValueError(f"{path}: no feature columns beside {LABEL_COLUMN!r}")
    return header.index(LABEL_COLUMN)


def _parse_label(where: str, cell: str) -> int:
    """An integer class label; '3.0' is accepted as 3 (spreadsheets write integers so)."""
    try:
        value = float(cell)
    except ValueError:
        value = math.nan
    if not value.is_integer() or abs(value) >= 2**62:
        raise ValueError(
            f"{where}, column {LABEL_COLUMN!r}: {cell.strip()!r} is not an integer class label"
        )
    return int(value)


def _parse_feature(where: str, column: str, cell: str) -> float:
    try:
        value = float(cell)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ValueError(f"{where}, column {column!r}: {cell.strip()!r} is not a finite number")
    return value


def _read_images(path: Path, input_shape: tuple[int, ...] | None) -> tuple[np.ndarray, np.ndarray]:
    """Images in one sub-folder per class, decoded by `load_imagefolder`.

    Labels: if every sub-folder is named by a non-negative integer (`0`, `3`, ...), that
    integer is its label, so a device that lacks some classes still labels the others right.
    Otherwise the label is the folder's position among the sorted names, which is correct
    only if every device has the same class folders: a device missing one would shift the
    labels of all later classes. Prefer integer names on devices.
    """
    options: dict[str, Any] = {}
    if input_shape is not None:
        shape = tuple(input_shape)
        if len(shape) != 3 or shape[0] not in (1, 3) or min(shape) < 1:
            raise ValueError(
                f"{path}: an image folder gives samples of shape (1 or 3, H, W), "
                f"the run's model takes {shape}"
            )
        options = {"size": (shape[1], shape[2]), "grayscale": shape[0] == 1}
    dataset = load_imagefolder(path, **options)
    names = dataset.class_names
    if not all(name.isascii() and name.isdigit() for name in names):
        return dataset.x, dataset.y
    labels = np.array([int(name) for name in names], dtype=np.int64)
    if len(set(labels.tolist())) != len(labels):
        raise ValueError(f"{path}: two class folders name the same label: {list(names)}")
    return dataset.x, labels[dataset.y]


# ---------------------------------------------------------------- fit to a run


def misfit(
    description: Mapping[str, Any], input_shape: Sequence[int], classes: int, min_samples: int
) -> str | None:
    """None if data so described fits the run; else one sentence saying why not.

    `description` is what an agent published (`OwnData.describe`) and is not trusted: a
    missing or wrongly typed field gives a reason too, never an exception.
    """
    parsed = _parse_description(description)
    if isinstance(parsed, str):
        return f"the device's data description is malformed: {parsed}"
    samples, shape, labels = parsed
    wanted = tuple(int(d) for d in input_shape)
    if shape != wanted:
        return f"samples have shape {shape}, the run's model takes {wanted}"
    outside = [label for label in labels if label >= classes]
    if outside:
        return f"{_some_labels(outside)} outside the run's {classes} classes"
    if samples < min_samples:
        return (
            f"{samples} sample{'' if samples == 1 else 's'}, the run needs at least {min_samples}"
        )
    return None


def _parse_description(description: object) -> tuple[int, tuple[int, ...], list[int]] | str:
    """(samples, shape, labels) of an untrusted description, or what is wrong with it."""
    if not isinstance(description, Mapping):
        return f"expected a mapping, got {type(description).__name__}"
    samples, shape, labels = (description.get(k) for k in ("samples", "shape", "labels"))
    if not _is_count(samples):
        return f"'samples' must be an integer >= 0, got {reprlib.repr(samples)}"
    if (
        not isinstance(shape, list | tuple)
        or not shape
        or not all(_is_count(d) and d > 0 for d in shape)
    ):
        return f"'shape' must be a list of positive integers, got {reprlib.repr(shape)}"
    if not isinstance(labels, list | tuple) or not all(_is_count(label) for label in labels):
        return f"'labels' must be a list of integers >= 0, got {reprlib.repr(labels)}"
    if len(labels) > samples or (samples > 0 and not labels):
        return f"{len(labels)} distinct labels for {samples} samples"
    return samples, tuple(shape), sorted(set(labels))


def _is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _some_labels(labels: list[int]) -> str:
    """'label 12 lies', 'labels 12 and 15 lie', 'labels 10, 11, 12, 13 and 5 more lie'."""
    if len(labels) == 1:
        return f"label {labels[0]} lies"
    shown = [str(label) for label in labels[:_SHOWN_LABELS]]
    rest = len(labels) - len(shown)
    last = f"{rest} more" if rest else shown.pop()
    return f"labels {', '.join(shown)} and {last} lie"


# ---------------------------------------------------------------- local split


def split_own_data(
    data: OwnData,
    seed: int,
    agent_id: str,
    *,
    test_fraction: float = 0.2,
    val_fraction: float = 0.1,
) -> LocalData:
    """Train, validation and test sets of `data`, stratified by label.

    Seeded by sha256(seed, agent_id): a restarted agent splits the same way, and two devices
    holding identical data still split differently. Per label, the samples are shuffled, then:
    - test takes round(n * test_fraction) (halves up), but at least 1 and at most n - 1: a
      label's last sample always stays in train, and a label with a single sample goes to
      train only (so test is empty only when every label has a single sample);
    - val takes round(n * val_fraction) of what remains, again leaving one for train;
    - the rest is train, so train holds every label present and is never empty.
    If val comes out empty overall, one training sample of the label with the most training
    samples (the smallest such label) moves to val, provided that label keeps one.
    """
    if not (test_fraction > 0 and val_fraction >= 0 and test_fraction + val_fraction < 1):
        raise ValueError(
            f"need 0 < test_fraction, 0 <= val_fraction and a sum < 1, got "
            f"{test_fraction} and {val_fraction}"
        )
    rng = np.random.default_rng(_split_seed(seed, agent_id))
    train, val, test = [], [], []
    for label in data.labels:
        idx = rng.permutation(np.flatnonzero(data.y == label))
        n = len(idx)
        n_test = min(max(_round_half_up(n * test_fraction), 1), n - 1)
        n_val = min(_round_half_up(n * val_fraction), n - 1 - n_test)
        test.append(idx[:n_test])
        val.append(idx[n_test : n_test + n_val])
        train.append(idx[n_test + n_val :])
    if not sum(len(part) for part in val):
        k = max(range(len(train)), key=lambda i: len(train[i]))
        if len(train[k]) > 1:
            val[k], train[k] = train[k][-1:], train[k][:-1]
    sets = [_tensors(data, np.sort(np.concatenate(parts))) for parts in (train, test, val)]
    return LocalData(*sets[0], *sets[1], *sets[2])


def _split_seed(seed: int, agent_id: str) -> int:
    digest = hashlib.sha256(f"own-data-split\0{seed}\0{agent_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def _round_half_up(value: float) -> int:
    return math.floor(value + 0.5)


def _tensors(data: OwnData, idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.from_numpy(data.x[idx]), torch.from_numpy(data.y[idx])
