"""Budgets a device can feel (issue 32): measured costs choose the round's reduction, and each
reduction trains what it says and nothing else."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from agent.device import calibration
from agent.device.calibration import ActivationMeter, RoundCosts, cached_costs, measure_costs
from agent.learning import Learner
from agent.learning.config import SGDConfig, StrategyConfig
from agent.learning.costs import Cost, CostTable, Row
from agent.learning.learner import LocalData
from agent.learning.models import build_model, prunable_names
from agent.learning.prefix import forward_layers, round_window, trained_names, windows
from agent.learning.reduced import reduced_training
from agent.learning.reduction import NO_REDUCTION, Reduction, local_reduction, measured_reduction
from agent.learning.training import train_local


def learner_for(name: str, shape: tuple[int, ...], **config: object) -> Learner:
    model = build_model(name, shape, 10, seed=1)
    cfg = StrategyConfig(**{"strategy": "dfedavgm", "batch_size": 16, **config})  # type: ignore[arg-type]
    return Learner(model, shape, prunable_names(model), cfg, seed=1)


def data_for(shape: tuple[int, ...], n: int = 64) -> LocalData:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, *shape, generator=generator)
    y = torch.randint(0, 10, (n,), generator=generator)
    return LocalData(x, y, x[:8], y[:8], x[:8], y[:8])


def table(rows: list[tuple[str, float, float, float, tuple[int, int] | None]]) -> CostTable:
    """A cost table of (kind, level, time share, activation MiB, window) rows; dense takes
    1 s a step with 10 MiB fixed and 100 MiB of activations at batch 16."""
    return CostTable(
        key="test",
        batch_size=16,
        dense=Cost(1.0, 10.0, 100.0),
        forward_s=0.001,
        rows=tuple(
            Row(kind, level, Cost(share, 10.0, act), window)
            for kind, level, share, act, window in rows
        ),
    )


TABLE = table(
    [
        ("freeze", 0.5, 0.85, 100.0, None),
        ("freeze", 0.2, 0.8, 100.0, None),
        ("prefix", 0.5, 0.7, 60.0, (0, 2)),
        ("prefix", 0.5, 0.45, 30.0, (2, 4)),
        ("prefix", 0.25, 0.6, 70.0, (0, 1)),
        ("prefix", 0.25, 0.3, 20.0, (3, 4)),
        ("prefix", 0.25, 0.35, 25.0, (2, 3)),
        ("width", 0.5, 0.3, 45.0, None),
        ("width", 0.25, 0.1, 22.0, None),
    ]
)
KINDS = ("freeze", "prefix", "width")


def test_auto_takes_the_least_costly_kind_that_fits_at_its_highest_level() -> None:
    # Freezing fits 0.9 (at active 0.5): it is tried first.
    chosen = measured_reduction(TABLE, KINDS, 0.9, 0, None, 16)
    assert (chosen.label, chosen.setting, chosen.predicted) == ("freeze", 0.5, 0.85)
    # At 0.5 freezing does not fit; the widest prefix window that fits does (level 0.5).
    chosen = measured_reduction(TABLE, KINDS, 0.5, 0, None, 16)
    assert (chosen.label, chosen.setting, chosen.predicted) == ("prefix", (2, 4), 0.45)
    assert "freeze (cheapest 0.80) do not fit" in chosen.why
    # At 0.32 only one window of level 0.25 fits; at 0.2 width 0.25 is the only option.
    assert measured_reduction(TABLE, KINDS, 0.32, 0, None, 16).setting == (3, 4)
    chosen = measured_reduction(TABLE, KINDS, 0.2, 0, None, 16)
    assert (chosen.label, chosen.setting) == ("width", 0.25)


def test_prefix_windows_take_turns_among_those_that_fit() -> None:
    fitting = {measured_reduction(TABLE, ("prefix",), 0.36, r, None, 16).setting for r in range(4)}
    assert fitting == {(2, 3), (3, 4)}
    assert round_window([(0, 1), (1, 2)], 3) == (1, 2)


def test_prefix_takes_the_level_whose_windows_train_the_most_layers() -> None:
    # At 0.46 one window of level 0.5 fits (layers 2-3), three of level 0.25 (layers 1-3).
    wider = table(
        [
            ("prefix", 0.5, 0.7, 60.0, (0, 2)),
            ("prefix", 0.5, 0.45, 30.0, (2, 4)),
            ("prefix", 0.25, 0.6, 70.0, (0, 1)),
            ("prefix", 0.25, 0.4, 40.0, (1, 2)),
            ("prefix", 0.25, 0.35, 25.0, (2, 3)),
            ("prefix", 0.25, 0.3, 20.0, (3, 4)),
        ]
    )
    chosen = {measured_reduction(wider, ("prefix",), 0.46, r, None, 16).setting for r in range(3)}
    assert chosen == {(1, 2), (2, 3), (3, 4)}
    # With equal coverage the larger windows win.
    assert measured_reduction(TABLE, ("prefix",), 0.46, 0, None, 16).setting == (2, 4)


def test_below_every_floor_the_round_trains_fewer_minibatches() -> None:
    chosen = measured_reduction(TABLE, KINDS, 0.05, 0, None, 16)
    assert chosen.label == "width+steps" and chosen.setting == 0.25
    assert chosen.step_fraction == pytest.approx(0.5)
    assert chosen.predicted == pytest.approx(0.05)
    assert "below every floor" in chosen.why


def test_memory_picks_a_smaller_batch_or_a_leaner_reduction() -> None:
    # 40 MiB: the prefix window (10 + 30 MiB at batch 16) fits as it is.
    chosen = measured_reduction(TABLE, ("prefix",), 0.5, 0, 40.0, 16)
    assert chosen.setting == (2, 4) and chosen.batch_size is None
    # 25 MiB: it trains at batch 8 (10 + 30 x 8/16 = 25 MiB).
    chosen = measured_reduction(TABLE, ("prefix",), 0.5, 0, 25.0, 16)
    assert chosen.setting == (2, 4) and chosen.batch_size == 8
    assert "batch 8 to fit the memory" in chosen.why
    # A dense round that fits the time but not the memory is reduced too.
    chosen = measured_reduction(TABLE, ("width",), 1.0, 0, 60.0, 16)
    assert chosen.label == "width" and chosen.setting == 0.5
    assert measured_reduction(TABLE, KINDS, 1.0, 0, 500.0, 16) == Reduction(
        why="a dense round fits the budget"
    )


def test_measured_modes_need_costs_and_the_flop_modes_keep_their_rule() -> None:
    learner = learner_for("mlp", (64,), strategy="dadpfl", reduce="prefix")
    masks = learner.init_agent("a").masks
    with pytest.raises(ValueError, match="--reduce prefix chooses by measured costs"):
        local_reduction(learner.facts, 0.5, masks)
    assert local_reduction(learner.facts, None, masks) == NO_REDUCTION
    pruned = learner_for("mlp", (64,), strategy="dadpfl", reduce="prune")
    chosen = local_reduction(pruned.facts, 0.3, masks, costs=TABLE)
    assert chosen.label == "prune" and chosen.setting is not None


def test_windows_cover_the_layers_in_forward_order() -> None:
    layers = forward_layers(build_model("resnet18", (3, 16, 16), 10, seed=1), (3, 16, 16))
    assert layers[0].name == "stem.0" and layers[-1].name == "classifier"
    for level in (0.5, 0.3, 0.15):
        cuts = windows(layers, level)
        assert cuts[0][0] == 0 and cuts[-1][1] == len(layers)
        assert all(a[1] == b[0] for a, b in zip(cuts, cuts[1:], strict=False))
    assert len(windows(layers, 0.15)) > len(windows(layers, 0.5))


class OutOfOrder(torch.nn.Module):
    """Registers its output layer first: windows must follow the data, not the attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(8, 10)
        self.body = torch.nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def test_a_users_module_is_cut_where_its_data_flows() -> None:
    assert [layer.name for layer in forward_layers(OutOfOrder(), (4,))] == ["body", "head"]


