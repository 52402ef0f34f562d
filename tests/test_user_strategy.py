"""A strategy the user brings (issue 47): named as a class by import path or file, in a run
file, on the command line and in the Python API; its family, traits and preset read from the
class; fingerprinted so a device with other code refuses the run; a decentralized one's own
`aggregate` what its rounds start from, its `train` how they train and its `publish` what
they send; and the example in examples/own_strategy runs in
simulate and as real agent processes with the same figures."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import edgefl
from agent.experiment import config_from_dict, config_to_dict
from agent.learning import AgentState, Learner, preset, sparse, strategies
from agent.learning.central import central_strategy
from agent.learning.models import build_model, prunable_names
from agent.options import experiment_config
from agent.runfile import load_run_file
from agent.user_code import load_callable
from coordinator.cli import main as coordinator

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "own_strategy"
SHORT = {"agents": 4, "rounds": 2}

DECENTRAL = """
import dataclasses

import torch

from agent.learning.decentral import DecentralizedStrategy
from agent.learning.decentral.dispfl import DisPFL


class Plain(DecentralizedStrategy):
    preset = {"epochs": 2}


class Budgeted(DecentralizedStrategy):
    budgets = True


class SaysSparse(DecentralizedStrategy):
    sparse = True


class Masked(DisPFL):
    prunes_further = True


class OwnOnly(DecentralizedStrategy):
    def aggregate(self, learner, agent, inbox):
        return agent.weights


class Unmasked(DisPFL):
    def initial_masks(self, learner, agent_id):  # DisPFL's rounds from the dense model
        return None


class Damped(DecentralizedStrategy):
    def train(self, learner, start):  # keeps half of each step: pulled back to its start
        trained = super().train(learner, start)
        halfway = {n: (w + start.weights[n]) / 2 for n, w in trained.weights.items()}
        return dataclasses.replace(trained, weights=halfway)


class Blurred(Damped):
    def publish(self, learner, model, start):  # sends its model blurred, keeps it exact
        draw = learner.facts.generator("blur", start.agent.agent_id, start.round)
        noise = {n: 0.05 * torch.randn(w.shape, generator=draw) for n, w in model.weights.items()}
        blurred = {n: w + noise[n] for n, w in model.weights.items()}
        return super().publish(learner, dataclasses.replace(model, weights=blurred), start)


class Neither:
    pass


def build():
    pass
"""


@pytest.fixture
def own(tmp_path: Path) -> Path:
    """A folder with a copy of the example's strategy and some decentralized ones."""
    folder = tmp_path / "own"
    folder.mkdir()
    shutil.copy(EXAMPLE / "strategy.py", folder / "strategy.py")
    (folder / "decentral.py").write_text(DECENTRAL)
    return folder


def test_the_example_emulated_equals_simulated_in_every_round(tmp_path: Path) -> None:
    config = edgefl.config(EXAMPLE / "run.toml", **SHORT)
    assert config.learning.strategy == f"{EXAMPLE / 'strategy.py'}:FedAvgM"
    assert config.learning.lr == 0.05, "the class's preset"
    assert config.strategy_fingerprint
    simulated = edgefl.simulate(config)
    emulated = edgefl.emulate(config, workdir=tmp_path / "fleet", agents_per_process=4)
    assert len(simulated.rounds) == len(emulated.rounds) == 2
    for sim, emu in zip(simulated.rounds, emulated.rounds, strict=True):
        assert len(sim["agents"]) == 4
        for agent, figures in sim["agents"].items():
            assert emu["agents"][agent]["accuracy"] == figures["accuracy"]
    # Its aggregate is FedAvgM's, not FedAvg's: round 2 moves with round 1's momentum.
    fedavg = edgefl.simulate(
        edgefl.config(EXAMPLE / "run.toml", strategy="fedavg", lr=0.05, **SHORT)
    )
    assert fedavg.rounds[0]["agents"] == simulated.rounds[0]["agents"]
    assert fedavg.rounds[1]["agents"] != simulated.rounds[1]["agents"]


def test_the_record_is_read_from_the_class(own: Path) -> None:
    fedavgm = strategies.strategy(f"{own}/strategy.py:FedAvgM")
    assert (fedavgm.family, fedavgm.options, fedavgm.sparse) == (
        "centralized",
        {"optimizer"},
        False,
    )
    assert fedavgm.defaults == {"lr": 0.05}
    assert type(central_strategy(f"{own}/strategy.py:FedAvgM")).__name__ == "FedAvgM"
    plain = strategies.strategy(f"{own}/decentral.py:Plain")
    assert (plain.family, plain.sparse, plain.prunes_further) == ("decentralized", False, False)
    assert plain.options == {"optimizer", "wire"}
    assert plain.defaults == {"epochs": 2}
    masked = strategies.strategy(f"{own}/decentral.py:Masked")
    assert (masked.sparse, masked.prunes_further, masked.fixed) == (True, True, {"max_wait": 0})
    assert "reduce" in masked.options, "a DisPFL subclass reads what DisPFL reads"
    # p_k is recorded only for a strategy that budgets: a DisPFL subclass does, as DisPFL;
    # a class of a contract's does not, unless it says so.
    assert (masked.budgets, fedavgm.budgets, plain.budgets) == (True, False, False)
    assert strategies.strategy(f"{own}/decentral.py:Budgeted").budgets


