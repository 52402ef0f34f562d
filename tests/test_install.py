"""The install as users get it: the wheel, built without build isolation on the oldest
setuptools the metadata allows, installed into a fresh virtual environment (none of this
machine's packages; made by the system Python where that one refuses pip, as on Debian 12 and
Raspberry Pi OS), the device profile first and then each extra on top. After each step
the commands of that profile run, and those of a missing extra say in one line, before
starting anything, which extra to install."""

from __future__ import annotations

import json
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from bench.install_footprint import (
    TORCH_PIN,
    FreshVenv,
    build_wheel,
    externally_managed_python,
    requirement,
    run,
)
from bench.support import broker
from coordinator.ports import free_port
from tests.processes import end

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

RUN_FILE = """[run]
strategy = "local"
agents = 1
input_shape = [12]
classes = 3
rounds = 3
linger = 0
seed = 1
"""


def refused(venv: FreshVenv, *args: str) -> str:
    """The one line a command without its extra prints: exit 2, no traceback."""
    done = subprocess.run(args, capture_output=True, text=True, cwd=venv.path, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    return line


def gateway_modules_absent(venv: FreshVenv) -> list[str]:
    probe = "import importlib.util as u; print(*[m for m in {} if u.find_spec(m)])"
    modules = ["amqtt", "starlette", "uvicorn", "prometheus_client", "matplotlib", "sklearn"]
    return run([venv.python, "-c", probe.format(modules)]).stdout.split()


def device_runs_own_data(venv: FreshVenv, work: Path) -> None:
    """`edge-agent --data` trains on its own data over a broker and exports its model;
    `edge-agent predict` classifies with it."""
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, 300)
    x = (rng.normal(size=(300, 12)) + labels[:, None]).astype(np.float32)
    np.savez(work / "own.npz", x=x, y=labels)
    (work / "run.toml").write_text(RUN_FILE)
    with broker("embedded", work) as address:
        run(
            [venv.bin("edge-agent"), "--broker", address, "--id", "pi-1", "--data", "own.npz",
             "--state-dir", "state", "--expect", "1", "--run", "run.toml"],
            cwd=work, timeout=120,
        )  # fmt: skip
    predicted = run(
        [venv.bin("edge-agent"), "predict", "own.npz", "--model", "state/model.onnx", "--json"],
        cwd=work,
    ).stdout
    classes = np.array(json.loads(predicted)["predictions"])
    assert classes.shape == (300,)
    assert (classes == labels).mean() > 0.5  # it learned: chance is 1/3


def gateway_serves_dashboard(venv: FreshVenv, work: Path) -> None:
    """`coordinator serve --http` on loopback: the broker and /metrics answer; SIGTERM ends it."""
    port, http = free_port(), free_port()
    serve = subprocess.Popen(
        [venv.bin("coordinator"), "serve", "--port", str(port), "--http", f"127.0.0.1:{http}"],
        cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=2) as r:
                    assert r.status == 200 and b"edgefl" in r.read()
                break
            except OSError:
                assert serve.poll() is None and time.monotonic() < deadline, serve.stdout
                time.sleep(0.2)
        socket.create_connection(("127.0.0.1", port), 2).close()
        time.sleep(2)
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            output, _ = serve.communicate(timeout=30)
        finally:
            end(serve)  # one that ignored SIGTERM: killed, and the test fails on its code
    assert serve.returncode == 0, output
    assert "Traceback" not in output


def readme_main_job() -> list[str]:
    """The `coordinator emulate ...` of README.md's first command."""
    match = re.search(r"^bash scripts/setup\.sh && \S*coordinator (emulate [^\n]+)$",
                      (ROOT / "README.md").read_text(), re.MULTILINE)  # fmt: skip
    assert match, "README.md's first command is not setup.sh followed by the main job"
    return shlex.split(match.group(1))


def test_each_profile_installs_from_the_wheel_and_runs_its_commands(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path)
    python = externally_managed_python() or sys.executable
    venv = FreshVenv(tmp_path / "venv", python, compile_bytecode=False)
    venv.install(TORCH_PIN)
    work = tmp_path / "work"
    work.mkdir()

    venv.install(requirement(wheel, "base"))
    assert gateway_modules_absent(venv) == []
    assert run([venv.bin("edge-agent"), "--version"]).stdout.startswith("edge-agent 0.1.0")
    assert "--data" in run([venv.bin("edge-agent"), "--help"]).stdout
    device_runs_own_data(venv, work)
    gateway_hint = "pip install 'edgefl-fleet[gateway]'"
    assert refused(venv, venv.bin("coordinator"), "serve", "--http", "8080").endswith(gateway_hint)
    lab_hint = "pip install 'edgefl-fleet[lab]'"
    simulate = [venv.bin("coordinator"), "simulate", "--agents", "2", "--rounds", "2"]
    assert refused(venv, *simulate).endswith(lab_hint)

    venv.install(requirement(wheel, "gateway"))
    gateway_serves_dashboard(venv, work)
    assert refused(venv, *simulate).endswith(lab_hint)

    venv.install(requirement(wheel, "lab"))
    run([*simulate, "--report", work / "simulate.json"], cwd=work, timeout=300)
    run([venv.bin("coordinator"), *readme_main_job()], cwd=work, timeout=300)
    assert (work / "report.json").is_file() and (work / "plots" / "accuracy.png").is_file()
    # A user's own model and data (an example's files) from the installed package, and the
    # Python API.
    example = ROOT / "examples" / "anomaly_autoencoder" / "run.toml"
    run(
        [
            venv.bin("coordinator"),
            "simulate",
            "--run",
            example,
            "--agents",
            "2",
            "--rounds",
            "1",
            "--report",
            work / "example.json",
        ],
        cwd=work,
        timeout=300,
    )
    metric = run(
        [
            venv.bin("python"),
            "-c",
            "import edgefl; print(edgefl.Report.load('example.json').metric)",
        ],
        cwd=work,
    ).stdout.strip()
    assert metric == "reconstruction_error"
