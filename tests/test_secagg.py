"""Secure aggregation's cryptography (`protocol.secagg`, `protocol.secagg_graph`,
`protocol.shamir`): the masks cancel, over the complete graph and SecAgg+'s sparse one, the sum
survives 30% of the members dropping, one masked upload is noise, the coordinator gets
t shares of at most one secret of a member, quantization keeps its bound."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import edgefl
from protocol import secagg, secagg_graph, shamir
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


def test_the_threshold_keeps_a_majority_of_each_neighbourhood() -> None:
    for n in range(2, 400):
        k, t = secagg_graph.degree_and_threshold(n)
        assert 2 * t > k + 1  # t of the k + 1 holders: a majority
        if k == n - 1:  # complete: any 30% may drop
            assert n - t >= (3 * n) // 10
        else:
            assert k % 2 == 0 and k + 1 - t >= (3 * (k + 1)) // 10


def test_the_graph_is_sparse_from_40_members_and_complete_below() -> None:
    assert secagg_graph.degree_and_threshold(20) == (19, 14)
    assert secagg_graph.degree_and_threshold(50) == (32, 17)
    assert secagg_graph.degree_and_threshold(100) == (58, 30)
    assert secagg_graph.degree_and_threshold(1000)[0] < 200  # O(log n), not n


def connected(graph: dict[str, tuple[str, ...]], removed: set[str] = frozenset()) -> bool:
    left = set(graph) - removed
    start = min(left)
    seen, todo = {start}, [start]
    while todo:
        for peer in graph[todo.pop()]:
            if peer in left and peer not in seen:
                seen.add(peer)
                todo.append(peer)
    return seen == left


@pytest.mark.parametrize("n", [5, 41, 50, 100, 137])
def test_the_graph_is_regular_symmetric_connected_and_the_same_from_the_same_seed(n: int) -> None:
    members = [f"agent-{i:03d}" for i in range(n)]
    k, _ = secagg_graph.degree_and_threshold(n)
    graph = secagg.round_graph(CONTEXT, members)
    assert graph == secagg.round_graph(CONTEXT, list(reversed(members)))
    for member, around in graph.items():
        assert member in around and len(around) == k + 1  # itself and k neighbours
        assert all(member in graph[peer] for peer in around)
    assert connected(graph)
    gone = set(members[: (3 * n) // 10])  # 30% dropped: the rest still one piece
    assert connected(graph, gone)
    if k < n - 1:
        assert graph != secagg.round_graph(Context("run-1", 4), members)  # reseeded a round


@pytest.mark.parametrize("n", [8, 50])
def test_over_the_graph_the_pairwise_masks_cancel_exactly(n: int) -> None:
    clients = {f"a{i:02d}": Client(f"a{i:02d}", CONTEXT) for i in range(n)}
    adverts = {k: c.advert(1) for k, c in clients.items()}
    relayed = Server(CONTEXT, adverts).relay({k: c.shares(adverts) for k, c in clients.items()})
    total = np.zeros(300, dtype=np.uint32)
    for k, c in clients.items():
        c.receive_shares(relayed[k])
        assert set(c.held) == set(c.neighbours)
        y, _ = c.masked(np.zeros(300))
        total += y - secagg._self_mask(CONTEXT, c.self_seed, 300)
    assert not total.any()


def test_a_sum_over_the_graph_with_30_percent_dropped_is_recovered() -> None:
    values = vectors(50, length=300, seed=5)
    weights = {k: 3 + i for i, k in enumerate(sorted(values))}
    before, after = sorted(values)[:8], sorted(values)[8:15]  # 15 of 50 drop
    result = sum_in_process(
        CONTEXT, values, weights, drop_after_shares=before, drop_after_upload=after
    )
    counted = sorted(set(values) - set(before))
    assert result.survivors == counted
    error = np.abs(result.mean - exact_mean(values, weights, counted)).max()
    assert error <= secagg.quantization_bound(len(counted)) * len(values) / len(counted)


def _shared_round(n: int) -> tuple[dict[str, Client], Server]:
    """A round of `n` members up to the masked uploads: keys advertised, shares relayed."""
    clients = {f"a{i:02d}": Client(f"a{i:02d}", CONTEXT) for i in range(n)}
    adverts = {k: c.advert(1) for k, c in clients.items()}
    server = Server(CONTEXT, adverts)
    relayed = server.relay({k: c.shares(adverts) for k, c in clients.items()})
    for k, c in clients.items():
        c.receive_shares(relayed[k])
    return clients, server


def test_a_coordinator_sending_two_survivor_lists_gets_no_share_of_the_victims_key() -> None:
    """The lie that unmasks a victim: some of its neighbours told it uploaded (they reveal its
    self-mask seed's share), others that it dropped (its mask-key seed's). With the
    consistency check, a member reveals only if every forwarded signature is on the list it
    was sent and t of its neighbours signed it: forwarded whole, the signatures on the other
    list stop everyone; forwarded per list, those told the victim dropped (fewer than t) are
    too few to vouch for their list among each one's neighbours, and the others fall short
    of the round's quorum: nobody reveals."""
    clients, server = _shared_round(50)
    victim = "a07"
    holders = [h for h in server.graph[victim] if h != victim]
    lied_to = set(holders[::2])
    everyone, without = sorted(clients), sorted(set(clients) - {victim})
    told = {k: without if k in lied_to else everyone for k in clients}
    signatures = {k: c.consent(told[k]) for k, c in clients.items()}
    for k, c in clients.items():
        with pytest.raises(SecAggError, match="did not sign this survivor list"):
            c.reveal(told[k], signatures)
    for k, c in clients.items():
        same = {s: sig for s, sig in signatures.items() if told[s] == told[k]}
        few = "neighbours signed" if k in lied_to else "members signed"
        with pytest.raises(SecAggError, match=few):
            c.reveal(told[k], same)
    assert len(lied_to) < server.threshold


