"""A gateway operator's day on real processes: where the run history goes, and what
`coordinator status` and `coordinator serve` (the dashboard's view) say about the fleet
after runs, restarts and a device whose clock jumped back."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from test_cli import COORDINATOR, EDGE_AGENT, REPO

from coordinator.ports import free_port
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
    typo = listed_runs(tmp_path / "stat", env)  # a mistyped --state-dir: nothing moves
    assert legacy.is_dir() and not (tmp_path / "stat").exists(), typo.stderr
    assert f"runs of an older version are still in {legacy}" in " ".join(typo.stderr.split())
    state.mkdir()  # the gateway's state folder (its keys, its broker's files)
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
    save_entry(legacy, RunEntry("run-older", "lab", "fedavg", 3, "/a.toml", state="done"))
    again = listed_runs(state, env)
    assert len(json.loads(again.stdout)) == 2, "a history is moved once, never merged"
    assert f"runs of an older version are still in {legacy}" in " ".join(again.stderr.split())


class Fleet:
    """`coordinator serve` (with its dashboard) and edge-agents on loopback, each a real
    process logging to a file in `folder`; `close` ends every one of them."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port, self.http = free_port(), free_port()
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def broker(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, name: str, command: list[str], env: dict[str, str] | None = None) -> None:
        with open(self.folder / f"{name}.log", "ab") as out:
            self.processes[name] = subprocess.Popen(
                command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env
            )

    def serve(self, name: str = "serve") -> None:
        serve = ["serve", "--host", "127.0.0.1", "--port", str(self.port)]
        self.start(name, [*COORDINATOR, *serve, "--http", str(self.http)])
        self.wait_for(name, f"listening on {self.broker}")

    def agent(self, name: str, env: dict[str, str] | None = None) -> None:
        state = ["--state-dir", str(self.folder / name)]
        self.start(name, [*EDGE_AGENT, "--broker", self.broker, "--id", name, *state], env)

    def log(self, name: str) -> str:
        return " ".join((self.folder / f"{name}.log").read_text(errors="replace").split())

    def wait_for(self, name: str, text: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.log(name):
            assert time.monotonic() < deadline, f"{text!r} not in {name}.log:\n{self.log(name)}"
            assert self.processes[name].poll() is None, f"{name} ended:\n{self.log(name)}"
            time.sleep(0.1)

    def stop(self, name: str) -> None:
        process = self.processes.pop(name)
        process.terminate()
        process.wait(30)

    def close(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait(10)

    def coordinator(self, *args: str) -> subprocess.CompletedProcess[str]:
        command = [*COORDINATOR, *args, "--broker", self.broker]
        env = {**os.environ, "COLUMNS": "200"}
        return subprocess.run(
            command, cwd=REPO, capture_output=True, text=True, env=env, timeout=90
        )

    def status(self) -> dict[str, dict]:
        result = self.coordinator("status", "--json", "--wait", "0.5")
        assert result.returncode == 0, result.stderr
        return {entry["agent"]: entry for entry in json.loads(result.stdout)}

    def dashboard(self) -> dict[str, dict]:
        url = f"http://127.0.0.1:{self.http}/api/fleet"
        with urllib.request.urlopen(url, timeout=10) as answer:
            snapshot = json.load(answer)
        return {row["agent"]: row for row in snapshot["agents"] + snapshot["members"]}

    def until(self, check: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not check():
            assert time.monotonic() < deadline, f"never {what}: {self.status()}"
            time.sleep(0.3)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    processes = Fleet(tmp_path)
    try:
        processes.serve()
        yield processes
    finally:
        processes.close()


def test_a_cancelled_run_says_the_rounds_its_agents_say_and_leaves_no_coordinator_row(
    fleet: Fleet, tmp_path: Path
) -> None:
    """`cancel` and `coordinator run` name the round each agent says it ended after; once
    the run is over, `status` and the dashboard show the gateway and the agents, and no
    offline "coordinator" beside them."""
    for name in ("a1", "a2"):
        fleet.agent(name)
        fleet.wait_for(name, "waiting for a run")
    run_file = tmp_path / "run.toml"
    run_file.write_text(
        '[run]\nagents = 2\nrounds = 30\ndataset = "mnist1d"\nstrategy = "fedavg"\n'
    )
    report = tmp_path / "report.json"
    fleet.start("run", [*COORDINATOR, "run", str(run_file), "--broker", fleet.broker,
                        "--report", str(report)])  # fmt: skip
    fleet.wait_for("a1", "round 2:")
    started = re.search(r"run (run-[0-9a-f]+): fedavg", fleet.log("run"))
    assert started is not None, fleet.log("run")
    run_id = started.group(1)
    cancelled = fleet.coordinator("cancel", run_id, "--wait", "60")
    assert cancelled.returncode == 0, cancelled.stderr
    assert fleet.processes["run"].wait(60) == 0, fleet.log("run")
    said = {}
    for name in ("a1", "a2"):
        fleet.wait_for(name, f"run {run_id} cancelled after round ")
        said[name] = int(
            fleet.log(name).split(f"run {run_id} cancelled after round ")[1].split(":")[0]
        )
    cancel_lines = " ".join(cancelled.stdout.split())
    for name, ended in said.items():
        assert f"{name} (cancelled after round {ended})" in cancel_lines, cancel_lines
    ended = sorted(set(said.values()))
    expected = (
        f"after round {ended[0]}"
        if len(ended) == 1
        else "after round " + ", ".join(f"{r} ({a})" for a, r in sorted(said.items()))
    )
    assert f"run {run_id} was cancelled {expected}" in fleet.log("run")
    assert json.loads(report.read_text())["summary"]["cancelled_after"] == said

    members = fleet.status()
    assert "coordinator" not in members and members["gateway"]["online"], members
    assert all(members[name]["online"] for name in said), members
    shown = fleet.dashboard()
    assert "coordinator" not in shown and shown["gateway"]["online"], shown


def test_presence_survives_a_clock_jump_back_and_a_gateway_restart(
    fleet: Fleet, tmp_path: Path
) -> None:
    """A device that started once with its clock 20 minutes ahead and then with the right
    clock is online for the running gateway (its dashboard) as for `status`; after the
    gateway restarts, it is online since it came back, not since its first connection."""
    ahead = tmp_path / "clock-ahead"
    ahead.mkdir()
    (ahead / "sitecustomize.py").write_text(
        "import time\n_time = time.time\ntime.time = lambda: _time() + 1200.0\n"
    )
    path = os.pathsep.join([str(ahead), os.environ.get("PYTHONPATH", str(REPO))])
    fleet.agent("pi", env={**os.environ, "PYTHONPATH": path})
    fleet.wait_for("pi", "waiting for a run")
    fleet.until(lambda: fleet.dashboard().get("pi", {}).get("online", False), "online, ahead")
    fleet.stop("pi")
    fleet.until(lambda: not fleet.dashboard()["pi"]["online"], "offline after its goodbye")
    fleet.agent("pi")  # the clock put right
    fleet.wait_for("pi", "waiting for a run")
    fleet.until(lambda: fleet.status()["pi"]["online"], "online for status")
    fleet.until(lambda: fleet.dashboard()["pi"]["online"], "online for the dashboard")
    assert "older than its latest presence" not in fleet.log("serve")

    fleet.stop("serve")
    restarted = time.time()
    fleet.serve("serve-again")
    fleet.until(lambda: fleet.status().get("pi", {}).get("since", 0) >= restarted, "back")
    assert fleet.status()["pi"]["online"]
