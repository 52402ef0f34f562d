"""One fleet over three real mosquitto brokers joined by mosquitto's bridge (the star that
`coordinator bridge-config` writes): agents on different brokers learn together, and the
emulated run gives simulate's numbers agent by agent and round by round."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from click.testing import CliRunner

from coordinator.bridges import BRIDGE, BridgeOptions, Site, bridge_config, write_bridge_config
from coordinator.broker_config import COORDINATOR_IDS, member_password
from coordinator.emulate import Emulation, EmulationOptions
from coordinator.simulate import simulate
from protocol import BrokerAddress
from protocol.acl import fleet_grants
from tests.conftest import BrokerProcess, _require, _unused_port
from tests.test_emulate import AGENTS, assert_same_learning, config

SITES = ("hub", "site1", "site2")
BRIDGE_START_TIMEOUT_S = 20.0

pytestmark = [pytest.mark.mosquitto, pytest.mark.timeout(300)]


def _ports(count: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        if (port := _unused_port()) not in ports:
            ports.append(port)
    return ports


def _client(
    address: BrokerAddress, *filters: str, login: tuple[str, str] | None = None
) -> tuple[mqtt.Client, queue.Queue]:
    """A plain MQTT client subscribed to `filters`; its messages arrive in the queue."""
    received: queue.Queue = queue.Queue()
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
    if login is not None:
        client.username_pw_set(*login)
    client.on_message = lambda _c, _u, m: received.put((m.topic, m.payload, m.retain))
    client.on_connect = lambda c, *_: [c.subscribe(f, 1) for f in filters]
    client.connect(address.host, address.port)
    client.loop_start()
    return client, received


def _close(*clients: mqtt.Client) -> None:
    for client in clients:
        client.loop_stop()
        client.disconnect()


def _wait_for_bridges(
    hub: BrokerAddress, leaves: list[str], login: tuple[str, str] | None = None
) -> None:
    """Until the hub holds each leaf's retained bridge state `1` (mosquitto's notification)."""
    client, received = _client(hub, "$SYS/broker/connection/+/state", login=login)
    up: set[str] = set()
    deadline = time.monotonic() + BRIDGE_START_TIMEOUT_S
    try:
        while up != set(leaves):
            topic, payload, _ = received.get(timeout=max(0.1, deadline - time.monotonic()))
            name = topic.split("/")[3].split("-to-")[0]
            (up.add if payload == b"1" else up.discard)(name)
    finally:
        _close(client)


def _loopback(names: tuple[str, ...]) -> list[Site]:
    ports = _ports(len(names))
    return [Site(n, BrokerAddress("127.0.0.1", p)) for n, p in zip(names, ports, strict=True)]


def _start(
    layout: list[Site], confs: list[Path], logs: Path, login: tuple[str, str] | None = None
) -> Iterator[list[BrokerProcess]]:
    """Run one mosquitto per site configuration, hub first, until the bridges are up; always
    stopped, whatever the test did."""
    binary = _require("mosquitto")
    brokers = []
    for site, conf in zip(layout, confs, strict=True):
        # As root, mosquitto would read the password and ACL files as user mosquitto.
        conf.write_text(conf.read_text() + "log_dest stdout\nuser root\n")
        command = [binary, "-c", str(conf)]
        log = logs / f"{site.name}.log"
        brokers.append(BrokerProcess("mosquitto", command, site.address.port, log))
    try:
        for broker in brokers:
            broker.start()
        _wait_for_bridges(brokers[0].address, [site.name for site in layout[1:]], login)
        yield brokers
    finally:
        for broker in brokers:
            broker.kill()


@pytest.fixture
def sites(tmp_path: Path) -> Iterator[list[BrokerProcess]]:
    """Three mosquitto brokers on loopback, bridged as `bridge-config` writes them (the hub
    first), open to any client."""
    layout = _loopback(SITES)
    confs = write_bridge_config(tmp_path / "sites", layout, BridgeOptions())
    yield from _start(layout, confs, tmp_path)


class ModelWatch:
    """Which agents' models (a peer's round model, or an update to the coordinator) each
    site's broker delivered: one subscriber per site."""

    def __init__(self, brokers: list[BrokerProcess], fleet: str) -> None:
        kinds = [f"fl/v1/{fleet}/round/+/{kind}/#" for kind in ("model", "update")]
        self.clients = [_client(b.address, *kinds) for b in brokers]

    def senders(self) -> list[set[str]]:
        """Per site, the agents whose round models reached a client of that site."""
        result = []
        for client, received in self.clients:
            _close(client)
            result.append({received.get()[0].split("/")[6] for _ in range(received.qsize())})
        return result