def test_a_coordinator_splitting_the_ring_at_the_victim_gets_no_reveal() -> None:
    """The lie a coordinator that knows the graph tells: the half-ring on one side of the
    victim that it uploaded, the other half that it dropped. Every member then holds t
    signatures on its list from its own neighbourhood (so that rule alone lets the coordinator
    rebuild one secret and all but one share of the other), but neither list has the
    round's quorum: nobody reveals."""
    clients, server = _shared_round(50)
    ring = secagg_graph._order(CONTEXT.info("graph"), sorted(clients))
    victim = ring[0]
    lied_to = set(ring[len(ring) // 2 + 1 :])
    everyone, without = sorted(clients), sorted(set(clients) - {victim})
    told = {k: without if k in lied_to else everyone for k in clients}
    signatures = {k: c.consent(told[k]) for k, c in clients.items()}
    for k, c in clients.items():
        same = {s: sig for s, sig in signatures.items() if told[s] == told[k]}
        assert len(set(same) & set(c.neighbours)) >= server.threshold
        with pytest.raises(SecAggError, match="members signed the survivor list"):
            c.reveal(told[k], same)


def test_a_member_reveals_only_for_the_list_it_signed_and_with_t_signatures() -> None:
    clients, server = _shared_round(10)
    survivors = sorted(clients)[:8]
    signatures = {k: clients[k].consent(survivors) for k in survivors}
    me = clients["a00"]
    with pytest.raises(SecAggError, match="not the one this member signed"):
        me.reveal(sorted(clients), signatures)
    few = dict(list(signatures.items())[: server.threshold - 1])
    with pytest.raises(SecAggError, match="revealing needs"):
        me.reveal(survivors, few)
    forged = {**signatures, "a01": signatures["a02"]}
    with pytest.raises(SecAggError, match="a01 did not sign"):
        me.reveal(survivors, forged)
    outsider = {**signatures, "a09": clients["a09"].signing.sign(b"x")}
    with pytest.raises(SecAggError, match="a09 did not sign"):
        me.reveal(survivors, outsider)
    with pytest.raises(SecAggError, match="not a subset"):
        me.consent(sorted(clients))  # signs once a round
    assert len(me.reveal(survivors, signatures)) == len(me.held)


def test_a_member_checks_only_the_signatures_revealing_counts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An Ed25519 verification is a device's largest cost of the round: with every one of 50
    signatures forwarded, a member checks the quorum's worth (t of its neighbours' among
    them) and reveals; a bad one among those it checks still stops it."""
    clients, server = _shared_round(50)
    survivors = sorted(clients)
    signatures = {k: c.consent(survivors) for k, c in clients.items()}
    checked: list[str] = []
    real = secagg.signed_by

    def counting(advert: secagg.Advert, signature: bytes, statement: bytes) -> bool:
        checked.append(next(k for k, c in clients.items() if c.advert(1) == advert))
        return real(advert, signature, statement)

    monkeypatch.setattr(secagg, "signed_by", counting)
    me = clients["a00"]
    assert len(me.reveal(survivors, signatures)) == len(me.held)
    assert len(checked) == secagg.quorum(50) < len(signatures)
    assert len(set(checked) & set(me.neighbours)) >= server.threshold
    other = clients["a01"]
    first = min(other.neighbours)  # the first it checks
    forged = {**signatures, first: signatures[max(other.neighbours)]}
    with pytest.raises(SecAggError, match=f"{first} did not sign"):
        other.reveal(survivors, forged)


def test_shares_from_a_member_outside_the_neighbourhood_are_refused() -> None:
    clients = {f"a{i:02d}": Client(f"a{i:02d}", CONTEXT) for i in range(50)}
    adverts = {k: c.advert(1) for k, c in clients.items()}
    sent = {k: c.shares(adverts) for k, c in clients.items()}
    me = clients["a00"]
    stranger = next(k for k in sorted(clients) if k not in me.neighbours)
    with pytest.raises(SecAggError, match="not a neighbour"):
        me.receive_shares({stranger: sent[stranger][next(iter(sent[stranger]))]})


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
    clients, _ = _shared_round(4)
    told = sorted(clients)[:3]
    signatures = {k: clients[k].consent(told) for k in told}
    first = clients["a00"].reveal(told, signatures)
    assert len(first["a03"]) == 16  # a03 dropped: its mask-key seed's share
    with pytest.raises(SecAggError):
        clients["a00"].reveal(told, signatures)  # once a round
    with pytest.raises(SecAggError):
        clients["a00"].reveal(sorted(clients), signatures)  # now claiming a03 survived


@pytest.mark.parametrize(
    ("options", "refusal"),
    [
        ({"strategy": "dispfl"}, "is for the centralized strategies .* each neighbour receives"),
        ({"strategy": "fedbuff-ssm"}, "with fedbuff-ssm is not built: its devices upload Adam's"),
        ({"strategy": "fedldf", "dp": "client"}, "--dp client is for .*: fedldf does not"),
        ({"strategy": "fedadam-top", "dp": "client"}, "fedadam-top uploads Adam's moments"),
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


def test_any_t_shares_rebuild_the_secret_and_fewer_do_not() -> None:
    rng = np.random.default_rng(7)

    def random(size: int) -> bytes:
        return bytes(rng.integers(0, 256, size, np.uint8))

    for t, holders in ((2, 3), (17, 33), (30, 59)):
        secret = shamir.secret_seed(random)
        xs = sorted(rng.choice(np.arange(1, 200), holders, replace=False).tolist())
        shares = shamir.split(secret, t, xs, random)
        for _ in range(3):
            some = sorted(rng.choice(xs, t, replace=False).tolist())
            assert shamir.combine([(x, shares[x]) for x in some]) == secret
        assert shamir.combine([(x, shares[x]) for x in xs[: t - 1]]) != secret
    with pytest.raises(shamir.ShamirError):
        shamir.combine([(1, b"\xff" * 16)])  # above the field


def test_the_broker_lets_each_member_send_only_its_own_secure_aggregation_steps() -> None:
    from protocol import acl, topics

    grants = {g.user: g for g in acl.fleet_grants("lab", ["pi-1", "pi-2"], "coordinator")}
    agent, coordinator = grants["pi-1"], grants["coordinator"]
    for kind in ("keys", "masked", "consent", "reveal"):
        assert agent.may_publish(topics.round_topic("lab", 3, kind, "pi-1"))
        assert not agent.may_publish(topics.round_topic("lab", 3, kind, "pi-2"))
    assert agent.may_publish(topics.round_topic("lab", 3, "shares", "pi-1", to="coordinator"))
    for kind in ("keylist", "survivors", "consent"):
        assert not agent.may_publish(topics.round_topic("lab", 3, kind, "coordinator"))
        assert coordinator.may_publish(topics.round_topic("lab", 3, kind, "coordinator"))
    assert coordinator.may_publish(topics.round_topic("lab", 3, "shares", "coordinator", to="pi-1"))
