"""`--dp-average` (`agent.learning.averaging`): under `--dp sample` a device keeps, serves
and reports a moving average of its strategy's models over the rounds, while it trains, sends
and spends privacy exactly as without it; the same in simulate and on real processes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from agent.experiment import ExperimentConfig
from agent.learning import fallback, preset
from agent.learning.kept import PERSONAL
from agent.runtime import Run
from agent.runtime.run_files import persist, restore
from coordinator.emulate import Emulation, EmulationOptions
from coordinator.simulate import simulate
from tests.test_faults_disk import runtime_of
from tests.test_privacy import ROSTER, _setup, accuracies, config, epsilons

pytestmark = pytest.mark.timeout(600)


def per_round(report: dict, figure: str) -> dict[tuple[int, str], float]:
    return {(r["round"], k): a[figure] for r in report["rounds"] for k, a in r["agents"].items()}


def test_the_kept_model_is_the_moving_average_of_the_strategys_models() -> None:
    learner, data = _setup("dadpfl", dp="sample", dp_average=0.25)
    agent = learner.init_agent("agent-000")
    masks = agent.masks
    assert masks is not None
    g = torch.Generator().manual_seed(3)
    first = {n: torch.randn(w.shape, generator=g) for n, w in agent.weights.items()}
    second = {n: torch.randn(w.shape, generator=g) for n, w in agent.weights.items()}
    agent, _ = fallback.judge(learner, agent, data, {PERSONAL: (first, masks)})
    agent, judged = fallback.judge(learner, agent, data, {PERSONAL: (second, masks)})
    for name, kept in judged.kept.weights.items():
        want = 0.25 * first[name] + 0.75 * second[name]
        if name in masks:
            want = want * masks[name]
        assert torch.allclose(kept, want, atol=1e-6), name
    assert agent.kept is not None and agent.kept.weights is judged.kept.weights
    assert agent.averaged is judged.kept.weights
    assert (judged.loss, judged.metric) == learner.facts.evaluate_on(judged.kept.weights, data)
    raw = learner.facts.evaluate_on(second, data)
    assert (judged.strategy_loss, judged.strategy_metric) == raw


@pytest.mark.parametrize("strategy", ["dadpfl", "fedavg"])
def test_averaging_changes_what_a_device_keeps_not_what_it_trains_nor_its_epsilon(
    strategy: str,
) -> None:
    latest = simulate(config(strategy, rounds=4, fallback="off"))
    averaged = simulate(config(strategy, rounds=4, fallback="off", dp_average=0.5))
    assert per_round(averaged, "train_loss") == per_round(latest, "train_loss")
    assert per_round(averaged, "strategy_accuracy") == accuracies(latest)
    assert epsilons(averaged) == epsilons(latest)
    first = {key: a for key, a in accuracies(latest).items() if key[0] == 1}
    assert {key: a for key, a in accuracies(averaged).items() if key[0] == 1} == first
    later = [key for key in accuracies(latest) if key[0] > 1]
    assert any(accuracies(averaged)[key] != accuracies(latest)[key] for key in later)


@pytest.mark.parametrize("strategy", ["dadpfl", "fedavg"])
def test_emulate_keeps_the_average_simulate_keeps(
    amqtt_broker, tmp_path: Path, strategy: str
) -> None:
    cfg = config(strategy, rounds=3, fallback="off", dp_average=0.5)
    simulated = simulate(cfg)
    opts = EmulationOptions(workdir=tmp_path / "fleet", linger_s=20.0, agents_per_process=ROSTER)
    emulated = Emulation(cfg, amqtt_broker.address, opts).run()
    assert emulated["summary"]["failed_agents"] == {}
    assert accuracies(emulated) == pytest.approx(accuracies(simulated), abs=1e-6)
    assert accuracies(simulated) != accuracies(simulate(config(strategy, rounds=3, fallback="off")))


def test_a_restarted_device_goes_on_from_its_kept_average(tmp_path: Path) -> None:
    learning = preset("dadpfl", rounds=4, neighbours=1, dp="sample", dp_average=0.5)
    run = Run(
        "run-average",
        ("a", "b"),
        ExperimentConfig(dataset="mnist1d", agents=2, seed=3, learning=learning),
    )
    agent = runtime_of(tmp_path, run)
    average = {n: torch.full_like(w, 0.25) for n, w in agent.session.state.weights.items()}
    agent.session.state = dataclasses.replace(agent.session.state, averaged=average)
    persist(agent.session, agent.driver, 1, {"round": 1})
    resumed = runtime_of(tmp_path, run)
    assert restore(resumed.session, resumed.driver) == 1
    restored = resumed.session.state.averaged
    assert restored is not None and restored.keys() == average.keys()
    assert all(torch.equal(restored[n], average[n]) for n in average)
