"""Run files: one TOML `[run]` table that describes a run of real devices.

`coordinator run FILE` on the gateway and `edge-agent --expect N --run FILE` on every device
without a coordinator read the same file, so a fleet is configured once instead of by a long
list of flags repeated on every device. Its keys are the long options of `coordinator
simulate` with dashes as underscores, plus how many agents the run waits for (`agents` or
`agent_ids`), what the devices' data looks like (`input_shape`, `classes`, `min_samples`) and
timeouts. For example::

    [run]
    strategy = "dadpfl"
    dataset = "device"     # the default: every device learns from its own data
    agents = 4
    input_shape = [40]
    classes = 10
    rounds = 20
    early_stop = true
    round_timeout = 60     # seconds to wait for a neighbour's model
    init = "previous"      # each device starts from its current model (default: "seed")
    keep = "latest"        # which model a device keeps current; or "best"

Everything that can be checked before the roster is known is checked when the file is loaded,
so a mistake is a one-line error before anyone waits for the fleet.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import sys
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.data import BUILTIN_DATASETS, PYTHON_SOURCE, USER_DATASETS
from agent.experiment import (
    DEVICE_DATA,
    INIT_CHOICES,
    KEEP_POLICIES,
    MAX_SECONDS,
    ExperimentConfig,
    default_model,
)
from agent.learning.config import MODEL_NAMES, StrategyConfig
from agent.options import _CHOICES, experiment_config
from agent.user_code import is_import_path, resolved
from protocol.errors import ProtocolError
from protocol.topics import check_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


@dataclass(frozen=True)
class RunTimeouts:
    """How long a run waits for what it needs from the fleet, in seconds."""

    round_s: float = 120.0
    """A neighbour's model, before going on without it."""
    vote_s: float = 60.0
    """A round's votes, before counting the missing ones as 0."""
    linger_s: float = 60.0
    """After the last round, keep serving neighbours at most this long."""
    join_s: float = 300.0
    """`coordinator run`: the agents to be online, before giving up."""


_TIMEOUT_KEYS = {
    "round_timeout": "round_s",
    "vote_timeout": "vote_s",
    "linger": "linger_s",
    "join_timeout": "join_s",
}
_DEVICE_ONLY = ("input_shape", "classes", "targets")
_VALUE_CHOICES: dict[str, tuple[str, ...]] = {
    **_CHOICES,
    "model": MODEL_NAMES,
    "init": INIT_CHOICES,
    "keep": KEEP_POLICIES,
}
_DATASETS = (
    DEVICE_DATA,
    *BUILTIN_DATASETS,
    *(f"{kind}:PATH" for kind in USER_DATASETS),
    "python:MODULE:FUNCTION",
)


def _config_kinds() -> dict[str, Any]:
    """The value type of every experiment and strategy field, None dropped (TOML has no
    null: a key left out is the default)."""
    kinds = {}
    for cls in (ExperimentConfig, StrategyConfig):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name != "learning" and not f.metadata.get("internal"):
                hint = hints[f.name]
                kinds[f.name] = next(
                    t for t in typing.get_args(hint) or (hint,) if t is not type(None)
                )
    return kinds


_KINDS = _config_kinds()
KNOWN_KEYS: tuple[str, ...] = (*_KINDS, "agent_ids", *_TIMEOUT_KEYS)
"""Every key a `[run]` table may hold, in the order the docs list them."""


