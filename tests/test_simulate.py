"""The in-process simulator: round semantics, accounting, determinism, and its CLI."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import firmware_profiles
from agent.learning import Published, RoundTopology, preset, topology
from agent.learning.strategies import TABLE
from agent.runtime import model_message
from coordinator.simulate import ExperimentConfig, Simulation, simulate
from protocol import messages
from tests.processes import Processes

REPO = Path(__file__).resolve().parent.parent
SUMMARY_KEYS = {
    "mean_accuracy",
    "mean_sparsity",
    "busiest_agent_bytes",
    "total_bytes",
    "total_train_flops",
    "wall_seconds",
    "rounds",
    "t_star",
}


def small(strategy: str = "dadpfl", agents: int = 6, **learning: object) -> ExperimentConfig:
    learning = {"rounds": 3, "neighbours": 3, "epochs": 1, **learning}
    return ExperimentConfig(
        dataset="mnist1d",
        agents=agents,
        partition="dirichlet:0.5",
        seed=3,
        learning=preset(strategy, **learning),
    )


def without_wall_time(report: dict) -> dict:
    return {**report, "summary": {**report["summary"], "wall_seconds": None}}


def test_the_same_seed_gives_the_identical_report() -> None:
    first, second = simulate(small()), simulate(small())
    assert without_wall_time(first) == without_wall_time(second)
    assert set(first["summary"]) >= SUMMARY_KEYS
    other_seed = simulate(ExperimentConfig(**{**small().__dict__, "seed": 4}))
    assert other_seed["rounds"][-1]["agents"] != first["rounds"][-1]["agents"]


def test_agents_see_this_rounds_prior_models_and_last_rounds_others() -> None:
    simulation = Simulation(small(max_wait=2, rounds=3, neighbours=4))
    published: dict[tuple[int, str], Published] = {}
    seen: list[tuple[int, str, dict[str, Published]]] = []
    original = simulation.learner.local_round

    def recording_round(agent, data, inbox, round_, prune_now, **options):
        result = original(agent, data, inbox, round_, prune_now, **options)
        published[(round_, agent.agent_id)] = result.published
        seen.append((round_, agent.agent_id, dict(inbox)))
        return result

    simulation.learner.local_round = recording_round
    report = simulation.run()
    waited = 0
    for round_, k, inbox in seen:
        order = report["rounds"][round_ - 1]["order"]
        neighbours = topology.neighbours(3, round_, simulation.roster, k, 4)
        prior, posterior = topology.prior_posterior(order, neighbours, k, 2)
        assert set(inbox) == set(neighbours)
        for j in prior:
            assert inbox[j] is published[(round_, j)]
            waited += 1
        for j in posterior:
            if round_ > 1:
                assert inbox[j] is published[(round_ - 1, j)]
            else:
                assert inbox[j].weights.keys() == simulation.learner.facts.initial.keys()
    assert waited > 0, "the configuration should make some agents wait"


def test_traffic_is_the_size_of_the_real_messages() -> None:
    simulation = Simulation(small("dispfl", rounds=2))
    report = simulation.run()
    second = report["rounds"][1]["agents"]
    state = simulation.states["agent-000"]
    size = len(
        model_message(
            fleet="sim",
            sender="agent-000",
            run_id="sim",
            round_=2,
            weights=state.weights,
            masks=state.masks,
            num_samples=len(simulation.data["agent-000"].y_train),
        )
    )
    assert second["agent-000"]["bytes_sent"] == size
    first = report["rounds"][0]["agents"]
    assert all(a["bytes_received"] == 0 for a in first.values()), "round-0 models are derivable"
    assert all(a["bytes_received"] > 0 for a in second.values())
    assert sum(a["bytes_sent"] for a in second.values()) < sum(
        a["bytes_received"] for a in second.values()
    ), "one publish reaches several neighbours"
    kept = sum(int(m.sum()) for m in state.masks.values())
    dense = sum(w.numel() for n, w in state.weights.items() if n not in state.masks)
    assert second["agent-000"]["nonzeros_sent"] == kept + dense


def test_a_model_used_in_two_rounds_is_received_once() -> None:
    # A prior neighbour's round-t model is a posterior one's in round t + 1: a networked
    # agent keeps it (it is subscribed to it for both rounds), so it comes in once.
    cfg = small("dadpfl", rounds=3, max_wait=3)
    report = Simulation(cfg).run()
    roster = report["config"]["roster"]
    ballot = messages.Vote(fleet="sim", sender=roster[0], vote=True, score=0.0)
    vote = len(messages.encode(ballot))
    everyone = messages.bitmap(roster, roster)
    tally = messages.Tally(fleet="sim", sender="sim", done=everyone, voted=everyone, yes=everyone)
    size = {
        (r["round"], k): a["bytes_sent"] - (vote if a["vote"] is not None else 0)
        for r in report["rounds"]
        for k, a in r["agents"].items()
    }
    used_twice = 0
    for k in roster:
        needs: set[tuple[int, str]] = set()
        for t in range(1, cfg.learning.rounds + 1):
            topology = RoundTopology(cfg.seed, t, roster, cfg.learning)
            used_twice += len(needs & topology.needs(k))
            needs |= {(r, j) for r, j in topology.needs(k) if r >= 1}
        received = sum(r["agents"][k]["bytes_received"] for r in report["rounds"])
        voted = sum(r["agents"][k]["vote"] is not None for r in report["rounds"])
        tallies = voted * len(messages.encode(tally))
        assert received == sum(size[need] for need in needs) + tallies, k
    assert used_twice, "the case must reuse a model in the next round"


def test_further_pruning_starts_after_the_vote_and_stops_at_the_target() -> None:
    report = simulate(
        small(rounds=6, delta_pr=100.0, target_sparsity=0.7, pqi_eta_c=1.0, pqi_gamma=0.9)
    )
    assert report["summary"]["t_star"] == 1
    sparsity = [max(a["sparsity"] for a in r["agents"].values()) for r in report["rounds"]]
    assert sparsity[0] == pytest.approx(0.5, abs=0.01)
    assert sparsity[-1] > 0.6
    assert all(s <= 0.7 + 1e-3 for s in sparsity)
    assert report["rounds"][0]["agents"]["agent-000"]["vote"] is True
    assert not any(a["pruned"] for a in report["rounds"][0]["agents"].values())


def test_the_norm_distance_scores_lower_and_votes_earlier_than_the_squared_one() -> None:
    """D = ||w - w0|| instead of its square: the same training (until a vote passes), and from
    round 2 every score at most half the squared one while D stays above D^1, so agents vote
    "settled" earlier. Only the detection score and what follows from it change."""
    first = {"detection_scale": "first"}  # the paper's score, over D^1
    squared = simulate(small(rounds=4, delta_pr=1e-9, detection_distance="squared", **first))
    norm = simulate(small(rounds=4, delta_pr=1e-9, detection_distance="norm", **first))
    for sq_round, norm_round in zip(squared["rounds"], norm["rounds"], strict=True):
        for agent, sq in sq_round["agents"].items():
            other = norm_round["agents"][agent]
            assert other["accuracy"] == sq["accuracy"]
            if sq_round["round"] == 1:
                assert other["score"] == sq["score"] == 1.0
            else:
                assert 0 < other["score"] <= sq["score"] / 2 + 1e-12
    threshold = statistics.median(
        a["score"] for r in squared["rounds"][1:] for a in r["agents"].values()
    )
    votes = {
        kind: sum(
            a["vote"]
            for r in simulate(
                small(
                    rounds=4,
                    delta_pr=threshold,
                    target_sparsity=0.0,
                    detection_distance=kind,
                    **first,
                )
            )["rounds"]
            for a in r["agents"].values()
        )
        for kind in ("squared", "norm")
    }
    assert votes["norm"] > votes["squared"]


def test_dispfl_never_prunes_further_and_never_waits() -> None:
    report = simulate(small("dispfl", rounds=3, delta_pr=100.0))
    assert report["summary"]["t_star"] is None
    assert report["summary"]["mean_sparsity"] == pytest.approx(0.5, abs=0.01)


@pytest.mark.parametrize("strategy", ["dfedavgm", "local", "fedavg", "fedavg-ft"])
def test_baselines_run_on_the_same_code(strategy: str) -> None:
    report = simulate(small(strategy, rounds=2))
    summary = report["summary"]
    assert summary["mean_sparsity"] == 0.0
    assert 0.0 < summary["mean_accuracy"] <= 1.0
    assert summary["total_train_flops"] > 0
    if strategy == "local":
        assert summary["total_bytes"] == 0
    if strategy.startswith("fedavg"):
        assert summary["busiest_agent"] == "coordinator"
        assert "coordinator" in report["rounds"][0]


def test_fedavg_and_fedavg_ft_differ_only_in_what_they_evaluate() -> None:
    plain, tuned = simulate(small("fedavg", rounds=2)), simulate(small("fedavg-ft", rounds=2))
    assert plain["summary"]["total_train_flops"] == tuned["summary"]["total_train_flops"]
    assert plain["summary"]["total_bytes"] == tuned["summary"]["total_bytes"]
    strategy = "mean_strategy_accuracy"  # the global model's, and the fine-tuned models'
    assert plain["summary"][strategy] != tuned["summary"][strategy]
    # Each device holds both and keeps the better on its validation split, whichever the
    # strategy evaluates: what the devices keep is the same.
    assert plain["summary"]["mean_accuracy"] == tuned["summary"]["mean_accuracy"]


def test_sparse_training_costs_fewer_flops_than_dense() -> None:
    sparse_run = simulate(small("dispfl", rounds=1))
    dense_run = simulate(small("local", rounds=1))
    assert sparse_run["summary"]["total_train_flops"] < dense_run["summary"]["total_train_flops"]


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    code = "from coordinator.cli import main; main(prog_name='coordinator')"
    return subprocess.run(
        [sys.executable, "-c", code, "simulate", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(REPO), "COLUMNS": "120", "PATH": "/usr/bin:/bin"},
    )


def test_cli_writes_the_report_and_plots(tmp_path: Path) -> None:
    result = _cli(
        "--strategy",
        "dadpfl",
        "--dataset",
        "mnist1d",
        "--agents",
        "5",
        "--rounds",
        "2",
        "--partition",
        "dirichlet:0.3",
        "--neighbours",
        "2",
        "--max-wait",
        "1",
        "--seed",
        "1",
        "--epochs",
        "1",
        "--report",
        "out/report.json",
        "--plot",
        "plots",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "out/report.json").read_text())
    assert set(report) == {"config", "rounds", "summary"}
    assert set(report["summary"]) >= SUMMARY_KEYS
    assert report["config"]["learning"]["max_wait"] == 1
    assert len(report["rounds"]) == 2 and len(report["rounds"][0]["agents"]) == 5
    for name in ("accuracy.png", "sparsity.png", "accuracy_vs_bytes.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:4] == b"\x89PNG"
    assert "mean accuracy" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--agents", "4", "--neighbours", "5"], "--neighbours must be between 1 and"),
        (["--dataset", "nope"], "unknown dataset 'nope'"),
        (["--partition", "dirichlet:x"], "dirichlet"),
        (["--strategy", "dispfl", "--max-wait", "2"], "dispfl fixes --max-wait to 0"),
        (["--strategy", "bogus"], "Invalid value for '--strategy'"),
        (["--rounds", "many"], "'many' is not a valid integer"),
        (["--dataset", "npz:/no/such/file.npz"], "/no/such/file.npz"),
        (["--strategy", "fedavg", "--reduce", "freeze"], "--reduce has no effect here"),
        (["--reduce", "squash"], "Invalid value for '--reduce'"),
        (["--strategy", "fedadam", "--ssm-fraction", "0.1"], "--ssm-fraction has no effect"),
        (["--strategy", "fedavg", "--ldf-n", "2"], "--ldf-n has no effect here"),
        (["--ldf-n", "2"], "applies to fedldf and runs with --wire layers"),
        (["--stop-patience", "3"], "applies to runs with --early-stop"),
        (["--early-stop", "--stop-rule", "never"], "Invalid value for '--stop-rule'"),
        (["--early-stop", "--stop-rule", "paper", "--stop-delta", "0.2"], "--stop-rule progress"),
        (["--strategy", "fedldf", "--ldf-n", "0"], "--ldf-n must be >= 1"),
        (["--strategy", "fedavg", "--wire", "delta"], "--wire has no effect here"),
        (["--delta-fraction", "0.2"], "applies to runs with --wire delta"),
        (["--wire", "zip"], "Invalid value for '--wire'"),
        (["--strategy", "dispfl", "--detection-distance", "norm"], "applies to dadpfl"),
        (["--detection-distance", "cube"], "Invalid value for '--detection-distance'"),
        (["--wire", "delta", "--delta-fraction", "1.5"], "--delta-fraction must be in (0, 1]"),
    ],
)
def test_cli_bad_configurations_get_one_clear_line(tmp_path: Path, args, message) -> None:
    result = _cli(*args, cwd=tmp_path)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "report.json").exists()


VOTE_BYTES = len(messages.encode(messages.Vote(fleet="sim", sender="a", vote=True, score=0.0)))
"""What a vote costs its sender in simulate's accounting (to the tally keeper, not to peers)."""


