"""BatchNorm running statistics describe the model they are used with (ALGORITHMS.md 6): the
metric a round records is the model's metric with statistics freshly computed from the
device's own training data under its final weights, for every kind of strategy."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import agent.learning.central.server as server_module
import edgefl
from agent.learning import PRESETS, LocalData, statistics
from agent.learning.sparse import State
from coordinator.simulate import Simulation

KEYWORDS = Path(__file__).resolve().parent.parent / "examples" / "keyword_spotting" / "run.toml"


def reference_metric(model: nn.Module, weights: State, data: LocalData) -> tuple[float, float]:
    """(loss, accuracy) with statistics computed the textbook way, independently of the
    project: every BatchNorm reset, then one train-mode pass over all the training data with
    cumulative averaging, then eval mode on the test split."""
    model = copy.deepcopy(model)
    model.load_state_dict(weights)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.reset_running_stats()
                module.momentum = None
        model.train()
        model(data.x_train)
        model.eval()
        logits = model(data.x_test)
    loss = nn.functional.cross_entropy(logits, data.y_test).item()
    return loss, (logits.argmax(1) == data.y_test).sum().item() / len(data.y_test)


def run(strategy: str, monkeypatch: pytest.MonkeyPatch) -> tuple[Simulation, dict[str, Any], Any]:
    """The keyword-spotting example (DS-CNN with BatchNorm) for 3 rounds, and the global
    model a centralized run ended with."""
    servers: list[Any] = []
    advance = server_module.advance_server

    def kept(*args: Any) -> Any:
        servers.append(advance(*args))
        return servers[-1]

    monkeypatch.setattr(server_module, "advance_server", kept)
    config = edgefl.config(KEYWORDS, strategy=strategy, rounds=3, agents=4, fallback="off")
    sim = Simulation(config)
    report = sim.run()
    return sim, report, servers[-1] if servers else None


@pytest.mark.parametrize("strategy", ["local", "dadpfl", "dfedavgm", "fedavg-ft", "fedspu"])
def test_a_personal_model_is_evaluated_with_its_own_fresh_statistics(
    strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sim, report, _ = run(strategy, monkeypatch)
    last = report["rounds"][-1]["agents"]
    for agent, state in sim.states.items():
        loss, accuracy = reference_metric(sim.learner.facts.model, state.weights, sim.data[agent])
        assert last[agent]["accuracy"] == pytest.approx(accuracy, abs=1e-9), agent
        assert last[agent]["loss"] == pytest.approx(loss, rel=1e-4), agent


def test_the_global_model_is_evaluated_with_statistics_of_the_device_for_its_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sim, report, server = run("fedavg", monkeypatch)
    last = report["rounds"][-1]["agents"]
    for agent in sim.states:
        loss, accuracy = reference_metric(sim.learner.facts.model, server.weights, sim.data[agent])
        assert last[agent]["accuracy"] == pytest.approx(accuracy, abs=1e-9), agent
        assert last[agent]["loss"] == pytest.approx(loss, rel=1e-4), agent


def test_refreshing_changes_only_running_statistics() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 2))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(1030, 3) * 3 + 1
    names = ("1.running_mean", "1.running_var", "1.num_batches_tracked")
    fresh = statistics.refreshed(model, state, x, names)
    for name, tensor in state.items():
        if name not in names:
            assert torch.equal(fresh[name], tensor), name
    features = x @ state["0.weight"].T + state["0.bias"]
    assert torch.allclose(fresh["1.running_mean"], features.mean(0), atol=1e-3)
    assert torch.allclose(fresh["1.running_var"], features.var(0), rtol=1e-2)
    again = statistics.refreshed(model, state, x, names)  # no randomness: dropout is off
    assert all(torch.equal(again[n], fresh[n]) for n in names)
    assert statistics.refreshed(model, state, x[:1], names) is state


@pytest.mark.parametrize("strategy", PRESETS)
def test_every_strategy_trains_a_batchnorm_model(strategy: str) -> None:
    """Federated dropout (a sub-model's masks cover BatchNorm's statistics) and the FedAdam
    presets (moments for every state entry, buffers included) failed on the first round of
    a BatchNorm model; every strategy now trains the keyword-spotting DS-CNN."""
    config = edgefl.config(KEYWORDS, strategy=strategy, rounds=1, epochs=1, agents=4)
    report = edgefl.simulate(config)
    for record in report.rounds:
        assert all(math.isfinite(a["accuracy"]) for a in record["agents"].values())
