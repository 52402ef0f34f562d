"""The `edge-agent` command: join a fleet over MQTT, learn with it, stay reachable."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from agent.device import Budget, BudgetLimits, Throttle, compute_budget, read_device
from agent.experiment import (
    ExperimentConfig,
    Workload,
    build_workload,
    check_networked,
    config_from_dict,
    nominal_budgets,
    profile_names,
    round_work,
)
from agent.learning import AgentState
from agent.onnx_export import OnnxModel, export_onnx, load_inputs
from agent.options import experiment_config, experiment_options
from agent.runtime import AgentRuntime, Run, Timeouts
from firmware_profiles import DeviceProfile, ProfileError, load_profile
from protocol import (
    BROKER,
    NAME,
    BrokerAddress,
    ConfigError,
    Identity,
    MqttTransport,
    ProtocolError,
    connect,
    leave,
    messages,
    read_key,
    stop_on_signal,
    topics,
    wait_for,
)

console = Console(stderr=True)
log = logging.getLogger(__name__)


def shown(
    flag: str, kind: click.ParamType, default: float | None, text: str
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A numeric option whose help shows its default (when it has one)."""
    return click.option(
        flag, type=kind, default=default, show_default=default is not None, help=text
    )


def default_agent_id() -> str:
    """The host name, made into a valid topic level, so one agent per device needs no flag."""
    name = re.sub(r"[^a-z0-9_.-]", "-", socket.gethostname().lower()).strip("-.")
    return (name or "agent")[:64]


def flags_run_id(fleet: str, roster: list[str], config: ExperimentConfig) -> str:
    """A run id every agent started with the same flags computes alike, with no coordinator."""
    text = json.dumps([fleet, sorted(roster), dataclasses.asdict(config)], sort_keys=True)
    return "run-" + hashlib.sha256(text.encode()).hexdigest()[:12]


def wait_for_run(
    transport: MqttTransport,
    fleet: str,
    key: bytes | None,
    stop: threading.Event,
    patience_s: float | None,
) -> Run | None:
    """The coordinator's retained run message; None if none came within `patience_s`."""
    found: list[Run] = []
    ready = threading.Event()

    def on_run(_topic: str, payload: bytes) -> None:
        try:
            message = messages.decode(payload, key=key)
            if not isinstance(message, messages.RunConfig) or message.fleet != fleet:
                raise ProtocolError("not a run configuration of this fleet")
            config = config_from_dict(message.config)
            check_networked(config, aggregator=True)
            run = Run(message.run_id, tuple(sorted(message.roster)), config, message.sender)
        except (ProtocolError, ValueError) as exc:
            log.warning("ignoring run message: %s", exc)
            return
        found.append(run)
        ready.set()

    transport.subscribe(topics.run(fleet), on_run)
    deadline = None if patience_s is None else time.monotonic() + patience_s
    while not ready.wait(0.5):
        if stop.is_set() or (deadline is not None and time.monotonic() > deadline):
            return None
    return found[-1]


