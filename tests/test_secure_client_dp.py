"""Client-level DP under secure aggregation (`--dp client --secure-aggregation`, distributed
DP): each device clips its update and adds its seeded share of the noise before masking,
the secure sum is the unweighted mean of the clipped updates plus the round's noise, a sum
over fewer survivors than the noise is sized for is never unmasked, and the epsilon is the
plain client-DP run's."""

from __future__ import annotations

import math
from typing import Any

import dp_accounting
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from dp_accounting import rdp

from agent.experiment import ExperimentConfig
from agent.learning import Learner, central_strategy, preset, privacy
from agent.learning.central import client_dp, secure_dp
from agent.learning.central.base import Payload
from agent.learning.central.secure import flat_change, summed_names
from agent.learning.models import build_model, prunable_names
from agent.runtime.secure_rounds import SecureSteps
from coordinator.cli import main as coordinator
from coordinator.secure_sum import noised_sum_check
from coordinator.simulate import simulate
from protocol import secagg

INPUT = (1, 40)
CONTEXT = secagg.Context("test", 1)


def _learner(**overrides: Any) -> Learner:
    model = build_model("cnn1d", INPUT, 10, seed=0)
    config = preset("fedavg", dp="client", secure_aggregation=True, **overrides)
    return Learner(model, INPUT, prunable_names(model), config, seed=5)


def _round(learner: Learner, members: int, round_: int, dropped: tuple[str, ...] = ()) -> tuple:
    """One secure round of `members` devices, each with a clipped random update (norm C):
    the secure mean, the clipped updates' unweighted mean over the survivors, the survivors."""
    strategy = central_strategy("fedavg")
    facts = learner.facts
    server = strategy.init_server(facts)
    names = summed_names(strategy, facts)
    g = torch.Generator().manual_seed(round_)
    vectors, changes = {}, {}
    for i in range(members):
        k = f"agent-{i:03d}"
        moved = {n: t + torch.randn(t.shape, generator=g) for n, t in server.weights.items()}
        upload = client_dp.clip_update(Payload(moved), server.weights, facts.config.dp_clip)
        changes[k] = flat_change(names, upload, server)
        vectors[k] = secure_dp.private_change(facts, names, upload, server, k, round_, members)
    ones = dict.fromkeys(vectors, 1)
    summed = secagg.sum_in_process(CONTEXT, vectors, ones, drop_after_shares=dropped)
    assert summed.clipped == 0
    plain = sum(changes[k] for k in summed.survivors) / len(summed.survivors)
    return summed.mean, plain, summed.survivors


def test_the_secure_mean_is_the_unweighted_mean_of_the_clipped_updates() -> None:
    learner = _learner(dp_clip=0.5, dp_noise=1e-12)
    mean, plain, survivors = _round(learner, 5, 1)
    assert len(survivors) == 5
    # every device weighs 1 over |U1|; the sum's rounding is half a step per member
    assert np.abs(mean - plain).max() <= 5 * secagg.quantization_bound(5)
    assert np.abs(plain).max() > 1e-3  # the updates moved the model


def test_the_noise_on_the_mean_is_sigma_c_over_n_sized_for_the_fewest_survivors() -> None:
    sigma, clip, n = 1.5, 0.5, 10
    learner = _learner(dp_clip=clip, dp_noise=sigma)
    draws = np.concatenate([np.subtract(*_round(learner, n, t)[:2]) for t in range(1, 4)])
    floor = secure_dp.survivors_floor(n)
    assert floor == 7
    want = sigma * clip / n * math.sqrt(n / floor)  # sigma C / n, and the 70% margin
    assert float(draws.std()) == pytest.approx(want, rel=0.03)
    assert float(draws.mean()) == pytest.approx(0.0, abs=3 * want / math.sqrt(draws.size))


def test_dropouts_take_their_noise_with_them_down_to_the_accountants_sigma() -> None:
    sigma, clip, n = 1.5, 0.5, 10
    learner = _learner(dp_clip=clip, dp_noise=sigma)
    dropped = ("agent-002", "agent-005", "agent-009")
    mean, plain, survivors = _round(learner, n, 1, dropped)
    assert len(survivors) == 7
    # the survivors' shares alone: sigma_eff C / |U3| on the mean, sigma_eff = sigma here
    sigma_eff = secure_dp.effective_noise(sigma, n, len(survivors))
    assert sigma_eff == pytest.approx(sigma)
    assert float((mean - plain).std()) == pytest.approx(sigma_eff * clip / 7, rel=0.05)
    assert secure_dp.effective_noise(sigma, n, n) > secure_dp.effective_noise(sigma, n, 8) > sigma


def test_a_sum_over_fewer_survivors_than_the_noise_is_sized_for_is_not_unmasked() -> None:
    config = preset("fedavg", dp="client", secure_aggregation=True, dp_noise=1.0)
    noised_sum_check(config, 2, 10, 7)
    with pytest.raises(secagg.SecAggError, match="6 of 10 uploaded; the noise is sized for"):
        noised_sum_check(config, 2, 10, 6)
    plain = preset("fedavg", aggregation="mean", secure_aggregation=True)
    noised_sum_check(plain, 2, 10, 2)  # without --dp client any quorum is summed


def test_the_noise_shares_are_seeded_by_agent_and_round() -> None:
    learner = _learner(dp_clip=0.5, dp_noise=1.0)
    strategy = central_strategy("fedavg")
    server = strategy.init_server(learner.facts)
    names = summed_names(strategy, learner.facts)
    upload = Payload(server.weights)

    def share(agent: str, round_: int) -> np.ndarray:
        return secure_dp.private_change(learner.facts, names, upload, server, agent, round_, 4)

    assert np.array_equal(share("agent-000", 1), share("agent-000", 1))
    assert not np.array_equal(share("agent-000", 1), share("agent-001", 1))
    assert not np.array_equal(share("agent-000", 1), share("agent-000", 2))


