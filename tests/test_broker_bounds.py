"""The embedded broker under floods, as a stranger on the LAN and a member would send them.

A real broker process (`python -m coordinator.broker` with a `broker-config` folder) runs
under `ulimit -n 1024`, the soft limit a gateway's shell leaves; strangers connect from other
loopback addresses (127.0.0.2 and up) than the member that must still get through. Each test
holds what `coordinator.broker_limits` states: descriptors, memory, the CONNECT timeout, the
retained store, and a log that a flood cannot fill.
"""

from __future__ import annotations

import contextlib
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import paho.mqtt.client as mqtt
import psutil
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from coordinator.broker import EmbeddedBroker
from coordinator.broker_limits import MIB, RESERVED_FDS, BrokerBounds
from coordinator.gateway_tls import broker_certificate, gateway_names
from protocol import BrokerAddress, topics
from tests.conftest import REPO, _unused_port
from tests.processes import Processes
from tests.test_broker_acl import FLEET, Client, configure
from tests.test_broker_packet_size import remaining_length

FD_LIMIT = 1024
BOUNDS = BrokerBounds()
LOG_LIMIT_BYTES = 64 * 1024


@dataclass
class Gateway:
    address: BrokerAddress
    process: psutil.Process
    passwords: dict[str, str]
    log: Path

    def fds(self) -> int:
        return self.process.num_fds()

    def rss(self) -> int:
        return self.process.memory_info().rss

    def member_gets_through(self) -> None:
        """a1 logs in, and the gateway's login sees what it publishes, within 5 s each."""
        watcher = Client(self.address, "gateway", self.passwords["gateway"], retry=False)
        agent = Client(self.address, "a1", self.passwords["a1"], retry=False)
        try:
            assert watcher.accepted and agent.accepted, (watcher.reason, agent.reason)
            watcher.subscribe(topics.status(FLEET, "a1"))
            agent.publish(topics.status(FLEET, "a1"), b"alive")
            assert watcher.received.get(timeout=5)[1] == b"alive"
        finally:
            watcher.close()
            agent.close()


def _limit_descriptors() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Gateway]:
    port, folder = _unused_port(), tmp_path / "auth"
    passwords = configure(folder, port)
    log = tmp_path / "broker.log"
    command = [sys.executable, "-m", "coordinator.broker", "--port", str(port)]
    command += ["--auth", str(folder)]
    with open(log, "wb") as out:
        child = subprocess.Popen(
            command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_limit_descriptors
        )
    try:
        deadline = time.monotonic() + 20
        while "ready" not in log.read_text():
            assert child.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        yield Gateway(BrokerAddress("127.0.0.1", port), psutil.Process(child.pid), passwords, log)
    finally:
        child.kill()
        child.wait(10)
    assert log.stat().st_size < LOG_LIMIT_BYTES, f"log of {log.stat().st_size} bytes"


_FLOODER = """
import selectors, socket, sys, time
host, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
first, wait_s = bytes.fromhex(sys.argv[4]), float(sys.argv[5])
sockets = []
for n in range(count):
    sock = socket.socket()
    sock.bind((f"127.0.0.{2 + n // 50}", 0))
    sock.settimeout(2)
    try:
        sock.connect((host, port))
        if first:
            sock.sendall(first)
    except OSError:
        sock.close()
        continue
    sockets.append(sock)
print("opened", len(sockets), flush=True)
selector = selectors.DefaultSelector()
for sock in sockets:
    sock.setblocking(False)
    selector.register(sock, selectors.EVENT_READ)
closed, deadline = 0, time.monotonic() + wait_s
while closed < len(sockets) and (left := deadline - time.monotonic()) > 0:
    for key, _ in selector.select(min(left, 0.5)):
        try:
            data = key.fileobj.recv(1024)
        except OSError:
            data = b""
        if not data:
            closed += 1
            selector.unregister(key.fileobj)
print("closed", closed, flush=True)
"""


def partial_connect(announced: int) -> bytes:
    """The start of a CONNECT packet announcing `announced` bytes: its fixed header and the
    protocol name, and nothing more."""
    return bytes([0x10]) + remaining_length(announced) + b"\x00\x04MQTT\x04\x02\x00\x1e"


class Flood:
    """`count` connections from 127.0.0.2 and up (50 an address), each sending `first` and
    then nothing, held by a process of their own (as a stranger on the LAN would: and a
    client's `select` takes no descriptor past 1024)."""

    def __init__(
        self, processes: Processes, address: BrokerAddress, count: int, first: bytes, wait_s: float
    ) -> None:
        command = [sys.executable, "-c", _FLOODER, address.host, str(address.port)]
        self.process = processes.popen(
            [*command, str(count), first.hex() or "", str(wait_s)],
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=_many_descriptors,
        )
        assert self.process.stdout is not None
        self.opened = int(self.process.stdout.readline().split()[1])

    def closed_by_broker(self) -> int:
        """How many of the connections the broker closed (EOF or reset) within `wait_s`."""
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        self.process.wait(10)
        return int(line.split()[1])


def _many_descriptors() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))


