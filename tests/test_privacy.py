"""Sample-level differential privacy (`--dp sample`): DP-SGD's per-sample clipping and noise
in the device's training step, the accountant's epsilon in every round's record, and
`--max-epsilon` stopping a device before a round would pass it, in simulate and on real
processes over a real broker."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import dp_accounting
import pytest
import torch
from click.testing import CliRunner
from dp_accounting import rdp

from agent.experiment import ExperimentConfig
from agent.learning import Learner, LocalData, preset, privacy
from agent.learning.config import SampleDP, SGDConfig
from agent.learning.models import build_model, prunable_names
from agent.learning.training import train_local
from coordinator.cli import main as coordinator
from coordinator.emulate import Emulation, EmulationOptions
from coordinator.simulate import simulate

INPUT = (1, 40)
ROSTER = 3

pytestmark = pytest.mark.timeout(600)


def _setup(strategy: str = "dadpfl", **overrides: object) -> tuple[Learner, LocalData]:
    model = build_model("cnn1d", INPUT, 10, seed=0)
    config = preset(strategy, rounds=10, epochs=1, batch_size=16, **overrides)
    learner = Learner(model, INPUT, prunable_names(model), config, seed=5)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(48, *INPUT, generator=g), torch.randint(0, 10, (48,), generator=g)
    return learner, LocalData(x[:32], y[:32], x[32:40], y[32:40], x[40:], y[40:])


def config(strategy: str, rounds: int = 3, **learning: Any) -> ExperimentConfig:
    extra = {"neighbours": 2} if strategy == "dadpfl" else {}
    return ExperimentConfig(
        dataset="mnist1d",
        agents=ROSTER,
        partition="dirichlet:0.5",
        seed=7,
        round_time_s=0.01,
        learning=preset(
            strategy,
            rounds=rounds,
            epochs=1,
            batch_size=64,
            dp="sample",
            dp_noise=1.1,
            **extra,
            **learning,
        ),
    )


def library_epsilon(noise: float, rate: float, steps: int, delta: float) -> float:
    """dp-accounting's own figure for `steps` Poisson-sampled Gaussian steps."""
    accountant = rdp.RdpAccountant(orders=list(privacy.ORDERS))
    event = dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(noise))
    accountant.compose(dp_accounting.SelfComposedDpEvent(event, steps))
    return float(accountant.get_epsilon(delta))


def epsilons(report: dict) -> dict[tuple[int, str], float]:
    return {(r["round"], k): a["epsilon"] for r in report["rounds"] for k, a in r["agents"].items()}


def accuracies(report: dict) -> dict[tuple[int, str], float]:
    return {
        (r["round"], k): a["accuracy"] for r in report["rounds"] for k, a in r["agents"].items()
    }


# ----------------------------------------------------------------------------- the step


