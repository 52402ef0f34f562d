"""Datasets and their partition across a fleet: pure functions, deterministic for a seed.

A `Dataset` is one pool of samples: labelled (classification), with float targets (regression)
or with x alone (reconstruction; see `for_task`). `partition` splits it into a train pool and a
test pool, deals the train pool out to the agents (IID, Dirichlet label skew, pathological
classes, or the dataset's natural groups), splits each agent's share into train and validation,
and draws each agent a test set with its own label mix. Every agent process of a fleet can run
the same call with the same seed and keep its own entry, so the data never has to travel.
Samples without labels count as one class throughout, so their splits are plain seeded shuffles.
"""

from __future__ import annotations

import codecs
import inspect
import logging
import math
import os
import pickle
import random
import threading
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path

import numpy as np
import platformdirs

from agent.files import atomic_write
from agent.learning.config import TASKS
from protocol.extras import DATASETS, LAB_EXTRA, require

log = logging.getLogger(__name__)

BUILTIN_DATASETS = ("digits", "mnist1d", "synthetic")
USER_DATASETS = ("npz", "imagefolder", "cifar10")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
CIFAR10_FILES = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)
CIFAR10_CLASSES = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)


@dataclass(frozen=True, eq=False)
class Dataset:
    """A pool of samples: x float32 of shape (n, *input_shape) and one of three kinds of y:

    - int64 labels (n,) in [0, num_classes), num_classes >= 2 (classification);
    - float32 targets (n,) or (n, d), all finite, num_classes 0 (regression);
    - float32 of shape (n, 0), num_classes 0: no targets at all (reconstruction).

    `groups` (int64 per sample, or None) names the source each sample came from (the device
    that generated it in `synthetic`); the `natural` partition deals whole groups to agents.
    `test` (bool per sample, or None) marks the samples a source set aside for testing: they
    are the held-out pool, never anyone's training data (`partition`).
    Construction validates everything, so no loader can hand out a malformed dataset.
    Datasets, splits and agent data compare by identity (arrays have no single truth value).
    """

    name: str
    x: np.ndarray
    y: np.ndarray
    num_classes: int
    input_shape: tuple[int, ...]
    class_names: tuple[str, ...] = ()
    groups: np.ndarray | None = field(default=None, repr=False)
    test: np.ndarray | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.x.dtype != np.float32 or self.y.dtype not in (np.int64, np.float32):
            raise ValueError(
                f"{self.name}: x must be float32 and y int64 (labels) or float32 (targets), "
                f"got {self.x.dtype} and {self.y.dtype}"
            )
        if self.has_labels:
            self._check_labels()
        else:
            self._check_targets()
        if tuple(self.x.shape[1:]) != tuple(self.input_shape):
            raise ValueError(
                f"{self.name}: samples have shape {self.x.shape[1:]}, expected {self.input_shape}"
            )
        if self.groups is not None and self.groups.shape != (len(self.x),):
            raise ValueError(f"{self.name}: groups must have one entry per sample")
        if self.test is not None and (self.test.shape != (len(self.x),) or self.test.all()):
            raise ValueError(
                f"{self.name}: test must mark each sample (True: held out for testing) and "
                "leave some to train on"
            )
        if not np.isfinite(self.x).all():
            raise ValueError(f"{self.name}: x holds NaN or infinite values")
        if self.x.strides != _standard_strides(self.x):
            # PyTorch picks kernels by strides, even those of size-1 dimensions: the same
            # values laid out as (160, 0, 4) or (160, 160, 4) train to different last bits.
            object.__setattr__(self, "x", np.array(self.x, order="C"))

    def _check_labels(self) -> None:
        """y int64: one label per sample, in [0, num_classes), with names to match."""
        if self.y.ndim != 1 or len(self.x) != len(self.y):
            raise ValueError(
                f"{self.name}: x has {len(self.x)} samples but y has shape "
                f"{self.y.shape}; need one label per sample"
            )
        if len(self.y) == 0:
            raise ValueError(f"{self.name}: no samples")
        if self.num_classes < 2 or self.y.min() < 0 or self.y.max() >= self.num_classes:
            raise ValueError(
                f"{self.name}: labels must lie in [0, {self.num_classes}) with at "
                f"least 2 classes, got [{self.y.min()}, {self.y.max()}]"
            )
        if self.class_names and len(self.class_names) != self.num_classes:
            raise ValueError(
                f"{self.name}: {len(self.class_names)} class names for {self.num_classes} classes"
            )

    def _check_targets(self) -> None:
        """y float32: one finite target (or row of targets, maybe empty) per sample, and no
        classes. A target row is made C-ordered, as x is, so batches slice it alike."""
        if self.y.ndim not in (1, 2) or len(self.x) != len(self.y):
            raise ValueError(
                f"{self.name}: x has {len(self.x)} samples but y has shape "
                f"{self.y.shape}; need one target or row of targets per sample"
            )
        if len(self.y) == 0:
            raise ValueError(f"{self.name}: no samples")
        if self.num_classes or self.class_names:
            raise ValueError(
                f"{self.name}: float targets y come with num_classes 0 and no class names, "
                f"got {self.num_classes} classes"
            )
        if not np.isfinite(self.y).all():
            raise ValueError(f"{self.name}: y holds NaN or infinite targets")
        if self.y.strides != _standard_strides(self.y):
            object.__setattr__(self, "y", np.array(self.y, order="C"))

    @property
    def has_labels(self) -> bool:
        """Whether y holds class labels (int64); else float targets, maybe none."""
        return bool(self.y.dtype == np.int64)

    def __len__(self) -> int:
        return len(self.x)


