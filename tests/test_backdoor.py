"""The backdoor attack (`--attack backdoor`): a trigger stamped on poisoned copies of an
attacker's data, an honest-looking model sent, and the trigger's success measured on the
honest agents' models (issue 46)."""

from __future__ import annotations

import torch

from agent.experiment import ExperimentConfig
from agent.learning import backdoor, preset, robust, robust_rules
from agent.learning.learner import LocalData
from agent.workload import build_workload
from coordinator.simulate import simulate


def local_data(x: torch.Tensor, y: torch.Tensor) -> LocalData:
    return LocalData(x, y, x.clone(), y.clone(), x[:0], y[:0])


def test_the_trigger_is_a_corner_of_an_image_and_the_end_of_a_series() -> None:
    images = torch.zeros(3, 1, 8, 8)
    stamped = backdoor.with_trigger(images, 1.0)
    assert stamped[:, :, -2:, -2:].eq(1).all() and stamped.sum() == 3 * 4
    series = torch.zeros(3, 40)
    assert backdoor.with_trigger(series, 2.0)[:, -4:].eq(2).all()
    assert images.sum() == 0, "the clean samples are left as they were"


def test_an_attacker_adds_a_triggered_copy_of_its_data_labelled_the_target() -> None:
    x, y = torch.rand(10, 1, 8, 8), torch.arange(10) % 5 + 1
    data = backdoor.poisoned(local_data(x, y), seed=1)
    copies = int(10 * robust_rules.BACKDOOR_SHARE)
    assert len(data.y_train) == 10 + copies
    assert data.y_train[10:].eq(robust_rules.BACKDOOR_TARGET).all()
    assert data.x_train[10:, :, -2:, -2:].eq(x.max()).all()
    assert torch.equal(data.x_test, x) and torch.equal(data.y_test, y), "its tests stay clean"


def test_the_model_an_attacker_sends_is_the_one_it_trained() -> None:
    weights = {"w": torch.randn(3, 3)}
    sent = robust.poison(weights, None, "backdoor", torch.Generator().manual_seed(0))
    assert torch.equal(sent["w"], weights["w"])


def test_only_the_attackers_data_is_poisoned() -> None:
    config = ExperimentConfig(
        dataset="digits", agents=4, attackers=1, attack="backdoor", learning=preset("fedavg")
    )
    roster = [f"agent-{k:03d}" for k in range(4)]
    clean_config = ExperimentConfig(dataset="digits", agents=4, learning=preset("fedavg"))
    clean = build_workload(clean_config, roster).data
    data = build_workload(config, roster).data
    attacker = robust_rules.attackers(roster, 1)[0]
    for agent_id in roster:
        grown = len(data[agent_id].y_train) - len(clean[agent_id].y_train)
        assert grown == (len(clean[agent_id].y_train) if agent_id == attacker else 0)


def test_a_run_under_the_backdoor_reports_the_triggers_success_on_honest_models() -> None:
    config = ExperimentConfig(
        dataset="digits",
        agents=6,
        attackers=2,
        attack="backdoor",
        learning=preset("fedavg", rounds=3, epochs=1, aggregation="mean", clip="off"),
    )
    summary = simulate(config)["summary"]
    by_agent = summary["backdoor_success_by_agent"]
    assert len(by_agent) == 4 and not set(by_agent) & set(summary["attackers"])
    assert 0.0 <= summary["backdoor_success"] <= 1.0
    assert 0.0 <= summary["backdoor_success_strategy"] <= 1.0
    clean = simulate(ExperimentConfig(dataset="digits", agents=6, learning=config.learning))
    assert "backdoor_success" not in clean["summary"]