def test_clipping_bounds_what_one_sample_adds_to_the_step() -> None:
    learner, data = _setup()
    model = learner.facts.model
    x, y = data.x_train[:8].clone(), data.y_train[:8]
    dp = SampleDP(noise=0.0, clip=0.5)
    generator = torch.Generator().manual_seed(0)

    def step_of(inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        privacy.private_gradients_(model, inputs, labels, learner.facts.task, dp, 8.0, generator)
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    without = step_of(x[1:], y[1:])
    for scale in (1.0, 1e3, 1e6):  # however wild the sample, it moves the step by C / B
        wild = x.clone()
        wild[0] *= scale
        added = (step_of(wild, y) - without).norm()
        assert added <= dp.clip / 8 * (1 + 1e-4)
    # Unclipped, the wild sample alone moves the plain gradient far more than that.
    model.zero_grad()
    learner.facts.task.loss(model(wild[:1]), y[:1]).backward()
    assert torch.cat([p.grad.flatten() for p in model.parameters()]).norm() / 8 > dp.clip / 8


def test_vmap_and_the_per_sample_loop_give_the_same_gradients() -> None:
    learner, data = _setup()
    model = learner.facts.model
    trained = dict(model.named_parameters())
    x, y = data.x_train[:6], data.y_train[:6]
    vmapped, losses = privacy.per_sample_gradients(model, x, y, learner.facts.task, trained)
    looped, looped_losses = privacy.looped_gradients(model, x, y, learner.facts.task, trained)
    for name in trained:
        assert torch.allclose(vmapped[name], looped[name], atol=1e-5), name
    assert torch.allclose(losses, looped_losses, atol=1e-6)


def test_masked_and_frozen_entries_stay_as_they_were_under_dp() -> None:
    learner, data = _setup()
    agent = learner.init_agent("a")
    sgd = SGDConfig(
        lr=0.5, momentum=0.9, batch_size=8, epochs=2, privacy=SampleDP(noise=2.0, clip=1.0)
    )
    name = next(iter(agent.masks))
    frozen = {name: torch.rand(agent.masks[name].shape) < 0.5}
    result = train_local(
        learner.facts.model,
        agent.weights,
        agent.masks,
        data.x_train,
        data.y_train,
        sgd,
        1,
        torch.Generator().manual_seed(1),
        frozen=frozen,
    )
    for n, mask in agent.masks.items():
        assert torch.all(result.state[n][~mask] == 0), n
        assert torch.any(result.state[n][mask] != agent.weights[n][mask]), n
    still = ~frozen[name]
    assert torch.equal(result.state[name][still], agent.weights[name][still])
    assert result.dp_steps == 2 * 4  # two epochs of 32 samples in expected batches of 8


def test_a_batchnorm_model_is_refused_in_one_line() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    cfg = preset("fedavg", dp="sample")
    with pytest.raises(ValueError, match=r"BatchNorm mixes a batch's samples"):
        privacy.check_run(cfg, model, {"a": 100})


# ------------------------------------------------------------------------- simulate


@pytest.mark.parametrize("strategy", ["dadpfl", "fedavg", "fedadam"])
def test_epsilon_grows_every_round_as_the_library_composes_it(strategy: str) -> None:
    cfg = config(strategy)
    report = simulate(cfg)
    from agent.workload import build_workload

    data = build_workload(cfg, [f"agent-{k:03d}" for k in range(ROSTER)]).data
    for k, local in data.items():
        n = len(local.y_train)
        # One epoch of expected batches of 64; DA-DPFL's RigL reads one more batch a round.
        per_round = -(-n // 64) + (1 if strategy == "dadpfl" else 0)
        rate = min(64, n) / n
        shown = [epsilons(report)[(t, k)] for t in (1, 2, 3)]
        assert shown == sorted(shown) and shown[0] < shown[2], k
        for t, epsilon in zip((1, 2, 3), shown, strict=True):
            want = library_epsilon(1.1, rate, t * per_round, 1e-5)
            assert epsilon == pytest.approx(want, rel=1e-9), (k, t)
    assert report["summary"]["max_epsilon"] == max(epsilons(report).values())


def test_a_plain_run_reports_no_epsilon() -> None:
    report = simulate(dataclasses.replace(config("fedavg"), learning=preset("fedavg", rounds=1)))
    assert all(e is None for e in epsilons(report).values())
    assert "max_epsilon" not in report["summary"]


@pytest.mark.parametrize(
    "flags, error",
    [
        (["--dp-noise", "2"], "--dp-noise has no effect here: it applies to runs with --dp"),
        (["--dp", "sample", "--dp-delta", "1"], "--dp-delta must be in (0, 1), got 1.0"),
        (["--dp", "sample", "--dp-clip", "0"], "--dp-clip must be in (0, 1e+09], got 0.0"),
        (["--max-epsilon", "4"], "--max-epsilon has no effect here"),
        (["--dp", "sample", "--max-epsilon", "0.01"], "--max-epsilon 0.01 is below one round"),
    ],
)
def test_bad_privacy_flags_get_one_line(flags: list[str], error: str) -> None:
    args = ["simulate", "--dataset", "synthetic", "--agents", "3", "--rounds", "1", *flags]
    result = CliRunner().invoke(coordinator, args)
    assert result.exit_code != 0
    assert error in result.output
    assert "Traceback" not in result.output
    assert len([line for line in result.output.splitlines() if "Error" in line]) == 1


# ---------------------------------------------------------- real processes, real broker


def limit_between_rounds(report: dict) -> float:
    """A `--max-epsilon` that every agent's first round stays under and some agent's third
    round passes."""
    shown = epsilons(report)
    first = max(e for (t, _), e in shown.items() if t == 1)
    third = max(e for (t, _), e in shown.items() if t == 3)
    return first + (third - first) / 4


@pytest.mark.parametrize("strategy", ["dadpfl", "fedavg"])
def test_max_epsilon_stops_devices_before_they_pass_it_in_emulate_as_in_simulate(
    amqtt_broker, tmp_path: Path, strategy: str
) -> None:
    limit = limit_between_rounds(simulate(config(strategy)))
    cfg = config(strategy, rounds=4, max_epsilon=limit)
    simulated = simulate(cfg)
    opts = EmulationOptions(workdir=tmp_path / "fleet", linger_s=20.0, agents_per_process=ROSTER)
    emulated = Emulation(cfg, amqtt_broker.address, opts).run()
    assert emulated["summary"]["failed_agents"] == {}
    for report in (simulated, emulated):
        stopped = report["summary"]["stopped"]
        assert stopped, "the limit must stop some device"
        for saved in stopped.values():
            assert saved["reason"].startswith("privacy budget spent: epsilon ")
            assert saved["reason"].endswith(" at delta 1e-05")
            assert saved["round"] < 4
        assert all(e <= limit for e in epsilons(report).values())
    assert epsilons(emulated) == pytest.approx(epsilons(simulated), rel=1e-12)
    assert accuracies(emulated) == pytest.approx(accuracies(simulated), abs=1e-6)
    assert emulated["summary"]["stopped"].keys() == simulated["summary"]["stopped"].keys()


def test_a_status_keeps_a_plausible_epsilon_and_the_fleet_table_shows_it() -> None:
    from coordinator.fleet import AgentEntry, fleet_table
    from coordinator.status_figures import checked

    reason = "privacy budget spent: epsilon 7.9 at delta 1e-05"
    figures, problems = checked({"epsilon": 7.9, "stop_reason": reason}, 3)
    assert figures == {"epsilon": 7.9, "stop_reason": reason} and problems == []
    figures, problems = checked({"epsilon": -1.0}, 3)
    assert "epsilon" not in figures and problems[0][0] == "epsilon"
    entry = AgentEntry(fleet="f", agent="a", metrics={"epsilon": 7.9})
    columns = [c.header for c in fleet_table([entry]).columns]
    assert "epsilon" in columns
    plain = AgentEntry(fleet="f", agent="a", metrics={})
    assert "epsilon" not in [c.header for c in fleet_table([plain]).columns]
