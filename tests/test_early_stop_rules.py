"""Early-stopping rules (ALGORITHMS.md 2, agent/learning/early_stop.py): each rule's decisions
on a given loss sequence, the defaults, bad values, and a checkpoint round trip."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from agent.experiment import ExperimentConfig
from agent.learning import DEFAULT_STOP_RULE, RoundTopology, StopRule, StopWatch, live, preset
from agent.runtime import checkpoint
from coordinator.simulate import Simulation

NAN = math.nan


def stops_after(
    losses: list[float],
    rule: StopRule,
    watch: StopWatch | None = None,
    pruned: frozenset[int] = frozenset(),
) -> int | None:
    """The round (1-based) after which an agent with these L values stops, if any; the
    rounds in `pruned` pruned its model."""
    watch = watch or StopWatch()
    for round_, loss in enumerate(losses, start=1):
        restart = round_ in pruned
        watch, stops = watch.after(
            loss, rule.patience, rule.name, rule.delta, restart, rule.prune_noise
        )
        if stops:
            return round_
    return None


LEVELLING = [10.0, 6.0, 5.0, 4.9, 4.85, 4.8]
"""L falls fast, then levels off: never a rise."""
NOISY = [10.0, 6.0, 7.0, 5.0, 5.5, 4.0, 3.0, 2.5]
"""L falls with noisy rises in between (an edge agent's tiny validation split)."""


@pytest.mark.parametrize(
    ("losses", "rule", "expected"),
    [
        (NOISY, StopRule("paper", 1), 3),  # the paper: the first rise stops
        (NOISY, StopRule("paper", 2), None),  # never two rises in a row
        ([3.0, 2.0, 2.5, 1.0, 1.5, 1.6], StopRule("paper", 2), 6),
        (LEVELLING, StopRule("paper", 1), None),  # a plateau without rises never stops
        # progress, window 2, delta 0.1: after round 5 the best fell 5 -> 4.85 in two
        # rounds, 0.15 <= 0.1 x (10 - 4.85); after round 4, 6 -> 4.9 was still progress.
        (LEVELLING, StopRule("progress", 2, 0.1), 5),
        (LEVELLING, StopRule("progress", 2, 0.01), None),  # 0.1 > 0.01 x 5.2 in round 6
        (NOISY, StopRule("progress", 2, 0.1), None),  # noise is no plateau: the best falls
        ([3.0, 2.0, 2.5, 2.2, 2.1], StopRule("progress", 3, 0.0), 5),  # delta 0: no new best
        ([3.0, 2.0, 2.5, 2.2, 1.9], StopRule("progress", 3, 0.0), None),
    ],
)
def test_each_rule_decides_on_a_loss_sequence(losses, rule: StopRule, expected) -> None:
    assert stops_after(losses, rule) == expected


PRUNED_AT_6 = [10.0, 6.0, 5.0, 4.95, 4.9, 6.0, 5.5, 5.2, 5.0, 4.99, 4.985, 4.98]
"""L levels off, round 6 prunes the model (L jumps), then the pruned model recovers."""


def test_a_pruning_round_restarts_the_progress_window() -> None:
    rule = StopRule("progress", 3, 0.1)
    # Against the L from before the pruning, the best stalls: the agent would stop in the
    # very round that pruned it, keeping a model that has not recovered (DA-DPFL).
    assert stops_after(PRUNED_AT_6, rule) == 6
    # Restarted, the window and the scale (first L) start at the pruned model's L: it trains
    # `patience` rounds at least, and stops once its own recovery has levelled off.
    assert stops_after(PRUNED_AT_6, rule, pruned=frozenset({6})) == 12
    assert stops_after(PRUNED_AT_6[:11], rule, pruned=frozenset({6})) is None
    # The paper's rule counts its rises as printed.
    paper = StopRule("paper", 1)
    assert stops_after(PRUNED_AT_6, paper, pruned=frozenset({6})) == stops_after(PRUNED_AT_6, paper)


@pytest.mark.parametrize(("name", "reason"), [("paper", "rose"), ("progress", "levelled off")])
def test_the_log_says_why_the_agent_stopped(name: str, reason: str) -> None:
    assert StopRule(name).reason == f"its loss {reason}"


@pytest.mark.parametrize("rule", [StopRule("paper", 1), StopRule("progress", 2, 0.1)])
def test_without_a_validation_split_no_rule_stops(rule: StopRule) -> None:
    assert stops_after([NAN] * 30, rule) is None
    assert stops_after([NAN, *LEVELLING], StopRule("progress", 2, 0.1)) == 6  # NaN skipped


def test_early_stop_defaults_to_the_measured_rule() -> None:
    rule = StopRule.of(preset("fedspu", early_stop=True))
    assert (rule.name, rule.patience, rule.delta) == (DEFAULT_STOP_RULE, 20, 0.1)
    assert DEFAULT_STOP_RULE == "progress"
    paper = StopRule.of(preset("fedspu", early_stop=True, stop_rule="paper"))
    assert paper.patience == 1  # as the paper prints it: the first rise
    assert StopRule.of(preset("fedspu", stop_rule="paper", stop_patience=3)).patience == 3


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"stop_rule": "never"}, "--stop-rule must be one of progress, paper, scaled, got never"),
        ({"stop_patience": -1}, "--stop-patience must be >= 0"),
        ({"stop_delta": 1.0}, "--stop-delta must be in [0, 1), got 1.0"),
        ({"stop_delta": -0.1}, "--stop-delta must be in [0, 1), got -0.1"),
    ],
)
def test_bad_stop_settings_get_one_line(over: dict, message: str) -> None:
    config = ExperimentConfig(learning=preset("fedspu", early_stop=True, **over))
    with pytest.raises(ValueError, match=r"^[^\n]+$") as caught:
        config.validate()
    assert message in str(caught.value)


