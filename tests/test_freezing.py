"""FedSPU neuron freezing: groups, active masks, frozen training, exchange and dropout."""

from __future__ import annotations

import hashlib
import math

import pytest
import torch
from torch import nn

from agent.learning import sparse
from agent.learning.config import SGDConfig
from agent.learning.freezing import (
    NeuronGroup,
    active_masks,
    active_unit_count,
    aggregate_active,
    freezing_plan,
    neuron_groups,
    overwrite_active,
    submodel,
)
from agent.learning.models import (
    MLP,
    build_model,
    flops_from_positions,
    output_positions,
    prunable_names,
)
from agent.learning.training import train_local

BUNDLED = [
    ("mlp", (1, 40)),
    ("cnn1d", (1, 40)),
    ("mlp", (1, 8, 8)),
    ("cnn2d", (1, 8, 8)),
    ("resnet18", (3, 32, 32)),
    ("vgg11", (3, 32, 32)),
    ("alexnet", (3, 32, 32)),
    ("cnn2d", (3, 32, 32)),
]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_mlp_groups_are_its_hidden_layers() -> None:
    groups = neuron_groups(build_model("mlp", (1, 40), 10, seed=0))
    assert groups == [
        NeuronGroup("net.1", 128, ("net.1.weight", "net.1.bias"), "net.3.weight", 1),
        NeuronGroup("net.3", 64, ("net.3.weight", "net.3.bias"), "net.5.weight", 1),
    ]


def test_cnn1d_groups_include_the_norm_and_the_flatten_factor() -> None:
    # 40 -> 20 -> 10 -> 5 positions: the last conv's channel c feeds features 5c .. 5c + 4.
    groups = neuron_groups(build_model("cnn1d", (1, 40), 10, seed=0))
    norm = ("features.{}.weight", "features.{}.weight", "features.{}.bias")
    assert groups == [
        NeuronGroup(
            f"features.{conv}",
            32,
            tuple(n.format(i) for n, i in zip(norm, (conv, conv + 1, conv + 1), strict=True)),
            consumer,
            expansion,
        )
        for conv, consumer, expansion in (
            (0, "features.3.weight", 1),
            (3, "features.6.weight", 1),
            (6, "classifier.weight", 5),
        )
    ]


def test_resnet18_freezes_only_the_block_conv1_channels() -> None:
    model = build_model("resnet18", (3, 32, 32), 10, seed=0)
    groups = neuron_groups(model)
    widths = (64, 64, 128, 128, 256, 256, 512, 512)
    assert [(g.name, g.size, g.consumer, g.expansion) for g in groups] == [
        (f"layers.{i}.conv1", w, f"layers.{i}.conv2.weight", 1) for i, w in enumerate(widths)
    ]
    assert groups[3].unit_params == (
        "layers.3.conv1.weight",
        "layers.3.norm1.weight",
        "layers.3.norm1.bias",
    )
    masks = active_masks(groups, _state(model), 0.5, torch.Generator().manual_seed(0))
    grouped = {p for g in groups for p in (*g.unit_params, g.consumer)}
    assert all(bool(m.all()) for n, m in masks.items() if n not in grouped)  # stem, shortcuts
    units = masks["layers.3.norm1.weight"]
    assert int(units.sum()) == 64
    conv2 = masks["layers.3.conv2.weight"]  # its outputs are residual: only inputs are masked
    assert torch.equal(conv2, units[None, :, None, None].expand_as(conv2))


