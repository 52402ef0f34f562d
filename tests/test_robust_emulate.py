"""Under attack, a fleet of real agent processes still computes what the simulator does:
attackers poison what they publish, receivers clip and aggregate robustly, the same way."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.experiment import ExperimentConfig
from agent.learning import preset
from coordinator.emulate import Emulation, EmulationOptions
from coordinator.simulate import simulate
from tests.test_emulate import SHARED

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize(
    ("strategy", "attack", "learning"),
    [
        ("dadpfl", "noise", {"aggregation": "median", "clip": "auto", "neighbours": 3}),
        ("fedavg", "scale", {"aggregation": "trimmed:0.2", "clip": "auto"}),
        ("fedavg", "inflate", {"aggregation": "mean"}),
    ],
    ids=["dadpfl-noise-median-clip", "fedavg-scale-trimmed-clip", "fedavg-inflated-count-mean"],
)
def test_emulate_equals_simulate_under_attack(
    amqtt_broker, tmp_path: Path, strategy: str, attack: str, learning: dict
) -> None:
    cfg = ExperimentConfig(
        dataset="mnist1d",
        agents=5,
        partition="dirichlet:0.5",
        seed=7,
        attackers=1,
        attack=attack,
        learning=preset(strategy, rounds=2, epochs=1, **learning),
    )
    options = EmulationOptions(workdir=tmp_path / "fleet", linger_s=20.0, agents_per_process=SHARED)
    emulated = Emulation(cfg, amqtt_broker.address, options).run()
    assert emulated["summary"]["failed_agents"] == {}
    assert emulated["summary"]["stragglers"] == []
    simulated = simulate(cfg)
    assert simulated["summary"]["attackers"] == ["agent-000"]
    want = {
        (r["round"], k): (a["accuracy"], a["loss"])
        for r in simulated["rounds"]
        for k, a in r["agents"].items()
    }
    got = {
        (r["round"], k): (a["accuracy"], a["loss"])
        for r in emulated["rounds"]
        for k, a in r["agents"].items()
    }
    assert got.keys() == want.keys()
    for key, figures in want.items():
        assert got[key] == pytest.approx(figures, abs=1e-6), key
    # what the defence screened out and clipped, each agent's and the aggregator's
    assert verdicts(emulated) == verdicts(simulated)
    assert ("defence" in simulated["summary"]) == (learning.get("clip") == "auto")


def verdicts(report: dict) -> dict[tuple[int, str], tuple[list[str], list[str]]]:
    """Each round's screened and clipped senders: each agent's, and (centralized) the
    round's own, the aggregator's."""
    found = {
        (r["round"], k): (a["screened"], a["clipped"])
        for r in report["rounds"]
        for k, a in r["agents"].items()
    }
    found |= {
        (r["round"], "aggregator"): (r["screened"], r["clipped"])
        for r in report["rounds"]
        if "screened" in r
    }
    return found


def test_emulated_agents_whose_models_turn_non_finite_keep_their_models_and_go_on(
    amqtt_broker, tmp_path: Path
) -> None:
    """A learning rate that sends every trained model to NaN: each agent undoes its round,
    keeps and sends its model from before it, and the fleet runs to the end with nobody
    waiting for a model that never comes."""
    cfg = ExperimentConfig(
        dataset="mnist1d",
        agents=4,
        seed=7,
        learning=preset(
            "dadpfl", rounds=2, epochs=1, neighbours=2, lr=10.0, weight_decay=1.0, batch_size=8
        ),
    )
    options = EmulationOptions(
        workdir=tmp_path / "fleet", linger_s=20.0, round_timeout_s=30.0, agents_per_process=SHARED
    )
    emulation = Emulation(cfg, amqtt_broker.address, options)
    report = emulation.run()
    assert report["summary"]["failed_agents"] == {}
    assert report["summary"]["stragglers"] == []
    assert [r["round"] for r in report["rounds"]] == [1, 2]
    for agent_id in emulation.processes:
        log = (tmp_path / "fleet" / f"{agent_id}.log").read_text()
        assert "round 2: model not finite; kept the model from before it" in log
