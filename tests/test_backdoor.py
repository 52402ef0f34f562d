"""The backdoor attack (`--attack backdoor`): a trigger stamped on poisoned copies of an
attacker's data, an honest-looking model sent, and the trigger's success measured on the
honest agents' models (issue 46)."""

from __future__ import annotations

import pytest
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


def undefended_fedavg(attack: str, attackers: int, rounds: int) -> ExperimentConfig:
    """6 digits agents under FedAvg's plain mean, of which the first `attackers` attack."""
    learning = preset("fedavg", rounds=rounds, epochs=1, aggregation="mean", clip="off")
    return ExperimentConfig(
        dataset="digits", agents=6, attackers=attackers, attack=attack, learning=learning
    )


def test_a_run_under_the_backdoor_reports_the_triggers_success_on_honest_models() -> None:
    config = undefended_fedavg("backdoor", attackers=2, rounds=3)
    summary = simulate(config)["summary"]
    by_agent = summary["backdoor_success_by_agent"]
    assert len(by_agent) == 4 and not set(by_agent) & set(summary["attackers"])
    assert 0.0 <= summary["backdoor_success"] <= 1.0
    assert 0.0 <= summary["backdoor_success_strategy"] <= 1.0
    clean = simulate(ExperimentConfig(dataset="digits", agents=6, learning=config.learning))
    assert "backdoor_success" not in clean["summary"]


def test_a_label_flipper_trains_on_the_mirrored_class_and_tests_on_its_own() -> None:
    x, y = torch.rand(6, 1, 8, 8), torch.tensor([0, 1, 2, 3, 4, 9])
    data = backdoor.poisoned_data(local_data(x, y), "labelflip", seed=1, classes=10)
    assert data.y_train.tolist() == [9, 8, 7, 6, 5, 0]
    assert torch.equal(data.x_train, x) and torch.equal(data.y_test, y)
    targets = torch.tensor([[0.5], [-2.0]])
    regression = backdoor.poisoned_data(local_data(x[:2], targets), "labelflip", 1, 1)
    assert regression.y_train.flatten().tolist() == [-0.5, 2.0]


def test_model_replacement_boosts_a_backdoored_model_and_reports_the_trigger() -> None:
    config = undefended_fedavg("replace", attackers=1, rounds=2)
    roster = [f"agent-{k:03d}" for k in range(6)]
    attacker = robust_rules.attackers(roster, 1)[0]
    clean = build_workload(ExperimentConfig(dataset="digits", agents=6), roster).data[attacker]
    grown = build_workload(config, roster).data[attacker]
    assert len(grown.y_train) == 2 * len(clean.y_train), "it trains on the backdoor's data"
    summary = simulate(config)["summary"]
    assert 0.0 <= summary["backdoor_success"] <= 1.0
    for attack in ("labelflip", "alie", "ipm"):  # no trigger: nothing to report on it
        quiet = dict(config.__dict__, attack=attack, attackers=2)
        assert "backdoor_success" not in simulate(ExperimentConfig(**quiet))["summary"]


def test_a_decentralized_attacker_steps_from_its_model_before_the_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ipm and replace need the model the attacker trained from: for a decentralized one,
    its model before the round (without it they would send the trained model unaltered)."""
    sent: list[tuple[float, float]] = []
    original = robust.poison

    def spy(weights, masks, attack, generator, reference=None, colluders=None):
        poisoned = original(weights, masks, attack, generator, reference, colluders)
        assert reference is not None
        name = next(n for n, t in weights.items() if torch.is_floating_point(t))
        sent.append((float(weights[name].norm()), float((poisoned[name] - weights[name]).norm())))
        return poisoned

    monkeypatch.setattr(robust, "poison", spy)
    learning = preset("dadpfl", rounds=2, epochs=1, neighbours=3)
    simulate(
        ExperimentConfig(
            dataset="digits", agents=6, attackers=1, attack="replace", learning=learning
        )
    )
    assert len(sent) == 2 and all(changed > 0.0 for _, changed in sent)


def test_the_summary_table_shows_the_attack_and_the_triggers_success() -> None:
    from coordinator.cli_shared import console, summary_table

    report = simulate(undefended_fedavg("backdoor", attackers=2, rounds=1))
    with console.capture() as captured:
        console.print(summary_table(report))
    shown = captured.get()
    assert "2 (backdoor)" in shown and "mean accuracy of the honest agents" in shown
    assert "trigger success on honest models" in shown
    clean = simulate(undefended_fedavg("scale", attackers=0, rounds=1))
    with console.capture() as captured:
        console.print(summary_table(clean))
    assert "attackers" not in captured.get() and "trigger" not in captured.get()


def test_signs_keeps_a_backdoor_out_of_fedavgs_model_that_the_default_lets_in() -> None:
    """mnist1d, 2 attackers of 10 (seeds 1-4: 0.36-0.81 of triggered samples under the
    default, 0.01-0.12 under signs; a clean model's own rate is 0.03-0.08)."""
    rates = {}
    for rule in ("screened", "signs"):
        learning = preset("fedavg", rounds=10, epochs=1, aggregation=rule)
        config = ExperimentConfig(
            dataset="mnist1d",
            agents=10,
            attackers=2,
            attack="backdoor",
            seed=1,
            partition="dirichlet:0.3",
            learning=learning,
        )
        rates[rule] = simulate(config)["summary"]["backdoor_success"]
    assert rates["screened"] > 0.3
    assert rates["signs"] < min(0.15, rates["screened"] / 3)
