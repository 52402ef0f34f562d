"""The embedded broker's CPU per published message, by payload size and number of receivers.

    python -m bench.broker_cost [--messages 300] [--out bench/results/broker_cost.json]

Each case starts an `EmbeddedBroker` on loopback, connects `receivers` paho clients (each
subscribed to the bench's topics and, as a fleet's agents are, to 5 filters that never match)
and one publisher, then publishes `--messages` messages of the payload size at QoS 1, each
only once the previous one reached every receiver. What is measured is the CPU time of the
broker's thread alone (its own thread clock), per published message: `amqtt` is amqtt's own
fan-out (`Broker._run_broadcast`), `edgefl` is the one `coordinator.broker` runs.

amqtt's fan-out builds a debug string of every message it sends on, payload included,
whether debug logging is on or not; `edgefl`'s leaves that out and keeps amqtt's rules.
Measured here (2 cores, Python 3.11, amqtt 0.12.1, 300 messages a case; the 1 kB rows move
by about 10 % from run to run):

    payload               receivers   amqtt   edgefl   saved
    status, 1 kB                  1   0.215    0.190     12%
    status, 1 kB                  8   0.513    0.534     -4%
    mnist1d model, 34 kB          1   0.437    0.218     50%
    mnist1d model, 34 kB          8   0.796    0.502     37%
    frame, 256 kB                 1   2.960    0.320     89%
    frame, 256 kB                 8   3.594    0.873     76%

A 44 MB ResNet-18 model (170 frames) cost the broker 0.50 s of CPU to pass on to one
receiver; now 0.05 s.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import paho.mqtt.client as mqtt
from amqtt.broker import Broker
from rich.console import Console
from rich.table import Table

from bench.support import environment, write_json
from coordinator import broker as embedded
from coordinator.ports import free_port

ROOT = pathlib.Path(__file__).resolve().parents[1]

SIZES = {"status, 1 kB": 1_000, "mnist1d model, 34 kB": 34_000, "frame, 256 kB": 256 * 1024}
"""A status; the CNN of the README's main job; one frame of a model larger than a frame
(`protocol.chunking.DEFAULT_CHUNK_SIZE`: a 44 MB ResNet-18 goes out in 170 of them)."""
RECEIVERS = (1, 8)
IDLE_FILTERS = 5
"""Filters each receiver holds that no bench message matches (an agent holds several)."""
FAN_OUTS = {"amqtt": Broker._run_broadcast, "edgefl": embedded._FleetBroker._run_broadcast}


@contextlib.contextmanager
def fan_out(name: str) -> Iterator[None]:
    """Run the broker with fan-out `name` (`FAN_OUTS`), then put edgefl's back."""
    embedded._FleetBroker._run_broadcast = FAN_OUTS[name]  # type: ignore[method-assign]
    try:
        yield
    finally:
        embedded._FleetBroker._run_broadcast = FAN_OUTS["edgefl"]  # type: ignore[method-assign]


def client(address: Any, name: str) -> mqtt.Client:
    paho = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=name)
    paho.connect(address.host, address.port)
    paho.loop_start()
    return paho


def broker_cpu_s() -> float:
    """CPU seconds of the embedded broker's thread so far."""
    (thread,) = [t for t in threading.enumerate() if t.name.startswith("amqtt-broker")]
    assert thread.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def measure(name: str, size: int, receivers: int, messages: int) -> dict[str, Any]:
    """Broker CPU ms per published message for one case."""
    payload = os.urandom(size)
    delivered = threading.Semaphore(0)
    with fan_out(name), embedded.EmbeddedBroker(host="127.0.0.1", port=free_port()) as broker:
        clients = []
        for k in range(receivers):
            receiver = client(broker.address, f"receiver-{k}")
            receiver.on_message = lambda *_: delivered.release()
            receiver.subscribe("bench/#", 1)
            for f in range(IDLE_FILTERS):
                receiver.subscribe(f"idle/{k}/{f}/+", 1)
            clients.append(receiver)
        publisher = client(broker.address, "publisher")
        clients.append(publisher)
        time.sleep(0.5)  # the subscriptions are in place
        started = broker_cpu_s()
        for n in range(messages):
            publisher.publish(f"bench/{n}", payload, qos=1).wait_for_publish(10)
            for _ in range(receivers):
                if not delivered.acquire(timeout=10):
                    raise RuntimeError(f"{name}: a message did not reach every receiver")
        spent = broker_cpu_s() - started
        for paho in clients:
            paho.disconnect()
            paho.loop_stop()
    return {
        "fan_out": name,
        "bytes": size,
        "receivers": receivers,
        "messages": messages,
        "broker_cpu_ms_per_message": 1000 * spent / messages,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=300)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench/results/broker_cost.json")
    args = parser.parse_args()
    table = Table(title="embedded broker: CPU ms per published message")
    for column in ("payload", "receivers", *FAN_OUTS, "saved"):
        table.add_column(column, justify="right")
    rows: list[dict[str, Any]] = []
    for label, size in SIZES.items():
        for receivers in RECEIVERS:
            case = {name: measure(name, size, receivers, args.messages) for name in FAN_OUTS}
            rows.extend(case.values())
            ms = {name: row["broker_cpu_ms_per_message"] for name, row in case.items()}
            saved = 1 - ms["edgefl"] / ms["amqtt"]
            cells = [f"{ms[name]:.3f}" for name in FAN_OUTS]
            table.add_row(label, str(receivers), *cells, f"{saved:.0%}")
    Console().print(table)
    write_json(args.out, {"machine": environment(), "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
