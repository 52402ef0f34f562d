"""ONNX export and `edge-agent predict` for models users bring, by task (agent.onnx_export).

The example models here are the shapes users bring that the bundled ones do not cover:
BatchNorm in eval mode, recurrent layers traced with a dynamic batch axis, and autoencoders
whose output is a reconstruction of their input rather than logits.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner, Result
from torch import Tensor, nn

from agent.cli import main
from agent.onnx_export import export_onnx, max_abs_diff
from agent.onnx_model import Answer, OnnxModel, float32_values, reconstruction_error

ATOL = 1e-4
BATCHES = (1, 3, 64)


class DepthwiseSeparableCNN(nn.Module):
    """Keyword-spotting style classifier: a stem, then depthwise and pointwise convolutions,
    each followed by BatchNorm, whose running statistics serve in eval mode."""

    def __init__(self, classes: int = 6) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1, bias=False),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False),  # depthwise
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 16, 1, bias=False),  # pointwise
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(16, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


class GRURegressor(nn.Module):
    """Two stacked GRU layers over (N, T, F) windows; the last step predicts d targets."""

    def __init__(self, features: int = 3, hidden: int = 12, targets: int = 2) -> None:
        super().__init__()
        self.gru = nn.GRU(features, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, targets)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.gru(x)
        return self.head(out[:, -1])


class LSTMRegressor(nn.Module):
    """An LSTM whose last hidden state predicts one target per window: output (N,)."""

    def __init__(self, features: int = 3, hidden: int = 10) -> None:
        super().__init__()
        self.lstm = nn.LSTM(features, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: Tensor) -> Tensor:
        _, (h, _) = self.lstm(x)
        return self.head(h[-1]).squeeze(-1)


class ConvAutoencoder(nn.Module):
    """A strided convolution and a linear bottleneck, decoded by linear layers back to the
    input's shape (N, 1, 8, 8)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Conv2d(1, 4, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(4 * 4 * 4, 6),
        )
        self.decoder = nn.Sequential(
            nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 64), nn.Unflatten(1, (1, 8, 8))
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.decoder(self.encoder(x))


def cnn_with_trained_norms() -> nn.Module:
    """The CNN with BatchNorm statistics and affines far from their init (0, 1), as after
    training, so an export that used batch statistics instead would not match."""
    model = DepthwiseSeparableCNN()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                c = module.num_features
                assert module.running_mean is not None and module.running_var is not None
                module.running_mean.copy_(torch.randn(c, generator=gen))
                module.running_var.copy_(torch.rand(c, generator=gen) * 2 + 0.5)
                module.weight.copy_(torch.randn(c, generator=gen))
                module.bias.copy_(torch.randn(c, generator=gen))
    return model


@dataclass(frozen=True)
class Case:
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    task: str
    output_shape: tuple[int, ...]  # per sample


CASES = {
    "ds_cnn": Case(cnn_with_trained_norms, (1, 10, 10), "classification", (6,)),
    "gru": Case(GRURegressor, (16, 3), "regression", (2,)),
    "lstm": Case(LSTMRegressor, (16, 3), "regression", ()),
    "autoencoder": Case(ConvAutoencoder, (1, 8, 8), "reconstruction", (1, 8, 8)),
}


@dataclass
class Exported:
    case: Case
    model: nn.Module  # eval mode
    path: Path
    onnx_model: OnnxModel


def export(model: nn.Module, shape: tuple[int, ...], path: Path, task: str | None) -> Path:
    """Export the way the agent does, naming the task as the agent's metadata does."""
    metadata = None if task is None else {"task": task}
    return export_onnx(model, model.state_dict(), shape, path, metadata=metadata)


@pytest.fixture(scope="module", params=list(CASES))
def exported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Exported:
    case = CASES[request.param]
    torch.manual_seed(0)
    model = case.build().eval()
    path = export(model, case.input_shape, tmp_path_factory.mktemp("m") / "model.onnx", case.task)
    return Exported(case, model, path, OnnxModel.load(path, threads=1))


