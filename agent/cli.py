"""The `edge-agent` command: join a fleet over MQTT, learn with it, stay reachable.

What trains (torch) is imported inside the functions that start an agent, so `--help`,
`--version`, `key`, `models` and `predict` start in a fraction of a second on a device, and
`predict` serves its model without loading torch (tests/test_layering.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from click.core import ParameterSource

from agent.experiment import ExperimentConfig, check_networked
from agent.files import DiskFullError
from agent.model_store import DEFAULT_KEEP_RUNS, MODEL_ONNX, ModelStore
from agent.onnx_model import RECONSTRUCTION, OnnxModel, load_inputs
from agent.options import expect_options
from firmware_profiles import ProfileError, load_profile
from protocol import (
    NAME,
    BrokerAddress,
    ConfigError,
    Identity,
    MqttTransport,
    ProtocolError,
    TlsOptions,
    connect,
    leave,
    read_key,
    stop_on_signal,
    topics,
)
from protocol.cli import (
    BrokerSettings,
    broker_options,
    logging_options,
    loopback,
    say,
    seconds,
    version_option,
)
from protocol.cli_help import HelpAllGroup, tucked
from protocol.fleet_logs import DEFAULT_LEVEL, LEVELS
from protocol.limits import MAX_MEMBERS, PRE_RUN_LIMITS
from protocol.log_context import agent_scope, set_process_name
from protocol.membership import BROKER_WAIT_S, STAMPS_FILE
from protocol.mqtt import unreachable, unresolved
from protocol.signing import (
    IDENTITY_FILE,
    Signer,
    member_keys,
    public_line,
)

if TYPE_CHECKING:
    from agent.own_data import OwnData
    from agent.service import ServiceOptions

log = logging.getLogger(__name__)


def shown(
    flag: str, kind: click.ParamType, default: float | None, text: str, **extra: Any
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A numeric option whose help shows its default (when it has one)."""
    return click.option(
        flag, type=kind, default=default, show_default=default is not None, help=text, **extra
    )


TUNING = "Tuning options"
"""Where `--help-all` lists what a device rarely changes (timeouts, models kept, telemetry):
`--help` keeps to what connecting, identifying and running a device needs."""


def default_agent_id() -> str:
    """The host name, made into a valid topic level, so one agent per device needs no flag."""
    name = re.sub(r"[^a-z0-9_.-]", "-", socket.gethostname().lower()).strip("-.")
    return (name or "agent")[:64]


def member_id(ctx: click.Context, agent_id: str, settings: BrokerSettings) -> str:
    """This agent's id: --id, else its broker login when that is a valid id (with per-member
    logins the broker lets a member publish only as its login), else the host name."""
    if ctx.get_parameter_source("agent_id") is not ParameterSource.DEFAULT:
        return agent_id
    try:
        return topics.check_name(settings.username or "", "agent")
    except ProtocolError:
        return agent_id


def wanted_run(
    run_file: str | None, expect: int | None, experiment: dict[str, Any], own: OwnData | None
) -> tuple[int | None, Callable[[int], ExperimentConfig] | None, dict[str, float]]:
    """Without a coordinator (`--expect N`, `--run FILE`): how many agents the run waits for
    and the run this agent wants for n agents; checked now, with this device's data `own`,
    so a configuration that cannot work is a one-line error before anything starts."""
    from agent.runfile import load_run_file, parse_run_table, run_timeouts
    from agent.workload import data_misfit, fingerprinted

    given = {k: v for k, v in experiment.items() if v is not None}
    if run_file is None and expect is None:
        if given:
            flags = ", ".join("--" + k.replace("_", "-") for k in sorted(given))
            raise ValueError(f"{flags}: experiment flags need --expect N (or use --run FILE)")
        return None, None, {}
    if run_file is not None:
        if given:
            raise ValueError("give the run either as --run FILE or as experiment flags, not both")
        runfile = load_run_file(run_file, agents=expect)
    else:
        runfile = parse_run_table(
            {**given, "agents": expect, "dataset": given.get("dataset", "mnist1d")}, "flags"
        )
    if expect is not None and expect != runfile.wanted:
        raise ValueError(f"--expect {expect} but the run file wants {runfile.wanted} agents")
    expect = runfile.wanted

    def own_config(roster_size: int) -> ExperimentConfig:
        return fingerprinted(runfile.config(roster_size))

    wanted = own_config(expect)
    check_networked(wanted, aggregator=False)
    if own is not None and wanted.on_devices and (problem := data_misfit(wanted, own)):
        raise ValueError(f"{own.path}: the data does not fit the run: {problem}")
    # A run file fixes the run's timeouts for every agent; flags leave each agent its own.
    timeouts = run_timeouts(runfile.timeouts) if run_file is not None else {}
    return expect, own_config, timeouts


