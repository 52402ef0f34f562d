"""Staleness and time to target made visible (issue 49, point 4): the report's summary per
agent, the status's field on the wire and in the fleet table, the dashboard's state, page
and `/metrics`, and the time the fleet first reached a target accuracy, all from records
and statuses built here (the asynchronous rounds that fill them are tested where they run)."""

from __future__ import annotations

import io
import json
import math
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgpack
import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from agent.report import summarize
from agent.runtime.session import Session, telemetry_json
from agent.time_to_target import TOLERANCE, time_to_target, with_time_to_target
from coordinator.cli import main as coordinator
from coordinator.cli_shared import summary_table
from coordinator.dashboard import Dashboard, FleetState
from coordinator.dashboard.metrics import registry_for
from coordinator.fleet import FleetView, fleet_table
from protocol import ProtocolError, messages, topics
from protocol.version import PROTOCOL_VERSION
from tests.test_dashboard import FLEET, RUN, presence, record

pytestmark = pytest.mark.timeout(60)


def entry(accuracy: float, **figures: Any) -> dict[str, Any]:
    """An agent's entry in a report's round (the figures `summarize` reads)."""
    return {
        "accuracy": accuracy,
        "sparsity": 0.0,
        "bytes_sent": 10,
        "bytes_received": 10,
        "train_flops": 100,
        **figures,
    }


def rounds_of(*agents: dict[int, dict[str, Any]], names: str = "ab") -> list[dict[str, Any]]:
    """Report rounds from each agent's entries by round (an agent without round t is left
    out of it, as assemble_report leaves out one that has not reported it)."""
    count = max(max(a) for a in agents)
    return [
        {
            "round": t,
            "agents": {name: a[t] for name, a in zip(names, agents, strict=True) if t in a},
        }
        for t in range(1, count + 1)
    ]


# ------------------------------------------------------------------------- the summary


def test_the_summary_gives_each_agents_mean_and_max_staleness() -> None:
    rounds = rounds_of(
        {1: entry(0.5, staleness=0.0), 2: entry(0.6, staleness=2.0), 3: entry(0.7, staleness=1.0)},
        {1: entry(0.5, staleness=None), 2: entry(0.6, staleness=4.0), 3: entry(0.7)},
    )
    staleness = summarize(rounds, None, 1.0)["staleness"]
    assert staleness["by_agent"] == {"a": {"mean": 1.0, "max": 2.0}, "b": {"mean": 4.0, "max": 4.0}}
    assert staleness["mean"] == pytest.approx(7.0 / 4) and staleness["max"] == 4.0


def test_a_synchronous_runs_summary_has_no_staleness() -> None:
    rounds = rounds_of(
        {1: entry(0.5, staleness=None), 2: entry(0.6)}, {1: entry(0.5), 2: entry(0.6)}
    )
    assert "staleness" not in summarize(rounds, None, 1.0)


def test_a_stopped_agents_idle_rounds_take_nothing_in() -> None:
    stale = record("a", 2, 0.5, staleness=3.0)
    assert stale.idle(3).staleness is None, "an idle round counts in no mean"
    assert stale.report_entry()["staleness"] == 3.0 and "finished_at" in stale.report_entry()


# ------------------------------------------------------------------------- time to target


def stamped(start: float = 1000.0) -> list[dict[str, Any]]:
    """Two agents, three rounds: a is quick, b slow; the fleet's mean after each finish is
    (a's latest + b's latest) / 2 once both have finished a round."""
    return rounds_of(
        {
            1: entry(0.4, finished_at=start + 1),
            2: entry(0.8, finished_at=start + 2),
            3: entry(0.9, finished_at=start + 3),
        },
        {
            1: entry(0.5, finished_at=start + 5),
            2: entry(0.7, finished_at=start + 10),
            3: entry(0.8, finished_at=start + 15),
        },
    )


