"""The default defence (`--clip auto`) says what it did: a round's record lists the models it
screened out and clipped, the summary counts them, and the log warns once per run when a
round screened out every one (session 35: under `--dp sample` at `--lr 0.5` every honest
upload was screened every round and nothing said so)."""

from __future__ import annotations

import io
import logging
from typing import Any

import pytest
import torch
from rich.console import Console

from agent.experiment import ExperimentConfig
from agent.learning import preset, robust
from agent.learning.screening import Screening, ScreeningLog, noted, tallied
from coordinator.aggregator import AggregatorRecord
from coordinator.cli_shared import summary_table
from coordinator.simulate import simulate

pytestmark = pytest.mark.timeout(300)

SCREENING_LOG = "agent.learning.screening"


def dp_fleet(**learning: Any) -> ExperimentConfig:
    """Session 35's fleet: FedAvg on digits, 4 agents, `--dp sample` at sigma 2.75
    (bench/privacy.py's calibration for epsilon 4 in its setting), the strategy's own
    models kept."""
    settings = {"rounds": 2, "dp": "sample", "dp_noise": 2.75, "fallback": "off", **learning}
    return ExperimentConfig(dataset="digits", agents=4, learning=preset("fedavg", **settings))


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == SCREENING_LOG and r.levelno >= logging.WARNING
    ]


def test_a_dp_fleet_at_a_high_lr_records_every_upload_screened_and_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.DEBUG, logger=SCREENING_LOG):
        report = simulate(dp_fleet(lr=0.5))
    roster = report["config"]["roster"]
    for record in report["rounds"]:
        assert record["screened"] == roster, record["round"]
        assert record["clipped"] == []
        assert all(a["screened"] == [] for a in record["agents"].values())
    assert report["summary"]["defence"]["screened"] == 2 * len(roster)
    shown = io.StringIO()
    Console(file=shown, width=200).print(summary_table(report))
    row = [line for line in shown.getvalue().splitlines() if "screened out / clipped" in line]
    assert len(row) == 1 and "(--clip auto)" in row[0] and "8 / 0" in row[0]
    said = warnings(caplog)
    assert len(said) == 1, "said once per run, not every round"
    assert said[0].startswith("round 1: the defence (--clip auto) screened out all 4 uploads")
    assert "under --dp sample" in said[0] and "lower --lr" in said[0]
    again = [r for r in caplog.records if r.name == SCREENING_LOG and r.levelno == logging.DEBUG]
    assert [r.getMessage()[:8] for r in again] == ["round 2:"]


def test_a_dp_fleet_at_the_default_lr_records_nothing_screened(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.DEBUG, logger=SCREENING_LOG):
        report = simulate(dp_fleet())
    for record in report["rounds"]:
        assert (record["screened"], record["clipped"]) == ([], [])
    assert "defence" not in report["summary"], "such a run's summary is unchanged"
    assert not [r for r in caplog.records if r.name == SCREENING_LOG]


def test_a_poisoned_neighbour_is_recorded_screened_by_the_agents_that_received_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """DFedAvgM, 5 agents hearing each other, agent-000 sends its model scaled: by round 2
    every honest agent aggregates one of its poisoned models, and screens it out."""
    cfg = ExperimentConfig(
        dataset="mnist1d",
        agents=5,
        seed=3,
        attackers=1,
        attack="scale",
        learning=preset("dfedavgm", rounds=2, epochs=1, neighbours=4, fallback="off"),
    )
    with caplog.at_level(logging.DEBUG, logger=SCREENING_LOG):
        report = simulate(cfg)
    honest = [k for k in report["config"]["roster"] if k != "agent-000"]
    last = report["rounds"][-1]["agents"]
    assert all(last[k]["screened"] == ["agent-000"] for k in honest)
    every = {s for r in report["rounds"] for k in honest for s in r["agents"][k]["screened"]}
    assert every == {"agent-000"}, "no honest sender screened"
    assert set(report["summary"]["defence"]["by_sender"]) == {"agent-000"}
    told = [r for r in caplog.records if r.name == SCREENING_LOG and r.levelno == logging.INFO]
    assert len(told) == 1 and "screened out 1 of 4 received (agent-000)" in told[0].getMessage()
    assert not warnings(caplog)


def test_verdicts_of_several_clips_in_a_round_add_up() -> None:
    """FedAdam clips three deltas, `--wire layers` each set of layers apart: a sender screened
    in one part is screened, one clipped in another part and screened in none is clipped."""
    own = {"w": torch.zeros(2)}
    first = {"a": {"w": torch.tensor([0.1, 0.0])}, "b": {"w": torch.tensor([0.0, 0.1])}}
    second = {"b": {"w": torch.tensor([0.0, 9.0])}, "c": {"w": torch.tensor([9.0, 0.0])}}
    with tallied() as tally:
        noted(robust.clip(own, first, "0.05"))  # a and b clipped
        noted(robust.clip(own, second | {"d": {"w": torch.tensor([float("nan"), 0])}}, "1"))
    assert tally.screening == Screening(("a", "b", "c", "d"), ("d",), ("a", "b", "c"))
    noted(robust.clip(own, second, "auto"))  # no tally open: counted nowhere
    assert not Screening().everything and Screening(("a",), ("a",)).everything


def test_each_cause_is_said_at_its_level_once_per_run(caplog: pytest.LogCaptureFixture) -> None:
    said = ScreeningLog(preset("dfedavgm"), centralized=False)
    some = Screening(("a", "b", "c"), ("b",), ("c",))
    with caplog.at_level(logging.DEBUG, logger=SCREENING_LOG):
        for round_, screening in enumerate([some, Screening(("a",)), some], start=1):
            said.say(round_, screening)
        said.say(4, Screening(("a", "b"), ("a", "b")))
    levels = [(r.levelno, r.getMessage()[:8]) for r in caplog.records]
    assert levels == [
        (logging.INFO, "round 1:"),
        (logging.DEBUG, "round 3:"),
        (logging.WARNING, "round 4:"),
    ]
    assert "screened out 1 of 3 received (b) and clipped 1 of 3 received (c)" in (
        caplog.records[0].getMessage()
    )
    assert "aggregated its own model alone" in caplog.records[2].getMessage()
    assert "if the models are honest, lower --lr, or pass --clip off" in (
        caplog.records[2].getMessage()
    )


def test_a_coordinator_restarted_from_state_kept_before_screening_was_recorded() -> None:
    kept = {
        "round": 3,
        "participants": ["a"],
        "stragglers": [],
        "traffic": {"sent": 1, "received": 2, "nonzeros_sent": 0},
    }
    record = AggregatorRecord.restored(kept)
    assert (record.round, record.traffic.received, record.screened) == (3, 2, [])
    assert AggregatorRecord.restored({**kept, "screened": ["a"]}).screened == ["a"]