def find_broker(
    settings: BrokerSettings, fleet: str, interfaces: tuple[str, ...]
) -> BrokerSettings:
    """The settings with the broker named by --broker (or its variable or config file), else
    with the one announced for this fleet over mDNS on the --mdns interfaces (over TLS with
    the system's CAs when it says TLS and no TLS options were given)."""
    if settings.address is not None:
        return settings
    if not interfaces:
        raise click.UsageError(
            "no broker: give --broker HOST[:PORT] (or EDGEFL_BROKER), or --mdns IP to find "
            "the fleet's broker over mDNS"
        )
    from protocol.discovery import discover_broker  # zeroconf: only when asked for

    say(f"looking for the broker of fleet {fleet} over mDNS on {', '.join(interfaces)}")
    try:
        found = discover_broker(fleet, list(interfaces), timeout=DISCOVERY_TIMEOUT_S)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--mdns") from None
    if found is None:
        raise click.ClickException(
            f"no broker of fleet {fleet} announced over mDNS on {', '.join(interfaces)} within "
            f"{DISCOVERY_TIMEOUT_S:g} s; is the coordinator serving with --mdns?"
        )
    tls = settings.tls or (TlsOptions() if found.tls else None)
    return dataclasses.replace(settings, address=BrokerAddress(found.host, found.port), tls=tls)


DISCOVERY_TIMEOUT_S = 30.0


@dataclasses.dataclass(frozen=True)
class Hosted:
    """Given as click's `obj` when `agent.host` runs this command in a thread beside other
    agents. A process has one set of signal handlers, in its main thread: a hosted agent
    stops on the event `started()` returns instead (called once the command line is read
    and logging is set up, which the host lets one agent at a time do); `joined` gets the
    agent's connection, which the host drops as a crash would to kill this agent alone."""

    started: Callable[[], threading.Event]
    joined: Callable[[MqttTransport], None]


def name_its_lines(ctx: click.Context, agent_id: str, hosted: Hosted | None) -> None:
    """The agent's log lines name it; alone in its process, so do all (its libraries'
    threads' too), while a hosted agent shares the process with others."""
    ctx.with_resource(agent_scope(agent_id))
    if hosted is None:
        set_process_name(agent_id)


@click.group(
    cls=HelpAllGroup,
    invoke_without_command=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)