def test_wire_delta_sends_the_top_fraction_of_each_agents_change_to_every_peer() -> None:
    full = simulate(small(rounds=4))
    delta = simulate(small(rounds=4, wire="delta", delta_fraction=0.1))
    agents = full["config"]["roster"]
    for f, d in zip(full["rounds"], delta["rounds"], strict=True):
        for k in agents:
            kept = f["agents"][k]["nonzeros_sent"]  # the whole sparse model's values
            # the top 10% of the kept entries, plus the mask flips where RigL moved it
            assert d["agents"][k]["nonzeros_sent"] < 0.45 * kept
            assert d["agents"][k]["bytes_sent"] < 0.5 * f["agents"][k]["bytes_sent"]
            # every peer's delta reaches every agent: K - 1 messages, not M models (their
            # votes go to the tally keeper, not to the agent)
            peers_sent = sum(d["agents"][j]["bytes_sent"] for j in agents if j != k)
            assert d["agents"][k]["bytes_received"] >= peers_sent - (len(agents) - 1) * VOTE_BYTES
    assert delta["summary"]["mean_accuracy"] > 0.2


def test_a_weaker_device_trains_fewer_flops_per_round() -> None:
    """p_k from each agent's profile caps its density: Pi 4 < Orin Nano in FLOPs per sample."""
    config = ExperimentConfig(**{**small().__dict__, "profiles": "mixed", "round_time_s": 0.01})
    simulation = Simulation(config)
    report = simulation.run()
    last = report["rounds"][-1]["agents"]
    by_profile = dict(zip(firmware_profiles.list_profiles(), simulation.roster, strict=True))
    weak, strong = by_profile["raspberry-pi-4"], by_profile["jetson-orin-nano"]

    def per_sample(agent: str) -> float:
        return last[agent]["train_flops"] / len(simulation.data[agent].y_train)

    assert last[weak]["p_k"] < last[strong]["p_k"] == 1.0
    assert per_sample(weak) < 0.5 * per_sample(strong)
    assert last[weak]["sparsity"] > last[strong]["sparsity"]
    unbudgeted = simulate(small())
    assert {a["p_k"] for a in unbudgeted["rounds"][-1]["agents"].values()} == {1.0}