def _standard_strides(a: np.ndarray) -> tuple[int, ...]:
    """The strides of a freshly allocated C-ordered array of a's shape and dtype."""
    strides, step = [], a.itemsize
    for size in reversed(a.shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


@dataclass(frozen=True, eq=False)
class Split:
    """Samples of one agent's split; `idx` are their positions in the source Dataset, and y
    has the source's dtype and row shape (labels, targets or (k, 0) for none)."""

    x: np.ndarray
    y: np.ndarray
    idx: np.ndarray

    def __len__(self) -> int:
        return len(self.x)


@dataclass(frozen=True, eq=False)
class AgentData:
    """One agent's data: train and val come from its share, test from the held-out pool.
    `num_classes` is the dataset's (0 without labels)."""

    agent: int
    train: Split
    val: Split
    test: Split
    num_classes: int
    input_shape: tuple[int, ...]


def label_counts(y: np.ndarray, num_classes: int) -> np.ndarray:
    """Number of samples per class, length num_classes (labels only: for a dataset without
    them, count `strata_of(dataset)` over 1 class)."""
    return np.bincount(y, minlength=num_classes)


def strata_of(dataset: Dataset) -> tuple[np.ndarray, int]:
    """What splits are stratified by, and how many values it takes: the labels and
    num_classes of a labelled dataset; for one without labels, a single class 0 for every
    sample, so that the stratified splits become plain seeded shuffles (and labelled
    datasets split exactly as they always did)."""
    if dataset.has_labels:
        return dataset.y, dataset.num_classes
    return np.zeros(len(dataset), np.int64), 1


# ---------------------------------------------------------------- built-in datasets


def load_digits() -> Dataset:
    """scikit-learn's 1,797 8x8 handwritten digits as 1x8x8 images in [0, 1] (bundled, no
    download; the data is fixed, so there is nothing to seed)."""
    from sklearn.datasets import load_digits as sk_digits

    bunch = sk_digits()
    x = (bunch.images / 16.0).astype(np.float32)[:, None, :, :]
    return Dataset(
        "digits", x, bunch.target.astype(np.int64), 10, (1, 8, 8), tuple(str(c) for c in range(10))
    )


_GLOBAL_RNG = threading.Lock()
"""Held while MNIST-1D is generated from the global numpy and random RNGs."""


def load_mnist1d(seed: int) -> Dataset:
    """MNIST-1D generated locally: its default 4,000 + 1,000 samples merged into one pool of
    shape 1x40 (partition makes its own test split).

    Only `make_dataset` is called, which generates; `get_dataset` would download. It seeds the
    global `random` and `np.random` generators with args.seed, so both are saved and restored
    around the call, under a lock (agents sharing a process load at once): the result
    depends on `seed` alone and the caller's RNG state is untouched (other code must not use
    the global numpy RNG in another thread meanwhile; edgefl's code never does).
    """
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.seed = seed
    with _GLOBAL_RNG:
        np_state, py_state = np.random.get_state(), random.getstate()
        try:
            data = make_dataset(args)
        finally:
            np.random.set_state(np_state)
            random.setstate(py_state)
    x = np.concatenate([data["x"], data["x_test"]]).astype(np.float32)[:, None, :]
    y = np.concatenate([data["y"], data["y_test"]]).astype(np.int64)
    return Dataset("mnist1d", x, y, 10, (1, x.shape[-1]), tuple(str(c) for c in range(10)))


def load_synthetic(
    seed: int,
    alpha: float = 1.0,
    beta: float = 1.0,
    groups: int = 30,
    samples_per_group: int = 200,
    dim: int = 60,
    num_classes: int = 10,
) -> Dataset:
    """Synthetic(alpha, beta) of the FedProx paper (Li et al., 2020): each group (device) k has
    its own logistic model and its own feature distribution, so groups are non-IID in both
    p(x) and p(y|x).

    u_k ~ N(0, alpha), W_k ~ N(u_k, 1) (dim x classes), b_k ~ N(u_k, 1); B_k ~ N(0, beta),
    v_k ~ N(B_k, 1) (dim), x ~ N(v_k, diag(j^-1.2)), y = argmax(x W_k + b_k). Unlike the
    paper's log-normal sizes, every group has `samples_per_group` samples so that agents are
    comparable. `groups` records each sample's group for the `natural` partition; other
    partitions treat the pool as one labelled set.
    """
    if alpha < 0 or beta < 0 or groups < 1:
        raise ValueError(
            f"synthetic needs alpha, beta >= 0 and groups >= 1, got {alpha}, {beta}, {groups}"
        )
    rng = np.random.default_rng(seed)
    scale = np.arange(1, dim + 1) ** -0.6  # std of x per feature: sqrt(j^-1.2)
    xs, ys = [], []
    for _ in range(groups):
        u = rng.normal(0.0, math.sqrt(alpha))
        w = rng.normal(u, 1.0, (dim, num_classes))
        b = rng.normal(u, 1.0, num_classes)
        v = rng.normal(rng.normal(0.0, math.sqrt(beta), dim), 1.0)
        x = v + rng.standard_normal((samples_per_group, dim)) * scale
        xs.append(x)
        ys.append(np.argmax(x @ w + b, axis=1))
    return Dataset(
        "synthetic",
        np.concatenate(xs).astype(np.float32),
        np.concatenate(ys).astype(np.int64),
        num_classes,
        (dim,),
        tuple(str(c) for c in range(num_classes)),
        np.repeat(np.arange(groups, dtype=np.int64), samples_per_group),
    )


# ---------------------------------------------------------------- size limits

MAX_DATA_ENV = "EDGEFL_MAX_DATA_MB"
DEFAULT_MAX_DATA_MB = 1024
"""How much of the user's data a process takes by default: a data file of at most this many
MB (1 MB = 2^20 bytes), whose samples as float32 take at most as much. A loader checks it
before it reads or decompresses anything, so a 2 GB csv or a small npz that expands to
gigabytes costs nothing but its error. Ten times CIFAR-10's train set, and more than a 4 GB
device can train on: a larger data set needs `EDGEFL_MAX_DATA_MB` (every program honours it)."""
MAX_IMAGE_PIXELS = 64 * 2**20
"""An image's width x height at most (a 64 MP photo decodes to 192 MB before its resize)."""
_MB = 2**20
_FLOAT32 = 4


class BadDataFile(ValueError):
    """A data file refused before it was read, by a message that names it already."""


def max_data_bytes() -> int:
    """The data size limit in bytes: `EDGEFL_MAX_DATA_MB` if set, else the default."""
    text = os.environ.get(MAX_DATA_ENV, "").strip()
    if not text:
        return DEFAULT_MAX_DATA_MB * _MB
    try:
        megabytes = float(text)
    except ValueError:
        megabytes = math.nan
    if not math.isfinite(megabytes) or megabytes <= 0:
        raise ValueError(f"{MAX_DATA_ENV}={text!r}: expected a positive number of MB")
    return int(megabytes * _MB)


def too_large(where: object, what: str, size: float | None, limit: int) -> BadDataFile:
    """The one-line error of data beyond the limit (`size` bytes, None: not known yet),
    saying how to raise it."""
    took = f"take {_megabytes(size)} MB, more" if size is not None else "take more"
    return BadDataFile(
        f"{where}: {what} {took} than the {_megabytes(limit)} MB allowed; "
        f"set {MAX_DATA_ENV} (MB) to allow more"
    )


def _megabytes(size: float) -> str:
    """`size` bytes in MB as a person reads them: 1,907; 0.86."""
    megabytes = size / _MB
    return f"{megabytes:,.0f}" if megabytes >= 10 else f"{megabytes:.2g}"


def check_file_size(path: Path, limit: int | None = None) -> None:
    """Refuse a data file larger than the limit before anything reads it."""
    limit = max_data_bytes() if limit is None else limit
    size = path.stat().st_size
    if size > limit:
        raise too_large(path, "the file's contents", size, limit)


def check_npz_members(path: Path, names: tuple[str, ...], limit: int | None = None) -> None:
    """Refuse an .npz whose arrays `names` would take more than the limit, as float32 or as
    they are, from each member's .npy header and the zip's own record of its size, before
    anything is decompressed (a zip of zeros expands a thousandfold). A header that declares
    more than its member holds is refused too: reading it would fail only at the end."""
    limit = max_data_bytes() if limit is None else limit
    total = 0
    with zipfile.ZipFile(path) as archive:
        members = {info.filename: info for info in archive.infolist()}
        for name in names:
            info = members.get(f"{name}.npy")
            if info is None:
                continue
            shape, dtype = _npy_header(path, name, archive, info)
            count = math.prod(shape)
            declared = count * dtype.itemsize
            if declared > info.file_size:
                raise BadDataFile(
                    f"{path}: {name} declares {declared:,} bytes but holds {info.file_size:,}"
                )
            total += max(declared, count * _FLOAT32)
    if total > limit:
        raise too_large(path, "its arrays", total, limit)


def _npy_header(
    path: Path, name: str, archive: zipfile.ZipFile, info: zipfile.ZipInfo
) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype an .npz member's .npy header declares (its first bytes alone are
    decompressed)."""
    try:
        with archive.open(info) as member:
            version = np.lib.format.read_magic(member)
            read_header = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, _, dtype = read_header(member)
    except ValueError as exc:
        raise BadDataFile(f"{path}: {name} is not a readable .npy array ({exc})") from None
    return tuple(shape), dtype


# ---------------------------------------------------------------- the user's own data


def load_npz(path: str | Path) -> Dataset:
    """An .npz with `x` (n, *input_shape), channels first, and optionally `y`:

    - integer y (n,): class labels, as ever; an optional scalar `num_classes` overrides
      max(y) + 1;
    - float y (n,) or (n, d): regression targets (cast to float32);
    - no y: samples alone, for reconstruction (y becomes float32 of shape (n, 0)).

    uint8 x is scaled to [0, 1]; other numeric types are used as they are. Loaded with
    allow_pickle=False: no code runs on load. Every problem is one line naming the file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"npz file not found: {path}")
    try:
        check_npz_members(path, ("x", "y", "num_classes"))
    except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        raise ValueError(f"{path}: not a readable .npz archive ({exc})") from None
    with np.load(path, allow_pickle=False) as npz:
        if "x" not in npz.files:
            raise ValueError(f"{path}: missing array(s) ['x']; found {npz.files}")
        x = npz["x"]
        y = npz["y"] if "y" in npz.files else None
        num_classes = int(npz["num_classes"]) if "num_classes" in npz.files else None
    if x.ndim < 2 or not np.issubdtype(x.dtype, np.number):
        raise ValueError(f"{path}: x must be numeric with shape (n, ...), got {x.dtype} {x.shape}")
    if len(x) == 0:
        raise ValueError(f"{path}: no samples")
    with np.errstate(over="ignore"):  # too large for float32: inf, refused below
        xf = x.astype(np.float32) / 255.0 if x.dtype == np.uint8 else x.astype(np.float32)
    if not np.isfinite(xf).all():
        raise ValueError(f"{path}: x holds NaN or infinite values")
    shape = tuple(x.shape[1:])
    if y is None:
        return Dataset("npz", xf, np.zeros((len(x), 0), np.float32), 0, shape)
    if y.dtype.kind == "f" and y.ndim in (1, 2):
        with np.errstate(over="ignore"):  # too large for float32: inf, refused below
            targets = y.astype(np.float32)
        if len(x) != len(y):
            raise ValueError(f"{path}: x has {len(x)} samples but y has {len(y)} targets")
        if not np.isfinite(targets).all():
            raise ValueError(f"{path}: y holds NaN or infinite targets (as float32)")
        return Dataset("npz", xf, targets, 0, shape)
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise ValueError(
            f"{path}: y must be a 1-D integer array (labels) or a float array of shape (n,) "
            f"or (n, d) (targets), got {y.dtype} {y.shape}"
        )
    if len(x) != len(y):
        raise ValueError(f"{path}: x has {len(x)} samples but y has {len(y)} labels")
    if len(y) and y.min() < 0:
        raise ValueError(f"{path}: labels must be >= 0, got {y.min()}")
    classes = num_classes if num_classes is not None else int(y.max()) + 1 if len(y) else 0
    return Dataset("npz", xf, y.astype(np.int64), classes, shape)