def test_a_window_trains_its_layers_and_leaves_the_others_bit_identical() -> None:
    learner = learner_for("cnn2d", (1, 8, 8))
    layers = learner.facts.forward_layers
    window = windows(layers, 0.5)[-1]
    names = trained_names(layers, window)
    start = learner.init_agent("a").weights
    data = data_for((1, 8, 8))
    result = train_local(
        learner.facts.model,
        start,
        None,
        data.x_train,
        data.y_train,
        SGDConfig(batch_size=16, epochs=1),
        1,
        torch.Generator().manual_seed(0),
        trainable=names,
    )
    for name, tensor in result.state.items():
        changed = not torch.equal(tensor, start[name])
        assert changed == (name in names and tensor.is_floating_point()), name
    assert all(p.requires_grad for p in learner.facts.model.parameters())


def test_fewer_minibatches_when_the_step_fraction_says_so() -> None:
    learner = learner_for("mlp", (64,))
    data = data_for((64,))
    sgd = SGDConfig(batch_size=16, epochs=2)
    start = learner.init_agent("a").weights
    args = (learner.facts.model, start, None, data.x_train, data.y_train, sgd, 1)
    whole = train_local(*args, torch.Generator().manual_seed(0))
    quarter = train_local(*args, torch.Generator().manual_seed(0), step_fraction=0.25)
    assert (whole.samples, quarter.samples) == (128, 32)


