"""`coordinator simulate` and `coordinator emulate`, the lab's commands, their flags made
from the experiment's config (`agent.options`). `coordinator` loads this module only when
one of them runs or is listed; what trains (torch) loads only when one of them runs."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from agent.options import experiment_config, experiment_options
from agent.runfile import check_files, lab_config
from coordinator.cli_shared import (
    Interrupted,
    agent_rounds,
    check_target,
    console,
    dashboard,
    http_options,
    publish_report,
    report_options,
    report_target,
    require_extra,
)
from coordinator.ports import free_port
from coordinator.watch import require_broker
from protocol import BROKER, BrokerAddress, ConfigError
from protocol.cli import BrokerSettings, seconds, stop_on_signal
from protocol.extras import LAB_EXTRA, MissingExtra
from protocol.limits import MAX_MEMBERS

if TYPE_CHECKING:
    from agent.experiment import ExperimentConfig
    from coordinator.broker import EmbeddedBroker


def lab_run_option(command: Callable) -> Callable:
    """--run FILE of simulate and emulate: a run file's settings, under the flags given."""
    return click.option(
        "--run",
        "run_file",
        type=click.Path(dir_okay=False),
        help="Take the run's settings from this run file's [run] table (as coordinator run "
        "does); flags given as well override it.",
    )(command)


@click.command()
@experiment_options
@report_options
@lab_run_option
@click.option(
    "--workers",
    type=click.IntRange(1, 1024),
    default=1,
    show_default=True,
    help="Train agents in this many processes at once (one a core; the report is "
    "identical). Each takes about a second to start: worth it for runs longer than a few "
    "seconds. With --backend ray and no --ray-address: the CPUs of the Ray started here "
    "(1: all).",
)
@click.option(
    "--backend",
    type=click.Choice(["local", "ray"]),
    default="local",
    show_default=True,
    help="Where agents train: this machine, or Ray tasks across a Ray cluster's nodes (the "
    "ray extra; the report is identical).",
)
@click.option(
    "--ray-address",
    metavar="HOST:PORT",
    help="The Ray cluster's head (ray start --head) for --backend ray [default: start a "
    "Ray on this machine, stopped at the end].",
)
def simulate(
    report_path: str | None,
    force: bool,
    plot_dir: str | None,
    target_accuracy: float | None,
    run_file: str | None,
    workers: int,
    backend: str,
    ray_address: str | None,
    **values: object,
) -> None:
    """Run a whole fleet in one process (no network) and write the JSON report."""
    require_extra(LAB_EXTRA, "coordinator simulate", plot_dir=plot_dir)
    report_path = report_target(report_path, force)
    config = lab_experiment(run_file, values)
    check_target(target_accuracy, config.task, config.metric)
    from coordinator.ray_backend import ClusterError
    from coordinator.simulate import Simulation  # torch: after the config's one-line checks

    try:
        simulation = Simulation(config, workers, backend, ray_address)
    except (ValueError, OSError) as exc:
        raise ConfigError(str(exc)) from None
    cfg = config.learning
    console.print(
        f"simulating [bold]{cfg.strategy}[/] on {config.dataset} ({simulation.model_name}), "
        f"{config.agents} agents, {cfg.rounds} rounds, partition {config.partition}, "
        f"seed {config.seed}"
        + (f", {workers} workers" if workers > 1 else "")
        + ray_where(backend, ray_address)
    )
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
    ) as progress:
        task = progress.add_task("round 1", total=cfg.rounds * config.agents)

        def advance(round_: int, _agent: str) -> None:
            progress.update(task, advance=1, description=f"round {round_}/{cfg.rounds}")

        try:
            report = simulation.run(advance)
        except BrokenProcessPool:
            raise click.ClickException(
                "a worker process died (out of memory?): run with fewer --workers"
            ) from None
        except (ClusterError, ConnectionError) as exc:
            raise click.ClickException(str(exc)) from None
    publish_report(report, report_path, plot_dir, target_accuracy)


def ray_where(backend: str, address: str | None) -> str:
    """Where the agents train, for simulate's first line: nothing for this machine."""
    if backend != "ray":
        return ""
    return f", on the Ray cluster at {address}" if address else ", on a Ray started here"


def lab_experiment(run_file: str | None, values: dict[str, object]) -> ExperimentConfig:
    """The run's config from --run and the flags, with the files it names: a mistake in
    either is one line before the run's slow imports (torch) and start."""
    try:
        if run_file:
            return lab_config(run_file, values)
        check_files(values)
        return experiment_config(values)
    except (ValueError, OSError) as exc:
        raise ConfigError(str(exc)) from None


def emulation_broker(
    brokers: tuple[BrokerAddress, ...],
) -> tuple[BrokerAddress, EmbeddedBroker | None]:
    """The broker the agents use: the first given, else an embedded one (to start and stop)."""
    if brokers:
        return brokers[0], None
    from coordinator.broker import EmbeddedBroker

    embedded = EmbeddedBroker(host="127.0.0.1", port=free_port())
    return embedded.address, embedded


