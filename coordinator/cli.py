"""The `coordinator` command: host a broker, follow the fleet, report its status."""

from __future__ import annotations

import dataclasses
import functools
import json
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.markup import escape

from coordinator.bridges import bridge_config
from coordinator.broker_config import (
    COORDINATOR,
    COORDINATOR_IDS,
    GATEWAY,
    broker_config,
)
from coordinator.cli_shared import (
    agent_rounds,
    check_target,
    console,
    http_options,
    publish_report,
    report_options,
    report_target,
    require_extra,
)
from coordinator.fleet import FleetLog
from coordinator.gateway_start import GatewayOptions, GatewayStart, coordinator_signer
from coordinator.gateway_state import (
    ADMITTED,
    BROKER_AUTH,
    FLEET_FILE,
    Guard,
    broker_agents,
    gateway_folder,
    identity_path,
    prepare_gateway,
    read_fleet,
    secure_by_default,
    write_bundle,
    write_logins,
)
from coordinator.manage import RETAINED_WAIT_S
from coordinator.new_project import new
from coordinator.runs import (
    RUNS,
    RUNS_DIR_ENV,
    RunEntry,
    end_entry,
    find_entry,
    load_entries,
    resumable,
    run_dir,
)
from coordinator.runs import runs_dir as runs_dir_of
from coordinator.watch import follow, mdns_sightings, require_broker, show
from coordinator.watch import watch as watch_fleet
from protocol import (
    NAME,
    BrokerAddress,
    ConfigError,
    ProtocolError,
    stop_on_signal,
    topics,
    wait_for,
)
from protocol.cli import (
    BrokerSettings,
    FiniteRange,
    broker_options,
    logging_options,
    say,
    version_option,
)
from protocol.cli_help import HelpAllGroup, with_help_all
from protocol.extras import (
    GATEWAY_EXTRA,
)
from protocol.mqtt import unreachable
from protocol.signing import (
    Signer,
    add_key,
    public_line,
)


class Commands(HelpAllGroup):
    """The coordinator's commands, the lab's (`coordinator.lab_cli`, which shares this
    module's helpers in `coordinator.cli_shared`) loaded only when one of them runs or is
    listed: a gateway's commands (serve, status, admit, ...) need none of it. Each takes
    --help-all (`protocol.cli_help`)."""

    LAB = ("emulate", "simulate")

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *self.LAB])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.LAB:
            return super().get_command(ctx, cmd_name)
        from coordinator import lab_cli

        command: click.Command = getattr(lab_cli, cmd_name)
        return with_help_all(command)


@click.group(cls=Commands, context_settings={"help_option_names": ["-h", "--help"]})
@version_option
@logging_options
def main() -> None:
    """Optional gateway side of an edge fleet: broker, runs, aggregation and the fleet view."""


main.add_command(broker_config)
main.add_command(bridge_config)
main.add_command(new)


def embedded_options(command: Callable) -> Callable:
    """--host, --port and --broker-auth of the embedded broker (serve, run)."""
    command = click.option(
        "--port",
        default=1883,
        show_default=True,
        type=click.IntRange(1, 65535),
        help="Port of the embedded broker.",
    )(command)
    command = click.option(
        "--broker-auth",
        type=click.Path(exists=True, file_okay=False),
        help="Folder `coordinator broker-config` wrote: per-member logins and the fleet's "
        "ACL, enforced by the embedded broker (anonymous clients refused).",
    )(command)
    return click.option(
        "--host",
        default="127.0.0.1",
        show_default=True,
        help="Address the embedded broker binds (without --broker): loopback unless told; "
        "the gateway's LAN address (or 0.0.0.0) to serve devices.",
    )(command)


