"""A fleet of real agent processes over a real broker: correctness and faults."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest

from agent import checkpoint
from agent.experiment import ExperimentConfig
from agent.strategies import preset
from coordinator.emulate import Emulation, EmulationOptions
from coordinator.simulate import simulate

AGENTS = 6


def config(strategy: str = "dadpfl", rounds: int = 3, **learning: object) -> ExperimentConfig:
    learning = {"rounds": rounds, "neighbours": 3, "epochs": 1, **learning}
    return ExperimentConfig(
        dataset="mnist1d",
        agents=AGENTS,
        partition="dirichlet:0.5",
        seed=7,
        learning=preset(strategy, **learning),
    )


def figures(report: dict) -> dict[tuple[int, str], tuple[float, float]]:
    return {
        (r["round"], agent): (a["accuracy"], a["sparsity"])
        for r in report["rounds"]
        for agent, a in r["agents"].items()
    }


def assert_same_learning(emulated: dict, simulated: dict) -> None:
    got, want = figures(emulated), figures(simulated)
    assert got.keys() == want.keys()
    for key, (accuracy, sparsity) in want.items():
        assert got[key][0] == pytest.approx(accuracy, abs=1e-6), key
        assert got[key][1] == pytest.approx(sparsity, abs=1e-6), key


def options(tmp_path: Path, **overrides: object) -> EmulationOptions:
    return EmulationOptions(workdir=tmp_path / "fleet", linger_s=20.0, **overrides)


@pytest.mark.parametrize(
    "learning",
    [
        {"strategy": "dadpfl", "max_wait": 2},
        {"strategy": "dispfl"},
        {"strategy": "dadpfl", "max_wait": 2, "rounds": 5, "delta_pr": 100.0},
    ],
    ids=["dadpfl", "dispfl", "dadpfl-pruning"],
)
def test_emulate_gives_the_numbers_of_simulate(amqtt_broker, tmp_path: Path, learning) -> None:
    cfg = config(**learning)
    emulated = Emulation(cfg, amqtt_broker.address, options(tmp_path)).run()
    assert emulated["summary"]["failed_agents"] == {}
    assert emulated["summary"]["stragglers"] == []
    assert_same_learning(emulated, simulate(cfg))
    if learning.get("delta_pr"):
        assert emulated["summary"]["t_star"] == 1
        assert emulated["summary"]["mean_sparsity"] > 0.5


def run_in_background(emulation: Emulation) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def target() -> None:
        try:
            result["report"] = emulation.run()
        except BaseException as exc:  # surfaced by the test
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, result


def wait_for_round(emulation: Emulation, agent: str, round_: int, timeout_s: float = 120) -> None:
    path = emulation.options.workdir / agent / "rounds.jsonl"
    deadline = time.monotonic() + timeout_s
    while round_ not in checkpoint.read_records(path):
        assert time.monotonic() < deadline, f"{agent} never finished round {round_}"
        time.sleep(0.05)


def test_a_killed_agent_resumes_from_its_checkpoint(amqtt_broker, tmp_path: Path) -> None:
    cfg = config(rounds=5)
    emulation = Emulation(cfg, amqtt_broker.address, options(tmp_path))
    thread, result = run_in_background(emulation)
    wait_for_round(emulation, "agent-002", 2)
    emulation.processes["agent-002"].send_signal(signal.SIGKILL)
    emulation.processes["agent-002"].wait(10)
    emulation.start_agent(2)
    thread.join(600)
    assert "error" not in result, result.get("error")
    report = result["report"]
    lines = (emulation.options.workdir / "agent-002" / "rounds.jsonl").read_text().splitlines()
    rounds_logged = [int(line.split('"round": ')[1].split(",")[0]) for line in lines]
    assert rounds_logged == [1, 2, 3, 4, 5], "no round lost or repeated"
    assert len(report["rounds"]) == 5
    assert_same_learning(report, simulate(cfg))


def test_a_vanished_agent_is_named_and_the_fleet_finishes(amqtt_broker, tmp_path: Path) -> None:
    cfg = config(rounds=4)
    emulation = Emulation(cfg, amqtt_broker.address, options(tmp_path, round_timeout_s=3.0))
    thread, result = run_in_background(emulation)
    wait_for_round(emulation, "agent-004", 1)
    emulation.processes["agent-004"].send_signal(signal.SIGKILL)
    thread.join(600)
    assert "error" not in result, result.get("error")
    summary = result["report"]["summary"]
    assert "agent-004" in summary["stragglers"]
    assert summary["failed_agents"] == {"agent-004": -signal.SIGKILL}
    last = result["report"]["rounds"][-1]["agents"]
    assert set(last) == {f"agent-{k:03d}" for k in range(AGENTS)} - {"agent-004"}


def test_every_agent_reconnects_after_a_broker_restart(broker, tmp_path: Path) -> None:
    cfg = config(rounds=5)
    emulation = Emulation(cfg, broker.address, options(tmp_path, round_timeout_s=60.0))
    thread, result = run_in_background(emulation)
    wait_for_round(emulation, "agent-000", 2)
    broker.kill()
    time.sleep(1.0)
    broker.start()
    thread.join(600)
    assert "error" not in result, result.get("error")
    report = result["report"]
    assert report["summary"]["failed_agents"] == {}
    assert all(len(r["agents"]) == AGENTS for r in report["rounds"])
    assert len(report["rounds"]) == 5