def test_a_narrower_model_trains_its_channels_only() -> None:
    learner = learner_for("cnn2d", (1, 8, 8))
    start = learner.init_agent("a").weights
    data = data_for((1, 8, 8))
    trained, flops = reduced_training(
        learner.facts,
        start,
        None,
        None,
        Reduction("width", 0.5),
        data,
        1,
        torch.Generator().manual_seed(0),
    )
    dense, dense_flops = reduced_training(
        learner.facts, start, None, None, NO_REDUCTION, data, 1, torch.Generator().manual_seed(0)
    )
    assert flops < 0.5 * dense_flops
    for name, tensor in trained.state.items():
        assert tensor.shape == start[name].shape
    changed = sum(int((trained.state[n] != start[n]).sum()) for n in start)
    assert 0 < changed < sum(int((dense.state[n] != start[n]).sum()) for n in start)


def test_calibration_measures_every_level_and_is_kept_in_the_state_folder(tmp_path) -> None:
    learner = learner_for("cnn2d", (1, 8, 8), strategy="dadpfl")
    data = data_for((1, 8, 8))
    measured = cached_costs(tmp_path, learner.facts, data, ("prune", "prefix", "width"))
    kinds = {row.kind for row in measured.rows}
    assert kinds == {"prune", "prefix", "width"}
    assert measured.dense.step_s > 0 and measured.dense.activation_mb > 0
    width = {row.level: row.cost for row in measured.of_kind("width")}
    assert width[0.25].activation_mb < width[0.75].activation_mb < measured.dense.activation_mb
    kept = json.loads((tmp_path / calibration.COSTS_FILE).read_text())
    assert list(kept) == [measured.key]
    assert CostTable.from_dict(kept[measured.key]) == measured
    # Read back, not measured again (another process: nothing in memory).
    calibration._MEASURED.clear()
    assert cached_costs(tmp_path, learner.facts, data, ("prune", "prefix", "width")) == measured
    assert not calibration._MEASURED
    # Another batch size is another key: measured and kept beside the first.
    other = dataclasses.replace(learner.config, batch_size=8)
    learner.facts.config = other
    again = cached_costs(tmp_path, learner.facts, data, ("prune", "prefix", "width"))
    assert again.batch_size == 8
    assert len(json.loads((tmp_path / calibration.COSTS_FILE).read_text())) == 2


def test_an_unreadable_table_is_measured_again(tmp_path) -> None:
    learner = learner_for("mlp", (64,))
    (tmp_path / calibration.COSTS_FILE).write_text("{not json")
    measured = cached_costs(tmp_path, learner.facts, data_for((64,)), ("prefix",))
    assert {row.kind for row in measured.rows} == {"prefix"}
    with pytest.raises(ValueError, match="cost table version"):
        CostTable.from_dict({**measured.to_dict(), "version": 99})


def test_the_activation_meter_counts_one_step_without_the_weights() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 4))
    meter = ActivationMeter()
    with meter.measuring():
        for _ in range(3):
            model(torch.randn(32, 256)).sum().backward()
    # The input (32 x 256) and the hidden activations (32 x 512, once or twice), in float32:
    # well under one weight matrix (256 x 512), which is not counted.
    assert 32 * 256 * 4 <= meter.megabytes * 2**20 <= 32 * (256 + 2 * 512) * 4


def test_a_round_is_predicted_from_its_measured_share() -> None:
    costs = RoundCosts(TABLE, samples=64, epochs=2, batch_size=16, extra_steps=1, eval_samples=10)
    # 8 steps of 1 s, 1 dense step for RigL, 10 samples at 1 ms.
    assert costs.dense_s == pytest.approx(9.01)
    prefix = measured_reduction(TABLE, ("prefix",), 0.5, 0, None, 16)
    assert costs.predicted_s(prefix) == pytest.approx(8 * 0.45 + 1.01)
    steps = measured_reduction(TABLE, KINDS, 0.05, 0, None, 16)
    assert costs.predicted_s(steps) == pytest.approx(4 * 0.1 + 1.01)


