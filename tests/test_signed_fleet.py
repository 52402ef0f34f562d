"""A fleet with a key per member, attacked during its run by a client on the same broker:
forged runs, statuses, votes, models and presences, messages signed by a member in another's
name and messages replayed on other rounds are all rejected, and the run learns exactly what
simulate learns. An agent the coordinator never admitted does not get into a run."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.experiment import ExperimentConfig
from agent.learning import preset
from coordinator.emulate import Emulation, EmulationOptions
from coordinator.simulate import Simulation
from coordinator.watch import FleetFeed
from protocol import MqttTransport, TransportOptions, topics
from protocol import messages as m
from protocol.signing import IDENTITY_FILE, MemberKeys, load_or_create_private, member_keys
from tests.test_emulate import SHARED, assert_same_learning

pytestmark = pytest.mark.timeout(300)
ROUNDS = 4


def config() -> ExperimentConfig:
    return ExperimentConfig(
        dataset="mnist1d",
        agents=4,
        partition="dirichlet:0.5",
        seed=7,
        round_time_s=0.01,
        learning=preset("dadpfl", rounds=ROUNDS, neighbours=2, epochs=1, max_wait=2),
    )


class Attacker:
    """A client on the fleet's broker that forges and replays what it can."""

    def __init__(self, transport: MqttTransport, emulation: Emulation) -> None:
        self.transport, self.fleet = transport, emulation.fleet
        self.run_id, self.roster = emulation.run_id, emulation.roster
        workdir = emulation.options.workdir
        # An insider: agent-000's own key, used to speak for the others.
        insider = load_or_create_private(workdir / "agent-000" / IDENTITY_FILE)
        self.insider = MemberKeys("agent-000", insider)
        self.outsider = Ed25519PrivateKey.generate()
        # The victims' own keys, as if their old presences had been captured.
        self.victim_keys = {
            agent: MemberKeys(agent, load_or_create_private(workdir / agent / IDENTITY_FILE))
            for agent in self.roster
        }
        self.captured: list[tuple[int, bytes]] = []
        self.sent = 0
        transport.subscribe(topics.round_topic(self.fleet, "+", "vote"), self.capture)

    def capture(self, topic: str, payload: bytes) -> None:
        self.captured.append((int(topic.split("/")[4]), payload))

    def send(self, topic: str, data: bytes) -> None:
        self.transport.publish(topic, data)
        self.sent += 1

    def forge_round(self, round_: int) -> None:
        header = {"fleet": self.fleet, "run_id": self.run_id, "round": round_}
        for victim in self.roster[1:]:
            forged: list[tuple[str, m.Message]] = [
                (
                    topics.round_topic(self.fleet, round_, "vote", victim),
                    m.Vote(sender=victim, vote=True, score=0.0, **header),
                ),
                (
                    topics.status(self.fleet, victim),
                    m.Status(sender=victim, state="done", stopped=True, **header),
                ),
                (
                    topics.round_topic(self.fleet, round_, "model", victim),
                    m.Model(sender=victim, tensors=b"\0" * 64, num_samples=10**9, **header),
                ),
            ]
            outsider = MemberKeys(victim, self.outsider)
            for topic, message in forged:
                self.send(topic, m.encode(message, key=self.insider))
                self.send(topic, m.encode(message, key=outsider))
            old_goodbye = m.Presence(
                fleet=self.fleet, sender=victim, online=False, since=1.0, reason="shutdown"
            )
            self.send(
                topics.presence(self.fleet, victim),
                m.encode(old_goodbye, key=self.victim_keys[victim]),
            )
        for captured_round, payload in list(self.captured):
            sender = m.decode(payload).sender
            self.send(topics.round_topic(self.fleet, captured_round + 1, "vote", sender), payload)

    def forge_run(self) -> None:
        run = m.RunConfig(
            fleet=self.fleet, sender="agent-000", run_id="forged", roster=self.roster, seed=1
        )
        self.send(topics.run(self.fleet), m.encode(run, key=self.insider))


def test_a_fleet_with_member_keys_learns_as_simulate_while_attacked(
    amqtt_broker, tmp_path: Path
) -> None:
    cfg = config()
    options = EmulationOptions(
        workdir=tmp_path / "fleet",
        round_timeout_s=10.0,
        linger_s=5.0,
        agent_keys=True,
        agents_per_process=SHARED,  # faster to start, with the same keys and code
    )
    emulation = Emulation(cfg, amqtt_broker.address, options)
    result: dict[str, Any] = {}
    run = threading.Thread(target=lambda: result.update(report=emulation.run()), daemon=True)
    with MqttTransport(amqtt_broker.address, TransportOptions()) as transport:
        assert transport.wait_connected(10)
        attacker = Attacker(transport, emulation)
        run.start()
        while run.is_alive() and attacker.sent < 4000:
            time.sleep(0.2)
            if attacker.captured:  # the agents are in their rounds
                attacker.forge_run()
                for round_ in range(1, ROUNDS + 1):
                    attacker.forge_round(round_)
        run.join(240)
    assert attacker.sent > 200 and attacker.captured, "the attack ran during the run"
    emulated = result["report"]
    assert emulated["summary"]["failed_agents"] == {}
    assert_same_learning(emulated, Simulation(cfg).run())
    logs = "".join((options.workdir / f"{agent}.log").read_text() for agent in emulation.roster)
    assert "bad signature for sender" in logs
    assert "rejected run" in logs and "'agent-000' is not admitted" in logs


def test_an_agent_the_coordinator_never_admitted_is_not_seen(amqtt_broker, tmp_path: Path) -> None:
    admitted = tmp_path / "admitted.keys"
    known = member_keys("d1", tmp_path / "d1.pem", None)
    admitted.write_text(f"d1 {known.public}\n")
    coordinator = member_keys("coordinator", tmp_path / "coordinator.pem", admitted)
    stranger = MemberKeys("d2", Ed25519PrivateKey.generate())
    fleet = "lab"
    with (
        MqttTransport(amqtt_broker.address, TransportOptions()) as transport,
        MqttTransport(amqtt_broker.address, TransportOptions()) as agents,
    ):
        feed = FleetFeed(transport, fleet, coordinator)
        # The messages below are not retained: the feed must be subscribed before they go.
        assert transport.wait_subscribed(10) and agents.wait_connected(10)
        for member in (known, stranger):
            presence = m.Presence(fleet=fleet, sender=member.me, online=True, since=time.time())
            status = m.Status(fleet=fleet, sender=member.me, state="idle")
            agents.publish(topics.presence(fleet, member.me), m.encode(presence, key=member))
            agents.publish(topics.status(fleet, member.me), m.encode(status, key=member))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not feed.entries():
            time.sleep(0.1)
        time.sleep(0.5)
        assert [entry.agent for entry in feed.entries()] == ["d1"]