@dataclass(frozen=True)
class RunFile:
    """A loaded run file: the experiment values it gives and what the run waits for."""

    path: Path
    values: dict[str, Any]
    """Experiment and strategy values as `experiment_config` takes them: only those given."""
    agents: int | None
    agent_ids: tuple[str, ...] | None
    timeouts: RunTimeouts

    @property
    def dataset(self) -> str:
        """'device' (each agent's own data) unless the file names a dataset every agent
        generates and keeps its share of (the experiment mode)."""
        return str(self.values.get("dataset", DEVICE_DATA))

    @property
    def wanted(self) -> int:
        """How many agents the run waits for."""
        if self.agent_ids is not None:
            return len(self.agent_ids)
        if self.agents is None:  # parse_run_table requires one of them
            raise ValueError(f"{self.path}: give agents = N or agent_ids = [...]")
        return self.agents

    def config(
        self,
        roster_size: int,
        input_shape: Sequence[int] | None = None,
        classes: int | None = None,
    ) -> ExperimentConfig:
        """The validated config for a fixed roster; `input_shape` and `classes` (what the
        agents reported of their data) serve where the file gives none."""
        try:
            return self._build(roster_size, input_shape, classes)
        except ValueError as exc:
            raise _located(str(self.path), exc) from None

    def outline(self) -> ExperimentConfig:
        """The config before any agent is heard: placeholders where the agents report their
        data (input shape, classes), so only what the file fixes counts (strategy, rounds,
        model)."""
        return self.config(self.wanted, (1,), 2)

    def _build(
        self, roster_size: int, input_shape: Sequence[int] | None, classes: int | None
    ) -> ExperimentConfig:
        values = {**self.values, "dataset": self.dataset, "agents": roster_size}
        if self.dataset == DEVICE_DATA:
            values.setdefault("input_shape", None if input_shape is None else tuple(input_shape))
            values.setdefault("classes", classes)
            needed: tuple[str, ...] = ("input_shape", "classes")
            if values.get("task", "classification") != "classification":
                needed = ("input_shape",)
            for key in needed:
                if values[key] is None:
                    raise ValueError(f"{key} is not in [run] and the agents reported none")
            # Named, the model of the devices' data goes into the run message and the report
            # (the agents would build the same from None, which a report shows as null).
            values.setdefault("model", default_model(DEVICE_DATA, values["input_shape"]))
        return experiment_config(values)


def load_run_file(
    path: str | Path, agents: int | None = None, *, files_here: bool = False
) -> RunFile:
    """Read and check a run file; ValueError with one line that starts with the path.
    `agents` (`edge-agent --expect N`) serves where the file names neither agents nor
    agent_ids. `files_here`: the files it names are on this machine (`check_files`): a lab
    run's, not the devices' of a run on real devices."""
    path = Path(path)
    try:
        with path.open("rb") as stream:
            data = tomllib.load(stream)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read run file: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from None
    try:
        table = _run_table(data)
    except ValueError as exc:
        raise _located(str(path), exc) from None
    if agents is not None and "agents" not in table and "agent_ids" not in table:
        table = {**table, "agents": agents}
    return parse_run_table(table, str(path), files_here=files_here)


def parse_run_table(table: Mapping[str, Any], source: str, *, files_here: bool = False) -> RunFile:
    """Check a `[run]` table (as tomllib reads it); errors start with `source`."""
    try:
        for key in table:
            if key not in KNOWN_KEYS:
                raise ValueError(f"unknown key {key!r} in [run]{_did_you_mean(key, KNOWN_KEYS)}")
        values = {k: _value(k, v) for k, v in table.items() if k in _KINDS and k != "agents"}
        values.update(_user_code_beside(values, Path(source).parent))
        agents, agent_ids = _roster(table)
        run = RunFile(Path(source), values, agents, agent_ids, _timeouts(table))
        _check_dataset(values)
        if files_here:
            check_files(values)
        run._build(run.wanted, (1,), 2)  # placeholders where the agents report their data
    except ValueError as exc:  # ProtocolError included
        raise _located(source, exc) from None
    return run


def _run_table(data: Mapping[str, Any]) -> Mapping[str, Any]:
    for key, value in data.items():
        if key == "run":
            continue
        if isinstance(value, dict):
            raise ValueError(f"unknown table [{key}]; a run file holds only a [run] table")
        raise ValueError(f"key {key!r} is outside [run]; put it under the [run] table")
    if "run" not in data:
        raise ValueError("no [run] table")
    if not isinstance(data["run"], dict):
        raise ValueError("run must be a table: [run] followed by its keys")
    return typing.cast(Mapping[str, Any], data["run"])


def _located(source: str, exc: ValueError) -> ValueError:
    """A config's error as one line naming the file, in the run file's key names."""
    return ValueError(f"{source}: {_as_keys(str(exc))}")


