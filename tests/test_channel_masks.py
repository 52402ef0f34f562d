"""Channel-level DA-DPFL (`--mask-unit channel`, agent/learning/channels.py): masks that keep
whole channels, so the model an agent trains is really narrower; every rule of the algorithm
(initial masks, RigL, PQI, the budget's cap) keeps them whole, and the full masked model
computes what the narrow one does."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor, nn

from agent.device.calibration import measure_costs
from agent.experiment import ExperimentConfig
from agent.learning import channels, models, sparse, width
from agent.learning.config import SGDConfig, preset
from agent.learning.learner import Learner, LocalData
from agent.learning.reduced import reduced_training
from agent.learning.reduction import NO_REDUCTION
from agent.learning.sparse import State
from agent.learning.training import train_local

SHAPES = {"mlp": (64,), "cnn1d": (1, 40), "cnn2d": (1, 8, 8), "resnet18": (3, 16, 16)}


def learner_for(name: str, **overrides: object) -> Learner:
    shape = SHAPES[name]
    model = models.build_model(name, shape, 10, seed=3)
    config = preset("dadpfl", mask_unit="channel", **overrides)
    return Learner(model, shape, models.prunable_names(model), config, seed=3)


def first_agent(name: str) -> tuple[Learner, channels.ChannelPlan, dict[str, Tensor], State]:
    """A learner with channel masks, its first agent's masks and masked initial weights."""
    learner = learner_for(name)
    masks = learner.initial_masks("agent-1")
    assert masks is not None
    return (
        learner,
        learner.facts.channel_plan,
        masks,
        sparse.apply_masks(learner.facts.initial, masks),
    )


def blocks_of(learner: Learner, masks: dict[str, Tensor]) -> list[int]:
    return [int(k.sum()) for k in channels.kept_blocks(learner.facts.channel_plan, masks)]


def is_structured(learner: Learner, masks: dict[str, Tensor]) -> bool:
    plan = learner.facts.channel_plan
    rebuilt = channels.masks_of(plan, channels.kept_blocks(plan, masks))
    return all(torch.equal(rebuilt[name], mask) for name, mask in masks.items())


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_the_masked_model_computes_what_the_narrow_model_does(name: str) -> None:
    learner = learner_for(name)
    plan = learner.facts.channel_plan
    masks = learner.initial_masks("agent-1")
    assert masks is not None and is_structured(learner, masks)
    assert 0.3 < 1 - sparse.sparsity(masks) <= 0.5
    weights = sparse.apply_masks(learner.facts.initial, masks)
    chosen = channels.selection(plan, masks)
    narrow = width.narrow_model(learner.facts.model, plan.width, chosen)
    narrow.load_state_dict(width.narrow_state(weights, plan.width, chosen))
    small = sum(p.numel() for p in narrow.parameters())
    assert small < 0.75 * sum(p.numel() for p in learner.facts.model.parameters())
    learner.facts.model.load_state_dict(weights)
    x = torch.randn(5, *SHAPES[name])
    learner.facts.model.eval()
    narrow.eval()
    torch.testing.assert_close(learner.facts.model(x), narrow(x), atol=1e-5, rtol=1e-4)
    # the growth gradients' weights: dropped neurons fed at w0 change nothing downstream
    revived = channels.revived(plan, weights, learner.facts.initial, masks)
    assert any(not torch.equal(revived[n], weights[n]) for n in masks)
    learner.facts.model.load_state_dict(revived)
    torch.testing.assert_close(learner.facts.model(x), narrow(x), atol=1e-5, rtol=1e-4)


def test_agents_draw_their_own_channels_from_the_fleet_seed() -> None:
    learner = learner_for("cnn2d")
    a, b = learner.initial_masks("agent-1"), learner.initial_masks("agent-2")
    assert a is not None and b is not None
    assert blocks_of(learner, a) == blocks_of(learner, b)
    assert any(not torch.equal(a[n], b[n]) for n in a)
    again = learner_for("cnn2d").initial_masks("agent-1")
    assert again is not None and all(torch.equal(a[n], again[n]) for n in a)


