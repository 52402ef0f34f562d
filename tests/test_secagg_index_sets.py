"""Secure aggregation over an index set agreed before masking, in one process: FedLDF (each
device masks its change on the layers it was asked for, the coordinator divides each layer
by the weight of the survivors it asked) and the FedAdam family (three deltas in one vector;
Top and SSM over the union of the devices' top-k masks). The result is the plain round's
aggregate within quantization, with devices dropping before upload and before reveal. Real
processes: tests/test_secagg_runs.py."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from agent.experiment import ExperimentConfig
from agent.learning import adam, central_strategy, ldf, preset
from agent.learning.central.base import CentralStrategy, Payload, ServerState, Upload
from agent.learning.central.fedadam import FedAdam, model_parameters, moment_payload
from agent.learning.central.secure import (
    SUM,
    chooses_entries,
    device_support,
    device_vector,
    flat_change,
    from_support,
    layer_parts,
    on_support,
    round_upload,
    summed_names,
    union,
    vector_length,
)
from agent.learning.central.secure_moments import SECOND_MOMENT_SCALE
from agent.learning.model_facts import ModelFacts
from coordinator.simulate import Simulation, simulate
from protocol import ProtocolError, secagg
from protocol.masks import pack_mask, unpack_mask

SAMPLES = {"a": 40, "b": 75, "c": 120, "d": 60, "e": 90}
DROPS = [
    {},
    {"drop_after_shares": ["b"]},
    {"drop_after_upload": ["d"]},
]
DROP_IDS = ["none", "before-upload", "before-reveal"]


@functools.cache
def facts(strategy: str, ldf_n: int = 2) -> ModelFacts:
    extra = {"ldf_n": ldf_n} if strategy == "fedldf" else {}
    cfg = ExperimentConfig(
        dataset="mnist1d",
        agents=2,
        seed=5,
        learning=preset(strategy, rounds=1, aggregation="mean", secure_aggregation=True, **extra),
    )
    return Simulation(cfg).learner.facts


def plain(
    strategy: CentralStrategy, learner: ModelFacts, server: ServerState, uploads: dict[str, Payload]
) -> ServerState:
    sent = {k: Upload(p, SAMPLES[k]) for k, p in uploads.items()}
    return strategy.aggregate(learner, server, sent).server


def summed(vectors: dict[str, np.ndarray], dropped: dict) -> secagg.InProcessSum:
    weights = {k: SAMPLES[k] for k in vectors}
    return secagg.sum_in_process(secagg.Context("index-sets", 2), vectors, weights, **dropped)


def tolerance(survivors: list[str], scale: float = 1.0) -> float:
    """The quantization bound of the sum over the smallest weight that can divide an entry,
    over the block's scale, and float32's rounding of the result."""
    smallest = min(SAMPLES[k] for k in survivors) / sum(SAMPLES.values())
    return secagg.quantization_bound(len(survivors)) / smallest / scale + 1e-6


# ---------------------------------------------------------------------------------- FedLDF


def ldf_round(learner: ModelFacts) -> tuple[ServerState, dict[str, dict], dict[str, list[str]]]:
    """The server, each device's trained model (a random step from it, its own size per
    layer so that the selection differs), and the layers the server asks of each."""
    strategy = central_strategy("fedldf")
    server = strategy.init_server(learner)
    generator = torch.Generator().manual_seed(7)
    trained = {}
    for k in SAMPLES:
        trained[k] = {
            n: t
            + 0.05 * torch.rand((), generator=generator) * torch.randn(t.shape, generator=generator)
            if torch.is_floating_point(t)
            else t.clone()
            for n, t in server.weights.items()
        }
    groups = learner.layer_groups
    divergences = {k: ldf.divergences(w, server.weights, groups) for k, w in trained.items()}
    return server, trained, strategy.select(learner, divergences)


@pytest.mark.parametrize("dropped", DROPS, ids=DROP_IDS)
@pytest.mark.parametrize("n", [1, 2])
def test_secure_fedldf_is_the_plain_aggregate_within_quantization(dropped: dict, n: int) -> None:
    strategy, learner = central_strategy("fedldf"), facts("fedldf", n)
    server, trained, asked = ldf_round(learner)
    assert any(asked.values()) and not all(
        len(a) == len(learner.layer_groups) for a in asked.values()
    )
    groups = learner.layer_groups
    responses = {k: Payload(ldf.partial_state(w, asked[k], groups)) for k, w in trained.items()}
    names = summed_names(strategy, learner)
    vectors = {k: flat_change(names, r, server) for k, r in responses.items()}
    result = summed(vectors, dropped)
    u3 = result.survivors
    parts = layer_parts(learner, server, {k: asked[k] for k in u3})
    upload = round_upload(
        strategy, learner, server, result.mean, {k: SAMPLES[k] for k in u3}, parts
    )
    secure = strategy.aggregate(learner, server, {SUM: upload}).server.weights
    want = plain(strategy, learner, server, {k: responses[k] for k in u3 if responses[k].weights})
    tol = tolerance(u3)
    for name, t in want.weights.items():
        if torch.is_floating_point(t):
            assert torch.allclose(secure[name].double(), t.double(), rtol=0, atol=tol), name
    # A layer none of the survivors was asked for keeps the server's value, as in the plain round.
    kept = [layer for layer in groups if not any(layer in asked[k] for k in u3)]
    if dropped.get("drop_after_shares") and n == 1:
        assert kept  # b was the only one asked for some layer
    for layer in kept:
        for name in groups[layer]:
            assert torch.equal(secure[name], server.weights[name]), name


# ---------------------------------------------------------------------------------- FedAdam


def adam_uploads(strategy: CentralStrategy, learner: ModelFacts) -> dict[str, Payload]:
    """Each device's upload: random deltas of W, M and V at the sizes local Adam gives
    (~1e-2, ~1e-3, ~1e-5; V's positive), sparsified as the strategy sparsifies them."""
    params = model_parameters(learner.initial, learner)
    generator = torch.Generator().manual_seed(13)

    def delta(scale: float) -> dict[str, torch.Tensor]:
        return {n: scale * torch.randn(t.shape, generator=generator) for n, t in params.items()}

    uploads = {}
    for k in SAMPLES:
        dv = {n: t.abs() for n, t in delta(1e-5).items()}
        assert isinstance(strategy, FedAdam)
        mode = strategy.mode
        w, m, v = adam.compress(delta(1e-2), delta(1e-3), dv, learner.config.ssm_fraction, mode)
        uploads[k] = moment_payload(w, m, v, mode)
    return uploads


def secure_adam(
    strategy: CentralStrategy,
    learner: ModelFacts,
    server: ServerState,
    uploads: dict[str, Payload],
    dropped: dict,
) -> tuple[ServerState, list[str], int]:
    names = summed_names(strategy, learner)
    whole = {k: device_vector(strategy, learner, names, u, server) for k, u in uploads.items()}
    support = None
    if chooses_entries(strategy):
        supports = {k: device_support(strategy, names, u) for k, u in uploads.items()}
        support = union(supports, vector_length(strategy, learner))
    cut = {k: on_support(v, support) for k, v in whole.items()}
    vectors = {k: v for k, v in cut.items() if v is not None}
    result = summed(vectors, dropped)
    u3 = result.survivors
    mean = from_support(result.mean, support)
    upload = round_upload(strategy, learner, server, mean, {k: SAMPLES[k] for k in u3})
    length = next(iter(vectors.values())).size
    return strategy.aggregate(learner, server, {SUM: upload}).server, u3, length


@pytest.mark.parametrize("dropped", DROPS, ids=DROP_IDS)
@pytest.mark.parametrize("name", ["fedadam", "fedadam-top", "fedadam-ssm"])
def test_secure_fedadam_is_the_plain_aggregate_within_quantization(
    name: str, dropped: dict
) -> None:
    strategy, learner = central_strategy(name), facts(name)
    server = strategy.init_server(learner)
    uploads = adam_uploads(strategy, learner)
    secure, u3, length = secure_adam(strategy, learner, server, uploads, dropped)
    want = plain(strategy, learner, server, {k: uploads[k] for k in u3})
    tol = tolerance(u3)
    for got, expected, scale in (
        (secure.weights, want.weights, 1.0),
        (secure.m, want.m, 1.0),
        (secure.v, want.v, SECOND_MOMENT_SCALE),
    ):
        assert got is not None and expected is not None
        for n, t in expected.items():
            assert torch.allclose(got[n].double(), t.double(), rtol=0, atol=tolerance(u3, scale)), n
    # V's deltas (~1e-5) are scaled before masking: V comes through within a thousandth of
    # the eps (1e-6) beside which the local step divides by it (unscaled: 2e-8).
    assert secure.v is not None and want.v is not None
    v_error = max(float((secure.v[n] - want.v[n]).abs().max()) for n in want.v)
    assert v_error < 1e-9
    # Top-k masks over the union: shorter than the whole vector of three deltas, unless dense.
    if chooses_entries(strategy):
        assert length < vector_length(strategy, learner)
    else:
        assert length == vector_length(strategy, learner)
    assert tol > 0


def test_a_device_whose_masks_missed_the_union_is_left_out() -> None:
    """A device masks only over the agreed entries: one with a delta outside the union (its
    masks came too late) sends nothing rather than a part of its update."""
    strategy, learner = central_strategy("fedadam-top"), facts("fedadam-top")
    server = strategy.init_server(learner)
    uploads = adam_uploads(strategy, learner)
    names = summed_names(strategy, learner)
    supports = {k: device_support(strategy, names, u) for k, u in uploads.items() if k != "e"}
    support = union(supports, vector_length(strategy, learner))
    late = device_vector(strategy, learner, names, uploads["e"], server)
    assert on_support(late, support) is None
    on_time = device_vector(strategy, learner, names, uploads["a"], server)
    cut = on_support(on_time, support)
    assert cut is not None and np.array_equal(from_support(cut, support), on_time)


@pytest.mark.parametrize("name", ["fedldf", "fedadam", "fedadam-top", "fedadam-ssm"])
def test_simulate_runs_them_secure_as_the_plain_run(name: str) -> None:
    """`coordinator simulate` takes each round from the in-process secure sum over the round's
    index set: every agent's figures are the plain run's; FedAdam-Top and -SSM's masked
    vectors are the union of the top-k masks long, more than a device's own k values."""

    def run(secure: bool) -> dict:
        extra = {"ldf_n": 2} if name == "fedldf" else {}
        cfg = ExperimentConfig(
            dataset="mnist1d",
            agents=4,
            partition="dirichlet:0.5",
            seed=3,
            learning=preset(
                name, rounds=2, epochs=1, aggregation="mean", secure_aggregation=secure, **extra
            ),
        )
        return simulate(cfg)

    secure, plain = run(True), run(False)
    for what in ("loss", "accuracy"):
        got, want = figures(secure, what), figures(plain, what)
        assert len(got) == 8 and got == pytest.approx(want, abs=1e-4), what
    sent = figures(secure, "nonzeros_sent")
    length = vector_length(central_strategy(name), facts(name))
    if chooses_entries(central_strategy(name)):
        assert all(figures(plain, "nonzeros_sent")[k] < v < length for k, v in sent.items())
    else:
        assert set(sent.values()) == {length}


def figures(report: dict, what: str) -> dict[tuple[int, str], float]:
    return {(r["round"], k): a[what] for r in report["rounds"] for k, a in r["agents"].items()}


def test_a_support_travels_in_the_smallest_mask_encoding_and_garbage_is_refused() -> None:
    """A `Support` carries a device's top-k masks as the codec's smallest mask encoding (at
    k = 5% a few bits an entry, not a byte); a receiver refuses one that is not a mask of
    the round's vector length, before it allocates it."""
    rng = np.random.default_rng(3)
    mask = rng.random(24_000) < 0.05
    packed = pack_mask(mask)
    assert len(packed) < mask.size / 8 / 2
    assert np.array_equal(unpack_mask(packed, mask.size), mask)
    for garbage in (b"", b"\xc1", b"\x92\x03\xc4\x01\x05", pack_mask(rng.random(800) < 0.5)):
        with pytest.raises(ProtocolError):
            unpack_mask(garbage, mask.size)
