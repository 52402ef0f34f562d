"""Command-line flags for an experiment, generated from the config dataclasses.

Every hyper-parameter of ExperimentConfig and StrategyConfig becomes a flag with the field's
help text and default, so `simulate` (and later `emulate`) expose all of them without a
hand-kept list that could drift from the code. `--help` shows the essential ones (`ESSENTIAL`);
the research hyper-parameters are tucked under `--help-all` (`protocol.cli_help`).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from typing import Any

import click

from agent.experiment import ExperimentConfig
from agent.learning.config import (
    BATCHNORM_MODES,
    DEFAULT_STOP_RULE,
    DETECTION_SCALES,
    DISTANCES,
    DP_CLIENT,
    DP_MODES,
    DP_SAMPLE,
    FALLBACKS,
    MASK_UNITS,
    METRIC_GOALS,
    OPTIMIZERS,
    PRESETS,
    REDUCE_MODES,
    STOP_RULES,
    TASKS,
    WIRE_FORMATS,
    StrategyConfig,
    preset,
)
from agent.learning.robust_rules import ATTACKS
from agent.learning.staleness import STALENESS_WEIGHTS
from agent.learning.strategies import SCOPES, Scope, fingerprint
from agent.learning.strategies import strategy as strategy_record
from agent.learning.topology import TOPOLOGIES
from agent.user_code import is_import_path, resolved
from protocol.cli_help import RESEARCH, tucked

_TYPES = {int: int, float: float, str: str}
_CHOICES: dict[str, tuple[str, ...]] = {
    "strategy": PRESETS,
    "topology": TOPOLOGIES,
    "reduce": REDUCE_MODES,
    "mask_unit": MASK_UNITS,
    "wire": WIRE_FORMATS,
    "detection_distance": DISTANCES,
    "detection_scale": DETECTION_SCALES,
    "optimizer": OPTIMIZERS,
    "fallback": FALLBACKS,
    "stop_rule": tuple(STOP_RULES),
    "attack": ATTACKS,
    "batchnorm": BATCHNORM_MODES,
    "task": TASKS,
    "metric_goal": METRIC_GOALS,
    "dp": DP_MODES,
    "staleness_weight": STALENESS_WEIGHTS,
}


class StrategyChoice(click.Choice):
    """--strategy: a shipped strategy's name, or the user's class by its import path
    (MODULE:CLASS, ./FILE.py:CLASS), imported and checked with the run's config."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and is_import_path(value):
            return value
        return super().convert(value, param, ctx)


def _fields() -> list[tuple[dataclasses.Field, Any]]:
    """(field, its type) for every experiment and strategy parameter, in display order."""
    pairs = []
    for cls in (ExperimentConfig, StrategyConfig):
        hints = typing.get_type_hints(cls)
        pairs += [
            (f, hints[f.name])
            for f in dataclasses.fields(cls)
            if f.name != "learning" and f.metadata.get("flag", True)
        ]
    return pairs


ESSENTIAL = (
    "dataset",
    "model",
    "task",
    "agents",
    "partition",
    "seed",
    "profiles",
    "round_time_s",
    "strategy",
    "rounds",
    "epochs",
    "batch_size",
    "lr",
)
"""The experiment flags `--help` shows: what to learn on, by which strategy, how long; the
rest (the strategies' hyper-parameters, attacks, custom losses and metrics, measurement
knobs) are listed by `--help-all` under "Research options"."""

EXPERIMENT = "Experiment options (with --expect N instead of --run FILE)"
"""Where `edge-agent --help-all` lists the essential experiment flags: a device gets its run
from a coordinator or a run file, and needs them only to start a run among peers."""


def _option(
    field: dataclasses.Field, hint: Any, essential: str | None
) -> Callable[[Callable], Callable]:
    flag = "--" + field.name.replace("_", "-")
    help_text = field.metadata.get("help", "")
    section = essential if field.name in ESSENTIAL else RESEARCH
    where = tucked(section) if section is not None else {}
    if hint is bool:
        return click.option(f"{flag}/--no-{flag[2:]}", default=None, help=help_text, **where)
    kind: click.ParamType | type = next(
        (_TYPES[t] for t in typing.get_args(hint) or (hint,) if t in _TYPES), str
    )
    if field.name in _CHOICES:
        choice = StrategyChoice if field.name == "strategy" else click.Choice
        kind = choice(_CHOICES[field.name])
    default = field.default if field.default is not dataclasses.MISSING else None
    shown = f" [default: {default}]" if default not in (None, "") else ""
    metavar = "NAME" if field.name == "strategy" else None  # its help lists the names
    return click.option(
        flag, type=kind, default=None, metavar=metavar, help=help_text + shown, **where
    )


