"""The gateway's memory under a chunk flood: a real `coordinator serve --http` process on its
embedded broker, flooded by an anonymous client with first chunks that declare huge messages
on the fleet's status topics, grows by no more than its stated bound and still shows the
fleet.

Every connection serve opens follows the fleet under `FOLLOWER_LIMITS`: a first chunk that
declares more than one frame's worth is refused on its header, and what a flood can park in
partial reassembly and the delivery queue is `held_bytes` per connection. serve has two (its
own and the dashboard's feed). Before, they took the default limits (512 MiB of partial
reassembly each) and kept what such a flood sent: 440 MiB of this one's 208 MiB (2 cores,
embedded broker), where the follower limits keep 21-41 MiB (23 MiB of three times the flood:
the allocator's arenas that frames passed through, not the flood's size).

Also here: what the coordinator keeps per sender stops at the fleet's size (`MAX_MEMBERS`
members followed) and at the run's rounds, and a centralized run raises its limits to the
run's models only while it lasts.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import msgpack
import paho.mqtt.client as paho
import psutil
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from agent.experiment import ExperimentConfig
from agent.learning import preset
from agent.report import AgentRound
from coordinator.broker_config import MAX_PACKET_BYTES
from coordinator.conductor import Conductor
from coordinator.watch import FleetFeed
from protocol import BrokerAddress, messages, topics
from protocol.chunking import MAGIC
from protocol.limits import FOLLOWER_LIMITS, MAX_MEMBERS, MIB, Limits, held_bytes
from protocol.membership import Identity, connect, leave
from tests.processes import Processes, wait_for_text
from tests.test_cli import COORDINATOR

FLEET = "default"
CONNECTIONS = 2
"""serve's connections that read the fleet: its own and the dashboard's feed."""
SLACK = 24 * MIB
"""The allocator's and the interpreter's own: arenas that frames passed through, caches."""
BOUND = CONNECTIONS * held_bytes(FOLLOWER_LIMITS) + SLACK
HUGE_FRAMES = 160
"""First chunks just under the broker's packet limit (1 MiB) declaring 512 MiB each: 160 MiB
sent, all kept under the old default limits."""
NEAR_LIMIT_FRAMES = 64
"""First chunks of 256 KiB declaring just under the message limit: buffered, then evicted."""


def first_chunk(total: int, chunk_size: int) -> bytes:
    """The first chunk of a message declaring `total` bytes; no other chunk ever comes."""
    count = -(-total // chunk_size)
    digest = hashlib.sha256(os.urandom(8)).digest()
    header = [MAGIC, 1, os.urandom(16), 0, count, chunk_size, total, digest]
    return msgpack.packb(header) + os.urandom(chunk_size)


def fleet_on_dashboard(url: str) -> dict[str, dict]:
    with urllib.request.urlopen(f"{url}/api/fleet", timeout=5) as answer:
        return {row["agent"]: row for row in json.load(answer)["agents"]}


def wait_for_state(url: str, agent: str, state: str, timeout_s: float = 20.0) -> None:
    """Until the dashboard shows `agent` in `state` (what serve's feed read last)."""
    deadline = time.monotonic() + timeout_s
    while fleet_on_dashboard(url).get(agent, {}).get("state") != state:
        if time.monotonic() > deadline:
            raise AssertionError(f"the dashboard never showed {agent} {state}")
        time.sleep(0.2)


@pytest.fixture
def served(
    tmp_path: Path, unused_port: int, processes: Processes
) -> tuple[psutil.Process, int, str, Path]:
    """serve on its embedded broker with the dashboard: (its process, broker port, URL,
    its log)."""
    with socket.socket() as probe:  # the dashboard's port
        probe.bind(("127.0.0.1", 0))
        http = probe.getsockname()[1]
    log = tmp_path / "serve.log"
    serve = processes.spawn(
        [*COORDINATOR, "serve", "--host", "127.0.0.1", "--port", str(unused_port)]
        + ["--http", f"127.0.0.1:{http}"],
        log,
    )
    wait_for_text(log, "dashboard on", process=serve)
    return psutil.Process(serve.pid), unused_port, f"http://127.0.0.1:{http}", log


def flood(port: int) -> int:
    """Publish the chunk flood on the fleet's status topics (an agent name each, so no
    per-topic bound helps), every frame acknowledged; returns the bytes sent."""
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id="flooder")
    client.max_inflight_messages_set(8)
    client.connect("127.0.0.1", port)
    client.loop_start()
    frames = [first_chunk(512 * MIB, MAX_PACKET_BYTES - 4096) for _ in range(HUGE_FRAMES)]
    below = FOLLOWER_LIMITS.max_message_bytes - 1
    frames += [first_chunk(below, 256 * 1024) for _ in range(NEAR_LIMIT_FRAMES)]
    try:
        sent = [
            client.publish(topics.status(FLEET, f"x{n}"), frame, qos=1)
            for n, frame in enumerate(frames)
        ]
        for info in sent:
            info.wait_for_publish(30)
    finally:
        client.loop_stop()
        client.disconnect()
    return sum(map(len, frames))


