"""FedBuff under secure aggregation on real processes and a real broker (amqtt, loopback):
cohorts of K devices make the versions, every masked upload is noise, a device killed
mid-cohort does not stop its version, and a device that slept has its late update taken
with its staleness."""

from __future__ import annotations

import logging
import re
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from test_emulate import run_in_background

from agent.experiment import ExperimentConfig
from agent.learning import preset
from coordinator.emulate import Emulation, EmulationOptions
from coordinator.simulate import simulate
from protocol import MqttTransport, TransportOptions, messages, secagg, topics

pytestmark = pytest.mark.timeout(300)

APPLIED = re.compile(r"version (\d+) applied from (.*)")
EPOCHS = 20
"""Long enough that an update is mostly training: stopped right after it logged an update,
a device is caught in the middle of its next one, which it uploads late when it wakes."""


def config(agents: int, versions: int, epochs: int = 1, buffer_size: int = 3) -> ExperimentConfig:
    return ExperimentConfig(
        dataset="digits",
        agents=agents,
        seed=3,
        learning=preset(
            "fedbuff",
            rounds=versions,
            epochs=epochs,
            buffer_size=buffer_size,
            max_staleness=versions,
            secure_aggregation=True,
        ),
    )


def options(tmp_path: Path, round_timeout_s: float = 120.0) -> EmulationOptions:
    return EmulationOptions(
        tmp_path / "fleet", round_timeout_s=round_timeout_s, linger_s=5.0, run_timeout_s=240
    )


def applied(caplog: pytest.LogCaptureFixture) -> list[tuple[int, list[tuple[str, int]]]]:
    """Each version the coordinator applied, with (agent, staleness) of the updates it took."""
    out = []
    for record in caplog.records:
        if match := APPLIED.fullmatch(record.getMessage()):
            took = re.findall(r"(agent-\d+) \((\d+) stale\)", match.group(2))
            out.append((int(match.group(1)), [(k, int(s)) for k, s in took]))
    return out


def figures(report: dict, what: str) -> dict[tuple[int, str], float]:
    return {(r["round"], k): a[what] for r in report["rounds"] for k, a in r["agents"].items()}


def test_secure_cohorts_emulate_as_they_simulate_and_upload_only_noise(
    amqtt_broker, tmp_path: Path
) -> None:
    """Three devices, K = 3: every cohort is the whole fleet, each update trained from the
    last version, so the emulated run is the simulated one within quantization; the
    coordinator receives three masked vectors a version and no model."""
    cfg = config(agents=3, versions=4)
    uploads: list[bytes] = []
    emulation = Emulation(cfg, amqtt_broker.address, options(tmp_path))
    spy = MqttTransport(amqtt_broker.address, TransportOptions(client_id="spy"))
    spy.subscribe(
        topics.round_topic(emulation.fleet, "+", "masked"), lambda t, p: uploads.append(p)
    )
    spy.start()
    try:
        assert spy.wait_subscribed(20.0)
        emulated = emulation.run()
    finally:
        spy.stop()
    assert emulated["summary"]["failed_agents"] == {}
    roster = sorted(emulated["config"]["roster"])
    assert [r["participants"] for r in emulated["rounds"]] == [roster] * cfg.learning.rounds
    # The last version's record is each device's closing one (the newest version judged),
    # which simulate does not write: the versions before it compare.
    simulated = simulate(cfg)
    for what in ("loss", "staleness"):
        got, want = figures(emulated, what), figures(simulated, what)
        assert len(got) == len(want) == 3 * cfg.learning.rounds
        before = [key for key in want if key[0] < cfg.learning.rounds]
        assert [got[k] for k in before] == pytest.approx([want[k] for k in before], abs=1e-5)
    assert len(uploads) == 3 * cfg.learning.rounds
    for payload in uploads:
        message = messages.decode(payload)
        assert isinstance(message, messages.Masked)
        decoded = secagg.dequantize(np.frombuffer(message.values, dtype="<u4"))
        assert np.abs(decoded).mean() > 1.0  # a change of a model is ~1e-2; this is ~4


