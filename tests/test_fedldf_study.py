"""studies/fedldf_study.py measures what `coordinator simulate` runs: its FedLDF row is the
simulator's FedLDF, its n >= K row is FedAvg, and its alternative selections upload what they
say (issue 17: the study's conclusions rest on these)."""

from __future__ import annotations

import pytest
import torch

from agent.experiment import ExperimentConfig
from agent.learning import preset
from coordinator.simulate import simulate
from studies import fedldf_study as study

pytestmark = pytest.mark.timeout(120)


def simulated(strategy: str, **over: int) -> float:
    """The simulator's figure for the study's row: the study weighs uploads by their sample
    counts (FedLDF's eq. 5), which the simulator does under `--aggregation mean`."""
    config = ExperimentConfig(
        dataset="digits",
        agents=5,
        partition="dirichlet:0.3",
        seed=3,
        threads=1,
        learning=preset(strategy, rounds=2, epochs=2, fallback="off", aggregation="mean", **over),
    )
    return float(simulate(config)["summary"]["mean_accuracy"])


def test_fedldf_and_fedavg_rows_are_the_simulators() -> None:
    fedldf = study.run("digits", 3, study.Variant("fedldf", "", n=2, rounds=2, agents=5))
    assert fedldf["accuracy"] == simulated("fedldf", ldf_n=2)
    fedavg = study.run("digits", 3, study.Variant("fedavg", "", **study.AVG, rounds=2, agents=5))
    assert fedavg["accuracy"] == simulated("fedavg")
    assert fedavg["upload_ratio"] == 1.0
    # Each of the 5 agents sends 2 of the 5 layer-slots per layer on average: 2/5 of the
    # model, plus its divergence vector.
    assert 0.4 < fedldf["upload_ratio"] < 0.41


@pytest.mark.parametrize("select", ["random", "client-random", "client-top", "per-step", "bottom"])
def test_every_selection_sends_each_layer_from_n_agents(select: str) -> None:
    gen = torch.Generator().manual_seed(0)
    divs = {f"a{i}": {"L1": float(i), "L2": float(5 - i), "L3": 1.0} for i in range(5)}
    steps = {f"a{i}": 1 + i % 2 for i in range(5)}
    chosen = study._pick(study.Variant("x", "", n=2, select=select), divs, steps, gen)
    for layer in ("L1", "L2", "L3"):
        assert sum(layer in layers for layers in chosen.values()) == 2
    if select == "bottom":
        assert [k for k, layers in chosen.items() if "L1" in layers] == ["a0", "a1"]
