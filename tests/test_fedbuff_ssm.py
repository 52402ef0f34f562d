"""FedBuff-SSM (`--strategy fedbuff-ssm`): FedAdam-SSM's sparse uploads into FedBuff's buffer.
The rule on weights and both moments, whole-state versions a device that skipped versions
takes as they are, and its simulated runs on the virtual clock."""

from __future__ import annotations

import pytest
import torch

from agent.experiment import ExperimentConfig
from agent.learning import Payload, ServerState, Upload, models, preset
from agent.learning.central.fedbuff import Buffer
from agent.learning.central.fedbuff_ssm import FedBuffSSM
from agent.learning.learner import Learner
from agent.learning.staleness import staleness_weight
from agent.runtime.codec import decode_broadcast, encode_state
from coordinator.simulate import simulate

SSM = FedBuffSSM()


def upload(mask: list[bool], w: list[float], m: list[float], v: list[float]) -> Upload:
    """An SSM upload of one 3-entry tensor `x`: w's delta in full under its mask, the
    moments' deltas as values in the mask's order."""
    return Upload(
        Payload(
            {"w:x": torch.tensor(w), "m:x": torch.tensor(m), "v:x": torch.tensor(v)},
            {"w:x": torch.tensor(mask)},
        ),
        10,
    )


def start(size: int) -> Buffer:
    server = ServerState(
        {"x": torch.zeros(3), "bn": torch.ones(3)}, {"x": torch.zeros(3)}, {"x": torch.ones(3)}
    )
    return Buffer(server, size, "polynomial", 5, deltas=SSM.update_delta)


def test_a_version_moves_weights_and_both_moments_by_the_weighted_deltas_over_k() -> None:
    buffer = start(2)
    buffer.offer("a", upload([True, False, False], [2.0, 0, 0], [1.0], [0.5]), 0)
    offer = buffer.offer("b", upload([False, True, False], [0, 4.0, 0], [2.0], [-0.5]), 0)
    assert offer.version == 1
    server = buffer.server
    assert server.weights["x"].tolist() == [1.0, 2.0, 0.0]
    assert server.m is not None and server.v is not None
    assert server.m["x"].tolist() == [0.5, 1.0, 0.0]
    assert server.v["x"].tolist() == [1.25, 0.75, 1.0]
    assert server.weights["bn"].tolist() == [1.0, 1.0, 1.0]  # buffers stay on the devices
    # A stale update's deltas are its own (taken on the device against its base), weighted.
    buffer.offer("a", upload([False, False, True], [0, 0, 2.0], [2.0], [-4.0]), 0)
    buffer.offer("b", upload([False, False, True], [0, 0, 0], [0.0], [0.0]), 1)
    w = staleness_weight(1)
    assert buffer.server.weights["x"][2].item() == pytest.approx(w * 2.0 / 2)
    assert buffer.server.m is not None and buffer.server.v is not None
    assert buffer.server.m["x"][2].item() == pytest.approx(w * 2.0 / 2)
    # V may not go negative: Adam divides by its square root.
    assert buffer.server.v["x"][2].item() == max(0.0, 1.0 - w * 4.0 / 2)


def test_a_device_that_skipped_versions_takes_the_newest_whole() -> None:
    model = models.build_model("mlp", (64,), 10, seed=3)
    learner = Learner(model, (64,), models.prunable_names(model), preset("fedbuff-ssm"), seed=3)
    facts = learner.facts
    start_state = SSM.init_server(facts)
    newest = ServerState(
        {n: t + 1.0 for n, t in start_state.weights.items()},
        {n: torch.full_like(t, 0.25) for n, t in (start_state.m or {}).items()},
        {n: torch.full_like(t, 0.5) for n, t in (start_state.v or {}).items()},
    )
    body = encode_state(SSM.version_payload(newest).weights)
    view = SSM.receive(start_state, decode_broadcast(SSM, facts, body))
    for name, tensor in newest.weights.items():
        assert torch.equal(view.weights[name], tensor)
    assert view.m is not None and view.v is not None and newest.m and newest.v
    assert all(torch.equal(view.m[n], newest.m[n]) for n in newest.m)
    assert all(torch.equal(view.v[n], newest.v[n]) for n in newest.v)


def config(**learning: object) -> ExperimentConfig:
    return ExperimentConfig(
        dataset="digits",
        agents=4,
        seed=5,
        learning=preset("fedbuff-ssm", rounds=4, epochs=1, buffer_size=2, **learning),
    )


def test_simulate_runs_fedbuff_ssm_versions_deterministically_with_sparse_uploads() -> None:
    report = simulate(config())
    assert [r["round"] for r in report["rounds"]] == [1, 2, 3, 4]
    assert all(len(r["applied"]) == 2 for r in report["rounds"])
    assert simulate(config())["rounds"] == report["rounds"]
    dense = simulate(config(ssm_fraction=1.0))
    sent = [a["bytes_sent"] for r in report["rounds"] for a in r["agents"].values()]
    dense_sent = [a["bytes_sent"] for r in dense["rounds"] for a in r["agents"].values()]
    assert 0 < sum(sent) < sum(dense_sent) / 2  # the shared mask's saving is kept
    assert 0.1 < report["summary"]["mean_accuracy"] <= 1.0


@pytest.mark.parametrize(
    ("learning", "message"),
    [
        ({"secure_aggregation": True}, "--secure-aggregation with fedbuff-ssm is not built"),
        ({"aggregation": "median"}, "leave --aggregation and --clip at their defaults"),
        ({"dp": "client"}, "fedbuff-ssm"),
    ],
)
def test_fedbuff_ssm_refuses_what_it_does_not_take_in_one_line(
    learning: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=message) as refused:
        config(**learning).validate()
    assert "\n" not in str(refused.value)