def inputs(shape: tuple[int, ...], n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, *shape)).astype(np.float32)


def test_export_matches_torch_at_batch_1_3_and_64(exported: Exported) -> None:
    """Traced at batch 2, the export runs at any batch size, the RNNs' initial hidden state
    included, and agrees with torch's eval-mode outputs."""
    case = exported.case
    for n in BATCHES:
        x = inputs(case.input_shape, n, seed=n)
        assert exported.onnx_model.predict(x).shape == (n, *case.output_shape)
        assert max_abs_diff(exported.model, exported.onnx_model, x) <= ATOL


def test_the_task_reaches_the_file(exported: Exported) -> None:
    assert exported.onnx_model.metadata == {"task": exported.case.task}
    assert exported.onnx_model.task == exported.case.task
    assert exported.onnx_model.input_shape == exported.case.input_shape


def test_export_refuses_a_model_returning_a_tuple(tmp_path: Path) -> None:
    class WithHidden(GRURegressor):
        def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
            out, h = self.gru(x)
            return self.head(out[:, -1]), h

    with pytest.raises(ValueError, match="must return one tensor.*returns a tuple of 2"):
        export(WithHidden(), (16, 3), tmp_path / "m.onnx", "regression")
    assert not any(tmp_path.iterdir())


def test_export_refuses_a_model_that_fixes_its_batch_size(tmp_path: Path) -> None:
    """`len(x)` is a constant in a trace: the file would fail at any batch but 2. The export
    is run at other batch sizes before it is written, so this is an error, not a file."""

    class LenState(GRURegressor):
        def forward(self, x: Tensor) -> Tensor:
            h0 = torch.zeros(2, len(x), 12)
            out, _ = self.gru(x, h0)
            return self.head(out[:, -1])

    with pytest.warns(torch.jit.TracerWarning), pytest.raises(ValueError, match="batch size"):
        export(LenState(), (16, 3), tmp_path / "m.onnx", "regression")
    assert not any(tmp_path.iterdir())


def test_export_refuses_an_output_that_does_not_fit_the_task(tmp_path: Path) -> None:
    gru = GRURegressor()
    with pytest.raises(ValueError, match=r"input's shape \(N, 16, 3\) or \(N, 48\), got \(N, 2\)"):
        export(gru, (16, 3), tmp_path / "m.onnx", "reconstruction")
    with pytest.raises(ValueError, match=r"class logits.*got \(N,\)"):
        export(LSTMRegressor(), (16, 3), tmp_path / "m.onnx", "classification")
    with pytest.raises(ValueError, match="unknown task 'segmentation'"):
        export(gru, (16, 3), tmp_path / "m.onnx", "segmentation")
    assert not any(tmp_path.iterdir())


def test_reconstruction_error_is_the_mean_squared_difference() -> None:
    x = inputs((1, 4, 4), 3)
    out = x + np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4) / 16
    expected = np.mean((np.arange(16) / 16) ** 2)
    np.testing.assert_allclose(reconstruction_error(x, out), [expected] * 3, rtol=1e-6)
    flat = reconstruction_error(x, out.reshape(3, 16))
    np.testing.assert_array_equal(flat, reconstruction_error(x, out))
    np.testing.assert_array_equal(reconstruction_error(x, out.reshape(3, 4, 4)), flat)
    with pytest.raises(ValueError, match=r"\(N, 1, 4, 4\) or \(N, 16\), got \(N, 15\)"):
        reconstruction_error(x, out.reshape(3, 16)[:, :15])


def test_float32_values_are_the_shortest_decimals() -> None:
    assert float32_values(np.array([0.1, 2.5, -1e-5], np.float32)) == [0.1, 2.5, -1e-05]
    assert float32_values(np.array([[0.1, 1.0]], np.float32)) == [[0.1, 1.0]]


# -- edge-agent predict -----------------------------------------------------------------------


