"""Client-level differential privacy (`--dp client`): each device clips its update on the
device, the aggregator adds Gaussian noise to their sum, the accountant's epsilon per round,
and `--max-epsilon` ending the run before a release would pass it, in simulate and on real
processes over a real broker."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import dp_accounting
import pytest
import torch
from click.testing import CliRunner
from dp_accounting import rdp

from agent.experiment import ExperimentConfig
from agent.learning import Learner, LocalData, Upload, central_strategy, preset, privacy
from agent.learning.central import client_dp
from agent.learning.central.base import Payload, ServerState
from agent.learning.central.participant import Turn
from agent.learning.models import build_model, prunable_names
from coordinator.cli import main as coordinator
from coordinator.emulate import Emulation, EmulationOptions
from coordinator.simulate import simulate

INPUT = (1, 40)
ROSTER = 3

pytestmark = pytest.mark.timeout(600)


def _learner(strategy: str, **overrides: Any) -> tuple[Learner, LocalData]:
    model = build_model("cnn1d", INPUT, 10, seed=0)
    config = preset(strategy, rounds=3, epochs=2, batch_size=8, lr=0.5, **overrides)
    learner = Learner(model, INPUT, prunable_names(model), config, seed=5)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(48, *INPUT, generator=g), torch.randint(0, 10, (48,), generator=g)
    return learner, LocalData(x[:32], y[:32], x[32:40], y[32:40], x[40:], y[40:])


def _fit(strategy: str, **overrides: Any) -> tuple[Any, ServerState]:
    """One participant's round 1 under `strategy`, and the view it trained from."""
    learner, data = _learner(strategy, **overrides)
    central = central_strategy(strategy)
    server = central.init_server(learner.facts)
    turn = Turn.of("agent-000", 1, ["agent-000", "agent-001"], None)
    part = None
    if central.downloads:
        part = central.download(learner.facts, server, "agent-000", 1, turn.p_k)
    view = turn.view(server, part)
    state = learner.init_agent("agent-000")
    return turn.train(central, learner, state, data, view), view


def config(strategy: str = "fedavg", rounds: int = 3, **learning: Any) -> ExperimentConfig:
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
            dp="client",
            dp_noise=1.1,
            dp_clip=0.5,
            **learning,
        ),
    )


def epsilons(report: dict) -> dict[tuple[int, str], float]:
    return {(r["round"], k): a["epsilon"] for r in report["rounds"] for k, a in r["agents"].items()}


def accuracies(report: dict) -> dict[tuple[int, str], float]:
    return {
        (r["round"], k): a["accuracy"] for r in report["rounds"] for k, a in r["agents"].items()
    }


def library_epsilon(noise: float, rounds: int, delta: float) -> float:
    """dp-accounting's own figure for `rounds` Gaussian releases (every agent in each)."""
    accountant = rdp.RdpAccountant(orders=list(privacy.ORDERS))
    accountant.compose(dp_accounting.GaussianDpEvent(noise), rounds)
    return float(accountant.get_epsilon(delta))


# -------------------------------------------------------------------- the device's clip


@pytest.mark.parametrize("strategy", ["fedavg", "fedspu", "feddrop"])
def test_a_participant_uploads_an_update_of_norm_at_most_the_clip(strategy: str) -> None:
    plain, view = _fit(strategy)
    unclipped = client_dp.update_norm(plain.upload, view.weights)
    clip = unclipped / 4  # well inside what it trained: the clip must act
    private, view = _fit(strategy, dp="client", dp_clip=clip, dp_noise=1.0)
    assert client_dp.update_norm(private.upload, view.weights) == pytest.approx(clip, rel=1e-5)
    # The clip scales the update (it keeps its direction) on the entries the upload carries,
    # and leaves the model the device keeps as it trained it.
    for name, sent in private.upload.weights.items():
        carried = client_dp.held(private.upload)[name]
        want = view.weights[name] + (plain.upload.weights[name] - view.weights[name]) / 4
        assert torch.allclose(sent[carried], want[carried], atol=1e-6), name
        assert torch.equal(sent[~carried], plain.upload.weights[name][~carried]), name
    assert all(torch.equal(private.state.weights[n], t) for n, t in plain.state.weights.items())
    assert private.state.dp_steps == 1 and plain.state.dp_steps == 0


def test_an_update_inside_the_clip_is_sent_as_it_is() -> None:
    plain, view = _fit("fedavg")
    unclipped = client_dp.update_norm(plain.upload, view.weights)
    private, _ = _fit("fedavg", dp="client", dp_clip=unclipped * 2)
    assert all(torch.equal(private.upload.weights[n], t) for n, t in plain.upload.weights.items())


# ------------------------------------------------------------------ the aggregator's noise


