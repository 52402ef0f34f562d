"""What a run says it does, on real `coordinator` processes: a mistake in the run file or a
file it names is its one line before torch is loaded; a report is never replaced in silence
(a second run takes a fresh name, an existing --report needs --force); Ctrl-C in
`coordinator emulate` writes the rounds done, names the folder the agents' logs are kept in,
exits 130 and leaves no agent running."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from netns import Lan, skip_unless_netns
from test_cli import COORDINATOR, REPO

pytestmark = pytest.mark.timeout(120)

SMALL = ["--agents", "2", "--rounds", "1", "--epochs", "1"]


def coordinator(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*COORDINATOR, *args], cwd=cwd, capture_output=True, text=True, timeout=100
    )


WITHOUT_TORCH = f"""
import sys
sys.path.insert(0, {str(REPO)!r})
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "torch":
            raise ImportError("torch loaded before the run's files were checked")
sys.meta_path.insert(0, NoTorch())
from coordinator.cli import main
main(prog_name="coordinator")
"""


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["simulate", "--run", "typo.toml"], "typo.toml: unknown key 'rouns' in [run]; did you "
         "mean 'rounds'?"),
        (["simulate", "--run", "data.toml"], "data.toml: npz file not found: missing.npz"),
        (["emulate", "--run", "absent.toml"], "absent.toml: cannot read run file: No such file "
         "or directory"),
        (["emulate", "--agents", "2", "--model", "./nets.py:build"], "model './nets.py:build': "
         "no such file ./nets.py"),
        (["simulate", "--dataset", "imagefolder:photos"], "image folder not found: photos"),
        (["run", "typo.toml"], "typo.toml: unknown key 'rouns' in [run]; did you mean "
         "'rounds'?"),
    ],
)  # fmt: skip
def test_a_mistake_in_the_run_or_its_files_is_said_before_torch_loads(
    tmp_path: Path, args: list[str], said: str
) -> None:
    (tmp_path / "typo.toml").write_text('[run]\nstrategy = "dadpfl"\nagents = 2\nrouns = 2\n')
    (tmp_path / "data.toml").write_text('[run]\nagents = 2\ndataset = "npz:missing.npz"\n')
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH, *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stderr) == (2, f"Error: {said}\n")
    assert not list(tmp_path.glob("report*.json"))


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


def test_run_without_broker_says_at_once_that_serve_is_on_another_address(
    tmp_path: Path,
) -> None:
    """`coordinator serve --host LAN-ADDRESS` is up: `coordinator run` without --broker
    would start a loopback broker of its own and wait its join timeout for agents that never
    come there; it says where the broker is and what to pass, before anything waits."""
    skip_unless_netns()
    run_file = tmp_path / "run.toml"
    run_file.write_text("[run]\nagents = 2\nrounds = 1\njoin_timeout = 600\n")
    state = ["--state-dir", str(tmp_path / "state")]
    log = tmp_path / "serve.log"
    with Lan(["gw"]) as lan:
        address = lan.address("gw")
        lan.popen("gw", [*COORDINATOR, "serve", "--host", address, "--open", *state], log=log)
        assert lan.reachable("gw", address, 1883, timeout_s=30), log.read_text()
        run = [*COORDINATOR, "run", str(run_file), *state, "--runs-dir", str(tmp_path / "runs")]
        done = lan.run("gw", run, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr == (
        f"Error: a broker already serves on {address}:1883 (coordinator serve?), not on "
        f"127.0.0.1:1883: give --broker {address}:1883 to run on it (without --broker this "
        "command starts a broker of its own on 127.0.0.1:1883, which the fleet's agents do not "
        "join)\n"
    )


def test_going_on_with_an_interrupted_run_writes_its_report_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`coordinator run` stopped wrote its partial report; the same command again (which
    goes on with that run) writes the run's report there, not to a fresh name; another
    existing file is still refused."""
    from coordinator.cli_shared import report_target
    from protocol import ConfigError

    monkeypatch.chdir(tmp_path)
    partial = tmp_path / "report.json"
    partial.write_text("{}")
    assert report_target(None, False) == "report-2.json"
    assert report_target(None, False, own=str(partial)) == str(partial)
    assert report_target("report.json", False, own=str(partial)) == "report.json"
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(ConfigError, match="other.json exists"):
        report_target("other.json", False, own=str(partial))
    assert report_target("other.json", True, own=str(partial)) == "other.json"


class LastStatusesLate:
    """A conductor whose last two agents' final statuses arrive just after it was asked
    whether all were finished (as on a fast run): the FedAvg bar ended at 28/30."""

    error = None

    def __init__(self) -> None:
        self.done = 28

    def wait(self, timeout_s: float) -> bool:
        return False

    def gone(self, after_s: float) -> bool:
        self.done = 30  # they arrive now: nobody is left unfinished
        return True

    def rounds_done(self) -> int:
        return self.done

    def unfinished(self) -> list[str]:
        return [] if self.done == 30 else ["pi-1", "pi-2"]


def test_the_bar_counts_the_statuses_that_ended_the_run() -> None:
    from coordinator.conductor import wait_until_finished

    shown: list[int] = []
    conductor: Any = LastStatusesLate()
    assert wait_until_finished(conductor, 60, shown.append, gone_after_s=180) == []
    assert shown[-1] == 30


def test_a_second_ctrl_c_interrupts_at_once() -> None:
    """The first Ctrl-C asks the program to stop when it can (after start-up, after the
    round); the second, from a person who cannot wait, interrupts at once."""
    from protocol.cli import stop_on_signal

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        stop = stop_on_signal()
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.wait(5), "the first one is remembered"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler runs in the main thread at the next bytecode
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
