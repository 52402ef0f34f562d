"""Runs in which agents died: the report says who, from which round and why, its final
figures say over how many agents they are, and the command exits non-zero."""

from __future__ import annotations

import dataclasses
import json
import signal
import socket
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner
from conftest import wait_until_logged

from agent.experiment import ExperimentConfig
from agent.learning import preset
from agent.report import AgentRound
from agent.runtime import checkpoint
from coordinator import cli, cli_shared
from coordinator.conductor import AgentProgress, assemble_report, describe_failures
from coordinator.emulate import Emulation, EmulationOptions, exit_reason
from coordinator.gateway import why_failed

pytestmark = pytest.mark.timeout(180)


def config(agents: int = 3, rounds: int = 6) -> ExperimentConfig:
    return ExperimentConfig(
        dataset="mnist1d",
        agents=agents,
        partition="dirichlet:0.5",
        seed=7,
        round_time_s=0.01,
        learning=preset("dadpfl", rounds=rounds, neighbours=2, epochs=1, max_wait=2),
    )


def record(round_: int, agent: str, accuracy: float) -> dict[str, Any]:
    return AgentRound(round_, agent, accuracy, 1.0, 1.0, 0.0, bytes_sent=10).as_dict()


def report_with_a_dead_agent() -> dict[str, Any]:
    """Three agents, four rounds; agent-002 logged rounds 1 and 2 and was killed."""
    cfg = config(rounds=4)
    roster = ["agent-000", "agent-001", "agent-002"]
    logs = {a: {t: record(t, a, 0.5) for t in range(1, 5)} for a in roster[:2]}
    logs["agent-002"] = {t: record(t, "agent-002", 0.9) for t in (1, 2)}
    report = assemble_report(cfg, roster, logs, [], 1.0, {"agent-002": "exit code -9 (SIGKILL)"})
    return {"config": {**dataclasses.asdict(cfg), "roster": roster}, **report}


def test_the_summary_says_who_failed_from_which_round_and_over_whom_its_figures_are() -> None:
    report = report_with_a_dead_agent()
    summary = report["summary"]
    assert summary["failures"] == {
        "agent-002": {"from_round": 3, "reason": "exit code -9 (SIGKILL)"}
    }
    assert summary["rounds"] == 4 and summary["agents_reported"] == 2
    assert summary["mean_accuracy"] == pytest.approx(0.5), "the dead agent's 0.9 is left out"
    assert describe_failures(report) == (
        "agents that failed: agent-002 (from round 3, exit code -9 (SIGKILL))"
    )
    with cli.console.capture() as captured:
        cli.console.print(cli_shared.summary_table(report))
    assert "mean accuracy (round 4, 2 of 3 agents)" in captured.get()
    assert "4 of 4" in captured.get()


def test_an_agent_that_died_before_any_round_fails_from_round_one() -> None:
    cfg = config(rounds=4)
    roster = ["agent-000", "agent-001"]
    report = assemble_report(cfg, roster, {a: {} for a in roster}, [], 1.0, {"agent-000": "x"})
    assert report["rounds"] == [] and report["summary"]["agents_reported"] == 0
    assert report["summary"]["failures"] == {"agent-000": {"from_round": 1, "reason": "x"}}


class FakeEmulation:
    """Stands in for `Emulation` in the CLI: returns a given report without running agents."""

    report: dict[str, Any] = {}

    def __init__(self, config: ExperimentConfig, broker: object, options: object) -> None:
        self.fleet = "emu-test"
        self.key = None

    def run(self, progress: Any = None, stop: Any = None) -> dict[str, Any]:
        return {**self.report, "summary": {**self.report["summary"], "interrupted": False}}


@pytest.mark.parametrize("dead", [True, False], ids=["an-agent-died", "all-finished"])
def test_emulate_exits_1_naming_the_dead_agent_after_writing_the_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dead: bool
) -> None:
    import coordinator.emulate

    report = report_with_a_dead_agent()
    if not dead:
        report["summary"]["failures"] = {}
    monkeypatch.setattr(FakeEmulation, "report", report)
    monkeypatch.setattr(coordinator.emulate, "Emulation", FakeEmulation)
    path = tmp_path / "report.json"
    with socket.create_server(("127.0.0.1", 0)) as listener:  # answers emulate's broker check
        broker = f"127.0.0.1:{listener.getsockname()[1]}"
        args = ["emulate", "--broker", broker, "--workdir", str(tmp_path / "w")]
        result = CliRunner().invoke(cli.main, [*args, "--agents", "3", "--report", str(path)])
    assert path.exists(), (result.output, result.exception)
    assert json.loads(path.read_text())["summary"]["failures"] == report["summary"]["failures"]
    if dead:
        assert result.exit_code == 1, result.output
        assert "agents that failed: agent-002 (from round 3, exit code -9 (SIGKILL))" in (
            result.output
        )
    else:
        assert result.exit_code == 0, result.output