def test_the_sum_gets_noise_of_sigma_times_the_clip_and_the_shares_sum_to_it() -> None:
    summed = {"w": torch.zeros(200_000), "count": torch.zeros(3, dtype=torch.int64)}
    noised = client_dp.noised_sum(summed, 2.0, 0.5, torch.Generator().manual_seed(1))
    assert float(noised["w"].std()) == pytest.approx(1.0, rel=0.02)
    assert torch.equal(noised["count"], summed["count"])  # a count is not a value to noise
    shares = [
        client_dp.noise_share(summed, 2.0, 0.5, 25, torch.Generator().manual_seed(s))["w"]
        for s in range(25)
    ]
    assert float(torch.stack(shares).sum(0).std()) == pytest.approx(1.0, rel=0.02)


def test_the_aggregate_is_the_unweighted_mean_of_the_clipped_updates_plus_noise_over_n() -> None:
    learner, _ = _learner("fedavg", dp="client", dp_clip=1e6, dp_noise=0.7 / 1e6)
    strategy = central_strategy("fedavg")
    server = strategy.init_server(learner.facts)
    g = torch.Generator().manual_seed(3)
    uploads = {
        k: Upload(
            Payload({n: t + torch.randn(t.shape, generator=g) for n, t in server.weights.items()}),
            num_samples=samples,
        )
        for k, samples in (("a", 10), ("b", 1000), ("c", 5))
    }
    aggregate = client_dp.aggregate(strategy, learner.facts, server, uploads, 4)
    mean = {
        n: sum(u.payload.weights[n] for u in uploads.values()) / 3 for n in server.weights
    }  # unweighted: the claimed sample counts change nothing
    noise = client_dp.gaussian(
        server.weights,
        0.7 / 1e6 * 1e6,
        learner.facts.generator(client_dp.NOISE_PURPOSE, "aggregator", 4),
    )
    for name, got in aggregate.server.weights.items():
        assert torch.allclose(got, mean[name] + noise[name] / 3, atol=1e-5), name
        assert torch.equal(aggregate.broadcast.weights[name], got)
    first = next(iter(mean))
    assert not torch.allclose(aggregate.server.weights[first], mean[first], atol=1e-2)


def test_the_aggregator_clips_an_update_that_skipped_the_devices_clip() -> None:
    learner, _ = _learner("fedavg", dp="client", dp_clip=0.5, dp_noise=1e-9)
    strategy = central_strategy("fedavg")
    server = strategy.init_server(learner.facts)
    honest = {n: t + 1e-3 for n, t in server.weights.items()}
    wild = {n: t + 1e3 for n, t in server.weights.items()}
    uploads = {"honest": Upload(Payload(honest), 10), "wild": Upload(Payload(wild), 10)}
    aggregate = client_dp.aggregate(strategy, learner.facts, server, uploads, 1)
    moved = client_dp.update_norm(Payload(aggregate.server.weights), server.weights)
    assert moved <= (0.5 + client_dp.update_norm(Payload(honest), server.weights)) / 2 + 1e-6


# ----------------------------------------------------------------- the accountant, a run


def test_epsilon_is_the_library_figure_for_the_rounds_run() -> None:
    report = simulate(config())
    for (t, k), epsilon in epsilons(report).items():
        assert epsilon == pytest.approx(library_epsilon(1.1, t, 1e-5), rel=1e-9), (t, k)
    assert report["summary"]["max_epsilon"] == pytest.approx(library_epsilon(1.1, 3, 1e-5))


@pytest.mark.parametrize(
    "flags, error",
    [
        (
            ["--strategy", "dadpfl"],
            "--dp client is for fedavg, fedavg-ft, fedspu, feddrop, fedbuff: dadpfl",
        ),
        (["--strategy", "fedadam"], "fedadam uploads Adam's moments too"),
        (["--strategy", "fedldf"], "fedldf does not upload models trained from the server's"),
        (["--aggregation", "mean"], "--dp client averages the clipped updates unweighted"),
        (["--clip", "auto"], "leave --aggregation and --clip at their defaults"),
        (["--fp16"], "--dp client sends updates at full precision: drop --fp16"),
        (["--max-epsilon", "0.5"], "--max-epsilon 0.5 is below one round's epsilon"),
        (["--dp-clip", "-1"], "--dp-clip must be in (0, 1e+09], got -1.0"),
    ],
)
def test_bad_client_dp_flags_get_one_line(flags: list[str], error: str) -> None:
    args = ["simulate", "--dataset", "synthetic", "--agents", "3", "--rounds", "1"]
    result = CliRunner().invoke(
        coordinator, [*args, "--strategy", "fedavg", "--dp", "client", *flags]
    )
    assert result.exit_code != 0
    assert error in result.output
    assert "Traceback" not in result.output
    assert len([line for line in result.output.splitlines() if "Error" in line]) == 1


# ---------------------------------------------------------- real processes, real broker


