"""The examples in examples/ work as their READMEs say: each trains under the strategies of
the papers and FedAvg in simulate, one runs as real agent processes with the same figures,
and the anomaly autoencoder's exported model flags anomalies with `edge-agent predict`."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import edgefl
from agent.cli import main as edge_agent

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
METRICS = {
    "keyword_spotting": ("accuracy", True),
    "sensor_regression": ("mae", False),
    "anomaly_autoencoder": ("reconstruction_error", False),
}
SHORT = {"agents": 4, "rounds": 2, "epochs": 1}


CODE = {"own_strategy": ("strategy.py",)}
"""The code of an example that brings no model or data of its own (tests/test_user_strategy.py
runs it); the others bring their model (nets.py) and data (data.py)."""


def test_every_example_has_a_readme_a_run_file_and_its_code() -> None:
    found = sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir())
    assert found == sorted([*METRICS, *CODE])
    for name in found:
        for file in ("README.md", "run.toml", *CODE.get(name, ("nets.py", "data.py"))):
            assert (EXAMPLES / name / file).is_file(), f"{name}/{file}"


@pytest.mark.parametrize("strategy", ["dadpfl", "fedspu", "fedavg", "fedldf"])
@pytest.mark.parametrize("example", sorted(METRICS))
def test_each_example_trains_under_every_strategy(example: str, strategy: str) -> None:
    config = edgefl.config(EXAMPLES / example / "run.toml", strategy=strategy, **SHORT)
    report = edgefl.simulate(config)
    name, higher = METRICS[example]
    assert (report.metric, report.higher_is_better) == (name, higher)
    assert len(report.rounds) == 2
    for record in report.rounds:
        assert len(record["agents"]) == 4
        assert all(math.isfinite(a[name]) for a in record["agents"].values())
    assert math.isfinite(report.mean_metric)


TASKS = {
    "keyword_spotting": "classification",
    "sensor_regression": "regression",
    "anomaly_autoencoder": "reconstruction",
}


@pytest.mark.parametrize("example", sorted(METRICS))
def test_each_example_model_exports_to_onnx_as_torch_computes_it(
    example: str, tmp_path: Path
) -> None:
    import torch

    from agent.onnx_export import export_onnx, max_abs_diff
    from agent.onnx_model import OnnxModel
    from agent.user_code import load_callable

    folder = EXAMPLES / example
    x = load_callable(f"{folder / 'data.py'}:load", "data source")(seed=1)["x"][:64]
    torch.manual_seed(0)
    model = load_callable(f"{folder / 'nets.py'}:build", "model")(
        tuple(x.shape[1:]),
        {"keyword_spotting": 6, "sensor_regression": 1}.get(example, int(np.prod(x.shape[1:]))),
    )
    model.train()
    with torch.no_grad():  # BatchNorm statistics that are not the defaults
        model(torch.from_numpy(x))
    path = export_onnx(
        model,
        model.state_dict(),
        x.shape[1:],
        tmp_path / "m.onnx",
        metadata={"task": TASKS[example]},
    )
    assert max_abs_diff(model, OnnxModel.load(path), x) < 1e-4


def test_the_autoencoder_emulated_equals_simulated_and_its_model_flags_anomalies(
    tmp_path: Path,
) -> None:
    # Long enough for the model to learn normal operation (the run file's epochs).
    config = edgefl.config(
        EXAMPLES / "anomaly_autoencoder" / "run.toml", strategy="fedavg", agents=4, rounds=6
    )
    simulated = edgefl.simulate(config)
    emulated = edgefl.emulate(config, workdir=tmp_path / "fleet", agents_per_process=4)
    for sim, emu in zip(simulated.rounds, emulated.rounds, strict=True):
        for agent, figures in sim["agents"].items():
            assert emu["agents"][agent]["reconstruction_error"] == figures["reconstruction_error"]
            assert emu["agents"][agent]["sparsity"] == figures["sparsity"]

    sys.path.insert(0, str(EXAMPLES / "anomaly_autoencoder"))
    try:
        from data import anomalies, load  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(EXAMPLES / "anomaly_autoencoder"))
        sys.modules.pop("data", None)
    normal = load(seed=1)["x"][::48]  # windows of every pump
    np.save(tmp_path / "normal.npy", normal)
    np.save(tmp_path / "anomalies.npy", anomalies(count=20))
    model = tmp_path / "fleet" / "agent-000" / "model.onnx"

    def errors(inputs: str) -> list[float]:
        result = CliRunner().invoke(
            edge_agent,
            ["predict", str(tmp_path / inputs), "--model", str(model), "--json"],
        )
        assert result.exit_code == 0, result.output
        return json.loads(result.output)["predictions"]

    normal_errors, anomaly_errors = errors("normal.npy"), errors("anomalies.npy")
    threshold = float(np.percentile(normal_errors, 95))
    flagged = CliRunner().invoke(
        edge_agent,
        [
            "predict",
            str(tmp_path / "anomalies.npy"),
            "--model",
            str(model),
            "--threshold",
            str(threshold),
            "--json",
        ],
    )
    assert flagged.exit_code == 0, flagged.output
    assert np.mean(anomaly_errors) > 2 * np.mean(normal_errors)
    assert sum(json.loads(flagged.output)["anomalies"]) >= 15