def test_only_a_strategy_that_budgets_reports_a_p_k() -> None:
    """FedAvg and DFedAvgM train the full model whatever a device affords: their reports
    carry no p_k (FedAvg's carried FedSPU's static tiers 0.2, 0.4, 0.6); FedSPU's still do,
    its tiers being what its rounds train with."""
    reported = {
        strategy: [
            a["p_k"]
            for a in simulate(small(strategy, 3, neighbours=2))["rounds"][-1]["agents"].values()
        ]
        for strategy in ("fedavg", "dfedavgm", "fedspu")
    }
    assert reported["fedavg"] == reported["dfedavgm"] == [None] * 3
    assert sorted(reported["fedspu"]) == [0.2, 0.4, 0.6]
    assert [s.name for s in TABLE if s.budgets] == ["dadpfl", "dispfl", "fedspu", "feddrop"]


EVERY_AGENT_STOPS = {
    "rounds": 8,
    "early_stop": True,
    "stop_rule": "paper",
    "stop_patience": 1,
    "momentum": 0.0,
    "clip_norm": 0.0,
}
"""6 agents of `small`: every one stops early (fedavg's by round 5, DA-DPFL's by round 8),
with plain SGD's noisier losses."""
FEDAVG_EVERY_AGENT_STOPS = {**EVERY_AGENT_STOPS, "aggregation": "mean"}
"""The same for FedAvg, whose uploads then weigh their sample counts (under the default
rule, equally: one agent goes on to round 8)."""


