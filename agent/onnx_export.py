"""Export a personalized model to ONNX and run it with onnxruntime.

The agent exports its personalized (sparse) model at the end of a run so that a device can
serve it without torch; `edge-agent predict` loads it here. Masked weights are stored as
dense zeros: onnxruntime densifies sparse initializers on load anyway, and at the densities
we reach COO indices would cost more bytes than the zeros they replace.

The export uses torch's TorchScript-based exporter (`dynamo=False`). Since torch 2.9 the
default is the torch.export-based exporter, which needs the extra `onnxscript` package
(plus `onnx-ir` and `ml_dtypes`) and takes 1.5-5 s per bundled model where this one takes
0.01-2 s, for the same accuracy. The TorchScript exporter is deprecated but still present in
torch 2.13 and matches torch on every bundled model. `dynamo=False` needs torch >= 2.5.

A model may be any `nn.Module` that maps a float batch to one float tensor, batch first,
GRU and LSTM layers included; its `task` metadata says what the output means and so what
`predict` reports (classes, values, or reconstruction errors for anomaly detection).
"""

from __future__ import annotations

import copy
import io
import math
import time
import warnings
import zipfile
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn

from agent.files import atomic_write
from agent.learning.tasks import TASKS

if TYPE_CHECKING:
    import onnxruntime as ort

# onnx and onnxruntime are imported where they are used: an agent needs them once, at the end
# of its run, and importing them up front would hold ~24 MB through every round.

# Every op of the bundled models exists in opset 17, which onnxruntime supports since 1.14:
# the lowest opset keeps the model loadable by the oldest runtimes on devices.
OPSET = 17
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

# The batch sizes an export is run at in onnxruntime before it is written (the trace uses 2):
# a model that fixes its batch size (`len(x)` or a constant in a reshape or an RNN's initial
# state) traces without an error but fails or disagrees with torch at any other batch size.
CHECK_BATCHES = (1, 3)
# Relative to the output's scale: float32 rounding stays ~1e-6 of it (see test_onnx), while a
# model that fixed its batch size is off by the outputs themselves.
CHECK_RTOL = 1e-3