def test_an_agent_killed_mid_run_is_named_with_its_round_and_signal(
    amqtt_broker, tmp_path: Path
) -> None:
    cfg = config(agents=3, rounds=6)
    options = EmulationOptions(workdir=tmp_path / "fleet", round_timeout_s=2.0, linger_s=2.0)
    emulation = Emulation(cfg, amqtt_broker.address, options)
    done: list[int] = []
    result: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: result.update(report=emulation.run(done.append)), daemon=True
    )
    thread.start()
    wait_until_logged(emulation, thread, "agent-001", 2)
    emulation.processes["agent-001"].send_signal(signal.SIGKILL)
    thread.join(150)
    summary = result["report"]["summary"]
    failure = summary["failures"]["agent-001"]
    assert summary["failures"].keys() == {"agent-001"}
    assert failure["reason"] == "exit code -9 (SIGKILL)"
    logged = checkpoint.read_records(emulation.round_log("agent-001"))
    assert failure["from_round"] == max(logged) + 1 >= 3
    assert summary["rounds"] == 6 and summary["agents_reported"] == 2
    assert done[-1] < 6 * 3, "the progress bar is not filled for the dead agent's rounds"


def test_a_failed_agent_process_is_explained_by_its_last_log_line(tmp_path: Path) -> None:
    log = tmp_path / "agent-000.log"
    log.write_text("round 1 done\nedge-agent: the disk is full (/state); stopping\n\n")
    assert exit_reason(1, log) == "exit code 1: edge-agent: the disk is full (/state); stopping"
    assert exit_reason(1, tmp_path / "missing.log") == "exit code 1"
    assert exit_reason(-signal.SIGTERM, log) == "exit code -15 (SIGTERM)"


def test_coordinator_run_says_why_each_agent_did_not_finish() -> None:
    agents = {
        "pi-a": AgentProgress(state="failed", error="disk full (/state)"),
        "pi-b": AgentProgress(state="training", round=2),
        "pi-c": AgentProgress(state="training", round=3),
        "pi-d": AgentProgress(),
        "pi-e": AgentProgress(state="done", round=4),
    }
    conductor = SimpleNamespace(agents=agents, offline={"pi-b": 0.0})
    assert why_failed(conductor, ["pi-b", "pi-c", "pi-d"]) == {  # type: ignore[arg-type]
        "pi-a": "failed: disk full (/state)",
        "pi-b": "went offline",
        "pi-c": "still training when the run ended",
        "pi-d": "never reported",
    }


REFUSING_MODEL = '''"""A model agent-001's device cannot build (a missing driver, say)."""
import sys

from torch import nn


def build(input_shape, num_outputs):
    if "agent-001" in sys.argv:
        raise ValueError("no accelerator for this layer on this device")
    return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[-1], num_outputs))
'''


def test_an_agent_that_refuses_the_run_is_named_with_its_reason(
    amqtt_broker, tmp_path: Path
) -> None:
    """It says why in its status and exits cleanly; the report names it all the same (it
    once left the rounds without a word in the summary)."""
    model = tmp_path / "refusing.py"
    model.write_text(REFUSING_MODEL)
    cfg = dataclasses.replace(config(agents=3, rounds=2), model=f"{model}:build")
    options = EmulationOptions(workdir=tmp_path / "fleet", round_timeout_s=2.0, linger_s=2.0)
    report = Emulation(cfg, amqtt_broker.address, options).run()
    summary = report["summary"]
    assert summary["failed_agents"].keys() == {"agent-001"}
    (failure,) = summary["failures"].values()
    assert failure["reason"].startswith("rejected: ")
    assert "no accelerator for this layer on this device" in failure["reason"]
    assert summary["agents_reported"] == 2