def load_imagefolder(
    path: str | Path, size: tuple[int, int] = (32, 32), grayscale: bool = False
) -> Dataset:
    """Images in one sub-folder per class (class index = sorted folder name), read with
    Pillow, resized to size = (height, width), as 1xHxW (grayscale) or 3xHxW in [0, 1].

    Files other than .png/.jpg/.jpeg and hidden entries are skipped.
    """
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("imagefolder datasets need Pillow: pip install pillow") from exc

    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"image folder not found: {root}")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if len(classes) < 2:
        raise ValueError(
            f"{root}: need one sub-folder per class and at least 2 classes, found {classes}"
        )
    mode = "L" if grayscale else "RGB"
    listed = _image_files(root, classes, (1 if grayscale else 3) * size[0] * size[1])
    xs, ys = [], []
    for label, files in enumerate(listed):
        for file in files:
            try:
                with Image.open(file) as img:
                    if img.width * img.height > MAX_IMAGE_PIXELS:
                        raise ValueError(
                            f"{file}: {img.width}x{img.height} pixels, more than the "
                            f"{MAX_IMAGE_PIXELS:,} an image may have"
                        )
                    image = img.convert(mode).resize((size[1], size[0]), Image.Resampling.BILINEAR)
                    arr = np.asarray(image, dtype=np.float32) / 255.0
            except (OSError, UnidentifiedImageError, Image.DecompressionBombError) as exc:
                raise ValueError(f"{file}: not a readable image ({exc})") from exc
            xs.append(arr[None] if grayscale else arr.transpose(2, 0, 1))
            ys.append(label)
    return Dataset(
        "imagefolder",
        np.stack(xs),
        np.asarray(ys, dtype=np.int64),
        len(classes),
        tuple(xs[0].shape),
        tuple(classes),
    )