@pytest.mark.parametrize("name, shape", BUNDLED)
def test_groups_fit_every_bundled_model(name: str, shape: tuple[int, ...]) -> None:
    model = build_model(name, shape, 10, seed=0)
    state = _state(model)
    groups = neuron_groups(model)
    assert groups
    for group in groups:
        assert all(state[p].shape[0] == group.size for p in group.unit_params)
        assert state[group.consumer].shape[1] == group.size * group.expansion
    masks = active_masks(groups, state, 0.3, torch.Generator().manual_seed(1))
    assert {n: m.shape for n, m in masks.items()} == {n: t.shape for n, t in state.items()}
    # Input channels and class neurons are always active.
    first, last = prunable_names(model)[0], prunable_names(model)[-1]
    assert bool(masks[first].any(dim=0).all()) and bool(masks[last].any(dim=1).all())
    # The weight masks go straight into FLOP counting.
    weights = {n: masks[n] for n in prunable_names(model)}
    shapes = {n: tuple(state[n].shape) for n in weights}
    positions = output_positions(model, shape)
    assert flops_from_positions(positions, shapes, weights) < flops_from_positions(
        positions, shapes
    )


# The groups of the bundled models as the registration-order walk inferred them before
# torch.fx did, (name, size, unit_params, consumer, expansion) in forward order, and a digest
# of active_masks(model, state, 0.3, seed 5) then: the fx inference must change neither (the
# identity benchmark draws these masks).
OLD_GROUPS = {
    ("mlp", (1, 40)): (
        "d34084eba9d11521",
        [
            ("net.1", 128, ("net.1.weight", "net.1.bias"), "net.3.weight", 1),
            ("net.3", 64, ("net.3.weight", "net.3.bias"), "net.5.weight", 1),
        ],
    ),
    ("mlp", (64,)): (
        "ee1af0964fe53a87",
        [
            ("net.1", 128, ("net.1.weight", "net.1.bias"), "net.3.weight", 1),
            ("net.3", 64, ("net.3.weight", "net.3.bias"), "net.5.weight", 1),
        ],
    ),
    ("mlp", (1, 8, 8)): (
        "ee1af0964fe53a87",
        [
            ("net.1", 128, ("net.1.weight", "net.1.bias"), "net.3.weight", 1),
            ("net.3", 64, ("net.3.weight", "net.3.bias"), "net.5.weight", 1),
        ],
    ),
    ("cnn1d", (1, 40)): (
        "f93578d808eaa3d6",
        [
            (
                "features.0",
                32,
                ("features.0.weight", "features.1.weight", "features.1.bias"),
                "features.3.weight",
                1,
            ),
            (
                "features.3",
                32,
                ("features.3.weight", "features.4.weight", "features.4.bias"),
                "features.6.weight",
                1,
            ),
            (
                "features.6",
                32,
                ("features.6.weight", "features.7.weight", "features.7.bias"),
                "classifier.weight",
                5,
            ),
        ],
    ),
    ("cnn2d", (1, 8, 8)): (
        "7cbd94b07e013382",
        [
            (
                "features.0",
                16,
                ("features.0.weight", "features.1.weight", "features.1.bias"),
                "features.4.weight",
                1,
            ),
            (
                "features.4",
                32,
                ("features.4.weight", "features.5.weight", "features.5.bias"),
                "classifier.weight",
                4,
            ),
        ],
    ),
    ("cnn2d", (3, 32, 32)): (
        "53d059ec3fd9bb1f",
        [
            (
                "features.0",
                16,
                ("features.0.weight", "features.1.weight", "features.1.bias"),
                "features.4.weight",
                1,
            ),
            (
                "features.4",
                32,
                ("features.4.weight", "features.5.weight", "features.5.bias"),
                "classifier.weight",
                64,
            ),
        ],
    ),
    ("resnet18", (3, 32, 32)): (
        "e8cf1aa840f42a02",
        [
            (
                "layers.0.conv1",
                64,
                ("layers.0.conv1.weight", "layers.0.norm1.weight", "layers.0.norm1.bias"),
                "layers.0.conv2.weight",
                1,
            ),
            (
                "layers.1.conv1",
                64,
                ("layers.1.conv1.weight", "layers.1.norm1.weight", "layers.1.norm1.bias"),
                "layers.1.conv2.weight",
                1,
            ),
            (
                "layers.2.conv1",
                128,
                ("layers.2.conv1.weight", "layers.2.norm1.weight", "layers.2.norm1.bias"),
                "layers.2.conv2.weight",
                1,
            ),
            (
                "layers.3.conv1",
                128,
                ("layers.3.conv1.weight", "layers.3.norm1.weight", "layers.3.norm1.bias"),
                "layers.3.conv2.weight",
                1,
            ),
            (
                "layers.4.conv1",
                256,
                ("layers.4.conv1.weight", "layers.4.norm1.weight", "layers.4.norm1.bias"),
                "layers.4.conv2.weight",
                1,
            ),
            (
                "layers.5.conv1",
                256,
                ("layers.5.conv1.weight", "layers.5.norm1.weight", "layers.5.norm1.bias"),
                "layers.5.conv2.weight",
                1,
            ),
            (
                "layers.6.conv1",
                512,
                ("layers.6.conv1.weight", "layers.6.norm1.weight", "layers.6.norm1.bias"),
                "layers.6.conv2.weight",
                1,
            ),
            (
                "layers.7.conv1",
                512,
                ("layers.7.conv1.weight", "layers.7.norm1.weight", "layers.7.norm1.bias"),
                "layers.7.conv2.weight",
                1,
            ),
        ],
    ),
    ("vgg11", (3, 32, 32)): (
        "1d04619bfb5d8657",
        [
            (
                "features.0",
                64,
                ("features.0.weight", "features.1.weight", "features.1.bias"),
                "features.4.weight",
                1,
            ),
            (
                "features.4",
                128,
                ("features.4.weight", "features.5.weight", "features.5.bias"),
                "features.8.weight",
                1,
            ),
            (
                "features.8",
                256,
                ("features.8.weight", "features.9.weight", "features.9.bias"),
                "features.11.weight",
                1,
            ),
            (
                "features.11",
                256,
                ("features.11.weight", "features.12.weight", "features.12.bias"),
                "features.15.weight",
                1,
            ),
            (
                "features.15",
                512,
                ("features.15.weight", "features.16.weight", "features.16.bias"),
                "features.18.weight",
                1,
            ),
            (
                "features.18",
                512,
                ("features.18.weight", "features.19.weight", "features.19.bias"),
                "features.22.weight",
                1,
            ),
            (
                "features.22",
                512,
                ("features.22.weight", "features.23.weight", "features.23.bias"),
                "features.25.weight",
                1,
            ),
            (
                "features.25",
                512,
                ("features.25.weight", "features.26.weight", "features.26.bias"),
                "classifier.weight",
                1,
            ),
        ],
    ),
    ("alexnet", (3, 32, 32)): (
        "9c686abd3313ec19",
        [
            (
                "features.0",
                64,
                ("features.0.weight", "features.1.weight", "features.1.bias"),
                "features.4.weight",
                1,
            ),
            (
                "features.4",
                192,
                ("features.4.weight", "features.5.weight", "features.5.bias"),
                "features.8.weight",
                1,
            ),
            (
                "features.8",
                384,
                ("features.8.weight", "features.9.weight", "features.9.bias"),
                "features.11.weight",
                1,
            ),
            (
                "features.11",
                256,
                ("features.11.weight", "features.12.weight", "features.12.bias"),
                "features.14.weight",
                1,
            ),
            (
                "features.14",
                256,
                ("features.14.weight", "features.15.weight", "features.15.bias"),
                "classifier.1.weight",
                4,
            ),
            (
                "classifier.1",
                4096,
                ("classifier.1.weight", "classifier.1.bias"),
                "classifier.4.weight",
                1,
            ),
            (
                "classifier.4",
                4096,
                ("classifier.4.weight", "classifier.4.bias"),
                "classifier.6.weight",
                1,
            ),
        ],
    ),
}


