"""Energy per round from the device profiles: the model, simulate's report and plots, and
emulate reporting the same figures as simulate."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.device.throttle import Throttle, radio_energy_j, round_energy, training_energy_j
from agent.experiment import ExperimentConfig, agent_profiles
from agent.learning import preset
from coordinator.emulate import Emulation
from coordinator.plots import write_plots
from coordinator.simulate import simulate
from firmware_profiles import load_profile
from tests.test_emulate import SHARED, assert_same_learning, options

PI4 = load_profile("raspberry-pi-4")
ORIN = load_profile("jetson-orin-nano")


def config(
    strategy: str = "dadpfl", profiles: str = "mixed", agents: int = 4, **learning: object
) -> ExperimentConfig:
    learning = {"rounds": 3, "neighbours": 2, "epochs": 1, **learning}
    return ExperimentConfig(
        dataset="mnist1d",
        agents=agents,
        partition="dirichlet:0.5",
        seed=7,
        profiles=profiles,
        round_time_s=0.01,
        learning=preset(strategy, **learning),
    )


def agent_rounds(report: dict) -> list[dict]:
    return [a for r in report["rounds"] for a in r["agents"].values()]


def test_the_profiles_make_a_raspberry_pi_4_the_costlier_board_per_flop() -> None:
    """The premise of the next tests: more power above idle for far less compute."""
    pi4_j_per_flop = (PI4.max_power_w - PI4.idle_power_w) / PI4.peak_fp32_gflops
    orin_j_per_flop = (ORIN.max_power_w - ORIN.idle_power_w) / ORIN.peak_fp32_gflops
    assert pi4_j_per_flop > 5 * orin_j_per_flop


def test_a_weaker_board_spends_more_energy_per_flop_in_the_model() -> None:
    flops = 1e9
    assert training_energy_j(PI4, flops) > 5 * training_energy_j(ORIN, flops)
    # 1 GFLOP at 10% of the Pi's 48 GFLOPS peak: 0.208 s at 3.7 W above idle.
    assert training_energy_j(PI4, flops) == pytest.approx(flops / 4.8e9 * 3.7)
    # The Pi's slower link (100 vs 200 Mbit/s) costs more per byte despite its lower draw.
    assert radio_energy_j(PI4, 10**6) > radio_energy_j(ORIN, 10**6)
    assert round_energy(PI4, 0, 0) == (0.0, 0.0)


def test_an_emulated_board_models_its_time_a_real_one_uses_what_it_measured() -> None:
    emulated = Throttle(PI4, sleep=lambda _s: None)
    assert emulated.round_energy(1e9, 5.0, 1000) == round_energy(PI4, 1e9, 1000)
    real = Throttle(PI4, enabled=False)
    training, radio = real.round_energy(1e9, 2.0, 0)
    assert training == pytest.approx(2.0 * 3.7) and radio == 0.0


def test_a_weaker_board_spends_more_energy_per_flop_in_a_simulated_run() -> None:
    pi4, orin = (simulate(config(profiles=name, rounds=2)) for name in (PI4.name, ORIN.name))
    for a, b in zip(agent_rounds(pi4), agent_rounds(orin), strict=True):
        assert a["train_flops"] > 0 and b["train_flops"] > 0
        assert a["energy_j"] / a["train_flops"] > 5 * b["energy_j"] / b["train_flops"]
    assert pi4["summary"]["energy_source"] == "modelled"
    assert set(pi4["summary"]["energy_by_agent"]) == set(pi4["config"]["roster"])
    assert sum(pi4["summary"]["energy_by_agent"].values()) == pytest.approx(
        pi4["summary"]["total_energy_j"]
    )
    radio = sum(a["radio_energy_j"] for a in agent_rounds(pi4))
    assert pi4["summary"]["total_radio_energy_j"] == pytest.approx(radio)
    assert radio > 0


def test_early_stopping_saves_the_energy_of_the_rounds_not_run(tmp_path: Path) -> None:
    report = simulate(config(rounds=6, early_stop=True, stop_rule="paper"))
    stopped = report["summary"]["stopped"]
    assert any(s["saved_rounds"] > 0 for s in stopped.values()), "the case must stop early"
    for agent_id, saved in stopped.items():
        ran = [r["agents"][agent_id] for r in report["rounds"][: saved["round"]]]
        mean = sum(a["energy_j"] for a in ran) / len(ran)
        assert saved["saved_energy_j"] == pytest.approx(mean * saved["saved_rounds"])
        later = [r["agents"][agent_id] for r in report["rounds"][saved["round"] :]]
        assert all(a["energy_j"] == 0.0 for a in later), "a stopped agent trains no more"
    written = {p.name for p in write_plots(report, tmp_path)}
    assert "energy.png" in written and (tmp_path / "energy.png").stat().st_size > 0


def test_without_profiles_there_is_no_energy_figure(tmp_path: Path) -> None:
    report = simulate(config(profiles="", rounds=4, early_stop=True, stop_rule="paper"))
    assert all(a["energy_j"] is None and a["radio_energy_j"] is None for a in agent_rounds(report))
    summary = report["summary"]
    assert summary["total_energy_j"] is None and summary["total_radio_energy_j"] is None
    assert summary["energy_by_agent"] is None and summary["energy_source"] is None
    assert all(s["saved_energy_j"] is None for s in summary["stopped"].values())
    assert "energy.png" not in {p.name for p in write_plots(report, tmp_path)}


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "learning",
    [
        {"strategy": "dadpfl", "max_wait": 2},
        {"strategy": "fedspu", "rounds": 6, "early_stop": True, "stop_rule": "paper"},
    ],
    ids=["dadpfl", "fedspu-early-stop"],
)
def test_simulate_and_emulate_report_the_same_training_energy(
    amqtt_broker, tmp_path: Path, learning: dict
) -> None:
    """Training energy is a function of the counted FLOPs, which both compute alike: equal
    to the last bit. Radio energy follows each side's own byte count (emulate's connection
    also carries statuses, envelopes and re-sends), so it is close, not equal."""
    cfg = config(**learning)
    boards = agent_profiles(cfg, [f"agent-{k:03d}" for k in range(cfg.agents)])
    shared = options(tmp_path, agents_per_process=SHARED)
    emulated = Emulation(cfg, amqtt_broker.address, shared).run()
    simulated = simulate(cfg)
    assert_same_learning(emulated, simulated)
    for got, want in zip(emulated["rounds"], simulated["rounds"], strict=True):
        for k, a in want["agents"].items():
            assert got["agents"][k]["energy_j"] == a["energy_j"], (got["round"], k)
            spent = got["agents"][k]["bytes_sent"] + got["agents"][k]["bytes_received"]
            radio = got["agents"][k]["radio_energy_j"]
            assert radio == radio_energy_j(boards[k], spent), (got["round"], k)
    for key in ("total_energy_j", "energy_by_agent", "energy_source"):
        assert emulated["summary"][key] == simulated["summary"][key], key
    saved = {k: s["saved_energy_j"] for k, s in simulated["summary"]["stopped"].items()}
    assert {k: s["saved_energy_j"] for k, s in emulated["summary"]["stopped"].items()} == saved
    if learning.get("early_stop"):
        assert any(saved.values()), "the case must stop early and save energy"