def signing_options(command: Callable) -> Callable:
    """--key-file, or --admitted with --identity: how the coordinator signs and checks."""
    command = click.option(
        "--key-file",
        type=click.Path(exists=True, dir_okay=False),
        help="File holding the fleet key that signs and checks every message (one key "
        "shared by the fleet; see --admitted for a key per member).",
    )(command)
    command = click.option(
        "--admitted",
        "admitted_file",
        type=click.Path(exists=True, dir_okay=False),
        help="Per-member keys: accept only the agents this admission list names (lines "
        "'ID ed25519:KEY'; `coordinator admit` adds one) and sign with --identity.",
    )(command)
    command = state_dir_option(command)
    return click.option(
        "--identity",
        "identity_file",
        type=click.Path(dir_okay=False),
        default=None,
        help="With --admitted: the coordinator's private key (made on first use by serve and "
        "run; status checks the coordinator's own messages with it); `coordinator key` prints "
        "the lines of the agents' --trust files. [default: STATE_DIR/coordinator.pem]",
    )(command)


def state_dir_option(command: Callable) -> Callable:
    """--state-dir: the gateway's keys, admission list and broker logins."""
    return click.option(
        "--state-dir",
        type=click.Path(file_okay=False),
        default=None,
        help="Where the gateway keeps its key, its admission list and the broker logins "
        "(made by serve and run beyond loopback, and by admit) [default: /var/lib/edgefl as "
        "root or where writable, else ~/.local/state/edgefl].",
    )(command)


def reader_guard(
    settings: BrokerSettings,
    key_file: str | None,
    admitted_file: str | None,
    identity_file: str | None,
    state_dir: str | None,
) -> tuple[Signer | None, BrokerSettings]:
    """status's, cancel's and forget's key and login: as given, else beyond loopback the
    gateway's own when its state folder has them (these commands never make them)."""
    where = settings.address.host if settings.address is not None else "127.0.0.1"
    given = Guard(key_file, admitted_file, identity_path(identity_file, state_dir))
    guard, settings = secure_by_default(given, settings, where, "", state_dir, prepare=False)
    key = coordinator_signer(guard.key_file, guard.admitted_file, guard.identity_file, signs=False)
    return key, settings


def open_option(command: Callable) -> Callable:
    return click.option(
        "--open",
        "open_fleet",
        is_flag=True,
        help="Beyond loopback, run without keys and logins: anyone on the network may join, "
        "start runs and send models in any agent's name (said at the start).",
    )(command)


def fleet_options(command: Callable) -> Callable:
    """--fleet, --mdns, --open and the signing options (serve, run)."""
    command = open_option(command)
    command = signing_options(command)
    command = click.option(
        "--mdns",
        "mdns_interfaces",
        multiple=True,
        metavar="IP",
        help="Announce the broker over mDNS on the interface with this address (repeatable), "
        "so agents find it without --broker. Off unless given.",
    )(command)
    return click.option(
        "--fleet", default="default", show_default=True, type=NAME, help="The fleet."
    )(command)