def test_a_sparse_strategy_that_draws_no_masks_is_refused_in_one_line(own: Path) -> None:
    with pytest.raises(edgefl.ConfigError, match="SaysSparse says sparse but draws no masks") as e:
        edgefl.config(dataset="digits", strategy=f"{own}/decentral.py:SaysSparse")
    assert "\n" not in str(e.value)


def test_a_decentralized_strategy_of_the_users_trains(own: Path) -> None:
    config = edgefl.config(dataset="digits", strategy=f"{own}/decentral.py:Plain", **SHORT)
    assert config.learning.epochs == 2
    assert len(edgefl.simulate(config).rounds) == 2


def figures(report: edgefl.Report) -> list[dict[str, tuple[float, float]]]:
    """Each round's (accuracy, training loss) per agent: what the model trained to."""
    return [
        {k: (a["accuracy"], a["train_loss"]) for k, a in r["agents"].items()} for r in report.rounds
    ]


def test_a_users_aggregate_is_the_one_its_rounds_take(own: Path, tmp_path: Path) -> None:
    """A strategy whose `aggregate` keeps the agent's own model trains as local training does,
    agent by agent and round by round, though its neighbours' models reach it (the contract
    itself, which averages them, trains otherwise): the round takes the strategy's aggregate.
    Real agent processes give the same figures: whichever neighbours' models reach them in
    time, none counts."""
    own_only = edgefl.config(dataset="digits", strategy=f"{own}/decentral.py:OwnOnly", **SHORT)
    simulated = edgefl.simulate(own_only)
    local = edgefl.simulate(edgefl.config(dataset="digits", strategy="local", **SHORT))
    contract = "agent.learning.decentral:DecentralizedStrategy"
    averaged = edgefl.simulate(edgefl.config(dataset="digits", strategy=contract, **SHORT))
    assert figures(simulated) == figures(local)
    assert figures(averaged) != figures(simulated)
    emulated = edgefl.emulate(own_only, workdir=tmp_path / "fleet", agents_per_process=4)
    assert figures(emulated) == figures(simulated)


def test_an_agents_first_masks_are_its_strategys(own: Path) -> None:
    """A sparse strategy's agents start under masks it draws (DisPFL: ERK at the run's
    density), a dense one's whole; a DisPFL whose `initial_masks` draws none starts from
    the whole initial model."""

    def first(strategy: str) -> tuple[Learner, AgentState]:
        model = build_model("cnn1d", (1, 40), 10, seed=0)
        learner = Learner(model, (1, 40), prunable_names(model), preset(strategy), seed=5)
        return learner, learner.init_agent("a")

    _, drawn = first("dispfl")
    assert drawn.masks is not None
    assert sparse.sparsity(drawn.masks) == pytest.approx(0.5, abs=0.01)
    assert first("dfedavgm")[1].masks is None
    learner, unmasked = first(f"{own}/decentral.py:Unmasked")
    assert unmasked.masks is None
    assert all(torch.equal(w, learner.facts.initial[n]) for n, w in unmasked.weights.items())


def test_a_users_training_and_what_it_sends_are_what_its_rounds_take(
    own: Path, tmp_path: Path
) -> None:
    """A strategy whose `train` keeps half of each training step trains otherwise than the
    contract from round 1 on. One that also blurs what it `publish`es keeps the same models
    in round 1 (no agent waits for a neighbour's round-1 model: --max-wait 0), and others
    from round 2 on, once its neighbours aggregate what it sent. Real agent processes give
    the same figures: they train and send what the strategy says, not the contract."""
    runs = {
        name: edgefl.config(dataset="digits", strategy=spec, max_wait=0, **SHORT)
        for name, spec in [
            ("contract", "agent.learning.decentral:DecentralizedStrategy"),
            ("damped", f"{own}/decentral.py:Damped"),
            ("blurred", f"{own}/decentral.py:Blurred"),
        ]
    }
    contract, damped, blurred = (figures(edgefl.simulate(c)) for c in runs.values())
    assert damped[0] != contract[0], "the round trains as the strategy's train says"
    assert blurred[0] == damped[0], "what an agent sends is not what it keeps"
    assert blurred[1] != damped[1], "its neighbours aggregate what its publish sent"
    emulated = edgefl.emulate(runs["blurred"], workdir=tmp_path / "fleet", agents_per_process=4)
    assert figures(emulated) == blurred


