"""The telemetry mirror: a real two-agent run over an embedded broker, read back by a plain
MQTT client that knows nothing of msgpack, as mosquitto_sub or Node-RED would."""

from __future__ import annotations

import json
import math
import queue
import threading
import time
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
import pytest
from conftest import run_in_threads
from paho.mqtt.enums import CallbackAPIVersion

from agent.experiment import ExperimentConfig
from agent.learning import preset
from agent.runtime import AgentRuntime, Run, Timeouts, new_run_id
from agent.runtime.session import REPORT_ONLY, telemetry_json
from agent.workload import build_workload
from protocol import BrokerAddress, MqttTransport, TransportOptions, messages, topics

FLEET = "telemetry"
ROSTER = ("a", "b")
WAIT_S = 20.0

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def broker(embedded_address: BrokerAddress) -> BrokerAddress:
    return embedded_address


def run_fleet(address: BrokerAddress, tmp_path: Path, mirrored: set[str]) -> None:
    """Two agents of a two-round run, each on its own connection, in threads; those in
    `mirrored` are asked for telemetry, the others keep the default."""
    config = ExperimentConfig(
        dataset="mnist1d",
        agents=len(ROSTER),
        seed=3,
        learning=preset("dadpfl", rounds=2, neighbours=1, epochs=1, max_wait=1),
    )
    run = Run(new_run_id(), ROSTER, config)
    transports = {
        me: MqttTransport(address, TransportOptions(client_id=f"agent-{me}")) for me in ROSTER
    }
    runtimes = [
        AgentRuntime(
            agent_id=me,
            fleet=FLEET,
            run=run,
            workload=build_workload(config, list(ROSTER), agents=[me]),
            transport=transports[me],
            state_dir=tmp_path / me,
            timeouts=Timeouts(round_s=15.0, vote_s=15.0, linger_s=5.0),
            **({"telemetry": True} if me in mirrored else {}),
        )
        for me in ROSTER
    ]
    for transport in transports.values():
        transport.start()
        assert transport.wait_connected(WAIT_S)
    try:
        run_in_threads([runtime.run for runtime in runtimes])
    finally:
        for transport in transports.values():
            transport.stop()


def plain_subscriber(address: BrokerAddress, topic: str) -> tuple[paho.Client, queue.Queue]:
    """A bare paho client collecting (topic, payload, retained) on `topic`."""
    received: queue.Queue[tuple[str, bytes, bool]] = queue.Queue()
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"reader-{time.monotonic_ns()}")
    client.on_message = lambda _c, _u, m: received.put((m.topic, m.payload, m.retain))
    client.on_connect = lambda c, *_: c.subscribe(topic, qos=1)
    client.connect(address.host, address.port)
    client.loop_start()
    return client, received


def drain(received: queue.Queue, settle_s: float = 1.0) -> list[tuple[str, bytes, bool]]:
    """Everything that arrives until nothing has for `settle_s`."""
    items = []
    while True:
        try:
            items.append(received.get(timeout=settle_s))
        except queue.Empty:
            return items


def retained_statuses(address: BrokerAddress) -> dict[str, messages.Status]:
    """The fleet's retained statuses, read as the coordinator reads them (msgpack)."""
    found: dict[str, messages.Status] = {}
    lock = threading.Lock()

    def keep(topic: str, payload: bytes) -> None:
        message = messages.decode(payload)
        assert isinstance(message, messages.Status)
        with lock:
            found[message.sender] = message

    with MqttTransport(address) as transport:
        transport.subscribe(topics.status(FLEET), keep)
        assert transport.wait_subscribed(WAIT_S)
        time.sleep(1.0)
    return found


def test_an_agent_mirrors_every_status_as_json_only_when_asked(
    broker: BrokerAddress, tmp_path: Path
) -> None:
    live, received = plain_subscriber(broker, topics.telemetry(FLEET))
    try:
        time.sleep(0.5)  # subscribed before the run starts: every mirror, not just the last
        run_fleet(broker, tmp_path, mirrored={"a"})
        during = drain(received)
    finally:
        live.disconnect()
        live.loop_stop()
    assert {topic for topic, _, _ in during} == {topics.telemetry(FLEET, "a")}, "off by default"
    documents = [json.loads(payload.decode("utf-8")) for _, payload, _ in during]
    assert [(d["state"], d["round"]) for d in documents] == [
        ("ready", 0),
        ("training", 1),
        ("done", 2),
    ]

    later, retained = plain_subscriber(broker, topics.telemetry(FLEET))
    try:
        kept = drain(retained)
    finally:
        later.disconnect()
        later.loop_stop()
    # amqtt may hand a retained message to a new subscriber twice: the same one
    assert {(topic, payload, flag) for topic, payload, flag in kept} == {
        (topics.telemetry(FLEET, "a"), during[-1][1], True)
    }
    final = json.loads(kept[0][1])
    status = retained_statuses(broker)["a"]
    assert (final["fleet"], final["agent"], final["run_id"]) == (FLEET, "a", status.run_id)
    assert (final["round"], final["state"], final["stopped"]) == (2, "done", False)
    assert final["metrics"] == {k: v for k, v in status.metrics.items() if k not in REPORT_ONLY}
    assert len(status.metrics["records"]) == 2, "the final status repeats every round's record"
    assert final["metrics"]["accuracy"] == status.metrics["record"]["accuracy"]
    assert abs(final["time"] - time.time()) < 60


def test_non_finite_figures_become_null() -> None:
    status = messages.Status(
        fleet=FLEET,
        sender="a",
        round=3,
        state="training",
        metrics={"accuracy": math.nan, "t_star": None, "loss": [math.inf, 1.5], "record": {}},
    )
    document: dict[str, Any] = json.loads(telemetry_json(status, at=12.5))
    assert document == {
        "fleet": FLEET,
        "agent": "a",
        "run_id": "",
        "round": 3,
        "state": "training",
        "stopped": False,
        "time": 12.5,
        "metrics": {"accuracy": None, "t_star": None, "loss": [None, 1.5]},
    }
