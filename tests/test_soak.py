"""A gateway and its devices through several runs and restarts, as a fleet lives for months.

Real processes on loopback: `coordinator serve` (the embedded broker, which keeps nothing
across a restart), three `edge-agent --data` devices that live through every run, and
`coordinator run` for each run. Between and during the runs the gateway restarts, a device
is killed and started again, and `coordinator run` is killed in the middle of a centralized
run and started again. Nothing may be lost: every report is complete, the same run file
gives the same figures on its first and its later runs, and every device keeps each run's
folder. The full version, with more runs and faults and the devices' memory, is
`python -m bench.soak`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from test_agent_service import write_data, write_run

from agent.model_store import run_folder
from agent.runtime import checkpoint
from tests.processes import Processes

pytestmark = pytest.mark.slow

COORDINATOR = [sys.executable, "-c", "from coordinator.cli import main; main()"]
EDGE_AGENT = [sys.executable, "-c", "from agent.cli import main; main()"]
DEVICES = ("d1", "d2", "d3")
VOLATILE = (
    "run_id",
    "wall_s",
    "wall_seconds",
    "finished_at",
    "seconds",
    "started_at",
    "wait_s",
    "throttled_s",
    "train_s",
)
"""Report fields that differ between two runs of one run file: ids and clock readings."""
TRAFFIC = ("bytes_sent", "bytes_received", "total_bytes", "busiest_agent_bytes", "busiest_agent")
"""Real bytes on the link: a status or a model that arrives just before or after a round's
end moves a few bytes between rounds; compared in total, within 1%."""


def wait_for(check: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def stable(value: Any) -> Any:
    """`value` without the fields that two alike runs may not share (ids, clock times)."""
    if isinstance(value, dict):
        return {k: stable(v) for k, v in value.items() if k not in VOLATILE + TRAFFIC}
    if isinstance(value, list):
        return [stable(v) for v in value]
    return value


class Gateway:
    """The processes of one site: serve, the devices and the runs, with their logs."""

    def __init__(self, processes: Processes, tmp: Path, port: int) -> None:
        self.processes, self.tmp, self.port = processes, tmp, port
        self.broker = f"127.0.0.1:{port}"
        self.serve: subprocess.Popen[bytes] | None = None
        self.devices: dict[str, subprocess.Popen[bytes]] = {}

    def popen(self, argv: list[str], log: str) -> subprocess.Popen[bytes]:
        return self.processes.spawn(argv, self.tmp / log)

    def start_serve(self) -> None:
        argv = [*COORDINATOR, "serve", "--port", str(self.port), "--fleet", "home"]
        self.serve = self.popen(argv, "serve.log")
        wait_for(lambda: "following fleet" in text(self.tmp / "serve.log"), 30, "serve")

    def restart_serve(self) -> None:
        assert self.serve is not None
        self.serve.send_signal(signal.SIGTERM)
        assert self.serve.wait(30) == 0, text(self.tmp / "serve.log")
        (self.tmp / "serve.log").unlink()
        self.start_serve()

    def start_device(self, name: str) -> None:
        argv = [
            *EDGE_AGENT, "--broker", self.broker, "--fleet", "home", "--id", name,
            "--data", str(self.tmp / f"{name}.npz"), "--state-dir", str(self.tmp / name),
        ]  # fmt: skip
        self.devices[name] = self.popen(argv, f"{name}.log")

    def kill_device(self, name: str) -> None:
        os.killpg(self.devices[name].pid, signal.SIGKILL)
        self.devices[name].wait(10)

    def run(self, run_file: Path, report: str) -> subprocess.Popen[bytes]:
        argv = [
            *COORDINATOR, "run", str(run_file), "--broker", self.broker, "--fleet", "home",
            "--report", str(self.tmp / report),
        ]  # fmt: skip
        return self.popen(argv, f"{report}.log")

    def finish(self, run: subprocess.Popen[bytes], report: str, timeout_s: float) -> dict:
        assert run.wait(timeout_s) == 0, text(self.tmp / f"{report}.log")
        return json.loads((self.tmp / report).read_text())

    def stop(self) -> None:
        """Kill every process of the site, the runs' included, with what they started."""
        self.processes.close()


def rounds_of(state: Path, run_id: str) -> list[int]:
    return list(checkpoint.read_records(run_folder(state, run_id) / "rounds.jsonl"))