def test_a_chunk_flood_leaves_the_gateway_within_its_bound(served) -> None:
    process, port, url, log = served
    member = Identity(FLEET, "d1")
    transport = connect(BrokerAddress("127.0.0.1", port), member, probe_s=0)

    def status(state: str) -> None:
        message = messages.Status(fleet=FLEET, sender="d1", state=state)
        topic = topics.status(FLEET, "d1")
        transport.publish(topic, messages.encode(message), retain=True).wait_for_publish(5)

    try:
        status("idle")
        wait_for_state(url, "d1", "idle")
        time.sleep(1.0)
        before = process.memory_info().rss
        sent = flood(port)
        status("training")  # after the flood: serve has read it all once this shows
        wait_for_state(url, "d1", "training", timeout_s=30)
        time.sleep(1.0)
        grown = process.memory_info().rss - before
        assert fleet_on_dashboard(url)["d1"]["online"]
        wait_for_text(log, f"{FLEET}/d1: online, training")  # serve's own connection
    finally:
        leave(transport, member)
    assert sent > 2 * BOUND
    assert grown <= BOUND, f"serve grew by {grown / MIB:.0f} MiB, its bound is {BOUND / MIB:.0f}"


# ---------------------------------------------------------------- state kept per sender


class Wire:
    """Stands in for a transport: keeps the handlers and the limits, takes publishes."""

    def __init__(self) -> None:
        self.handlers: dict[str, Callable[[str, bytes], None]] = {}

    def subscribe(self, topic_filter: str, handler: Callable[[str, bytes], None], qos=1) -> None:
        self.handlers[topic_filter] = handler

    def publish(self, topic: str, payload: bytes, **options: object) -> SimpleNamespace:
        return SimpleNamespace(wait_for_publish=lambda *_: True)

    def set_limits(self, limits: Limits) -> None:
        self.limits = limits

    connected = False
    limits = FOLLOWER_LIMITS


def status(sender: str, **fields: object) -> bytes:
    return messages.encode(messages.Status(fleet=FLEET, sender=sender, state="idle", **fields))


def test_a_follower_keeps_track_of_max_members_at_most() -> None:
    """Statuses under ever new names (anyone may publish them on an open broker) stop
    adding members at MAX_MEMBERS; the members followed still update."""
    wire = Wire()
    feed = FleetFeed(wire, FLEET, None)
    on_status = wire.handlers[topics.status(FLEET)]
    for n in range(MAX_MEMBERS + 3):
        on_status(topics.status(FLEET, f"a{n}"), status(f"a{n}"))
    on_status(topics.status(FLEET, "a0"), status("a0", round=5))
    entries = feed.entries()
    assert len(entries) == MAX_MEMBERS and feed.dropped == 3
    assert next(e for e in entries if e.agent == "a0").round == 5


def test_the_conductor_keeps_no_record_of_rounds_its_run_does_not_have() -> None:
    """A member's (or, in an unsigned fleet, anyone's) statuses for rounds beyond the run
    would each keep a record: the run's rounds are all there is to keep."""
    config = ExperimentConfig(
        dataset="digits", agents=3, learning=preset("dadpfl", rounds=2, neighbours=1)
    )
    wire = Wire()
    conductor = Conductor(
        fleet=FLEET, roster=["a", "b", "c"], config=config, transport=wire, run_id="r1"
    )
    conductor.start()
    try:
        on_status = wire.handlers[topics.status(FLEET)]
        record = AgentRound(1, "a", 0.5, loss=1.0, train_loss=1.0, sparsity=0.0).as_dict()
        for round_ in (1, 3, 10**9):
            payload = status("a", run_id="r1", round=round_, metrics={"record": record})
            on_status(topics.status(FLEET, "a"), payload)
        rows = [{**record, "round": r} for r in (2, 7, 10**6)]
        payload = status("b", run_id="r1", round=2, metrics={"records": rows})
        on_status(topics.status(FLEET, "b"), payload)
    finally:
        conductor.close(clear=False)
    records = conductor.records()
    assert list(records["a"]) == [1] and list(records["b"]) == [2]
    assert conductor.last_round() == 2


def test_a_centralized_run_raises_the_limits_for_its_models_and_only_while_it_lasts() -> None:
    config = ExperimentConfig(dataset="digits", agents=3, learning=preset("fedavg", rounds=2))
    wire = Wire()
    conductor = Conductor(
        fleet=FLEET, roster=["a", "b", "c"], config=config, transport=wire, run_id="r1"
    )
    conductor.start()
    try:
        during = wire.limits
    finally:
        conductor.close(clear=False)
    assert during.max_message_bytes > FOLLOWER_LIMITS.max_message_bytes
    assert wire.limits == FOLLOWER_LIMITS
