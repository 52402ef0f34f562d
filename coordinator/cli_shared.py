"""What the coordinator's commands share: the gateway's (`coordinator.cli`) and the lab's
(`coordinator.lab_cli`, simulate and emulate). The output console, the dashboard's options
and server, the checks for optional extras, and the report a run writes and shows.

A module of its own so that both import it, and neither imports the other: `coordinator.cli`
loads the lab's commands, and with them the experiment's options, only when one of them runs
or is listed.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from agent.files import atomic_write
from protocol import BrokerAddress, ConfigError, MqttTransport, topics
from protocol.cli import BrokerSettings, say
from protocol.cli import console as output_console
from protocol.extras import DASHBOARD, EMBEDDED_BROKER, GATEWAY_EXTRA, PLOTS, require
from protocol.signing import Signer

console = output_console(stderr=False)
"""Reports and tables: on stdout, unwrapped when not on a terminal."""


def require_extra(
    extra: str,
    command: str,
    *,
    embedded_broker: bool = False,
    http: str | None = None,
    plot_dir: str | None = None,
) -> None:
    """Before `command` starts anything: the modules of each feature it will use are
    installed, or one line says which extra brings them (exit 2). The dashboard is the
    gateway's, whichever command serves it; a built-in dataset is checked where it is
    loaded (`agent.data.load_dataset`), before any agent starts."""
    if embedded_broker:
        require(extra, EMBEDDED_BROKER, f"{command}'s embedded broker (without --broker)")
    if http is not None:
        require(GATEWAY_EXTRA, DASHBOARD, f"{command} --http (the dashboard and /metrics)")
    if plot_dir is not None:
        require(extra, PLOTS, f"{command} --plot")


def http_options(command: Callable) -> Callable:
    """--http and --http-token-file (or EDGEFL_HTTP_TOKEN): the live dashboard and /metrics
    (serve, run, emulate); the command gets the token as `http_token`."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        kwargs["http_token"] = dashboard_token(kwargs.pop("http_token_file"), kwargs["http_token"])
        return command(*args, **kwargs)

    wrapper = click.option(
        "--http-token",
        envvar=HTTP_TOKEN_ENV,
        hidden=True,
        callback=refuse_token_on_command_line,
    )(wrapper)
    wrapper = click.option(
        "--http-token-file",
        type=click.Path(dir_okay=False),
        envvar="EDGEFL_HTTP_TOKEN_FILE",
        show_envvar=True,
        help=f"File holding the access token the dashboard requires (needed when --http binds "
        f"beyond loopback), or set {HTTP_TOKEN_ENV}. There is no --http-token: a command line "
        "is visible to every user in `ps`.",
    )(wrapper)
    return click.option(
        "--http",
        "http",
        default=None,
        metavar="[HOST:]PORT",
        help="Serve the live dashboard and Prometheus /metrics here (host 127.0.0.1 unless "
        "given). Off unless given.",
    )(wrapper)


HTTP_TOKEN_ENV = "EDGEFL_HTTP_TOKEN"


def refuse_token_on_command_line(
    ctx: click.Context, param: click.Parameter, value: str | None
) -> str | None:
    """The token may come from EDGEFL_HTTP_TOKEN, never from the command line."""
    if (
        value is not None
        and ctx.get_parameter_source(param.name or "") is ParameterSource.COMMANDLINE
    ):
        raise ConfigError(
            "--http-token would show the token to every user of this machine (`ps`): put it "
            f"in a file given by --http-token-file FILE, or in {HTTP_TOKEN_ENV}"
        )
    return value


def dashboard_token(path: str | None, from_environment: str | None) -> str | None:
    """The dashboard's token: the file's content (its first line), else the variable's."""
    if path is None:
        return from_environment
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise click.BadParameter(
            f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}",
            param_hint="--http-token-file",
        ) from None
    token = lines[0].strip() if lines else ""
    if not token:
        raise click.BadParameter(f"{path} is empty", param_hint="--http-token-file")
    return token


