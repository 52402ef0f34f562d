"""FedBuff under secure aggregation (`--strategy fedbuff --secure-aggregation`): a cohort's
version is the plain buffer's from the same updates within the ring's quantization, its
simulated runs, and what it refuses."""

from __future__ import annotations

import pytest
import torch

from agent.experiment import ExperimentConfig
from agent.learning import Payload, ServerState, preset
from agent.learning.buffering import buffer_size
from agent.learning.central import Upload
from agent.learning.central.fedbuff import Buffer
from agent.learning.central.secure_buffer import MEMBER_WEIGHT, cohort_sum, member_change
from coordinator.simulate import simulate
from protocol import secagg

NAMES = ["w", "b"]
"""The floating tensors, in payload order (the counter `n` is not summed)."""


def model(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "w": scale * torch.randn(5, 4, generator=generator),
        "b": scale * torch.randn(4, generator=generator),
        "n": torch.tensor(seed),
    }


def buffers(size: int) -> tuple[Buffer, Buffer]:
    """A plain buffer and the one a secure run keeps, from the same model."""
    start = ServerState(model(0))
    return Buffer(start, size, "polynomial", 5), Buffer(start, size, "polynomial", 5)


def trained(buffer: Buffer, base: int, seed: int) -> Upload:
    """An update trained from version `base`: its model moved by a small step."""
    step = model(seed, scale=0.05)
    weights = {n: buffer.kept[base][n] + step[n] if n in NAMES else step[n] for n in step}
    return Upload(Payload(weights), 10)


def secure_version(
    buffer: Buffer, updates: dict[str, tuple[Upload, int]], dropped: tuple[str, ...] = ()
) -> list[str]:
    """Apply one cohort of `updates` (agent: (update, base)) to `buffer` as the coordinator
    does: each member's staleness-weighted delta masked and summed in the ring, the members
    in `dropped` gone after their shares; the survivors."""
    stale = {k: buffer.version - base for k, (_, base) in updates.items()}
    vectors = {
        k: member_change(NAMES, u.payload, ServerState(buffer.kept[base]), stale[k], buffer.rule)
        for k, (u, base) in updates.items()
    }
    context = secagg.Context("test", buffer.version + 1)
    weights = dict.fromkeys(vectors, MEMBER_WEIGHT)
    summed = secagg.sum_in_process(context, vectors, weights, drop_after_shares=dropped)
    total = cohort_sum(NAMES, buffer.server.weights, summed.mean, len(summed.survivors))
    took = [(k, stale[k]) for k in summed.survivors] if total is not None else []
    buffer.apply_summed(took, total)
    return summed.survivors


def assert_within_quantization(plain: Buffer, secure: Buffer, summands: int) -> None:
    bound = secagg.quantization_bound(summands) * summands  # the mean's, over |U3| = summands
    for name in NAMES:
        gap = (plain.server.weights[name].double() - secure.server.weights[name].double()).abs()
        assert float(gap.max()) <= bound + 1e-7, name  # and float32 rounding of the model
    assert torch.equal(plain.server.weights["n"], secure.server.weights["n"])


def test_a_secure_cohort_makes_the_plain_buffers_version_within_quantization() -> None:
    plain, secure = buffers(3)
    bases = [{"a": 0, "b": 0, "c": 0}, {"a": 0, "c": 1, "d": 1}, {"b": 0, "d": 2, "a": 1}]
    for version, cohort in enumerate(bases, start=1):
        updates = {k: (trained(plain, base, 10 * version + i), base)
                   for i, (k, base) in enumerate(cohort.items())}  # fmt: skip
        for k, (update, base) in updates.items():
            offer = plain.offer(k, update, base)
        assert offer.version == version
        assert secure_version(secure, updates) == sorted(cohort)
        assert secure.version == version
        assert sorted(secure.applied[-1]) == sorted(plain.applied[-1])
        assert_within_quantization(plain, secure, len(cohort))
    assert max(s for took in secure.applied for _, s in took) == 2  # stale ones weighted too


