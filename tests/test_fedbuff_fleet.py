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


SSM_VERSIONS = 16


def test_fedbuff_ssm_device_that_slept_catches_up_on_the_newest_whole_version(
    amqtt_broker, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """FedBuff-SSM's versions are whole states: a device stopped for several versions takes
    the newest when it wakes and trains its next update from it."""
    caplog.set_level(logging.INFO, logger="coordinator.buffered")
    cfg = ExperimentConfig(
        dataset="digits",
        agents=3,
        seed=3,
        partition="iid",  # the closing accuracies compare the model, not the data
        learning=preset(
            "fedbuff-ssm",
            rounds=SSM_VERSIONS,
            epochs=EPOCHS,
            buffer_size=1,
            max_staleness=SSM_VERSIONS,
        ),
    )
    emulation = Emulation(
        cfg,
        amqtt_broker.address,
        EmulationOptions(tmp_path / "fleet", linger_s=5.0, run_timeout_s=240),
    )
    thread, result = run_in_background(emulation)
    try:
        wait_for_round(emulation, "agent-002", 1)
        sleeper = emulation.processes["agent-002"]
        sleeper.send_signal(signal.SIGSTOP)
        try:
            slept_at = len(applied(caplog))
            deadline = time.monotonic() + 120
            while len(applied(caplog)) < slept_at + 4:
                assert time.monotonic() < deadline, "the fleet waited for the sleeping device"
                time.sleep(0.05)
            woke_at = len(applied(caplog))
        finally:
            sleeper.send_signal(signal.SIGCONT)
        thread.join(300)
        assert not thread.is_alive() and "error" not in result, result.get("error")
    finally:
        for process in emulation.processes.values():
            if process.poll() is None:
                process.kill()
        thread.join(60)
    versions = applied(caplog)
    assert [v for v, _ in versions] == list(range(1, SSM_VERSIONS + 1))
    # The bases of the sleeper's updates applied after it woke: one trained from a version
    # at least as new as the newest when it woke (it took that version and went on from it).
    sleeper_bases = [
        v - 1 - s for v, took in versions if v > woke_at for k, s in took if k == "agent-002"
    ]
    assert any(b >= woke_at for b in sleeper_bases), versions
    assert emulation.rounds_logged() == 3 * SSM_VERSIONS  # the progress bar's full count
    report = result["report"]
    assert report["summary"].get("failed_agents") in (None, {})
    last = report["rounds"][-1]
    assert last["round"] == SSM_VERSIONS and set(last["agents"]) == set(report["config"]["roster"])
    # Its closing record judges the newest whole version it took on its data: as good as
    # the others' (a device still on the model of before its nap would be near chance).
    closing = {k: a["accuracy"] for k, a in last["agents"].items()}
    assert closing["agent-002"] > 0.3, closing
    assert closing["agent-002"] >= 0.8 * min(closing["agent-000"], closing["agent-001"]), closing