def gateway_options(command: Callable) -> Callable:
    """The options serve and run share (the broker's, the embedded broker's, the fleet's
    with its keys, the dashboard's), given to the command as one `gateway`: both start the
    gateway from them alike (`GatewayStart`)."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        given = {field.name: kwargs.pop(field.name) for field in dataclasses.fields(GatewayOptions)}
        return command(*args, gateway=GatewayOptions(**given), **kwargs)

    return broker_options(embedded_options(fleet_options(http_options(wrapper))))


@main.command()
@click.argument("agent_id", type=NAME)
@click.argument("public_key")
@click.option(
    "--admitted",
    "admitted_file",
    type=click.Path(dir_okay=False),
    default=None,
    help="Only add the key to this admission list (made if missing), for serve and run "
    "--admitted [default: the gateway's own, with a broker login and a bundle for the device].",
)
@click.option(
    "--fleet",
    default=None,
    type=NAME,
    help="The fleet [default: the one the gateway's logins are for, else default].",
)
@click.option(
    "--replace",
    is_flag=True,
    help="AGENT_ID is admitted with another key: admit it with PUBLIC_KEY instead (a re-imaged "
    "device; the old key logs in no more).",
)
@state_dir_option
def admit(
    agent_id: str,
    public_key: str,
    admitted_file: str | None,
    fleet: str | None,
    replace: bool,
    state_dir: str | None,
) -> None:
    """Admit the agent AGENT_ID with its PUBLIC_KEY (`ed25519:...`, as `edge-agent key`
    prints it) to the fleet: the gateway accepts its messages and its key's broker login, at
    once (a running serve included), and the device's bundle (the coordinator's keys it
    trusts) is written for you to copy to it."""
    if admitted_file is not None:
        added = admit_key(Path(admitted_file), agent_id, public_key, replace)
        say(
            f"admitted {agent_id} in {admitted_file}"
            if added
            else f"{agent_id} was already admitted with this key in {admitted_file}"
        )
        return
    if agent_id in COORDINATOR_IDS:
        raise ConfigError(f"{agent_id!r} is the coordinator's own id: give the device another")
    folder = gateway_folder(state_dir)
    known = (folder / BROKER_AUTH / FLEET_FILE).is_file()
    fleet = fleet or (read_fleet(folder) if known else "default")
    prepare_gateway(folder, fleet)
    admit_key(folder / ADMITTED, agent_id, public_key, replace)
    agents = broker_agents(folder)
    if agent_id not in agents:
        write_logins(folder, fleet, [*agents, agent_id])
    bundle = write_bundle(folder, agent_id)
    fleet_flag = "" if fleet == "default" else f" --fleet {fleet}"
    say(
        f"admitted {agent_id} to fleet {fleet}: its key is in {folder / ADMITTED} (it logs in "
        f"to the broker with it), its grants in {folder / BROKER_AUTH}. Copy its bundle to the "
        f"device: `scp -r {bundle} {agent_id}:edgefl`, and start it there with "
        f"`edge-agent{fleet_flag} --config edgefl/agent.toml` (docs/deploy.md: as a service, "
        "in /etc/edgefl)"
    )


def admit_key(path: Path, agent_id: str, public_key: str, replace: bool = False) -> bool:
    try:
        return add_key(path, agent_id, public_key, replace)
    except ProtocolError as exc:
        raise click.ClickException(str(exc)) from None


@main.command()
@click.option(
    "--identity",
    "identity_file",
    type=click.Path(dir_okay=False),
    default=None,
    help="The coordinator's private key (made on first use) [default: STATE_DIR/coordinator.pem].",
)
@state_dir_option
def key(identity_file: str | None, state_dir: str | None) -> None:
    """Print the coordinator's public key as the lines of the agents' --trust files (one
    for `coordinator run`'s id, one for `coordinator serve`'s): agents accept runs signed
    by it."""
    path = Path(identity_path(identity_file, state_dir))
    try:
        lines = [public_line(member, path) for member in (COORDINATOR, GATEWAY)]
    except ProtocolError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo("\n".join(lines))


@main.command()
@gateway_options
def serve(gateway: GatewayOptions) -> None:
    """Host the fleet's broker (unless --broker is given) and follow the fleet until Ctrl-C;
    `coordinator run` starts runs on it.

    Beyond loopback it signs with the gateway's own key, admits only the devices that
    `coordinator admit` adds, and gives each a broker login (all made in --state-dir on
    first start), unless --open or keys and logins of your own are given."""
    require_extra(
        GATEWAY_EXTRA,
        "coordinator serve",
        embedded_broker=gateway.broker_settings.address is None,
        http=gateway.http,
    )
    stop = stop_on_signal()
    if gateway.broker_settings.address is not None:
        require_broker(gateway.broker_settings.address, given=True)
    start = GatewayStart.secured(gateway)
    identity = start.signed(GATEWAY)
    fleet, fleet_log = gateway.fleet, FleetLog(key=identity.key)

    def on_fleet_message(topic: str, payload: bytes) -> None:
        for line in fleet_log.feed(topic, payload):
            say(escape(line))

    with start.joined(identity) as (_, transport):
        try:
            transport.subscribe(topics.presence(fleet), on_fleet_message)
            transport.subscribe(topics.status(fleet), on_fleet_message)
            transport.subscribe(topics.run(fleet), on_fleet_message)
            say(f"following fleet [bold]{fleet}[/]; press Ctrl-C to stop")
            wait_for(stop)
        finally:
            say("stopping")
    say("stopped")


@main.command()
@broker_options
@click.option("--fleet", default=None, type=NAME, help="Only this fleet (default: every fleet).")
@click.option(
    "--wait",
    "wait_s",
    default=1.0,
    show_default=True,
    type=FiniteRange(0, 60),
    help="Seconds to collect retained messages after subscribing (not with --watch).",
)
@click.option(
    "--timeout",
    "timeout_s",
    default=5.0,
    show_default=True,
    type=FiniteRange(0.1, 600),
    help="Give up if the broker is unreachable this long.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option(
    "--watch",
    is_flag=True,
    help="Keep the table current until Ctrl-C: redrawn in place on a terminal; elsewhere "
    "(a pipe, a log) a fresh table each interval in which the fleet changed.",
)
@click.option(
    "--interval",
    "interval_s",
    default=2.0,
    show_default=True,
    type=FiniteRange(0.1, 3600),
    help="With --watch: seconds between redraws at most (new messages redraw sooner).",
)
@signing_options
@click.option(
    "--mdns",
    "mdns_interfaces",
    multiple=True,
    metavar="IP",
    help="Also show which agents mDNS sees on the interface with this address (repeatable).",
)
def status(
    broker_settings: BrokerSettings,
    fleet: str | None,
    wait_s: float,
    timeout_s: float,
    as_json: bool,
    watch: bool,
    interval_s: float,
    key_file: str | None,
    admitted_file: str | None,
    identity_file: str | None,
    state_dir: str | None,
    mdns_interfaces: tuple[str, ...],
) -> None:
    """Print who is in the fleet (online or offline and since when, state, and the latest
    round's accuracy, sparsity, p_k, traffic and stragglers) from retained messages, or with
    --watch keep it current. MQTT presence is the truth about liveness; --mdns adds what
    zeroconf sees."""
    if watch and as_json:
        raise click.UsageError("--watch shows a live table; leave out --json")
    stop = stop_on_signal() if watch else None
    key, broker_settings = reader_guard(
        broker_settings, key_file, admitted_file, identity_file, state_dir
    )
    with (
        mdns_sightings(mdns_interfaces) as sightings,
        follow(broker_settings, fleet, key, timeout_s) as feed,
    ):
        if stop is not None:
            watch_fleet(feed, console, interval_s, stop, sightings)
            return
        # mDNS adverts answer a browse within about 2 s
        time.sleep(max(wait_s, 2.0) if sightings is not None else wait_s)
        seen = sightings() if sightings is not None else None
        entries = feed.entries(seen)
    if as_json:
        rows = [
            vars(e) | ({"mdns": (e.fleet, e.agent) in seen} if seen is not None else {})
            for e in entries
        ]
        click.echo(json.dumps(rows, indent=2))
        return
    show(console, entries, seen)


def runs_dir_option(command: Callable) -> Callable:
    """--runs-dir: where `coordinator run` records the gateway's runs (run, runs, cancel)."""
    return click.option(
        "--runs-dir",
        envvar=RUNS_DIR_ENV,
        show_envvar=True,
        type=click.Path(file_okay=False),
        default=None,
        help=f"Where the gateway keeps its runs [default: STATE_DIR/{RUNS}, the gateway's "
        "state folder's; an older version's ~/.edgefl/runs moves into an existing one].",
    )(command)


@main.command()
@runs_dir_option
@state_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def runs(runs_dir: str | None, state_dir: str | None, as_json: bool) -> None:
    """List the runs this gateway recorded, oldest first: id, strategy, state (an
    unfinished run whose `coordinator run` is gone is "interrupted"), rounds, agents and
    when each began."""
    from coordinator.manage import runs_table

    base = runs_dir_of(runs_dir, state_dir, say)
    entries = load_entries(base)
    if as_json:
        click.echo(json.dumps([entry.summary() for entry in entries], indent=2))
    elif not entries:
        console.print(f"no runs recorded in {base}")
    else:
        console.print(runs_table(entries, base))


@main.command()
@click.argument("run_id", metavar="[RUN]", required=False)
@click.option("--agent", "agents", multiple=True, type=NAME, help="Only this agent (repeatable).")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new records until Ctrl-C.")
@runs_dir_option
@state_dir_option
def logs(
    run_id: str | None,
    agents: tuple[str, ...],
    follow: bool,
    runs_dir: str | None,
    state_dir: str | None,
) -> None:
    """Print the log records the agents of run RUN (default: the latest) published, one
    line each: time, level, agent and message. Agents publish WARNING and up unless told
    (`edge-agent --fleet-logs`); the gateway keeps them in the run's folder."""
    from coordinator.agent_logs import LogFollower, line_of, run_agents, run_to_show

    stop = stop_on_signal() if follow else None
    base = runs_dir_of(runs_dir, state_dir, say)
    try:
        run_id = run_to_show(base, run_id)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    known = run_agents(base, run_id)
    unknown = [agent for agent in agents if agent not in known]
    if unknown:
        raise click.ClickException(
            f"no agent {unknown[0]} in run {run_id}; its agents: {', '.join(known) or 'none'}"
        )
    follower = LogFollower(run_dir(base, run_id), agents or None)
    rows = follower.first_rows()
    if not rows and stop is None:
        say(f"no log records of run {run_id} in {base}")
    for row in rows:
        click.echo(line_of(row))
    while stop is not None and not stop.wait(0.5):
        for row in follower.new_rows():
            click.echo(line_of(row))


@main.command()
@click.argument("run_id", metavar="RUN")
@broker_options
@click.option(
    "--fleet",
    default=None,
    type=NAME,
    help="The run's fleet [default: the one the gateway recorded for RUN, else default].",
)
@signing_options
@runs_dir_option
@click.option(
    "--wait",
    "wait_s",
    default=30.0,
    show_default=True,
    type=FiniteRange(0, 3600),
    help="Seconds to wait for the run's agents to end their round (after up to "
    f"{RETAINED_WAIT_S:g} s for their presences).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def cancel(
    run_id: str,
    broker_settings: BrokerSettings,
    fleet: str | None,
    key_file: str | None,
    admitted_file: str | None,
    identity_file: str | None,
    state_dir: str | None,
    runs_dir: str | None,
    wait_s: float,
    as_json: bool,
) -> None:
    """Cancel the run RUN: its agents end it after the round they are in, keep their
    checkpoint and model, and wait for the next run; the `coordinator run` conducting it
    writes its report. Signed with the key `coordinator run` signs with."""
    from coordinator.manage import cancel_run, describe_cancellation, mark_cancelled

    base = runs_dir_of(runs_dir, state_dir, say)
    entry = find_entry(base, run_id)
    fleet = fleet or (entry.fleet if entry is not None else "default")
    key, broker_settings = reader_guard(
        broker_settings, key_file, admitted_file, identity_file, state_dir
    )
    done = cancel_run(broker_settings, fleet, run_id, key, wait_s, say)
    recorded = mark_cancelled(base, run_id)
    if as_json:
        click.echo(json.dumps(done.as_json(), indent=2))
        return
    for line in describe_cancellation(done, wait_s):
        console.print(escape(line))
    if recorded:
        console.print(f"recorded it as cancelled in {base}")


@main.command()
@click.argument("agent", type=NAME)
@broker_options
@click.option("--fleet", default="default", show_default=True, type=NAME, help="The fleet.")
@signing_options
@click.option(
    "--wait",
    "wait_s",
    default=3.0,
    show_default=True,
    type=FiniteRange(0, 60),
    help="Seconds to wait for a live agent to announce itself again.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def forget(
    agent: str,
    broker_settings: BrokerSettings,
    fleet: str,
    key_file: str | None,
    admitted_file: str | None,
    identity_file: str | None,
    state_dir: str | None,
    wait_s: float,
    as_json: bool,
) -> None:
    """Forget the agent AGENT: clear its retained presence, status and telemetry, so a
    device that is gone for good leaves `coordinator status` and the dashboard. An agent
    that is in fact alive is asked to announce itself, and comes back."""
    from coordinator.manage import forget_agent

    key, broker_settings = reader_guard(
        broker_settings, key_file, admitted_file, identity_file, state_dir
    )
    forgotten = forget_agent(broker_settings, fleet, agent, key, wait_s)
    if as_json:
        click.echo(json.dumps(forgotten.as_json(), indent=2))
    else:
        console.print(forgotten.describe())


def resume_options(command: Callable) -> Callable:
    """--resume, --new and --runs-dir of `coordinator run`."""
    command = runs_dir_option(command)
    command = click.option(
        "--new",
        "fresh",
        is_flag=True,
        help="Start a new run even when a run of this file was interrupted (it is dropped).",
    )(command)
    return click.option(
        "--resume",
        is_flag=True,
        help="Go on with the interrupted run of this run file (an error if there is none); "
        "without --new the same command does so too.",
    )(command)


def run_broker(start: GatewayStart) -> GatewayStart:
    """The broker `coordinator run` uses, said before anything waits: the one given (one
    line and exit 1 when nothing answers there); without --broker, the one already
    listening at --host:--port (a `coordinator serve`'s), else its own embedded one."""
    settings, options = start.settings, start.options
    if settings.address is not None:
        require_broker(settings.address, given=True)
        return start
    host = "127.0.0.1" if options.host in ("0.0.0.0", "") else options.host
    here = BrokerAddress(host, options.port)
    if unreachable(here, timeout_s=1.0) is None and options.broker_auth is None:
        say(f"a broker already listens on {here} (coordinator serve?): using it")
        return dataclasses.replace(start, settings=dataclasses.replace(settings, address=here))
    elsewhere = serving_elsewhere(here)
    if elsewhere:
        raise ConfigError(
            f"a broker already serves on {elsewhere[0]} (coordinator serve?), not on {here}: "
            f"give --broker {elsewhere[0]} to run on it (without --broker this command starts "
            f"a broker of its own on {here}, which the fleet's agents do not join)"
        )
    return start


def serving_elsewhere(here: BrokerAddress) -> list[BrokerAddress]:
    """Brokers that answer on `here`'s port at this host's other addresses: a `coordinator
    serve --host LAN-ADDRESS`, which a run starting its own broker on loopback would never
    meet (its agents would not come, and it would say so only after the join timeout)."""
    import psutil

    found = []
    for addresses in psutil.net_if_addrs().values():
        for item in addresses:
            if item.family != socket.AF_INET or item.address.startswith("127."):
                continue
            there = BrokerAddress(item.address, here.port)
            if there != here and unreachable(there, timeout_s=0.5) is None:
                found.append(there)
    return found


def with_broker_hint(error: str, own_broker: bool, broker: BrokerAddress) -> str:
    """A join that found no agent at all on a broker this command started itself: the
    agents are on another broker, or were never told of this one."""
    if own_broker and "only 0 of" in error:
        return (
            f"{error}; this command started its own broker on {broker}: agents must connect "
            "there (edge-agent --broker), or give --broker for the fleet's broker"
        )
    return error


def drop_interrupted(base: Path, entry: RunEntry | None, fresh: bool, resume: bool) -> None:
    """--new drops the interrupted run; --resume needs one."""
    if resume and fresh:
        raise click.BadParameter("--resume and --new exclude each other", param_hint="--new")
    if resume and entry is None:
        raise ConfigError(f"no interrupted run of this run file to resume in {base}")
    if fresh and entry is not None:
        end_entry(base, entry, "failed", "dropped for a new run (--new)")
        say(f"dropped the interrupted run {entry.run_id}")


@main.command("run")
@click.argument("run_file", type=click.Path(dir_okay=False))
@gateway_options
@report_options
@resume_options
def run_command(
    run_file: str,
    gateway: GatewayOptions,
    report_path: str | None,
    force: bool,
    plot_dir: str | None,
    target_accuracy: float | None,
    resume: bool,
    fresh: bool,
    runs_dir: str | None,
) -> str:
    """Run RUN_FILE (TOML, table [run]) on the fleet's devices and write the report.

    Waits for the agents the run wants (online, idle, with data that fits), fixes the roster,
    publishes the run, aggregates centralized strategies, follows the agents' statuses, and
    writes the report (the schema of `simulate`) from what they published. With no --broker
    it uses the broker listening at --host:--port, else starts the embedded broker itself.
    The run is recorded in the gateway's state folder (--state-dir; or --runs-dir) as it
    goes: if this command is stopped or its host restarts, the same command again goes on
    with the run (`coordinator runs` lists them).
    """
    require_extra(
        GATEWAY_EXTRA,
        "coordinator run",
        embedded_broker=gateway.broker_settings.address is None,
        http=gateway.http,
        plot_dir=plot_dir,
    )
    from agent.runfile import load_run_file

    try:
        checked = load_run_file(run_file)  # a mistake said before the gateway's imports
        from coordinator.gateway import Registry, RunFailed, conduct, load_for_run

        runfile = load_for_run(checked)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    values = runfile.values
    check_target(target_accuracy, values.get("task", "classification"), values.get("metric", ""))
    fleet, base = gateway.fleet, runs_dir_of(runs_dir, gateway.state_dir, say)
    interrupted = resumable(base, run_file, fleet)
    own = interrupted.report if interrupted is not None and not fresh else None
    report_path = report_target(report_path, force, own)
    start = run_broker(GatewayStart.secured(gateway))
    stop = stop_on_signal()
    identity = start.signed(COORDINATOR)
    key = identity.key
    registry = Registry(base, str(Path(report_path).resolve()))
    drop_interrupted(registry.base, interrupted, fresh, resume)
    own_broker = start.settings.address is None
    with start.joined(identity) as (broker, transport):
        try:
            with agent_rounds() as progress:
                task = progress.add_task("rounds", total=None)

                def advance(done: int, total: int) -> None:
                    progress.update(task, completed=done, total=total)

                report = conduct(
                    runfile, transport, fleet, key, stop, say, advance,
                    registry=registry, resume=None if fresh else interrupted,
                )  # fmt: skip
        except RunFailed as exc:
            raise click.ClickException(with_broker_hint(str(exc), own_broker, broker)) from None
        except (ValueError, RuntimeError) as exc:
            raise click.ClickException(str(exc)) from None
    publish_report(report, report_path, plot_dir, target_accuracy)
    say_how_it_ended(report)
    return report_path  # where it went, for the Python API (`edgefl.run`)


def say_how_it_ended(report: dict[str, Any]) -> None:
    """Exit 1 with the reason when the run did not finish well (interrupted, failed agents,
    no round at all); a cancelled run is said and is not an error."""
    if report["summary"].get("interrupted"):
        raise click.ClickException(
            f"run {report['config']['run_id']} interrupted after {len(report['rounds'])} "
            "rounds; the same command goes on with it"
        )
    if report["summary"].get("cancelled"):
        from coordinator.manage import after_rounds

        ended = after_rounds(report["summary"].get("cancelled_after", {}))
        say(f"run {report['config']['run_id']} was cancelled {ended}")
        return
    from coordinator.conductor import describe_failures

    failed = describe_failures(report)
    if failed:
        raise click.ClickException(failed)
    if not report["rounds"]:
        raise click.ClickException("no agent completed a round")