def export_onnx(
    model: nn.Module,
    state: Mapping[str, Tensor],
    input_shape: Sequence[int],
    path: str | Path,
    *,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Export `model` with the weights of `state`, in eval mode, to `path` with a dynamic
    batch dimension and `metadata` as ONNX metadata_props; returns the path.

    The model must return one floating-point tensor with the batch as its first dimension,
    fitting `metadata["task"]` if given (`check_task_output`; an unknown task is refused).
    The export is run in onnxruntime at batch sizes 1 and 3 and compared with torch before
    it is written, so a model whose forward fixes the batch size is a ValueError here, not a
    file that fails on the device. The caller's model is left untouched (a copy is
    exported). The file is checked with onnx.checker, written to a temporary file in the
    same directory, fsynced and renamed over `path`, so a crash leaves either the old model
    or the new one, never half of one.
    """
    path = Path(path)
    metadata = dict(metadata or {})
    bad = {k: v for k, v in metadata.items() if not (isinstance(k, str) and isinstance(v, str))}
    if bad:
        raise TypeError(f"metadata keys and values must be strings, got {bad!r}")
    task = task_of(metadata) if TASK_KEY in metadata else None
    exported = copy.deepcopy(model).cpu().eval()
    exported.load_state_dict(state)
    # Batch 2, not 1, so the trace cannot specialize anything to a single sample.
    example = torch.zeros((2, *input_shape))
    output = _single_output(exported, example)
    if task is not None:  # without one the file is served as a classifier; see task_of
        check_task_output(task, tuple(output.shape[1:]), tuple(input_shape))
    import onnx

    proto = onnx.load_from_string(_trace(exported, example))
    onnx.helper.set_model_props(proto, metadata)
    onnx.checker.check_model(proto, full_check=True)
    data = proto.SerializeToString()
    _check_other_batch_sizes(exported, data, tuple(input_shape))
    atomic_write(path, lambda handle: handle.write(data))
    return path


def _single_output(model: nn.Module, example: Tensor) -> Tensor:
    """The model's output for `example`, refused unless it is what an ONNX file with one
    output can carry and `predict` can read: one floating-point tensor, batch first. (The
    exporter would write a tuple as several outputs, which no task knows how to serve.)"""
    with torch.no_grad():
        output = model(example)
    if not isinstance(output, Tensor):
        kind = type(output).__name__
        size = f" of {len(output)}" if isinstance(output, (tuple, list, dict)) else ""
        raise ValueError(
            f"the model must return one tensor, but its forward returns a {kind}{size}; "
            f"return only the tensor to serve (e.g. the logits, not (logits, hidden))"
        )
    if not output.is_floating_point():
        raise ValueError(f"the model must return a floating-point tensor, got {output.dtype}")
    if output.dim() == 0 or output.shape[0] != len(example):
        raise ValueError(
            f"the model's output must have the batch as its first dimension: a batch of "
            f"{len(example)} gave an output of shape {tuple(output.shape)}"
        )
    return output


def _trace(model: nn.Module, example: Tensor) -> bytes:
    """The serialized ONNX model traced from `model` on `example`, batch axis dynamic."""
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        # The legacy exporter warns that it is deprecated; GroupNorm's batch-size sanity
        # check and the RNN modules' input and hidden-size checks warn that they become
        # trace constants; and every GRU/LSTM/RNN export warns that another batch size "can
        # cause an error", which `_check_other_batch_sizes` rules out. None changes the graph.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings(
            "ignore",
            category=torch.jit.TracerWarning,
            module=r"torch\.nn\.(functional|modules\.rnn)",
        )
        warnings.filterwarnings("ignore", r"Exporting a model to ONNX with a batch_size other")
        torch.onnx.export(
            model,
            (example,),
            buffer,  # type: ignore[arg-type]  # a file object works; the stubs say paths only
            dynamo=False,
            opset_version=OPSET,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
        )
    return buffer.getvalue()


def _check_other_batch_sizes(model: nn.Module, data: bytes, input_shape: tuple[int, ...]) -> None:
    """Raise ValueError unless the exported `data` runs in onnxruntime at each of
    CHECK_BATCHES and agrees with `model` (eval mode) there to CHECK_RTOL of the output's
    scale (NaN where torch has NaN too). The inputs are random, so a wrong batch size cannot
    hide behind equal rows, and in [0, 1), which any model's domain is likeliest to hold
    (a log, a square root, token ids cast from floats)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4  # a failing run is reported below, not as a log line
    session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    advice = (
        "the model's forward seems to fix the batch size; take it from the input with "
        "x.size(0) or x.shape[0] (not len(x) or a constant) for reshapes and initial RNN states"
    )
    for n in CHECK_BATCHES:
        x = rng.random((n, *input_shape), dtype=np.float32)
        try:
            with torch.no_grad():
                expected = model(torch.from_numpy(x)).numpy()
        except Exception as e:  # whatever the user's forward raises
            raise ValueError(f"the model fails in torch at batch size {n}: {e}") from e
        try:
            got = session.run([OUTPUT_NAME], {INPUT_NAME: x})[0]
        except Exception as e:  # onnxruntime's errors have no common public base class
            raise ValueError(f"the exported model fails at batch size {n}: {e}; {advice}") from e
        if got.shape != expected.shape:
            raise ValueError(
                f"at batch size {n} the exported model's output has shape {got.shape} where "
                f"torch's has {expected.shape}; {advice}"
            )
        differ = (got != expected) & ~(np.isnan(got) & np.isnan(expected))
        diff = float(np.abs(got[differ] - expected[differ]).max(initial=0.0))
        finite = np.abs(expected[np.isfinite(expected)])
        scale = max(1.0, float(finite.max(initial=0.0)))
        if not diff <= CHECK_RTOL * scale:
            raise ValueError(
                f"at batch size {n} the exported model's outputs differ from torch's by up to "
                f"{diff:.3g} (scale {scale:.3g}); {advice}, and must not be random in eval mode"
            )


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


def load_inputs(path: str | Path, input_shape: Sequence[int]) -> np.ndarray:
    """Inputs for `edge-agent predict` from a .npy file or a .npz file's `x` array, as a
    float32 batch of `input_shape` samples (a single sample may omit the batch dimension).
    Pickles are refused: an input file must not be able to run code."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no input file at {path}")
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


def max_abs_diff(
    model: nn.Module, onnx_model: OnnxModel, x: np.ndarray, batch_size: int = 256
) -> float:
    """Largest absolute difference between the torch model's eval-mode outputs and the ONNX
    model's on `x`: the check that an export reproduces the personalized model."""
    x = as_batch(x, onnx_model.input_shape)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            expected = np.concatenate(
                [
                    model(torch.from_numpy(x[i : i + batch_size])).numpy()
                    for i in range(0, len(x), batch_size)
                ]
            )
    finally:
        model.train(was_training)
    return float(np.abs(expected - onnx_model.predict(x, batch_size)).max())
