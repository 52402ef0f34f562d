"""A fleet run under a flood of hostile payloads (random bytes, truncated frames, huge
declared sizes, forged future rounds, forged sample counts, forged requests) gives the numbers
of `simulate`. `python -m bench.flood` measures the agents' memory under the same flood."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import flood
from coordinator.simulate import Simulation

PAYLOADS = 1400

pytestmark = pytest.mark.timeout(300)


def test_a_flooded_run_gives_the_numbers_of_simulate(amqtt_broker, tmp_path: Path) -> None:
    config = flood.fleet_config(agents=4, rounds=4, wire="delta")
    run = flood.run_fleet(config, amqtt_broker.address, tmp_path / "fleet", PAYLOADS)
    report, sent = run["report"], run["sent"]
    assert report["summary"]["failed_agents"] == {}
    assert sum(sent.get(kind, 0) for kind in flood.KINDS) == PAYLOADS, sent
    assert sent["started_at"] < max(run["round_ends"].values()), "the flood came after the run"
    assert report["summary"]["stragglers"] == []
    assert flood.same_learning(report, Simulation(config).run())
    logs = "".join(path.read_text() for path in (tmp_path / "fleet").glob("agent-*.log"))
    # The agents applied the run's limits: a declared 512 MiB was refused on its header.
    assert f"exceeds the limit of {run['limits'].max_message_bytes}" in logs