def _digest(masks: sparse.Masks) -> str:
    h = hashlib.sha256()
    for name in sorted(masks):
        h.update(name.encode())
        h.update(masks[name].numpy().tobytes())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("name, shape", list(OLD_GROUPS))
@pytest.mark.parametrize("with_shape", [False, True])
def test_bundled_groups_and_masks_are_those_of_the_registration_order_walk(
    name: str, shape: tuple[int, ...], with_shape: bool
) -> None:
    model = build_model(name, shape, 10, seed=0)
    digest, expected = OLD_GROUPS[(name, shape)]
    groups = neuron_groups(model, shape if with_shape else None)
    assert [(g.name, g.size, g.unit_params, g.consumer, g.expansion) for g in groups] == expected
    plan = freezing_plan(model, shape if with_shape else None)
    assert plan.groups == tuple(groups) and plan.layers == () and plan.note is None
    for given in (plan, model, groups):
        masks = active_masks(given, _state(model), 0.3, torch.Generator().manual_seed(5))
        assert _digest(masks) == digest


def test_a_chain_whose_shapes_do_not_connect_is_rejected() -> None:
    with pytest.raises(ValueError, match="reads 6 inputs"):
        neuron_groups(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(6, 2)))
    with pytest.raises(ValueError, match="does not run on a batch of input shape"):
        neuron_groups(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(6, 2)), (3,))