@version_option
@broker_options
@click.option("--fleet", default="default", show_default=True, type=NAME, help="Fleet to join.")
@click.option(
    "--id",
    "agent_id",
    type=NAME,
    default=default_agent_id,
    help="This agent's id in the fleet [default: the broker login (--username), else the "
    "host name].",
)
@click.option(
    "--data",
    "data_path",
    type=str,
    help="This device's own data, used whole and never sent: an .npz (x, and y if any), a .csv "
    "(numeric features and a 'label' or 'target' column), a folder with a sub-folder of images "
    "per class, or python:MODULE:FUNCTION (called again for every run).",
)
@click.option("--profile", default=None, help="Device profile name or TOML file.")
@click.option(
    "--device",
    "compute",
    default="auto",
    show_default=True,
    metavar="auto|cpu|cuda[:N]",
    help="What to train on: auto picks CUDA where torch sees it; the budget p_k counts "
    "the peak of the compute chosen.",
)
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Checkpoints, round logs and the ONNX model [default: ~/.edgefl/FLEET/ID].",
)
@click.option(
    "--run",
    "run_file",
    type=click.Path(exists=True, dir_okay=False),
    help="Without a coordinator: the run file (TOML, [run]) every agent is given.",
)
@shown(
    "--expect",
    click.IntRange(1, MAX_MEMBERS),
    None,
    "Without a coordinator: start once this many agents (self included) are online, with "
    "--run FILE or the experiment options (--help-all).",
)
@click.option("--once", is_flag=True, help="Exit after one run instead of waiting for the next.")
@click.option(
    "--keep-best",
    is_flag=True,
    help="Keep the most accurate run's model current (STATE_DIR/model.onnx), whatever a "
    "run's `keep` says [default: the newest run's, unless it is less accurate by more than "
    "the run's keep_margin].",
    **tucked(TUNING),
)
@shown(
    "--keep-runs",
    click.IntRange(1),
    DEFAULT_KEEP_RUNS,
    "Keep the folders (model, checkpoint, round log) of this many ended runs; older ones are "
    "deleted when a run finishes, never the current model's.",
    **tucked(TUNING),
)
@click.option(
    "--telemetry",
    is_flag=True,
    help="Also publish each status as plain JSON on fl/v1/FLEET/telemetry/ID (retained), "
    "for MQTT tools (mosquitto_sub, Node-RED, Telegraf).",
    **tucked(TUNING),
)
@click.option(
    "--fleet-logs",
    type=click.Choice(["off", *(level.lower() for level in LEVELS)], case_sensitive=False),
    default=DEFAULT_LEVEL.lower(),
    show_default=True,
    help="Publish this agent's log records of each run at this level and up to the gateway "
    "(`coordinator logs`), rate-limited; records below the agent's own level (-v) are never "
    "made; off: none.",
    **tucked(TUNING),
)
@shown(
    "--round-timeout",
    seconds(0.1),
    120.0,
    "Seconds to wait for a neighbour's model before going on without it (a run's own "
    "timeouts win).",
    **tucked(TUNING),
)
@shown(
    "--vote-timeout",
    seconds(0.1),
    60.0,
    "Seconds to wait for a round's votes before counting missing ones as 0.",
    **tucked(TUNING),
)
@shown(
    "--linger",
    seconds(0),
    60.0,
    "After the last round, keep serving neighbours this long at most.",
    **tucked(TUNING),
)
@click.option(
    "--mdns",
    "mdns_interfaces",
    multiple=True,
    metavar="IP",
    help="Use mDNS on the interface with this address (repeatable): advertise this agent "
    "and, with no --broker, find the fleet's broker. Off unless given.",
)
@click.option(
    "--key-file",
    type=click.Path(exists=True, dir_okay=False),
    help="File holding the fleet key that signs and checks every message (one key shared "
    "by the fleet; see --trust for a key per member).",
)
@click.option(
    "--trust",
    "trust_file",
    type=click.Path(exists=True, dir_okay=False),
    help="Sign with this agent's own key (STATE_DIR/identity.pem, made on first start; "
    "`edge-agent key` prints it) and accept runs only from the members this file lists "
    "(lines 'ID ed25519:KEY': the coordinator's, or, with --expect, the peers') [default: "
    "trust.keys beside the --config file, as `coordinator admit` writes it].",
)
@click.option(
    "--open",
    "open_fleet",
    is_flag=True,
    help="With a broker beyond loopback, run without a key and a broker login: anyone on "
    "the network may give this agent runs and send it models (said at the start). Without "
    "it, such an agent needs the bundle `coordinator admit` writes (--config).",
)
@logging_options
@expect_options
@click.pass_context
def main(
    ctx: click.Context,
    broker_settings: BrokerSettings,
    fleet: str,
    agent_id: str,
    data_path: str | None,
    profile: str | None,
    compute: str,
    state_dir: str | None,
    run_file: str | None,
    expect: int | None,
    once: bool,
    keep_best: bool,
    keep_runs: int,
    telemetry: bool,
    fleet_logs: str,
    round_timeout: float,
    vote_timeout: float,
    linger: float,
    mdns_interfaces: tuple[str, ...],
    key_file: str | None,
    trust_file: str | None,
    open_fleet: bool,
    **experiment: Any,
) -> None:
    """Run an edge agent: join the fleet, take part in every run that names this agent,
    keep its personalized model, and wait for the next run until Ctrl-C or SIGTERM.

    Runs come from a coordinator (`coordinator run`), or, in a fleet without one, from
    --expect N with --run FILE (the same file on every device).
    """
    agent_id = member_id(ctx, agent_id, broker_settings)
    if ctx.invoked_subcommand is not None:
        ctx.meta["agent_id"] = agent_id  # `edge-agent key` prints this agent's key
        return

    from agent.device import resolve_device
    from agent.own_data import load_own_data
    from agent.runtime import Timeouts
    from agent.service import ServiceOptions

    hosted = ctx.find_object(Hosted)
    name_its_lines(ctx, agent_id, hosted)
    stop = stop_on_signal() if hosted is None else hosted.started()
    try:
        device = load_profile(profile) if profile else None
        trains_on = resolve_device(compute)
        if device is not None:
            device.peak_for(trains_on.type)  # a CPU-only board asked for CUDA: an error
        own = load_own_data(data_path) if data_path else None
        expect, own_config, own_timeouts = wanted_run(run_file, expect, experiment, own)
    except (ProfileError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    folder = agent_state_dir(state_dir, fleet, agent_id)
    broker_settings = find_broker(broker_settings, fleet, mdns_interfaces)
    trust_file = trust_file or bundle_trust(ctx.params.get("config_file"), key_file)
    key = agent_signer(key_file, trust_file, agent_id, folder)
    if key is None and broker_settings.username is None:
        check_open(broker_settings, open_fleet, agent_id, fleet, folder)
    profile_name = device.name if device else ""
    identity = Identity(fleet, agent_id, profile=profile_name, key=key, stamps=folder / STAMPS_FILE)
    options = ServiceOptions(
        state_dir=folder,
        timeouts=Timeouts(round_s=round_timeout, vote_s=vote_timeout, linger_s=linger),
        device=device,
        own=own,
        once=once or expect is not None,
        expect=expect,
        own_config=own_config,
        own_timeouts=own_timeouts,
        say=say,
        compute=trains_on,
        compute_auto=compute == "auto",
        telemetry=telemetry,
        fleet_logs=None if fleet_logs == "off" else fleet_logs.upper(),
        keep_best=keep_best,
        keep_runs=keep_runs,
    )
    serve(broker_settings, identity, options, stop, hosted, mdns_interfaces)
    say(f"agent {agent_id} stopped")


def serve(
    settings: BrokerSettings,
    identity: Identity,
    options: ServiceOptions,
    stop: threading.Event,
    hosted: Hosted | None,
    mdns_interfaces: tuple[str, ...],
) -> None:
    """Join the fleet and serve it until `stop`, leaving it cleanly whatever happens (a
    full disk is a one-line error after the goodbye)."""
    from agent.service import AgentService

    broker = settings.address
    assert broker is not None
    transport = join(settings, identity)
    if hosted is not None:
        hosted.joined(transport)
    discovery = None
    try:
        if mdns_interfaces:
            discovery = advertise(identity, broker, mdns_interfaces)
        if wait_for_broker(transport, stop):
            AgentService(identity, transport, options, stop).serve()
    except DiskFullError as exc:  # one line, exit 1, after the goodbye below
        raise click.ClickException(str(exc)) from None
    finally:
        leave(transport, identity)
        if discovery is not None:
            discovery.close()


def join(settings: BrokerSettings, identity: Identity) -> MqttTransport:
    """The agent's connection to its fleet, its id claimed; a duplicate id or refused
    credentials are one-line errors. Where no broker answers (a device may boot before its
    gateway), it says why at once and keeps connecting in the background."""
    broker = settings.address
    assert broker is not None
    # Until a run names its model, nothing larger than a run message is expected.
    wire = dataclasses.replace(settings.transport_options(None), limits=PRE_RUN_LIMITS)
    problem = unreachable(broker)
    if problem is not None:
        say(f"{problem}; retrying until it does")
    try:
        # Nobody to ask whether the id is taken: no need to wait for an answer.
        transport = connect(broker, identity, wire, broker_wait_s=0.0 if problem else BROKER_WAIT_S)
    except ProtocolError as exc:
        raise click.ClickException(str(exc)) from None
    who = f"agent {identity.sender}"
    if transport.connected:
        say(f"{who} joined fleet {identity.fleet} via {broker}")
    elif problem is None:
        say(f"{who}: broker {broker} does not answer yet; retrying in the background")
    return transport


def wait_for_broker(transport: MqttTransport, stop: threading.Event) -> bool:
    """Wait until the transport is connected, however long (a gateway may be down for a
    while); False if `stop` came first. A broker that answers but refuses the agent's login
    is a one-line error, as it is at the start."""
    if transport.connected:
        return True
    while not transport.wait_connected(1.0):
        if stop.is_set():
            return False
        if transport.refused is not None:
            raise click.ClickException(
                f"the MQTT broker {transport.broker} refused the connection "
                f"({transport.refused}): check the user name, password and TLS options"
            )
    say(f"connected to broker {transport.broker}")
    return True


def agent_state_dir(state_dir: str | None, fleet: str, agent_id: str) -> Path:
    return Path(state_dir) if state_dir else Path.home() / ".edgefl" / fleet / agent_id


def named_state_dir(ctx: click.Context) -> Path:
    """The state folder of the agent a subcommand's command line names (--state-dir, else
    --fleet and --id), resolved as the agent itself resolves it."""
    root = ctx.find_root()
    return agent_state_dir(root.params.get("state_dir"), root.params["fleet"], ctx.meta["agent_id"])


def agent_signer(
    key_file: str | None, trust_file: str | None, agent_id: str, state_dir: Path
) -> Signer | None:
    """How this agent signs: the fleet key, its own key pair, or not at all."""
    if key_file and trust_file:
        raise click.UsageError("give --key-file (one fleet key) or --trust (a key per member)")
    if trust_file is None:
        return read_key(key_file)
    try:
        signer = member_keys(agent_id, state_dir / IDENTITY_FILE, Path(trust_file), runners=True)
    except ProtocolError as exc:
        raise click.ClickException(str(exc)) from None
    if signer.runners <= {agent_id}:
        raise click.ClickException(
            f"{trust_file} names nobody this agent would take runs from: add the lines "
            "`coordinator key` prints (or, with --expect, the peers' `edge-agent key` lines)"
        )
    say(f"agent {agent_id} signs with its own key {signer.public}")
    return signer


BUNDLE_TRUST = "trust.keys"
"""The coordinator keys a device trusts, beside the agent.toml of its bundle (`coordinator
admit` writes both)."""


def bundle_trust(config_file: str | None, key_file: str | None) -> str | None:
    """The trust file of the bundle whose agent.toml is --config, if it has one (and no
    fleet key is given instead)."""
    if config_file is None or key_file is not None:
        return None
    trust = Path(config_file).parent / BUNDLE_TRUST
    return str(trust) if trust.is_file() else None


def check_open(
    settings: BrokerSettings, open_fleet: bool, agent_id: str, fleet: str, state_dir: Path
) -> None:
    """An agent with neither a key nor a broker login runs only on loopback, or with --open
    (said, with what it allows); elsewhere it is a one-line error that says how to admit
    it: its key (made now), the command for the gateway and where the bundle goes."""
    broker = settings.address
    assert broker is not None
    if open_fleet:
        if not loopback(broker.host):
            say(
                f"[bold]--open[/]: agent {agent_id} signs nothing and has no login on {broker}: "
                "any machine that reaches the broker can give it runs, send it forged models "
                "and read what it publishes. Use it only on a network you trust."
            )
        return
    if loopback(broker.host):
        return
    if problem := unresolved(broker):  # a mistyped --broker, not yet a fleet to be admitted to
        raise ConfigError(f"{problem}: check --broker")
    try:
        line = public_line(agent_id, state_dir / IDENTITY_FILE)
    except ProtocolError as exc:
        raise click.ClickException(str(exc)) from None
    fleet_flag = "" if fleet == "default" else f" --fleet {fleet}"
    raise ConfigError(
        f"agent {agent_id} is not admitted to the fleet on {broker}: on the gateway run "
        f"`coordinator admit {line}{fleet_flag}`, copy the bundle folder it names to this "
        "device and start with --config BUNDLE/agent.toml (or give --open to run unsigned "
        "with no login, which anyone on the network can abuse)"
    )


@main.command()
@click.pass_context
def key(ctx: click.Context) -> None:
    """Print this agent's public key as a line for a coordinator's admission list or a
    peer's trust file (`ID ed25519:KEY`), making the key pair on first use.

    Give the same --id, --fleet and --state-dir as the agent itself:
    `edge-agent --id d1 key >> admitted.keys`."""
    agent_id = ctx.meta["agent_id"]
    try:
        click.echo(public_line(agent_id, named_state_dir(ctx) / IDENTITY_FILE))
    except ProtocolError as exc:
        raise click.ClickException(str(exc)) from None


def advertise(identity: Identity, broker: BrokerAddress, interfaces: tuple[str, ...]) -> Any:
    """Announce this agent over mDNS on `interfaces` (the Discovery to close at the end)."""
    from protocol.discovery import AgentAdvert, Discovery  # zeroconf: only when asked for

    try:
        discovery = Discovery(interfaces=list(interfaces))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--mdns") from None
    advert = AgentAdvert(identity.sender, identity.fleet, str(broker), identity.profile)
    discovery.advertise_agent(advert)
    return discovery


@main.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON.")
@click.pass_context
def models(ctx: click.Context, as_json: bool) -> None:
    """List the models this device kept, one per finished run, newest first; the current
    one (STATE_DIR/model.onnx, which `predict` serves) is marked with *.

    Give the same --id, --fleet and --state-dir as the agent itself:
    `edge-agent --state-dir /var/lib/edgefl models`. `models use RUN` makes RUN's model
    current (a rollback)."""
    if ctx.invoked_subcommand is not None:
        return
    folder = named_state_dir(ctx)
    store = ModelStore(folder)
    kept, current = store.models(), store.current_run()
    if as_json:
        rows = [{**dataclasses.asdict(m), "current": m.run_id == current} for m in kept]
        click.echo(json.dumps(rows))
        return
    if not kept:
        say(f"no models kept in {folder} yet: each run this agent finishes keeps one")
        return
    click.echo(f"  {'RUN':<18} {'FINISHED':<19} {'STRATEGY':<11} {'MODEL':<9} ROUNDS ACCURACY")
    for m in kept:
        finished = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.finished))
        accuracy = "-" if m.accuracy is None else f"{m.accuracy:.4f}"
        mark = "*" if m.run_id == current else " "
        click.echo(
            f"{mark} {m.run_id:<18} {finished:<19} {m.strategy:<11} {m.model:<9} "
            f"{m.rounds:>6} {accuracy:>8}"
        )


