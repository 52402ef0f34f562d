"""Secure aggregation of partial uploads (FedSPU, federated dropout) in one process: each
device masks its change over the whole model, 0 outside the part the coordinator sent it, and
the coordinator divides each entry of the unmasked sum by the weight of the devices that
trained it (`central.secure.part_mean`). The result is the plain round's aggregate within
quantization, dropouts included. Real processes: tests/test_secagg_runs.py."""

from __future__ import annotations

import functools

import pytest
import torch

from agent.experiment import ExperimentConfig
from agent.learning import central_strategy, preset
from agent.learning.central.base import CentralStrategy, Payload, ServerState, Upload
from agent.learning.central.secure import SUM, flat_change, part_mean, summed_names, summed_upload
from agent.learning.model_facts import ModelFacts
from coordinator.simulate import Simulation, simulate
from protocol import secagg

SAMPLES = {"a": 40, "b": 75, "c": 120, "d": 60, "e": 90}


@functools.cache
def facts(strategy: str) -> ModelFacts:
    cfg = ExperimentConfig(
        dataset="mnist1d",
        agents=2,
        seed=5,
        learning=preset(strategy, rounds=1, aggregation="mean", secure_aggregation=True),
    )
    return Simulation(cfg).learner.facts


def round_of(
    strategy: CentralStrategy, learner: ModelFacts, p_ks: dict[str, float]
) -> tuple[ServerState, dict[str, Payload], dict[str, Payload]]:
    """The server, each device's part of round 3, and its upload: its part moved by a random
    step (its values outside the part arbitrary, as a dropped sub-model's are)."""
    server = strategy.init_server(learner)
    parts, uploads = {}, {}
    generator = torch.Generator().manual_seed(7)
    for k, p_k in p_ks.items():
        parts[k] = strategy.download(learner, server, k, 3, p_k)
        moved = {}
        for n, t in server.weights.items():
            if torch.is_floating_point(t):
                step = 0.05 * torch.randn(t.shape, generator=generator)
                noise = 9.0 * torch.randn(t.shape, generator=generator)
                active = (parts[k].masks or {}).get(n, torch.ones_like(t, dtype=torch.bool))
                moved[n] = torch.where(active, t + step, noise)
            else:
                moved[n] = t.clone()
        uploads[k] = Payload(moved, parts[k].masks)
    return server, parts, uploads


def secure_aggregate(
    strategy: CentralStrategy,
    learner: ModelFacts,
    server: ServerState,
    parts: dict[str, Payload],
    uploads: dict[str, Payload],
    **dropped: list[str],
) -> tuple[dict[str, torch.Tensor], list[str]]:
    names = summed_names(strategy, learner)
    vectors = {k: flat_change(names, u, server) for k, u in uploads.items()}
    weights = {k: SAMPLES[k] for k in uploads}
    summed = secagg.sum_in_process(secagg.Context("parts", 3), vectors, weights, **dropped)
    u3 = summed.survivors
    mean = part_mean(summed.mean, names, {k: parts[k] for k in u3}, {k: weights[k] for k in u3})
    upload = summed_upload(names, server, mean, sum(weights[k] for k in u3))
    return strategy.aggregate(learner, server, {SUM: upload}).server.weights, u3


def plain_aggregate(
    strategy: CentralStrategy,
    learner: ModelFacts,
    server: ServerState,
    uploads: dict[str, Payload],
) -> dict[str, torch.Tensor]:
    sent = {k: Upload(u, SAMPLES[k]) for k, u in uploads.items()}
    return strategy.aggregate(learner, server, sent).server.weights


def tolerance(uploads: dict[str, Payload], survivors: list[str]) -> float:
    """The quantization bound of the sum over the smallest weight that can divide an entry,
    and float32's rounding of the result."""
    total = sum(SAMPLES[k] for k in uploads)
    smallest = min(SAMPLES[k] for k in survivors) / total
    return secagg.quantization_bound(len(survivors)) / smallest + 1e-6


def trainers(names: list[str], server: ServerState, parts: dict[str, Payload]):
    """Per entry of the summed vector, how many devices had it in their part."""
    ones = {n: torch.ones_like(server.weights[n]) for n in names}
    zeros = ServerState({n: torch.zeros_like(server.weights[n]) for n in names})
    return sum(flat_change(names, Payload(ones, p.masks), zeros) for p in parts.values())


