"""A device's own data (`edge-agent --data PATH`): loaded whole, described, checked against a
run, and split locally into train, validation and test.

None of it leaves the device: the agent publishes only `OwnData.describe()` (sample count,
sample shape, the labels present, or the targets per sample of data without labels), so that
the coordinator can tell before a run whether the device's data fits the run's model
(`misfit`). Data may hold class labels, regression targets, or x alone (reconstruction).
The split is seeded by the run's seed and the agent's id, so a restarted agent trains and
tests on exactly what it did before.
"""

from __future__ import annotations

import array
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

from agent.data import (
    PYTHON_SOURCE,
    TASKS,
    BadDataFile,
    call_data_source,
    check_file_size,
    check_npz_members,
    load_imagefolder,
    max_data_bytes,
    too_large,
)
from agent.learning import LocalData

LABEL_COLUMN = "label"
TARGET_COLUMN = "target"
FORMATS = (
    "an .npz file (x, and y if any), a .csv file (feature columns and a 'label' or 'target' "
    "column), a folder, or python:MODULE:FUNCTION"
)
"""What --data accepts, for error messages."""
_SHOWN_LABELS = 4


@dataclass(frozen=True, eq=False)
class OwnData:
    """All of one device's samples: x float32 (n, *input_shape), C-contiguous and finite, and
    y either int64 class indices >= 0 (n,) or float32 targets, finite, of shape (n,) or
    (n, d), d = 0 for samples without targets (reconstruction). Construction validates, so
    every loader's output is sound. Compares by identity (arrays have no single truth value).
    `path` is the file, folder or python: source the data came from."""

    path: str
    x: np.ndarray
    y: np.ndarray

    def __post_init__(self) -> None:
        x, y = self.x, self.y
        if x.dtype != np.float32 or y.dtype not in (np.int64, np.float32):
            raise ValueError(
                f"{self.path}: x must be float32 and y int64 (labels) or float32 (targets), "
                f"got {x.dtype}, {y.dtype}"
            )
        if x.ndim < 2 or not (y.ndim == 1 or (y.ndim == 2 and not self.has_labels)):
            raise ValueError(
                f"{self.path}: x must have shape (samples, ...) and y (samples,) or, for "
                f"targets, (samples, d), got {x.shape} and {y.shape}"
            )
        if len(x) != len(y):
            kind = "labels" if self.has_labels else "targets"
            raise ValueError(f"{self.path}: x has {len(x)} samples but y has {len(y)} {kind}")
        if len(y) == 0:
            raise ValueError(f"{self.path}: no samples")
        if self.has_labels and y.min() < 0:
            raise ValueError(f"{self.path}: labels must be class indices >= 0, got {y.min()}")
        if not self.has_labels and not np.isfinite(y).all():
            raise ValueError(f"{self.path}: y holds NaN or infinite targets")
        if not x.flags.c_contiguous:
            raise ValueError(f"{self.path}: x must be C-contiguous")
        if not np.isfinite(x).all():
            raise ValueError(f"{self.path}: x holds NaN or infinite values")

    @property
    def has_labels(self) -> bool:
        """Whether y holds class labels (int64); else float targets, maybe none."""
        return bool(self.y.dtype == np.int64)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.x.shape[1:])

    @property
    def samples(self) -> int:
        return len(self.y)

    @property
    def labels(self) -> tuple[int, ...]:
        """The distinct labels present, sorted; none for data without labels."""
        if not self.has_labels:
            return ()
        return tuple(int(label) for label in np.unique(self.y))

    @property
    def targets(self) -> int:
        """Targets per sample: 1 for y (n,), d for (n, d), 0 without any; 0 for labels."""
        if self.has_labels:
            return 0
        return 1 if self.y.ndim == 1 else int(self.y.shape[1])

    def describe(self) -> dict[str, Any]:
        """What the agent publishes of its data: enough to check the fit to a run, and no
        more (no per-class counts, which would reveal the device's label mix; no target
        statistics either). Labelled data: samples, shape, labels. Data without labels adds
        `targets` (per sample, 0 for none) and lists no labels, which is how `misfit` tells
        the two apart; a coordinator that predates targets finds such data malformed."""
        described: dict[str, Any] = {
            "samples": self.samples,
            "shape": list(self.input_shape),
            "labels": list(self.labels),
        }
        if not self.has_labels:
            described["targets"] = self.targets
        return described


