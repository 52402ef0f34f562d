"""FedBuff (`--strategy fedbuff`): the buffered rule, its simulated runs on the virtual clock,
and what it refuses."""

from __future__ import annotations

import math

import pytest
import torch

from agent.experiment import ExperimentConfig
from agent.learning import Payload, ServerState, Upload, preset
from agent.learning.buffering import buffer_size
from agent.learning.central.fedbuff import Buffer, ClientNoise, FedBuff
from agent.learning.staleness import staleness_weight
from coordinator.simulate import simulate


def upload(value: float) -> Upload:
    return Upload(Payload({"w": torch.full((2,), value), "n": torch.tensor(7)}), 10)


def start(size: int, max_staleness: int = 5, rule: str = "polynomial") -> Buffer:
    return Buffer(
        ServerState({"w": torch.zeros(2), "n": torch.tensor(0)}), size, rule, max_staleness
    )


def test_a_version_is_the_staleness_weighted_sum_of_k_deltas_over_k() -> None:
    buffer = start(2)
    assert buffer.offer("a", upload(1.0), 0).version is None  # one of two: no version yet
    offer = buffer.offer("b", upload(3.0), 0)
    assert offer.version == 1 and offer.staleness == 0
    assert torch.allclose(buffer.server.weights["w"], torch.full((2,), 2.0))
    assert int(buffer.server.weights["n"]) == 0  # counters carry no delta
    # Two more: one trained from version 0 (1 stale, its delta against version 0's model),
    # one from version 1.
    buffer.offer("a", upload(4.0), 0)
    offer = buffer.offer("b", upload(2.0), 1)
    assert offer.version == 2 and offer.staleness == 0
    expected = 2.0 + (staleness_weight(1) * (4.0 - 0.0) + 1.0 * (2.0 - 2.0)) / 2
    assert math.isclose(float(buffer.server.weights["w"][0]), expected, rel_tol=1e-6)
    assert buffer.applied == [[("a", 0), ("b", 0)], [("a", 1), ("b", 0)]]


def test_the_staleness_rule_weighs_the_deltas() -> None:
    constant = start(1, max_staleness=10, rule="constant")
    hinge = start(1, max_staleness=10, rule="hinge")
    for buffer in (constant, hinge):
        for _ in range(6):  # six versions, each from one update on the newest
            buffer.offer("a", upload(float(buffer.version + 1)), buffer.version)
    late_c, late_h = constant.offer("z", upload(10.0), 0), hinge.offer("z", upload(10.0), 0)
    assert late_c.staleness == late_h.staleness == 6
    # Delta 10 against version 0's zeros, K = 1: constant takes it whole, hinge 1/21 of it.
    assert math.isclose(float(constant.server.weights["w"][0]), 6.0 + 10.0, rel_tol=1e-6)
    assert math.isclose(float(hinge.server.weights["w"][0]), 6.0 + 10.0 / 21, rel_tol=1e-6)


def test_an_update_staler_than_max_staleness_is_dropped() -> None:
    buffer = start(1, max_staleness=2)
    for _ in range(3):
        buffer.offer("a", upload(1.0), buffer.version)
    before = buffer.server.weights["w"].clone()
    offer = buffer.offer("late", upload(100.0), 0)
    assert offer == type(offer)(staleness=3, taken=False)
    assert torch.equal(buffer.server.weights["w"], before) and not buffer.pending
    assert buffer.offer("ok", upload(3.0), 1).taken  # 2 stale: within the bound
    assert 0 not in buffer.kept  # versions older than the bound are forgotten


def test_the_synchronous_contract_is_the_unweighted_mean() -> None:
    server = ServerState({"w": torch.zeros(2), "n": torch.tensor(0)})
    uploads = {"a": upload(1.0), "b": upload(5.0)}
    result = FedBuff().aggregate(None, server, uploads)  # type: ignore[arg-type]
    assert torch.allclose(result.server.weights["w"], torch.full((2,), 3.0))


class Facts:
    """What `ClientNoise` reads of the model's facts: the generator of a draw."""

    @staticmethod
    def generator(purpose: str, agent: str, round_: int) -> torch.Generator:
        return torch.Generator().manual_seed(len(purpose) * 1000 + len(agent) * 10 + round_)