def test_measure_costs_covers_the_modes_reductions() -> None:
    learner = learner_for("mlp", (64,))
    measured = measure_costs(learner.facts, data_for((64,)), kinds=("freeze", "width"))
    assert {row.kind for row in measured.rows} == {"freeze", "width"}
    assert "kinds freeze,width" in measured.key


@pytest.mark.timeout(600)
def test_an_emulated_fleet_chooses_by_measured_cost_and_reports_its_clock(
    amqtt_broker, tmp_path
) -> None:
    from agent.experiment import ExperimentConfig
    from agent.learning import preset
    from coordinator.emulate import Emulation, EmulationOptions

    cfg = ExperimentConfig(
        dataset="mnist1d",
        agents=4,
        partition="dirichlet:0.5",
        seed=7,
        profiles="mixed",
        round_time_s=0.002,
        learning=preset("dadpfl", rounds=2, neighbours=2, epochs=1, reduce="auto"),
    )
    options = EmulationOptions(workdir=tmp_path / "fleet", linger_s=20.0, agents_per_process=2)
    report = Emulation(cfg, amqtt_broker.address, options).run()
    assert report["summary"]["failed_agents"] == {}
    entries = [a for r in report["rounds"] for a in r["agents"].values()]
    for entry in entries:
        assert entry["train_s"] > 0 and entry["predicted_s"] > 0
        assert entry["peak_memory_mb"] > 0
        if entry["p_k"] < 1:
            assert entry["reduction"].split("+")[0] in ("freeze", "prefix", "width")
    assert any(entry["p_k"] < 1 for entry in entries)
    # Each agent kept its measured table in its state folder.
    for agent in ("agent-000", "agent-003"):
        kept = json.loads((tmp_path / "fleet" / agent / calibration.COSTS_FILE).read_text())
        assert "kinds checkpoint,freeze,prefix,width" in next(iter(kept))


def test_a_measured_budget_leaves_the_uncut_part_of_the_round_out() -> None:
    from agent.device import BudgetLimits, RoundWork, compute_budget, nominal_reading
    from firmware_profiles import load_profile

    board = load_profile("raspberry-pi-4")
    work = RoundWork(train_flops=1e12, fixed_flops=0.0, batch_size=16)
    limits = BudgetLimits(round_time_s=6.0)
    idle = nominal_reading(board)
    # 10 s a dense round, 2 s of it RigL's dense step and the evaluation: 4 of the 8 s fit.
    budget = compute_budget(board, idle, work, limits, measured_dense_s=10.0, measured_fixed_s=2.0)
    assert budget.p_k == pytest.approx(0.5)
    assert budget.expected_train_s == pytest.approx(6.0)


@pytest.mark.parametrize("profile", ["raspberry-pi-4", "raspberry-pi-5", "jetson-nano"])
def test_an_emulated_board_cut_to_its_budget_takes_its_round_time(profile) -> None:
    """The board's clock for a reduction whose measured step share is p_k meets the round
    time its budget planned with (RigL's dense step is not scaled by the share)."""
    from agent.device import BudgetLimits, Throttle, compute_budget, nominal_reading
    from firmware_profiles import load_profile

    board = load_profile(profile)
    learner = learner_for("cnn2d", (1, 8, 8), strategy="dadpfl", rigl_batches=1)
    from agent.device.budget import RoundWork

    work = RoundWork.for_model(
        learner.facts.model, (1, 8, 8), samples=400, epochs=5, batch_size=16, dense_grad_samples=16
    )
    dense_s = (work.fixed_flops + work.train_flops) / (board.peak_fp32_gflops * 0.1e9)
    limits = BudgetLimits(round_time_s=0.6 * dense_s)
    budget = compute_budget(board, nominal_reading(board), work, limits)
    assert budget.p_k < 0.6
    share = measured_reduction(TABLE, KINDS, budget.p_k, 0, None, 16).predicted
    assert share is not None and share <= budget.p_k
    board_s = Throttle(board).board_seconds(work.fixed_flops, work.train_flops, share)
    assert board_s <= limits.round_time_s
