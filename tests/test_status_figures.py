"""A member's absurd or wrongly typed status figures (issue 46): `coordinator status`, `serve`'s
log, the dashboard, `/metrics` and `coordinator run`'s report neither crash on them nor
show them nor let them into a fleet-wide figure; the operator is told once per member and
figure, in one line that says why; honest statuses come through unchanged."""

from __future__ import annotations

import io
import json
import logging
import math
import os
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from agent.experiment import MAX_ROUNDS, ExperimentConfig
from agent.learning import preset
from agent.report import AgentRound, early_stop_savings
from agent.runtime.session import STATUS_FIGURES
from coordinator import status_figures
from coordinator.broker import EmbeddedBroker
from coordinator.conductor import Conductor, assemble_report
from coordinator.dashboard import FleetState
from coordinator.dashboard.metrics import registry_for
from coordinator.fleet import FleetLog, FleetView, fleet_table
from protocol import MqttTransport, messages, topics
from tests.test_bounded_memory import Wire
from tests.test_cli import COORDINATOR, REPO

FLEET = "lab"
RUN = "run-0001"

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def nothing_told_yet() -> Iterator[None]:
    """`status_figures.TOLD` is the process's: each test starts with nothing told."""
    status_figures.TOLD.clear()
    yield
    status_figures.TOLD.clear()


def record(agent: str, round_: int = 3, accuracy: float = 0.5, **figures: Any) -> dict[str, Any]:
    row = AgentRound(
        round_, agent, accuracy, loss=1.0, train_loss=0.9, sparsity=0.5, bytes_sent=1000,
        bytes_received=2000, train_flops=10**6, p_k=0.5,
    )  # fmt: skip
    return row.as_dict() | figures


def honest_metrics(agent: str, round_: int = 3, accuracy: float = 0.5) -> dict[str, Any]:
    """What `Session.finish_round` publishes after a round."""
    row = record(agent, round_, accuracy)
    return {k: row[k] for k in STATUS_FIGURES} | {"metric": "accuracy", "record": row}


def status(agent: str, metrics: dict[str, Any], **header: Any) -> tuple[str, bytes]:
    fields = {"run_id": RUN, "round": 3, "state": "training"} | header
    message = messages.Status(fleet=FLEET, sender=agent, metrics=metrics, **fields)
    return topics.status(FLEET, agent), messages.encode(message)


def presence(agent: str, **fields: Any) -> tuple[str, bytes]:
    message = messages.Presence(fleet=FLEET, sender=agent, online=True, since=time.time(), **fields)
    return topics.presence(FLEET, agent), messages.encode(message)


def fleet_with(hostile: dict[str, Any] | None, **header: Any) -> list[tuple[str, bytes]]:
    """Two honest agents (accuracy 0.5 and 0.7) and, unless `hostile` is None, agent x whose
    otherwise honest status carries `hostile` figures."""
    messages_ = [
        presence("a"),
        status("a", honest_metrics("a")),
        presence("b"),
        status("b", honest_metrics("b", accuracy=0.7)),
    ]
    if hostile is not None:
        messages_ += [
            presence("x"),
            status("x", honest_metrics("x", accuracy=0.6) | hostile, **header),
        ]
    return messages_


def table_text(view: FleetView) -> str:
    console = Console(file=io.StringIO(), width=200)
    console.print(fleet_table(view.entries(), width=200))
    return console.file.getvalue()  # type: ignore[attr-defined]


def view_of(fed: list[tuple[str, bytes]]) -> FleetView:
    view = FleetView()
    for topic, payload in fed:
        view.feed(topic, payload)
    return view


def state_of(fed: list[tuple[str, bytes]]) -> FleetState:
    state = FleetState(FLEET)
    for topic, payload in fed:
        state.feed(topic, payload)
    return state


