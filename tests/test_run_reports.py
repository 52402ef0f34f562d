"""What a run says it does, on real `coordinator` processes: a report is never replaced in
silence (a second run takes a fresh name, an existing --report needs --force), and Ctrl-C
in `coordinator emulate` writes the rounds done, names the folder the agents' logs are kept
in, exits 130 and leaves no agent running."""

from __future__ import annotations

import json
import re
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from test_cli import COORDINATOR

pytestmark = pytest.mark.timeout(120)

SMALL = ["--agents", "2", "--rounds", "1", "--epochs", "1"]


def coordinator(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*COORDINATOR, *args], cwd=cwd, capture_output=True, text=True, timeout=100
    )


def test_a_second_run_never_replaces_the_first_report(tmp_path: Path) -> None:
    first = coordinator(tmp_path, "simulate", *SMALL)
    assert first.returncode == 0, first.stderr
    kept = (tmp_path / "report.json").read_bytes()
    assert re.search(r"pruning time t\* \(voted\) +│ not reached in 1 rounds", first.stdout)
    assert "None" not in first.stdout
    second = coordinator(tmp_path, "simulate", *SMALL, "--seed", "2")
    assert second.returncode == 0, second.stderr
    assert "report written to report-2.json" in second.stdout
    assert (tmp_path / "report.json").read_bytes() == kept
    assert json.loads((tmp_path / "report-2.json").read_text())["config"]["seed"] == 2

    refused = coordinator(tmp_path, "emulate", *SMALL, "--report", "report.json")
    assert refused.returncode == 2
    assert refused.stderr.strip() == (
        "Error: report.json exists (an earlier run's report): give --force to replace it, "
        "or another --report"
    )
    assert (tmp_path / "report.json").read_bytes() == kept
    assert not list(tmp_path.glob("emulate-*")), "refused before anything started"

    forced = coordinator(
        tmp_path, "simulate", *SMALL, "--seed", "3", "--report", "report.json", "--force"
    )
    assert forced.returncode == 0, forced.stderr
    assert json.loads((tmp_path / "report.json").read_text())["config"]["seed"] == 3
    assert "t*" not in coordinator(tmp_path, "simulate", *SMALL, "--strategy", "fedavg").stdout


def rounds_logged(folder: Path) -> int:
    """Rounds the agents of an emulation have logged so far, all agents together."""
    return sum(
        len(log.read_text().splitlines()) for log in folder.glob("emulate-*/*/**/rounds.jsonl")
    )


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_ctrl_c_in_emulate_writes_the_rounds_done_and_says_where_the_logs_are(
    tmp_path: Path,
) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    command = [*COORDINATOR, "emulate", "--agents", "2", "--rounds", "40", "--epochs", "1"]
    emulate = subprocess.Popen(
        command,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(scratch)},
        start_new_session=True,  # a group of its own, as a terminal's job: Ctrl-C reaches all
    )
    try:
        deadline = time.monotonic() + 90
        while rounds_logged(scratch) < 2:
            assert emulate.poll() is None and time.monotonic() < deadline, emulate.stderr
            time.sleep(0.2)
        os.killpg(emulate.pid, signal.SIGINT)
        out, err = emulate.communicate(timeout=60)
    finally:
        if group_alive(emulate.pid):
            os.killpg(emulate.pid, signal.SIGKILL)
        emulate.wait(10)
    assert emulate.returncode == 130, out + err
    assert not group_alive(emulate.pid), "an agent process outlived the emulation"
    (folder,) = scratch.glob("emulate-*")
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out + err and "Aborted" not in err, err
    assert lines[0].startswith("Error: interrupted after "), err
    assert lines[0].endswith(f"of 40 rounds; the agents' logs are kept in {folder}")
    assert sorted(p.name for p in folder.glob("*.log")) == ["agent-000.log", "agent-001.log"]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["summary"]["interrupted"] is True
    assert 1 <= len(report["rounds"]) < 40
    assert report["summary"]["failed_agents"] == {}, "agents ended by Ctrl-C did not fail"
    assert f" {rounds_logged(scratch)}/80 " in out, "the bar counts what the agents logged"