@contextlib.contextmanager
def dashboard(
    http: str | None,
    token: str | None,
    broker: BrokerAddress,
    settings: BrokerSettings,
    fleet: str,
    key: Signer | None,
) -> Iterator[None]:
    """The dashboard of `fleet` on `http` while in use, fed by a connection of its own (a
    run's connection unsubscribes what it no longer needs); nothing without --http."""
    if http is None:
        yield
        return
    from coordinator.agent_logs import RecentLogs
    from coordinator.dashboard import Dashboard, FleetState

    try:
        address = BrokerAddress.parse(http if ":" in http else f"127.0.0.1:{http}", 8080)
        state, logs = FleetState(fleet, key=key), RecentLogs(fleet, key)
        board = Dashboard(state, address.host, address.port, token=token, logs=logs)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--http") from None
    try:
        board.start()
    except OSError as exc:
        raise click.ClickException(f"cannot serve the dashboard on {http}: {exc}") from None
    feed = MqttTransport(broker, settings.transport_options(None))
    feed.subscribe(topics.presence(fleet), state.feed)
    feed.subscribe(topics.status(fleet), state.feed)
    feed.subscribe(topics.log(fleet), logs.feed, qos=0)
    feed.start()
    say(f"dashboard on [bold]{board.url}[/] (metrics at {board.url.rstrip('/')}/metrics)")
    try:
        yield
    finally:
        feed.stop()
        board.stop()


def report_options(command: Callable) -> Callable:
    """--report, --force, --plot and --target-accuracy, shared by simulate, emulate and run
    (they write one schema)."""
    command = click.option(
        "--target-accuracy",
        type=click.FloatRange(-MAX_TARGET, MAX_TARGET),
        default=None,
        help="The report's summary says when (seconds since the run's start) the fleet's "
        "mean accuracy (the run's metric) first reached this [default: the run's final "
        "fleet accuracy less half a point]. The report's alone: the run is the same.",
    )(command)
    command = click.option(
        "--plot",
        "plot_dir",
        type=click.Path(file_okay=False),
        help="Also write PNG plots into this folder.",
    )(command)
    command = click.option(
        "--force",
        is_flag=True,
        help="Replace the --report file if it exists (without it, an existing report is an "
        "error: a run never overwrites another's report in silence).",
    )(command)
    return click.option(
        "--report",
        "report_path",
        type=click.Path(dir_okay=False),
        default=None,
        help=f"Where to write the JSON report [default: {DEFAULT_REPORT}, or the first of "
        "report-2.json, report-3.json, ... not taken].",
    )(command)


DEFAULT_REPORT = "report.json"
MAX_TARGET = 1e12
"""The largest --target-accuracy in magnitude: any metric a model gives (an mae too)."""


class Interrupted(click.ClickException):
    """Ctrl-C (or SIGTERM) ended the run after its report was written: one line, and exit
    130 as a shell reports a command that SIGINT ended."""

    exit_code = 130


def report_target(given: str | None, force: bool, own: str | None = None) -> str:
    """Where a run writes its report, decided before it starts: --report as given, an error
    if that file exists (an earlier run's report) unless --force or it is `own` (the report
    of the interrupted run this one goes on with); without --report, `own`, else report.json
    or the first report-N.json not taken, so a second run never replaces the first's."""
    if given is None:
        return own or first_free(Path(DEFAULT_REPORT))
    path = Path(given)
    if path.exists() and not force and (own is None or path.resolve() != Path(own).resolve()):
        raise ConfigError(
            f"{given} exists (an earlier run's report): give --force to replace it, or "
            "another --report"
        )
    return given


def first_free(path: Path) -> str:
    """`path`, else the first of its numbered names (`report-2.json`, ...) not taken."""
    candidate, number = path, 1
    while candidate.exists():
        number += 1
        candidate = path.with_name(f"{path.stem}-{number}{path.suffix}")
    return str(candidate)


