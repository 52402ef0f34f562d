"""Neighbour draws, reuse order, prior/posterior sets (agent/learning/topology.py;
ALGORITHMS.md 1.2-1.3)."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.learning import topology as tp

ROSTER = [f"pi-{i}" for i in range(10)]
REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------ neighbours (1.2)


def test_random_neighbours_fixed_expected_lists():
    # Pinned: a change here changes every fleet's topology (agents of mixed versions disagree).
    assert tp.neighbours(1234, 7, ROSTER, "pi-3", 3) == ["pi-2", "pi-4", "pi-8"]
    assert tp.neighbours(1234, 8, ROSTER, "pi-3", 3) == ["pi-7", "pi-8", "pi-9"]
    assert tp.neighbours(99, 1, ROSTER, "pi-0", 4) == ["pi-1", "pi-4", "pi-7", "pi-9"]


def test_draws_follow_the_documented_hash():
    # What a non-Python agent must implement: sort candidates by
    # sha256(json([purpose, seed, round, sorted roster]) + json([ids...])).
    def key(purpose: str, *ids: str) -> bytes:
        text = json.dumps([purpose, 1234, 7, ROSTER]) + json.dumps(list(ids))
        return hashlib.sha256(text.encode()).digest()

    others = [a for a in ROSTER if a != "pi-3"]
    expected = sorted(sorted(others, key=lambda j: key("neighbours", "pi-3", j))[:3])
    assert tp.neighbours(1234, 7, ROSTER, "pi-3", 3) == expected
    assert tp.reuse_order(1234, 7, ROSTER) == sorted(ROSTER, key=lambda a: key("reuse", a))


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.text(min_size=1, max_size=6), min_size=2, max_size=12, unique=True),
    st.integers(0, 2**31),
    st.data(),
)
def test_the_shared_draw_is_the_documented_hash_for_any_ids(roster, seed, data):
    # Ids with quotes, backslashes, non-ASCII: the draw that reuses each id's JSON and one
    # hash state per agent gives the definition's sets for every agent, byte for byte.
    ordered = sorted(roster)
    m = data.draw(st.integers(0, len(roster) - 1))
    draw = tp.NeighbourDraw(seed, 3, roster)
    prefix = json.dumps(["neighbours", seed, 3, ordered])

    def key(*ids: str) -> bytes:
        return hashlib.sha256((prefix + json.dumps(list(ids))).encode()).digest()

    for agent in roster:
        others = [a for a in ordered if a != agent]
        expected = sorted(sorted(others, key=lambda j, k=agent: key(k, j))[:m])
        assert draw(agent, m) == expected


def test_random_neighbours_same_in_another_process():
    code = (
        "import json; from agent.learning.topology import everyone_neighbours, reuse_order; "
        f"r = {ROSTER!r}; "
        "print(json.dumps([everyone_neighbours(5, 3, r, 4), reuse_order(5, 3, r)]))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert json.loads(out.stdout) == [
        tp.everyone_neighbours(5, 3, ROSTER, 4),
        tp.reuse_order(5, 3, ROSTER),
    ]


@settings(max_examples=50, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    round_=st.integers(1, 1000),
    k=st.integers(2, 12),
    data=st.data(),
)
def test_random_neighbours_basic_properties(seed, round_, k, data):
    roster = [f"agent-{i}" for i in range(k)]
    agent = data.draw(st.sampled_from(roster))
    m = data.draw(st.integers(0, k - 1))
    got = tp.neighbours(seed, round_, roster, agent, m)
    assert len(got) == m == len(set(got))
    assert agent not in got and set(got) <= set(roster) and got == sorted(got)
    shuffled = data.draw(st.permutations(roster))
    assert tp.neighbours(seed, round_, shuffled, agent, m) == got  # roster order irrelevant


def test_random_neighbours_uniform_over_subsets():
    # K = 8, M = 3: the 35 subsets of the 7 others should be equally likely.
    # 7000 rounds -> 200 expected each; chi-square with 34 dof, p = 0.001 is 65.25.
    roster = [f"a{i}" for i in range(8)]
    counts = Counter(tuple(tp.neighbours(11, t, roster, "a0", 3)) for t in range(1, 7001))
    assert len(counts) == 35
    chi2 = sum((c - 200) ** 2 / 200 for c in counts.values())
    assert chi2 < 65.25


def test_random_neighbours_redrawn_and_directed():
    sets = [tp.everyone_neighbours(3, t, ROSTER, 2) for t in range(1, 21)]
    assert len({tuple(s["pi-0"]) for s in sets}) > 5
    asymmetric = [(k, j) for s in sets for k in s for j in s[k] if k not in s[j]]
    assert asymmetric
    assert tp.neighbours(3, 1, ROSTER, "pi-0", 2) != tp.neighbours(4, 1, ROSTER, "pi-0", 2)


def test_ring_and_full_topologies():
    roster = ["e", "c", "a", "d", "b"]  # canonical order is sorted: a b c d e
    assert tp.neighbours(0, 1, roster, "a", 2, "ring") == ["b", "e"]
    assert tp.neighbours(0, 9, roster, "c", 2, "ring") == ["b", "d"]
    assert tp.neighbours(0, 1, roster, "a", 1, "ring") == ["b"]
    assert tp.neighbours(0, 1, roster, "a", 3, "ring") == ["b", "c", "e"]
    assert tp.neighbours(0, 1, roster, "a", 4, "ring") == ["b", "c", "d", "e"]
    assert tp.neighbours(0, 1, roster, "a", 0, "ring") == []
    assert tp.neighbours(0, 1, roster, "d", 99, "full") == ["a", "b", "c", "e"]
    assert tp.everyone_neighbours(0, 1, roster, 2, "ring") == {
        "a": ["b", "e"],
        "b": ["a", "c"],
        "c": ["b", "d"],
        "d": ["c", "e"],
        "e": ["a", "d"],
    }


def test_neighbour_errors():
    with pytest.raises(ValueError):
        tp.neighbours(0, 1, ROSTER, "pi-0", 10)  # m > K - 1
    with pytest.raises(ValueError):
        tp.neighbours(0, 1, ROSTER, "pi-0", 10, "ring")
    with pytest.raises(ValueError):
        tp.neighbours(0, 1, ROSTER, "stranger", 2)
    with pytest.raises(ValueError):
        tp.neighbours(0, 1, ["a", "a", "b"], "a", 1)
    with pytest.raises(ValueError):
        tp.neighbours(0, 1, ROSTER, "pi-0", 2, "star")  # type: ignore[arg-type]


# ------------------------------------------------------------------------ reuse order (1.3)


def test_reuse_order_fixed_permutation_and_per_round():
    assert tp.reuse_order(1234, 7, ROSTER) == [
        "pi-0",
        "pi-2",
        "pi-1",
        "pi-6",
        "pi-8",
        "pi-7",
        "pi-5",
        "pi-4",
        "pi-3",
        "pi-9",
    ]
    orders = [tp.reuse_order(1234, t, ROSTER) for t in range(1, 21)]
    assert all(sorted(o) == ROSTER for o in orders)
    assert len({tuple(o) for o in orders}) == 20
    assert tp.reuse_order(1234, 7, list(reversed(ROSTER))) == orders[6]


def test_reuse_order_uniform_first_place():
    # 5000 rounds, K = 10: each agent first 500 times; chi-square 9 dof, p = 0.001 is 27.88.
    first = Counter(tp.reuse_order(2, t, ROSTER)[0] for t in range(1, 5001))
    assert sum((first[a] - 500) ** 2 / 500 for a in ROSTER) < 27.88


# ---------------------------------------------------------------------- prior / posterior (1.3)

# Fig. 1 of the paper: K = 6, M = 2, reuse index = label. "N = 1: node 3 waits for 2, nodes 5
# and 6 for 1; nodes 1, 2, 4 start at once. N = 2: node 6 waits for 1 and 5."
FIG1_ORDER = ["n1", "n2", "n3", "n4", "n5", "n6"]
FIG1_G = {
    "n1": ["n2", "n4"],
    "n2": ["n3", "n6"],
    "n3": ["n2", "n4"],
    "n4": ["n5", "n6"],
    "n5": ["n1", "n6"],
    "n6": ["n5", "n1"],
}


def _split(max_wait: int) -> dict[str, tuple[list[str], list[str]]]:
    return {k: tp.prior_posterior(FIG1_ORDER, g, k, max_wait) for k, g in FIG1_G.items()}


def test_prior_posterior_figure1_n0():
    split = _split(0)
    assert all(prior == [] for prior, _ in split.values())
    assert split["n6"] == ([], ["n1", "n5"])  # posterior listed in reuse order


def test_prior_posterior_figure1_n1():
    split = _split(1)
    assert {k: p for k, (p, _) in split.items()} == {
        "n1": [],
        "n2": [],
        "n3": ["n2"],
        "n4": [],
        "n5": ["n1"],
        "n6": ["n1"],
    }
    # n6's other earlier neighbour (n5) is beyond the cap: it joins the posterior set.
    assert split["n6"] == (["n1"], ["n5"])
    assert split["n5"] == (["n1"], ["n6"])


def test_prior_posterior_figure1_n2_and_k():
    two = _split(2)
    assert two["n6"] == (["n1", "n5"], [])
    assert two["n3"] == (["n2"], ["n4"])
    assert _split(6) == two  # N >= M: the cap never binds


def test_prior_posterior_follows_order_not_ids():
    order = ["d", "b", "a", "c"]
    assert tp.prior_posterior(order, ["a", "b", "d"], "c", 1) == (["d"], ["b", "a"])
    assert tp.prior_posterior(order, ["a", "b", "c"], "d", 2) == ([], ["b", "a", "c"])
    with pytest.raises(ValueError):
        tp.prior_posterior(order, ["z"], "c", 1)
    with pytest.raises(ValueError):
        tp.prior_posterior(order, ["a"], "c", -1)


@pytest.mark.parametrize("topology", ["random", "ring", "full"])
@pytest.mark.parametrize("max_wait", [0, 1, 2, 4, 12])
def test_processing_in_reuse_order_never_waits_on_the_future(topology, max_wait):
    roster = [f"a{i:02d}" for i in range(12)]
    for seed, t in itertools.product(range(3), range(1, 11)):
        order = tp.reuse_order(seed, t, roster)
        graph = tp.everyone_neighbours(seed, t, roster, 4, topology)
        done: set[str] = set()
        for k in order:
            prior, posterior = tp.prior_posterior(order, graph[k], k, max_wait)
            assert set(prior) <= done  # every awaited model already exists: a DAG, no cycles
            assert len(prior) <= max_wait and sorted(prior + posterior) == graph[k]
            done.add(k)


def test_full_topology_with_n_equal_k_is_sequential():
    roster = [f"a{i}" for i in range(6)]
    order = tp.reuse_order(8, 2, roster)
    for i, k in enumerate(order):
        prior, _ = tp.prior_posterior(order, tp.neighbours(8, 2, roster, k, 0, "full"), k, 6)
        assert prior == order[:i]
