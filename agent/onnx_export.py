"""Export a personalized model to ONNX (torch), checked in onnxruntime before it is written.

The agent exports its personalized (sparse) model at the end of a run so that a device can
serve it without torch (`agent.onnx_model`, which `edge-agent predict` loads). Masked
weights are stored as dense zeros: onnxruntime densifies sparse initializers on load
anyway, and at the densities we reach COO indices would cost more bytes than the zeros they
replace.

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
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from agent.files import atomic_write
from agent.onnx_model import (
    INPUT_NAME,
    OUTPUT_NAME,
    TASK_KEY,
    OnnxModel,
    as_batch,
    check_task_output,
    task_of,
)

# onnx and onnxruntime are imported where they are used: an agent needs them once, at the end
# of its run, and importing them up front would hold ~24 MB through every round.

# Every op of the bundled models exists in opset 17, which onnxruntime supports since 1.14:
# the lowest opset keeps the model loadable by the oldest runtimes on devices.
OPSET = 17

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