def test_a_cohort_that_lost_a_member_applies_the_survivors_mean() -> None:
    """One of four members (K = 4) gone after sharing its keys: the version is the plain
    rule over the three whose update the sum holds (FedBuff's 1/K over the survivors)."""
    plain, secure = buffers(3)
    secure.size = 4
    updates = {k: (trained(plain, 0, i), 0) for i, k in enumerate("abcd")}
    survivors = secure_version(secure, updates, dropped=("c",))
    assert survivors == ["a", "b", "d"]
    for k in survivors:
        plain.offer(k, updates[k][0], 0)
    assert plain.version == secure.version == 1
    assert_within_quantization(plain, secure, 3)


def test_a_cohort_left_with_two_survivors_keeps_the_model() -> None:
    """Two survivors would each learn the other's update from the version (they know their
    own): the version is the last one's model, as when a cohort's sum fails."""
    _, secure = buffers(3)
    before = secure.server
    updates = {k: (trained(secure, 0, i), 0) for i, k in enumerate("abc")}
    assert secure_version(secure, updates, dropped=("c",)) == ["a", "b"]
    assert secure.version == 1 and secure.applied == [[]]
    assert secure.server is before


def test_under_secure_aggregation_the_automatic_k_is_at_least_three() -> None:
    assert buffer_size(0, 4) == 2 and buffer_size(0, 4, secure=True) == 3
    assert buffer_size(0, 30, secure=True) == 10 and buffer_size(5, 4, secure=True) == 5


@pytest.mark.parametrize(
    ("agents", "strategy", "learning", "message"),
    [
        (4, "fedbuff-ssm", {}, "--secure-aggregation with fedbuff-ssm is not built"),
        (4, "fedbuff", {"dp": "client"}, "--dp client with --secure-aggregation is not built"),
        (4, "fedbuff", {"buffer_size": 2}, "K must be at least 3"),
        (4, "fedbuff", {"buffer_size": 5}, "cohorts of K = 5 distinct devices"),
        (2, "fedbuff", {}, "cohorts of K = 3 distinct devices"),
    ],
)
def test_what_secure_fedbuff_refuses_in_one_line(
    agents: int, strategy: str, learning: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=message) as refused:
        ExperimentConfig(
            dataset="digits",
            agents=agents,
            learning=preset(strategy, secure_aggregation=True, **learning),
        ).validate()
    assert "\n" not in str(refused.value)


def config(secure: bool, **learning: object) -> ExperimentConfig:
    return ExperimentConfig(
        dataset="digits",
        agents=6,
        seed=4,
        profiles="mixed",  # boards of different speeds: stale updates
        learning=preset(
            "fedbuff", rounds=6, epochs=1, buffer_size=3, secure_aggregation=secure, **learning
        ),
    )


def agents(record: dict) -> list[str]:
    """Who a version took, one entry an update, sorted."""
    return sorted(e["agent"] for e in record["applied"])


def test_a_simulated_secure_run_takes_cohorts_of_k_distinct_devices() -> None:
    secure, plain = simulate(config(True)), simulate(config(False))
    rounds = secure["rounds"]
    assert [r["round"] for r in rounds] == list(range(1, 7))
    for record in rounds:
        assert len(agents(record)) == len(set(agents(record))) == 3
    stale = [e["staleness"] for r in rounds for e in r["applied"]]
    assert max(stale) >= 1  # the slow boards' updates go into later cohorts, weighted
    # A plain buffer takes a fast board's updates twice in one version; a cohort cannot.
    assert any(len(set(agents(r))) < 3 for r in plain["rounds"])
    assert secure["summary"]["mean_accuracy"] > 0.5
    # Each member sends its keys, shares, masked change, signature and reveal: more than
    # one plain upload (an agent's bytes in a plain version it sent one update to).
    once = [a for a in agents(plain["rounds"][0]) if agents(plain["rounds"][0]).count(a) == 1]
    member = next(a for a in agents(rounds[0]) if a in once)
    assert (
        rounds[0]["agents"][member]["bytes_sent"]
        > plain["rounds"][0]["agents"][member]["bytes_sent"]
    )
