"""A command that needs an extra which is not installed says which one, in one line, exit 2,
before it starts anything (tests/test_install.py shows it on a real device install)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from click.testing import CliRunner

import edgefl
from agent.data import load_dataset
from coordinator.cli import main
from protocol import extras

GATEWAY = "pip install 'edgefl-fleet[gateway]'"
LAB = "pip install 'edgefl-fleet[lab]'"


@pytest.fixture
def without(monkeypatch: pytest.MonkeyPatch):
    """Make the given modules look uninstalled to the extras check."""
    real = importlib.util.find_spec
    missing: set[str] = set()

    def find_spec(name: str, *args: object):
        return None if name in missing else real(name, *args)

    monkeypatch.setattr(extras.importlib.util, "find_spec", find_spec)
    return missing.update


@pytest.mark.parametrize(
    ("absent", "args", "line"),
    [
        (
            ["amqtt"],
            ["serve"],
            "coordinator serve's embedded broker (without --broker) needs the gateway extra "
            f"(amqtt not installed): {GATEWAY}",
        ),
        (
            ["uvicorn"],
            ["serve", "--broker", "127.0.0.1:1", "--http", "8080"],
            "coordinator serve --http (the dashboard and /metrics) needs the gateway extra "
            f"(uvicorn not installed): {GATEWAY}",
        ),
        (
            ["matplotlib"],
            ["run", "RUN.toml", "--broker", "127.0.0.1:1", "--plot", "plots"],
            f"coordinator run --plot needs the gateway extra (matplotlib not installed): {GATEWAY}",
        ),
        (
            ["sklearn"],
            ["simulate", "--dataset", "digits"],
            f"the digits dataset needs the lab extra (scikit-learn not installed): {LAB}",
        ),
        (
            ["amqtt", "mnist1d"],
            ["emulate", "--agents", "2"],
            "coordinator emulate's embedded broker (without --broker) needs the lab extra "
            f"(amqtt not installed): {LAB}",
        ),
        (
            ["mnist1d"],
            ["emulate", "--broker", "127.0.0.1:1", "--agents", "2"],
            f"the mnist1d dataset needs the lab extra (mnist1d not installed): {LAB}",
        ),
        (
            ["prometheus_client"],
            ["emulate", "--broker", "127.0.0.1:1", "--dataset", "synthetic", "--http", "8080"],
            "coordinator emulate --http (the dashboard and /metrics) needs the gateway extra "
            f"(prometheus-client not installed): {GATEWAY}",
        ),
        (
            ["ray"],
            ["simulate", "--backend", "ray"],
            "--backend ray needs the ray extra (ray not installed): "
            "pip install 'edgefl-fleet[ray]'",
        ),
    ],
)
def test_a_missing_extra_is_one_line_before_anything_starts(
    without, monkeypatch, tmp_path: Path, absent: list[str], args: list[str], line: str
) -> None:
    without(absent)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("coordinator.cli.stop_on_signal", lambda: pytest.fail("it started"))
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [f"Error: {line}"]
    assert list(tmp_path.iterdir()) == []  # no report, no work folder


def test_what_needs_no_extra_is_not_refused(without, monkeypatch, tmp_path: Path) -> None:
    """A simulation on a generated dataset needs neither the datasets nor the plots."""
    without(["sklearn", "mnist1d", "matplotlib", "amqtt"])
    monkeypatch.chdir(tmp_path)
    args = ["simulate", "--dataset", "synthetic", "--agents", "2", "--rounds", "1"]
    result = CliRunner().invoke(main, [*args, "--model", "mlp"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "report.json").is_file()


def test_a_built_in_dataset_loaded_without_its_extra(without) -> None:
    without(["mnist1d"])
    with pytest.raises(extras.MissingExtra, match=r"mnist1d dataset needs the lab extra"):
        load_dataset("mnist1d", seed=1)


def test_the_api_refuses_a_backend_it_cannot_use_in_one_sentence(without) -> None:
    config = edgefl.config(agents=2, rounds=1)
    with pytest.raises(edgefl.ConfigError, match=r"^--backend must be one of local, ray"):
        edgefl.simulate(config, backend="spark")
    without(["ray"])
    with pytest.raises(edgefl.ConfigError, match=r"needs the ray extra .*edgefl-fleet\[ray\]"):
        edgefl.simulate(config, backend="ray")