def experiment_options(command: Callable) -> Callable:
    """Decorate a click command with one flag per experiment and strategy parameter: the
    `ESSENTIAL` ones shown by --help, the others under --help-all (simulate, emulate)."""
    return _with_experiment_options(command, None)


def expect_options(command: Callable) -> Callable:
    """The experiment flags of `edge-agent`, all under --help-all: the essential ones in
    their own section, the research ones in theirs."""
    return _with_experiment_options(command, EXPERIMENT)


def _with_experiment_options(command: Callable, essential: str | None) -> Callable:
    for field, hint in reversed(_fields()):
        command = _option(field, hint, essential)(command)
    return command


def experiment_config(values: dict[str, Any]) -> ExperimentConfig:
    """Build and validate the config from parsed flags; only flags given override defaults.

    Raises ValueError with a one-sentence reason for an impossible combination.
    """
    given = {k: v for k, v in values.items() if v is not None}
    strategy_names = {f.name for f in dataclasses.fields(StrategyConfig)}
    learning = {k: v for k, v in given.items() if k in strategy_names and k != "strategy"}
    experiment = {k: v for k, v in given.items() if k not in strategy_names}
    strategy = resolved(given.get("strategy", StrategyConfig.strategy))  # ./FILE.py from here
    for name, applies, where in FLAG_SCOPES:
        if name in learning and not applies(strategy, learning):
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} has no effect here: it applies to {where}")
    learning.update(fitted_neighbours(strategy, learning, experiment))
    config = ExperimentConfig(
        **experiment,
        strategy_fingerprint=fingerprint(strategy),
        learning=preset(strategy, **learning),
    )
    config.validate()
    return config


def fitted_neighbours(
    strategy: str, learning: dict[str, Any], experiment: dict[str, Any]
) -> dict[str, int]:
    """The default neighbour count cut to a small fleet (3 agents cannot have 5 neighbours
    each); a count given explicitly is kept, and validated as given."""
    if "neighbours" in learning:
        return {}
    defaults = preset(strategy)
    if not strategy_record(strategy).decentralized or (
        learning.get("topology", defaults.topology) != "random"
    ):
        return {}
    agents = experiment.get("agents", ExperimentConfig.agents)
    if agents < 2:
        raise ValueError(f"{strategy} needs at least 2 agents, got {agents}")
    return {"neighbours": min(defaults.neighbours, agents - 1)}


FLAG_SCOPES: tuple[tuple[str, Callable[[str, dict[str, Any]], bool], str], ...] = tuple(
    (scope.option, scope.applies, scope.readers())
    for scope in (
        *SCOPES,
        Scope(
            "delta_fraction", "runs with --wire delta", lambda given: given.get("wire") == "delta"
        ),
        *(
            Scope(
                option,
                "runs with --dp sample or client",
                lambda given: given.get("dp") in (DP_SAMPLE, DP_CLIENT),
            )
            for option in ("dp_noise", "dp_clip", "dp_delta", "max_epsilon")
        ),
        *(
            Scope(
                option,
                "runs with --asynchronous (and fedbuff)",
                lambda given: bool(given.get("asynchronous")),
            )
            for option in ("staleness_weight", "max_staleness")
        ),
        Scope("dp_average", "runs with --dp sample", lambda given: given.get("dp") == DP_SAMPLE),
        Scope(
            "dp_seeded_noise",
            "runs with --dp client --secure-aggregation",
            lambda given: given.get("dp") == DP_CLIENT and bool(given.get("secure_aggregation")),
        ),
        Scope("stop_rule", "runs with --early-stop", lambda given: bool(given.get("early_stop"))),
        Scope(
            "stop_patience", "runs with --early-stop", lambda given: bool(given.get("early_stop"))
        ),
        Scope(
            "stop_delta",
            "runs with --early-stop and --stop-rule progress",
            lambda given: (
                bool(given.get("early_stop"))
                and given.get("stop_rule", DEFAULT_STOP_RULE) == "progress"
            ),
        ),
    )
)
"""Strategy flags that only some runs read, each with whether a strategy's run with the
given flags reads it and who does: given elsewhere, they are an error, not a silent no-op.
Those only some strategies read are the table's (`strategies.SCOPES`)."""
