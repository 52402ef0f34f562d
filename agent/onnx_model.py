"""Serve an exported model with onnxruntime, without torch: `edge-agent predict` and the
round-trip checks of an export (`agent.onnx_export`) load it here.

The file format: one input (`input`, batch first) and one output (`logits`, whatever the
task), and the run's task in the metadata (`task`), which says what the output means and so
what `predict` reports: classes, values, or reconstruction errors for anomaly detection.
"""

from __future__ import annotations

import math
import time
import zipfile
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from agent.learning.config import TASKS

if TYPE_CHECKING:
    import onnxruntime as ort

# onnxruntime is imported where it is used (`OnnxModel.load`): an agent needs it once, at the
# end of its run, and importing it up front would hold its megabytes through every round.

INPUT_NAME = "input"
# "logits" for every task: the name is part of the file format, and a device whose older
# `edge-agent predict` asks for "logits" still serves a regression model exported now.
OUTPUT_NAME = "logits"

# What a model's output means (the run's task): class logits (N, classes); predicted values
# (N,) or (N, d); an autoencoder's reconstruction, (N, *input_shape) or as many values. An
# exported file names it in its `task` metadata; one without (exported before there were
# tasks) is a classifier.
CLASSIFICATION, REGRESSION, RECONSTRUCTION = TASKS
TASK_KEY = "task"


def task_of(metadata: Mapping[str, str]) -> str:
    """The task named by a model's metadata; classification when it names none (files
    exported before there were tasks). ValueError for a task this version cannot serve."""
    task = metadata.get(TASK_KEY, CLASSIFICATION)
    if task not in TASKS:
        raise ValueError(
            f"unknown task {task!r} in the model's metadata (known: {', '.join(TASKS)})"
        )
    return task


def check_task_output(
    task: str, output_shape: tuple[int, ...], input_shape: tuple[int, ...]
) -> None:
    """Raise ValueError unless a per-sample output of `output_shape` (batch dimension
    removed) means something for `task` on samples of `input_shape`: class logits are a
    vector; a reconstruction has as many values as the input, which it is compared with in
    row-major order, as training compares them (`agent.learning.tasks`), so a model that
    trains is never refused here; regression takes any shape."""
    if task == CLASSIFICATION and len(output_shape) != 1:
        raise ValueError(
            f"a classification model must output class logits of shape (N, classes), "
            f"got {_batch_shape(output_shape)}"
        )
    if task == RECONSTRUCTION and math.prod(output_shape) != math.prod(input_shape):
        raise ValueError(
            f"a reconstruction model must output its input's shape {_batch_shape(input_shape)} "
            f"or {_batch_shape((math.prod(input_shape),))}, got {_batch_shape(output_shape)}"
        )


def _batch_shape(shape: tuple[int, ...]) -> str:
    """A per-sample shape written with the batch: (N, 1, 8, 8), or (N,) for a scalar."""
    return f"(N, {', '.join(map(str, shape))})" if shape else "(N,)"


def reconstruction_error(x: np.ndarray, reconstruction: np.ndarray) -> np.ndarray:
    """Each sample's reconstruction error, the mean over its values of (output - input)^2
    (computed in float64): an autoencoder's anomaly score. The output may be the input's
    shape or flattened (any shape of as many values); ValueError if it has another number
    of values."""
    n = len(x)
    check_task_output(RECONSTRUCTION, tuple(reconstruction.shape[1:]), tuple(x.shape[1:]))
    diff = reconstruction.reshape(n, -1).astype(np.float64) - x.reshape(n, -1)
    return np.mean(diff * diff, axis=1)


@dataclass(frozen=True)
class LatencyStats:
    """Batch-1 latency over the samples (ms) and throughput at `batch_size` (samples/s)."""

    samples: int
    mean_ms: float
    p50_ms: float
    p95_ms: float
    batch_size: int
    throughput_per_s: float


