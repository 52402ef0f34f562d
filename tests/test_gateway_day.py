"""A gateway operator's day on real processes: where the run history goes, and what
`coordinator status` and `coordinator serve` (the dashboard's view) say about the fleet
after runs, restarts and a device whose clock jumped back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from test_cli import COORDINATOR, REPO

from coordinator.runs import RunEntry, save_entry

pytestmark = pytest.mark.timeout(120)


def gateway_env(home: Path) -> dict[str, str]:
    """The environment of a gateway command run by a user whose home is `home`, with no
    runs folder of its own (the suite's conftest gives every process one)."""
    env = {k: v for k, v in os.environ.items() if k != "EDGEFL_RUNS_DIR"}
    return env | {"HOME": str(home), "COLUMNS": "200"}


def listed_runs(state: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    command = [*COORDINATOR, "runs", "--state-dir", str(state), "--json"]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env, timeout=60)


def test_runs_are_kept_in_the_gateway_state_folder(amqtt_broker, tmp_path: Path) -> None:
    """`coordinator run --state-dir S` records its run in S/runs and `coordinator runs
    --state-dir S` lists it; an older version's ~/.edgefl/runs is moved there, with a line,
    and another state folder (another gateway) has a history of its own."""
    home, state = tmp_path / "home", tmp_path / "state"
    env = gateway_env(home)
    legacy = home / ".edgefl" / "runs"
    save_entry(legacy, RunEntry("run-old", "lab", "fedavg", 3, "/a.toml", state="done"))
    run_file = tmp_path / "run.toml"
    run_file.write_text("[run]\nagents = 2\nrounds = 1\n")
    log = tmp_path / "run.log"
    command = [*COORDINATOR, "run", str(run_file), "--broker", str(amqtt_broker.address)]
    with open(log, "wb") as out:
        run = subprocess.Popen(
            [*command, "--state-dir", str(state)],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        deadline = time.monotonic() + 60
        while "waiting for 2 agents" not in log.read_text():
            assert time.monotonic() < deadline and run.poll() is None, log.read_text()
            time.sleep(0.1)
        run.send_signal(signal.SIGINT)
        assert run.wait(30) == 1
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(10)
    said = " ".join(log.read_text().split())
    assert f"moved the run history of an older version from {legacy} to {state / 'runs'}" in said
    assert not legacy.exists()
    listed = listed_runs(state, env)
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert [(r["run_id"] == "run-old", r["state"]) for r in rows] == [
        (True, "done"),
        (False, "cancelled"),
    ], rows
    assert (state / "runs" / rows[1]["run_id"] / "run.json").is_file()
    other = listed_runs(tmp_path / "other-state", env)
    assert other.returncode == 0 and json.loads(other.stdout) == [], other.stderr