def _image_files(root: Path, classes: list[str], values: int) -> list[list[Path]]:
    """Each class folder's image files, sorted; refused before any is decoded when their
    samples (`values` float32 each) would take more than the data size limit."""
    listed = []
    for name in classes:
        files = sorted(
            f
            for f in (root / name).iterdir()
            if f.suffix.lower() in IMAGE_SUFFIXES and not f.name.startswith(".")
        )
        if not files:
            raise ValueError(f"{root / name}: no {'/'.join(IMAGE_SUFFIXES)} images")
        listed.append(files)
    limit = max_data_bytes()
    size = sum(map(len, listed)) * values * _FLOAT32
    if size > limit:
        raise too_large(root, f"{sum(map(len, listed)):,} images as float32", size, limit)
    return listed


_RECONSTRUCT = np.empty(0).__reduce__()[0]  # numpy's array rebuilder, whatever its module


class _CifarUnpickler(pickle.Unpickler):
    """Resolves only what a CIFAR-10 batch holds (dicts, lists, bytes and one uint8 array),
    so a tampered file raises instead of running code."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"): _RECONSTRUCT,  # written by numpy 1.x
        ("numpy._core.multiarray", "_reconstruct"): _RECONSTRUCT,  # written by numpy 2.x
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("_codecs", "encode"): codecs.encode,  # bytes as pickled by Python 3, protocol 2
    }

    def find_class(self, module: str, name: str) -> object:
        try:
            return self._ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"forbidden global {module}.{name}") from None


def load_cifar10(path: str | Path) -> Dataset:
    """CIFAR-10 in its official python format from a local folder (or its
    cifar-10-batches-py sub-folder): every present file of data_batch_1..5 and test_batch,
    merged into one pool of 3x32x32 images in [0, 1] (partition makes its own test split).

    These files are pickles written by Python 2, so they are read with pickle and
    encoding='bytes'; this is done only for this user-supplied local format, never for
    anything received over the network, and through an unpickler that allows only numpy
    arrays, so a tampered file raises ValueError instead of running code.
    """
    root = Path(path)
    if (root / "cifar-10-batches-py").is_dir():
        root = root / "cifar-10-batches-py"
    if not root.is_dir():
        raise FileNotFoundError(f"CIFAR-10 folder not found: {root}")
    files = [root / name for name in CIFAR10_FILES if (root / name).is_file()]
    if not files:
        raise FileNotFoundError(f"{root}: none of the CIFAR-10 batches {CIFAR10_FILES}")
    xs, ys = [], []
    for file in files:
        check_file_size(file)
        try:
            with file.open("rb") as fh:
                batch = _CifarUnpickler(fh, encoding="bytes").load()
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as exc:
            raise ValueError(f"{file}: not a CIFAR-10 python batch ({exc})") from exc
        if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
            raise ValueError(f"{file}: expected a dict with b'data' and b'labels'")
        data, labels = np.asarray(batch[b"data"]), np.asarray(batch[b"labels"])
        if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
            raise ValueError(
                f"{file}: data must be uint8 of shape (n, 3072), got {data.dtype} {data.shape}"
            )
        if labels.shape != (len(data),):
            raise ValueError(f"{file}: {len(data)} images but labels of shape {labels.shape}")
        if not np.issubdtype(labels.dtype, np.integer) or labels.min() < 0 or labels.max() > 9:
            raise ValueError(f"{file}: labels must be integers in [0, 9]")
        xs.append(data.reshape(-1, 3, 32, 32))
        ys.append(labels.astype(np.int64))
    x = np.concatenate(xs).astype(np.float32) / 255.0
    return Dataset("cifar10", x, np.concatenate(ys), 10, (3, 32, 32), CIFAR10_CLASSES)


# ---------------------------------------------------------------- data from the user's code

PYTHON_SOURCE = "python:"
"""Prefix of a dataset spec naming a callable data source: python:MODULE:FUNCTION or
python:./FILE.py:FUNCTION (`load_python`)."""
_RETURNS = "x, (x, y) or a dict with 'x' and optional 'y', 'groups' and 'test'"


def call_data_source(
    spec: str, seed: int | None = None
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """x, y, groups and test from the callable `spec` names (MODULE:FUNCTION or
    ./FILE.py:FUNCTION, without the python: prefix): x float32 C-ordered, y int64 (integer
    labels) or float32 (targets) or None, groups int64 or None, test bool or None.

    The callable is called anew on every load, never cached: a device that collected more
    data since the last run trains on it in the next. It gets `seed=seed` if it takes a
    `seed` (and a seed is given), nothing otherwise, and returns x, (x, y), or a dict with
    "x" and optional "y", "groups" and "test" (True for a sample set aside for testing):
    numpy arrays or torch tensors. x is converted, not scaled (a source scales its own data).
    Whatever it raises or returns wrong becomes one ValueError line naming the source, never
    a traceback.
    """
    from agent.user_code import load_callable  # imports torch: only when used

    name = PYTHON_SOURCE + spec
    source = load_callable(spec, "data source")
    try:
        returned = source(**_seed_argument(source, seed))
    except Exception as exc:
        raise ValueError(
            f"data source {name} failed: {type(exc).__name__}: {_first_line(exc)}"
        ) from None
    x, y, groups, test = _unpack(name, returned)
    return _features(name, x), _targets(name, y), _groups(name, groups), _test(name, test)


def load_python(spec: str, seed: int) -> Dataset:
    """The dataset a callable data source returns (see `call_data_source`), named
    python:SPEC: integer y gives labels 0..max(y), float y targets, no y samples alone."""
    x, y, groups, test = call_data_source(spec, seed)
    name, shape = PYTHON_SOURCE + spec, tuple(x.shape[1:])
    if y is None:
        y = np.zeros((len(x), 0), np.float32)
    classes = int(y.max()) + 1 if y.dtype == np.int64 and y.size else 0
    return Dataset(name, x, y, classes, shape, (), groups, test)


def _seed_argument(source: Callable[..., object], seed: int | None) -> dict[str, int]:
    """{'seed': seed} if `source` takes a keyword `seed` (or any keyword), else {}."""
    if seed is None:
        return {}
    try:
        parameters = inspect.signature(source).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: call it bare
        return {}
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    takes = any(
        p.kind is inspect.Parameter.VAR_KEYWORD or (p.name == "seed" and p.kind in keyword)
        for p in parameters
    )
    return {"seed": seed} if takes else {}


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else "(no message)"


def _unpack(name: str, returned: object) -> tuple[object, object, object, object]:
    """(x, y, groups, test) of what a data source returned; all but x may be None."""
    if isinstance(returned, dict):
        keys = sorted(str(k) for k in returned)
        if "x" not in returned or set(keys) - {"x", "y", "groups", "test"}:
            raise ValueError(
                f"data source {name} returned a dict with keys {keys}; expected {_RETURNS}"
            )
        return returned["x"], returned.get("y"), returned.get("groups"), returned.get("test")
    if isinstance(returned, tuple):
        if len(returned) != 2:
            raise ValueError(
                f"data source {name} returned a tuple of {len(returned)} items; expected {_RETURNS}"
            )
        return returned[0], returned[1], None, None
    if not _is_array(returned):
        raise ValueError(
            f"data source {name} returned {type(returned).__name__}; expected {_RETURNS}"
        )
    return returned, None, None, None


def _is_array(value: object) -> bool:
    if isinstance(value, np.ndarray):
        return True
    import torch  # the data source's module has imported it if it made a tensor

    return isinstance(value, torch.Tensor)


def _as_numpy(name: str, what: str, value: object) -> np.ndarray:
    """A numpy array or a torch tensor as a numpy array (a tensor copied to the CPU)."""
    if isinstance(value, np.ndarray):
        return value
    if not _is_array(value):
        raise ValueError(
            f"data source {name} returned {what} as {type(value).__name__}; "
            "expected a numpy array or a torch tensor"
        )
    import torch

    assert isinstance(value, torch.Tensor)
    tensor = value.float() if value.dtype == torch.bfloat16 else value  # numpy has no bfloat16
    return tensor.numpy(force=True)


def _features(name: str, value: object) -> np.ndarray:
    x = _as_numpy(name, "x", value)
    if x.dtype.kind not in "iuf" or x.ndim < 2 or len(x) == 0:
        raise ValueError(
            f"data source {name} returned x of {x.dtype} {x.shape}; expected numbers of "
            "shape (n, ...) with n >= 1"
        )
    with np.errstate(over="ignore"):  # too large for float32: inf, which Dataset refuses
        return np.ascontiguousarray(x, dtype=np.float32)


def _targets(name: str, value: object) -> np.ndarray | None:
    """Integer y as int64 labels, floating y as float32 targets."""
    if value is None:
        return None
    y = _as_numpy(name, "y", value)
    if y.dtype.kind == "f":
        with np.errstate(over="ignore"):  # too large for float32: inf, which Dataset refuses
            return np.ascontiguousarray(y, dtype=np.float32)
    if y.dtype.kind in "iu" and (y.size == 0 or y.max() <= np.iinfo(np.int64).max):
        return y.astype(np.int64)
    raise ValueError(
        f"data source {name} returned y of {y.dtype}; expected integer class labels or "
        "float targets"
    )


def _groups(name: str, value: object) -> np.ndarray | None:
    if value is None:
        return None
    groups = _as_numpy(name, "groups", value)
    if groups.dtype.kind not in "iu" or groups.ndim != 1:
        raise ValueError(
            f"data source {name} returned groups of {groups.dtype} {groups.shape}; expected "
            "one integer per sample"
        )
    return groups.astype(np.int64)


def _test(name: str, value: object) -> np.ndarray | None:
    if value is None:
        return None
    test = _as_numpy(name, "test", value)
    if test.dtype != np.bool_ or test.ndim != 1:
        raise ValueError(
            f"data source {name} returned test of {test.dtype} {test.shape}; expected one "
            "boolean per sample (True: set aside for testing)"
        )
    return test


# ---------------------------------------------------------------- tasks


def for_task(dataset: Dataset, task: str) -> Dataset:
    """`dataset` as `task` uses it, or ValueError (one line) if it cannot serve it.

    classification needs integer labels and takes the dataset as it is; regression takes
    float targets as they are and labels as float32 targets (n,), but needs some y;
    reconstruction needs no y, so it is replaced by float32 of shape (n, 0) (groups kept),
    and every split then carries x alone.
    """
    _check_task(dataset, task)
    if task == "regression" and dataset.has_labels:
        return replace(dataset, y=dataset.y.astype(np.float32), num_classes=0, class_names=())
    if task == "reconstruction" and dataset.y.shape != (len(dataset), 0):
        empty = np.zeros((len(dataset), 0), np.float32)
        return replace(dataset, y=empty, num_classes=0, class_names=())
    return dataset


def num_outputs(dataset: Dataset, task: str) -> int:
    """How many values the model outputs per sample for `task` on `dataset`: its classes,
    its targets per sample (1 for y of shape (n,)), or the size of one sample
    (reconstruction); ValueError as `for_task` when the dataset cannot serve the task."""
    _check_task(dataset, task)
    if task == "classification":
        return dataset.num_classes
    if task == "reconstruction":
        return math.prod(dataset.input_shape)
    return 1 if dataset.y.ndim == 1 else int(dataset.y.shape[1])


def _check_task(dataset: Dataset, task: str) -> None:
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    has_none = dataset.y.ndim == 2 and dataset.y.shape[1] == 0
    if task == "classification" and not dataset.has_labels:
        what = "has no y" if has_none else f"has float targets of shape {dataset.y.shape}"
        raise ValueError(
            f"dataset {dataset.name!r} {what}, but classification needs y to be integer "
            "class labels"
        )
    if task == "regression" and has_none:
        raise ValueError(
            f"dataset {dataset.name!r} has no y, but regression needs targets y (float, of "
            "shape (n,) or (n, d))"
        )


def _numbers(spec: str, text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"bad dataset spec {spec!r}: {text!r} is not a list of numbers") from None


# ---------------------------------------------------------------- dataset cache

CACHE_ENV = "EDGEFL_CACHE_DIR"
CACHE_FORMAT = 1
"""Bump when a built-in dataset's preparation changes, so old cache files are not used."""


