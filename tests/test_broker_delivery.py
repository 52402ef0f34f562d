"""The embedded broker sends every message at QoS 0 and never waits for a client's PUBACK.

amqtt waits 5 s for the PUBACK of each QoS 1 delivery; a broker fanning out a large round
read them late and fell behind (64 agents all-to-all: 4.1x the algorithm's traffic, see
coordinator/broker.py `_deliver_at_qos0`). These clients never acknowledge anything
(`manual_ack`), and still receive every live, retained and will message, each at QoS 0:
nothing of theirs waits at the broker for an acknowledgement.
"""

from __future__ import annotations

import queue
import threading

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from protocol import BrokerAddress
from tests.conftest import BrokerProcess

WAIT_S = 5.0


def silent_client(
    address: BrokerAddress, name: str, will: str | None = None
) -> tuple[mqtt.Client, queue.Queue]:
    """A paho client that acknowledges nothing it receives; its queue of (topic, qos)."""
    received: queue.Queue[tuple[str, int]] = queue.Queue()
    connected = threading.Event()
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=name, manual_ack=True)
    if will is not None:
        client.will_set(will, b"gone", qos=1)
    client.on_connect = lambda *_: connected.set()
    client.on_message = lambda _c, _u, message: received.put((message.topic, message.qos))
    client.connect(address.host, address.port, keepalive=10)
    client.loop_start()
    assert connected.wait(WAIT_S), f"{name} did not connect"
    return client, received


def subscribe(client: mqtt.Client, topic_filter: str) -> list[int]:
    """Subscribe at QoS 1; the QoS levels the broker granted."""
    granted: list[int] = []
    done = threading.Event()

    def on_subscribe(_c: object, _u: object, _mid: int, reasons: list, _p: object) -> None:
        granted.extend(reason.value for reason in reasons)
        done.set()

    client.on_subscribe = on_subscribe
    client.subscribe(topic_filter, qos=1)
    assert done.wait(WAIT_S), "no SUBACK"
    return granted


def take(received: queue.Queue, count: int) -> list[tuple[str, int]]:
    return [received.get(timeout=WAIT_S) for _ in range(count)]


def test_every_delivery_goes_out_at_qos0_without_waiting_for_acks(
    amqtt_broker: BrokerProcess,
) -> None:
    address = amqtt_broker.address
    publisher, _ = silent_client(address, "publisher")
    publisher.publish("d/retained", b"kept", qos=1, retain=True).wait_for_publish(WAIT_S)
    doomed, _ = silent_client(address, "doomed", will="d/will")

    listener, received = silent_client(address, "listener")
    assert subscribe(listener, "d/#") == [0]
    assert take(received, 1) == [("d/retained", 0)]
    for index in range(50):
        publisher.publish(f"d/live/{index}", bytes(1000), qos=1).wait_for_publish(WAIT_S)
    assert take(received, 50) == [(f"d/live/{index}", 0) for index in range(50)]
    doomed.loop_stop()
    lost = doomed.socket()
    assert lost is not None
    lost.close()  # a lost connection: the broker publishes the will
    assert take(received, 1) == [("d/will", 0)]
    for client in (publisher, listener):
        client.disconnect()
        client.loop_stop()
