"""Help for the job at hand: every `--help` fits two screens, `--help-all` lists every option,
the options `--help` leaves out still work, and both programs complete in the shell.

The help is read through click in this process (a terminal of 80 columns, as COLUMNS=80
gives); what the issue asks of real processes (a research option doing its work, the shell
completion scripts and answers, without torch) runs the programs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from test_docs_deploy import PROGRAMS, subcommands

from protocol.cli_help import RESEARCH

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parent.parent
SCREENS = 120
"""Two screens of 60 lines: the most a `--help` may take at 80 columns."""

PROGRAM = {
    "edge-agent": "from agent.cli import main; main(prog_name='edge-agent')",
    "coordinator": "from coordinator.cli import main; main(prog_name='coordinator')",
}
DEVICE_OPTIONS = (
    "--broker",
    "--tls-ca",
    "--config",
    "--fleet",
    "--id",
    "--key-file",
    "--trust",
    "--state-dir",
    "--data",
    "--profile",
    "--run",
    "--expect",
    "--log-format",
)
RESEARCH_FLAGS = ("--pqi-p", "--rigl-a", "--attack", "--aggregation", "--stop-rule")


def walk(command: click.Command, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], str]]:
    yield path, " ".join(path)
    for name, sub in subcommands(command).items():
        yield from walk(sub, (*path, name))


EVERY_COMMAND = [entry for name, program in PROGRAMS.items() for entry in walk(program, (name,))]


def command_at(path: tuple[str, ...]) -> click.Command:
    command = PROGRAMS[path[0]]
    for name in path[1:]:
        command = subcommands(command)[name]
    return command


def help_of(path: tuple[str, ...], flag: str) -> str:
    """The help `PROGRAM ... flag` prints on a terminal of 80 columns."""
    result = CliRunner().invoke(
        PROGRAMS[path[0]], [*path[1:], flag], prog_name=path[0], env={"COLUMNS": "80"}
    )
    assert result.exit_code == 0, result.output
    return result.output


def test_several_commands_are_walked() -> None:
    """The walk below sees both programs and their commands, those loaded late too."""
    names = {name for _, name in EVERY_COMMAND}
    assert {"edge-agent", "edge-agent models use", "coordinator run", "coordinator serve"} <= names
    assert {"coordinator simulate", "coordinator emulate"} <= names


@pytest.mark.parametrize(("path", "name"), EVERY_COMMAND, ids=[n for _, n in EVERY_COMMAND])
def test_each_help_fits_two_screens_and_help_all_lists_every_option(
    path: tuple[str, ...], name: str
) -> None:
    shown = help_of(path, "--help")
    assert len(shown.splitlines()) <= SCREENS, f"{name} --help: {len(shown.splitlines())} lines"
    assert "--help-all" in shown
    everything = help_of(path, "--help-all")
    command = command_at(path)
    options = [
        p
        for p in command.get_params(click.Context(command))
        if isinstance(p, click.Option) and not p.hidden
    ]
    assert options
    for option in options:
        for flag in (*option.opts, *option.secondary_opts):
            assert flag in everything, f"{name} --help-all leaves out {flag}"


def test_edge_agent_help_is_what_a_device_needs() -> None:
    shown = help_of(("edge-agent",), "--help")
    for flag in DEVICE_OPTIONS:
        assert f"  {flag} " in shown, flag
    for flag in (*RESEARCH_FLAGS, "--linger", "--dataset", "--strategy"):
        assert flag not in shown, flag
    everything = help_of(("edge-agent",), "--help-all")
    titles = [line for line in everything.splitlines() if line.endswith(":")]
    assert [t for t in titles if not t.startswith(" ")] == [
        "Options:",
        "Tuning options:",
        "Experiment options (with --expect N instead of --run FILE):",
        f"{RESEARCH}:",
        "Commands:",
    ]
    research = everything.split(f"{RESEARCH}:")[1]
    for flag in RESEARCH_FLAGS:
        assert f"  {flag} " in research, flag


@pytest.mark.parametrize(
    ("command", "flags"),
    [
        ("serve", ("--broker", "--host", "--port", "--state-dir", "--open", "--http")),
        ("run", ("--broker", "--fleet", "--state-dir", "--report", "--resume", "--runs-dir")),
        ("status", ("--broker", "--fleet", "--json", "--watch")),
        ("admit", ("--fleet", "--state-dir")),
    ],
)
def test_the_gateways_help_shows_what_running_a_fleet_needs(
    command: str, flags: tuple[str, ...]
) -> None:
    shown = help_of(("coordinator", command), "--help")
    for flag in flags:
        assert f"  {flag} " in shown, flag


@pytest.mark.parametrize("command", ["simulate", "emulate"])
def test_the_labs_help_shows_the_essentials_and_tucks_the_research(command: str) -> None:
    shown = help_of(("coordinator", command), "--help")
    for flag in ("--dataset", "--model", "--agents", "--strategy", "--rounds", "--report"):
        assert f"  {flag} " in shown, flag
    for flag in RESEARCH_FLAGS:
        assert flag not in shown, flag
    research = help_of(("coordinator", command), "--help-all").split(f"\n{RESEARCH}:\n")[1]
    for flag in RESEARCH_FLAGS:
        assert f"  {flag} " in research, flag


def test_a_tucked_option_still_takes_its_value() -> None:
    """`--keep-runs` is out of edge-agent's --help, not out of its parser."""
    result = CliRunner().invoke(
        PROGRAMS["edge-agent"], ["--keep-runs", "0"], prog_name="edge-agent"
    )
    assert result.exit_code == 2
    assert "--keep-runs" in result.output and "x>=1" in result.output


