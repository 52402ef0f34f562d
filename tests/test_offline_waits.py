"""Peers stop waiting for an agent whose presence says offline: it is a straggler at once (its
newest model stands in, as after a timeout), and waits apply again once it is back online."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_until_logged

from agent.experiment import ExperimentConfig
from agent.learning import preset
from agent.runtime import Expected, Inbox, checkpoint, expected_shapes
from coordinator.emulate import Emulation, EmulationOptions
from protocol import messages, topics

FLEET, RUN = "lab", "run-1"
LONG_S = 60.0
"""A round timeout no test here may wait out."""


def inbox() -> Inbox:
    return Inbox(Expected(FLEET, RUN, frozenset({"a", "b"}), expected_shapes({})))


def presence(box: Inbox, agent: str, online: bool) -> None:
    message = messages.Presence(fleet=FLEET, sender=agent, online=online, since=1.0)
    box.on_presence(topics.presence(FLEET, agent), messages.encode(message))


def ready(box: Inbox, agent: str) -> None:
    """`agent`'s first status of this run: it takes part."""
    status = messages.Status(fleet=FLEET, sender=agent, run_id=RUN, round=0, state="ready")
    box.on_status(topics.status(FLEET, agent), messages.encode(status))


def timed_wait(box: Inbox, timeout_s: float) -> tuple[set[tuple[int, str]], float]:
    started = time.monotonic()
    missing = box.wait_models({(2, "b")}, timeout_s)
    return missing, time.monotonic() - started


def test_a_wait_for_a_model_ends_when_its_sender_goes_offline() -> None:
    box = inbox()
    ready(box, "b")
    threading.Timer(0.2, presence, (box, "b", False)).start()
    missing, waited = timed_wait(box, LONG_S)
    assert missing == set() and waited < 5.0
    assert box.gone() == {"b"} and box.model(2, "b") is None


def test_waits_apply_again_once_the_sender_is_back_online() -> None:
    box = inbox()
    ready(box, "b")
    presence(box, "b", False)
    assert timed_wait(box, LONG_S)[1] < 1.0
    presence(box, "b", True)
    missing, waited = timed_wait(box, 0.3)
    assert missing == {(2, "b")} and waited >= 0.3


def test_an_offline_presence_of_an_agent_not_yet_in_this_run_is_still_waited_for() -> None:
    """A retained goodbye of an earlier run arrives before the agent comes up again."""
    box = inbox()
    presence(box, "b", False)
    missing, waited = timed_wait(box, 0.3)
    assert missing == {(2, "b")} and waited >= 0.3 and box.gone() == set()


def config() -> ExperimentConfig:
    return ExperimentConfig(
        dataset="mnist1d",
        agents=3,
        partition="dirichlet:0.5",
        seed=7,
        round_time_s=0.01,
        learning=preset("dadpfl", rounds=5, neighbours=2, epochs=1, max_wait=2),
    )


@pytest.mark.timeout(150)
def test_peers_of_a_killed_agent_finish_without_waiting_a_round_timeout(
    amqtt_broker: Any, tmp_path: Path
) -> None:
    """SIGKILL after round 1: the broker publishes the agent's will, and the others' rounds
    that need its models end at once, with it as a straggler, not after 60 s each."""
    options = EmulationOptions(workdir=tmp_path / "fleet", round_timeout_s=LONG_S, linger_s=2.0)
    emulation = Emulation(config(), amqtt_broker.address, options)
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(report=emulation.run()), daemon=True)
    thread.start()
    try:
        wait_until_logged(emulation, thread, "agent-001", 1)
        emulation.processes["agent-001"].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        thread.join(LONG_S + 30)
        assert not thread.is_alive() and time.monotonic() - killed < LONG_S
    finally:
        for process in emulation.processes.values():
            if process.poll() is None:  # the run did not end: leave no agent behind
                process.kill()
    assert result["report"]["summary"]["failures"].keys() == {"agent-001"}
    rounds: list[dict[str, Any]] = []
    for agent in ("agent-000", "agent-002"):
        records = checkpoint.read_records(emulation.round_log(agent))
        assert sorted(records) == [1, 2, 3, 4, 5]
        rounds += records.values()
    assert max(r["wait_s"] for r in rounds) < LONG_S / 4
    assert any("agent-001" in r["stragglers"] for r in rounds), "its models were needed"