def test_batchnorm_after_a_linear_layer_needs_the_input_shape() -> None:
    # Without shapes the rank of a linear layer's output is unknown, so BatchNorm1d might
    # normalize another dim than its features: no group rather than a guess.
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    assert neuron_groups(model) == []
    assert neuron_groups(model, (3,)) == [
        NeuronGroup(
            "0",
            4,
            ("0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var"),
            "2.weight",
        )
    ]


@pytest.mark.parametrize(
    "size, fraction, expected",
    [(128, 0.5, 64), (100, 0.29, 29), (5, 0.1, 1), (32, 0.2, 6), (7, 1.0, 7), (1, 0.01, 1)],
)
def test_active_unit_count_is_max_one_floor(size: int, fraction: float, expected: int) -> None:
    assert active_unit_count(size, fraction) == expected


def test_tiny_mlp_masks_follow_the_both_ends_rule_by_hand() -> None:
    model = MLP((3,), 2, hidden=(4, 3))  # 3 inputs -> 4 -> 3 -> 2 classes
    state = _state(model)
    masks = active_masks(model, state, 0.5, torch.Generator().manual_seed(7))
    first, second = masks["net.1.bias"], masks["net.3.bias"]
    assert int(first.sum()) == 2 and int(second.sum()) == 1  # floor(0.5*4), max(1, floor(1.5))
    # A weight is active iff both neurons it connects are; inputs and classes always are.
    assert torch.equal(masks["net.1.weight"], first[:, None].expand(4, 3))
    assert torch.equal(masks["net.3.weight"], second[:, None] & first[None, :])
    assert torch.equal(masks["net.5.weight"], second[None, :].expand(2, 3))
    assert bool(masks["net.5.bias"].all())
    assert [int(masks[n].sum()) for n in ("net.1.weight", "net.3.weight", "net.5.weight")] == [
        6,
        2,
        2,
    ]


def test_each_group_draws_its_own_uniform_subset() -> None:
    model = build_model("cnn1d", (1, 40), 10, seed=0)
    state = _state(model)
    draws = [active_masks(model, state, 0.25, torch.Generator().manual_seed(s)) for s in range(20)]
    chosen = [[m[f"features.{i}.weight"] for i in (1, 4, 7)] for m in draws]  # norms
    assert all(int(c.sum()) == 8 for per_group in chosen for c in per_group)
    assert not torch.equal(chosen[0][0], chosen[0][1])  # groups are drawn independently
    hits = torch.stack([per_group[0] for per_group in chosen]).sum(0)
    assert int((hits > 0).sum()) > 24  # not the same 8 channels every round


def test_masks_are_a_function_of_the_generator_seed() -> None:
    model = build_model("cnn1d", (1, 40), 10, seed=0)
    state = _state(model)
    a, b, c = (active_masks(model, state, 0.4, torch.Generator().manual_seed(s)) for s in (3, 3, 4))
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert any(not torch.equal(a[n], c[n]) for n in a)