def test_a_device_killed_mid_cohort_does_not_stop_its_version_nor_the_next_ones(
    amqtt_broker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Of four devices (K = 4), the first member of cohort 2 to send its shares is killed
    then: its masks are removed with its key, rebuilt from the others' shares, and version
    2 is the other three members' mean (three survivors, the fewest a version takes). No
    later cohort can fill, so each closes a round timeout after its first member with the
    three left."""
    caplog.set_level(logging.INFO, logger="coordinator.buffered")
    cfg = config(agents=4, versions=4, buffer_size=4)
    emulation = Emulation(cfg, amqtt_broker.address, options(tmp_path, round_timeout_s=5))
    killed: list[str] = []

    def on_shares(topic: str, payload: bytes) -> None:
        fields = topics.parse(topic)[2]
        agent = fields["agent"]
        if fields["round"] == "2" and agent.startswith("agent-") and not killed:
            killed.append(agent)
            emulation.processes[agent].send_signal(signal.SIGKILL)

    spy = MqttTransport(amqtt_broker.address, TransportOptions(client_id="spy"))
    spy.subscribe(topics.round_topic(emulation.fleet, "+", "shares", "+", to="+"), on_shares)
    spy.start()
    try:
        assert spy.wait_subscribed(20.0)
        report = emulation.run()
    finally:
        spy.stop()
    assert len(killed) == 1
    assert report["summary"]["failed_agents"] == {killed[0]: -signal.SIGKILL}
    versions = applied(caplog)
    assert [v for v, _ in versions] == [1, 2, 3, 4]
    assert len(versions[0][1]) == 4
    left = sorted(set(emulation.roster) - set(killed))
    assert [sorted(k for k, _ in took) for _, took in versions[1:]] == [left] * 3


def test_a_sleeping_devices_late_update_is_taken_with_its_staleness(
    amqtt_broker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Of four devices (K = 3), one stopped (SIGSTOP) while it trains holds nobody back: the
    other three make versions; once it wakes, its update joins the next cohort, weighted
    by the versions it slept through."""
    caplog.set_level(logging.INFO, logger="coordinator.buffered")
    cfg = config(agents=4, versions=8, epochs=EPOCHS)
    # Should it be stopped once its keys are out, its cohort goes on without it after this.
    emulation = Emulation(cfg, amqtt_broker.address, options(tmp_path, round_timeout_s=30))
    stopped = threading.Event()

    def on_status(topic: str, payload: bytes) -> None:
        """Stop the sleeper on the status of its first update: its next one starts then."""
        message = messages.decode(payload)
        training = isinstance(message, messages.Status) and message.state == "training"
        if training and message.round >= 1 and not stopped.is_set():
            emulation.processes["agent-002"].send_signal(signal.SIGSTOP)
            stopped.set()

    spy = MqttTransport(amqtt_broker.address, TransportOptions(client_id="spy"))
    spy.subscribe(topics.status(emulation.fleet, "agent-002"), on_status)
    spy.start()
    thread, result = run_in_background(emulation)
    try:
        assert spy.wait_subscribed(20.0) and stopped.wait(120), "the sleeper never trained"
        try:
            slept_at = len(applied(caplog))
            deadline = time.monotonic() + 120
            while len(applied(caplog)) < slept_at + 3:
                assert time.monotonic() < deadline, "the fleet waited for the sleeping device"
                time.sleep(0.05)
        finally:
            emulation.processes["agent-002"].send_signal(signal.SIGCONT)
        thread.join(240)
        assert not thread.is_alive() and "error" not in result, result.get("error")
    finally:
        spy.stop()
        for process in emulation.processes.values():
            if process.poll() is None:
                process.kill()
        thread.join(60)
    versions = applied(caplog)
    assert [v for v, _ in versions] == list(range(1, 9))
    woke = [s for v, took in versions if v > slept_at + 3 for k, s in took if k == "agent-002"]
    assert woke and woke[0] >= 3, versions  # its update from before the nap, taken stale
    assert all(len({k for k, _ in took}) == 3 for _, took in versions)
    report = result["report"]
    assert report["summary"]["failed_agents"] == {}