def cache_dir() -> Path | None:
    """Where built-in datasets are cached: $EDGEFL_CACHE_DIR, else the user cache directory;
    None (no cache) when the variable is set to an empty string."""
    configured = os.environ.get(CACHE_ENV)
    if configured is not None:
        return Path(configured) if configured else None
    return Path(platformdirs.user_cache_dir("edgefl")) / "datasets"


def cached(key: str, make: Callable[[], Dataset]) -> Dataset:
    """`make()`'s dataset, read from the cache if an earlier call stored it.

    Generating mnist1d takes seconds of CPU (and importing its generator, another second); a
    fleet emulated on one machine would pay that once per agent process. A cache file is
    written atomically, so agents starting together at worst all generate it; a file that
    cannot be read is regenerated, and an unwritable cache only costs the time.
    """
    folder = cache_dir()
    if folder is None:
        return make()
    path = folder / f"{key}-v{CACHE_FORMAT}.npz"
    try:
        return _read_cached(path)
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:
        log.warning("dataset cache file %s is unreadable (%s); making it again", path, exc)
    dataset = make()
    arrays = {
        "name": np.array(dataset.name),
        "x": dataset.x,
        "y": dataset.y,
        "num_classes": np.array(dataset.num_classes),
        "input_shape": np.array(dataset.input_shape, dtype=np.int64),
        "class_names": np.array(dataset.class_names, dtype=str),
        **({} if dataset.groups is None else {"groups": dataset.groups}),
    }
    try:
        # allow_pickle (the default) is named so that no array of **arrays could bind to it.
        atomic_write(path, lambda handle: np.savez(handle, allow_pickle=True, **arrays))
    except OSError as exc:
        log.warning("cannot cache dataset in %s: %s", folder, exc)
    return dataset