# ---------------------------------------------------------------- loading


def load_own_data(path: str | Path, input_shape: tuple[int, ...] | None = None) -> OwnData:
    """The data at `path`, whole; ValueError with one line naming the file if it is unusable.

    - A folder: one sub-folder of images per class (see `_read_images`). Images are decoded
      to `input_shape` = (C, H, W), C 1 for grayscale or 3 for RGB, when given; else to
      `load_imagefolder`'s default, 3x32x32.
    - `.npz`: arrays `x` (n, ...) channels first, any numeric type (uint8 is scaled to
      [0, 1], as `load_npz` does), and `y`: (n,) integer labels, or float targets of shape
      (n,) or (n, d), or no `y` at all (samples alone, for reconstruction). No pickles are
      loaded.
    - `.csv`: a header row; a `label` column of integer class indices or a `target` column
      of float regression targets, and numeric feature columns, giving x of shape
      (n, features) (see `_read_csv`).
    - `python:MODULE:FUNCTION` or `python:./FILE.py:FUNCTION`: the user's callable (see
      `agent.data.call_data_source`), called without a seed and called again on every load,
      so that a device that collected more data trains on it next time.

    `input_shape` shapes only images: other samples keep their shape, which `misfit`
    compares with the run's. Data beyond the size limit (`agent.data.max_data_bytes`: 1 GiB
    unless EDGEFL_MAX_DATA_MB says otherwise) is refused before it is read or decompressed.
    """
    if str(path).startswith(PYTHON_SOURCE):
        x, y, _, _ = call_data_source(str(path)[len(PYTHON_SOURCE) :])
        if y is None:
            y = np.zeros((len(x), 0), np.float32)
        return OwnData(str(path), x, y)
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


def reloaded(data: OwnData, input_shape: tuple[int, ...] | None = None) -> OwnData:
    """`data` as it is now: a python: source is called again (it may hold more samples than
    when the agent started); data read from a file or folder is returned as it is."""
    if data.path.startswith(PYTHON_SOURCE):
        return load_own_data(data.path, input_shape)
    return data


def _read_npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """x as C-ordered float32 (uint8 scaled to [0, 1]) and y as int64 labels, float32
    targets, or float32 of shape (n, 0) when the archive has no y, from an .npz."""
    try:
        if not zipfile.is_zipfile(path):  # np.load would also take .npy and pickles
            raise ValueError("not a zip archive of named arrays")
        check_npz_members(path, ("x", "y"))
        with np.load(path, allow_pickle=False) as npz:
            x = npz["x"] if "x" in npz.files else None
            y = npz["y"] if "y" in npz.files else None
    except BadDataFile:
        raise
    except (OSError, EOFError, ValueError, zipfile.BadZipFile, zlib.error) as exc:
        raise ValueError(f"{path}: not a readable .npz archive ({exc})") from None
    if x is None:
        raise ValueError(f"{path}: missing array(s) ['x']; it must hold x (and y, if any)")
    if x.dtype.kind not in "iuf":
        raise ValueError(f"{path}: x must be numeric, got {x.dtype}")
    xf = np.array(x, dtype=np.float32, order="C")
    if x.dtype == np.uint8:
        xf /= 255.0
    if y is None:
        return xf, np.zeros((len(x), 0), np.float32)
    if y.dtype.kind == "f":
        with np.errstate(over="ignore"):  # too large for float32: inf, which OwnData refuses
            return xf, np.array(y, dtype=np.float32, order="C")
    if y.dtype.kind not in "iu":
        raise ValueError(
            f"{path}: y must hold integer class labels or float targets, got {y.dtype}"
        )
    if y.dtype == np.uint64 and len(y) and y.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{path}: label {y.max()} is too large")
    return xf, y.astype(np.int64)


