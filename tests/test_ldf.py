"""FedLDF layer grouping, divergences, per-layer selection and aggregation
(agent/learning/ldf.py)."""

from __future__ import annotations

import math

import pytest
import torch

from agent.learning import build_model, ldf, sparse

SHAPES = {
    "mlp": (1, 40),
    "cnn1d": (1, 40),
    "cnn2d": (1, 8, 8),
    "resnet18": (3, 32, 32),
    "vgg11": (3, 32, 32),
    "alexnet": (3, 32, 32),
}


def test_cnn1d_groups_by_hand() -> None:
    groups = ldf.layer_groups(build_model("cnn1d", (1, 40), 10, seed=0))
    assert groups == {
        "features.0": ["features.0.weight", "features.1.weight", "features.1.bias"],
        "features.3": ["features.3.weight", "features.4.weight", "features.4.bias"],
        "features.6": ["features.6.weight", "features.7.weight", "features.7.bias"],
        "classifier": ["classifier.weight", "classifier.bias"],
    }
    assert list(groups) == ["features.0", "features.3", "features.6", "classifier"]


def test_resnet18_stem_and_blocks_by_hand() -> None:
    groups = ldf.layer_groups(build_model("resnet18", (3, 32, 32), 10, seed=0))
    assert list(groups)[:5] == [
        "stem.0",
        "layers.0.conv1",
        "layers.0.conv2",
        "layers.1.conv1",
        "layers.1.conv2",
    ]
    assert groups["stem.0"] == ["stem.0.weight", "stem.1.weight", "stem.1.bias"]
    assert groups["layers.0.conv1"] == [
        "layers.0.conv1.weight",
        "layers.0.norm1.weight",
        "layers.0.norm1.bias",
    ]
    assert groups["layers.0.conv2"] == [
        "layers.0.conv2.weight",
        "layers.0.norm2.weight",
        "layers.0.norm2.bias",
    ]
    # The first block with a projection shortcut: its 1x1 conv owns the shortcut's norm,
    # not the block's norm2 (which comes before it in module order).
    assert groups["layers.2.conv2"] == [
        "layers.2.conv2.weight",
        "layers.2.norm2.weight",
        "layers.2.norm2.bias",
    ]
    assert groups["layers.2.shortcut.0"] == [
        "layers.2.shortcut.0.weight",
        "layers.2.shortcut.1.weight",
        "layers.2.shortcut.1.bias",
    ]
    assert groups["classifier"] == ["classifier.weight", "classifier.bias"]


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_every_parameter_in_exactly_one_layer(name: str) -> None:
    model = build_model(name, SHAPES[name], 10, seed=0)
    groups = ldf.layer_groups(model)
    flat = [t for names in groups.values() for t in names]
    assert sorted(flat) == sorted(model.state_dict())
    assert len(flat) == len(set(flat))
    # Each layer is exactly one conv/linear weight (plus its bias and norm).
    assert all(
        sum(t.endswith(".weight") and t[:-7] == layer for t in ts) == 1
        for layer, ts in groups.items()
    )
    assert len(groups) == sum(isinstance(m, ldf.WEIGHTED_TYPES) for m in model.modules())


def test_a_norm_joins_only_the_layer_directly_before_it() -> None:
    nn = torch.nn
    # No weighted layer before it: a layer of its own (it used to be an error).
    groups = ldf.layer_groups(nn.Sequential(nn.GroupNorm(1, 4), nn.Linear(4, 2)))
    assert groups == {"0": ["0.weight", "0.bias"], "1": ["1.weight", "1.bias"]}
    # Activations and containers in between are skipped; a second norm, or a norm after a
    # module of another kind, is a layer of its own. BatchNorm's buffers travel with it.
    model = nn.Sequential(
        nn.Conv1d(1, 2, 3, bias=False),
        nn.ReLU(),
        nn.Sequential(nn.BatchNorm1d(2)),
        nn.LayerNorm(2),
        nn.Embedding(3, 2),
        nn.LayerNorm(2),
    )
    bn = [f"2.0.{t}" for t in ("weight", "bias", "running_mean", "running_var")]
    assert ldf.layer_groups(model) == {
        "0": ["0.weight", *bn, "2.0.num_batches_tracked"],
        "3": ["3.weight", "3.bias"],
        "4": ["4.weight"],
        "5": ["5.weight", "5.bias"],
    }


def test_divergence_by_hand_in_float64() -> None:
    groups = {"a": ["a.w", "a.b"], "b": ["b.w"]}
    received = {"a.w": torch.zeros(2), "a.b": torch.tensor([4e20]), "b.w": torch.ones(3)}
    after = {"a.w": torch.tensor([3e20, 0.0]), "a.b": torch.zeros(1), "b.w": torch.ones(3)}
    out = ldf.divergences(after, received, groups)
    # 3e20 and 4e20 squared overflow float32: only a float64 computation gives a finite norm.
    assert out == {"a": math.hypot(float(after["a.w"][0]), float(received["a.b"][0])), "b": 0.0}
    assert out["a"] == pytest.approx(5e20)
    assert list(out) == ["a", "b"]


