"""A round's measured cost (training seconds against the cost table's prediction, peak
memory) and what the budget made it do, as the dashboard, `/metrics` and `coordinator
status` show them; an agent that does not report them (an older one) adds no series and no
column."""

from __future__ import annotations

import io
import json
import time
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from coordinator.dashboard import Dashboard, FleetState
from coordinator.dashboard.metrics import registry_for
from coordinator.fleet import FleetView, fleet_table
from protocol import messages, topics
from tests.test_dashboard import Chromium

FLEET = "lab"
WHY = "prefix: meets 12 s at the least accuracy cost; width over memory"
MEASURED = {
    "train_s": 12.3,
    "predicted_s": 11.0,
    "peak_memory_mb": 96.0,
    "reduction": "prefix+steps",
    "reduction_why": WHY,
}
"""What an agent that measures its rounds reports."""


def feed(sink: FleetState | FleetView, agent: str, figures: dict[str, Any]) -> None:
    """An online agent whose latest round (3) reported `figures`, in its status and record."""
    presence = messages.Presence(fleet=FLEET, sender=agent, online=True, since=time.time())
    sink.feed(topics.presence(FLEET, agent), messages.encode(presence))
    shown = {"accuracy": 0.5, "p_k": 0.5, **figures}
    status = messages.Status(
        fleet=FLEET,
        sender=agent,
        run_id="run-0001",
        round=3,
        state="training",
        metrics=shown | {"record": shown | {"round": 3, "agent": agent}},
    )
    sink.feed(topics.status(FLEET, agent), messages.encode(status))


def fleet(**agents: dict[str, Any]) -> FleetState:
    state = FleetState(FLEET)
    for agent, figures in agents.items():
        feed(state, agent, figures)
    return state


def samples(state: FleetState) -> dict[tuple[str, str], tuple[float, dict[str, str]]]:
    """(series name, agent) -> (value, labels) of what `/metrics` would serve."""
    body = generate_latest(registry_for(state)).decode()
    return {
        (s.name, s.labels.get("agent", "")): (s.value, s.labels)
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }


COST_SERIES = (
    "edgefl_agent_train_seconds",
    "edgefl_agent_predicted_train_seconds",
    "edgefl_agent_peak_training_memory_bytes",
    "edgefl_agent_prediction_error_ratio",
    "edgefl_agent_reduction_info",
)


def test_the_dashboard_rows_carry_the_latest_rounds_cost_and_reduction() -> None:
    rows = {r["agent"]: r for r in fleet(a=MEASURED, old={}).snapshot(series=False)["agents"]}
    a, old = rows["a"], rows["old"]
    assert (a["train_s"], a["predicted_s"], a["peak_memory_mb"]) == (12.3, 11.0, 96.0)
    assert (a["reduction"], a["reduction_why"]) == ("prefix+steps", WHY)
    assert (old["train_s"], old["predicted_s"], old["peak_memory_mb"]) == (None, None, None)
    assert (old["reduction"], old["reduction_why"]) == ("", "")


def test_metrics_give_the_measured_and_predicted_cost_and_the_reduction() -> None:
    served = samples(fleet(a=MEASURED, old={}))
    assert served["edgefl_agent_train_seconds", "a"][0] == 12.3
    assert served["edgefl_agent_predicted_train_seconds", "a"][0] == 11.0
    assert served["edgefl_agent_peak_training_memory_bytes", "a"][0] == 96 * 2**20
    assert served["edgefl_agent_prediction_error_ratio", "a"][0] == pytest.approx(1.3 / 11.0)
    value, labels = served["edgefl_agent_reduction_info", "a"]
    assert value == 1 and labels == {"fleet": FLEET, "agent": "a", "reduction": "prefix+steps"}
    assert not [name for name in COST_SERIES if (name, "old") in served], "nothing reported"


def test_without_a_prediction_only_the_measured_figures_are_served() -> None:
    unpredicted = {"train_s": 4.0, "predicted_s": None, "reduction": "none"}
    served = samples(fleet(a=unpredicted))
    assert served["edgefl_agent_train_seconds", "a"][0] == 4.0
    assert served["edgefl_agent_reduction_info", "a"][1]["reduction"] == "none"
    for name in COST_SERIES[1:4]:
        assert (name, "a") not in served


def table(state: FleetView) -> str:
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(fleet_table(state.entries()))
    return console.export_text()


def view(**agents: dict[str, Any]) -> FleetView:
    fleet_view = FleetView()
    for agent, figures in agents.items():
        feed(fleet_view, agent, figures)
    return fleet_view


def cells(text: str, agent: str) -> tuple[str, list[str]]:
    """The header line and the words of the agent's row of a printed table."""
    lines = text.splitlines()
    header = next(line for line in lines if "agent" in line and "presence" in line)
    row = next(line.split() for line in lines if line.split()[:1] == [agent])
    return header, row


def test_the_status_table_shows_measured_over_predicted_seconds_and_the_reduction() -> None:
    header, row = cells(table(view(a=MEASURED, old={})), "a")
    assert "train s" in header and "reduction" in header
    assert "12.3/11.0" in row and "prefix+steps" in row
    assert WHY not in table(view(a=MEASURED)), "the reason is too long for the table"


def test_the_status_table_has_no_cost_columns_when_no_agent_reports_them() -> None:
    header, _ = cells(table(view(a={}, b={})), "a")
    assert "train s" not in header and "reduction" not in header


def test_seconds_without_a_prediction_or_reduction_show_alone() -> None:
    text = table(view(a={"train_s": 0.0412, "predicted_s": None, "reduction": "none"}))
    header, row = cells(text, "a")
    assert "train s" in header and "0.041" in row
    assert not [word for word in row if "/" in word], "no prediction to divide by"
    assert "reduction" not in header, "no agent's budget reduced its round"


CELLS = """JSON.stringify(Object.fromEntries([...document.querySelectorAll('#fleet tbody tr')]
  .map(tr => [tr.dataset.agent, Object.fromEntries(['train_s', 'peak_memory', 'reduction']
    .map(f => [f, [tr.querySelector(`[data-field=${f}]`).textContent,
                   tr.querySelector(`[data-field=${f}]`).title]]))])))"""


def test_the_page_shows_seconds_against_the_prediction_memory_and_the_reduction(
    chromium: Chromium,
) -> None:
    dashboard = Dashboard(fleet(a=MEASURED, old={}), port=0)
    dashboard.start()
    try:
        chromium.call("Page.navigate", url=dashboard.url)
        deadline = time.monotonic() + 10
        while len(rows := json.loads(chromium.evaluate(CELLS) or "{}")) < 2:
            assert time.monotonic() < deadline, "the page never showed both agents"
            time.sleep(0.1)
    finally:
        dashboard.stop()
    assert rows["a"] == {
        "train_s": ["12.3 / 11.0", "+12 % against the prediction"],
        "peak_memory": ["96 MiB", ""],
        "reduction": ["prefix+steps", WHY],
    }
    assert rows["old"] == {
        "train_s": ["–", ""],
        "peak_memory": ["–", ""],
        "reduction": ["–", ""],
    }