def test_time_to_target_is_the_first_finish_after_which_the_fleets_mean_reaches_it() -> None:
    reach = time_to_target(stamped(), 1000.0, 0.7)
    # At 5 s b's first round joins a's round 3 (0.9): mean 0.7, there.
    assert (reach["seconds"], reach["round"], reach["given"], reach["timed"]) == (
        5.0,
        1,
        True,
        True,
    )
    later = time_to_target(stamped(), 1000.0, 0.8)
    assert (later["seconds"], later["round"]) == (10.0, 2), "0.9 and 0.7"


def test_a_target_never_reached_has_no_time() -> None:
    reach = time_to_target(stamped(), 1000.0, 0.95)
    assert reach["timed"] and reach["seconds"] is None and reach["round"] is None


def test_without_a_target_it_is_the_final_fleet_accuracy_less_half_a_point() -> None:
    reach = time_to_target(stamped(), 1000.0)
    assert reach["target"] == pytest.approx(0.85 - TOLERANCE) and not reach["given"]
    assert (reach["seconds"], reach["round"]) == (15.0, 3)


def test_records_without_time_stamps_have_no_time() -> None:
    unstamped = rounds_of({1: entry(0.9), 2: entry(0.9)}, {1: entry(0.9), 2: entry(0.9)})
    reach = time_to_target(unstamped, 0.0, 0.5)
    assert not reach["timed"] and reach["seconds"] is None


def test_an_agent_that_finished_nothing_yet_counts_with_its_first_model_from_the_start() -> None:
    """FedBuff's device that has delivered no update yet has an entry without a time stamp
    (the model it started with): the fleet's figure counts it from the start, rather than
    having no time at all."""
    partly = stamped()
    partly[0]["agents"]["b"] = {**partly[0]["agents"]["b"], "finished_at": None, "accuracy": 0.1}
    reach = time_to_target(partly, 1000.0, 0.5)
    # b's first model (0.1) from the start; a's rounds at 1, 2, 3 s: means 0.25, 0.45, 0.5
    assert (reach["timed"], reach["seconds"], reach["round"]) == (True, 3.0, 3)


def test_a_lower_is_better_metric_reaches_its_target_by_falling_to_it() -> None:
    rounds = rounds_of(
        {1: entry(3.0, finished_at=1.0), 2: entry(1.0, finished_at=2.0)},
        {1: entry(3.0, finished_at=1.5), 2: entry(1.0, finished_at=4.0)},
    )
    report = {
        "rounds": [
            {**r, "agents": {k: {"mae": a.pop("accuracy"), **a} for k, a in r["agents"].items()}}
            for r in rounds
        ],
        "summary": {"metric": {"name": "mae", "higher_is_better": False}},
    }
    reach = with_time_to_target(report, 1.5, 0.0)["summary"]["time_to_target"]
    assert (reach["seconds"], reach["round"]) == (4.0, 2)
    final = with_time_to_target(report, None)["summary"]["time_to_target"]
    assert final["target"] == pytest.approx(1.0 + TOLERANCE) and final["started_at"] == 0.0


def test_the_summary_table_shows_time_to_target_and_staleness() -> None:
    rounds = stamped()
    for t, r in enumerate(rounds, start=1):
        r["agents"]["a"]["staleness"] = float(t)
    summary = summarize(rounds, None, 16.0)
    report = {
        "config": {"agents": 2, "learning": {"strategy": "dadpfl", "rounds": 3}},
        "rounds": rounds,
        "summary": summary,
    }
    with_time_to_target(report, 0.8, 1000.0)
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(summary_table(report))
    shown = console.export_text()
    assert "time to mean accuracy >= 0.8000" in shown and "10.0 s (round 2)" in shown
    assert "staleness (mean / max rounds)" in shown and "2.00 / 3" in shown
    report["summary"]["time_to_target"]["timed"] = False
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(summary_table(report))
    assert "time to" not in console.export_text(), "no time stamps: no row"