def test_rigl_swaps_whole_blocks_and_regrown_ones_start_afresh() -> None:
    learner = learner_for("mlp")
    plan = learner.facts.channel_plan
    masks = learner.initial_masks("agent-1")
    assert masks is not None
    trained = {
        n: t * (1.5 if n in masks else 1.0) + 0.01
        for n, t in sparse.apply_masks(learner.facts.initial, masks).items()
    }
    weights = sparse.apply_masks(trained, masks)
    # the first hidden neuron kept is made the weakest: RigL drops it
    kept = channels.kept_blocks(plan, masks)
    weakest = int(torch.nonzero(kept[0])[0])
    weights["net.1.weight"][weakest] = 1e-6
    grads = {n: torch.ones_like(weights[n]) for n in masks}
    new_weights, new_masks = channels.rigl_update(
        plan, weights, masks, grads, learner.facts.initial, alpha=0.15
    )
    new_kept = channels.kept_blocks(plan, new_masks)
    assert is_structured(learner, new_masks)
    assert blocks_of(learner, new_masks) == blocks_of(learner, masks)
    assert not bool(new_kept[0][weakest])
    regrown = torch.nonzero(new_kept[0] & ~kept[0]).flatten()
    assert len(regrown) == int(0.15 * int(kept[0].sum()))
    for name, mask in new_masks.items():
        assert not bool(new_weights[name][~mask].any())
        fresh = mask & ~masks[name]
        assert torch.equal(new_weights[name][fresh], learner.facts.initial[name][fresh])
        stayed = mask & masks[name]
        assert torch.equal(new_weights[name][stayed], weights[name][stayed])


def test_growth_prefers_the_neuron_whose_readers_have_the_largest_gradient() -> None:
    learner = learner_for("mlp")
    plan = learner.facts.channel_plan
    masks = learner.initial_masks("agent-1")
    assert masks is not None
    kept = channels.kept_blocks(plan, masks)
    dropped = torch.nonzero(~kept[0]).flatten()
    wanted = int(dropped[-1])
    grads = {n: torch.zeros_like(t) for n, t in masks.items()}
    grads["net.3.weight"][:, wanted] = 1.0  # the second layer reads the first's neurons
    _, new = channels.rigl_update(
        plan,
        sparse.apply_masks(learner.facts.initial, masks),
        masks,
        grads,
        learner.facts.initial,
        0.15,
    )
    assert bool(channels.kept_blocks(plan, new)[0][wanted])


def test_pqi_drops_whole_blocks_and_never_passes_the_target_sparsity() -> None:
    learner, plan, masks, weights = first_agent("cnn1d")
    for name in masks:  # very unequal neurons: PQI wants to drop most of them
        scale = torch.logspace(-4, 0, weights[name].shape[0]).view(
            -1, *[1] * (weights[name].dim() - 1)
        )
        weights[name] = weights[name] * scale
    count = channels.pqi_counter(0.5, 1.0, 0.0, 1.0, 0.9)
    pruned = channels.pqi_prune(plan, weights, masks, count, target_sparsity=0.8)
    assert is_structured(learner, pruned)
    assert sparse.sparsity(masks) < sparse.sparsity(pruned) <= 0.8
    between = (sparse.sparsity(masks) + sparse.sparsity(pruned)) / 2
    tight = channels.pqi_prune(plan, weights, masks, count, target_sparsity=between)
    assert sparse.sparsity(masks) < sparse.sparsity(tight) <= between
    assert all(k >= 1 for k in blocks_of(learner, pruned))


def test_the_budgets_cap_keeps_the_strongest_channels() -> None:
    learner, plan, masks, weights = first_agent("cnn2d")
    capped = channels.prune_to_density(plan, weights, masks, 0.2)
    assert is_structured(learner, capped)
    assert 0.1 < 1 - sparse.sparsity(capped) <= 0.2
    norms = channels.weight_norms(plan, weights)
    for norm, before, after in zip(
        norms,
        channels.kept_blocks(plan, masks),
        channels.kept_blocks(plan, capped),
        strict=True,
    ):
        assert bool((after <= before).all())
        if bool((before & ~after).any()):
            assert float(norm[before & ~after].max()) <= float(norm[after].min())
    same = channels.prune_to_density(plan, weights, masks, 0.9)
    assert all(torch.equal(same[n], masks[n]) for n in masks)