_FLAG = re.compile(r"--([a-z][a-z0-9-]*)")


def _as_keys(message: str) -> str:
    """The config's messages name command-line flags; a run file's user wrote keys."""

    def key(match: re.Match[str]) -> str:
        name = match[1].replace("-", "_")
        return name if name in KNOWN_KEYS else match[0]

    return _FLAG.sub(key, message)


def _did_you_mean(word: str, options: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _shown(value: Any) -> str:
    """A value as the user wrote it in TOML (true, not True), on one line."""
    return str(value).lower() if isinstance(value, bool) else repr(value)


def _value(key: str, value: Any) -> Any:
    """A config value of the type its field takes, one of its choices where it has them."""
    kind = _KINDS[key]
    if kind is bool:
        ok, what = isinstance(value, bool), "true or false"
    elif kind is int:
        ok, what = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif kind is float:
        ok, what = _is_number(value), "a finite number"
    elif kind is str:
        ok, what = isinstance(value, str), "a string"
    else:  # the input shape, tuple[int, ...]
        ok, what = _is_shape(value), "a list of positive integers, e.g. [3, 32, 32]"
    if not ok:
        raise ValueError(f"{key} must be {what}, got {_shown(value)}")
    choices = _VALUE_CHOICES.get(key)
    if key in USER_CODE_KEYS and is_import_path(value):
        choices = None  # the user's own model or strategy, imported with the run's config
    if choices is not None and value not in choices:
        raise ValueError(
            f"{key} must be one of {', '.join(choices)}; got {_shown(value)}"
            f"{_did_you_mean(value, choices)}"
        )
    return float(value) if kind is float else tuple(value) if key == "input_shape" else value


USER_CODE_KEYS = ("model", "loss", "metric", "strategy")
"""Keys that may name the user's code: MODULE:FUNCTION or ./FILE.py:FUNCTION (a class for
the strategy)."""


def _user_code_beside(values: Mapping[str, Any], folder: Path) -> dict[str, str]:
    """User code named by a file path, resolved beside the run file (``./nets.py:build`` is
    the nets.py next to it, wherever the command runs); a python: dataset likewise."""
    found = {
        key: resolved(values[key], folder)
        for key in USER_CODE_KEYS
        if isinstance(values.get(key), str) and is_import_path(values[key])
    }
    dataset = values.get("dataset")
    if isinstance(dataset, str) and dataset.startswith(PYTHON_SOURCE):
        found["dataset"] = PYTHON_SOURCE + resolved(dataset[len(PYTHON_SOURCE) :], folder)
    return found


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_shape(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in value)
    )


def _roster(table: Mapping[str, Any]) -> tuple[int | None, tuple[str, ...] | None]:
    """`agents`, `agent_ids`: one of them says how many agents the run waits for."""
    if "agents" not in table and "agent_ids" not in table:
        raise ValueError("give agents = N or agent_ids = [...]: the agents the run waits for")
    agents = _value("agents", table["agents"]) if "agents" in table else None
    if agents is not None and agents < 1:
        raise ValueError(f"agents must be at least 1, got {agents}")
    ids = _agent_ids(table["agent_ids"]) if "agent_ids" in table else None
    if agents is not None and ids is not None and agents != len(ids):
        raise ValueError(f"agents = {agents} but agent_ids names {len(ids)} agents")
    return agents, ids


def _agent_ids(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"agent_ids must be a non-empty list of agent names, got {_shown(value)}")
    seen: set[str] = set()
    for name in value:
        try:
            check_name(name, "agent")
        except ProtocolError as exc:
            raise ValueError(f"agent_ids: {exc}") from None
        if name in seen:
            raise ValueError(f"agent_ids names {name!r} twice")
        seen.add(name)
    return tuple(value)


