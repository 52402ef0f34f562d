"""`coordinator emulate` checks the whole run before it starts anything.

A run the agents cannot start (too many agents for the dataset's samples, a bad partition,
neighbours, dataset or model) fails in the coordinator's process with the one line and exit
status 2 that `coordinator simulate` gives for the same flags, before any broker or agent
starts: not after N agent processes, each with the reason in its own log only. The fixture
`nothing_starts` makes starting a broker, an agent or the run fail the test.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from agent.experiment import ExperimentConfig
from agent.learning import preset
from coordinator.broker import EmbeddedBroker
from coordinator.cli import main
from coordinator.emulate import Emulation, EmulationOptions
from coordinator.simulate import Simulation
from protocol import BrokerAddress

TOO_MANY_AGENTS = (
    "300 agents x 10 samples need more than the 1438 samples of the train pool; "
    "use fewer agents or a lower --min-samples"
)

RULES = [
    pytest.param(["--dataset", "digits", "--agents", "300"], TOO_MANY_AGENTS, id="samples"),
    pytest.param(
        ["--dataset", "digits", "--partition", "pathological:11"],
        "bad partition 'pathological:11': pathological:N needs an integer N in [1, 10] "
        "(classes present)",
        id="partition-classes",
    ),
    pytest.param(
        ["--dataset", "digits", "--partition", "natural"],
        "partition 'natural' needs a dataset with groups; 'digits' has none",
        id="partition-groups",
    ),
    pytest.param(
        ["--dataset", "synthetic", "--partition", "natural", "--agents", "400"],
        "natural partition: 400 agents but only 30 groups",
        id="partition-natural-agents",
    ),
    pytest.param(
        ["--dataset", "digits", "--agents", "3", "--neighbours", "3"],
        "--neighbours must be between 1 and agents - 1 = 2 for dadpfl, got 3",
        id="neighbours",
    ),
    pytest.param(
        ["--dataset", "no-such-set"],
        "unknown dataset 'no-such-set'; known: digits, mnist1d, synthetic, npz:PATH, "
        "imagefolder:PATH, cifar10:PATH, python:MODULE:FUNCTION",
        id="dataset-unknown",
    ),
    pytest.param(
        ["--dataset", "npz:/no/such.npz"], "npz file not found: /no/such.npz", id="dataset-missing"
    ),
    pytest.param(
        ["--dataset", "digits", "--model", "no-such-model"],
        "unknown model 'no-such-model'; known: mlp, cnn1d, cnn2d, resnet18, vgg11, alexnet, or "
        "your own as MODULE:FUNCTION or ./FILE.py:FUNCTION",
        id="model-unknown",
    ),
    pytest.param(
        ["--dataset", "digits", "--model", "cnn1d"],
        "model 'cnn1d' needs a 2-D input shape (channels first), got (1, 8, 8)",
        id="model-shape",
    ),
    pytest.param(
        ["--dataset", "digits", "--strategy", "fedavg", "--agents", "3", "--attackers", "3"],
        "--attackers must be between 0 and agents - 1 = 2, got 3",
        id="attackers",
    ),
    pytest.param(
        ["--dataset", "digits", "--strategy", "fedadam", "--ssm-fraction", "0.5"],
        "--ssm-fraction has no effect here: it applies to fedadam-top, fedadam-ssm, fedbuff-ssm",
        id="strategy-option",
    ),
]


@pytest.fixture
def nothing_starts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What was started (a broker, agents, the run), each of which fails at once: a run
    that got past the checks ends here in a moment instead of starting real agents."""
    started: list[str] = []

    def refuse(what: str):
        def start(*args: object, **kwargs: object) -> None:
            started.append(what)
            raise RuntimeError(f"{what} started")

        return start

    monkeypatch.setattr(EmbeddedBroker, "start", refuse("broker"))
    monkeypatch.setattr(Emulation, "run", refuse("run"))
    monkeypatch.setattr(Emulation, "start_agents", refuse("agents"))
    monkeypatch.setattr(Emulation, "start_agent", refuse("agent"))
    monkeypatch.setattr(Emulation, "start_shared", refuse("agents' process"))
    return started


def invoke(command: str, flags: list[str], tmp_path: Path) -> Result:
    """`coordinator COMMAND FLAGS` with a small run, its report and folders under tmp_path."""
    extra = ["--workdir", str(tmp_path / "work")] if command == "emulate" else []
    return CliRunner().invoke(
        main,
        [command, "--rounds", "1", "--report", str(tmp_path / "report.json"), *extra, *flags],
    )


def assert_refused(result: Result, message: str) -> None:
    assert result.exit_code == 2, result.output
    assert result.output.splitlines() == [f"Error: {message}"]


def assert_nothing_started(started: list[str], tmp_path: Path) -> None:
    assert started == []
    made = sorted(p.name for p in (tmp_path / "work").glob("*"))
    assert not [name for name in made if name.startswith("agent-") or name.endswith(".log")]
    assert not (tmp_path / "report.json").exists()


@pytest.mark.parametrize(("flags", "message"), RULES)
def test_emulate_refuses_what_simulate_refuses_before_starting_anything(
    nothing_starts: list[str], tmp_path: Path, flags: list[str], message: str
) -> None:
    emulated = invoke("emulate", flags, tmp_path)
    assert_nothing_started(nothing_starts, tmp_path)
    assert_refused(emulated, message)
    simulated = invoke("simulate", flags, tmp_path)
    assert simulated.output == emulated.output
    assert simulated.exit_code == 2


def test_three_hundred_agents_on_digits_fail_in_one_line_without_agents(
    nothing_starts: list[str], tmp_path: Path
) -> None:
    """The issue's case, a process each and shared processes alike."""
    for per_process in ("1", "75"):
        flags = ["--dataset", "digits", "--agents", "300", "--agents-per-process", per_process]
        result = invoke("emulate", flags, tmp_path)
        assert_nothing_started(nothing_starts, tmp_path)
        assert_refused(result, TOO_MANY_AGENTS)


def test_a_run_that_passes_the_checks_goes_on_to_start(
    nothing_starts: list[str], tmp_path: Path
) -> None:
    """The control: the fixture does catch a start, so the cases above are not vacuous."""
    result = invoke("emulate", ["--dataset", "digits", "--agents", "3"], tmp_path)
    assert nothing_starts, result.output
    assert result.exit_code != 2, result.output


def test_emulation_raises_the_simulations_error_on_construction(tmp_path: Path) -> None:
    """Without the CLI (bench/, tests): the same ValueError, and no folder is made."""
    config = ExperimentConfig(dataset="digits", agents=300, learning=preset("dadpfl"))
    with pytest.raises(ValueError) as simulated:
        Simulation(config)
    options = EmulationOptions(workdir=tmp_path / "work", agent_keys=True)
    with pytest.raises(ValueError) as emulated:
        Emulation(config, BrokerAddress("127.0.0.1", 1), options)
    assert str(emulated.value) == str(simulated.value) == TOO_MANY_AGENTS
    assert not (tmp_path / "work").exists()