def test_fraction_one_keeps_everything_active() -> None:
    model = build_model("cnn1d", (1, 40), 10, seed=0)
    masks = active_masks(model, _state(model), 1.0, torch.Generator().manual_seed(0))
    assert all(m.dtype == torch.bool and bool(m.all()) for m in masks.values())


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.01, math.nan])
def test_a_fraction_outside_zero_one_is_rejected(fraction: float) -> None:
    model = build_model("mlp", (1, 40), 10, seed=0)
    with pytest.raises(ValueError, match="fraction"):
        active_masks(model, _state(model), fraction, torch.Generator())


def test_frozen_entries_are_bit_identical_after_training() -> None:
    model = build_model("cnn1d", (1, 40), 10, seed=0)
    state = _state(model)
    active = active_masks(model, state, 0.5, torch.Generator().manual_seed(2))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 1, 40, generator=g), torch.randint(0, 10, (32,), generator=g)
    config = SGDConfig(lr=0.5, momentum=0.9, weight_decay=0.01, batch_size=8, epochs=2)

    def train(frozen: sparse.Masks | None) -> sparse.State:
        seed = torch.Generator().manual_seed(1)
        return train_local(model, state, None, x, y, config, 1, seed, frozen=frozen).state

    frozen, free = train(active), train(None)
    for name, mask in active.items():
        assert torch.equal(_bits(frozen[name][~mask]), _bits(state[name][~mask])), name
        assert bool((frozen[name][mask] != state[name][mask]).all()), name
        assert bool((free[name][~mask] != state[name][~mask]).all()), name  # would have moved