def test_select_layers_by_hand() -> None:
    # Inserted out of id order: the choice must depend on ids, not on dict order.
    divs = {
        "c": {"L1": 2.0, "L2": 0.0, "L3": 2.0},
        "a": {"L1": 3.0, "L2": 1.0, "L3": 2.0},
        "b": {"L1": 1.0, "L2": 5.0, "L3": 2.0},
    }
    # n=1: L1 -> a, L2 -> b, L3 three-way tie -> a (lowest id).
    assert ldf.select_layers(divs, 1) == {"a": ["L1", "L3"], "b": ["L2"], "c": []}
    # n=2: L1 -> a, c; L2 -> b, a; L3 tie -> a, b.
    assert ldf.select_layers(divs, 2) == {"a": ["L1", "L2", "L3"], "b": ["L2", "L3"], "c": ["L1"]}
    everything = {i: ["L1", "L2", "L3"] for i in "abc"}
    assert ldf.select_layers(divs, 3) == ldf.select_layers(divs, 7) == everything


def test_select_layers_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="NaN"):
        ldf.select_layers({"a": {"L1": 1.0}, "b": {"L1": math.nan}}, 1)
    with pytest.raises(ValueError, match="at least 1"):
        ldf.select_layers({"a": {"L1": 1.0}}, 0)
    with pytest.raises(ValueError, match="different layers"):
        ldf.select_layers({"a": {"L1": 1.0}, "b": {"L2": 1.0}}, 1)


# float64 states make any change in summation order or division visible (float32 results
# round most float64 differences away); float32 is what agents really exchange.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_n_equal_k_is_fedavg_bit_for_bit(dtype: torch.dtype) -> None:
    model = build_model("cnn1d", (1, 40), 10, seed=0).to(dtype)
    groups = ldf.layer_groups(model)
    received = {n: t.detach().clone() for n, t in model.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    ids = ["k3", "k0", "k4", "k1", "k2"]
    states = {
        i: {n: t + torch.randn(t.shape, generator=gen) for n, t in received.items()} for i in ids
    }
    weights = {"k3": 17.3, "k0": 3.1, "k4": 250.7, "k1": 41.9, "k2": 9.0}
    divs = {i: ldf.divergences(states[i], received, groups) for i in ids}
    chosen = ldf.select_layers(divs, len(ids))
    uploads = {i: ldf.partial_state(states[i], chosen[i], groups) for i in ids}
    got = ldf.aggregate_layers(uploads, weights, groups, received)
    want = sparse.aggregate_weighted(states, weights)
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == want[name].dtype
        assert torch.equal(got[name], want[name]), name


def test_aggregate_with_n_below_k_by_hand() -> None:
    groups = {"a": ["a.w", "a.b"], "b": ["b.w"], "c": ["c.w"]}
    previous = {
        "a.w": torch.zeros(2),
        "a.b": torch.zeros(1),
        "b.w": torch.zeros(1),
        "c.w": torch.tensor([7.0]),
    }
    states = {
        "x": {
            "a.w": torch.tensor([1.0, 2.0]),
            "a.b": torch.tensor([4.0]),
            "b.w": torch.tensor([100.0]),
            "c.w": torch.tensor([9.0]),
        },
        "y": {
            "a.w": torch.tensor([3.0, 6.0]),
            "a.b": torch.tensor([8.0]),
            "b.w": torch.tensor([2.0]),
            "c.w": torch.tensor([9.0]),
        },
        "z": {
            "a.w": torch.tensor([-50.0, 0.0]),
            "a.b": torch.tensor([0.0]),
            "b.w": torch.tensor([5.0]),
            "c.w": torch.tensor([9.0]),
        },
    }
    weights = {"x": 1.0, "y": 3.0, "z": 2.0}
    # Layer a from x and y, layer b from y and z, layer c from nobody.
    uploads = {
        "x": ldf.partial_state(states["x"], ["a"], groups),
        "y": ldf.partial_state(states["y"], ["a", "b"], groups),
        "z": ldf.partial_state(states["z"], ["b"], groups),
    }
    assert list(uploads["y"]) == ["a.w", "a.b", "b.w"]
    out = ldf.aggregate_layers(uploads, weights, groups, previous)
    assert torch.equal(out["a.w"], torch.tensor([(1 + 9) / 4, (2 + 18) / 4]))
    assert torch.equal(out["a.b"], torch.tensor([(4 + 24) / 4]))
    assert torch.equal(out["b.w"], torch.tensor([(6 + 10) / 5]))
    assert torch.equal(out["c.w"], previous["c.w"])
    assert out["c.w"] is not previous["c.w"]
    assert list(out) == list(previous)


def test_aggregate_rejects_a_partial_layer() -> None:
    groups = {"a": ["a.w", "a.b"]}
    previous = {"a.w": torch.zeros(2), "a.b": torch.zeros(1)}
    with pytest.raises(ValueError, match="part of layer"):
        ldf.aggregate_layers({"x": {"a.w": torch.ones(2)}}, {"x": 1.0}, groups, previous)
