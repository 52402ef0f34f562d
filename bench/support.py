"""What the benchmarks share: the machine they ran on, JSON written whole, a broker for an
emulated fleet, round ends from the agents' logs, and a watch on the fleet's memory."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import platform
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import psutil

from protocol import BrokerAddress

if TYPE_CHECKING:
    from coordinator.emulate import Emulation


def environment() -> dict[str, Any]:
    """The machine and versions a result was measured on."""
    import torch

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    if hasattr(os, "getloadavg"):
        env["loadavg"] = list(os.getloadavg())
    return env


def seeds(spec: str) -> list[int]:
    """`--seeds`: a list (1,2,3) or a range (1-10)."""
    try:
        if "-" in spec:
            first, last = (int(x) for x in spec.split("-"))
            return list(range(first, last + 1))
        return [int(x) for x in spec.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 1,2,3 or 1-10, got {spec!r}") from None


def write_json(path: pathlib.Path, data: Any) -> None:
    """Write atomically, so an interrupted run never leaves half a result file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


# ------------------------------------------------------------------------ fleets


@contextlib.contextmanager
def broker(spec: str, workdir: pathlib.Path) -> Iterator[BrokerAddress]:
    """A broker for an emulated fleet: `embedded` (amqtt in this process, what `coordinator
    emulate` starts), `mosquitto` (a child process on a free loopback port) or HOST:PORT."""
    from coordinator.broker import EmbeddedBroker
    from coordinator.ports import free_port

    if spec == "embedded":
        with EmbeddedBroker(host="127.0.0.1", port=free_port()) as embedded:
            yield embedded.address
        return
    if spec != "mosquitto":
        yield BrokerAddress.parse(spec)
        return
    binary = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    port = free_port()
    config = workdir / "mosquitto.conf"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n")
    process = subprocess.Popen([binary, "-c", str(config)], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError(f"mosquitto did not start on port {port}")
            time.sleep(0.05)
        yield BrokerAddress("127.0.0.1", port)
    finally:
        process.terminate()
        process.wait(10)


def fleet_round_ends(workdir: pathlib.Path, roster: list[str]) -> dict[int, float]:
    """Round -> the time (epoch seconds) the last agent finished it, from the round logs."""
    from agent.runtime import checkpoint

    ends: dict[int, float] = {}
    for agent_id in roster:
        for log in (workdir / agent_id / "runs").glob("*/rounds.jsonl"):
            for round_, record in checkpoint.read_records(log).items():
                ends[round_] = max(ends.get(round_, 0.0), record["finished_at"])
    return ends


def steady_round_s(ends: dict[int, float]) -> float | None:
    """Seconds per round after the first: (end of the last round - end of the first) / rounds
    between. Start-up (process start, imports, connecting) lands in round 1, not here."""
    if len(ends) < 2:
        return None
    first, last = min(ends), max(ends)
    return (ends[last] - ends[first]) / (last - first)


class MemoryWatch(threading.Thread):
    """Peak machine memory in use, and peak summed USS of the emulation's agent processes
    (each process once, however many agents it runs)."""

    def __init__(self, emulation: Emulation, period_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.emulation, self.period_s = emulation, period_s
        self.baseline = psutil.virtual_memory().used
        self.peak_used = self.baseline
        self.peak_uss = 0
        self.done = threading.Event()

    def run(self) -> None:
        handles: dict[int, psutil.Process] = {}
        while not self.done.wait(self.period_s):
            self.peak_used = max(self.peak_used, psutil.virtual_memory().used)
            uss = 0
            for pid in {p.pid for p in list(self.emulation.processes.values())}:
                try:
                    uss += handles.setdefault(pid, psutil.Process(pid)).memory_full_info().uss
                except psutil.Error:
                    continue
            self.peak_uss = max(self.peak_uss, uss)