def test_overwrite_active_takes_global_values_only_where_active() -> None:
    personal = {"w": torch.tensor([1.0, 2.0, 3.0]), "b": torch.tensor([4.0])}
    global_ = {"w": torch.tensor([10.0, 20.0, 30.0]), "b": torch.tensor([40.0])}
    active = {"w": torch.tensor([True, False, True]), "b": torch.tensor([False])}
    out = overwrite_active(personal, global_, active)
    assert torch.equal(out["w"], torch.tensor([10.0, 2.0, 30.0]))
    assert torch.equal(out["b"], torch.tensor([4.0]))
    assert torch.equal(personal["w"], torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(global_["w"], torch.tensor([10.0, 20.0, 30.0]))
    out["b"] += 1
    assert personal["b"].item() == 4.0


def test_aggregate_active_averages_over_the_agents_that_trained_each_element() -> None:
    previous = {"w": torch.tensor([0.0, 0.0, 0.0, 5.0]), "b": torch.tensor([9.0])}
    nan = math.nan  # an inactive position's value must never matter
    updates = {
        "c": (
            {"w": torch.tensor([nan, 8.0, 9.0, 300.0]), "b": torch.tensor([3.0])},
            {"w": torch.tensor([False, True, True, False]), "b": torch.tensor([True])},
        ),
        "a": (
            {"w": torch.tensor([1.0, 2.0, nan, 100.0]), "b": torch.tensor([1.0])},
            {"w": torch.tensor([True, True, False, False]), "b": torch.tensor([True])},
        ),
        "b": (
            {"w": torch.tensor([4.0, nan, 6.0, 200.0]), "b": torch.tensor([2.0])},
            {"w": torch.tensor([True, False, True, False]), "b": torch.tensor([True])},
        ),
    }
    weights = {"a": 1.0, "b": 2.0, "c": 3.0}
    out = aggregate_active(previous, updates, weights)
    # (1*1 + 2*4)/3, (1*2 + 3*8)/4, (2*6 + 3*9)/5, nobody: previous 5; b: (1 + 4 + 9)/6.
    expected_w = torch.tensor([3.0, 6.5, 7.8, 5.0], dtype=torch.float64).to(torch.float32)
    assert torch.equal(out["w"], expected_w)
    assert torch.equal(out["b"], torch.tensor([14.0 / 6.0]))
    assert out["w"].dtype == torch.float32
    reordered = aggregate_active(previous, dict(reversed(updates.items())), weights)
    assert all(torch.equal(_bits(out[n]), _bits(reordered[n])) for n in out)


def test_aggregate_active_with_all_active_masks_is_fedavg_bit_for_bit() -> None:
    # float64 values of mixed magnitudes, so a different summation order shows in the bits;
    # the updates arrive out of id order.
    g = torch.Generator().manual_seed(0)
    ids = ["q", "c", "x", "a", "m"]
    states = {
        i: {"w": torch.randn(200, generator=g, dtype=torch.float64) * 10.0 ** (3 * k)}
        for k, i in enumerate(ids)
    }
    weights = dict(zip(ids, (17.0, 5.0, 40.0, 3.0, 11.0), strict=True))
    full = {"w": torch.ones(200, dtype=torch.bool)}
    previous = {"w": torch.zeros(200, dtype=torch.float64)}
    out = aggregate_active(previous, {i: (states[i], full) for i in ids}, weights)
    expected = sparse.aggregate_weighted(states, weights)["w"]
    assert torch.equal(out["w"].view(torch.int64), expected.view(torch.int64))


def test_aggregate_active_keeps_the_previous_value_bit_for_bit_where_nobody_trained() -> None:
    previous = {"w": torch.tensor([-0.0, 1e-40, 3.3])}
    none = {"w": torch.zeros(3, dtype=torch.bool)}
    out = aggregate_active(previous, {"a": ({"w": torch.ones(3)}, none)}, {"a": 4.0})
    assert torch.equal(_bits(out["w"]), _bits(previous["w"]))
    with pytest.raises(ValueError, match="non-negative"):
        aggregate_active(previous, {"a": ({"w": torch.ones(3)}, none)}, {"a": -1.0})


def _normalized_outputs(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """The GroupNorm outputs of one forward pass, in order."""
    outputs: list[torch.Tensor] = []
    norms = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
    handles = [m.register_forward_hook(lambda _m, _i, out: outputs.append(out)) for m in norms]
    with torch.no_grad():
        model(x)
    for handle in handles:
        handle.remove()
    return outputs


def test_a_dropped_channel_outputs_zero_only_with_its_norm_parameters_zeroed() -> None:
    model = build_model("cnn2d", (1, 8, 8), 10, seed=0)
    state = _state(model)
    groups = neuron_groups(model)
    active = active_masks(groups, state, 0.5, torch.Generator().manual_seed(0))
    x = torch.randn(16, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    dropped = [~active[g.unit_params[1]] for g in groups]  # the norm weights' channel masks

    model.load_state_dict(submodel(state, active))
    for out, off in zip(_normalized_outputs(model, x), dropped, strict=True):
        assert bool((out[:, off] == 0).all()) and bool((out[:, ~off] != 0).any())
    # The classifier columns masked off are exactly the flattened features of the dropped
    # channels, which are all zero (channel-major flatten, 2x2 positions per channel).
    features = model.features(x).flatten(1)
    columns = ~active["classifier.weight"].all(dim=0)
    assert torch.equal(columns, dropped[-1].repeat_interleave(4))
    assert bool((features[:, columns] == 0).all())

    # Zeroing the conv rows alone is not enough: GroupNorm maps the zero channel to
    # -mean / std * gamma + beta, nonzero for the initial gamma = 1.
    rows_only = {n: t.clone() for n, t in state.items()}
    for group, off in zip(groups, dropped, strict=True):
        rows_only[group.unit_params[0]][off] = 0.0
    model.load_state_dict(rows_only)
    for out, off in zip(_normalized_outputs(model, x), dropped, strict=True):
        assert bool((out[:, off] != 0).any())


def test_submodel_zeroes_inactive_entries_into_new_tensors() -> None:
    state = {"w": torch.tensor([[1.0, -2.0], [3.0, 4.0]])}
    out = submodel(state, {"w": torch.tensor([[True, False], [False, True]])})
    assert torch.equal(out["w"], torch.tensor([[1.0, 0.0], [0.0, 4.0]]))
    assert state["w"][0, 1].item() == -2.0