def test_idle_connections_cannot_take_the_descriptors_and_are_closed_after_the_timeout(
    gateway: Gateway, processes: Processes
) -> None:
    before = gateway.fds()
    flood = Flood(processes, gateway.address, 1100, b"", BOUNDS.connect_timeout_s + 5)
    time.sleep(1)
    held = gateway.fds() - before
    assert held <= BOUNDS.pending + 8, f"{held} descriptors held by strangers"
    assert gateway.fds() < FD_LIMIT - RESERVED_FDS
    gateway.member_gets_through()
    # Those past the bounds were closed at once; the rest at the CONNECT timeout.
    assert flood.closed_by_broker() == flood.opened == 1100
    assert gateway.fds() <= before + 8


def test_huge_or_slow_connects_are_cut_and_cost_little_memory(
    gateway: Gateway, processes: Processes
) -> None:
    before_rss = gateway.rss()
    five_fields = partial_connect(5 * 65_540)  # five 64 KB fields
    huge = Flood(processes, gateway.address, 300, five_fields, 3)
    assert huge.closed_by_broker() == huge.opened, "a CONNECT over the bound was read"
    wait_s = BOUNDS.connect_timeout_s + 5
    slow = Flood(processes, gateway.address, 300, partial_connect(2000), wait_s)
    gateway.member_gets_through()
    grown = gateway.rss() - before_rss
    assert grown < 40 * MIB, f"grew {grown / MIB:.0f} MiB"
    assert slow.closed_by_broker() == slow.opened == 300


def test_probes_that_connect_and_close_leave_no_socket_behind(gateway: Gateway) -> None:
    before = gateway.fds()
    for n in range(2500):
        with contextlib.suppress(OSError):
            socket.create_connection((gateway.address.host, gateway.address.port), 2).close()
        if n % 500 == 499:
            time.sleep(0.2)
    deadline = time.monotonic() + 3
    while gateway.fds() > before + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    waiting = [c for c in gateway.process.net_connections() if c.status == psutil.CONN_CLOSE_WAIT]
    assert not waiting, f"{len(waiting)} sockets left in CLOSE-WAIT"
    assert gateway.fds() <= before + 2
    gateway.member_gets_through()


def retained_on(address: BrokerAddress, password: str, topic_filter: str) -> int:
    """How many retained messages a new subscriber to `topic_filter` receives."""
    reader = Client(address, "gateway", password, retry=False)
    try:
        reader.subscribe(topic_filter)
        count = 0
        with contextlib.suppress(Exception):
            while True:
                reader.received.get(timeout=3)
                count += 1
        return count
    finally:
        reader.close()


def test_a_member_cannot_fill_the_retained_store(gateway: Gateway) -> None:
    before_rss = gateway.rss()
    member = Client(gateway.address, "a1", gateway.passwords["a1"], retry=False)
    try:
        member.publish(topics.presence(FLEET, "a1"), b"birth", retain=True)
        member.publish(topics.round_topic(FLEET, 1, "vote", "a1"), b"v", retain=True)
        big = b"m" * 1_000_000
        for round_ in range(90):  # 90 MB: past the member's 64 MiB
            member.publish(topics.layer(FLEET, round_, "a1", 0), big, retain=True)
    finally:
        member.close()
    password = gateway.passwords["gateway"]
    kept = retained_on(gateway.address, password, topics.layer(FLEET, "+", "a1", "+"))
    assert 60 <= kept <= BOUNDS.retained_bytes_per_member // len(big)
    assert retained_on(gateway.address, password, topics.round_topic(FLEET, "+", "vote")) == 0
    assert retained_on(gateway.address, password, topics.presence(FLEET, "a1")) == 1
    grown = gateway.rss() - before_rss
    assert grown < BOUNDS.retained_bytes_per_member + 48 * MIB, f"grew {grown / MIB:.0f} MiB"
    assert grown <= BOUNDS.memory_bound(members=3)
    gateway.member_gets_through()


def test_tls_listener_takes_only_tls_and_bounds_stalled_handshakes(
    tmp_path: Path, processes: Processes
) -> None:
    """Beyond loopback the broker speaks TLS only (issue 46): a plain CONNECT to its TLS port
    is closed unanswered, a handshake that never comes is closed at the CONNECT timeout
    (asyncio alone would wait 60 s, outside any count), and a member with the gateway's CA
    logs in meanwhile."""
    port, tls_port = _unused_port(), _unused_port()
    passwords = configure(tmp_path / "auth", port)
    certificate = broker_certificate(tmp_path / "gw", gateway_names())
    broker = EmbeddedBroker(port=port, auth=tmp_path / "auth", tls=certificate, tls_port=tls_port)
    with broker:
        assert broker.address == BrokerAddress("127.0.0.1", port)
        tls_address = broker.tls_address
        assert tls_address == BrokerAddress("127.0.0.1", tls_port)
        plain = Flood(processes, tls_address, 20, partial_connect(12), 3)
        assert plain.closed_by_broker() == plain.opened == 20
        stalled = Flood(processes, tls_address, 300, b"", BOUNDS.connect_timeout_s + 5)
        ready = threading.Event()
        client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="tls-member")
        client.username_pw_set("a1", passwords["a1"])
        client.tls_set(ca_certs=str(certificate.ca))
        client.on_connect = lambda *args: ready.set() if not args[3].is_failure else None
        client.connect(tls_address.host, tls_address.port, keepalive=10)
        client.loop_start()
        try:
            assert ready.wait(5), "a member over TLS did not get in during the flood"
        finally:
            client.disconnect()
            client.loop_stop()
        assert stalled.closed_by_broker() == stalled.opened == 300
