"""docs/deploy.md, the systemd units and the example run file stay true to the programs.

Every `edge-agent` or `coordinator` command line they show uses only options that command has,
every EDGEFL_* variable they name is one the programs read, their TOML examples load, and the
units are complete and start the right command. All offline: the commands are inspected
through click, never run.
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

import click
import pytest

from agent.cli import main as agent_main
from agent.data import MAX_DATA_ENV
from agent.runfile import load_run_file
from coordinator.cli import main as coordinator_main
from firmware_profiles.loader import PROFILE_PATH_ENV
from protocol.cli import PASSWORD_ENV

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

DOCS = Path(__file__).resolve().parents[1] / "docs"
DEPLOY = DOCS / "deploy.md"
UNITS = {"edge-agent.service": "edge-agent", "coordinator.service": "coordinator serve"}
PROGRAMS: dict[str, click.Command] = {"edge-agent": agent_main, "coordinator": coordinator_main}
HELP = {"-h", "--help"}
ASSIGNMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=(.*)", re.S)
SEPARATOR = re.compile(r"\s*(?:&&|\|\||[|;])\s*")
FENCE = re.compile(r"^[ \t]*```(\w*)\n(.*?)^[ \t]*```", re.M | re.S)
COMMENTED_ASSIGNMENT = re.compile(r"^(\s*)#\s*(?=[A-Z_][A-Z0-9_]*=)", re.M)
EXPANSION = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")


# ------------------------------------------------------------------ reading the programs


def options(command: click.Command) -> set[str]:
    names = set(HELP)
    for param in command.params:
        if isinstance(param, click.Option):
            names.update(param.opts, param.secondary_opts)
    return names


def subcommands(command: click.Command) -> dict[str, click.Command]:
    """A group's subcommands by name, those it loads only when asked for too (`coordinator
    simulate`); none for a command."""
    if not isinstance(command, click.Group):
        return {}
    context = click.Context(command)
    found = {name: command.get_command(context, name) for name in command.list_commands(context)}
    return {name: sub for name, sub in found.items() if sub is not None}


def commands() -> Iterator[click.Command]:
    """Both programs and all their subcommands."""
    stack = list(PROGRAMS.values())
    while stack:
        command = stack.pop()
        yield command
        stack.extend(subcommands(command).values())


def known_variables() -> set[str]:
    """The environment variables edge-agent and coordinator read."""
    names = {PASSWORD_ENV, PROFILE_PATH_ENV, MAX_DATA_ENV}
    for command in commands():
        for param in command.params:
            if isinstance(param.envvar, str):
                names.add(param.envvar)
            elif param.envvar:
                names.update(param.envvar)
    return names


def unknown_flags(words: list[str]) -> list[str]:
    """The options of a command line (program first) that its command does not have."""
    command = PROGRAMS[Path(words[0]).name]
    name = Path(words[0]).name
    unknown = []
    for word in words[1:]:
        if word.startswith("-") and word != "-":
            if word.split("=", 1)[0] not in options(command):
                unknown.append(f"{name} {word}")
        elif word in subcommands(command):
            command = subcommands(command)[word]
            name += f" {word}"
    return unknown


def invoked(words: list[str]) -> str:
    """'coordinator run' for a command line (program first): the program and subcommands."""
    command = PROGRAMS[Path(words[0]).name]
    name = Path(words[0]).name
    for word in words[1:]:
        if word in subcommands(command):
            command = subcommands(command)[word]
            name += f" {word}"
    return name


# ------------------------------------------------------------------ reading the docs


def shell_commands(text: str) -> Iterator[list[str]]:
    """Each simple command of shell text as words: continuations joined, comments dropped
    (but a commented-out VAR=value line counts), pipelines and lists split."""
    text = COMMENTED_ASSIGNMENT.sub(r"\1", text.replace("\\\n", " "))
    for line in text.splitlines():
        for part in SEPARATOR.split(line):
            try:
                words = shlex.split(part, comments=True)
            except ValueError:
                assert not any(p in part for p in PROGRAMS), f"cannot parse: {part!r}"
                continue
            if words:
                yield words


def invocation(words: list[str], unit_vars: dict[str, list[str]]) -> list[str] | None:
    """The command line from `edge-agent`/`coordinator` on, after `sudo [-u USER]` and VAR=value
    prefixes; a unit's variable (AGENT_ARGS=...) as the command its ExecStart makes of it;
    None for any other command."""
    first = ASSIGNMENT.fullmatch(words[0])
    if first and first[1] in unit_vars:
        return [*unit_vars[first[1]], *shlex.split(first[2]), *words[1:]]
    i = 0
    if words[0] == "sudo":
        i = 1
        while i < len(words) and words[i].startswith("-"):
            i += 2 if words[i] == "-u" else 1
    while i < len(words) and ASSIGNMENT.fullmatch(words[i]):
        i += 1
    if i < len(words) and Path(words[i]).name in PROGRAMS:
        return words[i:]
    return None


def read_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """A systemd unit's sections, each key with all its values in order."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in path.read_text().replace("\\\n", " ").splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None and "=" in line, f"{path.name}: not a unit line: {raw!r}"
        key, value = line.split("=", 1)
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def exec_start(path: Path) -> list[str]:
    (line,) = read_unit(path)["Service"]["ExecStart"]
    return shlex.split(line)


def unit_variables() -> dict[str, list[str]]:
    """Each variable a unit's ExecStart expands, with the words before it."""
    found = {}
    for name in UNITS:
        words = exec_start(DOCS / name)
        for i, word in enumerate(words):
            for var in EXPANSION.findall(word):
                found[var] = words[:i]
    return found


def deploy_command_lines() -> list[list[str]]:
    """Every edgefl command line deploy.md shows: in code blocks and in inline code."""
    markdown = DEPLOY.read_text()
    unit_vars = unit_variables()
    texts = [body for lang, body in FENCE.findall(markdown) if lang in ("", "sh", "bash")]
    prose = FENCE.sub("", markdown).replace("\n", " ")
    texts += re.findall(r"`([^`]+)`", prose)
    lines = []
    for text in texts:
        for words in shell_commands(text):
            line = invocation(words, unit_vars)
            if line is not None:
                lines.append(line)
    return lines


# ------------------------------------------------------------------ the tests


def test_the_checker_tells_a_subcommands_options_apart() -> None:
    assert unknown_flags(["coordinator", "run", "r.toml", "--report", "x", "--plot", "p"]) == []
    assert unknown_flags(["coordinator", "status", "--report", "x"]) == [
        "coordinator status --report"
    ]
    assert unknown_flags(["/opt/v/bin/edge-agent", "predict", "in.npz", "--model", "m"]) == []
    assert unknown_flags(["edge-agent", "--tls", "--no-tls", "--nonsense=1"]) == [
        "edge-agent --nonsense=1"
    ]


def test_every_option_in_deploy_md_exists() -> None:
    lines = deploy_command_lines()
    shown = {invoked(words) for words in lines}
    for wanted in ("edge-agent", "edge-agent predict", "coordinator serve", "coordinator run"):
        assert wanted in shown, f"deploy.md shows no `{wanted}` command line"
    assert "coordinator status" in shown
    unknown = sorted({flag for words in lines for flag in unknown_flags(words)})
    assert unknown == [], f"deploy.md uses options the programs lack: {unknown}"


def test_every_option_named_alone_in_deploy_md_exists() -> None:
    prose = FENCE.sub("", DEPLOY.read_text()).replace("\n", " ")
    named = {span.split()[0] for span in re.findall(r"`(--[^`]+)`", prose)}
    assert "--profile" in named
    existing = set().union(*(options(command) for command in commands()))
    assert sorted(named - existing) == []


def test_every_edgefl_variable_named_is_read_by_the_programs() -> None:
    texts = [DEPLOY.read_text(), *((DOCS / name).read_text() for name in UNITS)]
    named = set(re.findall(r"\bEDGEFL_[A-Z0-9_]+\b", "\n".join(texts)))
    assert {"EDGEFL_BROKER", "EDGEFL_CONFIG"} <= named
    assert sorted(named - known_variables()) == []


@pytest.mark.parametrize("name", sorted(UNITS))
def test_unit_starts_its_command_with_existing_options(name: str) -> None:
    unit = read_unit(DOCS / name)
    assert {"Unit", "Service", "Install"} <= unit.keys()
    words = exec_start(DOCS / name)
    assert words[0].startswith("/opt/edgefl/venv/bin/")
    assert invoked(words) == UNITS[name]
    assert unknown_flags(words) == []


@pytest.mark.parametrize("name", sorted(UNITS))
def test_unit_runs_unprivileged_restarts_and_stops_cleanly(name: str) -> None:
    unit = read_unit(DOCS / name)
    service = unit["Service"]
    assert service["User"] == ["edgefl"]
    assert service["Restart"] == ["on-failure"]
    assert service["KillSignal"] == ["SIGTERM"]
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]
    assert "network-online.target" in unit["Unit"]["Wants"][0]
    assert all(path.startswith("-") for path in service["EnvironmentFile"]), "must be optional"


@pytest.mark.parametrize("name", sorted(UNITS))
def test_unit_works_without_its_environment_file(name: str) -> None:
    """Every variable ExecStart expands has a default, so a missing env file is no error."""
    service = read_unit(DOCS / name)["Service"]
    defaults = {line.split("=", 1)[0] for line in service.get("Environment", [])}
    expanded = set(EXPANSION.findall(service["ExecStart"][0]))
    assert expanded and expanded <= defaults


def test_agent_unit_keeps_its_state_in_its_writable_state_directory() -> None:
    """ProtectSystem=strict leaves only the StateDirectory writable."""
    service = read_unit(DOCS / "edge-agent.service")["Service"]
    words = exec_start(DOCS / "edge-agent.service")
    state_dir = words[words.index("--state-dir") + 1]
    assert service["ProtectSystem"] == ["strict"]
    assert state_dir == "/var/lib/" + service["StateDirectory"][0]


def test_example_run_file_loads() -> None:
    run = load_run_file(DOCS / "run.example.toml")
    assert run.wanted == 4
    config = run.config(run.wanted)
    assert config.on_devices and config.input_shape == (40,)


def test_toml_examples_in_deploy_md_load(tmp_path: Path) -> None:
    blocks = [body for lang, body in FENCE.findall(DEPLOY.read_text()) if lang == "toml"]
    broker_keys = {
        flag[2:].replace("-", "_")
        for param in agent_main.params
        if isinstance(param, click.Option) and isinstance(param.envvar, str)
        if param.envvar.startswith("EDGEFL_") and param.envvar != "EDGEFL_LOG_FORMAT"
        for flag in param.opts
    }
    kinds = []
    for i, block in enumerate(blocks):
        data = tomllib.loads(block)
        kinds.append(set(data))
        if "run" in data:
            (tmp_path / f"run{i}.toml").write_text(block)
            load_run_file(tmp_path / f"run{i}.toml")
        else:
            assert set(data) == {"broker"}, f"unexpected TOML example: {block}"
            assert sorted(set(data["broker"]) - broker_keys) == []
    assert {"run"} in kinds and {"broker"} in kinds
