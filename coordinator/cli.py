"""The `coordinator` command: host a broker, follow the fleet, report its status."""

from __future__ import annotations

import json
import logging
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from agent.files import atomic_write
from agent.options import experiment_config, experiment_options
from coordinator.fleet import AgentEntry, FleetView, describe_presence, describe_state
from coordinator.plots import write_plots
from protocol import (
    BROKER,
    NAME,
    BrokerAddress,
    ConfigError,
    Identity,
    MqttTransport,
    TransportOptions,
    connect,
    leave,
    read_key,
    stop_on_signal,
    topics,
    wait_for,
)

console = Console()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
def main(verbose: int) -> None:
    """Optional gateway side of an edge fleet: broker, roster, status and aggregation."""
    level = (logging.WARNING, logging.INFO, logging.DEBUG)[min(verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@main.command()
@click.option("--broker", type=BROKER, help="Use this broker instead of starting one.")
@click.option(
    "--host", default="0.0.0.0", show_default=True, help="Address the embedded broker binds."
)
@click.option(
    "--port",
    default=1883,
    show_default=True,
    type=click.IntRange(1, 65535),
    help="Port of the embedded broker.",
)
@click.option("--fleet", default="default", show_default=True, type=NAME, help="Fleet to follow.")
@click.option(
    "--mdns",
    "mdns_interfaces",
    multiple=True,
    metavar="IP",
    help="Announce the broker over mDNS on the interface with this address (repeatable). "
    "Off unless given.",
)
@click.option(
    "--key-file",
    type=click.Path(exists=True, dir_okay=False),
    help="File holding the fleet key that signs and checks every message.",
)
def serve(
    broker: BrokerAddress | None,
    host: str,
    port: int,
    fleet: str,
    mdns_interfaces: tuple[str, ...],
    key_file: str | None,
) -> None:
    """Host the fleet's broker (unless --broker is given) and follow the fleet until Ctrl-C."""
    stop = stop_on_signal()
    from coordinator.broker import EmbeddedBroker

    key = read_key(key_file)
    embedded = None
    if broker is None:
        embedded = EmbeddedBroker(host=host, port=port)
        try:
            embedded.start()
        except OSError as exc:
            raise click.ClickException(
                f"cannot start the embedded broker on {host}:{port}: {exc}"
            ) from None
        console.print(f"embedded MQTT broker listening on [bold]{host}:{port}[/]")
        broker = BrokerAddress("127.0.0.1" if host in ("0.0.0.0", "") else host, port)
    else:
        console.print(f"using MQTT broker at [bold]{broker.host}:{broker.port}[/]")

    identity = Identity(fleet, "coordinator", role="coordinator", key=key)
    view = FleetView(key=key)

    def on_fleet_message(topic: str, payload: bytes) -> None:
        entry = view.feed(topic, payload)
        if entry is not None and entry.agent != "coordinator":
            console.print(describe_entry(entry))

    transport = connect(broker, identity)
    discovery = None
    try:
        transport.subscribe(topics.presence(fleet), on_fleet_message)
        transport.subscribe(topics.status(fleet), on_fleet_message)
        if mdns_interfaces:
            from protocol import Discovery

            discovery = Discovery(interfaces=list(mdns_interfaces))
            # An mDNS address record needs an IP: the embedded broker is reached on the
            # interface it is announced on; an external broker's host name is resolved here.
            announced = mdns_interfaces[0] if embedded else socket.gethostbyname(broker.host)
            discovery.advertise_broker(announced, broker.port)
            console.print(f"announcing the broker over mDNS on {', '.join(mdns_interfaces)}")
        console.print(f"following fleet [bold]{fleet}[/]; press Ctrl-C to stop")
        wait_for(stop)
    finally:
        console.print("stopping")
        leave(transport, identity)
        if discovery is not None:
            discovery.close()
        if embedded is not None:
            embedded.stop()
    console.print("stopped")


def describe_entry(entry: AgentEntry) -> str:
    state = f", {describe_state(entry)}" if entry.state else ""
    return f"{entry.fleet}/{entry.agent}: {describe_presence(entry)}{state}"


@main.command()
@click.option(
    "--broker",
    type=BROKER,
    default="127.0.0.1:1883",
    show_default=True,
    help="Broker to read the fleet's retained messages from.",
)
@click.option("--fleet", default=None, type=NAME, help="Only this fleet (default: every fleet).")
@click.option(
    "--wait",
    "wait_s",
    default=1.0,
    show_default=True,
    type=click.FloatRange(0, 60),
    help="Seconds to collect retained messages after subscribing.",
)
@click.option(
    "--timeout",
    "timeout_s",
    default=5.0,
    show_default=True,
    type=click.FloatRange(0.1, 600),
    help="Give up if the broker is unreachable this long.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option(
    "--key-file",
    type=click.Path(exists=True, dir_okay=False),
    help="Fleet key to check message signatures with.",
)
def status(
    broker: BrokerAddress,
    fleet: str | None,
    wait_s: float,
    timeout_s: float,
    as_json: bool,
    key_file: str | None,
) -> None:
    """Print who is in the fleet, online or offline and since when, from retained messages."""
    view = FleetView(key=read_key(key_file))
    lock = threading.Lock()

    def on_message(topic: str, payload: bytes) -> None:
        with lock:
            view.feed(topic, payload)

    transport = MqttTransport(broker, TransportOptions(client_id=None))
    target = fleet or "+"
    transport.subscribe(topics.presence(target), on_message)
    transport.subscribe(topics.status(target), on_message)
    transport.start()
    try:
        if not transport.wait_connected(timeout_s):
            raise click.ClickException(
                f"cannot reach the MQTT broker at {broker.host}:{broker.port} within {timeout_s:g}s"
            )
        time.sleep(wait_s)
    finally:
        transport.stop()
    with lock:
        entries = view.entries()
    if as_json:
        click.echo(json.dumps([vars(e) for e in entries], indent=2))
        return
    if not entries:
        console.print("no agents have announced themselves on this broker")
        return
    table = Table("fleet", "agent", "role", "presence", "state", "round", "profile")
    for column in table.columns:
        column.overflow = "fold"
    for e in entries:
        table.add_row(
            e.fleet,
            e.agent,
            e.role,
            f"[{'green' if e.online else 'red'}]{describe_presence(e)}[/]",
            describe_state(e),
            str(e.round) if e.state else "",
            e.profile,
        )
    console.print(table)


def report_options(command: Callable) -> Callable:
    """--report and --plot, shared by simulate and emulate (they write one schema)."""
    command = click.option(
        "--plot",
        "plot_dir",
        type=click.Path(file_okay=False),
        help="Also write PNG plots into this folder.",
    )(command)
    return click.option(
        "--report",
        "report_path",
        type=click.Path(dir_okay=False),
        default="report.json",
        show_default=True,
        help="Where to write the JSON report.",
    )(command)


@main.command()
@experiment_options
@report_options
def simulate(report_path: str, plot_dir: str | None, **values: object) -> None:
    """Run a whole fleet in one process (no network) and write the JSON report."""
    from coordinator.simulate import Simulation

    try:
        config = experiment_config(values)
        simulation = Simulation(config)
    except (ValueError, OSError) as exc:
        raise ConfigError(str(exc)) from None
    cfg = config.learning
    console.print(
        f"simulating [bold]{cfg.strategy}[/] on {config.dataset} ({simulation.model_name}), "
        f"{config.agents} agents, {cfg.rounds} rounds, partition {config.partition}, "
        f"seed {config.seed}"
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

        report = simulation.run(advance)
    publish_report(report, report_path, plot_dir)


def publish_report(report: dict, report_path: str, plot_dir: str | None) -> None:
    """Write the report atomically (a crash never leaves half of one), show it, plot it."""
    atomic_write(Path(report_path), lambda f: f.write(json.dumps(report, indent=1).encode()))
    if report["rounds"]:
        console.print(summary_table(report))
    console.print(f"report written to [bold]{report_path}[/]")
    if plot_dir and report["rounds"]:
        for path in write_plots(report, plot_dir):
            console.print(f"plot written to {path}")


def summary_table(report: dict) -> Table:
    summary = report["summary"]
    table = Table("figure", "value", title=f"{report['config']['learning']['strategy']} summary")
    rows = [
        ("mean accuracy (final round)", f"{summary['mean_accuracy']:.4f}"),
        ("mean sparsity (final round)", f"{summary['mean_sparsity']:.3f}"),
        ("busiest agent bytes", f"{summary['busiest_agent_bytes']:,} ({summary['busiest_agent']})"),
        ("total bytes", f"{summary['total_bytes']:,}"),
        ("total training FLOPs", f"{summary['total_train_flops']:.3e}"),
        ("first pruning time t*", str(summary["t_star"])),
        ("rounds", str(summary["rounds"])),
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
    for name, value in rows:
        table.add_row(name, value)
    return table


@main.command()
@experiment_options
@click.option("--broker", type=BROKER, help="Use this broker [default: start an embedded one].")
@click.option(
    "--workdir",
    type=click.Path(file_okay=False),
    default=None,
    help="Agents' state folders and logs [default: a new temporary folder].",
)
@click.option(
    "--round-timeout",
    type=click.FloatRange(0.1),
    default=120.0,
    show_default=True,
    help="Seconds an agent waits for a neighbour's model before going on without it.",
)
@report_options
def emulate(
    broker: BrokerAddress | None,
    workdir: str | None,
    round_timeout: float,
    report_path: str,
    plot_dir: str | None,
    **values: object,
) -> None:
    """Run a fleet of real edge-agent processes over MQTT and write the same report as simulate."""
    from coordinator.broker import EmbeddedBroker
    from coordinator.emulate import Emulation, EmulationOptions

    embedded = None
    if broker is None:
        embedded = EmbeddedBroker(host="127.0.0.1", port=free_port())
        broker = embedded.address
    folder = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="emulate-"))
    options = EmulationOptions(workdir=folder, round_timeout_s=round_timeout)
    try:
        config = experiment_config(values)
        emulation = Emulation(config, broker, options)
    except (ValueError, OSError) as exc:
        if not workdir:
            folder.rmdir()
        raise ConfigError(str(exc)) from None
    if embedded:
        embedded.start()
    cfg = config.learning
    console.print(
        f"emulating [bold]{cfg.strategy}[/]: {config.agents} agent processes on {config.dataset}, "
        f"{cfg.rounds} rounds, broker {broker}{' (embedded)' if embedded else ''}, "
        f"logs in {folder}"
    )
    try:
        with Progress(
            TextColumn("agent-rounds"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
        ) as progress:
            task = progress.add_task("rounds", total=cfg.rounds * config.agents)
            report = emulation.run(lambda done: progress.update(task, completed=done))
    except TimeoutError as exc:
        raise click.ClickException(f"{exc}; see the agent logs in {folder}") from None
    finally:
        if embedded is not None:
            embedded.stop()
    failed = report["summary"]["failed_agents"]
    if failed:
        console.print(f"[red]agents that failed[/]: {failed} (logs in {folder})")
    publish_report(report, report_path, plot_dir)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
