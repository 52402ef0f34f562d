"""The embedded broker closes a connection that announces a packet over its limit, before it
reads the packet's body: amqtt read any packet whole into memory (three 200 MiB publishes
took `coordinator serve` from 247 to 1,775 MiB), so one client could exhaust a gateway."""

from __future__ import annotations

import socket
import struct

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from coordinator.broker_config import MAX_PACKET_BYTES
from protocol import BrokerAddress
from tests.test_broker_delivery import silent_client, subscribe, take

CONNECT = bytes([0x10, 16, 0, 4]) + b"MQTT" + bytes([4, 2, 0, 30, 0, 4]) + b"huge"


def remaining_length(length: int) -> bytes:
    """MQTT's variable-length encoding of a packet's length."""
    encoded = bytearray()
    while True:
        length, digit = divmod(length, 128)
        encoded.append(digit | (0x80 if length else 0))
        if not length:
            return bytes(encoded)


def closed_before(sock: socket.socket, body_bytes: int) -> bool:
    """Whether the broker drops the connection before `body_bytes` of the body are sent."""
    sent = 0
    block = b"\0" * 65536
    try:
        while sent < body_bytes:
            sock.sendall(block)
            sent += len(block)
        sock.settimeout(3.0)
        return sock.recv(1) == b""
    except (BrokenPipeError, ConnectionResetError):
        return True
    except TimeoutError:
        return False


def test_a_packet_over_the_limit_closes_its_connection_unread(
    embedded_address: BrokerAddress,
) -> None:
    declared = 200 * 2**20
    with socket.create_connection((embedded_address.host, embedded_address.port)) as sock:
        sock.sendall(CONNECT)
        assert sock.recv(4) == bytes([0x20, 2, 0, 0])  # CONNACK, accepted
        topic = b"fl/v1/lab/status/x"
        sock.sendall(bytes([0x31]) + remaining_length(declared) + struct.pack("!H", len(topic)))
        sock.sendall(topic)
        assert closed_before(sock, 8 * 2**20), "the broker kept reading a 200 MiB packet"


def test_packets_up_to_the_limit_still_pass(embedded_address: BrokerAddress) -> None:
    receiver, received = silent_client(embedded_address, "receiver")
    subscribe(receiver, "big/#")
    sender = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="sender")
    sender.connect(embedded_address.host, embedded_address.port)
    sender.loop_start()
    try:
        payload = b"x" * (MAX_PACKET_BYTES - 64)
        sender.publish("big/one", payload, qos=1).wait_for_publish(5.0)
        assert take(received, 1) == [("big/one", 0)]
    finally:
        sender.loop_stop()
        sender.disconnect()
        receiver.loop_stop()
        receiver.disconnect()