def check_target(target: float | None, task: str, metric: str) -> None:
    """--target-accuracy of a run whose metric is accuracy (a classification task without a
    --metric of its own) is a share: one line for 80 meant as 80 %."""
    accuracy = task == "classification" and not metric
    if target is not None and accuracy and not 0 <= target <= 1:
        raise ConfigError(
            f"--target-accuracy is a share of 1 for accuracy (0.8 for 80 %), got {target:g}"
        )


def publish_report(
    report: dict, report_path: str, plot_dir: str | None, target: float | None = None
) -> None:
    """Write the report atomically (a crash never leaves half of one), show it, plot it;
    with a `target` (--target-accuracy), its time to target is to that one."""
    if target is not None:
        from agent.time_to_target import with_time_to_target

        with_time_to_target(report, target)
    atomic_write(Path(report_path), lambda f: f.write(json.dumps(report, indent=1).encode()))
    if report["rounds"]:
        console.print(summary_table(report))
    console.print(f"report written to [bold]{report_path}[/]")
    if plot_dir and report["rounds"]:
        from coordinator.plots import write_plots

        for path in write_plots(report, plot_dir):
            console.print(f"plot written to {path}")


def summary_table(report: dict) -> Table:
    """The run's figures; the final ones say which round and how many agents they are over
    (a run whose agents died ends early, and its means leave the dead out)."""
    summary, config = report["summary"], report["config"]
    table = Table("figure", "value", title=f"{config['learning']['strategy']} summary")
    final = f"round {summary['rounds']}, {summary['agents_reported']} of {config['agents']} agents"
    from agent.report import metric_of

    metric, higher_is_better = metric_of(report)
    better = "higher" if higher_is_better else "lower"
    shown = metric if metric == "accuracy" else f"{metric}, {better} is better"
    rows = [(f"mean {shown} ({final})", f"{summary[f'mean_{metric}']:.4f}")]
    rows += kept_rows(summary, metric)
    rows += attack_rows(summary, config, metric)
    rows += [
        (f"mean sparsity ({final})", f"{summary['mean_sparsity']:.3f}"),
        ("busiest agent bytes", f"{summary['busiest_agent_bytes']:,} ({summary['busiest_agent']})"),
        ("total bytes", f"{summary['total_bytes']:,}"),
        ("total training FLOPs", f"{summary['total_train_flops']:.3e}"),
        *pruning_rows(summary, config),
        ("rounds", f"{summary['rounds']} of {config['learning']['rounds']}"),
        ("wall time", f"{summary['wall_seconds']:.1f} s"),
    ]
    stopped = summary.get("stopped") or {}
    if stopped:
        saved = sum(s["saved_rounds"] for s in stopped.values())
        rows.append(
            (
                "stopped early",
                f"{len(stopped)} agents, {saved} agent-rounds, "
                f"{sum(s['saved_flops'] for s in stopped.values()):.3e} FLOPs, "
                f"{sum(s['saved_bytes'] for s in stopped.values()):,} bytes saved",
            )
        )
    rows += privacy_rows(summary, config)
    rows += asynchronous_rows(summary, metric, higher_is_better)
    for name, value in rows:
        table.add_row(name, value)
    return table


def asynchronous_rows(summary: dict, metric: str, higher: bool) -> list[tuple[str, str]]:
    """When the fleet first reached the target (`agent.time_to_target`), where the report
    has time stamps to say it; and, under asynchronous rounds, how stale what the agents
    took in was (mean and max over the run)."""
    rows = []
    reach = summary.get("time_to_target") or {}
    if reach.get("timed"):
        sign = ">=" if higher else "<="
        which = "" if reach["given"] else ", the final one's"
        name = f"time to mean {metric} {sign} {reach['target']:.4f}{which}"
        seconds = reach["seconds"]
        virtual = reach.get("clock") == "virtual"  # a board's rounds: hundredths of a second
        shown = "not reached"
        if seconds is not None:
            when = f"{seconds:.3g} virtual s" if virtual else f"{seconds:.1f} s"
            shown = f"{when} (round {reach['round']})"
        rows.append((name, shown))
    staleness = summary.get("staleness")
    if staleness:
        rows.append(
            ("staleness (mean / max rounds)", f"{staleness['mean']:.2f} / {staleness['max']:g}")
        )
    return rows