def _read_cached(path: Path) -> Dataset:
    with np.load(path, allow_pickle=False) as f:
        return Dataset(
            str(f["name"]),
            f["x"],
            f["y"],
            int(f["num_classes"]),
            tuple(int(d) for d in f["input_shape"]),
            tuple(str(c) for c in f["class_names"]),
            f["groups"] if "groups" in f.files else None,
        )


# ---------------------------------------------------------------- loading by spec


def load_dataset(spec: str, *, seed: int) -> Dataset:
    """Load a dataset by spec: `digits`, `mnist1d`, `synthetic[:ALPHA,BETA[,GROUPS]]`,
    `npz:PATH`, `imagefolder:PATH` (32x32 RGB; call load_imagefolder for other sizes),
    `cifar10:PATH` or `python:MODULE:FUNCTION` / `python:./FILE.py:FUNCTION` (the user's
    callable, see `call_data_source`). `seed` drives the generated datasets (and goes to a
    callable that takes one); loaded data does not need it. Built-in datasets come from the
    dataset cache (see `cached`) once made; a callable is called again on every load."""
    kind, _, arg = spec.partition(":")
    if spec.startswith(PYTHON_SOURCE):
        return load_python(arg, seed)
    if kind in USER_DATASETS:
        if not arg:
            raise ValueError(f"dataset spec {spec!r} needs a path: {kind}:PATH")
        loader = {"npz": load_npz, "imagefolder": load_imagefolder, "cifar10": load_cifar10}
        return loader[kind](arg)
    if kind == "synthetic":
        params = _numbers(spec, arg) if arg else []
        if len(params) not in (0, 2, 3):
            raise ValueError(f"bad dataset spec {spec!r}: use synthetic:ALPHA,BETA[,GROUPS]")
        if len(params) == 3 and not params[2].is_integer():
            raise ValueError(f"bad dataset spec {spec!r}: GROUPS must be an integer")
        alpha, beta = params[:2] if params else (1.0, 1.0)
        groups = int(params[2]) if len(params) == 3 else 30
        return cached(
            f"synthetic-{alpha!r}-{beta!r}-{groups}-seed{seed}",
            lambda: load_synthetic(seed, alpha, beta, groups),
        )
    if kind in DATASETS and not arg:
        require(LAB_EXTRA, DATASETS[kind], f"the {kind} dataset")
    if kind == "digits" and not arg:
        return cached(f"digits-sklearn{metadata.version('scikit-learn')}", load_digits)
    if kind == "mnist1d" and not arg:
        return cached(
            f"mnist1d{metadata.version('mnist1d')}-seed{seed}", lambda: load_mnist1d(seed)
        )
    if kind in ("digits", "mnist1d"):
        raise ValueError(f"dataset {kind!r} takes no argument, got {spec!r}")
    known = ", ".join(
        [
            *BUILTIN_DATASETS,
            *(f"{k}:PATH" for k in USER_DATASETS),
            f"{PYTHON_SOURCE}MODULE:FUNCTION",
        ]
    )
    raise ValueError(f"unknown dataset {spec!r}; known: {known}")


# ---------------------------------------------------------------- partitions


def _parse_partition(spec: str, num_classes_present: int) -> tuple[str, float]:
    kind, _, arg = spec.partition(":")
    if kind in ("iid", "natural"):
        if arg:
            raise ValueError(f"partition {kind!r} takes no argument, got {spec!r}")
        return kind, 0.0
    try:
        value = float(arg)
    except ValueError:
        value = math.nan
    if kind == "dirichlet":
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"bad partition {spec!r}: dirichlet:ALPHA needs ALPHA > 0")
        return kind, value
    if kind == "pathological":
        if not (value.is_integer() and 1 <= value <= num_classes_present):
            raise ValueError(
                f"bad partition {spec!r}: pathological:N needs an integer N in "
                f"[1, {num_classes_present}] (classes present)"
            )
        return kind, value
    raise ValueError(
        f"unknown partition {spec!r}; known: iid, dirichlet:ALPHA, "
        f"pathological:CLASSES_PER_AGENT, natural"
    )