SAVED_AS_TEXT = {"round": 3, "saved_rounds": "x", "saved_flops": "x", "saved_bytes": "x"}
CRASHED_THE_TABLE = [
    pytest.param({"limited_by": "[/]"}, {}, id="markup-limited_by"),
    pytest.param({"stragglers": ["[/]"]}, {}, id="markup-straggler"),
    pytest.param({"saved": SAVED_AS_TEXT}, {"state": "stopped", "stopped": True}, id="saved-text"),
    pytest.param({}, {"state": "[/]"}, id="markup-state"),
]


@pytest.mark.parametrize(("hostile", "header"), CRASHED_THE_TABLE)
def test_a_hostile_figure_crashes_neither_the_table_nor_serves_log(
    hostile: dict[str, Any], header: dict[str, Any]
) -> None:
    fed = fleet_with(hostile, **header)
    text = table_text(view_of(fed))
    assert " a " in text and " b " in text and "0.700" in text
    lines = [line for topic, payload in fed for line in FleetLog().feed(topic, payload)]
    assert lines and "[/]" not in "".join(lines)


def test_a_presence_of_markup_does_not_crash_the_table() -> None:
    fed = fleet_with(None) + [presence("x", profile="[/]", role="[bold]")]
    assert " a " in table_text(view_of(fed))


@pytest.mark.parametrize(
    ("hostile", "header"),
    [
        ({"quarantined": ["q" * 900_000]}, {}),
        ({"stragglers": ["s" * 14_000] * 64}, {}),
        ({}, {"state": "s" * 900_000}),
        ({}, {"run_id": "r" * 900_000}),
    ],
    ids=["name", "names", "state", "run_id"],
)
def test_a_huge_figure_is_not_shown(hostile: dict[str, Any], header: dict[str, Any]) -> None:
    fed = fleet_with(hostile, **header)
    assert len(table_text(view_of(fed))) < 10_000
    assert len(json.dumps(state_of(fed).snapshot())) < 20_000


ABSURD = {
    "accuracy": 1e300,
    "p_k": 5.0,
    "sparsity": -3.0,
    "train_s": 1e300,
    "predicted_s": 1e-300,
    "peak_memory_mb": 1e305,
    "energy_j": -1e300,
    "record": record("x", accuracy=7.0, bytes_sent=-(10**15), train_flops=1e308, energy_j=1e300),
}


