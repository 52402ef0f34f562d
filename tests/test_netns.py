"""The namespace LAN harness carries what multi-host acceptance tests rely on: MQTT to the
gateway's broker, mDNS between hosts, unplugging a device, and leaving nothing behind."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from netns import PREFIX, Lan, list_namespaces, skip_unless_netns

pytestmark = pytest.mark.timeout(60)

BROKER_PORT = 1883

_MQTT_ROUND_TRIP = """
import sys, threading
from protocol import BrokerAddress
from protocol.mqtt import MqttTransport
received = threading.Event()
with MqttTransport(BrokerAddress(sys.argv[1], 1883)) as transport:
    transport.subscribe("netns/smoke", lambda topic, payload: received.set())
    if not transport.wait_subscribed(10):
        sys.exit("not subscribed")
    transport.publish("netns/smoke", b"hello")
    sys.exit(0 if received.wait(10) else "own message not received")
"""

_ADVERTISE = """
import sys, threading
from protocol.discovery import Discovery
Discovery([sys.argv[1]]).advertise_broker(sys.argv[1], 1883)
print("advertised", flush=True)
threading.Event().wait()
"""

_BROWSE = """
import sys, time
from protocol.discovery import Discovery
with Discovery([sys.argv[1]]) as discovery:
    deadline = time.monotonic() + 10
    while (sys.argv[2], 1883) not in discovery.brokers() and time.monotonic() < deadline:
        time.sleep(0.1)
    print(discovery.brokers())
    sys.exit(0 if (sys.argv[2], 1883) in discovery.brokers() else 1)
"""


@pytest.fixture(scope="module")
def lan(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lan]:
    """gw runs the embedded broker on its LAN address; d1 and d2 are devices."""
    skip_unless_netns()
    log = tmp_path_factory.mktemp("netns") / "broker.log"
    with Lan(["gw", "d1", "d2"]) as lan:
        broker = [sys.executable, "-m", "coordinator.broker", "--host", "0.0.0.0"]
        lan.popen("gw", broker + ["--port", str(BROKER_PORT)], log=log)
        if not lan.reachable("d1", lan.address("gw"), BROKER_PORT, timeout_s=15):
            pytest.fail(f"broker in gw not reachable from d1:\n{log.read_text()[-3000:]}")
        yield lan


def _python(lan: Lan, host: str, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return lan.run(host, [sys.executable, "-c", script, *args], timeout=20)


def test_device_reaches_gateway_broker_over_mqtt(lan: Lan) -> None:
    result = _python(lan, "d1", _MQTT_ROUND_TRIP, lan.address("gw"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_each_host_has_its_own_loopback_and_no_way_out(lan: Lan) -> None:
    # The broker listens on every interface of gw, yet d1's 127.0.0.1 is d1's own.
    assert lan.reachable("gw", "127.0.0.1", BROKER_PORT, timeout_s=5)
    assert not lan.reachable("d1", "127.0.0.1", BROKER_PORT, timeout_s=0.5)
    # No default route: an address off the LAN (TEST-NET-1) is unreachable at once.
    assert not lan.reachable("d1", "192.0.2.1", 80, timeout_s=0.5)


def test_mdns_finds_the_gateway_broker_from_another_host(lan: Lan, tmp_path: Path) -> None:
    gw, d2 = lan.address("gw"), lan.address("d2")
    log = tmp_path / "advertise.log"
    advertiser = lan.popen("gw", [sys.executable, "-c", _ADVERTISE, gw], log=log)
    try:
        result = _python(lan, "d2", _BROWSE, d2, gw)
        assert result.returncode == 0, result.stdout + result.stderr + log.read_text()
    finally:
        lan.kill(advertiser)


def test_unplugged_device_cannot_reach_gateway_until_plugged_back(lan: Lan) -> None:
    gw = lan.address("gw")
    lan.link("d1", False)
    try:
        assert not lan.reachable("d1", gw, BROKER_PORT, timeout_s=2)
        assert lan.reachable("d2", gw, BROKER_PORT, timeout_s=2), "other devices stay on"
    finally:
        lan.link("d1", True)
    assert lan.reachable("d1", gw, BROKER_PORT, timeout_s=5)
    routes = lan.run("d1", ["ip", "route"], timeout=5).stdout
    assert "224.0.0.0/4 dev eth0" in routes, "the multicast route survives"


def test_exit_removes_namespaces_and_processes_even_after_an_error(tmp_path: Path) -> None:
    skip_unless_netns()
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    with pytest.raises(RuntimeError, match="boom"), Lan(["a", "b"]) as lan:
        names = [lan.switch, *lan.namespaces.values()]
        assert set(names) <= set(list_namespaces())
        process = lan.popen("a", sleeper, log=tmp_path / "sleep.log")
        raise RuntimeError("boom")
    assert not set(names) & set(list_namespaces())
    assert process.poll() is not None
    lan.close()  # idempotent


def test_leftovers_of_a_dead_run_are_removed_but_not_those_of_live_ones() -> None:
    skip_unless_netns()
    finished = subprocess.Popen([sys.executable, "-c", ""])
    finished.wait(60)
    dead, live = f"{PREFIX}-{finished.pid}-abc123-d1", f"{PREFIX}-1-abc123-d1"
    for name in (dead, live):
        subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    try:
        with Lan(["a"]):
            assert dead not in list_namespaces()
            assert live in list_namespaces(), "pid 1 is alive: its namespace is not ours"
    finally:
        for name in set(list_namespaces()) & {dead, live}:
            subprocess.run(["ip", "netns", "del", name], check=True, timeout=30)


def test_bad_arguments_are_rejected_before_anything_is_created() -> None:
    with pytest.raises(ValueError, match="unique"):
        Lan(["a", "a"])
    with pytest.raises(ValueError, match="IPv4"):
        Lan(["a"], subnet="fd00::/64")
    with pytest.raises(ValueError, match="fewer than 3"):
        Lan(["a", "b", "c"], subnet="10.0.0.0/30")