def wait_for_roster(
    transport: MqttTransport,
    fleet: str,
    me: str,
    expect: int,
    key: bytes | None,
    stop: threading.Event,
) -> list[str] | None:
    """The first `expect` agents seen online on the fleet's presence topics (self included)."""
    online: dict[str, bool] = {}
    lock = threading.Lock()

    def on_presence(_topic: str, payload: bytes) -> None:
        try:
            message = messages.decode(payload, key=key)
        except ProtocolError:
            return
        if isinstance(message, messages.Presence) and message.role == "agent":
            with lock:
                online[message.sender] = message.online

    transport.subscribe(topics.presence(fleet), on_presence)
    while not stop.wait(0.5):
        with lock:
            peers = sorted(a for a, up in online.items() if up)
        if len(peers) >= expect and me in peers:
            return peers[:expect]
    return None


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--broker", type=BROKER, help="MQTT broker of the fleet (required to run).")
@click.option("--fleet", default="default", show_default=True, type=NAME, help="Fleet to join.")
@click.option(
    "--id",
    "agent_id",
    type=NAME,
    default=default_agent_id,
    help="This agent's id in the fleet [default: the host name].",
)
@click.option("--profile", default=None, help="Device profile name or TOML file.")
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Where checkpoints, the round log and the ONNX model go [default: ~/.edgefl/FLEET/ID].",
)
@shown(
    "--expect",
    click.IntRange(1),
    None,
    "Without a coordinator: wait for this many agents (self included) and run "
    "with the experiment flags below.",
)
@shown(
    "--round-timeout",
    click.FloatRange(0.1),
    120.0,
    "Seconds to wait for a neighbour's model before going on without it.",
)
@shown(
    "--vote-timeout",
    click.FloatRange(0.1),
    60.0,
    "Seconds to wait for a round's votes before counting missing ones as 0.",
)
@shown(
    "--linger",
    click.FloatRange(0),
    60.0,
    "After the last round, keep serving neighbours this long at most.",
)
@click.option(
    "--mdns",
    "mdns_interfaces",
    multiple=True,
    metavar="IP",
    help="Advertise this agent over mDNS on the interface with this address "
    "(repeatable). Off unless given.",
)
@click.option(
    "--key-file",
    type=click.Path(exists=True, dir_okay=False),
    help="File holding the fleet key that signs and checks every message.",
)
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
@experiment_options
@click.pass_context
def main(
    ctx: click.Context,
    broker: BrokerAddress | None,
    fleet: str,
    agent_id: str,
    profile: str | None,
    state_dir: str | None,
    expect: int | None,
    round_timeout: float,
    vote_timeout: float,
    linger: float,
    mdns_interfaces: tuple[str, ...],
    key_file: str | None,
    verbose: int,
    **experiment: object,
) -> None:
    """Run an edge agent: join the fleet, learn with it, and keep serving until Ctrl-C.

    The run configuration comes from the coordinator's retained run message, or, with
    --expect N, from this agent's own experiment flags (every agent must get the same).
    """
    if ctx.invoked_subcommand is not None:
        return
    if broker is None:
        raise click.UsageError("Missing option '--broker'.")
    stop = stop_on_signal()
    level = (logging.WARNING, logging.INFO, logging.DEBUG)[min(verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        device = load_profile(profile) if profile else None
        own_config = experiment_config(experiment) if expect else None
        if own_config is not None:
            check_networked(own_config, aggregator=False)
    except (ProfileError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    profile_name = device.name if device else ""
    identity = Identity(fleet, agent_id, profile=profile_name, key=read_key(key_file))
    folder = Path(state_dir) if state_dir else Path.home() / ".edgefl" / fleet / agent_id
    transport = connect(broker, identity)
    discovery = None
    try:
        if mdns_interfaces:
            from protocol import AgentAdvert, Discovery

            discovery = Discovery(interfaces=list(mdns_interfaces))
            discovery.advertise_agent(AgentAdvert(agent_id, fleet, str(broker), profile_name))
        console.print(f"agent {agent_id} joining fleet {fleet} via {broker}")
        publish_idle(transport, identity)
        run = wait_for_run(transport, fleet, identity.key, stop, 3.0 if expect else None)
        if run is None and own_config is not None and expect and not stop.is_set():
            console.print(f"no coordinator run message; waiting for {expect} agents")
            roster = wait_for_roster(transport, fleet, agent_id, expect, identity.key, stop)
            if roster is not None:
                config = dataclasses.replace(own_config, agents=len(roster))
                run = Run(flags_run_id(fleet, roster, config), tuple(roster), config)
        if run is not None and not stop.is_set():
            learn(
                run,
                agent_id,
                fleet,
                transport,
                folder,
                identity.key,
                stop,
                Timeouts(round_s=round_timeout, vote_s=vote_timeout, linger_s=linger),
                device,
            )
        wait_for(stop)
    finally:
        leave(transport, identity)
        if discovery is not None:
            discovery.close()
    console.print(f"agent {agent_id} stopped")


def publish_idle(transport: MqttTransport, identity: Identity) -> None:
    status = messages.Status(fleet=identity.fleet, sender=identity.sender, state="idle")
    transport.publish(
        topics.status(identity.fleet, identity.sender),
        messages.encode(status, key=identity.key),
        retain=True,
    )


def budget_source(
    run: Run, agent_id: str, workload: Workload, device: DeviceProfile | None
) -> tuple[Callable[[], Budget | None] | None, Throttle | None]:
    """Where p_k comes from, and whether this agent's speed and link are emulated.

    A run with `profiles` is an emulated fleet: each agent budgets as an idle board of its
    profile (the simulator computes the same) and is throttled to its speed and link.
    Otherwise an agent with a --profile is a real board and measures itself each round.
    """
    budgets = nominal_budgets(run.config, workload, list(run.roster))
    if agent_id in budgets:
        names = profile_names(run.config.profiles)
        board = load_profile(names[sorted(run.roster).index(agent_id) % len(names)])
        return (lambda: budgets[agent_id]), Throttle(board)
    if device is None:
        return None, None
    work = round_work(run.config, workload.learner, len(workload.data[agent_id].y_train))
    limits = BudgetLimits(round_time_s=run.config.round_time_s)
    readings = [read_device()]

    def measure() -> Budget:
        readings[0] = read_device(readings[0])
        return compute_budget(device, readings[0], work, limits)

    return measure, None


def learn(
    run: Run,
    agent_id: str,
    fleet: str,
    transport: MqttTransport,
    folder: Path,
    key: bytes | None,
    stop: threading.Event,
    timeouts: Timeouts,
    device: DeviceProfile | None,
) -> None:
    """Run the rounds of `run` (resuming from a checkpoint), then stop the program."""
    if agent_id not in run.roster:
        console.print(f"agent {agent_id} is not in the roster of run {run.run_id}; idling")
        return
    console.print(
        f"run {run.run_id}: {run.config.learning.strategy}, {len(run.roster)} agents, "
        f"{run.config.learning.rounds} rounds; state in {folder}"
    )
    workload = build_workload(run.config, list(run.roster), agents=[agent_id])

    def report(record: dict) -> None:
        console.print(
            f"round {record['round']}: accuracy {record['accuracy']:.4f}, "
            f"p_k {record['p_k']:.3f}, sparsity {record['sparsity']:.3f}, "
            f"waited {record['wait_s']:.2f}s"
            + (f", stragglers {record['stragglers']}" if record["stragglers"] else "")
        )

    def export(state: AgentState) -> None:
        path = export_onnx(
            workload.learner.model,
            state.weights,
            workload.learner.input_shape,
            folder / "model.onnx",
            metadata={
                "agent": agent_id,
                "run_id": run.run_id,
                "round": str(state.round),
                "model": workload.model_name,
                "strategy": run.config.learning.strategy,
            },
        )
        console.print(f"run {run.run_id}: personalized model final, exported to {path}")

    budget, throttle = budget_source(run, agent_id, workload, device)
    runtime = AgentRuntime(
        agent_id=agent_id,
        fleet=fleet,
        run=run,
        workload=workload,
        transport=transport,
        state_dir=folder,
        timeouts=timeouts,
        key=key,
        on_round=report,
        on_finish=export,
        stop=stop,
        budget=budget,
        throttle=throttle,
    )
    runtime.run()
    stop.set()


@main.command()
@click.argument("inputs", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--model",
    "model_path",
    type=click.Path(exists=True, dir_okay=False),
    required=True,
    help="The exported model (STATE_DIR/model.onnx).",
)
@shown("--threads", click.IntRange(1), 1, "onnxruntime intra-op threads.")
@shown(
    "--latency-samples",
    click.IntRange(0),
    200,
    "Samples to time one at a time for the per-sample latency.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (predictions and latency).")
def predict(
    inputs: str, model_path: str, threads: int, latency_samples: int, as_json: bool
) -> None:
    """Classify INPUTS (.npy, or .npz with x) with an exported personalized model."""
    try:
        model = OnnxModel.load(model_path, threads=threads)
        x = load_inputs(inputs, model.input_shape)
    except (ValueError, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from None
    classes = model.predict(x).argmax(axis=1).tolist()
    stats = model.benchmark(x[:latency_samples]) if latency_samples else None
    if as_json:
        click.echo(
            json.dumps(
                {"predictions": classes, "latency": dataclasses.asdict(stats) if stats else None}
            )
        )
        return
    click.echo(" ".join(map(str, classes)))
    if stats:
        console.print(
            f"per-sample latency over {stats.samples} samples: mean "
            f"{stats.mean_ms:.3f} ms, p50 {stats.p50_ms:.3f} ms, p95 "
            f"{stats.p95_ms:.3f} ms; {stats.throughput_per_s:,.0f} samples/s at batch "
            f"{stats.batch_size}"
        )