MIXES = [
    {"a": 0.2, "b": 0.2, "c": 0.2},
    {"a": 0.2, "b": 0.4, "c": 0.6, "d": 0.8, "e": 1.0},
    {"a": 1.0, "b": 0.6, "c": 0.2, "d": 0.4},
]


@pytest.mark.parametrize("name", ["fedspu", "feddrop"])
@pytest.mark.parametrize("p_ks", MIXES, ids=["all-0.2", "tiers", "mixed"])
def test_the_secure_aggregate_of_parts_is_the_plain_one_within_quantization(
    name: str, p_ks: dict[str, float]
) -> None:
    strategy, learner = central_strategy(name), facts(name)
    server, parts, uploads = round_of(strategy, learner, p_ks)
    secure, u3 = secure_aggregate(strategy, learner, server, parts, uploads)
    plain = plain_aggregate(strategy, learner, server, uploads)
    tol = tolerance(uploads, u3)
    for n, want in plain.items():
        assert torch.allclose(secure[n].double(), want.double(), rtol=0, atol=tol), n
    # Entries trained by some devices only are divided by their weight alone; entries nobody
    # trained keep the server's value exactly (3 devices at 0.2 leave some untrained).
    names = summed_names(strategy, learner)
    counts = trainers(names, server, parts)
    assert (counts < len(parts)).any() and (counts > 0).any()
    if p_ks == MIXES[0]:
        assert (counts == 0).any()
        untrained = torch.cat([(secure[n] == server.weights[n]).flatten() for n in names])
        assert untrained.numpy()[counts == 0].all()


@pytest.mark.parametrize(
    "dropped",
    [{"drop_after_shares": ["b"]}, {"drop_after_upload": ["d"]}],
    ids=["before-upload", "before-reveal"],
)
def test_a_device_dropping_leaves_the_plain_aggregate_of_the_others(dropped: dict) -> None:
    strategy, learner = central_strategy("fedspu"), facts("fedspu")
    server, parts, uploads = round_of(strategy, learner, MIXES[1])
    secure, u3 = secure_aggregate(strategy, learner, server, parts, uploads, **dropped)
    gone = set(dropped.get("drop_after_shares", []))
    assert u3 == sorted(set(uploads) - gone)
    plain = plain_aggregate(strategy, learner, server, {k: uploads[k] for k in u3})
    tol = tolerance(uploads, u3)
    for n, want in plain.items():
        assert torch.allclose(secure[n].double(), want.double(), rtol=0, atol=tol), n


def test_a_masked_part_is_noise_over_the_whole_model() -> None:
    """A device's upload covers every entry, its part or not: the broker and the coordinator
    see a vector of the model's length whose values are uniform in the ring."""
    strategy, learner = central_strategy("fedspu"), facts("fedspu")
    server, parts, uploads = round_of(strategy, learner, {"a": 0.2, "b": 1.0})
    names = summed_names(strategy, learner)
    vectors = {k: flat_change(names, u, server) for k, u in uploads.items()}
    assert (vectors["a"] == 0).mean() > 0.5  # the part is small...
    summed = secagg.sum_in_process(secagg.Context("parts", 3), vectors, SAMPLES)
    masked = secagg.dequantize(summed.uploads["a"])
    assert masked.size == vectors["a"].size
    assert (masked == 0).mean() < 1e-3 and abs(masked).mean() > 1.0  # ...and hidden


def test_simulate_runs_secure_federated_dropout_as_the_plain_run() -> None:
    """`coordinator simulate` takes each round from the in-process secure sum of the parts it
    sent: the figures of every agent and round are the plain run's."""

    def run(secure: bool) -> dict[tuple[int, str], float]:
        cfg = ExperimentConfig(
            dataset="mnist1d",
            agents=4,
            partition="dirichlet:0.5",
            seed=3,
            learning=preset(
                "feddrop", rounds=2, epochs=1, aggregation="mean", secure_aggregation=secure
            ),
        )
        report = simulate(cfg)
        return {
            (r["round"], k): a["loss"] for r in report["rounds"] for k, a in r["agents"].items()
        }

    secure, plain = run(True), run(False)
    assert len(secure) == 8
    assert secure == pytest.approx(plain, abs=1e-5)