@pytest.mark.parametrize(
    ("rule", "losses", "pruned"),
    [
        (StopRule("paper", 2), [10.0, 6.0, 7.0, 5.0, 5.2, 5.3, 4.9, 4.85, 4.9, 4.84], ()),
        (StopRule("progress", 3, 0.1), [10.0, 6.0, 7.0, 5.0, 5.2, 5.3, 4.9, 4.85, 4.83], ()),
        (StopRule("progress", 3, 0.1), PRUNED_AT_6, (6,)),
        (StopRule("scaled", 3, 0.1, 2.0), PRUNED_AT_6, (6, 10)),  # the rise's noise restored
    ],
)
def test_a_restored_watch_decides_as_one_that_never_restarted(
    tmp_path: Path, rule: StopRule, losses: list[float], pruned: tuple[int, ...]
) -> None:
    def run(watch: StopWatch, first_round: int, losses: list[float]) -> tuple[StopWatch, list]:
        decisions = []
        for round_, loss in enumerate(losses, start=first_round):
            restart = round_ in pruned
            watch, stops = watch.after(
                loss, rule.patience, rule.name, rule.delta, restart, rule.prune_noise
            )
            decisions.append(stops)
        return watch, decisions

    _, decisions = run(StopWatch(), 1, losses)
    assert any(decisions), "the case must reach a stop"
    for crash in range(1, len(losses)):
        watch, _ = run(StopWatch(), 1, losses[:crash])
        path = tmp_path / f"{crash}.pt"  # saved and read back as the agent's session does
        checkpoint.save(path, {"stop_watch": dataclasses.asdict(watch)})
        saved = checkpoint.load(path)
        assert saved is not None
        _, resumed = run(StopWatch(**saved["stop_watch"]), crash + 1, losses[crash:])
        assert resumed == decisions[crash:], crash


def test_a_checkpoint_from_before_the_rules_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "old.pt"
    checkpoint.save(path, {"stop_watch": {"previous": 2.0, "rises": 1}})
    saved = checkpoint.load(path)
    assert saved is not None
    watch = StopWatch(**saved["stop_watch"])
    assert watch.after(2.5, 2, "paper")[1]  # the paper rule goes on counting its rises
    assert stops_after(LEVELLING, StopRule("progress", 2, 0.1), watch) == 5  # progress anew


def test_a_simulated_agent_trains_on_while_it_prunes() -> None:
    """DA-DPFL: the simulator restarts an agent's window in each round that pruned it."""

    def stopped(delta_pr: float) -> tuple[dict[str, int], list[int]]:
        learning = preset(
            "dadpfl",
            rounds=8,
            neighbours=3,
            epochs=1,
            delta_pr=delta_pr,  # 0: never prunes; 100: prunes from round 2 on
            early_stop=True,
            stop_patience=2,
            stop_delta=0.3,
        )
        config = ExperimentConfig(
            dataset="mnist1d", agents=6, partition="dirichlet:0.5", seed=7, threads=1
        )
        simulation = Simulation(dataclasses.replace(config, learning=learning))
        simulation.run()
        return simulation.stopped, simulation.plan.times

    levelled, never = stopped(0.0)
    assert levelled and not never, "without pruning, these agents level off and stop"
    assert stopped(100.0) == ({}, [2, 3, 4, 5, 6, 7])


def test_a_need_counts_only_if_its_sender_trained_in_that_round() -> None:
    """`live`: a neighbour that stopped after round 2 counts with its round-2 model (it
    trained then) and is left out of every later round's needs."""
    needs = {(3, "a"), (2, "b"), (3, "c"), (0, "d")}
    assert live(needs, {"a": 2, "b": 2, "d": 1}) == {(2, "b"), (3, "c"), (0, "d")}
    assert live(needs, {}) == needs


def test_a_decentralized_agent_leaves_stopped_neighbours_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DA-DPFL in the simulator: no aggregate holds a model of a round its sender did not
    train (a stopped agent's stale model pulled its neighbours back: studies/early_stopping.py),
    and the run does leave some neighbour out."""
    learning = preset(
        "dadpfl", rounds=8, neighbours=3, epochs=1, early_stop=True, stop_rule="paper"
    )
    config = ExperimentConfig(dataset="mnist1d", agents=6, seed=7, threads=1)
    simulation = Simulation(dataclasses.replace(config, learning=learning))
    inboxes: list[tuple[int, set[str], set[str]]] = []
    start_round = simulation._start_round

    def recorded(k: str, topology: RoundTopology, inbox: dict) -> object:
        prior, posterior = topology.prior_posterior(k)
        inboxes.append((topology.round, set(prior), set(inbox)))
        assert set(inbox) <= set(prior) | set(posterior)
        return start_round(k, topology, inbox)

    monkeypatch.setattr(simulation, "_start_round", recorded)
    simulation.run()
    stopped = simulation.stopped
    assert stopped, "the case must exercise early stopping"
    for t, prior, senders in inboxes:
        for j in senders:
            assert stopped.get(j, t) >= (t if j in prior else t - 1), (t, j, stopped)
    assert any(len(senders) < 3 for _, _, senders in inboxes), "someone was left out"
