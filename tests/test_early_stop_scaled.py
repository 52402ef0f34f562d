"""The `scaled` early-stopping rule (agent/learning/early_stop.py; measured in
bench/early_stopping.py): `progress` over a window that is a third of the run, so that one
rule fits a 30-round and a 60-round run; it stops a fleet that levelled off and not one
still learning, and emulated agents stop where simulated ones do."""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

import pytest

from agent.experiment import ExperimentConfig
from agent.learning import StopRule, StopWatch, preset
from agent.learning.config import SCALED_DELTA, SCALED_PRUNE_NOISE
from coordinator.emulate import Emulation
from coordinator.simulate import Simulation
from tests.test_emulate import SHARED, assert_same_learning, options


@pytest.mark.parametrize(("rounds", "window"), [(8, 5), (15, 5), (30, 10), (40, 13), (60, 20)])
def test_the_window_is_a_third_of_the_run(rounds: int, window: int) -> None:
    rule = StopRule.of(preset("fedavg", early_stop=True, stop_rule="scaled", rounds=rounds))
    assert (rule.name, rule.patience, rule.delta) == ("scaled", window, SCALED_DELTA)
    given = preset("fedavg", early_stop=True, stop_rule="scaled", rounds=60, stop_patience=4)
    assert StopRule.of(given).patience == 4  # --stop-patience still sets the window


def test_scaled_decides_as_progress_with_its_window() -> None:
    losses = [10.0, 6.0, 5.0, 4.8, 4.7, 4.65, 4.62, 4.6, 4.59, 4.58, 4.575, 4.57]

    def stops_after(rule: StopRule) -> int | None:
        watch = StopWatch()
        for round_, loss in enumerate(losses, start=1):
            watch, stops = watch.after(loss, rule.patience, rule.name, rule.delta)
            if stops:
                return round_
        return None

    # Window 5, delta 0.05: after round 8 the best fell 5.0 -> 4.6 in five rounds, more
    # than 0.05 x (10 - 4.6) = 0.27; after round 9, 4.8 -> 4.59 is 0.21, less.
    scaled = StopRule.of(preset("fedavg", early_stop=True, stop_rule="scaled", rounds=15))
    assert stops_after(scaled) == 9
    assert stops_after(StopRule("progress", 5, SCALED_DELTA)) == 9
    assert stops_after(StopRule("progress", 20, 0.1)) is None  # the default's window: never


LEVELLING = [10.0, 6.0, 5.0, 4.8, 4.7, 4.65, 4.62, 4.6, 4.59, 4.58, 4.575, 4.57]
"""L falls, then levels off: `scaled` with a window of 5 stops after round 9."""


def stops_after(losses: list[float], rule: StopRule, pruned: int) -> int | None:
    """The round after which an agent with these L values stops; round `pruned` pruned it."""
    watch = StopWatch()
    for round_, loss in enumerate(losses, start=1):
        restart = round_ == pruned
        watch, stops = watch.under(loss, rule, restart)
        if stops:
            return round_
    return None


def test_a_prune_within_the_noise_of_l_does_not_restart_scaled_one_beyond_does() -> None:
    scaled = StopRule.of(preset("dadpfl", early_stop=True, stop_rule="scaled", rounds=15))
    assert (scaled.patience, scaled.prune_noise) == (5, SCALED_PRUNE_NOISE)
    # Round 8 pruned the model and L rose 4.62 -> 4.67: within two standard deviations
    # (0.41 each) of the window's round-to-round changes, the prune did not hurt, and the
    # agent stops after round 9 as if it had not pruned (DA-DPFL's prunes on the grid).
    small = [*LEVELLING[:7], 4.67, *LEVELLING[8:]]
    assert stops_after(small, scaled, pruned=8) == stops_after(LEVELLING, scaled, pruned=0) == 9
    # `progress` restarts on every prune: its window starts anew at round 8.
    assert stops_after(small, StopRule("progress", 5, SCALED_DELTA), pruned=8) is None
    # L jumped to 6.5: the prune hurt, the L before belongs to another model, the window
    # restarts and the agent trains on while the pruned model recovers.
    large = [*LEVELLING[:7], 6.5, *LEVELLING[8:]]
    assert stops_after(large, scaled, pruned=8) is None
    # Too few rounds to read L's noise from: a prune restarts as before.
    assert StopWatch(losses=(10.0, 6.0)).jumped(5.0, SCALED_PRUNE_NOISE)