@pytest.mark.parametrize("strategy", ["fedavg", "fedspu"])
def test_max_epsilon_ends_the_run_before_a_release_passes_it_in_emulate_as_in_simulate(
    amqtt_broker, tmp_path: Path, strategy: str
) -> None:
    limit = (library_epsilon(1.1, 2, 1e-5) + library_epsilon(1.1, 3, 1e-5)) / 2
    cfg = config(strategy, rounds=5, max_epsilon=limit)
    simulated = simulate(cfg)
    opts = EmulationOptions(workdir=tmp_path / "fleet", linger_s=20.0, agents_per_process=ROSTER)
    emulated = Emulation(cfg, amqtt_broker.address, opts).run()
    assert emulated["summary"]["failed_agents"] == {}
    spent = f"privacy budget spent: epsilon {library_epsilon(1.1, 2, 1e-5):.3g} at delta 1e-05"
    for report in (simulated, emulated):
        stopped = report["summary"]["stopped"]
        assert set(stopped) == {f"agent-{k:03d}" for k in range(ROSTER)}
        assert all(s["reason"] == spent and s["round"] == 2 for s in stopped.values())
        assert max(t for t, _ in epsilons(report)) == 2
        assert report["summary"]["max_epsilon"] <= limit
    assert epsilons(emulated) == pytest.approx(epsilons(simulated), rel=1e-12)
    assert accuracies(emulated) == pytest.approx(accuracies(simulated), abs=1e-6)


def test_the_release_guard_stops_the_aggregator_at_the_limit() -> None:
    cfg = config(max_epsilon=(library_epsilon(1.1, 2, 1e-5) + library_epsilon(1.1, 3, 1e-5)) / 2)
    assert privacy.release_spent(cfg.learning, 2) is None
    reason = privacy.release_spent(cfg.learning, 3)
    assert reason is not None and reason.startswith("privacy budget spent: epsilon ")
    unlimited = dataclasses.replace(cfg.learning, max_epsilon=None)
    assert privacy.release_spent(unlimited, 100) is None
    line = privacy.released(cfg.learning, 3)
    assert line == f"privacy spent: epsilon {library_epsilon(1.1, 3, 1e-5):.3g} at delta 1e-05"
    assert not math.isnan(library_epsilon(1.1, 3, 1e-5))


# ------------------------------------------------------------------------- the dashboard

DASHBOARD_PAGE = """JSON.stringify({
  cards: [...document.querySelectorAll("#summary .card")].map((c) => c.textContent),
  epsilon: [...document.querySelectorAll("#fleet tbody [data-field=epsilon]")]
    .map((td) => td.textContent),
})"""


def dp_fleet(dp: str, epsilons: dict[str, float | None]) -> Any:
    """A dashboard's fleet state fed each agent's status after round 2 of a `--dp` run."""
    from coordinator.dashboard import FleetState
    from protocol import messages, topics
    from tests.test_dashboard import FLEET, RUN, presence, record

    state = FleetState(FLEET)
    for agent, epsilon in epsilons.items():
        state.feed(*presence(agent))
        data = record(agent, 2, 0.8, epsilon=epsilon).as_dict()
        metrics = {"accuracy": 0.8, "epsilon": epsilon, "strategy": "fedavg", "dp": dp}
        message = messages.Status(
            fleet=FLEET, sender=agent, run_id=RUN, round=2, state="training",
            metrics=metrics | {"record": data},
        )  # fmt: skip
        state.feed(topics.status(FLEET, agent), messages.encode(message))
    return state


def test_the_fleet_summary_carries_the_runs_epsilon_and_whose_it_is() -> None:
    client = dp_fleet("client", {"a": 2.5, "b": 2.5})
    (fleet,) = client.snapshot(series=False)["fleets"]
    assert (fleet["epsilon"], fleet["dp"]) == (2.5, "client")
    sample = dp_fleet("sample", {"a": 1.25, "b": 3.75})
    (fleet,) = sample.snapshot(series=False)["fleets"]
    assert (fleet["epsilon"], fleet["dp"]) == (3.75, "sample"), "the weakest device's"
    (plain,) = dp_fleet("", {"a": None}).snapshot(series=False)["fleets"]
    assert "epsilon" not in plain


@pytest.mark.parametrize(
    "dp, epsilons, card",
    [
        ("client", {"a": 2.5, "b": 2.5}, "2.5ε, client-level (the run's)"),
        ("sample", {"a": 1.25, "b": 3.75}, "3.75max ε, sample-level (per device)"),
    ],
)
def test_the_dashboard_page_shows_epsilon(
    chromium: Any, dp: str, epsilons: dict[str, float], card: str
) -> None:
    from coordinator.dashboard import Dashboard

    served = Dashboard(dp_fleet(dp, epsilons), port=0)
    served.start()
    try:
        chromium.call("Page.navigate", url=served.url)
        page: dict[str, Any] = {}
        for _ in range(200):
            page = json.loads(chromium.evaluate(DASHBOARD_PAGE) or "{}")
            if page and page["epsilon"]:
                break
            time.sleep(0.05)
    finally:
        served.stop()
    assert card in page["cards"], page
    assert page["epsilon"] == [f"{e:g}" for e in epsilons.values()], page