def test_client_dp_clips_noises_each_version_and_takes_one_update_a_device() -> None:
    buffer = start(2)
    buffer.dp = ClientNoise(noise=1.0, clip=1.0, facts=Facts())  # type: ignore[arg-type]
    buffer.offer("a", upload(10.0), 0)  # its delta (norm 14.1) clipped to norm 1
    assert buffer.offer("a", upload(2.0), 0).held  # a second one waits for the next version
    offer = buffer.offer("b", upload(0.0), 0)
    assert offer.version == 1 and buffer.applied[0] == [("a", 0), ("b", 0)]
    drawn = Facts.generator("client-dp", "aggregator", 1)
    noise = torch.normal(0.0, 1.0, (2,), generator=drawn)
    expected = (1 / math.sqrt(2) + noise.double()) / 2
    assert torch.allclose(buffer.server.weights["w"], expected.float(), atol=1e-6)
    assert buffer.pending[0][0] == "a" and not buffer.held  # the held one, offered again


def test_simulate_under_client_dp_counts_each_upload_as_a_release() -> None:
    report = simulate(config(rounds=3, buffer_size=2, dp="client"))
    epsilons = [a["epsilon"] for a in report["rounds"][-1]["agents"].values()]
    assert all(e is not None and e > 0 for e in epsilons)


@pytest.mark.parametrize(
    ("configured", "agents", "k"), [(0, 5, 2), (0, 100, 34), (0, 1, 1), (7, 5, 7)]
)
def test_the_default_buffer_is_a_third_of_the_fleet(configured: int, agents: int, k: int) -> None:
    assert buffer_size(configured, agents) == k


def config(rounds: int = 4, agents: int = 4, **learning: object) -> ExperimentConfig:
    return ExperimentConfig(
        dataset="digits",
        agents=agents,
        seed=5,
        learning=preset("fedbuff", rounds=rounds, epochs=1, **learning),
    )


def test_simulate_runs_versions_on_the_virtual_clock_deterministically() -> None:
    report = simulate(config(rounds=4, buffer_size=2))
    assert [r["round"] for r in report["rounds"]] == [1, 2, 3, 4]
    times = [r["finished_at"] for r in report["rounds"]]
    assert times == sorted(times) and times[0] > 0
    for record in report["rounds"]:
        assert len(record["applied"]) == 2
        for entry in record["applied"]:
            agent = record["agents"][entry["agent"]]
            assert agent["bytes_sent"] > 0 and agent["staleness"] is not None
    # The same arrival order (all boards alike: ties by roster order) gives stale updates
    # from the second version on, and the same numbers on a second run.
    stalenesses = [e["staleness"] for r in report["rounds"] for e in r["applied"]]
    assert stalenesses[:2] == [0, 0] and max(stalenesses) >= 1
    again = simulate(config(rounds=4, buffer_size=2))
    assert again["rounds"] == report["rounds"]
    assert 0.2 < report["summary"]["mean_accuracy"] <= 1.0


def test_a_slow_board_does_not_hold_the_versions_back() -> None:
    # Every bundled board, from a Raspberry Pi 4 to an x86 laptop: the versions come at the
    # fast boards' pace; the slow boards' updates are taken late, with their staleness.
    report = simulate(
        ExperimentConfig(
            dataset="digits",
            agents=6,
            seed=5,
            profiles="mixed",
            learning=preset("fedbuff", rounds=8, epochs=1, buffer_size=2, max_staleness=8),
        )
    )
    applied = [e for r in report["rounds"] for e in r["applied"]]
    counts = {k: sum(e["agent"] == k for e in applied) for k in report["config"]["roster"]}
    assert len(applied) == 16 and max(counts.values()) > min(counts.values())
    assert max(e["staleness"] for e in applied) >= 2


@pytest.mark.parametrize(
    ("learning", "message"),
    [
        ({"dp": "client", "max_epsilon": 8.0}, "--max-epsilon with fedbuff is not built yet"),
        ({"early_stop": True}, "--early-stop does not apply to fedbuff"),
        ({"aggregation": "median"}, "leave --aggregation and --clip at their defaults"),
    ],
)
def test_what_fedbuff_refuses_in_one_line(learning: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as refused:
        ExperimentConfig(
            dataset="digits", agents=3, learning=preset("fedbuff", **learning)
        ).validate()
    assert "\n" not in str(refused.value)


def test_simulate_counts_progress_as_versions_times_agents() -> None:
    """The progress bar's total is `--rounds` x agents: each version counts once per agent,
    whatever the updates per version (K = 2 of 4 agents here)."""
    told: list[tuple[int, str]] = []
    simulate(config(rounds=3, buffer_size=2), lambda t, k: told.append((t, k)))
    roster = [f"agent-{i:03d}" for i in range(4)]
    assert told == [(t, k) for t in (1, 2, 3) for k in roster]