@pytest.mark.parametrize(
    "target, error",
    [("80", "--target-accuracy is a share of 1 for accuracy (0.8 for 80 %), got 80"),
     ("nan", "--target-accuracy")],
)  # fmt: skip
def test_a_target_accuracy_that_cannot_be_one_is_a_one_line_error(target: str, error: str) -> None:
    result = CliRunner().invoke(
        coordinator, ["simulate", "--agents", "2", "--rounds", "1", "--target-accuracy", target]
    )
    assert result.exit_code == 2 and error in result.output, result.output
    assert "Traceback" not in result.output


# ------------------------------------------------------------------------- the status


def encoded_status(staleness: float | None, agent: str = "a") -> bytes:
    return messages.encode(
        messages.Status(
            fleet=FLEET,
            sender=agent,
            run_id=RUN,
            round=3,
            state="training",
            metrics={"accuracy": 0.5},
            staleness=staleness,
        )
    )


def test_the_status_carries_staleness_across_the_codec() -> None:
    decoded = messages.decode(encoded_status(1.5))
    assert isinstance(decoded, messages.Status) and decoded.staleness == 1.5


def test_a_status_from_before_the_field_decodes_and_a_synchronous_one_is_its_bytes() -> None:
    body = {"state": "training", "metrics": {"accuracy": 0.5}}
    old = msgpack.packb([PROTOCOL_VERSION, "status", FLEET, "a", RUN, 3, body, None])
    decoded = messages.decode(old)
    assert isinstance(decoded, messages.Status) and decoded.staleness is None
    assert encoded_status(None) == old


@pytest.mark.parametrize("bad", [math.inf, "1", True])
def test_a_staleness_that_is_no_number_is_refused(bad: Any) -> None:
    body = {"state": "training", "staleness": bad}
    with pytest.raises(ProtocolError, match="staleness"):
        messages.decode(msgpack.packb([PROTOCOL_VERSION, "status", FLEET, "a", RUN, 3, body, None]))


