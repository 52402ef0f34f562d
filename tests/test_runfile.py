"""Run files: what a user writes in `[run]` becomes the config `coordinator simulate` would
build from the same flags, and every mistake is one line naming the file and the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.experiment import DEVICE_DATA
from agent.options import experiment_config
from agent.runfile import KNOWN_KEYS, RunTimeouts, load_run_file

DEVICE = "agents = 3\ninput_shape = [40]\nclasses = 10\n"


def write(tmp_path: Path, body: str, name: str = "run.toml") -> Path:
    path = tmp_path / name
    path.write_text(body)
    return path


def run_error(tmp_path: Path, body: str) -> str:
    """The one-line message of loading `body` as a run file, which must start with its path."""
    path = write(tmp_path, body)
    with pytest.raises(ValueError) as info:
        load_run_file(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and "\n" not in message
    return message


def test_a_complete_file_builds_what_the_same_flags_build(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '[run]\nstrategy = "fedspu"\nagents = 4\ninput_shape = [1, 8, 8]\nclasses = 10\n'
        'rounds = 5\nlr = 0.05\nepochs = 2\nmodel = "cnn2d"\n',
    )
    run = load_run_file(path)
    flags = {"strategy": "fedspu", "rounds": 5, "lr": 0.05, "epochs": 2, "model": "cnn2d"}
    expected = experiment_config(
        {**flags, "dataset": "device", "agents": 4, "input_shape": (1, 8, 8), "classes": 10}
    )
    assert run.config(4) == expected
    assert run.path == path and run.wanted == 4 and run.values["lr"] == 0.05


def test_a_built_in_dataset_runs_in_experiment_mode(tmp_path: Path) -> None:
    body = '[run]\ndataset = "mnist1d"\nagents = 6\nneighbours = 3\nmax_wait = 1\n'
    config = load_run_file(write(tmp_path, body)).config(6)
    flags = {"dataset": "mnist1d", "agents": 6, "neighbours": 3, "max_wait": 1}
    assert config == experiment_config(flags)


def test_defaults_device_data_and_timeouts(tmp_path: Path) -> None:
    run = load_run_file(write(tmp_path, "[run]\n" + DEVICE))
    assert run.dataset == DEVICE_DATA and run.values.keys() == {"input_shape", "classes"}
    assert run.timeouts == RunTimeouts() and RunTimeouts().join_s == 300.0
    config = run.config(3)
    assert config.on_devices and config.learning.strategy == "dadpfl"


def test_timeouts_are_parsed(tmp_path: Path) -> None:
    body = "[run]\n" + DEVICE + "round_timeout = 60\nvote_timeout = 2.5\nlinger = 0\n"
    run = load_run_file(write(tmp_path, body + "join_timeout = 600\n"))
    assert run.timeouts == RunTimeouts(round_s=60.0, vote_s=2.5, linger_s=0.0, join_s=600.0)


def test_the_default_neighbours_fit_a_small_fleet(tmp_path: Path) -> None:
    run = load_run_file(write(tmp_path, "[run]\n" + DEVICE))
    assert run.config(3).learning.neighbours == 2
    assert run.config(20).learning.neighbours == 5  # the strategy's default, uncut
    message = run_error(tmp_path, "[run]\n" + DEVICE + "neighbours = 5\n")
    assert "neighbours must be between 1 and agents - 1 = 2" in message


def test_input_shape_and_classes_can_come_from_the_agents(tmp_path: Path) -> None:
    run = load_run_file(write(tmp_path, "[run]\nagents = 3\n"))
    config = run.config(3, input_shape=[40], classes=10)
    assert config.input_shape == (40,) and config.classes == 10
    with pytest.raises(ValueError, match=r"run\.toml: input_shape is not in \[run\]"):
        run.config(3)
    with pytest.raises(ValueError, match="classes is not in"):
        run.config(3, input_shape=[40])
    # what the file gives wins over what an agent reports
    fixed = load_run_file(write(tmp_path, "[run]\n" + DEVICE, "fixed.toml"))
    assert fixed.config(3, input_shape=[7], classes=4).input_shape == (40,)


def test_agent_ids_fix_how_many_the_run_waits_for(tmp_path: Path) -> None:
    run = load_run_file(write(tmp_path, '[run]\nagent_ids = ["pi-1", "pi-2", "jetson"]\n'))
    assert run.wanted == 3 and run.agent_ids == ("pi-1", "pi-2", "jetson") and run.agents is None
    same = '[run]\nagents = 2\nagent_ids = ["a", "b"]\n'
    assert load_run_file(write(tmp_path, same, "same.toml")).wanted == 2


def test_expect_gives_the_agent_count_a_file_leaves_out(tmp_path: Path) -> None:
    """`edge-agent --expect 3 --run FILE`: the file need not say agents = 3 again; where it
    names its agents, the file's count stands (and edge-agent checks the two agree)."""
    bare = write(tmp_path, "[run]\ninput_shape = [40]\nclasses = 10\n")
    assert load_run_file(bare, agents=3).wanted == 3
    assert "give agents = N" in run_error(tmp_path, "[run]\ninput_shape = [40]\n")
    assert load_run_file(write(tmp_path, f"[run]\n{DEVICE}", "own.toml"), agents=5).wanted == 3
    named = write(tmp_path, '[run]\nagent_ids = ["a", "b"]\n', "named.toml")
    assert load_run_file(named, agents=5).wanted == 2


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("[run]\nagents = 3\nround = 5\n", "unknown key 'round' in [run]; did you mean 'rounds'?"),
        ('[run]\nagents = 3\nrounds = "ten"\n', "rounds must be an integer, got 'ten'"),
        ("[run]\nagents = 3\nrounds = true\n", "rounds must be an integer, got true"),
        ("[run]\nagents = 3\nrounds = 2.0\n", "rounds must be an integer, got 2.0"),
        ("[run]\nagents = 3\nearly_stop = 1\n", "early_stop must be true or false, got 1"),
        ("[run]\nagents = 3\nlr = nan\n", "lr must be a finite number, got nan"),
        ('[run]\nagents = 3\nstrategy = "fedavgg"\n', "did you mean 'fedavg'?"),
        ('[run]\nagents = 3\nwire = "half"\n', "wire must be one of full, delta, layers"),
        ('[run]\nagents = 3\ntopology = "star"\n', "topology must be one of"),
        ('[run]\nagents = 3\nreduce = "cut"\n', "reduce must be one of"),
        ('[run]\nagents = 3\ndetection_distance = "l1"\n', "detection_distance must be one"),
        ('[run]\nagents = 3\nmodel = "cnn"\n', "model must be one of"),
        ("[run]\nagents = 3\ninput_shape = [3, 0]\n", "input_shape must be a list of positive"),
        ("[run]\nagents = 3\ninput_shape = 40\n", "input_shape must be a list of positive"),
        ("[run]\nagents = 3\nclasses = 1\n", "dataset 'device' needs classes >= 2, got 1"),
        ("[run]\nagents = 3\nmin_samples = 1\n", "min_samples must be >= 3, got 1"),
        ("[run]\nagents = 0\n", "agents must be at least 1, got 0"),
        ("[run]\nrounds = 3\n", "give agents = N or agent_ids = [...]"),
        ('[run]\nagent_ids = ["pi/1"]\n', "agent_ids: invalid agent 'pi/1'"),
        ('[run]\nagent_ids = ["a", "a"]\n', "agent_ids names 'a' twice"),
        ("[run]\nagent_ids = []\n", "agent_ids must be a non-empty list"),
        ('[run]\nagents = 3\nagent_ids = ["a", "b"]\n', "agents = 3 but agent_ids names 2"),
        ("[run]\nagents = 3\nround_timeout = 0\n", "round_timeout must be > 0 seconds"),
        ("[run]\nagents = 3\nlinger = -1\n", "linger must be >= 0 seconds, got -1"),
        ('[run]\nagents = 3\njoin_timeout = "5m"\n', "join_timeout must be a number of seconds"),
        ('[run]\nagents = 3\npartition = "iid"\n', "partition has no effect with dataset 'device'"),
        ('[run]\nagents = 3\ndataset = "mnist1d"\nclasses = 4\n', "classes applies to dataset"),
        ('[run]\nagents = 3\ndataset = "mnist2d"\n', "unknown dataset 'mnist2d'"),
        ("[run]\nagents = 3\nssm_fraction = 0.1\n", "ssm_fraction has no effect here"),
        ("[run]\nagents = 3\nstop_patience = 2\n", "it applies to runs with early_stop"),
        ('[run]\nagents = 3\nstrategy = "dispfl"\nmax_wait = 2\n', "fixes max_wait to 0"),
        ("[run]\nagents = 3\ndensity = 1.5\n", "density must be in (0, 1], got 1.5"),
        ("[run]\nagents = 1\n", "dadpfl needs at least 2 agents, got 1"),
        ("rounds = 3\n[run]\nagents = 3\n", "key 'rounds' is outside [run]"),
        ("[run]\nagents = 3\n[fleet]\nname = 'x'\n", "unknown table [fleet]; a run file holds"),
        ("[runs]\nagents = 3\n", "unknown table [runs]"),
        ("", "no [run] table"),
        ("run = 3\n", "run must be a table"),
        ("[run]\nagents = \n", "not valid TOML: Invalid value (at line 2, column 10)"),
    ],
)
def test_mistakes_are_one_line_naming_the_file_and_key(
    tmp_path: Path, body: str, expected: str
) -> None:
    assert expected in run_error(tmp_path, body)


