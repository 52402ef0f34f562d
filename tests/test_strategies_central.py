"""The centralized strategies of ALGORITHMS.md 2-4 and early stopping, through the simulator."""

from __future__ import annotations

import pytest

from agent.learning import CENTRALIZED, StopWatch, preset
from agent.learning.central import STATIC_TIERS, static_tier
from agent.learning.reduction import Reduction, local_reduction
from agent.learning.reductions.freeze import MIN_ACTIVE
from coordinator.simulate import ExperimentConfig, Simulation, simulate

AGENTS = 5


def config(strategy: str, rounds: int = 2, **learning: object) -> ExperimentConfig:
    return ExperimentConfig(
        dataset="mnist1d",
        agents=AGENTS,
        partition="dirichlet:0.5",
        seed=3,
        learning=preset(strategy, rounds=rounds, epochs=1, neighbours=3, **learning),
    )


def agent_figures(report: dict, key: str, round_index: int = 0) -> dict[str, float]:
    return {k: a[key] for k, a in report["rounds"][round_index]["agents"].items()}


@pytest.mark.parametrize("strategy", CENTRALIZED)
def test_every_centralized_strategy_learns_and_reports(strategy: str) -> None:
    report = simulate(config(strategy))
    summary = report["summary"]
    assert summary["rounds"] == 2 and summary["busiest_agent"] == "coordinator"
    assert 0.0 < summary["mean_accuracy"] <= 1.0 and summary["total_train_flops"] > 0
    for record in report["rounds"]:
        assert set(record["agents"]) == set(report["config"]["roster"])
        # FedBuff: a version's senders are those it took (`applied`); everyone receives it
        senders = [e["agent"] for e in record.get("applied", [])] or record["agents"]
        assert all(record["agents"][k]["bytes_sent"] > 0 for k in senders)
        assert all(a["bytes_received"] > 0 for a in record["agents"].values())
        assert record["coordinator"]["received"] == sum(
            a["bytes_sent"] for a in record["agents"].values()
        )


def test_fedldf_with_every_participant_per_layer_is_fedavg() -> None:
    fedavg = simulate(config("fedavg", rounds=3))
    ldf = simulate(config("fedldf", rounds=3, ldf_n=AGENTS))
    for t in range(3):
        assert agent_figures(ldf, "accuracy", t) == agent_figures(fedavg, "accuracy", t)
        assert agent_figures(ldf, "loss", t) == agent_figures(fedavg, "loss", t)


def test_fedldf_uploads_n_of_k_of_the_layers() -> None:
    fedavg = simulate(config("fedavg", rounds=1))
    ldf = simulate(config("fedldf", rounds=1, ldf_n=1))
    uploaded = fedavg["rounds"][0]["coordinator"]["received"]
    ldf_uploaded = ldf["rounds"][0]["coordinator"]["received"]
    # One participant per layer: the model once, plus divergence vectors and message headers.
    assert ldf_uploaded < uploaded / AGENTS + 4_000


def test_fedadam_uploads_shrink_with_one_shared_mask() -> None:
    sent = {
        s: sum(agent_figures(simulate(config(s, rounds=1)), "bytes_sent").values())
        for s in ("fedadam", "fedadam-top", "fedadam-ssm")
    }
    assert sent["fedadam-ssm"] < sent["fedadam-top"] < sent["fedadam"]


def test_fedspu_and_federated_dropout_move_the_same_active_part() -> None:
    spu, drop = simulate(config("fedspu", rounds=1)), simulate(config("feddrop", rounds=1))
    assert agent_figures(spu, "bytes_sent") == agent_figures(drop, "bytes_sent")
    assert agent_figures(spu, "bytes_received") == agent_figures(drop, "bytes_received")
    # Dropout trains the sub-model only; FedSPU still runs the frozen part forward (the same
    # when every neuron is active: the last agent's tier is 1.0).
    spu_flops, drop_flops = agent_figures(spu, "train_flops"), agent_figures(drop, "train_flops")
    *partial, full = sorted(spu_flops)
    assert all(drop_flops[k] < spu_flops[k] for k in partial)
    assert drop_flops[full] == spu_flops[full]


def test_without_profiles_fedspu_uses_the_papers_tiers() -> None:
    simulation = Simulation(config("fedspu", rounds=1))
    tiers = [static_tier(simulation.roster, k) for k in simulation.roster]
    assert tiers == list(STATIC_TIERS[:AGENTS])
    report = simulation.run()
    assert list(agent_figures(report, "p_k").values()) == tiers
    flops = agent_figures(report, "train_flops")
    per_sample = {k: flops[k] / len(simulation.data[k].y_train) for k in flops}
    ordered = [per_sample[k] for k in simulation.roster]
    assert ordered == sorted(ordered)


