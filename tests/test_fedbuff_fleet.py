"""FedBuff over MQTT with real processes on a real broker (amqtt, loopback): a device asleep
(SIGSTOP) holds nobody back and its late update is taken with its staleness once it wakes
(SIGCONT); a device gone for good (SIGKILL) never blocks; the run ends at the last version."""

from __future__ import annotations

import logging
import re
import signal
import time

import pytest
from test_emulate import run_in_background, wait_for_round

from agent.experiment import ExperimentConfig
from agent.learning import preset
from coordinator.emulate import Emulation, EmulationOptions

pytestmark = pytest.mark.timeout(600)

VERSIONS = 24
EPOCHS = 20
"""Long enough that an update is mostly training: stopped right after it logged an update,
a device is caught in the middle of its next one, which it uploads late when it wakes."""
APPLIED = re.compile(r"version (\d+) applied from (.*)")


def applied(caplog: pytest.LogCaptureFixture) -> list[tuple[int, list[tuple[str, int]]]]:
    """Each version the coordinator applied, with (agent, staleness) of the updates it took."""
    out = []
    for record in caplog.records:
        if match := APPLIED.fullmatch(record.getMessage()):
            took = re.findall(r"(agent-\d+) \((\d+) stale\)", match.group(2))
            out.append((int(match.group(1)), [(k, int(s)) for k, s in took]))
    return out


def test_a_sleeping_device_blocks_nobody_and_its_late_update_counts_stale(
    amqtt_broker, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="coordinator.buffered")
    cfg = ExperimentConfig(
        dataset="digits",
        agents=3,
        seed=3,
        learning=preset(
            "fedbuff", rounds=VERSIONS, epochs=EPOCHS, buffer_size=1, max_staleness=VERSIONS
        ),
    )
    emulation = Emulation(
        cfg,
        amqtt_broker.address,
        EmulationOptions(tmp_path / "fleet", linger_s=5.0, run_timeout_s=240),
    )
    thread, result = run_in_background(emulation)
    try:
        wait_for_round(emulation, "agent-001", 1)
        emulation.processes["agent-001"].send_signal(signal.SIGKILL)  # gone for good
        wait_for_round(emulation, "agent-002", 1)
        sleeper = emulation.processes["agent-002"]
        sleeper.send_signal(signal.SIGSTOP)  # asleep while the others go on
        try:
            slept_at = len(applied(caplog))
            deadline = time.monotonic() + 120
            while len(applied(caplog)) < slept_at + 4:
                assert time.monotonic() < deadline, "the fleet waited for the sleeping device"
                time.sleep(0.05)
        finally:
            sleeper.send_signal(signal.SIGCONT)
        thread.join(300)
        assert not thread.is_alive() and "error" not in result, result.get("error")
    finally:  # however the test ends, no agent outlives it (a stopped one dies too)
        for process in emulation.processes.values():
            if process.poll() is None:
                process.kill()
        thread.join(60)
    versions = applied(caplog)
    assert [v for v, _ in versions] == list(range(1, VERSIONS + 1))
    woke = [s for v, took in versions if v > slept_at + 4 for k, s in took if k == "agent-002"]
    assert woke and woke[0] >= 3, versions  # its update from before the nap, taken stale
    report = result["report"]
    assert report["summary"]["failed_agents"] == {"agent-001": -signal.SIGKILL}
    last = report["rounds"][-1]
    assert last["round"] == VERSIONS and set(last["agents"]) >= {"agent-000", "agent-002"}