def test_a_round_trains_the_narrow_model_as_the_masked_one_would() -> None:
    """Training the narrower model gives the kept weights what masked-dense training of the
    full model gives them (to float error): the channel variant is the same algorithm, only
    the zeros are not computed."""
    learner = learner_for("cnn2d", epochs=1, batch_size=16)
    masks = learner.initial_masks("agent-1")
    assert masks is not None
    start = sparse.apply_masks(learner.facts.initial, masks)
    x, y = torch.randn(48, 1, 8, 8), torch.randint(0, 10, (48,))
    data = LocalData(x, y, x[:4], y[:4], x[:4], y[:4])
    narrow, flops = reduced_training(
        learner.facts, start, masks, None, NO_REDUCTION, data, 0, torch.Generator().manual_seed(1)
    )
    dense = train_local(
        learner.facts.model,
        start,
        masks,
        x,
        y,
        learner.facts.sgd,
        0,
        torch.Generator().manual_seed(1),
    )
    assert flops == 3 * learner.facts.forward_flops(masks) * 48
    for name, mask in masks.items():
        assert not bool(narrow.state[name][~mask].any())
        torch.testing.assert_close(narrow.state[name][mask], dense.state[name][mask])
    assert narrow.mean_loss == pytest.approx(dense.mean_loss, rel=1e-5)


def test_a_simulated_fleet_keeps_its_masks_whole_and_its_budget_cap_real() -> None:
    from coordinator.simulate import simulate

    config = ExperimentConfig(
        dataset="digits",
        agents=4,
        learning=preset("dadpfl", mask_unit="channel", rounds=3, epochs=1, neighbours=2),
    )
    report = simulate(config)
    records = [a for r in report["rounds"] for a in r["agents"].values()]
    assert len(records) == 12
    assert all(0.5 <= a["sparsity"] < 0.7 for a in records)
    assert report["summary"]["mean_accuracy"] > 0.2


def test_calibration_measures_channel_masks_at_every_density() -> None:
    learner = learner_for("cnn2d", batch_size=16)
    x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))
    table = measure_costs(
        learner.facts, LocalData(x, y, x[:2], y[:2], x[:2], y[:2]), kinds=("prune",)
    )
    rows = table.of_kind("prune")
    assert [r.level for r in rows] == [0.5, 0.35, 0.2, 0.1]
    memory = [r.cost.peak_mb for r in rows]
    assert memory == sorted(memory, reverse=True) and memory[-1] < 0.5 * memory[0]


class Normalized(nn.Module):
    """A user's module whose only hidden channels are normalized across (LayerNorm)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 12)
        self.norm = nn.LayerNorm(12)
        self.out = nn.Linear(12, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.relu(self.norm(self.fc(x))))


def test_a_model_without_channels_to_drop_is_refused_in_one_line() -> None:
    model = Normalized()
    config = preset("dadpfl", mask_unit="channel")
    with pytest.raises(ValueError, match=r"^--mask-unit channel: .*no channel to drop") as info:
        Learner(model, (6,), models.prunable_names(model), config, seed=1)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"strategy": "fedavg"}, "for the sparse strategies"),
        ({"strategy": "dfedavgm"}, "for the sparse strategies"),
        ({"reduce": "width"}, "--reduce prune"),
        ({"mask_unit": "neuron"}, "--mask-unit must be one of weight, channel"),
    ],
)
def test_impossible_channel_options_are_refused(overrides: dict[str, str], message: str) -> None:
    strategy = overrides.pop("strategy", "dadpfl")
    learning = dataclasses.replace(preset(strategy), **{"mask_unit": "channel", **overrides})
    with pytest.raises(ValueError, match=message):
        ExperimentConfig(dataset="digits", agents=8, learning=learning).validate()


def test_the_default_stays_the_papers_weight_masks() -> None:
    assert preset("dadpfl").mask_unit == "weight"
    # The paper's SGD with momentum and clipping (bench/learning_quality.py measured both)
    assert preset("dadpfl").local_training() == SGDConfig(momentum=0.9, clip_norm=2.0)


def test_a_device_serves_the_narrow_model_and_it_answers_as_the_masked_one(tmp_path) -> None:
    from agent.learning.learner import served_model
    from agent.onnx_export import export_onnx
    from agent.onnx_model import OnnxModel

    learner = learner_for("cnn2d")
    masks = learner.initial_masks("agent-1")
    assert masks is not None
    weights = sparse.apply_masks(learner.facts.initial, masks)
    model, state = served_model(learner, weights, masks)
    assert sum(t.numel() for t in state.values()) < 0.7 * sum(t.numel() for t in weights.values())
    path = export_onnx(model, state, SHAPES["cnn2d"], tmp_path / "model.onnx")
    x = torch.randn(6, *SHAPES["cnn2d"])
    learner.facts.model.load_state_dict(weights)
    learner.facts.model.eval()
    with torch.no_grad():
        want = learner.facts.model(x).numpy()
    got = OnnxModel.load(path, threads=1).predict(x.numpy())
    assert abs(got - want).max() < 1e-4