def test_a_research_option_works_when_given(tmp_path: Path) -> None:
    """A simulation given --rigl-a, which --help does not show, runs with it."""
    report = tmp_path / "report.json"
    command = [
        *("simulate", "--strategy", "dadpfl", "--dataset", "digits", "--agents", "2"),
        *("--rounds", "1", "--epochs", "1", "--rigl-a", "0.17", "--report", str(report)),
    ]
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM["coordinator"], *command],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(report.read_text())["config"]["learning"]["rigl_a"] == 0.17


COMPLETE = """
import os, sys
from {module} import main
try:
    main(prog_name={program!r})
except SystemExit:
    pass
print("torch loaded" if "torch" in sys.modules else "no torch")
"""


def complete(program: str, shell: str, words: str = "", cword: int = 0) -> list[str]:
    """What `program` prints for its shell completion (the script with `SHELL_source`,
    the candidates with `SHELL_complete`), then whether it loaded torch."""
    variable = f"_{program.replace('-', '_').upper()}_COMPLETE"
    module = "agent.cli" if program == "edge-agent" else "coordinator.cli"
    env = {
        **os.environ,
        variable: shell,
        "COMP_WORDS": words,
        "COMP_CWORD": str(cword),
    }
    done = subprocess.run(
        [sys.executable, "-c", COMPLETE.format(module=module, program=program)],
        cwd=REPO,
        env={k: v for k, v in env.items() if k != "EAGER_IMPORT"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


@pytest.mark.parametrize("program", ["edge-agent", "coordinator"])
@pytest.mark.parametrize(
    ("shell", "registers"),
    [
        ("bash", "complete -o nosort -F {function} {program}"),
        ("zsh", "compdef {function} {program}"),
    ],
)
def test_the_completion_script_is_printed(program: str, shell: str, registers: str) -> None:
    function = f"_{program.replace('-', '_')}_completion"
    lines = complete(program, f"{shell}_source")
    assert registers.format(function=function, program=program) in "\n".join(lines)
    assert lines[-1] == "no torch"


@pytest.mark.parametrize(
    ("program", "words", "cword", "wanted"),
    [
        ("edge-agent", "edge-agent --state", 1, "plain,--state-dir"),
        ("edge-agent", "edge-agent --lin", 1, "plain,--linger"),
        ("coordinator", "coordinator sim", 1, "plain,simulate"),
        ("coordinator", "coordinator emulate --pqi-b", 2, "plain,--pqi-beta"),
    ],
)
def test_completion_offers_commands_and_tucked_options_without_torch(
    program: str, words: str, cword: int, wanted: str
) -> None:
    lines = complete(program, "bash_complete", words, cword)
    assert lines == [wanted, "no torch"]
