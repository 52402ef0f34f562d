"""FedAdam-SSM (ALGORITHMS.md 3): the paper's Adam step, top-k masks, the three variants and
the aggregation of sparse deltas, pinned on hand-worked cases."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from agent.learning import adam, sparse
from agent.learning.adam import AdamConfig, train_adam
from agent.learning.training import _batches


def _linear_case() -> tuple[nn.Linear, sparse.State, torch.Tensor, torch.Tensor]:
    """nn.Linear(2, 2) with equal rows, so both logits are equal and softmax is (1/2, 1/2).

    For x = (0.06, -0.02) and label 0, dL/dlogits = p - onehot = (-1/2, 1/2), hence
    dL/dW = [[-0.03, 0.01], [0.03, -0.01]] and dL/db = (-1/2, 1/2); the loss is ln 2.
    """
    weights = {
        "weight": torch.tensor([[0.2, -0.1], [0.2, -0.1]]),
        "bias": torch.tensor([0.3, 0.3]),
    }
    return nn.Linear(2, 2), weights, torch.tensor([[0.06, -0.02]]), torch.tensor([0])


def test_one_step_is_the_papers_adam_without_bias_correction_eps_inside_the_root() -> None:
    model, weights, x, y = _linear_case()
    m0, v0 = 0.01, 1e-6
    m = {name: torch.full_like(t, m0) for name, t in weights.items()}
    v = {name: torch.full_like(t, v0) for name, t in weights.items()}
    config = AdamConfig(epochs=1)
    result = train_adam(model, weights, m, v, x, y, config, torch.Generator().manual_seed(0))

    grads = {"weight": [[-0.03, 0.01], [0.03, -0.01]], "bias": [-0.5, 0.5]}
    for name, g in grads.items():
        g = torch.tensor(g, dtype=torch.float64)
        m1 = 0.9 * m0 + 0.1 * g
        v1 = 0.999 * v0 + 0.001 * g**2
        w1 = weights[name].double() - 1e-3 * m1 / torch.sqrt(v1 + 1e-6)
        torch.testing.assert_close(result.m[name].double(), m1, rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(result.v[name].double(), v1, rtol=1e-6, atol=1e-12)
        torch.testing.assert_close(result.weights[name].double(), w1, rtol=0, atol=1e-7)
    # W[0, 0] worked out: m = 0.006, v = 1.899e-6, step = 1e-3 * 0.006 / sqrt(2.899e-6).
    # Bias correction would step about 1e-3 and eps outside the root 4.35e-3.
    assert result.weights["weight"][0, 0].item() == pytest.approx(0.2 - 3.52393e-3, abs=1e-7)
    assert result.mean_loss == pytest.approx(math.log(2), rel=1e-6)
    assert result.samples == 1


class _Scaled(nn.Module):
    """A linear layer times a fixed buffer: parameters get moments, the buffer does not."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale


def _random_case() -> tuple[_Scaled, sparse.State, sparse.State, sparse.State, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    model = _Scaled()
    weights = {name: torch.randn(t.shape, generator=g) for name, t in model.state_dict().items()}
    params = {name: weights[name] for name, _ in model.named_parameters()}
    m = {name: torch.randn(t.shape, generator=g) * 0.01 for name, t in params.items()}
    v = {name: torch.rand(t.shape, generator=g) * 1e-4 for name, t in params.items()}
    return model, weights, m, v, torch.randn(20, 4, generator=g)


def test_training_leaves_inputs_alone_and_carries_buffers() -> None:
    model, weights, m, v, x = _random_case()
    y = torch.arange(20) % 3
    before = [{k: t.clone() for k, t in s.items()} for s in (weights, m, v)]
    x0, y0 = x.clone(), y.clone()
    config = AdamConfig(lr=1e-2, batch_size=8, epochs=2)
    result = train_adam(model, weights, m, v, x, y, config, torch.Generator().manual_seed(2))

    for original, kept in zip((weights, m, v), before, strict=True):
        assert all(torch.equal(original[k], kept[k]) for k in kept)
    assert torch.equal(x, x0) and torch.equal(y, y0)
    assert set(result.m) == set(result.v) == {"linear.weight", "linear.bias"}
    assert set(result.weights) == {"linear.weight", "linear.bias", "scale"}
    assert torch.equal(result.weights["scale"], weights["scale"])
    for name in result.m:
        assert not torch.equal(result.weights[name], weights[name])
        assert not torch.equal(result.m[name], m[name])
    assert result.samples == 2 * 20
    with pytest.raises(ValueError, match="parameters"):
        train_adam(model, weights, {}, v, x, y, config, torch.Generator())


def test_same_seed_same_result_and_batches_drawn_as_train_local_draws_them() -> None:
    model, weights, m, v, x = _random_case()
    y = torch.arange(20) % 3
    config = AdamConfig(lr=1e-2, batch_size=8, epochs=2)
    runs = [
        train_adam(model, weights, m, v, x, y, config, torch.Generator().manual_seed(seed))
        for seed in (5, 5, 6)
    ]
    first, again, other = runs
    for field in ("weights", "m", "v"):
        a, b, c = (getattr(r, field) for r in runs)
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert any(not torch.equal(a[k], c[k]) for k in a)
    assert first.mean_loss == again.mean_loss != other.mean_loss

    # The generator advances exactly as E calls of train_local's `_batches` advance it.
    used, reference = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    train_adam(model, weights, m, v, x, y, config, used)
    for _ in range(config.epochs):
        _batches(20, config.batch_size, reference)
    assert torch.equal(used.get_state(), reference.get_state())


def test_top_k_mask_picks_the_largest_entries_across_tensors() -> None:
    delta = {
        "b": torch.tensor([0.5, -3.0]),
        "a": torch.tensor([[1.0, -2.0], [0.1, 4.0]]),
    }
    # d = 6, k = 3: |4| in a, |-3| in b, |-2| in a.
    masks = adam.top_k_mask(delta, 0.5)
    assert list(masks) == ["b", "a"]
    assert masks["b"].tolist() == [False, True]
    assert masks["a"].tolist() == [[False, True], [False, True]]
    assert masks["a"].dtype == torch.bool
    # k = max(1, round(fraction d)): round(0.25 * 6) = round(1.5) = 2, and at least one.
    assert sum(int(t.sum()) for t in adam.top_k_mask(delta, 0.25).values()) == 2
    assert sum(int(t.sum()) for t in adam.top_k_mask(delta, 1e-6).values()) == 1
    with pytest.raises(ValueError):
        adam.top_k_mask(delta, 0.0)


def test_top_k_mask_ties_go_to_the_lower_flat_index_in_sorted_name_order() -> None:
    # d = 4, k = 2: b[0] = 2 wins, then three entries tie at 1: a[0] (first in name order).
    delta = {"b": torch.tensor([2.0, 1.0]), "a": torch.tensor([-1.0, 1.0])}
    masks = adam.top_k_mask(delta, 0.5)
    assert masks["a"].tolist() == [True, False]
    assert masks["b"].tolist() == [True, False]
    reordered = adam.top_k_mask({"a": delta["a"], "b": delta["b"]}, 0.5)
    assert all(torch.equal(masks[k], reordered[k]) for k in masks)
    # All equal: exactly k kept, the first k in flat order (an unstable sort or torch.topk
    # would pick others at this size).
    flat = adam.top_k_mask({"w": torch.ones(2, 50)}, 0.3)
    assert flat["w"].flatten().tolist() == [True] * 30 + [False] * 70


def _three_deltas() -> tuple[sparse.State, sparse.State, sparse.State]:
    """Deltas whose largest entries sit in different places (k = 2 of d = 4)."""
    d_w = {"x": torch.tensor([5.0, -4.0]), "y": torch.tensor([0.1, 0.2])}
    d_m = {"x": torch.tensor([0.1, 0.2]), "y": torch.tensor([-7.0, 6.0])}
    d_v = {"x": torch.tensor([3.0, 0.1]), "y": torch.tensor([0.2, 9.0])}
    return d_w, d_m, d_v


def test_ssm_sparsifies_all_three_deltas_with_the_one_mask_of_dw() -> None:
    d_w, d_m, d_v = _three_deltas()
    w, m, v = adam.compress(d_w, d_m, d_v, 0.5, adam.MODE_SSM)
    assert w.mask is m.mask is v.mask
    assert w.mask["x"].tolist() == [True, True] and w.mask["y"].tolist() == [False, False]
    assert w.values["x"].tolist() == [5.0, -4.0] and w.values["y"].tolist() == [0.0, 0.0]
    # dM and dV keep dW's positions, not their own largest entries.
    assert m.values["x"].tolist() == pytest.approx([0.1, 0.2]) and m.values["y"].tolist() == [0, 0]
    assert v.values["x"].tolist() == pytest.approx([3.0, 0.1]) and v.values["y"].tolist() == [0, 0]


def test_top_uses_three_masks_each_from_its_own_delta() -> None:
    d_w, d_m, d_v = _three_deltas()
    w, m, v = adam.compress(d_w, d_m, d_v, 0.5, adam.MODE_TOP)
    assert w.mask["x"].tolist() == [True, True] and w.mask["y"].tolist() == [False, False]
    assert m.mask["x"].tolist() == [False, False] and m.mask["y"].tolist() == [True, True]
    assert v.mask["x"].tolist() == [True, False] and v.mask["y"].tolist() == [False, True]
    assert m.values["y"].tolist() == [-7.0, 6.0] and m.values["x"].tolist() == [0.0, 0.0]
    assert v.values["x"].tolist() == [3.0, 0.0] and v.values["y"].tolist() == [0.0, 9.0]


def test_dense_keeps_everything_and_unknown_modes_are_refused() -> None:
    d_w, d_m, d_v = _three_deltas()
    sent = adam.compress(d_w, d_m, d_v, 0.05, adam.MODE_DENSE)
    for kept, delta in zip(sent, (d_w, d_m, d_v), strict=True):
        assert all(bool(mask.all()) for mask in kept.mask.values())
        assert all(torch.equal(kept.values[k], delta[k]) for k in delta)
    with pytest.raises(ValueError, match="mode"):
        adam.compress(d_w, d_m, d_v, 0.5, "fedavg")


def test_an_unselected_coordinate_counts_as_zero_in_the_weighted_average() -> None:
    # Agent a (1 sample) kept coordinates 0 and 2, agent b (3 samples) kept coordinate 1.
    updates = {
        "b": {"w": torch.tensor([0.0, 8.0, 0.0])},
        "a": {"w": torch.tensor([2.0, 0.0, 4.0])},
    }
    out = adam.aggregate_deltas(updates, {"a": 1.0, "b": 3.0})
    # (1 * 2) / 4, (3 * 8) / 4, (1 * 4) / 4, not the mean over the agents that kept each.
    assert out["w"].tolist() == [0.5, 6.0, 1.0]
    assert out["w"].dtype == torch.float32
    assert torch.equal(out["w"], sparse.aggregate_weighted(updates, {"a": 1.0, "b": 3.0})["w"])


def test_deltas_and_apply_round_trip_and_apply_carries_other_tensors() -> None:
    old = {"w": torch.tensor([1.0, 2.0]), "buffer": torch.tensor([5.0])}
    new = {"w": torch.tensor([1.5, 1.0]), "buffer": torch.tensor([5.0])}
    delta = adam.deltas({"w": new["w"]}, {"w": old["w"]})
    assert delta["w"].tolist() == [0.5, -1.0]
    applied = adam.apply(old, delta)
    assert applied["w"].tolist() == [1.5, 1.0] and applied["buffer"].tolist() == [5.0]
    assert old["w"].tolist() == [1.0, 2.0] and applied["buffer"] is not old["buffer"]
    with pytest.raises(ValueError):
        adam.apply(old, {"missing": torch.zeros(1)})
    with pytest.raises(ValueError):
        adam.deltas(new, {"w": old["w"]})
    zeros = adam.zeros_like_state(old)
    assert zeros["w"].tolist() == [0.0, 0.0] and zeros["buffer"].dtype == torch.float32