RISING = [10.0, 6.0, 4.0, 3.0, 2.5, 2.2]
"""The first six rounds of the cases below: L falls fast."""
SMOOTH = [*RISING, *(2.1 - 0.002 * i for i in range(24))]
"""Then L creeps down 0.002 a round: a plateau that no noise explains."""
NOISY = [*RISING, *(2.1 - 0.002 * i + (0.15 if i % 2 else -0.15) for i in range(24))]
"""The same plateau under noise of +-0.15 a round (an edge agent's small validation split)."""
FALLING = [*RISING, *(2.1 - 0.07 * i for i in range(24))]
"""L still falls, 0.07 a round, without noise: learning at the long window's pace or more."""


@pytest.mark.parametrize(("rounds", "short"), [(15, 5), (30, 6), (40, 8), (41, 0), (60, 0)])
def test_the_short_window_runs_on_runs_of_at_most_40_rounds(rounds: int, short: int) -> None:
    """Measured on the grid: at 60 rounds the short window cost more than it cut."""
    rule = StopRule.of(preset("fedavg", early_stop=True, stop_rule="scaled", rounds=rounds))
    assert rule.smooth_window == short


def thirty_rounds() -> tuple[StopRule, StopRule]:
    """`scaled` on a 30-round run, and the same without its short window."""
    rule = StopRule.of(preset("fedavg", early_stop=True, stop_rule="scaled", rounds=30))
    assert (rule.patience, rule.smooth_window) == (10, 6)
    return rule, dataclasses.replace(rule, smooth_window=0)


def test_scaled_stops_a_smooth_plateau_after_its_short_window() -> None:
    rule, long_only = thirty_rounds()
    # After round 12 the best fell 2.2 -> 2.09 in six rounds, within the long window's pace
    # (0.05 x 6/10 of the fall 10 -> 2.09: 0.24), and L's changes there (sd 0.04) stay
    # within 1% of that fall (0.079): the agent stops four rounds before the long window
    # (after round 16, 2.2 -> 2.082 in ten rounds, within 0.05 x 7.9) would stop it.
    assert stops_after(SMOOTH, rule, pruned=0) == 12
    assert stops_after(SMOOTH, long_only, pruned=0) == 16


def test_the_short_window_waits_out_noise_and_a_steady_fall() -> None:
    rule, long_only = thirty_rounds()
    # Under noise the short window proves nothing: only the long one stops the agent.
    assert stops_after(NOISY, rule, pruned=0) == stops_after(NOISY, long_only, pruned=0) == 16
    # A smooth fall at more than the long window's pace is learning, not a plateau.
    assert stops_after(FALLING, rule, pruned=0) is None


def test_a_thirty_round_fleet_stops_sooner_with_the_short_window(monkeypatch) -> None:
    """The simulator's agents read the rule's short window (`EarlyStop.of`): with it a fleet
    that levels off smoothly (FedAvg at lr 0.03, the devices stop after rounds 17-21) stops
    sooner than with the long window alone (after rounds 21-26)."""
    with_short = Simulation(shifted(0.03, rounds=30))
    with_short.run()
    monkeypatch.setattr("agent.learning.early_stop.SCALED_SMOOTH_NOISE", 0.0)
    long_only = Simulation(shifted(0.03, rounds=30))
    long_only.run()
    assert set(with_short.stopped) == set(long_only.stopped) == set(long_only.roster)
    assert all(with_short.stopped[a] <= long_only.stopped[a] for a in long_only.roster)
    assert sum(with_short.stopped.values()) < sum(long_only.stopped.values())