@pytest.mark.parametrize(
    ("strategy", "learning"),
    [
        ("fedavg", FEDAVG_EVERY_AGENT_STOPS),
        ("fedspu", {}),  # per-participant downloads
        ("dadpfl", EVERY_AGENT_STOPS),  # reuse order: prior neighbours train first
        ("dadpfl", {"wire": "layers", "rounds": 4}),  # inboxes of fetched layers
        ("dispfl", {"wire": "delta"}),  # no prior neighbours: a round trains at once
    ],
)
def test_rounds_trained_in_worker_processes_give_the_identical_report(
    strategy: str, learning: dict
) -> None:
    """Every preset, wire and reduction: `python -m bench.identity compare DIR --workers 2`."""
    config = small(strategy, **learning)
    serial = simulate(config)
    assert without_wall_time(simulate(config, workers=2)) == without_wall_time(serial)
    if learning.get("early_stop"):
        assert len(serial["summary"]["stopped"]) == 6


def test_the_cli_trains_in_workers(tmp_path: Path) -> None:
    run = ["--strategy", "fedavg", "--agents", "4", "--rounds", "2", "--epochs", "1"]
    serial = _cli(*run, "--report", "serial.json", cwd=tmp_path)
    pooled = _cli(*run, "--workers", "2", "--report", "pooled.json", cwd=tmp_path)
    assert serial.returncode == 0 and pooled.returncode == 0, pooled.stderr
    assert "4 agents, 2 rounds, partition dirichlet:0.3, seed 1, 2 workers" in pooled.stdout
    reports = [json.loads((tmp_path / f).read_text()) for f in ("serial.json", "pooled.json")]
    assert without_wall_time(reports[0]) == without_wall_time(reports[1])
    refused = _cli("--workers", "0", cwd=tmp_path)
    assert refused.returncode == 2 and "--workers" in refused.stderr


def test_a_worker_that_dies_ends_the_run_with_one_line(
    tmp_path: Path, processes: Processes
) -> None:
    code = "from coordinator.cli import main; main(prog_name='coordinator')"
    run = processes.popen(
        [sys.executable, "-c", code, "simulate", "--strategy", "dispfl", "--rounds", "500"]
        + ["--workers", "2", "--report", str(tmp_path / "r.json")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={"PYTHONPATH": str(REPO), "COLUMNS": "120", "PATH": "/usr/bin:/bin"},
    )
    deadline = time.monotonic() + 60
    workers: list[psutil.Process] = []
    while len(workers) < 2 and time.monotonic() < deadline:  # spawn's tracker + 2 workers
        children = psutil.Process(run.pid).children()
        workers = [c for c in children if "spawn_main" in " ".join(c.cmdline())]
        time.sleep(0.2)
    time.sleep(2)  # training
    workers[0].kill()
    _, err = run.communicate(timeout=60)
    assert run.returncode == 1
    assert "a worker process died (out of memory?): run with fewer --workers" in err
    assert "Traceback" not in err
    assert not (tmp_path / "r.json").exists()
