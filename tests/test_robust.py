"""Robust aggregation (`--aggregation`, `--clip`), poisoning (`--attackers`, `--attack`) and
the finite-model guard: the pure rules, and what they do to a simulated fleet."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from agent.experiment import ExperimentConfig
from agent.learning import (
    AgentState,
    Fit,
    Payload,
    Published,
    ServerState,
    central_strategy,
    checked_fit,
    preset,
    robust,
    robust_rules,
)
from agent.learning.central.participant import Turn
from agent.options import experiment_config
from coordinator.simulate import Simulation, simulate

MEDIAN = robust_rules.Rule("median")


def test_median_and_trimmed_mean_count_only_the_senders_that_hold_an_element() -> None:
    values = torch.tensor([[1.0, 5.0, 0.0], [2.0, 100.0, 0.0], [9.0, 6.0, 3.0], [4.0, 7.0, 0.0]])
    held = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 1], [0, 1, 0]], dtype=torch.bool)
    values = values.to(torch.float64)
    # column 0: {1, 2, 9}; column 1: {5, 100, 6, 7}; column 2: {3}
    assert robust.combine(values, held, MEDIAN).tolist() == [2.0, 6.5, 3.0]
    trimmed = robust.combine(values, held, robust_rules.Rule("trimmed", 0.25))
    assert trimmed.tolist() == [2.0, 6.5, 3.0]  # one cut at each end of 3 and of 4
    untrimmed = robust.combine(values, held, robust_rules.Rule("trimmed", 0.0))
    assert untrimmed.tolist() == pytest.approx([4.0, 29.5, 3.0])
    nobody = robust.combine(values, torch.zeros_like(held), MEDIAN)
    assert nobody.tolist() == [0.0, 0.0, 0.0]


def test_robust_aggregate_of_masked_models_and_missing_tensors() -> None:
    states = {
        "a": {"w": torch.tensor([1.0, 0.0]), "b": torch.tensor([1.0])},
        "b": {"w": torch.tensor([3.0, 2.0]), "b": torch.tensor([2.0])},
        "c": {"w": torch.tensor([9.0, 4.0])},
    }
    held = {"a": {"w": torch.tensor([True, False])}}
    out, counts = robust.aggregate(states, MEDIAN, held)
    assert out["w"].tolist() == [3.0, 3.0]
    assert counts["w"].tolist() == [3, 2]
    assert out["b"].tolist() == [1.5]
    previous = {"w": torch.tensor([7.0, 7.0]), "b": torch.tensor([7.0]), "c": torch.tensor([7.0])}
    onto = robust.aggregate_onto(previous, states, MEDIAN, held)
    assert onto["c"].tolist() == [7.0] and onto["w"].tolist() == [3.0, 3.0]


def test_clipping_bounds_each_received_models_distance_to_the_own() -> None:
    own = {"w": torch.zeros(4)}
    models = {
        "a": {"w": torch.tensor([1.0, 0.0, 0.0, 0.0])},
        "b": {"w": torch.tensor([0.0, 2.0, 0.0, 0.0])},
        "c": {"w": torch.tensor([0.0, 0.0, 300.0, 400.0])},
    }
    bounded = robust.clip(own, models, "1.5")
    fixed = bounded.models
    assert torch.equal(fixed["a"]["w"], models["a"]["w"])
    assert robust.distance(own, fixed["b"]) == pytest.approx(1.5)
    assert robust.distance(own, fixed["c"]) == pytest.approx(1.5)
    assert (bounded.screened, bounded.clipped) == ((), ("b", "c"))
    models["d"] = {"w": torch.tensor([0.0, 0.0, 3.0, 4.0])}  # 5: within the screen, 3 x 2
    screened = robust.clip(own, models, "auto")  # the lower median distance, 2
    auto = screened.models
    assert robust.distance(own, auto["d"]) == pytest.approx(4.0), "clipped to 2 x 2"
    assert torch.equal(auto["b"]["w"], models["b"]["w"])
    # c is screened out: the mean of the own model, a, b and the clipped d stands in for it
    assert auto["c"]["w"].tolist() == pytest.approx([0.25, 0.5, 0.6, 0.8])
    assert (screened.screened, screened.clipped) == (("c",), ("d",))
    off = robust.clip(own, models, "off")
    assert off.models["c"]["w"].tolist() == [0.0, 0.0, 300.0, 400.0]
    assert (off.screened, off.clipped) == ((), ())
    # a sparse sender: the distance and the pull only over the entries it holds
    masked = robust.clip(
        {"w": torch.ones(2)},
        {"s": {"w": torch.tensor([5.0, -9.0])}},
        "2",
        {"s": {"w": torch.tensor([True, False])}},
    ).models
    assert masked["s"]["w"].tolist() == [3.0, -9.0]


def test_auto_screens_out_far_models_and_keeps_honest_ones() -> None:
    own = {"w": torch.tensor([1.0, 1.0]), "b": torch.tensor([0.5])}
    honest = {
        f"h{i}": {"w": torch.tensor([1.0 + d, 1.0]), "b": torch.tensor([0.5])}
        for i, d in enumerate([0.1, 0.2, 0.3, 0.4])
    }
    poisoned = {n: t * robust_rules.SCALE_FACTOR for n, t in honest["h3"].items()}
    flipped = {n: -t for n, t in honest["h2"].items()}
    out = robust.clip(own, {**honest, "p": poisoned, "q": flipped}, "auto").models
    for j in honest:  # within 2 x the median (0.3): as sent
        assert all(torch.equal(out[j][n], honest[j][n]) for n in own), j
    for j in ("p", "q"):  # beyond 3 x: the mean of the own model and the kept ones
        assert out[j]["w"].tolist() == pytest.approx([1.2, 1.0]), j
        assert out[j]["b"].tolist() == pytest.approx([0.5]), j
    assert robust.bounds([0.1, 0.2, 0.3, 0.4, 50.0, 90.0]) == pytest.approx((0.6, 0.9))


def test_auto_with_one_or_two_received_models() -> None:
    own = {"w": torch.zeros(3)}
    far = {"w": torch.tensor([0.0, 300.0, 400.0])}
    near = {"w": torch.tensor([0.0, 0.3, 0.4])}
    # one received model: nothing to compare with, kept as it is
    alone = robust.clip(own, {"p": far}, "auto").models
    assert alone["p"]["w"].tolist() == far["w"].tolist()
    two = robust.clip(own, {"h": near, "p": far}, "auto").models  # the nearer sets the bounds
    assert two["h"]["w"].tolist() == near["w"].tolist()
    assert two["p"]["w"].tolist() == pytest.approx([0.0, 0.15, 0.2]), "mean of own and h"
    # no honest one
    both = robust.clip(own, {"p": far, "q": {"w": far["w"] * 2}}, "auto").models
    assert robust.distance(own, both["q"]) == pytest.approx(1000.0), "nothing to tell by"
    # a sparse sender is screened on the entries it holds; the rest stay its own zeros
    sparse = robust.clip(
        {"w": torch.ones(3)},
        {"h": {"w": torch.tensor([1.5, 1.0, 1.0])}, "s": {"w": torch.tensor([90.0, 0.0, 0.0])}},
        "auto",
        {"s": {"w": torch.tensor([True, False, False])}},
    ).models
    assert sparse["s"]["w"].tolist() == [1.25, 0.0, 0.0]


MODEL_ATTACKS = [a for a in robust_rules.ATTACKS if a not in robust_rules.SENT_AS_TRAINED]
"""The attacks on what is sent (labelflip and backdoor send the model they trained:
test_backdoor)."""


@pytest.mark.parametrize("attack", MODEL_ATTACKS)
def test_a_poisoned_model_is_well_formed_and_bad(attack: str) -> None:
    weights = {"w": torch.tensor([[0.5, -0.25], [0.0, 1.0]]), "b": torch.tensor([0.1, 0.2])}
    masks = {"w": torch.tensor([[True, True], [False, True]])}
    trained_from = {"w": torch.zeros(2, 2), "b": torch.tensor([0.5, 0.5])}  # `inflate`'s
    other = {"w": torch.ones(2, 2), "b": torch.tensor([0.7, 0.8])}  # another colluder's
    pooled = robust.Colluders([weights, other], z=2.0)

    def poisoned() -> robust.State:
        generator = torch.Generator().manual_seed(3)
        return robust.poison(weights, masks, attack, generator, trained_from, pooled)

    first, again = poisoned(), poisoned()
    for n in weights:  # drawn from the generator
        torch.testing.assert_close(first[n], again[n], rtol=0, atol=0, equal_nan=True)
    assert all(first[n].shape == t.shape and first[n].dtype == t.dtype for n, t in weights.items())
    assert robust.finite(first) == (attack != "nan")
    assert first["w"][1, 0] == 0.0, "zero outside the mask, as the honest model"
    assert not float((first["b"] - weights["b"]).abs().max()) <= 0.1  # NaN: not close either
    if attack == "huge":
        assert first["b"].tolist() == torch.full((2,), robust_rules.HUGE_VALUE).tolist()
    if attack == "signflip":
        assert torch.equal(first["b"], -weights["b"])
    if attack == "inflate":  # the step from the model trained from, the other way
        torch.testing.assert_close(first["b"], torch.tensor([0.9, 0.8]))
    if attack == "ipm":  # half of that step the other way
        torch.testing.assert_close(first["b"], torch.tensor([0.7, 0.65]))
    if attack == "replace":  # the step boosted 20 times
        torch.testing.assert_close(first["b"], torch.tensor([-7.5, -5.5]))
    if attack == "alie":  # the colluders' mean less 2 of their standard deviations
        torch.testing.assert_close(first["b"], torch.tensor([-0.2, -0.1]), atol=1e-6, rtol=0)


def test_an_alie_attacker_that_knows_no_other_model_sends_its_own() -> None:
    weights = {"b": torch.tensor([0.1, 0.2])}
    alone = robust.Colluders([weights], z=1.0)
    for colluders in (None, alone):
        sent = robust.poison(weights, None, "alie", torch.Generator(), None, colluders)
        assert torch.equal(sent["b"], weights["b"])


def test_alie_shifts_within_what_a_majority_rule_counts_on() -> None:
    # Baruch et al. 2019: n = 50, m = 12 -> s = 14, z = Phi^-1(36 / 50) = 0.58
    assert robust_rules.alie_z(50, 12) == pytest.approx(0.583, abs=1e-3)
    assert robust_rules.alie_z(20, 4) > robust_rules.alie_z(20, 2) > 0.0
    assert robust_rules.alie_z(20, 0) == 0.0, "with no attacker there is no margin"
    assert robust_rules.alie_z(1, 1) == 0.0


def test_bad_options_are_one_sentence_each() -> None:
    for spec in ("trimmed:0.5", "trimmed:x", "mode", "trimmed:-0.1"):
        with pytest.raises(ValueError, match="--aggregation must be screened, signs, mean,"):
            experiment_config({"aggregation": spec})
    for spec in ("0", "-1", "nan", "sometimes"):
        with pytest.raises(ValueError, match="--clip must be off, auto or a positive"):
            experiment_config({"clip": spec})
    with pytest.raises(ValueError, match="--attackers must be between 0 and agents - 1 = 3"):
        experiment_config({"agents": 4, "attackers": 4})
    assert robust_rules.parse_rule("trimmed:0.2") == robust_rules.Rule("trimmed", 0.2)
    assert experiment_config({"aggregation": "median", "clip": "auto"}).learning.clip == "auto"


def _config(
    strategy: str, aggregation: str = "mean", attackers: int = 2, **kw: object
) -> ExperimentConfig:
    """8 agents on iid digits (on a skewed partition a median is far from the mean even
    without attackers), a few short rounds; the strategy's models as they are (no device
    falls back to its local-only model, which would hide what the rule lets through)."""
    neighbours = {"neighbours": 4} if strategy in ("dadpfl", "dfedavgm") else {}
    rounds = 8 if strategy == "dadpfl" else 6
    learning = preset(
        strategy,
        rounds=rounds,
        epochs=1,
        aggregation=aggregation,
        **{"fallback": "off", **neighbours, **kw},
    )
    return ExperimentConfig(
        dataset="digits",
        agents=8,
        partition="iid",
        seed=2,
        attackers=attackers,
        attack="scale",
        learning=learning,
    )


@pytest.mark.parametrize("strategy", ["dadpfl", "fedavg"])
def test_two_attackers_break_the_mean_and_not_the_robust_rules(strategy: str) -> None:
    clean = simulate(_config(strategy, attackers=0))["summary"]
    assert "honest_mean_accuracy" not in clean, "a clean run's summary is unchanged"
    attacked = simulate(_config(strategy))["summary"]
    assert attacked["attackers"] == ["agent-000", "agent-001"]
    broken = attacked["honest_mean_accuracy"]
    assert broken < clean["mean_accuracy"] - 0.2
    for aggregation, clip in (("median", "off"), ("trimmed:0.3", "off"), ("mean", "auto")):
        defended = simulate(_config(strategy, aggregation, clip=clip))["summary"]
        accuracy = defended["honest_mean_accuracy"]
        assert accuracy > broken + 0.1 and accuracy > clean["mean_accuracy"] - 0.15, aggregation


def test_a_member_claiming_the_protocols_largest_count_does_not_outweigh_the_fleet() -> None:
    """FedAvg weighed each upload by its sender's claim: one member claiming 10,000,000
    samples with a step the wrong way took the fleet to chance. Under the default rule
    every upload weighs the same; `--aggregation mean` keeps the published weighting."""
    clean = simulate(_config("fedavg", "screened", attackers=0))["summary"]["mean_accuracy"]
    inflated = dataclasses.replace(_config("fedavg", "screened", attackers=1), attack="inflate")
    defended = simulate(inflated)["summary"]
    assert defended["attackers"] == ["agent-000"]
    # one reversed step of eight slows 6 short rounds; the claim adds nothing to it
    assert defended["honest_mean_accuracy"] > clean - 0.1
    undefended = dataclasses.replace(_config("fedavg", attackers=1), attack="inflate")
    assert simulate(undefended)["summary"]["honest_mean_accuracy"] < clean - 0.3


def test_an_agent_receiving_huge_weights_keeps_its_model_and_goes_on() -> None:
    """The bug: a neighbour's finite 3e37 weights turned the receiver's model to NaN for the
    rest of the run. Now the round is undone, and later rounds with honest neighbours learn."""
    simulation = Simulation(_config("dfedavgm", attackers=0))
    learner, me = simulation.learner, "agent-005"
    state = simulation.states[me]
    huge = {n: torch.full_like(t, 3e37) for n, t in state.weights.items()}
    inbox = {"agent-001": Published(huge, None, 10)}
    result = learner.local_round(state, simulation.data[me], inbox, 1, False)
    assert result.recovered and robust.finite(result.published.weights)
    assert all(torch.equal(result.state.weights[n], state.weights[n]) for n in state.weights)
    assert result.state.round == 1 and math.isfinite(result.train_loss)
    honest = {"agent-002": learner.published(simulation.states["agent-002"], 10)}
    later = learner.local_round(result.state, simulation.data[me], honest, 2, False)
    assert not later.recovered and later.accuracy > 0.0


def test_a_participant_whose_fit_is_not_finite_uploads_what_changes_nothing() -> None:
    before = AgentState("a", {"w": torch.ones(2)}, None, {"w": torch.ones(2)})
    view = ServerState({"w": torch.tensor([2.0, 3.0])})
    bad = Fit(
        dataclasses.replace(before, weights={"w": torch.tensor([math.nan, 1.0])}, round=4),
        Payload({"w": torch.tensor([math.nan, 1.0])}),
        10,
        math.nan,
        0,
    )
    fit, undone = checked_fit(bad, before, view)
    assert undone and fit.state.round == 4
    assert fit.upload.weights["w"].tolist() == [2.0, 3.0]
    assert fit.state.weights["w"].tolist() == [1.0, 1.0]


def test_an_undone_fit_keeps_the_round_of_its_local_only_model(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A participant whose round comes out not finite (here: trained from a global model
    that is not) keeps its model from before, says so, and its local-only model, which never
    saw that model, still trains: in the networked agent's order, which the simulator shares
    (`Turn.train`); it used to undo the local-only model's round with the fit's."""
    simulation = Simulation(_config("fedavg", attackers=0, fallback="local"))
    learner, me = simulation.learner, "agent-005"
    state = simulation.states[me]
    poisoned = ServerState({n: torch.full_like(t, math.nan) for n, t in state.weights.items()})
    turn = Turn(me, 1, 1.0)
    fit = turn.train(central_strategy("fedavg"), learner, state, simulation.data[me], poisoned)
    assert "round 1: model not finite; kept the model from before it" in caplog.text
    assert fit.undone and fit.state.round == 1
    assert all(torch.equal(fit.state.weights[n], state.weights[n]) for n in state.weights)
    assert fit.state.shadow is not None and fit.fallback_flops > 0
    moved = fit.state.shadow.weights  # from the fleet's initial weights, as `local` starts
    assert any(not torch.equal(moved[n], learner.facts.initial[n]) for n in moved)
    assert robust.finite(moved)


