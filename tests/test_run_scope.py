"""A long-lived agent's subscriptions end with each run, even those a late message makes: the
keeper's offline presence, handled after the run ended, once subscribed the agent to every
status of the fleet for the rest of the process's life (bytes counted in every later run)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from agent.experiment import ExperimentConfig
from agent.learning import preset
from agent.runtime import AgentRuntime, Run, Timeouts, new_run_id
from agent.runtime.session import follow_everyone
from agent.workload import build_workload
from protocol import BrokerAddress, MqttTransport, messages, topics

FLEET = "scope"

pytestmark = pytest.mark.timeout(60)


def statuses_received_after_keeper_lost(
    address: BrokerAddress, tmp_path: Path, *, over: bool
) -> int:
    """Frames the agent's connection receives for a peer's status after its keeper was lost
    (with the run `over` or not)."""
    config = ExperimentConfig(
        dataset="mnist1d", agents=2, seed=1, learning=preset("dadpfl", rounds=1, neighbours=1)
    )
    run = Run(new_run_id(), ("a", "b"), config, "coordinator", "coordinator")
    with MqttTransport(address) as transport, MqttTransport(address) as peer:
        runtime = AgentRuntime(
            agent_id="a",
            fleet=FLEET,
            run=run,
            workload=build_workload(config, ["a", "b"], agents=["a"]),
            transport=transport,
            state_dir=tmp_path / f"a-{over}",
            timeouts=Timeouts(),
        )
        runtime.session.over = over
        follow_everyone(runtime.session)
        assert transport.wait_subscribed(10) and peer.wait_connected(10)
        before = transport.stats.get("received_frames", 0)
        status = messages.Status(fleet=FLEET, sender="b", run_id=run.run_id, state="idle")
        peer.publish(topics.status(FLEET, "b"), messages.encode(status)).wait_for_publish(5)
        time.sleep(1.0)
        return transport.stats.get("received_frames", 0) - before


def test_a_keeper_lost_after_the_run_ended_subscribes_nothing(
    embedded_address: BrokerAddress, tmp_path: Path
) -> None:
    broker = embedded_address
    assert statuses_received_after_keeper_lost(broker, tmp_path, over=False) == 1
    assert statuses_received_after_keeper_lost(broker, tmp_path, over=True) == 0
