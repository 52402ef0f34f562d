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
"""

from __future__ import annotations

import copy
import io
import time
import warnings
import zipfile
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor, nn

from agent.files import atomic_write

if TYPE_CHECKING:
    import onnxruntime as ort

# onnx and onnxruntime are imported where they are used: an agent needs them once, at the end
# of its run, and importing them up front would hold ~24 MB through every round.

# Every op of the bundled models exists in opset 17, which onnxruntime supports since 1.14:
# the lowest opset keeps the model loadable by the oldest runtimes on devices.
OPSET = 17
INPUT_NAME = "input"
OUTPUT_NAME = "logits"


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

    The caller's model is left untouched (a copy is exported). The file is checked with
    onnx.checker, written to a temporary file in the same directory, fsynced and renamed over
    `path`, so a crash leaves either the old model or the new one, never half of one.
    """
    path = Path(path)
    metadata = dict(metadata or {})
    bad = {k: v for k, v in metadata.items() if not (isinstance(k, str) and isinstance(v, str))}
    if bad:
        raise TypeError(f"metadata keys and values must be strings, got {bad!r}")
    exported = copy.deepcopy(model).cpu().eval()
    exported.load_state_dict(state)
    # Batch 2, not 1, so the trace cannot specialize anything to a single sample.
    example = torch.zeros((2, *input_shape))
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        # The legacy exporter warns that it is deprecated, and GroupNorm's batch-size sanity
        # check warns that it becomes a trace constant; neither changes the graph.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings(
            "ignore", category=torch.jit.TracerWarning, module=r"torch\.nn\.functional"
        )
        torch.onnx.export(
            exported,
            (example,),
            buffer,  # type: ignore[arg-type]  # a file object works; the stubs say paths only
            dynamo=False,
            opset_version=OPSET,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
        )
    import onnx

    proto = onnx.load_from_string(buffer.getvalue())
    onnx.helper.set_model_props(proto, metadata)
    onnx.checker.check_model(proto, full_check=True)
    atomic_write(path, lambda handle: handle.write(proto.SerializeToString()))
    return path


@dataclass(frozen=True)
class LatencyStats:
    """Batch-1 latency over the samples (ms) and throughput at `batch_size` (samples/s)."""

    samples: int
    mean_ms: float
    p50_ms: float
    p95_ms: float
    batch_size: int
    throughput_per_s: float


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
        """Logits for `x` (a batch, or one sample without the batch dimension), run in
        batches of `batch_size` to bound memory."""
        x = as_batch(x, self.input_shape)
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        return np.concatenate(
            [self._run(x[i : i + batch_size]) for i in range(0, len(x), batch_size)]
        )

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


def max_abs_diff(
    model: nn.Module, onnx_model: OnnxModel, x: np.ndarray, batch_size: int = 256
) -> float:
    """Largest absolute difference between the torch model's eval-mode logits and the ONNX
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