def test_a_step_few_senders_push_is_reversed_and_one_most_agree_on_is_taken() -> None:
    reference = {"w": torch.zeros(3), "count": torch.tensor(4)}
    # element 0: all four step up; element 1: one pushes hard, three step either way; element
    # 2: two up, two down
    states = {
        "a": {"w": torch.tensor([1.0, 8.0, 1.0]), "count": torch.tensor(5)},
        "b": {"w": torch.tensor([1.0, 0.1, 1.0]), "count": torch.tensor(5)},
        "c": {"w": torch.tensor([1.0, -0.1, -1.0]), "count": torch.tensor(5)},
        "d": {"w": torch.tensor([1.0, -0.1, -1.0]), "count": torch.tensor(5)},
    }
    mean = {"w": torch.tensor([1.0, 1.975, 0.0]), "count": torch.tensor(5)}
    voted = robust.sign_vote(reference, states, mean)
    torch.testing.assert_close(voted["w"], torch.tensor([1.0, -1.975, 0.0]))
    assert voted["count"] is mean["count"], "counters are copied, never voted on"
    # what a sender does not hold is no vote: element 1's two holders both step up
    held = {k: {"w": torch.tensor([True, k in "ab", True])} for k in states}
    kept = robust.sign_vote(reference, states, mean, held)
    assert float(kept["w"][1]) == pytest.approx(1.975)


def test_signs_takes_only_strategies_whose_senders_share_one_start() -> None:
    assert experiment_config({"aggregation": "signs", "strategy": "fedavg"}).learning.clip == "auto"
    for strategy in ("dadpfl", "fedadam"):
        with pytest.raises(ValueError, match="--aggregation signs votes on the steps of models"):
            experiment_config({"aggregation": "signs", "strategy": strategy})
