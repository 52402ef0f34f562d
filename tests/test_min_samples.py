"""`min_samples` sets the fewest samples the partition gives an agent: through the API, the run
file and the CLI, so a fleet larger than the dataset's default share allows can run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import edgefl
from agent.runfile import load_run_file
from agent.workload import partitioned

REPO = Path(__file__).resolve().parent.parent
AGENTS = 200
"""digits' train pool holds 1,437 samples: 200 agents need a minimum under 7 a head."""


def test_the_api_passes_min_samples_to_the_partition() -> None:
    config = edgefl.config(dataset="digits", agents=AGENTS, min_samples=3)
    _, parts = partitioned(config)
    sizes = [len(p.train.y) + len(p.val.y) for p in parts]
    assert len(sizes) == AGENTS and min(sizes) >= 3
    higher = edgefl.config(dataset="digits", agents=20, min_samples=60, partition="dirichlet:0.1")
    assert min(len(p.train.y) + len(p.val.y) for p in partitioned(higher)[1]) >= 60
    with pytest.raises(ValueError, match="use fewer agents or a lower --min-samples"):
        partitioned(edgefl.config(dataset="digits", agents=AGENTS))


def test_a_run_file_sets_min_samples_for_a_partitioned_dataset(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(f'[run]\ndataset = "digits"\nagents = {AGENTS}\nmin_samples = 3\n')
    config = load_run_file(path).config(AGENTS)
    assert config.min_samples == 3
    assert len(partitioned(config)[1]) == AGENTS


def test_the_cli_runs_a_fleet_the_default_minimum_refuses(tmp_path: Path) -> None:
    def simulate(*args: str) -> subprocess.CompletedProcess[str]:
        code = "from coordinator.cli import main; main(prog_name='coordinator')"
        fleet = ["--strategy", "local", "--dataset", "digits", "--agents", str(AGENTS)]
        return subprocess.run(
            [sys.executable, "-c", code, "simulate", *fleet, "--rounds", "1", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
            env={"PYTHONPATH": str(REPO), "COLUMNS": "120", "PATH": "/usr/bin:/bin"},
        )

    refused = simulate()
    assert refused.returncode != 0 and "--min-samples" in refused.stderr
    assert "Traceback" not in refused.stderr
    ran = simulate("--min-samples", "3", "--report", "report.json")
    assert ran.returncode == 0, ran.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["config"]["min_samples"] == 3
    assert len(report["rounds"][0]["agents"]) == AGENTS