def privacy_rows(summary: dict, config: dict) -> list[tuple[str, str]]:
    """Under `--dp`: the largest epsilon an agent reached (the fleet's guarantee is its
    weakest member's; under `--dp client` the run's) at the run's delta, and how many
    stopped on their privacy budget."""
    if summary.get("max_epsilon") is None:
        return []
    learning = config["learning"]
    rows = [(f"max epsilon (delta {learning['dp_delta']:g})", f"{summary['max_epsilon']:.3g}")]
    spent = [s for s in (summary.get("stopped") or {}).values() if s.get("reason")]
    if spent:
        limit = learning.get("max_epsilon")
        rows.append(("stopped on privacy budget", f"{len(spent)} agents (max epsilon {limit:g})"))
    return rows


def pruning_rows(summary: dict, config: dict) -> list[tuple[str, str]]:
    """When the agents voted to prune further (t*, DA-DPFL's pruning time), for a strategy
    that votes on it; nothing for one that never prunes further (FedAvg, ...)."""
    from agent.learning.strategies import STRATEGIES

    t_star = summary.get("t_star")
    if t_star is not None:
        return [("pruning time t* (voted)", f"round {t_star}")]
    known = STRATEGIES.get(config["learning"]["strategy"])
    if known is not None and known.prunes_further:
        return [("pruning time t* (voted)", f"not reached in {summary['rounds']} rounds")]
    return []


def kept_rows(summary: dict, metric: str) -> list[tuple[str, str]]:
    """What the devices kept (`agent.learning.fallback`): how many kept each model, the
    strategy's own models' mean beside the kept ones', and what the local-only models cost
    (none in a report from before devices chose)."""
    kept = summary.get("kept") or {}
    if not kept:
        return []
    strategy = summary.get(f"mean_strategy_{metric}")
    rows = [("models kept", ", ".join(f"{name} {count}" for name, count in sorted(kept.items())))]
    if strategy is not None:
        rows.append((f"mean {metric} of the strategy's own models", f"{strategy:.4f}"))
    if summary.get("total_fallback_flops"):
        rows.append(("local-only models' training FLOPs", f"{summary['total_fallback_flops']:.3e}"))
    return rows


def attack_rows(summary: dict, config: dict, metric: str) -> list[tuple[str, str]]:
    """Under `--attackers` (research): who attacked, the honest agents' mean (an attacker's
    own model says nothing of what the fleet learned) and, under a trigger attack, how often
    the trigger works on the honest agents' models; nothing for a run without attackers.
    Whenever the defence (`--clip`) screened out or clipped any model, how many."""
    rows = []
    defence = summary.get("defence")
    if defence:
        name = f"models screened out / clipped (--clip {config['learning']['clip']})"
        rows.append((name, f"{defence['screened']} / {defence['clipped']}"))
    attackers = summary.get("attackers") or []
    if attackers:
        rows.append(("attackers", f"{len(attackers)} ({config['attack']})"))
        honest = summary.get(f"honest_mean_{metric}")
        if honest is not None:
            rows.append((f"mean {metric} of the honest agents", f"{honest:.4f}"))
    if summary.get("backdoor_success") is not None:
        strategy = summary.get("backdoor_success_strategy")
        beside = f" (the strategy's own models {strategy:.3f})" if strategy is not None else ""
        rows.append(
            ("trigger success on honest models", f"{summary['backdoor_success']:.3f}{beside}")
        )
    return rows


def agent_rounds() -> Progress:
    """The progress bar of a networked run: agent-rounds done of all (emulate, run)."""
    return Progress(
        TextColumn("agent-rounds"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    )
