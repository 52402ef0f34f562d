"""A model each device can trust (agent/learning/fallback.py): after every round a device
keeps, of the models it holds and its local-only model, the one best on its own validation
data, reports and serves that one, and says which and why."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

import edgefl
from agent.learning import Learner, LocalData, preset
from agent.learning.fallback import choose, start_shadow, train_shadow
from agent.learning.kept import Shadow
from agent.learning.models import build_model, prunable_names
from coordinator.simulate import Simulation

SENSORS = Path(__file__).resolve().parent.parent / "examples" / "sensor_regression" / "run.toml"


def small_learner(**overrides: object) -> tuple[Learner, LocalData]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(192, 1, 16, generator=g)
    y = (x.mean((1, 2)) > 0).long()
    model = build_model("mlp", (1, 16), 2, seed=0)
    cfg = preset("fedavg", epochs=2, batch_size=16, **overrides)  # type: ignore[arg-type]
    learner = Learner(model, (1, 16), prunable_names(model), cfg, seed=1)
    return learner, LocalData(x[:96], y[:96], x[96:144], y[96:144], x[144:], y[144:])


def trained(learner: Learner, data: LocalData, rounds: int) -> dict[str, torch.Tensor]:
    """A model trained `rounds` local rounds from the fleet's initial weights."""
    shadow = start_shadow(learner)
    for round_ in range(1, rounds + 1):
        shadow, _ = train_shadow(learner, shadow, data, "a", round_)
    return shadow.weights


def test_the_best_model_on_validation_is_kept_and_the_local_one_unless_beaten() -> None:
    learner, data = small_learner()
    good, untrained = trained(learner, data, 5), dict(learner.facts.initial)
    kept = choose(learner, {"fleet": (untrained, None), "local": (good, None)}, data)
    assert kept.name == "local" and kept.weights is good
    assert kept.scores["local"] > kept.scores["fleet"]
    assert "validation accuracy" in kept.reason and "fleet" in kept.reason
    lead = choose(learner, {"personal": (good, None), "local": (untrained, None)}, data)
    assert lead.name == "personal", "a clear lead on validation"
    tie = choose(learner, {"personal": (good, None), "fleet": (good, None)}, data)
    assert tie.name == "personal", "a tie keeps the strategy's model"
    even = choose(learner, {"personal": (good, None), "local": (good, None)}, data)
    assert even.name == "local" and "within the validation noise" in even.reason
    broken = {k: torch.full_like(v, math.nan) for k, v in good.items()}
    assert choose(learner, {"personal": (broken, None), "local": (good, None)}, data).name == (
        "local"
    )


def test_the_local_model_trains_every_round_and_says_what_it_cost() -> None:
    """It trains on whatever the fleet's model does (one that stopped once the fleet's had
    beaten it a few rounds left devices worse than alone by the run's end), at the `local`
    strategy's cost; without a validation split nothing could choose it, so it never trains."""
    learner, data = small_learner()
    shadow = start_shadow(learner)
    for round_ in range(1, 4):
        before = shadow.weights
        shadow, flops = train_shadow(learner, shadow, data, "a", round_)
        assert flops == learner.facts.train_flops(None, 2 * 96)
        assert not all(torch.equal(shadow.weights[k], before[k]) for k in before)
    assert shadow.rounds == 3
    blind = LocalData(
        data.x_train, data.y_train, data.x_test, data.y_test, data.x_val[:0], data.y_val[:0]
    )
    assert train_shadow(learner, shadow, blind, "a", 4) == (shadow, 0)


def test_in_a_simulation_the_local_model_is_the_local_strategys() -> None:
    options = {"dataset": "digits", "agents": 4, "rounds": 3, "epochs": 1, "seed": 2}
    alone = Simulation(edgefl.config(**options, strategy="local"))
    alone.run()
    fleet = Simulation(edgefl.config(**options, strategy="dispfl"))
    fleet.run()
    for agent, state in fleet.states.items():
        shadow = state.shadow
        assert isinstance(shadow, Shadow) and shadow.rounds == 3
        local = alone.states[agent].weights
        assert all(torch.equal(shadow.weights[k], local[k]) for k in local)


@pytest.mark.parametrize("fallback", ["off", "fleet", "local"])
def test_what_a_fallback_setting_lets_a_device_keep(fallback: str) -> None:
    config = edgefl.config(SENSORS, strategy="fedavg", agents=4, rounds=3, fallback=fallback)
    report = edgefl.simulate(config)
    final = report.rounds[-1]["agents"].values()
    kept = {a["kept"] for a in final}
    spent = report.summary["total_fallback_flops"]
    if fallback == "off":
        assert kept == {"fleet"} and spent == 0
        assert all(a["mae"] == a["strategy_mae"] for a in final)
    elif fallback == "fleet":
        assert kept <= {"fleet", "personal"} and spent == 0
    else:
        assert spent > 0 and "local" in kept
    assert report.summary["kept"] == {k: sum(a["kept"] == k for a in final) for k in kept}


@pytest.mark.slow
def test_a_device_whose_fleet_model_is_worse_keeps_its_own_and_serves_it(tmp_path: Path) -> None:
    """Sensor regression under FedAvg: each machine's calibration is its own, so devices
    whose global model fits them worse than their local-only one keep that one, say so,
    and export it; emulated agents (real processes, MQTT) decide as simulated ones."""
    import onnx

    from agent.onnx_model import OnnxModel

    config = edgefl.config(SENSORS, strategy="fedavg", agents=4, rounds=6)
    simulation = Simulation(config)
    simulated = edgefl.Report.of(simulation.run())
    emulated = edgefl.emulate(config, workdir=tmp_path / "fleet", agents_per_process=4)
    final = emulated.rounds[-1]["agents"]
    for agent, figures in simulated.rounds[-1]["agents"].items():
        for name in ("kept", "mae", "strategy_mae", "fallback_flops"):
            assert final[agent][name] == figures[name], (agent, name)
    own = [k for k, a in final.items() if a["kept"] == "local"]
    assert own, "no device kept its local model"
    for agent in own:
        assert final[agent]["strategy_mae"] > final[agent]["mae"]  # the fleet's is worse
        folder = tmp_path / "fleet" / agent
        log = (tmp_path / "fleet" / f"{agent}.log").read_text()
        assert "model final (local: validation mae" in log
        path = folder / "model.onnx"
        metadata = {p.key: p.value for p in onnx.load(path).metadata_props}
        assert metadata["kept"] == "local"
        shadow = simulation.states[agent].shadow
        assert shadow is not None
        data = simulation.data[agent]
        model = simulation.learner.facts.model
        model.load_state_dict(shadow.weights)
        model.eval()
        with torch.no_grad():
            expected = model(data.x_test).numpy()
        served = OnnxModel.load(path).predict(data.x_test.numpy())
        assert np.abs(served - expected).max() < 1e-4
