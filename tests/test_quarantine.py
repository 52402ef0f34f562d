"""A keyed member that keeps sending invalid (NaN) models is quarantined by its receivers:
they stop waiting for it, say so in their round records, and their own models stay finite.

Without the quarantine every receiver waits out the round timeout for it every round (the
model comes, fails its checks, is asked for again, comes invalid again): issue 34."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from agent.experiment import ExperimentConfig
from agent.learning import preset
from agent.runtime.quarantine import QUARANTINE_AFTER, Quarantine
from coordinator.emulate import Emulation, EmulationOptions
from tests.test_emulate import SHARED

pytestmark = pytest.mark.timeout(300)

ROUNDS = 5
ROUND_TIMEOUT_S = 30.0


def test_a_member_sending_nan_models_is_quarantined_and_not_waited_for(
    amqtt_broker, tmp_path: Path
) -> None:
    cfg = ExperimentConfig(
        dataset="digits",
        agents=4,
        seed=7,
        attackers=1,
        attack="nan",
        learning=preset("dadpfl", rounds=ROUNDS, epochs=1, neighbours=3),
    )
    options = EmulationOptions(
        workdir=tmp_path / "fleet",
        linger_s=10.0,
        round_timeout_s=ROUND_TIMEOUT_S,
        agents_per_process=SHARED,
        agent_keys=True,
    )
    started = time.monotonic()
    report = Emulation(cfg, amqtt_broker.address, options).run()
    wall = time.monotonic() - started
    assert report["summary"]["failed_agents"] == {}
    # Waiting out the timeout for it every round would take ROUNDS x 30 s at least.
    assert wall < ROUNDS * ROUND_TIMEOUT_S, wall
    honest = {a: r for a, r in _records(tmp_path / "fleet").items() if a != "agent-000"}
    assert sorted(honest) == ["agent-001", "agent-002", "agent-003"]
    for agent, records in honest.items():
        assert [r["round"] for r in records] == list(range(1, ROUNDS + 1))
        assert sum(r["wait_s"] for r in records) < ROUND_TIMEOUT_S, agent
        # Each hears the attacker every round (3 neighbours of 3): a round's invalid model
        # is not waited for (the wait above), and after QUARANTINE_AFTER rounds of them
        # the attacker is quarantined and shown so.
        assert records[-1]["quarantined"] == ["agent-000"], agent
        assert records[QUARANTINE_AFTER - 2]["quarantined"] == [], agent
        # its NaN never reached their models
        assert all(math.isfinite(r["loss"]) for r in records), agent


def _records(workdir: Path) -> dict[str, list[dict]]:
    """Each agent's round log (`rounds.jsonl`), by agent."""
    out: dict[str, list[dict]] = {}
    for path in workdir.rglob("rounds.jsonl"):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if rows:
            out[rows[0]["agent"]] = rows
    return out


def test_a_sender_is_quarantined_after_invalid_models_in_three_rounds() -> None:
    quarantine = Quarantine()
    quarantine.invalid("d1", 1, "not finite")
    quarantine.invalid("d1", 1, "not finite")  # the same round re-sent: still one
    assert quarantine.skips(1, "d1") and not quarantine.skips(2, "d1")
    quarantine.invalid("d1", 2, "not finite")
    assert quarantine.members() == set()
    quarantine.invalid("d1", 4, "not finite")
    assert quarantine.members() == {"d1"} and quarantine.holds("d1")
    assert quarantine.skips(9, "d1") and not quarantine.skips(1, "d2")