def test_a_file_resolves_beside_the_run_file_the_cwd_or_from_the_class(
    own: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (own / "run.toml").write_text(
        '[run]\nagents = 4\ndataset = "digits"\nstrategy = "./strategy.py:FedAvgM"\n'
    )
    wanted = f"{own.resolve()}/strategy.py:FedAvgM"
    assert load_run_file(own / "run.toml").values["strategy"] == wanted
    monkeypatch.chdir(own.parent)  # the run file's folder is not the current one
    assert edgefl.config(own / "run.toml").learning.strategy == wanted
    monkeypatch.chdir(own)
    given = {"dataset": "digits", "strategy": "./strategy.py:FedAvgM"}
    assert experiment_config(given).learning.strategy == wanted
    cls = load_callable(wanted, "strategy")
    assert edgefl.config(dataset="digits", strategy=cls).learning.strategy == wanted


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        ("./missing.py:FedAvgM", "no such file"),
        ("./strategy.py:FedAvgN", "has no FedAvgN"),
        ("./decentral.py:Neither", "derives from neither contract"),
        ("./decentral.py:build", "function is not a class"),
        ("no_such_module_anywhere:Cls", "cannot import no_such_module_anywhere"),
    ],
)
def test_a_bad_spec_is_one_line_everywhere(
    own: Path, monkeypatch: pytest.MonkeyPatch, spec: str, error: str
) -> None:
    monkeypatch.chdir(own)
    with pytest.raises(edgefl.ConfigError, match=error) as api:
        edgefl.config(dataset="digits", strategy=spec)
    assert "\n" not in str(api.value)
    (own / "bad.toml").write_text(f'[run]\nagents = 4\ndataset = "digits"\nstrategy = "{spec}"\n')
    with pytest.raises(ValueError, match=error) as runfile:
        edgefl.config(own / "bad.toml")
    assert str(runfile.value).startswith(str(own / "bad.toml"))
    result = CliRunner().invoke(
        coordinator, ["simulate", "--dataset", "digits", "--strategy", spec, "--rounds", "1"]
    )
    assert result.exit_code != 0
    assert error in result.output and "Traceback" not in result.output


def test_what_the_class_does_not_read_is_refused(own: Path) -> None:
    with pytest.raises(edgefl.ConfigError, match="--reduce has no effect here"):
        edgefl.config(dataset="digits", strategy=f"{own}/strategy.py:FedAvgM", reduce="prune")
    (own / "odd.py").write_text(
        "from agent.learning.central import FedAvg\n\n\nclass Odd(FedAvg):\n"
        '    preset = {"learning_rate": 0.1}\n'
    )
    with pytest.raises(edgefl.ConfigError, match="unknown options learning_rate"):
        edgefl.config(dataset="digits", strategy=f"{own}/odd.py:Odd")


DEVICE = """
import json, sys
from agent.experiment import config_from_dict
try:
    config_from_dict(json.loads(sys.argv[1]))
except ValueError as exc:
    sys.exit(str(exc))
"""
"""A device reading a run's configuration, in a process of its own."""


def test_a_device_with_other_strategy_code_refuses_the_run(own: Path) -> None:
    """Another device's copy of the code is read by another process: once the file differs
    from the run's, that device refuses the run. A long-lived process that loaded the class
    before the file was edited runs what it loaded, and its digest says so: the run made
    from that same code is still its own (it used to digest the file on disk, and would
    have taken a run of the edited code while running the old one)."""
    config = edgefl.config(dataset="digits", strategy=f"{own}/strategy.py:FedAvgM", **SHORT)
    sent = config_to_dict(config)
    assert config_from_dict(sent) == config, "the same code: accepted"
    (own / "strategy.py").write_text((own / "strategy.py").read_text() + "\n# edited\n")
    device = subprocess.run(
        [sys.executable, "-c", DEVICE, json.dumps(sent)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert device.returncode == 1 and "different code here" in device.stderr
    assert device.stderr.count("\n") == 1, device.stderr
    assert config_from_dict(sent) == config, "this process runs the code it loaded"
    assert strategies.fingerprint(f"{own}/strategy.py:FedAvgM") == config.strategy_fingerprint
    assert edgefl.config(dataset="digits", strategy="fedavg").strategy_fingerprint == ""


def test_naming_a_strategy_loads_no_torch() -> None:
    code = (
        "import sys, agent.learning.strategies as s, agent.options; "
        "s.strategy('fedavg'); assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
