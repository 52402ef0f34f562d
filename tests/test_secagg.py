"""Secure aggregation's cryptography (`protocol.secagg`): the masks cancel, the sum survives
30% of the members dropping, one masked upload is noise, quantization keeps its bound."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import edgefl
from protocol import secagg
from protocol.secagg import Client, Context, SecAggError, Server, sum_in_process

CONTEXT = Context("run-1", 3)


def vectors(n: int, length: int = 2000, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"a{i:02d}": rng.normal(0, 0.05, length) for i in range(n)}


def exact_mean(values: dict[str, np.ndarray], weights: dict[str, int], who: list[str]):
    return sum(values[k] * weights[k] for k in who) / sum(weights[k] for k in who)


def test_the_masks_cancel_and_the_sum_is_the_weighted_mean_within_quantization() -> None:
    values = vectors(7)
    weights = {k: 10 + 3 * i for i, k in enumerate(sorted(values))}
    result = sum_in_process(CONTEXT, values, weights)
    assert result.survivors == sorted(values)
    error = np.abs(result.mean - exact_mean(values, weights, sorted(values))).max()
    assert error <= secagg.quantization_bound(7)
    assert error > 0  # quantized: not bit-equal, yet within the bound


def test_the_pairwise_masks_alone_cancel_exactly_in_the_ring() -> None:
    clients = {k: Client(k, CONTEXT) for k in ("a", "b", "c", "d")}
    adverts = {k: c.advert(1) for k, c in clients.items()}
    server = Server(CONTEXT, adverts)
    relayed = server.relay({k: c.shares(adverts) for k, c in clients.items()})
    zero = np.zeros(500)
    total = np.zeros(500, dtype=np.uint32)
    for k, c in clients.items():
        c.receive_shares(relayed[k])
        y, _ = c.masked(zero)
        total = total + (y - secagg._self_mask(CONTEXT, c.self_seed, 500))
    assert not total.any()


@pytest.mark.parametrize("when", ["after_shares", "after_upload"])
def test_a_sum_with_30_percent_dropped_is_recovered(when: str) -> None:
    values = vectors(10, seed=1)
    weights = dict.fromkeys(values, 5)
    gone = sorted(values)[:3]
    if when == "after_shares":
        result = sum_in_process(CONTEXT, values, weights, drop_after_shares=gone)
        counted = sorted(set(values) - set(gone))
    else:
        result = sum_in_process(CONTEXT, values, weights, drop_after_upload=gone)
        counted = sorted(values)
    assert result.survivors == counted
    error = np.abs(result.mean - exact_mean(values, weights, counted)).max()
    assert error <= secagg.quantization_bound(len(counted)) * len(values) / len(counted)


def test_more_dropped_than_the_threshold_allows_is_refused() -> None:
    values = vectors(10, length=50)
    with pytest.raises(SecAggError, match="too few|needs"):
        sum_in_process(
            CONTEXT, values, dict.fromkeys(values, 1), drop_after_upload=sorted(values)[:4]
        )


def test_one_masked_upload_is_noise() -> None:
    values = vectors(5, length=20000, seed=2)
    result = sum_in_process(CONTEXT, values, dict.fromkeys(values, 1))
    for k, upload in result.uploads.items():
        decoded = secagg.dequantize(upload) * len(values)  # as if it were a lone quantized x
        assert abs(np.corrcoef(decoded, values[k])[0, 1]) < 0.05
        assert np.abs(decoded).mean() > 100 * np.abs(values[k]).mean()


def test_the_threshold_keeps_a_majority_and_tolerates_30_percent() -> None:
    for n in range(2, 200):
        t = secagg.threshold(n)
        assert t > n / 2
        assert n - t >= (3 * n) // 10


def test_quantization_error_within_the_stated_bound() -> None:
    rng = np.random.default_rng(4)
    x = rng.uniform(-secagg.CLIP_RANGE, secagg.CLIP_RANGE, 100000)
    q, clipped = secagg.quantize(x)
    assert clipped == 0
    assert np.abs(secagg.dequantize(q) - x).max() <= secagg.quantization_bound(1)
    _, clipped = secagg.quantize(np.array([secagg.CLIP_RANGE * 2, 0.0]))
    assert clipped == 1


def test_shares_relayed_to_the_wrong_member_do_not_decrypt() -> None:
    clients = {k: Client(k, CONTEXT) for k in ("a", "b", "c")}
    adverts = {k: c.advert(1) for k, c in clients.items()}
    sent = {k: c.shares(adverts) for k, c in clients.items()}
    swapped = {u: sent[u]["c"] for u in sent}  # c's shares, given to b
    with pytest.raises(SecAggError, match="do not decrypt"):
        clients["b"].receive_shares(swapped)


def test_a_member_reveals_once_and_never_both_secrets_of_one_member() -> None:
    values = vectors(4, length=10)
    clients = {k: Client(k, CONTEXT) for k in values}
    adverts = {k: c.advert(1) for k, c in clients.items()}
    relayed = Server(CONTEXT, adverts).relay({k: c.shares(adverts) for k, c in clients.items()})
    for k, c in clients.items():
        c.receive_shares(relayed[k])
    first = clients["a00"].reveal(sorted(values)[:3])
    assert len(first["a03"]) == 16  # a03 dropped: its mask-key seed's share
    with pytest.raises(SecAggError):
        clients["a00"].reveal(sorted(values))  # now claiming a03 survived: refused


@pytest.mark.parametrize(
    ("options", "refusal"),
    [
        ({"strategy": "dispfl"}, "is for the centralized strategies .* each neighbour receives"),
        ({"strategy": "fedspu"}, "built for fedavg and fedavg-ft, .* fedspu's uploads"),
        ({"strategy": "fedavg", "aggregation": "median"}, "needs --aggregation mean and no"),
        ({"strategy": "fedavg", "aggregation": "mean", "clip": "auto"}, "no --clip"),
    ],
)
def test_where_secure_aggregation_cannot_run_it_is_refused_in_one_line(
    options: dict, refusal: str
) -> None:
    with pytest.raises(edgefl.ConfigError, match=refusal) as refused:
        edgefl.config(secure_aggregation=True, **options)
    assert "\n" not in str(refused.value)


def test_secure_aggregation_takes_the_plain_mean_by_default() -> None:
    learning = edgefl.config(strategy="fedavg", secure_aggregation=True).learning
    assert (learning.aggregation, learning.clip) == ("mean", "off")
    plain = edgefl.config(strategy="fedavg").learning
    assert (plain.aggregation, plain.clip) == ("screened", "auto")


def test_a_run_file_asks_for_secure_aggregation(tmp_path: Path) -> None:
    run_file = tmp_path / "run.toml"
    run_file.write_text(
        '[run]\ndataset = "digits"\nagents = 3\nstrategy = "fedavg"\n'
        'aggregation = "mean"\nsecure_aggregation = true\n'
    )
    assert edgefl.config(run_file).learning.secure_aggregation


def test_reconstruction_with_shared_coefficients_is_pycryptodomes() -> None:
    from Crypto.Protocol.SecretSharing import Shamir

    for n in (3, 10, 31):
        t = secagg.threshold(n)
        for _ in range(3):
            secret = bytes(np.random.default_rng(n).integers(0, 256, 16, dtype=np.uint8))
            shares = Shamir.split(t, n, secret)[n - t :]
            assert secagg.combine(shares) == Shamir.combine(shares) == secret


def test_the_broker_lets_each_member_send_only_its_own_secure_aggregation_steps() -> None:
    from protocol import acl, topics

    grants = {g.user: g for g in acl.fleet_grants("lab", ["pi-1", "pi-2"], "coordinator")}
    agent, coordinator = grants["pi-1"], grants["coordinator"]
    for kind in ("keys", "masked", "reveal"):
        assert agent.may_publish(topics.round_topic("lab", 3, kind, "pi-1"))
        assert not agent.may_publish(topics.round_topic("lab", 3, kind, "pi-2"))
    assert agent.may_publish(topics.round_topic("lab", 3, "shares", "pi-1", to="coordinator"))
    assert not agent.may_publish(topics.round_topic("lab", 3, "keylist", "coordinator"))
    for kind in ("keylist", "survivors"):
        assert coordinator.may_publish(topics.round_topic("lab", 3, kind, "coordinator"))
    assert coordinator.may_publish(topics.round_topic("lab", 3, "shares", "coordinator", to="pi-1"))
