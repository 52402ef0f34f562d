"""A subscriber gets only the retained messages that match its own filters, on both brokers.

amqtt 0.12.1 sent a connecting client the retained messages of every filter any client held:
a plain paho client that subscribed to one topic also received the coordinator's presence."""

from __future__ import annotations

import queue
import threading
import time

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from protocol import BrokerAddress, topics
from tests.conftest import BrokerProcess

FLEET = "f1"


def connect(address: BrokerAddress, name: str) -> tuple[mqtt.Client, queue.Queue[str]]:
    """A plain paho client, connected, with the queue of topics it receives."""
    received: queue.Queue[str] = queue.Queue()
    connected = threading.Event()
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=name)
    client.on_connect = lambda *_: connected.set()
    client.on_message = lambda _c, _u, message: received.put(message.topic)
    client.connect(address.host, address.port, keepalive=10)
    client.loop_start()
    assert connected.wait(5), f"{name} did not connect"
    return client, received


def subscribe(client: mqtt.Client, topic_filter: str) -> None:
    done = threading.Event()
    client.on_subscribe = lambda *_: done.set()
    client.subscribe(topic_filter, qos=1)
    assert done.wait(5), "no SUBACK"


def received_within(received: queue.Queue[str], seconds: float) -> list[str]:
    deadline, topics_seen = time.monotonic() + seconds, []
    while (left := deadline - time.monotonic()) > 0:
        try:
            topics_seen.append(received.get(timeout=left))
        except queue.Empty:
            break
    return topics_seen


def test_subscriber_gets_only_the_retained_messages_it_asked_for(broker: BrokerProcess) -> None:
    wanted = topics.status(FLEET, "a2")
    others = [topics.presence(FLEET, "coordinator"), topics.run(FLEET), topics.status("f2", "a2")]
    publisher, _ = connect(broker.address, "publisher")
    for topic in [wanted, *others]:
        publisher.publish(topic, b"retained", qos=1, retain=True).wait_for_publish(5)
    # Another client holds filters that match every other retained topic.
    follower, _ = connect(broker.address, "follower")
    for topic_filter in (topics.presence(FLEET), topics.run(FLEET), "fl/v1/#"):
        subscribe(follower, topic_filter)

    idle, idle_received = connect(broker.address, "idle")  # subscribes to nothing
    plain, plain_received = connect(broker.address, "plain")
    subscribe(plain, wanted)
    assert received_within(plain_received, 1.5) == [wanted]
    assert received_within(idle_received, 0.1) == []
    for client in (publisher, follower, idle, plain):
        client.disconnect()
        client.loop_stop()