def prometheus(state: FleetState) -> dict[tuple[str, str], float]:
    """(series, agent or fleet) -> value of every sample `/metrics` serves."""
    text = generate_latest(registry_for(state)).decode()
    return {
        (sample.name, sample.labels.get("agent", sample.labels.get("fleet", ""))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_absurd_figures_move_no_fleet_figure_and_no_gauge() -> None:
    honest, hostile = state_of(fleet_with(None)), state_of(fleet_with(ABSURD))
    (fleet,) = hostile.snapshot()["fleets"]
    assert fleet["mean_accuracy"] == pytest.approx(0.6), "a's and b's alone"
    assert honest.snapshot()["fleets"][0]["mean_accuracy"] == pytest.approx(0.6)
    samples = prometheus(hostile)
    assert all(math.isfinite(value) for value in samples.values())
    assert all(value >= 0 for (name, _), value in samples.items() if name.endswith("_total"))
    assert samples["edgefl_agent_p_k", "x"] == 0.5, "its round record's, not its claimed 5"
    assert ("edgefl_agent_prediction_error_ratio", "x") not in samples
    assert samples["edgefl_agent_bytes_sent_total", "x"] == 0
    assert samples["edgefl_fleet_mean_accuracy", FLEET] == pytest.approx(0.6)
    row = next(row for row in hostile.snapshot()["agents"] if row["agent"] == "x")
    assert (row["sparsity"], row["energy_j"], row["series"]["accuracy"]) == (0.5, None, [None])


def test_a_member_naming_another_metric_stays_out_of_the_fleets_mean() -> None:
    """A classification fleet's mean is of accuracies: a member claiming an mae of 1e11 (no
    share, so no accuracy check) is left out of it, as is any figure of another metric."""
    state = state_of(fleet_with({"metric": "mae", "accuracy": 1e11}))
    (fleet,) = state.snapshot()["fleets"]
    assert (fleet["metric"], fleet["mean_accuracy"]) == ("accuracy", pytest.approx(0.6))


def test_a_round_beyond_any_run_is_ignored_and_beyond_its_run_moves_no_progress() -> None:
    state = state_of(fleet_with({}, round=10**9))
    assert state.snapshot()["fleets"][0]["round"] == 3
    assert ("edgefl_fleet_round", FLEET) in prometheus(state)
    assert prometheus(state)["edgefl_fleet_round", FLEET] == 3
    log = FleetLog(progress_every_s=0)
    run = messages.RunConfig(
        fleet=FLEET, sender="coordinator", run_id=RUN, roster=["a", "x"], seed=1,
        config={"learning": {"rounds": 10, "strategy": "dadpfl"}},
    )  # fmt: skip
    log.feed(topics.run(FLEET), messages.encode(run))
    lines = log.feed(*status("x", honest_metrics("x"), round=5000))
    assert not any("5000" in line for line in lines)
    assert any("round 3/10" in line for line in log.feed(*status("a", honest_metrics("a"))))


def test_each_absurd_figure_is_told_once_with_its_reason(caplog: pytest.LogCaptureFixture) -> None:
    """However often the member sends it again and however many readers see it (serve's log
    and its dashboard each follow the fleet)."""
    caplog.set_level(logging.WARNING, logger=status_figures.__name__)
    records = [record("x", t, accuracy=7.0) for t in (1, 2, 3)]
    fed = fleet_with({"accuracy": 7.0, "limited_by": "[/]", "records": records})
    view, state = FleetView(), FleetState(FLEET)
    for _ in range(3):
        for topic, payload in fed:
            view.feed(topic, payload)
            state.feed(topic, payload)
    told = [r.getMessage() for r in caplog.records if r.name == status_figures.__name__]
    assert sorted(told) == [
        f"agent {FLEET}/x's status: 'accuracy' must be a number in [0, 1], got 7.0 - ignored",
        f"agent {FLEET}/x's status: 'limited_by' must be a label of at most 64 letters, "
        "digits and _ .,:+()/-, got '[/]' - ignored",
        f"agent {FLEET}/x's status: 'records[0].accuracy' must be a number in [0, 1], got 7.0 "
        "- ignored",
    ]


def test_a_flood_of_absurd_members_is_told_a_few_lines_at_a_time() -> None:
    """Statuses under a thousand names: a few lines per interval, each member still told
    (once) when its status comes again after the interval."""
    now = [0.0]
    lines: list[str] = []
    logger = logging.getLogger("test_status_figures.flood")
    logger.addHandler(handler := logging.Handler())
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    told = status_figures.FigureLog(logger, interval_s=10, burst=20, clock=lambda: now[0])
    try:
        for _ in range(3):
            for n in range(1000):
                told.tell(FLEET, f"m{n}", [("accuracy", "must be a number in [0, 1]")], "ignored")
        assert len(lines) == 20
        now[0] += 10
        for n in range(1000):
            told.tell(FLEET, f"m{n}", [("accuracy", "must be a number in [0, 1]")], "ignored")
    finally:
        logger.removeHandler(handler)
    assert len(lines) == 40 and len(set(lines)) == 40


def conducted(statuses: dict[str, list[dict[str, Any]]]) -> Conductor:
    """A 2-round classification run's conductor that received each agent's statuses (round
    record after round record)."""
    config = ExperimentConfig(
        dataset="digits", agents=len(statuses), learning=preset("dadpfl", rounds=2, neighbours=1)
    )
    wire = Wire()
    conductor = Conductor(
        fleet=FLEET, roster=sorted(statuses), config=config, transport=wire, run_id=RUN
    )
    conductor.start()
    try:
        for agent, rows in statuses.items():
            for row in rows:
                metrics = {"metric": "accuracy"} | row
                round_ = row["record"]["round"] if isinstance(row.get("record"), dict) else 1
                wire.handlers[topics.status(FLEET)](*status(agent, metrics, round=round_))
    finally:
        conductor.close(clear=False)
    return conductor


def test_a_members_absurd_records_never_build_the_report() -> None:
    """Records whose accuracy is text (which crashed the report's summary), that lack a
    figure (which crashed it too), or that claim 1e300 or, as "mae", 0.9e11."""
    honest = [{"record": record("a", t, accuracy=0.5)} for t in (1, 2)]
    conductor = conducted(
        {
            "a": honest,
            "b": [{"record": record("b", 1, accuracy="x")}],
            "c": [{"record": {k: v for k, v in record("c", 1).items() if k != "loss"}}],
            "d": [{"record": record("d", 1, accuracy=1e300)}, {"error": "e" * 900_000}],
            "e": [{"metric": "mae", "record": record("e", 1, accuracy=9e10)}],
        }
    )
    records = conductor.records()
    assert list(records["a"]) == [1, 2] and not any(records[k] for k in "bcde")
    assert conductor.agents["d"].error == ""
    report = assemble_report(conductor.config, conductor.roster, records, [], 1.0)
    assert report["summary"]["mean_accuracy"] == pytest.approx(0.5)


def test_honest_statuses_pass_unchanged() -> None:
    row = record("a", 2, energy_j=1.5, radio_energy_j=0.1, energy_source="modelled",
                 reduction="prefix+steps", reduction_why="prefix: meets 12 s; width over memory",
                 train_s=12.3, predicted_s=11.0, peak_memory_mb=96.0, kept="local",
                 kept_why="local 0.81 > fleet 0.77", strategy_accuracy=0.77, t_star=None,
                 stragglers=["b"], quarantined=["c"], limited_by="time (floored)",
                 finished_at=time.time(), vote=True, score=0.2, stopped=True)  # fmt: skip
    saved = early_stop_savings([row], 2, 10)
    metrics = (
        {k: row[k] for k in STATUS_FIGURES}
        | {"metric": "accuracy", "record": row, "records": [row], "saved": saved, "votes": "01"}
        | {"strategy": "./strategies/fedavg_momentum.py:FedAvgM"}
        | {"data": {"samples": 200, "shape": [40], "labels": [0, 1]}, "later": {"any": [1]}}
    )
    assert status_figures.checked(metrics, 2) == (metrics, [])
    idle = {"last_run": {"run_id": RUN, "state": "done", "round": 2, "records": [row]}}
    assert status_figures.checked(idle, 0) == (idle, [])
    regression = {"metric": "mae", "accuracy": 123.4, "record": record("a", 2, accuracy=123.4)}
    assert status_figures.checked(regression, 2) == (regression, [])
    # The header's strategy: a name or an import path, never markup the table would obey.
    kept, problems = status_figures.checked({"strategy": "[bold]fedavg"}, 2)
    assert kept == {} and [name for name, _ in problems] == ["strategy"]


def test_the_round_bound_is_the_runs() -> None:
    assert status_figures.MAX_ROUNDS == MAX_ROUNDS


@pytest.fixture
def broker(unused_port: int) -> Iterator[tuple[str, MqttTransport]]:
    with (
        EmbeddedBroker("127.0.0.1", unused_port) as embedded,
        MqttTransport(embedded.address) as publisher,
    ):
        assert publisher.wait_connected(10)
        yield str(embedded.address), publisher


def test_coordinator_status_shows_the_fleet_and_says_why_it_ignored_a_figure(broker) -> None:
    """The real command on a real broker, a member's retained status carrying markup (which
    crashed it with a traceback) and an accuracy of 1e300."""
    address, publisher = broker
    for topic, payload in fleet_with({"limited_by": "[/]", "accuracy": 1e300}):
        assert publisher.publish(topic, payload, retain=True).wait_for_publish(10)
    result = subprocess.run(
        [*COORDINATOR, "status", "--broker", address, "--wait", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert "0.700" in result.stdout and "1e+300" not in result.stdout
    told = [line for line in result.stderr.splitlines() if "agent lab/x's status" in line]
    assert len(told) == 2, result.stderr
    assert "'accuracy' must be a number in [0, 1], got 1e+300 - ignored" in result.stderr
