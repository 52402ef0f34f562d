"""The `edge-agent` command: join a fleet over MQTT and stay reachable until stopped."""

from __future__ import annotations

import logging
import re
import socket

import click
from rich.console import Console

from protocol import messages, topics
from protocol.cli import BROKER, NAME, read_key, stop_on_signal, wait_for
from protocol.membership import Identity, connect, leave
from protocol.mqtt import BrokerAddress

console = Console(stderr=True)


def default_agent_id() -> str:
    """The host name, made into a valid topic level, so one agent per device needs no flag."""
    name = re.sub(r"[^a-z0-9_.-]", "-", socket.gethostname().lower()).strip("-.")
    return (name or "agent")[:64]


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--broker", type=BROKER, required=True, help="MQTT broker of the fleet.")
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
def main(
    broker: BrokerAddress,
    fleet: str,
    agent_id: str,
    profile: str | None,
    mdns_interfaces: tuple[str, ...],
    key_file: str | None,
    verbose: int,
) -> None:
    """Run an edge agent: announce it to the fleet and keep it online until Ctrl-C."""
    stop = stop_on_signal()
    level = (logging.WARNING, logging.INFO, logging.DEBUG)[min(verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from firmware_profiles import ProfileError, load_profile

    try:
        device = load_profile(profile) if profile else None
    except ProfileError as exc:
        raise click.BadParameter(str(exc), param_hint="--profile") from None
    profile_name = device.name if device else ""
    identity = Identity(fleet, agent_id, profile=profile_name, key=read_key(key_file))
    transport = connect(broker, identity)
    discovery = None
    try:
        status = messages.Status(fleet=fleet, sender=agent_id, state="idle")
        transport.publish(
            topics.status(fleet, agent_id), messages.encode(status, key=identity.key), retain=True
        )
        if mdns_interfaces:
            from protocol.discovery import AgentAdvert, Discovery

            discovery = Discovery(interfaces=list(mdns_interfaces))
            discovery.advertise_agent(
                AgentAdvert(agent_id, fleet, str(broker), profile=profile_name)
            )
        console.print(f"agent {agent_id} joining fleet {fleet} via {broker}")
        wait_for(stop)
    finally:
        leave(transport, identity)
        if discovery is not None:
            discovery.close()
    console.print(f"agent {agent_id} stopped")
