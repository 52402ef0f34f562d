"""DA-DPFL sparse math (agent/learning: sparse.py, rigl.py, pqi.py) pinned on hand-worked
cases (ALGORITHMS.md 1.1-1.9)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.learning import pqi as pq
from agent.learning import rigl
from agent.learning import sparse as sp

T = torch.tensor
B = torch.bool


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------------- ERK (1.1)


def test_erk_no_saturation_hand_worked():
    # raw = sum/prod: a (10,10) -> 20/100 = 0.2; b (100,10) -> 110/1000 = 0.11.
    # budget 0.5 * 1100 = 550; eps = 550 / (0.2*100 + 0.11*1000) = 550/130.
    d = sp.erk_densities({"a": (10, 10), "b": (100, 10)}, 0.5)
    assert d["a"] == pytest.approx(0.2 * 550 / 130)
    assert d["b"] == pytest.approx(0.11 * 550 / 130)
    masks = sp.random_masks({"a": (10, 10), "b": (100, 10)}, d, gen(0))
    assert int(masks["a"].sum()) == 85  # round(84.6)
    assert int(masks["b"].sum()) == 465  # round(465.4)


def test_erk_saturates_in_two_rounds_and_resolves():
    # a (1000,1): raw 1.001; b (20,20): raw 0.1; c (200,200): raw 0.01; total 41400, d0 0.3.
    # iter 1: eps = 12420 / (1001 + 40 + 400) = 8.619 -> a = 8.6 > 1 dense, b = 0.862 fine.
    # iter 2: eps = (12420 - 1000) / (40 + 400) = 25.95 -> b = 2.6 > 1 dense now.
    # iter 3: eps = (12420 - 1400) / 400 = 27.55 -> c = 0.2755.
    shapes = {"a": (1000, 1), "b": (20, 20), "c": (200, 200)}
    d = sp.erk_densities(shapes, 0.3)
    assert d == {"a": 1.0, "b": 1.0, "c": pytest.approx(0.2755)}
    masks = sp.random_masks(shapes, d, gen(1))
    counts = {n: int(m.sum()) for n, m in masks.items()}
    assert counts == {"a": 1000, "b": 400, "c": 11020}
    assert sum(counts.values()) == 12420  # exactly 0.3 x 41400


def test_erk_single_layer_small_layer_dense_others_share():
    d = sp.erk_densities({"a": (2, 2), "b": (100, 100)}, 0.5)
    # a: raw 1 saturates; b gets the rest: (5002 - 4) / 10000.
    assert d == {"a": 1.0, "b": pytest.approx(0.4998)}


@given(
    shapes=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 40)), min_size=1, max_size=5),
    density=st.floats(0.05, 1.0),
)
def test_erk_properties(shapes, density):
    named = {f"l{i}": s for i, s in enumerate(shapes)}
    d = sp.erk_densities(named, density)
    sizes = {n: math.prod(s) for n, s in named.items()}
    assert all(0.0 < v <= 1.0 for v in d.values())
    kept = sum(d[n] * sizes[n] for n in named)
    assert kept == pytest.approx(density * sum(sizes.values()), rel=1e-9)
    ratios = {d[n] / (sum(s) / sizes[n]) for n, s in named.items() if d[n] < 1.0}
    assert max(ratios, default=0) - min(ratios, default=0) <= 1e-9 * max(ratios, default=1)


def test_erk_rejects_bad_density():
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError):
            sp.erk_densities({"a": (3, 3)}, bad)


# --------------------------------------------------------------------------- random masks (1.1)


def test_random_masks_exact_counts_deterministic_and_order_free():
    shapes = {"conv": (8, 3, 3, 3), "fc": (10, 32)}
    dens = {"conv": 0.37, "fc": 0.5}
    a = sp.random_masks(shapes, dens, gen(7))
    b = sp.random_masks(dict(reversed(shapes.items())), dens, gen(7))
    c = sp.random_masks(shapes, dens, gen(8))
    assert list(a) == ["conv", "fc"] and list(b) == ["fc", "conv"]
    assert int(a["conv"].sum()) == round(0.37 * 216) == 80
    assert int(a["fc"].sum()) == 160
    assert a["conv"].shape == (8, 3, 3, 3) and a["conv"].dtype == B
    assert all(torch.equal(a[n], b[n]) for n in shapes)
    assert not torch.equal(a["fc"], c["fc"])


def test_random_masks_positions_uniform():
    # 4000 draws of 2 of 5 positions: each position expected 1600 times.
    counts = torch.zeros(5)
    g = gen(3)
    for _ in range(4000):
        counts += sp.random_masks({"w": (5,)}, {"w": 0.4}, g)["w"]
    chi2 = float(((counts - 1600) ** 2 / 1600).sum())
    assert chi2 < 18.5  # chi-square, 4 dof, p = 0.001


# ------------------------------------------------------------------------------ masking


def test_apply_masks_zeroes_exactly_and_copies():
    state = {"w": T([[1.0, -2.0], [3.0, -4.0]]), "b": T([5.0, 6.0])}
    masks = {"w": T([[True, False], [False, True]])}
    out = sp.apply_masks(state, masks)
    assert torch.equal(out["w"], T([[1.0, 0.0], [0.0, -4.0]]))
    assert not torch.signbit(out["w"][0, 1])  # +0.0, not -0.0
    out["b"].add_(1.0)
    out["w"].add_(1.0)
    assert torch.equal(state["b"], T([5.0, 6.0])) and state["w"][0, 1] == -2.0


def test_apply_masks_in_place():
    state = {"w": T([1.0, -2.0, 3.0]), "b": T([1.0])}
    sp.apply_masks_(state, {"w": T([True, False, True])})
    assert torch.equal(state["w"], T([1.0, 0.0, 3.0])) and not torch.signbit(state["w"][1])
    assert torch.equal(state["b"], T([1.0]))


def test_sparsity():
    masks = {"a": T([True, False, False, False]), "b": T([[True, True], [False, True]])}
    assert sp.sparsity(masks) == pytest.approx(1 - 4 / 8)
    assert sp.sparsity({}) == 0.0


# ------------------------------------------------------------------------- aggregation (1.4)


def _fleet():
    # element 0: kept by a only; 1: by a and b; 2: by b and c; 3: by nobody.
    masks = {
        "a": {"w": T([True, True, False, False])},
        "b": {"w": T([False, True, True, False])},
        "c": {"w": T([False, False, True, False])},
    }
    states = {
        "a": {"w": T([1.0, 2.0, 0.0, 0.0]), "bias": T([1.0, 2.0])},
        "b": {"w": T([0.0, 4.0, 6.0, 0.0]), "bias": T([3.0, 4.0])},
        # c carries a stray value outside its mask: it must not leak into the average.
        "c": {"w": T([0.0, 0.0, 10.0, 100.0]), "bias": T([5.0, 9.0])},
    }
    return {k: (states[k], masks[k]) for k in states}


def test_aggregate_masked_hand_worked():
    models = _fleet()
    everything = sp.aggregate_masked(models, {"w": T([True] * 4)})
    # over the count of holders, not |S| = 3 (which would give 1/3, 2, 16/3).
    assert torch.equal(everything["w"], T([1.0, 3.0, 8.0, 0.0]))
    assert torch.equal(everything["bias"], T([3.0, 5.0]))  # dense: plain mean over S
    own_a = sp.aggregate_masked(models, models["a"][1])
    assert torch.equal(own_a["w"], T([1.0, 3.0, 0.0, 0.0]))
    assert list(own_a) == ["w", "bias"] and own_a["w"].dtype == torch.float32


def test_aggregate_masked_rejects_mismatched_masks():
    models = _fleet()
    models["b"] = (models["b"][0], {})
    with pytest.raises(ValueError):
        sp.aggregate_masked(models, {"w": T([True] * 4)})


def _random_fleet(seed: int, k: int, shape: tuple[int, ...]):
    g = gen(seed)
    models = {}
    for i in range(k):
        state = {"w": torch.randn(shape, generator=g), "bias": torch.randn(3, generator=g)}
        mask = {"w": torch.rand(shape, generator=g) < 0.5}
        models[f"agent-{i:02d}"] = (sp.apply_masks(state, mask), mask)
    return models


def _reference_masked(models, own):
    ids = sorted(models)
    flat_own = own["w"].flatten().tolist()
    out = []
    for e in range(len(flat_own)):
        total, count = 0.0, 0
        for i in ids:
            state, mask = models[i]
            if mask["w"].flatten()[e]:
                total += float(state["w"].flatten()[e])
                count += 1
        out.append(total / count if count and flat_own[e] else 0.0)
    return T(out).view(own["w"].shape)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(1, 5), n=st.integers(1, 12))
def test_aggregate_masked_matches_slow_reference(seed, k, n):
    models = _random_fleet(seed, k, (n, 2))
    own = models[sorted(models)[0]][1]
    got = sp.aggregate_masked(models, own)
    assert torch.equal(got["w"], _reference_masked(models, own))
    bias = sum(models[i][0]["bias"].double() for i in sorted(models)) / k
    assert torch.equal(got["bias"], bias.float())


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), shuffle_seed=st.integers(0, 10_000))
def test_aggregation_is_order_invariant_bitwise(seed, shuffle_seed):
    models = _random_fleet(seed, 6, (7, 5))
    ids = list(models)
    random.Random(shuffle_seed).shuffle(ids)
    shuffled = {i: models[i] for i in ids}
    own = models[ids[0]][1]
    a, b = sp.aggregate_masked(models, own), sp.aggregate_masked(shuffled, own)
    assert all(torch.equal(a[n], b[n]) for n in a)
    states = {i: models[i][0] for i in models}
    states_shuffled = {i: states[i] for i in ids}
    mean, mean_shuffled = sp.aggregate_mean(states), sp.aggregate_mean(states_shuffled)
    assert all(torch.equal(mean[n], mean_shuffled[n]) for n in mean)


def test_aggregate_mean_and_weighted_hand_worked():
    states = {"b": {"x": T([4.0, 0.0])}, "a": {"x": T([1.0, 2.0])}}
    assert torch.equal(sp.aggregate_mean(states)["x"], T([2.5, 1.0]))
    # (1*1 + 3*4) / 4 = 3.25 ; (1*2 + 3*0) / 4 = 0.5
    assert torch.equal(sp.aggregate_weighted(states, {"a": 1, "b": 3})["x"], T([3.25, 0.5]))
    with pytest.raises(ValueError):
        sp.aggregate_weighted(states, {"a": 0, "b": 0})
    with pytest.raises(ValueError):
        sp.aggregate_mean({})
    # integer buffers are copied from the first agent by id, never averaged
    assert torch.equal(sp.aggregate_mean({"b": {"n": T([7])}, "a": {"n": T([1])}})["n"], T([1]))


# -------------------------------------------------------------------------------- RigL (1.6)


def test_rigl_alpha_schedule():
    assert rigl.rigl_alpha(0, 100) == pytest.approx(0.3)
    assert rigl.rigl_alpha(50, 100) == pytest.approx(0.15)
    assert rigl.rigl_alpha(100, 100) == pytest.approx(0.0)
    assert rigl.rigl_alpha(25, 100, a=0.5) == pytest.approx(0.25 * (1 + math.sqrt(0.5)))


def test_rigl_hand_worked_drop_smallest_regrow_largest_grad():
    w = T([0.0, 0.5, -0.1, 0.0, 2.0, 0.0, 0.3, 0.0])
    m = T([0, 1, 1, 0, 1, 0, 1, 0], dtype=B)
    # Dropped positions 2 and 6 carry the largest gradients: they must not come back.
    g = T([0.1, 9.0, 9.0, 0.5, 0.0, 0.2, 9.0, 0.05])
    new = rigl.rigl_update({"w": w}, {"w": m}, {"w": g}, alpha=0.5)["w"]
    # n = 4, drop ceil(2) = 2 smallest |w| active: 2 (0.1), 6 (0.3);
    # regrow the 2 largest |g| among previously inactive {0, 3, 5, 7}: 3 (0.5), 5 (0.2).
    assert new.tolist() == [False, True, False, True, True, True, False, False]
    weights = sp.apply_masks({"w": w}, {"w": new})["w"]
    assert weights.tolist() == [0.0, 0.5, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0]  # regrown start at 0


def test_rigl_ties_go_to_lower_index():
    w = T([1.0, -1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    m = T([1, 1, 1, 1, 0, 0, 0, 0], dtype=B)
    g = T([0.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    new = rigl.rigl_update({"w": w}, {"w": m}, {"w": g}, alpha=0.5)["w"]
    assert new.tolist() == [False, False, True, True, True, True, False, False]


def test_rigl_drops_only_what_can_be_regrown():
    m = T([1, 1, 1, 1, 1, 1, 1, 0], dtype=B)
    w = T([7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0, 0.0])
    new = rigl.rigl_update({"w": w}, {"w": m}, {"w": torch.ones(8)}, alpha=0.5)["w"]
    # ceil(0.5 * 7) = 4 wanted, but only one inactive position: drop 1 (index 6), regrow 7.
    assert new.tolist() == [True] * 6 + [False, True]
    dense = {"w": torch.ones(8, dtype=B)}
    assert torch.equal(rigl.rigl_update({"w": w}, dense, {"w": w}, 0.3)["w"], dense["w"])
    assert torch.equal(rigl.rigl_update({"w": w}, {"w": m}, {"w": w}, 0.0)["w"], m)


@settings(max_examples=50, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    shape=st.tuples(st.integers(1, 9), st.integers(1, 9)),
    density=st.floats(0.0, 1.0),
    alpha=st.floats(0.0, 1.0),
)
def test_rigl_invariants(seed, shape, density, alpha):
    g = gen(seed)
    m = sp.random_masks({"w": shape}, {"w": density}, g)["w"]
    w = torch.randn(shape, generator=g) * m
    grad = torch.randn(shape, generator=g)
    new = rigl.rigl_update({"w": w}, {"w": m}, {"w": grad}, alpha)["w"]
    n, size = int(m.sum()), m.numel()
    assert int(new.sum()) == n
    dropped, grown = m & ~new, new & ~m
    k = min(math.ceil(alpha * n - 1e-9 * max(1.0, alpha * n)), size - n)
    assert int(dropped.sum()) == int(grown.sum()) == k
    if k:
        kept = m & new
        assert kept.sum() == 0 or w.abs()[dropped].max() <= w.abs()[kept].min()
        not_grown = ~m & ~new
        assert not_grown.sum() == 0 or grad.abs()[grown].min() >= grad.abs()[not_grown].max()
    out = sp.apply_masks({"w": w}, {"w": new})["w"]
    assert torch.all(out[grown] == 0) and torch.all(out[~new] == 0)
    assert torch.equal(out[m & new], w[m & new])


# --------------------------------------------------------------------------------- PQI (1.9)


def test_pqi_hand_worked():
    assert pq.pqi(T([1.0, 1.0, 1.0, 1.0])) == pytest.approx(0.0, abs=1e-12)
    assert pq.pqi(T([-1.0, 1.0, 1.0, -1.0])) == pytest.approx(0.0, abs=1e-12)
    # one nonzero of d = 4: ||x||_0.5 = ||x||_1 = 1, PQI = 1 - 4^(1 - 2) = 0.75 (the maximum).
    assert pq.pqi(T([1.0, 0.0, 0.0, 0.0])) == pytest.approx(0.75)
    # [4, 1]: ||x||_0.5 = (2 + 1)^2 = 9, ||x||_1 = 5, PQI = 1 - 9 / (2 * 5) = 0.1.
    assert pq.pqi(T([4.0, -1.0])) == pytest.approx(0.1)
    # p = 1, q = 2 on [3, 4]: 1 - 2^(1/2 - 1) * 7 / 5.
    assert pq.pqi(T([3.0, 4.0]), p=1.0, q=2.0) == pytest.approx(1 - 7 / (5 * math.sqrt(2)))


def test_pqi_degenerate_inputs_prune_nothing():
    assert pq.pqi(T([])) == 0.0 and pq.pqi(torch.zeros(5)) == 0.0
    assert pq.pqi_prune_count(T([])) == 0
    assert pq.pqi_prune_count(torch.zeros(5), eta_c=1.0, gamma=0.9) == 0
    with pytest.raises(ValueError):
        pq.pqi_prune_count(T([1.0]), p=1.0, q=1.0)


def test_pqi_prune_count_hand_worked():
    # equal magnitudes: PQI 0 -> r = d -> prune nothing (default eta_c = 0).
    assert pq.pqi_prune_count(torch.ones(4)) == 0
    # [1,0,0,0]: r = 4 * 1 * (1 - 0.75)^1 = 1 ; c = floor(4 * min(0.75, 0.9)) = 3.
    assert pq.pqi_prune_count(T([1.0, 0.0, 0.0, 0.0])) == 3
    # [4, 1] defaults: r = 2 * 0.9 = 1.8, c = floor(2 * 0.1) = 0.
    assert pq.pqi_prune_count(T([4.0, 1.0])) == 0
    # [4, 1] paper params: r = 2 * 2^-2 * 0.9 = 0.45, c = floor(2 * 0.9 * (1 - 0.225)) = 1.
    assert pq.pqi_prune_count(T([4.0, 1.0]), eta_c=1.0, gamma=0.9) == 1
    # one nonzero of 100: 1 - r/d = 0.99, capped by beta: floor(100 * 0.9) = 90.
    one_hot = torch.zeros(100)
    one_hot[17] = 3.0
    assert pq.pqi_prune_count(one_hot) == 90
    assert pq.pqi_prune_count(one_hot, beta=0.29) == 29  # 0.29 * 100 = 28.999999999999996


GAUSSIAN_PQI = 1 - math.gamma(0.75) ** 2 / math.sqrt(math.pi)  # 0.15279, d -> infinity


def test_pqi_gaussian_layer_fractions():
    x = torch.randn(400_000, generator=gen(0))
    d = x.numel()
    assert pq.pqi(x) == pytest.approx(GAUSSIAN_PQI, abs=2e-3)
    # defaults {p,q,gamma,eta_c} = {0.5,1,1,0}: c/d = PQI, about 15%.
    assert pq.pqi_prune_count(x) / d == pytest.approx(0.1528, abs=2e-3)
    # paper text {0.5,1,0.9,1}: c/d = 0.9 (1 - (1 - PQI) / 4), about 71%.
    paper = 0.9 * (1 - (1 - GAUSSIAN_PQI) / 4)
    assert pq.pqi_prune_count(x, eta_c=1.0, gamma=0.9) / d == pytest.approx(paper, abs=2e-3)
    assert paper == pytest.approx(0.7094, abs=1e-4)


def _layer(values: list[float], active: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.zeros(len(values))
    w[:active] = T(values[:active])
    return w, torch.arange(len(values)) < active


def test_pqi_prune_removes_smallest_active():
    w = T([5.0, 0.0, -0.1, 0.3, 0.2, 9.0])
    m = T([1, 0, 1, 1, 1, 0], dtype=B)  # index 5 is inactive: its (stray) 9.0 is ignored.
    active = w[m]
    c = pq.pqi_prune_count(active)
    # hand: sum sqrt|x| = 2.2361 + 0.3162 + 0.5477 + 0.4472 = 3.5472 -> ||x||_0.5 = 12.583,
    # ||x||_1 = 5.6, PQI = 1 - 12.583 / (4 * 5.6) = 0.4383, c = floor(4 * 0.4383) = 1.
    assert c == 1
    new = pq.pqi_prune({"w": w}, {"w": m}, target_sparsity=0.99)["w"]
    assert new.tolist() == [True, False, False, True, True, False]


def test_pqi_prune_trims_to_target_exactly():
    big = [1000.0] + [0.001 * (i + 1) for i in range(99)]
    wa, ma = _layer(big, 100)
    wb, mb = _layer(big, 50)
    assert pq.pqi_prune_count(wa[ma]) == 90 and pq.pqi_prune_count(wb[mb]) == 45
    # N = 200, active 150, s* = 0.5 -> budget 150 - 100 = 50 < 135 planned.
    # proportional: a 90*50/135 = 33.33, b 45*50/135 = 16.67 -> floors 33, 16, the one left
    # over goes to the larger remainder (b): 33 + 17 = 50.
    new = pq.pqi_prune({"a": wa, "b": wb}, {"a": ma, "b": mb}, target_sparsity=0.5)
    assert int(new["a"].sum()) == 100 - 33 and int(new["b"].sum()) == 50 - 17
    assert sp.sparsity(new) == 0.5
    # the largest magnitudes survive: index 0 and the top of the ramp.
    assert new["a"][0] and new["a"][34:].all() and not new["a"][1:34].any()
    # no cap hit: the planned counts go through unchanged.
    free = pq.pqi_prune({"a": wa, "b": wb}, {"a": ma, "b": mb}, target_sparsity=0.95)
    assert int(free["a"].sum()) == 10 and int(free["b"].sum()) == 5
    # already at the target: nothing changes.
    done = pq.pqi_prune({"a": wa, "b": wb}, new, target_sparsity=0.5)
    assert all(torch.equal(done[n], new[n]) for n in new)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    sizes=st.lists(st.integers(1, 60), min_size=1, max_size=4),
    density=st.floats(0.05, 1.0),
    target=st.floats(0.0, 0.99),
    eta_c=st.sampled_from([0.0, 1.0]),
)
def test_pqi_prune_never_passes_target(seed, sizes, density, target, eta_c):
    g = gen(seed)
    shapes = {f"l{i}": (n,) for i, n in enumerate(sizes)}
    masks = sp.random_masks(shapes, dict.fromkeys(shapes, density), g)
    weights = {n: torch.randn(s, generator=g) * masks[n] for n, s in shapes.items()}
    before = sp.sparsity(masks)
    new = pq.pqi_prune(weights, masks, eta_c=eta_c, gamma=0.9, target_sparsity=target)
    total = sum(sizes)
    after = sp.sparsity(new)
    assert after <= max(before, target) + 1e-12
    for n in shapes:
        assert not (new[n] & ~masks[n]).any()  # only prunes
        pruned, kept = masks[n] & ~new[n], new[n]
        if pruned.any() and kept.any():
            assert weights[n].abs()[pruned].max() <= weights[n].abs()[kept].min()
    planned = sum(pq.pqi_prune_count(weights[n][masks[n]], eta_c=eta_c, gamma=0.9) for n in shapes)
    if before < target and (1 - before) * total - planned < (1 - target) * total:
        assert abs(after - target) < 1 / total + 1e-12  # trimmed: lands on s*