def _check_fits(dataset: Dataset, spec: str, num_agents: int) -> None:
    """Whether `spec` can deal `dataset` at all: the label-skew partitions deal by class (a
    dataset without labels cannot take them), `natural` by group, and every agent needs a
    sample."""
    kind = spec.partition(":")[0]
    if not dataset.has_labels and kind in ("dirichlet", "pathological"):
        raise ValueError(
            f"partition {spec} needs class labels; a regression or reconstruction run uses "
            "iid or natural"
        )
    if kind == "natural" and dataset.groups is None:
        raise ValueError(
            f"partition 'natural' needs a dataset with groups; {dataset.name!r} has none"
        )
    if num_agents > len(dataset):
        raise ValueError(f"{num_agents} agents but only {len(dataset)} samples")


def _train_test_pools(
    strata: np.ndarray, test_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Stratified split: each stratum with n >= 2 puts round(n f), clipped to [1, n-1], into
    the test pool; singletons stay in the train pool."""
    train, test = [], []
    for s in np.unique(strata):
        idx = rng.permutation(np.flatnonzero(strata == s))
        n_test = 0 if len(idx) < 2 else min(max(round(len(idx) * test_fraction), 1), len(idx) - 1)
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def _dirichlet(
    y: np.ndarray,
    pool: np.ndarray,
    num_agents: int,
    alpha: float,
    min_samples: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """Per class, proportions over agents ~ Dir(alpha), as in NIID-Bench (Li et al., 2022):
    an agent already holding its even share (n/K) gets no more, and the whole draw is repeated
    (up to 100 times) until every agent has min_samples. If no draw succeeds (tiny alpha, many
    agents), the last one is rebalanced: agents short of min_samples take random samples from
    the largest agents, which keeps the skew of everyone else."""
    parts: list[list[int]] = []
    for _ in range(100):
        parts = [[] for _ in range(num_agents)]
        for c in np.unique(y[pool]):
            idx = rng.permutation(pool[y[pool] == c])
            p = rng.dirichlet(np.full(num_agents, alpha))
            sizes = np.array([len(q) for q in parts])
            capped = p * (sizes < len(pool) / num_agents)
            p = capped / capped.sum() if capped.sum() > 0 else p / p.sum()
            cuts = (np.cumsum(p)[:-1] * len(idx)).astype(int)
            for q, chunk in zip(parts, np.split(idx, cuts), strict=True):
                q.extend(chunk.tolist())
        if min(len(q) for q in parts) >= min_samples:
            return [np.sort(np.asarray(q, dtype=np.int64)) for q in parts]
    for k in range(num_agents):
        while len(parts[k]) < min_samples:
            donor = max(range(num_agents), key=lambda j: len(parts[j]))
            take = min(min_samples - len(parts[k]), len(parts[donor]) - min_samples)
            moved = set(rng.choice(parts[donor], take, replace=False).tolist())
            parts[donor] = [i for i in parts[donor] if i not in moved]
            parts[k].extend(sorted(moved))
    return [np.sort(np.asarray(q, dtype=np.int64)) for q in parts]


def _pathological(
    y: np.ndarray, pool: np.ndarray, num_agents: int, per_agent: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Each agent gets exactly `per_agent` distinct classes, chosen at random among the least
    used so far (so classes are spread evenly over agents); each class's samples are then
    split evenly among the agents that hold it."""
    classes = np.unique(y[pool])
    usage = np.zeros(len(classes))
    holders: list[list[int]] = [[] for _ in classes]
    for k in range(num_agents):
        chosen = np.argsort(usage + rng.random(len(classes)) * 0.5, kind="stable")[:per_agent]
        usage[chosen] += 1
        for c in chosen:
            holders[c].append(k)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_agents)]
    for c, agents in zip(classes, holders, strict=True):
        if agents:
            idx = rng.permutation(pool[y[pool] == c])
            for k, chunk in zip(agents, np.array_split(idx, len(agents)), strict=True):
                parts[k].append(chunk)
    return [np.sort(np.concatenate(p)) for p in parts]