@dataclass(frozen=True)
class Answer:
    """What `edge-agent predict` reports for a batch, as plain Python values for JSON."""

    task: str
    # Class ids (classification); predicted values, a list per sample when a sample has
    # several (regression); reconstruction errors, the anomaly score (reconstruction).
    predictions: list[Any]
    # Reconstruction with a threshold: whether each sample's error exceeds it.
    anomalies: list[bool] | None = None
    threshold: float | None = None

    def fields(self) -> dict[str, Any]:
        """The JSON fields: `predictions`, and `anomalies` when there is a threshold (so a
        classifier's JSON keeps the keys it had before there were tasks)."""
        fields: dict[str, Any] = {"predictions": self.predictions}
        if self.anomalies is not None:
            fields["anomalies"] = self.anomalies
        return fields

    def lines(self) -> list[str]:
        """The text output: the predictions on one line, or a line per sample where a sample
        has several values; then how many samples are anomalies, and which."""
        if self.predictions and isinstance(self.predictions[0], list):
            lines = [" ".join(map(str, _flatten(p))) for p in self.predictions]
        else:
            lines = [" ".join(map(str, self.predictions))]
        if self.anomalies is not None:
            flagged = [str(i) for i, anomaly in enumerate(self.anomalies) if anomaly]
            which = f": samples {' '.join(flagged)}" if flagged else ""
            lines.append(
                f"{len(flagged)} of {len(self.anomalies)} samples are anomalies "
                f"(reconstruction_error > {self.threshold}){which}"
            )
        return lines


def _flatten(values: list[Any]) -> list[Any]:
    """The numbers of nested lists, in order."""
    return [v for item in values for v in (_flatten(item) if isinstance(item, list) else [item])]