def test_a_devices_noise_share_is_secret_unless_the_lab_asks_for_seeded_noise() -> None:
    """On a networked device the share comes from the OS's randomness (the fleet seed is the
    coordinator's, which could otherwise draw the share again and subtract it); only
    `--dp-seeded-noise` draws it from the run's seed."""
    from agent.runtime import secure_vector

    learner = _learner(dp_clip=0.5, dp_noise=1.0)
    strategy = central_strategy("fedavg")
    server = strategy.init_server(learner.facts)
    names = summed_names(strategy, learner.facts)
    upload = Payload(server.weights)
    seeded = secure_dp.private_change(learner.facts, names, upload, server, "agent-000", 1, 4)
    secret = [
        secure_dp.private_change(
            learner.facts, names, upload, server, "agent-000", 1, 4,
            generator=secure_vector.secret_generator(),
        )
        for _ in range(2)
    ]  # fmt: skip
    assert not np.array_equal(secret[0], seeded) and not np.array_equal(*secret)
    assert preset("fedavg", dp="client", secure_aggregation=True).dp_seeded_noise is False


def library_epsilon(noise: float, rounds: int, delta: float) -> float:
    accountant = rdp.RdpAccountant(orders=list(privacy.ORDERS))
    accountant.compose(dp_accounting.GaussianDpEvent(noise), rounds)
    return float(accountant.get_epsilon(delta))


def _config(secure: bool, **learning: Any) -> ExperimentConfig:
    return ExperimentConfig(
        dataset="mnist1d",
        agents=4,
        partition="dirichlet:0.5",
        seed=7,
        learning=preset(
            "fedavg",
            epochs=1,
            batch_size=64,
            dp="client",
            dp_clip=0.5,
            secure_aggregation=secure,
            **learning,
        ),
    )


def test_a_simulated_secure_run_spends_the_plain_runs_epsilon_and_stops_at_the_limit() -> None:
    limit = (library_epsilon(1.1, 2, 1e-5) + library_epsilon(1.1, 3, 1e-5)) / 2
    report = simulate(_config(True, rounds=4, dp_noise=1.1, max_epsilon=limit))
    rounds = report["rounds"]
    assert [r["round"] for r in rounds] == [1, 2]  # --max-epsilon ends it before round 3
    for r in rounds:
        for agent in r["agents"].values():
            assert agent["epsilon"] == pytest.approx(library_epsilon(1.1, r["round"], 1e-5))
    assert report["summary"]["max_epsilon"] <= limit


def test_with_little_noise_a_simulated_secure_run_is_the_plain_client_dp_run() -> None:
    secure = simulate(_config(True, rounds=3, dp_noise=1e-6))
    plain = simulate(_config(False, rounds=3, dp_noise=1e-6))
    # the two runs draw their (tiny) noise apart, which a few rounds of SGD carry on: a
    # sample or two changes its class
    for what, within in (("loss", 1e-3), ("strategy_accuracy", 0.02)):
        got = {(r["round"], k): a[what] for r in secure["rounds"] for k, a in r["agents"].items()}
        want = {(r["round"], k): a[what] for r in plain["rounds"] for k, a in r["agents"].items()}
        assert got == pytest.approx(want, abs=within), what
    losses = [r["agents"]["agent-000"]["loss"] for r in secure["rounds"]]
    assert losses[-1] < losses[0]  # it learns


@pytest.mark.parametrize(
    "flags, error",
    [
        (["--dp-clip", "5"], "--dp-clip 5 with --dp-noise 1 reaches 35 per entry, past the"),
        (["--aggregation", "median"], "--dp client averages the clipped updates unweighted"),
        (["--strategy", "fedadam"], "fedadam uploads Adam's moments too"),
    ],
)
def test_what_still_cannot_run_gets_one_line(flags: list[str], error: str) -> None:
    args = ["simulate", "--dataset", "synthetic", "--agents", "3", "--rounds", "1"]
    common = ["--strategy", "fedavg", "--dp", "client", "--secure-aggregation"]
    result = CliRunner().invoke(coordinator, [*args, *common, *flags])
    assert result.exit_code != 0
    assert error in result.output
    assert "Traceback" not in result.output
    assert len([line for line in result.output.splitlines() if "Error" in line]) == 1


def test_a_device_reveals_nothing_for_fewer_survivors_than_its_noise_is_sized_for() -> None:
    client = secagg.Client("agent-000", CONTEXT)
    members = [f"agent-{i:03d}" for i in range(10)]
    client.adverts = {k: secagg.Client(k, CONTEXT).advert(1) for k in members}
    steps = SecureSteps(None, "coordinator", 1.0)  # type: ignore[arg-type]  # unused here
    assert steps._noised_enough(1, members[:7], client)
    assert not steps._noised_enough(1, members[:6], client)


@pytest.mark.parametrize("name", ["fedspu", "feddrop"])
def test_client_dp_under_secure_aggregation_is_refused_for_partial_uploads(name: str) -> None:
    """FedSPU's and FedDrop's secure rounds average each entry over the devices that trained
    it; the devices' noise shares, sized for the whole round, would not cover those entries
    evenly: refused in one line rather than run with noise the accountant does not count."""
    result = CliRunner().invoke(
        coordinator,
        ["simulate", "--strategy", name, "--dp", "client", "--secure-aggregation",
         "--dataset", "digits", "--agents", "3", "--rounds", "1"],
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    line = result.output.strip().splitlines()[-1]
    assert "built for fedavg and fedavg-ft" in line and name in line