def _natural(
    groups: np.ndarray, pool: np.ndarray, num_agents: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Groups shuffled and dealt round-robin: each agent holds whole groups."""
    ids = rng.permutation(np.unique(groups))
    if num_agents > len(ids):
        raise ValueError(f"natural partition: {num_agents} agents but only {len(ids)} groups")
    return [pool[np.isin(groups[pool], ids[k::num_agents])] for k in range(num_agents)]


def _val_mask(y: np.ndarray, val_fraction: float, rng: np.random.Generator) -> np.ndarray:
    """Exactly floor(n f) validation samples, stratified: systematic sampling over the
    samples sorted by label (random order within a label), so every label gets its share +-1."""
    order = np.lexsort((rng.random(len(y)), y))
    pos = np.arange(len(y))
    chosen = np.floor((pos + 1) * val_fraction) > np.floor(pos * val_fraction)
    mask = np.zeros(len(y), dtype=bool)
    mask[order[chosen]] = True
    return mask


def _allocate(total: int, weights: np.ndarray) -> np.ndarray:
    """Split `total` into integer parts proportional to weights (largest remainder)."""
    exact = total * weights / weights.sum()
    counts = np.floor(exact).astype(np.int64)
    short = total - int(counts.sum())
    counts[np.argsort(-(exact - counts), kind="stable")[:short]] += 1
    return counts


def _check_partition(
    num_agents: int,
    val_fraction: float,
    test_fraction: float,
    test_size: int | None,
    min_samples: int,
) -> None:
    """`partition`'s arguments, or ValueError with the one that is impossible."""
    if num_agents < 1:
        raise ValueError(f"num_agents must be >= 1, got {num_agents}")
    if not 0 <= val_fraction < 1 or not 0 < test_fraction < 1:
        raise ValueError(
            f"need 0 <= val_fraction < 1 and 0 < test_fraction < 1, got "
            f"{val_fraction} and {test_fraction}"
        )
    if min_samples < 1 or (test_size is not None and test_size < 0):
        raise ValueError("min_samples must be >= 1 and test_size >= 0")


def partition(
    dataset: Dataset,
    num_agents: int,
    spec: str = "iid",
    *,
    seed: int,
    val_fraction: float = 0.3,
    test_fraction: float = 0.2,
    test_size: int | None = None,
    min_samples: int = 10,
) -> list[AgentData]:
    """Deal `dataset` out to `num_agents` agents; deterministic for (dataset, arguments, seed).

    1. Test pool: test_fraction of every class (of every (group, class) when the dataset has
       groups), or the samples the dataset marks (`Dataset.test`); the rest: the train pool.
    2. The train pool is dealt by `spec`: `iid` (shuffled, even sizes), `dirichlet:ALPHA`
       (label skew, see `_dirichlet`), `pathological:N` (exactly N classes per agent) or
       `natural` (whole groups per agent, for datasets with groups such as `synthetic`).
       Every agent gets at least `min_samples` (train + val); dirichlet re-draws or
       rebalances to ensure it, the others raise ValueError when they cannot.
    3. Each agent's share is split into train and val: exactly floor(n * val_fraction) val
       samples, stratified by label (default 0.3 = 1 - lambda of ALGORITHMS.md section 2).
    4. Test set: by default round(n * test_fraction / (1 - test_fraction)) samples for an
       agent with n samples, so that its test-to-train ratio is the global one (or
       `test_size` each), allocated over classes in proportion to its train label counts
       (largest remainder) and drawn from the test pool (from the agent's own groups under
       `natural`: all of them when the dataset marks its test samples). Within a class,
       sampling is without replacement unless the pool holds fewer samples than needed, then
       with replacement. Agents draw independently, so two agents may share test samples; a
       test sample is never anyone's training sample.

    A dataset without labels (regression targets, or none) counts as one class in steps 1,
    3 and 4, so its splits are seeded random ones of the same sizes; it takes `iid` or
    `natural` only (ValueError for the label-skew partitions). Splits carry its y as it is.
    """
    _check_partition(num_agents, val_fraction, test_fraction, test_size, min_samples)
    y, c = strata_of(dataset)  # labels; without them, one class: plain random splits
    groups = dataset.groups
    _check_fits(dataset, spec, num_agents)
    kind, value = _parse_partition(spec, len(np.unique(y)))
    rng = np.random.default_rng(seed)
    strata = y if groups is None else groups * c + y
    pool, test_pool, ratio = _pools(dataset, strata, test_fraction, rng)
    if num_agents * min_samples > len(pool):
        raise ValueError(
            f"{num_agents} agents x {min_samples} samples need more than the "
            f"{len(pool)} samples of the train pool; use fewer agents or a lower --min-samples"
        )
    shares = _deal(dataset, pool, num_agents, kind, value, min_samples, rng)
    smallest = min(range(num_agents), key=lambda k: len(shares[k]))
    if len(shares[smallest]) < min_samples:
        raise ValueError(
            f"partition {spec!r} gives agent {smallest} only "
            f"{len(shares[smallest])} samples (< min_samples={min_samples}); "
            f"use fewer agents or a lower --min-samples"
        )

    agents = []
    for k, share in enumerate(shares):
        is_val = _val_mask(y[share], val_fraction, rng)
        train_idx, val_idx = share[~is_val], share[is_val]
        candidates = test_pool
        if kind == "natural" and groups is not None:
            candidates = test_pool[np.isin(groups[test_pool], groups[share])]
        if test_size is None and dataset.test is not None and kind == "natural":
            test_idx = candidates  # the source's own test samples of the agent's groups
        else:
            n_test = round(len(share) * ratio) if test_size is None else test_size
            test_idx = _draw_test(y, c, train_idx, candidates, n_test, rng)
        agents.append(
            AgentData(
                k,
                _split(dataset, train_idx),
                _split(dataset, val_idx),
                _split(dataset, test_idx),
                dataset.num_classes,
                dataset.input_shape,
            )
        )
    return agents


def _pools(
    dataset: Dataset, strata: np.ndarray, test_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, float]:
    """The train and test pools (`partition`, step 1) and an agent's test-to-train ratio
    (step 4): the dataset's own test samples when it marks them."""
    if dataset.test is None:
        pool, test_pool = _train_test_pools(strata, test_fraction, rng)
        return pool, test_pool, test_fraction / (1 - test_fraction)
    pool, test_pool = np.flatnonzero(~dataset.test), np.flatnonzero(dataset.test)
    return pool, test_pool, len(test_pool) / max(len(pool), 1)


def _deal(
    dataset: Dataset,
    pool: np.ndarray,
    num_agents: int,
    kind: str,
    value: float,
    min_samples: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """Each agent's share of the train pool under partition `kind` (see `partition`, step 2);
    one helper per kind, so each states its own rule."""
    if kind == "iid":
        return [np.sort(s) for s in np.array_split(rng.permutation(pool), num_agents)]
    if kind == "dirichlet":
        return _dirichlet(dataset.y, pool, num_agents, value, min_samples, rng)
    if kind == "pathological":
        return _pathological(dataset.y, pool, num_agents, int(value), rng)
    assert dataset.groups is not None  # checked by partition: `natural` needs groups
    return _natural(dataset.groups, pool, num_agents, rng)


def _draw_test(
    y: np.ndarray,
    num_classes: int,
    train_idx: np.ndarray,
    candidates: np.ndarray,
    n_test: int,
    rng: np.random.Generator,
) -> np.ndarray:
    """An agent's test set (see `partition`, step 4): `n_test` samples of `candidates`,
    allocated over classes in proportion to the agent's train label counts, so that its test
    label mix is its own; without replacement where a class has enough candidates."""
    train_counts = label_counts(y[train_idx], num_classes)
    available = label_counts(y[candidates], num_classes)
    weights = train_counts * (available > 0)
    per_class = _allocate(n_test, weights) if weights.sum() else np.zeros(num_classes, np.int64)
    return np.concatenate(
        [np.zeros(0, np.int64)]
        + [
            rng.choice(candidates[y[candidates] == cls], n, replace=n > available[cls])
            for cls, n in enumerate(per_class)
            if n > 0
        ]
    )


def _split(dataset: Dataset, idx: np.ndarray) -> Split:
    return Split(dataset.x[idx], dataset.y[idx], idx)
