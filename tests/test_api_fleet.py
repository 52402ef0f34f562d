"""The Python API runs a real fleet: agents in threads (`edgefl.run_agent`) and a run
(`edgefl.run`) over a broker, with a user's model and a python: data source on each device,
and returns the same report `coordinator run` writes."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

import pytest

import edgefl
from protocol import BrokerAddress

SOURCE = """
import numpy as np

def read():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(60, 8)).astype("float32")
    return x, (x[:, 0] > 0).astype("int64")
"""
NETS = """
from torch import nn

def build(input_shape, num_outputs):
    return nn.Sequential(nn.Linear(input_shape[0], 16), nn.ReLU(), nn.Linear(16, num_outputs))
"""
RUN = """
[run]
model = "./nets.py:build"
agents = 2
input_shape = [8]
classes = 2
strategy = "dadpfl"
rounds = 2
epochs = 1
round_timeout = 30
"""


def test_agents_and_a_run_from_python(
    tmp_path: Path, embedded_address: BrokerAddress, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "apisource.py").write_text(SOURCE)
    (tmp_path / "nets.py").write_text(NETS)
    (tmp_path / "run.toml").write_text(RUN)
    monkeypatch.syspath_prepend(str(tmp_path))
    broker = str(embedded_address)
    stop = threading.Event()
    errors: list[BaseException] = []

    def agent(name: str) -> None:
        try:
            edgefl.run_agent(
                broker=broker,
                stop=stop,
                fleet="api",
                agent_id=name,
                data="python:apisource:read",
                state_dir=tmp_path / name,
                once=True,
            )
        except BaseException as exc:  # noqa: BLE001 (asserted below)
            errors.append(exc)

    threads = [threading.Thread(target=agent, args=(n,)) for n in ("d1", "d2")]
    for thread in threads:
        thread.start()
    handler = signal.getsignal(signal.SIGINT)
    try:
        (tmp_path / "report.json").write_text("{}")  # an earlier run's: never replaced
        monkeypatch.chdir(tmp_path)
        report = edgefl.run(
            tmp_path / "run.toml",
            broker=broker,
            fleet="api",
            runs_dir=tmp_path / "runs",
        )
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert errors == []
    assert signal.getsignal(signal.SIGINT) == handler, "the caller's handler is back"
    assert report.metric == "accuracy"
    assert report.config == edgefl.Report.load(tmp_path / "report-2.json").config, "where it went"
    assert (tmp_path / "report.json").read_text() == "{}"
    assert [sorted(r["agents"]) for r in report.rounds] == [["d1", "d2"], ["d1", "d2"]]
    assert report.config["model_fingerprint"], "a device run with a user model carries it"
    assert (tmp_path / "d1" / "model.onnx").is_file()
    sys.modules.pop("apisource", None)
    sys.modules.pop("nets", None)


def test_a_bad_option_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(edgefl.ConfigError, match="run file"):
        edgefl.run(tmp_path / "missing.toml", broker="127.0.0.1:1")