@models.command("use")
@click.argument("run_id", metavar="RUN")
@click.pass_context
def use_model(ctx: click.Context, run_id: str) -> None:
    """Make RUN's kept model the current one (STATE_DIR/model.onnx), e.g. to roll back to
    it. A running agent picks again by its policy when its next run finishes."""
    store = ModelStore(named_state_dir(ctx))
    try:
        kept = store.use(run_id)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    accuracy = "unknown" if kept.accuracy is None else f"{kept.accuracy:.4f}"
    rounds = f"{kept.rounds} round{'' if kept.rounds == 1 else 's'}"
    say(
        f"run {run_id} is now the current model (accuracy {accuracy}, {rounds}): "
        f"{store.current_path}"
    )


@main.command()
@click.argument("inputs", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--model",
    "model_path",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="The exported model [default: the agent's current model, STATE_DIR/model.onnx].",
)
@shown("--threads", click.IntRange(1), 1, "onnxruntime intra-op threads.")
@shown(
    "--latency-samples",
    click.IntRange(0),
    200,
    "Samples to time one at a time for the per-sample latency.",
)
@click.option(
    "--threshold",
    type=float,
    default=None,
    metavar="X",
    help="Reconstruction models: flag the samples whose reconstruction_error exceeds X as "
    "anomalies.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (predictions and latency).")