def predict(model: Path, x: np.ndarray, tmp_path: Path, *flags: str) -> Result:
    """`edge-agent predict` on `x`, without the latency runs."""
    np.savez(tmp_path / "inputs.npz", x=x)
    args = ["predict", str(tmp_path / "inputs.npz"), "--model", str(model)]
    return CliRunner().invoke(main, [*args, "--latency-samples", "0", *flags])


def predict_json(model: Path, x: np.ndarray, tmp_path: Path, *flags: str) -> dict:
    result = predict(model, x, tmp_path, "--json", *flags)
    assert result.exit_code == 0, result.output
    answer: dict = json.loads(result.stdout)
    return answer


@pytest.fixture(scope="module")
def regressors(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[nn.Module, Path]]:
    folder = tmp_path_factory.mktemp("regressors")
    torch.manual_seed(0)
    models = {"gru": GRURegressor().eval(), "lstm": LSTMRegressor().eval()}
    return {
        name: (m, export(m, (16, 3), folder / f"{name}.onnx", "regression"))
        for name, m in models.items()
    }


def test_predict_prints_a_regressors_values(
    regressors: dict[str, tuple[nn.Module, Path]], tmp_path: Path
) -> None:
    """d targets: a list per sample (a line per sample as text); one target: one number per
    sample, on one line as classes are."""
    x = inputs((16, 3), 5)
    for name, per_sample in (("gru", 2), ("lstm", 0)):
        model, path = regressors[name]
        answer = predict_json(path, x, tmp_path)
        assert set(answer) == {"predictions", "latency"} and answer["latency"] is None
        with torch.no_grad():
            expected = model(torch.from_numpy(x)).numpy()
        got = np.array(answer["predictions"])
        assert got.shape == expected.shape == ((5, per_sample) if per_sample else (5,))
        assert np.abs(got - expected).max() <= ATOL
        text = predict(path, x, tmp_path)
        assert text.exit_code == 0, text.output
        lines = text.stdout.splitlines()
        values = [[float(v) for v in line.split()] for line in lines]
        np.testing.assert_array_equal(np.array(values).reshape(got.shape), got)
        assert len(lines) == (5 if per_sample else 1)


def identity_autoencoder() -> nn.Module:
    """Reconstructs any input exactly, as a flat (N, 64): error 0 whatever the input."""
    linear = nn.Linear(64, 64)
    with torch.no_grad():
        linear.weight.copy_(torch.eye(64))
        linear.bias.zero_()
    return nn.Sequential(nn.Flatten(), linear)


def zero_autoencoder() -> nn.Module:
    """Reconstructs everything as zeros in the input's shape, as an autoencoder trained on
    quiet signals would: the error is the input's mean square, small near the training data
    and large far from it."""
    linear = nn.Linear(64, 64)
    with torch.no_grad():
        linear.weight.zero_()
        linear.bias.zero_()
    return nn.Sequential(nn.Flatten(), linear, nn.Unflatten(1, (1, 8, 8)))


def test_predict_flags_samples_far_from_the_training_data(tmp_path: Path) -> None:
    path = export(zero_autoencoder(), (1, 8, 8), tmp_path / "ae.onnx", "reconstruction")
    x = np.stack([np.zeros((1, 8, 8)), np.full((1, 8, 8), 0.5), np.full((1, 8, 8), 3.0)])
    answer = predict_json(path, x, tmp_path, "--threshold", "1")
    assert answer == {
        "predictions": [0.0, 0.25, 9.0],
        "anomalies": [False, False, True],
        "latency": None,
    }
    assert predict_json(path, x, tmp_path) == {"predictions": [0.0, 0.25, 9.0], "latency": None}
    text = predict(path, x, tmp_path, "--threshold", "1")
    assert text.exit_code == 0, text.output
    assert text.stdout.splitlines() == [
        "0.0 0.25 9.0",
        "1 of 3 samples are anomalies (reconstruction_error > 1.0): samples 2",
    ]