def _timeouts(table: Mapping[str, Any]) -> RunTimeouts:
    given = {}
    for key, attr in _TIMEOUT_KEYS.items():
        if key not in table:
            continue
        seconds = table[key]
        if not _is_number(seconds):
            raise ValueError(f"{key} must be a number of seconds, got {_shown(seconds)}")
        if seconds < 0 or (seconds == 0 and key != "linger"):
            bound = ">= 0" if key == "linger" else "> 0"
            raise ValueError(f"{key} must be {bound} seconds, got {_shown(seconds)}")
        if seconds > MAX_SECONDS:
            raise ValueError(
                f"{key} must be at most {MAX_SECONDS:,.0f} seconds (a week), got {_shown(seconds)}"
            )
        given[attr] = float(seconds)
    return RunTimeouts(**given)


def _check_dataset(values: Mapping[str, Any]) -> None:
    """'device', or a dataset every agent can generate or load; keys that only one of the
    two modes reads are errors in the other rather than silently ignored."""
    dataset = values.get("dataset", DEVICE_DATA)
    if dataset == DEVICE_DATA:
        if "partition" in values:
            raise ValueError(
                "partition has no effect with dataset 'device': each agent learns from all of "
                "its own data"
            )
        return
    kind, _, arg = dataset.partition(":")
    user_function = kind == PYTHON_SOURCE[:-1] and is_import_path(arg)
    known = kind in BUILTIN_DATASETS or (kind in USER_DATASETS and arg)
    if not (user_function or known):
        raise ValueError(f"unknown dataset {dataset!r}; known: {', '.join(_DATASETS)}")
    for key in _DEVICE_ONLY:
        if key in values:
            raise ValueError(
                f"{key} applies to dataset 'device' only (the agents' own data), not {dataset!r}"
            )


def run_timeouts(timeouts: RunTimeouts) -> dict[str, float]:
    """The timeouts a run message carries to the agents (`messages.RunConfig.timeouts`); the
    join timeout is the coordinator's own."""
    return {"round_s": timeouts.round_s, "vote_s": timeouts.vote_s, "linger_s": timeouts.linger_s}


def lab_config(path: str | Path, flags: Mapping[str, Any]) -> ExperimentConfig:
    """`coordinator simulate --run FILE` (and emulate, and the Python API): the run file's
    values, with the command's flags over them. The file must name a dataset: a simulated
    fleet has no devices with data of their own. ValueError with one line naming the file."""
    runfile = load_run_file(path, files_here=True)
    if runfile.dataset == DEVICE_DATA:
        raise ValueError(
            f'{path}: a simulated fleet needs a dataset in [run] (e.g. dataset = "digits" '
            "or \"python:./data.py:load\"); 'device' means each device's own data"
        )
    given = {k: v for k, v in flags.items() if v is not None}
    check_files(given)
    try:
        return experiment_config({**runfile.values, "agents": runfile.wanted, **given})
    except ValueError as exc:
        raise _located(str(path), exc) from None


def check_files(values: Mapping[str, Any]) -> None:
    """The files a lab run's values name exist on this machine: its dataset's (`npz:PATH`,
    `imagefolder:PATH`, `cifar10:PATH`, `python:./FILE.py:FUNCTION`) and its code's
    (`./FILE.py:FUNCTION`). Checked before the config is (which loads torch) and before the
    run starts, so a missing file is its one line at once, not seconds later; the loaders
    say the same if one goes missing meanwhile. ValueError naming the file."""
    dataset = values.get("dataset")
    dataset = dataset if isinstance(dataset, str) else ""
    kind, _, arg = dataset.partition(":")
    if kind in USER_DATASETS and arg:
        folder = {"imagefolder": "image folder", "cifar10": "CIFAR-10 folder"}.get(kind)
        path = Path(arg)
        if not (path.is_dir() if folder else path.is_file()):
            raise ValueError(f"{folder or 'npz file'} not found: {path}")
    code = {key: values.get(key) for key in USER_CODE_KEYS}
    if dataset.startswith(PYTHON_SOURCE):
        code["dataset"] = dataset[len(PYTHON_SOURCE) :]
    for key, spec in code.items():
        if isinstance(spec, str) and is_import_path(spec):
            source = spec.rpartition(":")[0]
            if source.endswith(".py") and not Path(source).expanduser().is_file():
                raise ValueError(f"{key} {spec!r}: no such file {source}")