def test_an_unreadable_file_is_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ValueError, match=f"^{missing}: cannot read run file: No such file"):
        load_run_file(missing)
    with pytest.raises(ValueError, match="cannot read run file: Is a directory"):
        load_run_file(tmp_path)
    (tmp_path / "bin.toml").write_bytes(b"[run]\nagents = 3 # \xff\n")
    with pytest.raises(ValueError, match="bin.toml: not valid TOML"):
        load_run_file(tmp_path / "bin.toml")


def test_a_roster_smaller_than_explicit_neighbours_is_an_error(tmp_path: Path) -> None:
    run = load_run_file(write(tmp_path, "[run]\nagents = 6\nneighbours = 4\n"))
    assert run.config(6, [40], 10).learning.neighbours == 4
    with pytest.raises(ValueError, match=r"run\.toml: neighbours must be between 1 and"):
        run.config(4, [40], 10)  # two devices did not join: the explicit 4 no longer fits


def test_known_keys_cover_every_simulate_flag_and_the_run_keys() -> None:
    from coordinator.lab_cli import simulate

    # where the report goes and the target its summary times, how many processes (or which
    # Ray) train and the run file itself (simulate's own)
    own = {"report_path", "force", "plot_dir", "workers", "backend", "ray_address", "run_file"}
    own.add("target_accuracy")
    flags = {p.name for p in simulate.params if p.expose_value} - own  # not --help-all
    assert flags <= set(KNOWN_KEYS)
    run_only = {"agent_ids", "input_shape", "classes", "min_samples", "round_timeout"}
    assert run_only | {"vote_timeout", "linger", "join_timeout"} <= set(KNOWN_KEYS)