def test_a_simulated_dadpfl_agent_stops_under_scaled_while_it_prunes() -> None:
    """Under `scaled` agents stop before the run's end while their models are pruned every
    round (`pruning`); under `progress` with the same window and delta, which restarts on
    every prune, none does."""

    def stopped(rule: str) -> dict[str, int]:
        simulation = Simulation(pruning(rule))
        simulation.run()
        assert simulation.plan.times == list(range(2, 15)), "the case must prune every round"
        return simulation.stopped

    scaled = stopped("scaled")
    assert scaled and min(scaled.values()) < 15, "agents whose prunes did not hurt stop"
    assert stopped("progress") == {}


def shifted(lr: float, rounds: int = 15) -> ExperimentConfig:
    """Four devices of FedProx's synthetic task with their own feature shift under FedAvg:
    at lr 0.1 the fleet levels off within ten rounds; at 0.003 it still learns at 15."""
    learning = preset("fedavg", rounds=rounds, epochs=1, lr=lr, early_stop=True, stop_rule="scaled")
    return ExperimentConfig(
        dataset="synthetic:0.5,1",
        agents=4,
        partition="natural",
        seed=7,
        threads=1,
        round_time_s=0.01,
        learning=learning,
    )


def pruning(rule: str) -> ExperimentConfig:
    """Six DA-DPFL devices of the task of `shifted`, levelling off within 15 rounds, the plan
    pruning in every round from round 2 on (`delta_pr` 100) in steps that leave L within
    its noise; `rule` with a window of 5 and scaled's delta."""
    learning = preset(
        "dadpfl",
        rounds=15,
        neighbours=3,
        epochs=1,
        lr=0.1,
        delta_pr=100.0,
        max_wait=2,
        early_stop=True,
        stop_rule=rule,
        stop_patience=5,
        stop_delta=SCALED_DELTA,
    )
    return dataclasses.replace(shifted(0.1), agents=6, learning=learning)


def fleet_losses(report: dict) -> list[float]:
    """The fleet's mean training loss per round."""
    return [
        statistics.fmean(a["train_loss"] for a in r["agents"].values()) for r in report["rounds"]
    ]


def test_scaled_stops_a_levelled_fleet_and_not_one_still_learning() -> None:
    levelled = Simulation(shifted(0.1))
    report = levelled.run()
    assert set(levelled.stopped) == set(levelled.roster), "every device levelled off"
    assert max(levelled.stopped.values()) < 15, "and stopped before the run's end"
    assert report["summary"]["stopped"].keys() == set(levelled.roster)

    learning = Simulation(shifted(0.003))
    losses = fleet_losses(learning.run())
    assert losses[-1] < losses[-6] - 0.05 * (losses[0] - losses[-1]), "it still learns"
    assert learning.stopped == {}, "a fleet still learning trains to the end"


@pytest.mark.timeout(600)
def test_emulated_agents_stop_where_simulated_ones_do(amqtt_broker, tmp_path: Path) -> None:
    cfg = shifted(0.1, rounds=12)  # window 5: the devices stop after rounds 10-11
    shared = options(tmp_path, agents_per_process=SHARED)
    emulated = Emulation(cfg, amqtt_broker.address, shared).run()
    assert emulated["summary"]["failed_agents"] == {}
    simulated = Simulation(cfg).run()
    assert_same_learning(emulated, simulated)
    stopped = {a: s["round"] for a, s in simulated["summary"]["stopped"].items()}
    assert stopped, "the case must exercise early stopping"
    assert {a: s["round"] for a, s in emulated["summary"]["stopped"].items()} == stopped


@pytest.mark.timeout(600)
def test_emulated_dadpfl_agents_stop_where_simulated_ones_do(amqtt_broker, tmp_path: Path) -> None:
    """The networked agents run the same rule on the same pruning rounds (`pruning`)."""
    cfg = pruning("scaled")
    shared = options(tmp_path, agents_per_process=SHARED)
    emulated = Emulation(cfg, amqtt_broker.address, shared).run()
    assert emulated["summary"]["failed_agents"] == {}
    simulated = Simulation(cfg).run()
    assert_same_learning(emulated, simulated)
    stopped = {a: s["round"] for a, s in simulated["summary"]["stopped"].items()}
    assert stopped and min(stopped.values()) < 15, "the case must stop agents while pruning"
    assert {a: s["round"] for a, s in emulated["summary"]["stopped"].items()} == stopped