def test_a_perfect_reconstruction_is_never_an_anomaly(tmp_path: Path) -> None:
    path = export(identity_autoencoder(), (1, 8, 8), tmp_path / "ae.onnx", "reconstruction")
    x = np.stack([np.zeros((1, 8, 8)), np.full((1, 8, 8), 1e3), inputs((1, 8, 8), 1)[0] * 50])
    answer = predict_json(path, x, tmp_path, "--threshold", "0")
    assert answer["predictions"] == [0.0, 0.0, 0.0]
    assert answer["anomalies"] == [False, False, False]
    text = predict(path, x, tmp_path, "--threshold", "0")
    assert text.stdout.splitlines()[-1] == (
        "0 of 3 samples are anomalies (reconstruction_error > 0.0)"
    )


def test_threshold_is_a_one_line_error_on_other_models(
    regressors: dict[str, tuple[nn.Module, Path]], tmp_path: Path
) -> None:
    """A classifier exported before there were tasks (no `task` metadata) and a regressor:
    --threshold means nothing for them, said on one line before the inputs are read."""
    cnn = export(DepthwiseSeparableCNN(), (1, 10, 10), tmp_path / "cnn.onnx", None)
    for path, task in ((cnn, "classification"), (regressors["gru"][1], "regression")):
        result = predict(path, np.zeros((1, 2)), tmp_path, "--threshold", "1")
        assert result.exit_code == 2
        assert result.output.splitlines() == [
            f"Error: --threshold applies to reconstruction models only; {path} is a {task} model"
        ]


def test_a_classifier_answers_as_before(tmp_path: Path) -> None:
    """Classes, the same JSON keys and text line as before tasks: old and new files alike."""
    torch.manual_seed(0)
    model = cnn_with_trained_norms().eval()
    x = inputs((1, 10, 10), 7)
    with torch.no_grad():
        classes = model(torch.from_numpy(x)).argmax(dim=1).tolist()
    for task in (None, "classification"):
        path = export(model, (1, 10, 10), tmp_path / f"{task}.onnx", task)
        assert predict_json(path, x, tmp_path) == {"predictions": classes, "latency": None}
        assert predict(path, x, tmp_path).stdout == " ".join(map(str, classes)) + "\n"


def test_bad_thresholds_and_unknown_tasks_are_one_line_errors(tmp_path: Path) -> None:
    path = export(zero_autoencoder(), (1, 8, 8), tmp_path / "ae.onnx", "reconstruction")
    for bad in ("-1", "nan", "inf"):
        result = predict(path, np.zeros((1, 1, 8, 8)), tmp_path, "--threshold", bad)
        assert result.exit_code == 2 and "--threshold" in result.output
        assert "Traceback" not in result.output
    proto = onnx.load(path)
    onnx.helper.set_model_props(proto, {"task": "segmentation"})
    onnx.save(proto, tmp_path / "future.onnx")
    result = predict(tmp_path / "future.onnx", np.zeros((1, 1, 8, 8)), tmp_path)
    assert result.exit_code == 1
    assert result.output.splitlines() == [
        "Error: unknown task 'segmentation' in the model's metadata "
        "(known: classification, regression, reconstruction)"
    ]


def test_answer_lines_for_several_values_per_sample() -> None:
    answer = Answer("regression", [[[1.0, 2.0], [3.0, 4.0]], [[0.5, 0.0], [1.0, -1.0]]])
    assert answer.lines() == ["1.0 2.0 3.0 4.0", "0.5 0.0 1.0 -1.0"]
    assert answer.fields() == {"predictions": answer.predictions}


def test_export_accepts_outputs_that_are_nan_where_torch_is_nan_too(tmp_path: Path) -> None:
    """A model defined on part of the input space (a log of shifted features) gives NaN on
    the export check's random inputs, in torch and onnxruntime alike: no disagreement."""

    class LogFeatures(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return torch.log(x - 0.5)

    path = export(LogFeatures(), (4,), tmp_path / "m.onnx", "regression")
    x = np.array([[0.25, 1.0, 2.0, np.e + 0.5]], np.float32)
    got = OnnxModel.load(path).predict(x)
    np.testing.assert_allclose(got[0, 1:], np.log([0.5, 1.5, np.e]), rtol=1e-6)
    assert np.isnan(got[0, 0])