@pytest.mark.parametrize(
    "learning",
    [{"strategy": "dadpfl", "max_wait": 2}, {"strategy": "fedavg"}],
    ids=["dadpfl", "fedavg"],
)
def test_a_fleet_over_three_bridged_brokers_learns_as_simulate_does(
    sites: list[BrokerProcess], tmp_path: Path, learning: dict
) -> None:
    cfg = config(**learning)
    brokers = tuple(b.address for b in sites)
    options = EmulationOptions(
        workdir=tmp_path / "fleet", linger_s=20.0, agent_brokers=brokers, agents_per_process=2
    )
    emulation = Emulation(cfg, brokers[0], options)
    home = {agent: emulation.broker_of(k) for k, agent in enumerate(emulation.roster)}
    assert set(home.values()) == set(brokers), "every broker has agents of its own"
    watch = ModelWatch(sites, emulation.fleet)
    emulated = emulation.run()
    assert emulated["summary"]["failed_agents"] == {}
    assert emulated["summary"]["stragglers"] == []
    assert_same_learning(emulated, simulate(cfg))
    # Each site's broker delivered the models published on every other site: they crossed
    # the bridges (leaf to hub, hub to leaf, and leaf to hub to leaf).
    for broker, seen in zip(brokers, watch.senders(), strict=True):
        assert {home[agent] for agent in seen} == set(brokers), broker
    if cfg.learning.strategy == "dadpfl":
        # Two agents per broker and three neighbours each: every agent learns from agents
        # homed on other brokers in every round.
        assert cfg.learning.neighbours > AGENTS // len(brokers) - 1


def test_bridge_config_writes_a_star_of_sites_and_refuses_bad_arguments(tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "out"
    loopback = ["--out", str(out), "--sites", "3"]
    result = runner.invoke(bridge_config, [*loopback, "--base-port", "18830"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == list(SITES)
    assert "connection" not in (out / "hub" / "mosquitto.conf").read_text()
    leaf = (out / "site2" / "mosquitto.conf").read_text()
    assert "address 127.0.0.1:18830" in leaf and "topic fl/v1/# both 1" in leaf
    again = runner.invoke(bridge_config, loopback)
    assert again.exit_code == 2 and "--force" in again.output
    assert runner.invoke(bridge_config, [*loopback, "--force"]).exit_code == 0
    for args, message in [
        (["--sites", "1"], "at least 2 sites"),
        ([], "no site given"),
        (["--sites", "2", "--site", "a=h:1"], "not both"),
        (["--site", "a=h:1", "--site", "a=h:2"], "share the name a"),
        (["--site", "a=h:1", "--site", "b=h:1"], "share the address h:1"),
        (["--site", "a", "--site", "b=h:1"], "expected NAME=HOST[:PORT]"),
        (["--sites", "2", "--agent", "a1"], "--agent needs --fleet"),
        (["--sites", "2", "--fleet", "f", "--agent", "bridge"], "reserved logins"),
    ]:
        result = runner.invoke(bridge_config, ["--out", str(tmp_path / "x"), *args])
        assert result.exit_code == 2 and message in result.output, (args, result.output)
        assert len(result.output.strip().splitlines()) == 1, result.output


def test_secured_sites_carry_each_members_messages_and_enforce_the_acl(tmp_path: Path) -> None:
    """With logins and the ACL on every site, the bridge carries what a member may publish
    (and the coordinator's retained run) to the other site, and nothing forged."""
    layout = _loopback(("hub", "east"))
    grants = fleet_grants("f1", ["a1", "a2"], "gateway", COORDINATOR_IDS)
    out = tmp_path / "sites"
    confs = write_bridge_config(out, layout, BridgeOptions("f1"), grants)
    hub, east = (site.address for site in layout)
    # The same members with the same passwords on both sites: a device may move.
    login = {m: (m, member_password(out / "hub", m)) for m in ("a1", "a2", "gateway", BRIDGE)}
    assert all(member_password(out / "east", m) == p for m, (_, p) in login.items())
    for _ in _start(layout, confs, tmp_path, login[BRIDGE]):
        coordinator, _ = _client(hub, login=login["gateway"])
        coordinator.publish("fl/v1/f1/run", b"run", 1, retain=True).wait_for_publish(5)
        watcher, received = _client(east, "fl/v1/f1/#", login=login["a2"])
        assert received.get(timeout=5)[:2] == ("fl/v1/f1/run", b"run")
        # Kept on the leaf as well: a device that joins the leaf later still gets the run.
        late, kept = _client(east, "fl/v1/f1/run", login=login["a1"])
        assert kept.get(timeout=5) == ("fl/v1/f1/run", b"run", True)
        agent, _ = _client(hub, login=login["a1"])
        agent.publish("fl/v1/f1/status/a2", b"forged", 1).wait_for_publish(5)
        agent.publish("fl/v1/f1/status/a1", b"own", 1).wait_for_publish(5)
        assert received.get(timeout=5) == ("fl/v1/f1/status/a1", b"own", False)
        assert received.empty()
        _close(coordinator, watcher, late, agent)


def test_a_restarted_leaf_gets_the_retained_run_again_from_the_hub(
    sites: list[BrokerProcess],
) -> None:
    """A leaf keeps nothing across a restart (no persistence); its bridge subscribes afresh
    (`cleansession true`) and the hub sends the retained run again, so devices that
    reconnect to the leaf still find the run."""
    hub, leaf = sites[0], sites[2]
    coordinator, _ = _client(hub.address)
    coordinator.publish("fl/v1/f1/run", b"run", 1, retain=True).wait_for_publish(5)
    leaf.kill()
    leaf.start()
    _wait_for_bridges(hub.address, list(SITES[1:]))
    device, received = _client(leaf.address, "fl/v1/f1/run")
    assert received.get(timeout=10)[:2] == ("fl/v1/f1/run", b"run")
    _close(coordinator, device)