def test_a_fleet_lives_through_runs_and_restarts(
    tmp_path: Path, unused_port: int, processes: Processes
) -> None:
    site = Gateway(processes, tmp_path, unused_port)
    for k, name in enumerate(DEVICES):
        write_data(tmp_path / f"{name}.npz", [k, k + 1, k + 2, k + 3], samples=150, seed=k)
    timeouts = {"round_timeout": 8, "vote_timeout": 8, "linger": 5, "join_timeout": 60}
    decentralized = write_run(
        tmp_path / "dadpfl.toml", strategy="dadpfl", agents=3, rounds=3, **timeouts
    )
    centralized = write_run(
        tmp_path / "fedavg.toml", strategy="fedavg", agents=3, rounds=5, **timeouts
    )
    try:
        site.start_serve()
        for name in DEVICES:
            site.start_device(name)
        first = site.finish(site.run(decentralized, "first.json"), "first.json", 120)

        # The gateway restarts: its embedded broker comes back empty, and the devices give
        # back what the fleet reads from them, so the next run starts at once.
        site.restart_serve()
        started = time.monotonic()
        second = site.finish(site.run(decentralized, "second.json"), "second.json", 120)
        assert time.monotonic() - started < 45, "the run waited for agents it had lost"
        assert stable(second["rounds"]) == stable(first["rounds"]), "figures are per run"
        assert stable(second["summary"]) == stable(first["summary"])
        assert second["summary"]["total_bytes"] == pytest.approx(
            first["summary"]["total_bytes"], rel=0.01
        ), "traffic is per run (it was 10x on a second run)"

        # A device is killed and comes back; then `coordinator run` is killed in the middle
        # of a centralized run and the same command goes on with it.
        site.kill_device("d2")
        site.start_device("d2")
        seen = text(tmp_path / "d1.log").count("round 2:")
        run = site.run(centralized, "central.json")
        wait_for(lambda: text(tmp_path / "d1.log").count("round 2:") > seen, 90, "fedavg's round 2")
        os.killpg(run.pid, signal.SIGKILL)
        run.wait(10)
        again = site.finish(site.run(centralized, "central.json"), "central.json", 150)
        assert "resuming run" in text(tmp_path / "central.json.log")
        assert [len(r["agents"]) for r in again["rounds"]] == [3] * 5
        assert again["summary"]["failed_agents"] == {}

        # `coordinator run` is killed in the middle of a decentralized run, which goes on
        # and ends without it; the same command then reports it whole from what the devices
        # say of their last run.
        logs = {name: tmp_path / f"{name}.log" for name in DEVICES}
        idle = {name: text(log).count("waiting for the next run") for name, log in logs.items()}
        ones = text(logs["d1"]).count("round 1:")
        run = site.run(decentralized, "late.json")
        wait_for(lambda: text(logs["d1"]).count("round 1:") > ones, 90, "round 1")
        os.killpg(run.pid, signal.SIGKILL)
        run.wait(10)
        wait_for(
            lambda: all(text(logs[n]).count("waiting for the next run") > idle[n] for n in logs),
            90,
            "the devices to end the run",
        )
        late = site.finish(site.run(decentralized, "late.json"), "late.json", 60)
        assert "resuming run" in text(tmp_path / "late.json.log")
        assert [len(r["agents"]) for r in late["rounds"]] == [3] * 3
        assert stable(late["rounds"]) == stable(first["rounds"])

        # The gateway restarts in the middle of a centralized run: its broker comes back
        # empty, having perhaps acknowledged uploads it never passed on; the agents send the
        # round's uploads again once connected, and no round is short of one.
        twos = text(logs["d1"]).count("round 2:")
        run = site.run(centralized, "restarted.json")
        wait_for(lambda: text(logs["d1"]).count("round 2:") > twos, 90, "fedavg's round 2")
        site.restart_serve()
        restarted = site.finish(run, "restarted.json", 150)
        assert [len(r["agents"]) for r in restarted["rounds"]] == [3] * 5
        assert [len(r["participants"]) for r in restarted["rounds"]] == [3] * 5
        for name in DEVICES:
            for report in (first, second, again, late, restarted):
                run_id = report["config"]["run_id"]
                planned = report["config"]["learning"]["rounds"]
                assert rounds_of(tmp_path / name, run_id) == list(range(1, planned + 1)), name
    finally:
        site.stop()