@pytest.mark.parametrize("strategy", ["fedavg-ft", "dadpfl", "fedspu"])
def test_a_stopped_agent_keeps_its_model_and_spends_nothing(strategy: str) -> None:
    report = simulate(config(strategy, rounds=8, early_stop=True, stop_rule="paper"))
    stopped = report["summary"]["stopped"]
    assert stopped, "with one local epoch per round some agent's loss rises within 8 rounds"
    for agent_id, info in stopped.items():
        after = [r["agents"][agent_id] for r in report["rounds"][info["round"] :]]
        last = report["rounds"][info["round"] - 1]["agents"][agent_id]
        for record in after:
            # It trains and receives nothing; it only re-sends its last model to neighbours
            # that never had it (each fetches it once).
            assert record["train_flops"] == 0 and record["bytes_received"] == 0
            assert record["bytes_sent"] <= last["bytes_sent"] * (AGENTS - 1)
            assert record["accuracy"] == last["accuracy"]
        assert info["saved_rounds"] == 8 - info["round"]
        if info["saved_rounds"]:  # one that stopped after the last round saved nothing
            assert info["saved_flops"] > 0 and info["saved_bytes"] > 0


def test_the_run_ends_when_every_agent_has_stopped() -> None:
    report = simulate(config("fedavg-ft", rounds=40, early_stop=True, stop_rule="paper", lr=0.5))
    stopped = report["summary"]["stopped"]
    assert len(stopped) == AGENTS
    assert report["summary"]["rounds"] == max(i["round"] for i in stopped.values()) < 40


def test_without_early_stopping_nobody_stops() -> None:
    assert simulate(config("fedavg-ft", rounds=4))["summary"]["stopped"] == {}


@pytest.mark.parametrize("variant", ["fedadam-ssm", "fedadam-top"])
def test_keeping_every_delta_is_dense_fedadam(variant: str) -> None:
    dense = simulate(config("fedadam", rounds=2))
    kept = simulate(config(variant, rounds=2, ssm_fraction=1.0))
    for t in range(2):
        assert agent_figures(kept, "accuracy", t) == agent_figures(dense, "accuracy", t)


@pytest.mark.parametrize(
    ("losses", "patience", "stops_after"),
    [
        ([3.0, 2.0, 2.5, 1.0], 1, 3),  # ALGORITHMS.md 2: the first rise stops
        ([3.0, 2.0, 2.5, 1.0, 1.5, 1.6], 2, 6),  # a rise, a fall, then two rises in a row
        ([3.0, float("nan"), 4.0, 5.0], 1, 4),  # NaN never counts as a rise
    ],
)
def test_the_stop_rule_counts_consecutive_rises(losses, patience, stops_after) -> None:
    watch, stopped_at = StopWatch(), None
    for round_, loss in enumerate(losses, start=1):
        watch, stops = watch.after(loss, patience)
        if stops and stopped_at is None:
            stopped_at = round_
    assert stopped_at == stops_after


def reduction_at(p_k: float, mode: str):
    """local_reduction for a cnn1d DA-DPFL agent at density 0.5 whose budget is p_k, and the
    FLOP fraction c of a full round of its model."""
    learner = Simulation(config("dadpfl", reduce=mode)).learner
    masks = learner.init_agent("agent-000").masks
    cost = learner.facts.forward_flops(masks) / learner.facts.dense_flops
    return local_reduction(learner.facts, p_k, masks), cost


def test_reduce_prunes_or_freezes_to_the_budget() -> None:
    (_, cost) = reduction_at(1.0, "prune")
    affordable, short, shorter = cost * 1.01, cost * 0.9, cost * 0.75
    assert reduction_at(affordable, "freeze")[0] == Reduction()
    assert reduction_at(affordable, "prune")[0].setting >= 0.5  # a cap that prunes nothing
    pruned, _ = reduction_at(short, "prune")
    assert pruned.kind == "prune" and pruned.setting < 0.5
    assert pruned.figures() == {"density_cap": pruned.setting}  # the round's record
    # Freezing a fraction a costs c (2 + a) / 3: a = 3 x 0.9 - 2 = 0.7 here.
    frozen, _ = reduction_at(short, "freeze")
    assert frozen.kind == "freeze" and frozen.setting == pytest.approx(0.7)
    assert frozen.figures() == {"active_fraction": frozen.setting}
    # At 0.75 c only a = 0.25 can train.
    assert reduction_at(shorter, "freeze")[0].setting == pytest.approx(0.25)
    # Below 2/3 c freezing cannot meet the budget at all: it trains the minimum.
    assert reduction_at(cost * 0.5, "freeze")[0].setting == MIN_ACTIVE


def test_freezing_trains_fewer_flops_and_keeps_the_density() -> None:
    def run(reduce: str, profiles: str) -> dict:
        return simulate(
            ExperimentConfig(
                dataset="mnist1d",
                agents=6,
                partition="dirichlet:0.5",
                seed=3,
                profiles=profiles,
                round_time_s=0.01,
                learning=preset("dadpfl", rounds=1, epochs=1, neighbours=3, reduce=reduce),
            )
        )

    frozen, full = run("freeze", "mixed"), run("freeze", "")
    short = {k for k, a in agent_figures(run("prune", "mixed"), "sparsity").items() if a > 0.51}
    assert short, "a weak board must be short of its budget"
    frozen_flops, full_flops = (
        agent_figures(frozen, "train_flops"),
        agent_figures(full, "train_flops"),
    )
    assert all(frozen_flops[k] < full_flops[k] for k in short)
    assert all(frozen_flops[k] == full_flops[k] for k in set(full_flops) - short)
    assert all(
        s == pytest.approx(0.5, abs=0.01) for s in agent_figures(frozen, "sparsity").values()
    )


def test_an_unknown_reduce_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="--reduce"):
        ExperimentConfig(learning=preset("dadpfl", reduce="squash")).validate()