@click.pass_context
def predict(
    ctx: click.Context,
    inputs: str,
    model_path: str | None,
    threads: int,
    latency_samples: int,
    threshold: float | None,
    as_json: bool,
) -> None:
    """Run an exported personalized model on INPUTS (.npy, or .npz with x), by the task in
    its metadata: each sample's class (classification, and models exported without a task),
    its predicted values (regression), or its reconstruction_error, the mean squared
    difference between the output and the input (reconstruction, an autoencoder)."""
    if threshold is not None and not 0 <= threshold < float("inf"):
        raise click.BadParameter("must be a finite number >= 0", param_hint="--threshold")
    path = model_path or named_state_dir(ctx) / MODEL_ONNX
    try:
        model = OnnxModel.load(path, threads=threads)
        task = model.task
    except (ValueError, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from None
    if threshold is not None and task != RECONSTRUCTION:
        # Checked before the inputs are read: the flag is wrong whatever they hold.
        raise ConfigError(
            f"--threshold applies to reconstruction models only; {path} is a {task} model"
        )
    try:
        x = load_inputs(inputs, model.input_shape)
        answer = model.answer(x, threshold)
    except (ValueError, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from None
    stats = model.benchmark(x[:latency_samples]) if latency_samples else None
    if as_json:
        latency = dataclasses.asdict(stats) if stats else None
        click.echo(json.dumps({**answer.fields(), "latency": latency}))
        return
    for line in answer.lines():
        click.echo(line)
    if stats:
        say(
            f"per-sample latency over {stats.samples} samples: mean "
            f"{stats.mean_ms:.3f} ms, p50 {stats.p50_ms:.3f} ms, p95 "
            f"{stats.p95_ms:.3f} ms; {stats.throughput_per_s:,.0f} samples/s at batch "
            f"{stats.batch_size}"
        )