def _read_csv(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """x (n, features) float32 and y from a .csv with a header row: int64 labels from a
    `label` column, or float32 targets (n,) from a `target` column. Blank lines are skipped,
    and a bad cell is named by its line and column. The file is refused before it is read
    when it exceeds the data size limit (`agent.data.max_data_bytes`), and read row by row
    into float32 (4 bytes a cell, where a list of floats takes 32)."""
    check_file_size(path)
    cells = array.array("f")
    labels: array.array[Any]
    limit = max_data_bytes()
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            rows = csv.reader(f)
            header = [name.strip() for name in next(rows, [])]
            at, column = _label_index(path, header)
            parse = _parse_label if column == LABEL_COLUMN else _parse_target
            labels = array.array("q" if column == LABEL_COLUMN else "f")
            for row in rows:
                if not any(cell.strip() for cell in row):
                    continue
                where = f"{path}: line {rows.line_num}"
                if len(row) != len(header):
                    raise ValueError(f"{where} has {len(row)} cells, the header has {len(header)}")
                labels.append(parse(where, row[at]))
                cells.extend(
                    _parse_feature(where, name, cell)
                    for i, (name, cell) in enumerate(zip(header, row, strict=True))
                    if i != at
                )
                if len(cells) * cells.itemsize > limit:
                    raise too_large(path, "its features as float32", None, limit)
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a UTF-8 text file") from None
    except csv.Error as exc:
        raise ValueError(f"{path}: not a readable .csv file ({exc})") from None
    if not labels:
        raise ValueError(f"{path}: no samples below the header row")
    x = np.frombuffer(cells, dtype=np.float32).reshape(len(labels), len(header) - 1)
    dtype = np.int64 if column == LABEL_COLUMN else np.float32
    return x, np.frombuffer(labels, dtype=dtype)


def _label_index(path: Path, header: list[str]) -> tuple[int, str]:
    """Position and name of the one `label` or `target` column; at least one feature column
    must remain."""
    found = [name for name in (LABEL_COLUMN, TARGET_COLUMN) if name in header]
    if len(found) != 1 or header.count(found[0]) != 1:
        names = ", ".join(header) if header else "nothing"
        raise ValueError(
            f"{path}: the header row must name exactly one {LABEL_COLUMN!r} column (class "
            f"labels) or one {TARGET_COLUMN!r} column (regression targets) (found: {names})"
        )
    column = found[0]
    if len(header) < 2:
        raise ValueError(f"{path}: no feature columns beside {column!r}")
    return header.index(column), column


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


def _parse_target(where: str, cell: str) -> float:
    """A regression target: any finite number that float32 can hold."""
    value = _parse_feature(where, TARGET_COLUMN, cell)
    if abs(value) > float(np.finfo(np.float32).max):
        raise ValueError(
            f"{where}, column {TARGET_COLUMN!r}: {cell.strip()!r} is too large for float32"
        )
    return value


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
    description: Mapping[str, Any],
    input_shape: Sequence[int],
    classes: int,
    min_samples: int,
    *,
    task: str | None = None,
    targets: int | None = None,
) -> str | None:
    """None if data so described fits the run; else one sentence saying why not.

    `description` is what an agent published (`OwnData.describe`) and is not trusted: a
    missing or wrongly typed field gives a reason too, never an exception. `task` is the
    run's; None judges by the data: labels must lie within `classes`, and data without
    labels (a description with `targets`) skips that check. classification needs labels;
    regression needs targets (labels count as one target each), as many per sample as
    `targets` when given; reconstruction reads x alone, so labels and targets do not matter.
    """
    parsed = parse_description(description)
    if isinstance(parsed, str):
        return f"the device's data description is malformed: {parsed}"
    samples, shape, labels, described = parsed
    wanted = tuple(int(d) for d in input_shape)
    if shape != wanted:
        return f"samples have shape {shape}, the run's model takes {wanted}"
    problem = _task_misfit(labels, described, classes, task, targets)
    if problem is not None:
        return problem
    if samples < min_samples:
        return (
            f"{samples} sample{'' if samples == 1 else 's'}, the run needs at least {min_samples}"
        )
    return None


