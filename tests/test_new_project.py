"""`coordinator new NAME`: every template makes a project whose README's commands run as
written, in real processes (new, split.py, simulate; emulate for one template), and train a
model better than knowing nothing; on the classification template's data the fleet beats
training alone; a device reads its own file through data.py; nothing is ever overwritten;
and the wheel ships the templates."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from agent.own_data import load_own_data, misfit
from agent.report import metric_of
from agent.runfile import load_run_file
from coordinator.cli import main as coordinator
from coordinator.new_project import TEMPLATES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
COORDINATOR = [
    sys.executable,
    "-c",
    "from coordinator.cli import main; main(prog_name='coordinator')",
]
METRICS = {
    "classification": ("accuracy", True),
    "regression": ("mae", False),
    "anomaly": ("reconstruction_error", False),
}


def _run(argv: list[str], cwd: Path, timeout_s: float = 120) -> str:
    """Run a command the way a user types it (`coordinator` and `python` are this checkout's),
    in its own process group, killed with whatever it started if it fails or hangs."""
    programs = {"coordinator": COORDINATOR, "python": [sys.executable]}
    command = [*programs.get(argv[0], argv[:1]), *argv[1:]]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    process = subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout_s)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 0, f"{shlex.join(argv)} failed:\n{output}"
    return output


def _readme_commands(project: Path) -> list[list[str]]:
    """The README's next commands, as a user copies them (comments dropped)."""
    block = re.search(
        r"## The next 3 commands\n\n```bash\n(.*?)```",
        project.joinpath("README.md").read_text(),
        re.S,
    )
    assert block, "the README names its next commands in a bash block"
    return [shlex.split(line, comments=True) for line in block[1].splitlines()]


def _make(template: str, folder: Path) -> Path:
    output = _run(["coordinator", "new", "project", "--template", template], folder)
    project = folder / "project"
    assert "cd project" in output and "python split.py" in output
    return project


def _devices(project: Path) -> list[dict[str, np.ndarray]]:
    files = sorted((project / "data").glob("device-*.npz"))
    assert files, "split.py wrote device files"
    loaded = []
    for path in files:
        with np.load(path) as stored:
            loaded.append({key: stored[key] for key in stored.files})
    return loaded


def _knowing_nothing(template: str, devices: list[dict[str, np.ndarray]]) -> float:
    """The metric of a device that predicts without its input: its most frequent label, its
    mean target, its mean window."""
    if template == "classification":
        return float(np.mean([np.bincount(d["y"]).max() / len(d["y"]) for d in devices]))
    if template == "regression":
        return float(np.mean([np.abs(d["y"] - d["y"].mean()).mean() for d in devices]))
    return float(np.mean([((d["x"] - d["x"].mean(0)) ** 2).mean() for d in devices]))


def _metric(report_path: Path, template: str) -> float:
    report = json.loads(report_path.read_text())
    name, higher = METRICS[template]
    assert metric_of(report) == (name, higher)
    return float(report["summary"][f"mean_{name}"])


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_each_template_runs_as_its_readme_says_and_learns(template: str, tmp_path: Path) -> None:
    project = _make(template, tmp_path)
    split, simulate, emulate = _readme_commands(project)
    assert split[:2] == ["python", "split.py"] and simulate[:2] == ["coordinator", "simulate"]
    assert emulate[:2] == ["coordinator", "emulate"]
    _run(split, project)
    _run(simulate, project)
    devices = _devices(project)
    figure, baseline = (
        _metric(project / "report.json", template),
        _knowing_nothing(template, devices),
    )
    better = figure > baseline if METRICS[template][1] else figure < baseline
    assert better, f"{template}: {figure} against {baseline} knowing nothing"
    assert len(devices) == tomllib.loads((project / "run.toml").read_text())["run"]["agents"]
    if template == "classification":
        _fleet_beats_training_alone(project, simulate, figure)


def _fleet_beats_training_alone(project: Path, simulate: list[str], fleet: float) -> None:
    """The product's point on a first run: with the run file as written, the models the
    devices keep (`fleet`, the mean of report.json) beat each device's model trained alone
    (`--strategy local`), and most devices keep one learnt with the fleet. On the template's
    earlier data (4 devices of 300 easy samples) every device kept its local model and the
    two means were equal."""
    _run([*simulate, "--strategy", "local", "--report", "alone.json"], project)
    alone = _metric(project / "alone.json", "classification")
    assert fleet >= alone + 0.03, f"the fleet's kept models {fleet}, alone {alone}"
    kept = json.loads((project / "report.json").read_text())["summary"]["kept"]
    assert kept.get("personal", 0) > kept.get("local", 0), kept


def test_a_project_emulates_as_agent_processes(tmp_path: Path) -> None:
    project = _make("classification", tmp_path)
    _, _, emulate = _readme_commands(project)
    _run(["python", "split.py", "--devices", "3"], project)
    small = ["--agents", "3", "--rounds", "2", "--agents-per-process", "3"]
    output = _run([*emulate, *small], project, timeout_s=240)
    written = re.search(r"report written to (\S+)", " ".join(output.split()))
    assert written and "--report" not in emulate, output  # run twice, it never replaces one
    report_path = project / written.group(1)
    report = json.loads(report_path.read_text())
    assert len(report["rounds"]) == 2, output
    assert sorted(report["rounds"][-1]["agents"]) == ["agent-000", "agent-001", "agent-002"]
    assert _metric(report_path, "classification") > 1 / 4  # four classes: chance


def test_a_device_reads_its_own_file_and_the_run_file_serves_devices(tmp_path: Path) -> None:
    """What the README's "On real devices" says to do. A loopback run of edge-agents with
    that data and run file (`coordinator run`, 2 agents) trained when tried by hand; what
    is the template's own is checked here: the loader and the run file."""
    project = _make("regression", tmp_path)
    source = f"python:{project / 'data.py'}:device"
    with pytest.raises(ValueError, match=r"device\.npz: copy this device's file") as missing:
        load_own_data(source)
    assert "\n" not in str(missing.value)
    _run(["python", "split.py", "--devices", "2", "--samples", "50"], project)
    (project / "data" / "device-2.npz").rename(project / "data" / "device.npz")
    own = load_own_data(source)
    assert own.samples == 50 and own.targets == 1 and own.input_shape == (8,)
    run_file = project / "run.toml"
    lines = run_file.read_text().splitlines(keepends=True)
    run_file.write_text("".join(x for x in lines if not x.startswith(("dataset =", "partition ="))))
    devices = load_run_file(run_file)
    assert devices.dataset == "device" and devices.wanted == 12
    config = devices.config(12, own.input_shape)
    assert (config.task, config.model) == ("regression", f"{project / 'model.py'}:build")
    assert misfit(own.describe(), own.input_shape, 0, 10, task="regression", targets=1) is None


def test_new_never_overwrites_and_names_its_templates(tmp_path: Path) -> None:
    kept = tmp_path / "taken"
    kept.mkdir()
    (kept / "run.toml").write_text("mine")
    runner = CliRunner()
    refused = runner.invoke(coordinator, ["new", str(kept)])
    assert refused.exit_code == 1
    assert refused.output.strip().splitlines() == [
        f"Error: {kept} is a folder that is not empty; give `coordinator new` a new name"
    ]
    assert [p.name for p in kept.iterdir()] == ["run.toml"] and (
        kept / "run.toml"
    ).read_text() == "mine"
    unknown = runner.invoke(coordinator, ["new", str(tmp_path / "p"), "--template", "vision"])
    assert unknown.exit_code == 2 and "'vision' is not one of 'classification'" in unknown.output
    assert not (tmp_path / "p").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    made = runner.invoke(coordinator, ["new", str(empty), "--template", "anomaly"])
    assert made.exit_code == 0, made.output
    assert sorted(p.name for p in empty.iterdir()) == [
        "README.md",
        "data.py",
        "model.py",
        "run.toml",
        "split.py",
    ]
    assert (
        "# empty\n" in (empty / "README.md").read_text()
        and "{" not in (empty / "run.toml").read_text()
    )


def test_the_wheel_declares_every_template_file() -> None:
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]
    patterns = package_data["coordinator"]
    root = REPO / "coordinator"
    files = [
        p.relative_to(root).as_posix()
        for p in (root / "templates").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    ]
    assert len(files) >= 1 + 4 * len(TEMPLATES)
    assert all(any(fnmatch.fnmatch(f, pattern) for pattern in patterns) for f in files), files