class OnnxModel:
    """An exported model in an onnxruntime CPU session, with its metadata and input shape."""

    def __init__(self, session: ort.InferenceSession, metadata: dict[str, str]) -> None:
        inputs, outputs = session.get_inputs(), session.get_outputs()
        if len(inputs) != 1 or len(outputs) != 1:
            raise ValueError(
                f"expected a model with one input and one output, "
                f"got {len(inputs)} inputs and {len(outputs)} outputs"
            )
        dims = inputs[0].shape[1:]
        if not all(isinstance(d, int) for d in dims):
            raise ValueError(f"model input has non-fixed sample dimensions {dims}")
        self.session = session
        self.metadata = metadata
        self.input_shape: tuple[int, ...] = tuple(dims)
        self._input_name = inputs[0].name

    @property
    def task(self) -> str:
        """What the model's output means (`task_of` its metadata); ValueError for a task
        this version cannot serve."""
        return task_of(self.metadata)

    @classmethod
    def load(cls, path: str | Path, *, threads: int | None = None) -> OnnxModel:
        """Load and check an ONNX file; `threads` sets onnxruntime's intra-op threads (None:
        its default, one per physical core)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no ONNX model at {path}")
        import onnx
        import onnxruntime as ort

        data = path.read_bytes()
        try:
            proto = onnx.load_from_string(data)
            onnx.checker.check_model(proto)
        except Exception as e:  # protobuf decode errors have no common public base class
            raise ValueError(f"{path} is not a valid ONNX model: {e}") from e
        options = ort.SessionOptions()
        if threads is not None:
            options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
        return cls(session, {p.key: p.value for p in proto.metadata_props})

    def predict(self, x: np.ndarray, batch_size: int = 256) -> np.ndarray:
        """The model's outputs for `x` (a batch, or one sample without the batch dimension):
        logits, values or reconstructions by `task`, run in batches of `batch_size` to bound
        memory."""
        x = as_batch(x, self.input_shape)
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        return np.concatenate(
            [self._run(x[i : i + batch_size]) for i in range(0, len(x), batch_size)]
        )

    def answer(
        self, x: np.ndarray, threshold: float | None = None, batch_size: int = 256
    ) -> Answer:
        """What `edge-agent predict` reports for `x`, by the model's task: class ids, predicted
        values, or reconstruction errors, with anomalies where `threshold` is given (for a
        reconstruction model only: ValueError otherwise, or if the output does not fit the
        task)."""
        task = self.task
        if threshold is not None and task != RECONSTRUCTION:
            raise ValueError(f"a threshold applies to reconstruction models, not to {task}")
        x = as_batch(x, self.input_shape)
        output = self.predict(x, batch_size)
        check_task_output(task, tuple(output.shape[1:]), self.input_shape)
        if task == CLASSIFICATION:
            return Answer(task, output.argmax(axis=1).tolist())
        if task == REGRESSION:
            # One target per sample, (N,) or (N, 1), reads best as one number per sample.
            values = output.reshape(len(output)) if output.size == len(output) else output
            return Answer(task, float32_values(values))
        errors = float32_values(reconstruction_error(x, output))
        # Compared as reported, so an error printed as X is never flagged by --threshold X.
        anomalies = None if threshold is None else [e > threshold for e in errors]
        return Answer(task, errors, anomalies, threshold)

    def benchmark(self, x: np.ndarray, batch_size: int = 64, warmup: int = 10) -> LatencyStats:
        """Batch-1 latency of every sample of `x` (slice `x` to bound the time), and
        throughput over all of `x` in batches of `batch_size`, after `warmup` untimed runs
        that let onnxruntime allocate its buffers."""
        x = as_batch(x, self.input_shape)
        for _ in range(warmup):
            self._run(x[:1])
        latencies = []
        for i in range(len(x)):
            start = time.perf_counter()
            self._run(x[i : i + 1])
            latencies.append(time.perf_counter() - start)
        ms = np.array(latencies) * 1e3
        batch_size = min(batch_size, len(x))
        self._run(x[:batch_size])
        start = time.perf_counter()
        self.predict(x, batch_size)
        elapsed = time.perf_counter() - start
        p50, p95 = np.percentile(ms, [50, 95])
        return LatencyStats(
            samples=len(x),
            mean_ms=float(ms.mean()),
            p50_ms=float(p50),
            p95_ms=float(p95),
            batch_size=batch_size,
            throughput_per_s=len(x) / elapsed,
        )

    def _run(self, batch: np.ndarray) -> np.ndarray:
        return self.session.run([OUTPUT_NAME], {self._input_name: batch})[0]


def as_batch(x: np.ndarray, input_shape: Sequence[int]) -> np.ndarray:
    """`x` as a contiguous float32 batch of `input_shape` samples; a single sample gains the
    batch dimension. Rejects other shapes (naming the expected one) and NaN or inf, which
    would otherwise come back as silently meaningless logits."""
    x = np.asarray(x)
    if x.dtype == np.bool_ or not np.issubdtype(x.dtype, np.number) or np.iscomplexobj(x):
        raise TypeError(f"inputs must be real numbers, got dtype {x.dtype}")
    shape = tuple(input_shape)
    if x.shape == shape:
        x = x[None]
    if x.shape[1:] != shape or len(x) == 0:
        raise ValueError(
            f"inputs must have shape (N, {', '.join(map(str, shape))}) or {shape}, got {x.shape}"
        )
    x = np.ascontiguousarray(x, dtype=np.float32)
    finite = np.isfinite(x).reshape(len(x), -1).all(axis=1)
    if not finite.all():
        bad = np.flatnonzero(~finite)
        raise ValueError(f"{len(bad)} input samples contain NaN or inf (first: index {bad[0]})")
    return x


NPY_MAGIC = b"\x93NUMPY"
NPZ_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")
"""How a .npy file and a .npz file (a zip archive; an empty one is its end record) begin."""


def load_inputs(path: str | Path, input_shape: Sequence[int]) -> np.ndarray:
    """Inputs for `edge-agent predict` from a .npy file or a .npz file's `x` array, as a
    float32 batch of `input_shape` samples (a single sample may omit the batch dimension).
    Pickles are refused: an input file must not be able to run code."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no input file at {path}")
    with path.open("rb") as f:
        magic = f.read(len(NPY_MAGIC))
    if not magic.startswith((NPY_MAGIC, *NPZ_MAGIC)):  # else numpy reads it as a pickle
        raise ValueError(
            f"{path} is not a .npy or .npz file: predict reads the samples from a .npy array "
            "or a .npz file's x array (numpy.save or numpy.savez of the feature columns)"
        )
    try:
        # Our own handle: np.load leaks the one it opens when a .npz is corrupt.
        x: np.ndarray | None
        with path.open("rb") as f:
            loaded = np.load(f, allow_pickle=False)
            if isinstance(loaded, np.ndarray):
                x, names = loaded, ["x"]
            else:
                with loaded:
                    names = loaded.files
                    x = loaded["x"] if "x" in names else None
    except (OSError, EOFError, ValueError, zipfile.BadZipFile, zlib.error) as e:
        raise ValueError(f"{path} is not a readable .npy or .npz file: {e}") from e
    if x is None:
        raise ValueError(f"{path} has no 'x' array (has: {', '.join(names) or 'none'})")
    return as_batch(x, input_shape)


def float32_values(values: np.ndarray) -> list[Any]:
    """`values` (any shape, batch first) as nested lists of the shortest decimals that are the
    same float32 (0.1, not 0.10000000149011612): a model computes in float32, so further
    digits are noise."""
    flat = [float(str(v)) for v in np.asarray(values, np.float32).ravel()]
    nested: list[Any] = np.array(flat, dtype=object).reshape(np.shape(values)).tolist()
    return nested