def _task_misfit(
    labels: list[int], described: int | None, classes: int, task: str | None, outputs: int | None
) -> str | None:
    """Why y so described does not serve the run's task, or None; `described` is the
    description's targets per sample, None for labelled data."""
    if task not in (None, *TASKS):
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    if task == "reconstruction":
        return None
    if task == "regression":
        per_sample = 1 if described is None else described
        if per_sample == 0:
            return "the data has no targets y, and a regression run needs them"
        if outputs is not None and per_sample != outputs:
            plural = "" if per_sample == 1 else "s"
            return f"{per_sample} target{plural} per sample, the run's model predicts {outputs}"
        return None
    if described is not None:
        return "the data has no class labels, and a classification run needs them" if task else None
    outside = [label for label in labels if label >= classes]
    if outside:
        return f"{_some_labels(outside)} outside the run's {classes} classes"
    return None


def parse_description(
    description: object,
) -> tuple[int, tuple[int, ...], list[int], int | None] | str:
    """(samples, shape, labels, targets) of an untrusted description, or what is wrong with
    it; targets is None for labelled data (a description without `targets`)."""
    if not isinstance(description, Mapping):
        return f"expected a mapping, got {type(description).__name__}"
    samples, shape, labels = (description.get(k) for k in ("samples", "shape", "labels"))
    targets = description.get("targets")
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
    if targets is not None:
        if not _is_count(targets):
            return f"'targets' must be an integer >= 0, got {reprlib.repr(targets)}"
        if labels:
            return f"{len(labels)} labels beside 'targets', which data without labels has"
        return samples, tuple(shape), [], targets
    if len(labels) > samples or (samples > 0 and not labels):
        return f"{len(labels)} distinct labels for {samples} samples"
    return samples, tuple(shape), sorted(set(labels)), None


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
    """Train, validation and test sets of `data`, stratified by label (data without labels
    counts as a single label: a seeded random split of the same sizes).

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
    strata = data.y if data.has_labels else np.zeros(data.samples, np.int64)
    train, val, test = [], [], []
    for label in np.unique(strata):
        idx = rng.permutation(np.flatnonzero(strata == label))
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


def own_for_task(data: OwnData, task: str) -> OwnData:
    """`data` as `task` uses it, as `agent.data.for_task` does a dataset: classification
    needs labels; regression takes targets as they are and labels as float32 targets (n,);
    reconstruction drops y (float32 of shape (n, 0)). ValueError, one line, otherwise."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    if task == "classification" and not data.has_labels:
        raise ValueError(
            f"{data.path}: a classification run needs y to be integer class labels, and this "
            "data has none"
        )
    if task == "regression" and not data.has_labels and data.targets == 0:
        raise ValueError(f"{data.path}: regression needs targets y, and this data has none")
    if task == "regression" and data.has_labels:
        return OwnData(data.path, data.x, data.y.astype(np.float32))
    if task == "reconstruction" and data.y.shape != (data.samples, 0):
        return OwnData(data.path, data.x, np.zeros((data.samples, 0), np.float32))
    return data


def _split_seed(seed: int, agent_id: str) -> int:
    digest = hashlib.sha256(f"own-data-split\0{seed}\0{agent_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def _round_half_up(value: float) -> int:
    return math.floor(value + 0.5)


def _tensors(data: OwnData, idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.from_numpy(data.x[idx]), torch.from_numpy(data.y[idx])
