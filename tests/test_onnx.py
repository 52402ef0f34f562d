"""ONNX export of personalized sparse models and onnxruntime inference (agent.onnx_export)."""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from torch import Tensor, nn

from agent.learning.config import MODEL_NAMES
from agent.learning.models import build_model, prunable_names
from agent.learning.sparse import apply_masks, erk_densities, random_masks
from agent.onnx_export import OPSET, export_onnx, max_abs_diff
from agent.onnx_model import OnnxModel, load_inputs

# Small inputs where a model allows; the deep models on CIFAR-sized images.
SHAPES = {
    "mlp": (60,),
    "cnn1d": (1, 40),
    "cnn2d": (1, 8, 8),
    "resnet18": (3, 32, 32),
    "vgg11": (3, 32, 32),
    "alexnet": (3, 32, 32),
}
NUM_CLASSES = 10
ATOL = 1e-5


@dataclass
class Exported:
    name: str
    model: nn.Module  # eval mode, holding `state`
    state: dict[str, Tensor]
    path: Path
    metadata: dict[str, str]
    onnx_model: OnnxModel


def sparse_state(model: nn.Module, seed: int, noise: float = 1.0) -> dict[str, Tensor]:
    """Init weights moved by `noise` times each tensor's spread (absolute for norm affines,
    which start at exactly 1 and 0), as training moves them, then masked to ~50% density the
    way the agent masks them (ERK densities, exact zeros)."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for k, v in model.state_dict().items():
        scale = float(v.std()) if k in prunable_names(model) else 0.1
        state[k] = v + noise * scale * torch.randn(v.shape, generator=gen)
    shapes = {k: state[k].shape for k in prunable_names(model)}
    masks = random_masks(shapes, erk_densities(shapes, 0.5), gen)
    return apply_masks(state, masks)


def inputs(shape: tuple[int, ...], n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, *shape)).astype(np.float32)


@pytest.fixture(scope="module", params=MODEL_NAMES)
def exported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Exported:
    name = request.param
    model = build_model(name, SHAPES[name], NUM_CLASSES, seed=0)
    state = sparse_state(model, seed=1)
    metadata = {
        "model": name,
        "input_shape": ",".join(map(str, SHAPES[name])),
        "num_classes": str(NUM_CLASSES),
        "agent_id": "agent-07",
        "round": "42",
        "sparsity": "0.5",
    }
    path = tmp_path_factory.mktemp(name) / "model.onnx"
    assert export_onnx(model, state, SHAPES[name], path, metadata=metadata) == path
    model.load_state_dict(state)
    model.eval()
    return Exported(name, model, state, path, metadata, OnnxModel.load(path, threads=1))


def test_matches_torch_within_1e5_at_batch_1_and_7(exported: Exported) -> None:
    x = inputs(SHAPES[exported.name], 7)
    with torch.no_grad():
        expected = exported.model(torch.from_numpy(x)).numpy()
    for batch in (x[:1], x):
        logits = exported.onnx_model.predict(batch)
        assert logits.shape == (len(batch), NUM_CLASSES) and logits.dtype == np.float32
        np.testing.assert_allclose(logits, expected[: len(batch)], rtol=0, atol=ATOL)
    assert max_abs_diff(exported.model, exported.onnx_model, x) <= ATOL


def test_large_logits_differ_only_at_float32_rounding(tmp_path: Path) -> None:
    """AlexNet with weights 5x their init scale gives logits near 20; its 4096-wide layers
    then put torch's own float32 result ~1e-5 from the exact (float64) one, and onnxruntime's
    differs from torch by as much. The export is no less exact than torch itself."""
    model = build_model("alexnet", SHAPES["alexnet"], NUM_CLASSES, seed=0)
    state = sparse_state(model, seed=1, noise=5.0)
    onnx_model = OnnxModel.load(export_onnx(model, state, SHAPES["alexnet"], tmp_path / "a.onnx"))
    model.load_state_dict(state)
    x = inputs(SHAPES["alexnet"], 8)
    with torch.no_grad():
        torch32 = model.eval()(torch.from_numpy(x)).numpy()
        exact = model.double()(torch.from_numpy(x).double()).numpy()
    ours = onnx_model.predict(x)
    scale = np.abs(exact).max()
    assert scale > 5
    assert np.abs(ours - torch32).max() <= 3e-6 * scale
    assert np.abs(ours - exact).max() <= 2 * np.abs(torch32 - exact).max()


def test_metadata_and_input_shape_round_trip(exported: Exported) -> None:
    assert exported.onnx_model.metadata == exported.metadata
    assert exported.onnx_model.input_shape == SHAPES[exported.name]
    proto = onnx.load(exported.path)
    assert [o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")] == [OPSET]


def test_masked_weights_stay_exactly_zero(exported: Exported) -> None:
    """Every masked entry reaches the file as an exact zero (the file stores them densely)."""
    masked = sum(int((exported.state[k] == 0).sum()) for k in prunable_names(exported.model))
    proto = onnx.load(exported.path)
    zeros = sum(int((numpy_helper.to_array(t) == 0).sum()) for t in proto.graph.initializer)
    assert zeros >= masked > 0


def test_predict_batches_and_single_sample(exported: Exported) -> None:
    onnx_model, x = exported.onnx_model, inputs(SHAPES[exported.name], 5)
    whole = onnx_model.predict(x)
    np.testing.assert_array_equal(onnx_model.predict(x[0]), whole[:1])
    np.testing.assert_allclose(onnx_model.predict(x, batch_size=2), whole, rtol=0, atol=1e-6)


def test_export_leaves_the_callers_model_alone(tmp_path: Path) -> None:
    model = build_model("cnn1d", SHAPES["cnn1d"], NUM_CLASSES, seed=0).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    export_onnx(model, sparse_state(model, 3), SHAPES["cnn1d"], tmp_path / "m.onnx")
    assert model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_export_replaces_an_existing_file_and_leaves_no_temp_files(tmp_path: Path) -> None:
    model = build_model("mlp", SHAPES["mlp"], NUM_CLASSES, seed=0)
    path = tmp_path / "out" / "model.onnx"
    path.parent.mkdir()
    path.write_bytes(b"old model")
    export_onnx(model, sparse_state(model, 4), SHAPES["mlp"], path, metadata={"round": "1"})
    export_onnx(model, sparse_state(model, 5), SHAPES["mlp"], path, metadata={"round": "2"})
    assert os.listdir(path.parent) == ["model.onnx"]
    assert OnnxModel.load(path).metadata == {"round": "2"}


def test_failed_write_keeps_the_old_file_and_leaves_no_temp_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = build_model("mlp", SHAPES["mlp"], NUM_CLASSES, seed=0)
    path = tmp_path / "model.onnx"
    export_onnx(model, sparse_state(model, 4), SHAPES["mlp"], path, metadata={"round": "1"})

    def crash(*_args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="disk full"):
        export_onnx(model, sparse_state(model, 5), SHAPES["mlp"], path, metadata={"round": "2"})
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["model.onnx"]
    assert OnnxModel.load(path).metadata == {"round": "1"}


def test_export_rejects_a_state_of_another_model_and_non_string_metadata(tmp_path: Path) -> None:
    model = build_model("mlp", SHAPES["mlp"], NUM_CLASSES, seed=0)
    other = build_model("cnn1d", SHAPES["cnn1d"], NUM_CLASSES, seed=0)
    with pytest.raises(RuntimeError, match="state_dict"):
        export_onnx(model, other.state_dict(), SHAPES["mlp"], tmp_path / "m.onnx")
    with pytest.raises(TypeError, match="strings"):
        bad: dict = {"round": 3}  # not dict[str, str]: the check under test
        export_onnx(model, model.state_dict(), SHAPES["mlp"], tmp_path / "m.onnx", metadata=bad)
    assert not any(tmp_path.iterdir())


@pytest.fixture(scope="module")
def cnn2d(tmp_path_factory: pytest.TempPathFactory) -> OnnxModel:
    model = build_model("cnn2d", SHAPES["cnn2d"], NUM_CLASSES, seed=0)
    path = tmp_path_factory.mktemp("cnn2d") / "m.onnx"
    return OnnxModel.load(export_onnx(model, sparse_state(model, 6), SHAPES["cnn2d"], path))


def test_load_rejects_missing_and_non_onnx_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no ONNX model"):
        OnnxModel.load(tmp_path / "missing.onnx")
    for i, junk in enumerate([b"", b"not a model at all", np.arange(50).tobytes()]):
        path = tmp_path / f"junk{i}.onnx"
        path.write_bytes(junk)
        with pytest.raises(ValueError, match="not a valid ONNX model"):
            OnnxModel.load(path)


def test_predict_names_the_expected_shape(cnn2d: OnnxModel) -> None:
    for shape in [(4, 1, 8, 9), (4, 64), (8, 8), (0, 1, 8, 8)]:
        with pytest.raises(ValueError, match=r"\(N, 1, 8, 8\) or \(1, 8, 8\)"):
            cnn2d.predict(np.zeros(shape, np.float32))


def test_predict_rejects_non_finite_and_non_numeric_inputs(cnn2d: OnnxModel) -> None:
    x = inputs(SHAPES["cnn2d"], 4)
    x[2, 0, 3, 3] = np.nan
    x[3, 0, 0, 0] = -np.inf
    with pytest.raises(ValueError, match=r"2 input samples contain NaN or inf \(first: index 2\)"):
        cnn2d.predict(x)
    for bad in (np.zeros((1, 1, 8, 8), bool), np.full((1, 1, 8, 8), "a")):
        with pytest.raises(TypeError, match="real numbers"):
            cnn2d.predict(bad)
    with pytest.raises(ValueError, match="batch_size"):
        cnn2d.predict(inputs(SHAPES["cnn2d"], 2), batch_size=0)


def test_integer_and_float64_inputs_are_converted(cnn2d: OnnxModel) -> None:
    x = inputs(SHAPES["cnn2d"], 3)
    np.testing.assert_array_equal(cnn2d.predict(x.astype(np.float64)), cnn2d.predict(x))
    assert cnn2d.predict(np.ones((2, 1, 8, 8), np.int64)).shape == (2, NUM_CLASSES)


def test_benchmark_reports_batch1_latency_and_throughput(cnn2d: OnnxModel) -> None:
    stats = cnn2d.benchmark(inputs(SHAPES["cnn2d"], 40), batch_size=16)
    assert stats.samples == 40 and stats.batch_size == 16
    assert 0 < stats.p50_ms <= stats.p95_ms and stats.mean_ms > 0
    assert stats.throughput_per_s > 0
    assert cnn2d.benchmark(inputs(SHAPES["cnn2d"], 3)).batch_size == 3


def test_load_inputs_from_npy_and_npz(tmp_path: Path) -> None:
    x = inputs(SHAPES["cnn2d"], 4)
    np.save(tmp_path / "x.npy", x)
    np.savez(tmp_path / "x.npz", x=x.astype(np.float64), y=np.arange(4))
    np.save(tmp_path / "one.npy", x[0])
    for name in ("x.npy", "x.npz"):
        loaded = load_inputs(tmp_path / name, SHAPES["cnn2d"])
        assert loaded.dtype == np.float32
        np.testing.assert_array_equal(loaded, x)
    np.testing.assert_array_equal(load_inputs(tmp_path / "one.npy", SHAPES["cnn2d"]), x[:1])


def test_load_inputs_errors(tmp_path: Path) -> None:
    shape = SHAPES["cnn2d"]
    with pytest.raises(FileNotFoundError, match="no input file"):
        load_inputs(tmp_path / "missing.npy", shape)
    np.savez(tmp_path / "nox.npz", y=np.zeros((2, *shape)))
    with pytest.raises(ValueError, match=r"no 'x' array \(has: y\)"):
        load_inputs(tmp_path / "nox.npz", shape)
    np.save(tmp_path / "pickled.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    (tmp_path / "text.npy").write_text("1,2,3\n")
    (tmp_path / "cut.npz").write_bytes((tmp_path / "nox.npz").read_bytes()[:40])
    np.savez_compressed(tmp_path / "flipped.npz", x=np.zeros((50, *shape)))
    data = bytearray((tmp_path / "flipped.npz").read_bytes())
    data[100:110] = bytes(10)
    (tmp_path / "flipped.npz").write_bytes(bytes(data))
    for name in ("pickled.npy", "cut.npz", "flipped.npz"):
        with pytest.raises(ValueError, match="not a readable .npy or .npz file"):
            load_inputs(tmp_path / name, shape)
    (tmp_path / "samples.csv").write_text("a,b\n1,2\n")
    (tmp_path / "list.npz").write_bytes(pickle.dumps([1.0, 2.0]))
    for name in ("text.npy", "samples.csv", "list.npz"):  # numpy would offer to unpickle
        with pytest.raises(ValueError, match="is not a .npy or .npz file: predict reads") as e:
            load_inputs(tmp_path / name, shape)
        assert "pickle" not in str(e.value)
    np.save(tmp_path / "wrong.npy", np.zeros((2, 3, 8, 8), np.float32))
    with pytest.raises(ValueError, match=r"\(N, 1, 8, 8\)"):
        load_inputs(tmp_path / "wrong.npy", shape)
