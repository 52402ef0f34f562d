"""bench/asynchronous.py: its quick run writes the figures the issue asks for, measured the
same way on both sides (fleet accuracy from each agent's latest record by a moment)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench import asynchronous


def record(round_: int, **agents: tuple[float, float]) -> dict:
    """A round record: agent -> (finished_at, accuracy)."""
    return {
        "round": round_,
        "agents": {k: {"finished_at": f, "accuracy": a} for k, (f, a) in agents.items()},
    }


def test_fleet_accuracy_is_each_agents_latest_record_by_the_moment() -> None:
    rounds = [
        record(1, a=(1.0, 0.2), b=(5.0, 0.4)),
        record(2, a=(2.0, 0.6), b=(9.0, 0.8)),
    ]
    assert asynchronous.fleet_accuracy_at(rounds, 5.0) == pytest.approx(0.5)
    assert asynchronous.fleet_accuracy_at(rounds) == pytest.approx(0.7)
    got = asynchronous.measures({"rounds": rounds}, target=0.5)
    # not before b's first record: before it the fleet has no figure
    assert got["seconds_to_target"] == 5.0 and got["seconds"] == 9.0
    assert got["mean_staleness"] is None


def test_the_quick_bench_writes_both_sides_of_every_pair(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "asynchronous.json"
    monkeypatch.setattr(sys, "argv", ["bench.asynchronous", "--quick", "--out", str(out)])
    asynchronous.main()
    result = json.loads(out.read_text())
    assert result["settings"]["quick"] and result["emulate"] == []
    rows = {row["pair"]: row for row in result["rows"]}
    assert set(rows) == set(asynchronous.PAIRS)
    dadpfl = rows["dadpfl"]
    sync, asyn = dadpfl["synchronous"], dadpfl["asynchronous"]
    assert asyn["rounds"] == 2 * sync["rounds"]
    assert sync["mean_staleness"] is None and asyn["mean_staleness"] > 0
    assert sync["seconds_to_target"] <= sync["seconds"]
    # the sleepers hold up every synchronous round, never an asynchronous one
    assert dadpfl["time_ratio"] < 1
    assert dadpfl["time_ratio"] == pytest.approx(
        asyn["seconds_to_target"] / sync["seconds_to_target"]
    )
    for row in rows.values():
        assert {"accuracy", "seconds", "seconds_to_target"} <= set(row["asynchronous"])
        assert "accuracy_at_sync_seconds" in row["asynchronous"]
        assert isinstance(row["accuracy_gap_points"], float)