@click.command()
@experiment_options
@click.option(
    "--broker",
    "brokers",
    type=BROKER,
    multiple=True,
    help="Use this broker [default: start an embedded one]. Repeated: brokers bridged into "
    "one fleet; the coordinator joins the first, agent k the (k mod n)-th.",
)
@click.option(
    "--workdir",
    type=click.Path(file_okay=False),
    default=None,
    help="Agents' state folders and logs [default: a new temporary folder].",
)
@click.option(
    "--round-timeout",
    type=seconds(0.1),
    default=120.0,
    show_default=True,
    help="Seconds an agent waits for a neighbour's model before going on without it.",
)
@click.option(
    "--telemetry",
    is_flag=True,
    help="Agents also publish their statuses as plain JSON on fl/v1/FLEET/telemetry/ID.",
)
@click.option(
    "--key-file",
    type=click.Path(exists=True, dir_okay=False),
    help="Sign every message with this fleet key (one key shared by the fleet).",
)
@click.option(
    "--agent-keys",
    is_flag=True,
    help="Give every agent its own key pair: the coordinator admits them, signs the run, "
    "and checks every message against its sender's key (as serve/run --admitted do).",
)
@click.option(
    "--agents-per-process",
    type=click.IntRange(1, MAX_MEMBERS),
    default=None,
    help="Run this many agents as threads of one process (each still with its own "
    "connection, state and log); 1: a process per agent. [default: the agents spread over "
    "2 x cores processes, one each up to that many: a process costs about 175 MB, one more "
    "agent in a shared one about 4 MB, and more processes than that add no speed]",
)
@http_options
@report_options
@lab_run_option
def emulate(
    brokers: tuple[BrokerAddress, ...],
    workdir: str | None,
    round_timeout: float,
    telemetry: bool,
    key_file: str | None,
    agent_keys: bool,
    agents_per_process: int | None,
    http: str | None,
    http_token: str | None,
    report_path: str | None,
    force: bool,
    plot_dir: str | None,
    target_accuracy: float | None,
    run_file: str | None,
    **values: object,
) -> None:
    """Run a fleet of real edge-agent processes over MQTT and write the same report as
    simulate. Ctrl-C ends the agents and writes the report of the rounds they did. The
    agents' processes are forked from one that imported torch once (what it prints is
    kept in WORKDIR/fork-server.log); EDGEFL_AGENT_START=fresh starts each afresh."""
    stop = stop_on_signal()  # first: a Ctrl-C while starting is honoured once started
    require_extra(
        LAB_EXTRA, "coordinator emulate", embedded_broker=not brokers, http=http, plot_dir=plot_dir
    )
    report_path = report_target(report_path, force)
    if key_file and agent_keys:
        raise click.UsageError("give --key-file (one fleet key) or --agent-keys, not both")
    config = lab_experiment(run_file, values)
    check_target(target_accuracy, config.task, config.metric)
    from coordinator.emulate import Emulation, EmulationOptions, auto_agents_per_process

    broker, embedded = emulation_broker(brokers)
    folder = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="emulate-"))
    try:
        per_process = agents_per_process or auto_agents_per_process(config.agents)
        options = EmulationOptions(
            workdir=folder,
            agent_brokers=brokers if len(brokers) > 1 else (),
            round_timeout_s=round_timeout,
            telemetry=telemetry,
            key_file=Path(key_file) if key_file else None,
            agent_keys=agent_keys,
            agents_per_process=per_process,
        )
        emulation = Emulation(config, broker, options)
        for given in brokers:  # after the run's own checks; agents retry a dead one in silence
            require_broker(given, given=True)
    except (ValueError, OSError, MissingExtra, click.ClickException) as exc:
        if not workdir:
            shutil.rmtree(folder, ignore_errors=True)  # with any keys the emulation made
        if isinstance(exc, click.ClickException):
            raise
        raise ConfigError(str(exc)) from None
    if embedded:
        embedded.start()
    cfg = config.learning
    console.print(
        f"emulating [bold]{cfg.strategy}[/]: {config.agents} agents "
        f"({per_process} per process) on {config.dataset}, "
        f"{cfg.rounds} rounds, broker {', '.join(map(str, brokers or [broker]))}"
        f"{' (embedded)' if embedded else ''}, "
        f"logs in {folder}{'' if workdir else ' (removed after a run that went well)'}"
    )
    watched = dashboard(
        http, http_token, broker, BrokerSettings(broker), emulation.fleet, emulation.key
    )
    try:
        with watched, agent_rounds() as progress:
            task = progress.add_task("rounds", total=cfg.rounds * config.agents)
            report = emulation.run(lambda done: progress.update(task, completed=done), stop)
    except TimeoutError as exc:
        raise click.ClickException(f"{exc}; see the agent logs in {folder}") from None
    finally:
        if embedded is not None:
            embedded.stop()
    publish_report(report, report_path, plot_dir, target_accuracy)
    say_how_emulation_ended(report, folder)
    if not workdir:
        remove_scratch(folder, report_path, plot_dir)


def say_how_emulation_ended(report: dict, folder: Path) -> None:
    """Exit with the reason, naming the folder the agents' logs are kept in, when the run
    did not finish well: interrupted (exit 130), failed agents or no round at all (exit 1)."""
    if report["summary"]["interrupted"]:
        raise Interrupted(
            f"interrupted after {len(report['rounds'])} of "
            f"{report['config']['learning']['rounds']} rounds; the agents' logs are kept in "
            f"{folder}"
        )
    from coordinator.conductor import describe_failures  # the learning core: torch

    failed = describe_failures(report)
    if failed:
        raise click.ClickException(f"{failed}; see their logs in {folder}")
    if not report["rounds"]:
        raise click.ClickException(f"no agent completed a round; see the logs in {folder}")


def remove_scratch(folder: Path, *kept: str | None) -> None:
    """Remove emulate's temporary folder after a run that went well (agents' state and
    logs, nothing the user asked for), unless a path the user gave lies inside it."""
    inside = [p for p in kept if p and Path(p).resolve().is_relative_to(folder.resolve())]
    if not inside:
        shutil.rmtree(folder, ignore_errors=True)