class Published:
    """A transport that keeps what is published."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    def publish(self, topic: str, payload: bytes, **_: Any) -> None:
        self.sent.append((topic, payload))


def test_the_session_publishes_its_latest_rounds_staleness() -> None:
    transport = Published()
    session = SimpleNamespace(
        header=lambda round_: {"fleet": FLEET, "sender": "a", "run_id": RUN, "round": round_},
        learner=SimpleNamespace(prunes_further=False),
        stopped_round=None,
        transport=transport,
        fleet=FLEET,
        me="a",
        key=None,
        telemetry=False,
        dozing=SimpleNamespace(shown=None),
    )
    for round_, staleness in ((3, 2.5), (4, None)):
        row = record("a", round_, 0.5, staleness=staleness).as_dict()
        metrics = {"accuracy": 0.5, "record": row}
        Session.status(session, "training", round_, metrics, {})  # type: ignore[arg-type]
    stale, synchronous = (messages.decode(payload) for _, payload in transport.sent)
    assert isinstance(stale, messages.Status) and stale.staleness == 2.5
    assert isinstance(synchronous, messages.Status) and synchronous.staleness is None
    assert json.loads(telemetry_json(stale, 1.0))["staleness"] == 2.5
    assert "staleness" not in json.loads(telemetry_json(synchronous, 1.0))


# ------------------------------------------------------------------------- fleet table, dashboard


def stale_fleet(staleness: dict[str, float | None]) -> FleetState:
    """A dashboard's fleet state fed each agent's status after its round 3."""
    state = FleetState(FLEET)
    for agent, figure in staleness.items():
        state.feed(*presence(agent))
        data = record(agent, 3, 0.8, staleness=figure).as_dict()
        message = messages.Status(
            fleet=FLEET, sender=agent, run_id=RUN, round=3, state="training",
            metrics={"accuracy": 0.8, "strategy": "dadpfl", "record": data}, staleness=figure,
        )  # fmt: skip
        state.feed(topics.status(FLEET, agent), messages.encode(message))
    return state


def table_text(staleness: dict[str, float | None]) -> str:
    view = FleetView()
    for agent, figure in staleness.items():
        view.feed(*presence(agent))
        view.feed(topics.status(FLEET, agent), encoded_status(figure, agent))
    console = Console(width=250, record=True, file=io.StringIO())
    console.print(fleet_table(view.entries()))
    return console.export_text()


def test_the_fleet_table_shows_staleness_only_when_an_agent_has_one() -> None:
    assert "staleness" not in table_text({"a": None})
    shown = table_text({"a": 1.25})
    assert "staleness" in shown and "1.2" in shown


def test_an_implausible_staleness_is_left_out_of_the_fleet_view() -> None:
    view = FleetView()
    view.feed(topics.status(FLEET, "a"), encoded_status(1e12))
    (only,) = view.entries()
    assert "staleness" not in only.metrics


def test_the_dashboard_state_and_metrics_carry_each_agents_staleness() -> None:
    state = stale_fleet({"a": 2.0, "b": None})
    rows = {row["agent"]: row for row in state.snapshot(series=False)["agents"]}
    assert (rows["a"]["staleness"], rows["b"]["staleness"]) == (2.0, None)
    from prometheus_client import generate_latest

    body = generate_latest(registry_for(state)).decode()
    samples = {
        s.labels["agent"]: s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
        if s.name == "edgefl_agent_staleness_rounds"
    }
    assert samples == {"a": 2.0}, "b's round was synchronous: no sample"


PAGE = """JSON.stringify([...document.querySelectorAll("#fleet tbody [data-field=staleness]")]
  .map((td) => td.textContent))"""


def test_the_dashboard_page_shows_a_staleness_column(chromium: Any) -> None:
    served = Dashboard(stale_fleet({"a": 2.0, "b": None}), port=0)
    served.start()
    try:
        chromium.call("Page.navigate", url=served.url)
        cells: list[str] = []
        deadline = time.monotonic() + 10
        while not cells and time.monotonic() < deadline:
            cells = json.loads(chromium.evaluate(PAGE) or "[]")
            time.sleep(0.05)
    finally:
        served.stop()
    assert cells == ["2.0", "–"]


def test_simulate_writes_the_given_target_in_its_report(tmp_path: Path) -> None:
    """simulate's records have no time stamps until its virtual clock stamps them: the
    target is there, and no time."""
    path = tmp_path / "report.json"
    flags = ["--dataset", "digits", "--agents", "2", "--rounds", "2", "--strategy", "fedavg"]
    result = CliRunner().invoke(
        coordinator, ["simulate", *flags, "--target-accuracy", "0.5", "--report", str(path)]
    )
    assert result.exit_code == 0, result.output
    reach = json.loads(path.read_text())["summary"]["time_to_target"]
    assert (reach["target"], reach["given"], reach["timed"], reach["seconds"]) == (
        0.5, True, False, None,
    )  # fmt: skip
    assert "time to" not in result.output


def test_the_agents_round_line_says_its_staleness_only_when_it_has_one() -> None:
    from agent.service import AgentService

    said: list[str] = []
    agent = SimpleNamespace(say=said.append)
    for staleness in (1.5, None):
        row = record("a", 3, 0.5, staleness=staleness).as_dict()
        AgentService.report_round(agent, "accuracy", row)  # type: ignore[arg-type]
    assert said[0].endswith(", staleness 1.50") and "staleness" not in said[1], said


def test_simulate_says_its_time_to_target_is_on_the_virtual_clock(tmp_path: Path) -> None:
    """An asynchronous simulated run is placed on the virtual clock: its time to target is
    in virtual seconds, and the summary table says so rather than passing them for wall
    time."""
    path = tmp_path / "report.json"
    flags = ["--dataset", "digits", "--agents", "4", "--rounds", "2", "--strategy", "dfedavgm"]
    result = CliRunner().invoke(
        coordinator,
        ["simulate", *flags, "--asynchronous", "--target-accuracy", "0", "--report", str(path)],
    )
    assert result.exit_code == 0, result.output
    reach = json.loads(path.read_text())["summary"]["time_to_target"]
    assert (reach["timed"], reach["clock"], reach["round"]) == (True, "virtual", 1)
    assert "virtual s (round 1)" in result.output
