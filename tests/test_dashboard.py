"""The dashboard: the fleet state it folds from real encoded messages, its HTTP routes on a
real uvicorn server (JSON, server-sent events, Prometheus, the access token), and the page
itself in headless Chromium during an emulated run with early stopping."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import http.client
import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.sync.client import connect as websocket_connect

from agent.options import experiment_config
from agent.report import AgentRound, early_stop_savings
from agent.runtime.session import STATUS_FIGURES
from coordinator.broker import EmbeddedBroker
from coordinator.dashboard import Dashboard, FleetState
from coordinator.dashboard import state as state_module
from coordinator.dashboard.state import number
from coordinator.emulate import Emulation, EmulationOptions
from protocol import MqttTransport, messages, topics
from protocol.signing import FleetKey

REPO = Path(__file__).resolve().parent.parent
FLEET = "lab"
RUN = "run-0001"
TOKEN = "s3cret-Token_1"

pytestmark = pytest.mark.timeout(120)


def presence(
    agent: str, online: bool = True, *, role: str = "agent", key: FleetKey | None = None
) -> tuple[str, bytes]:
    message = messages.Presence(
        fleet=FLEET, sender=agent, online=online, since=time.time() - 90, role=role
    )
    return topics.presence(FLEET, agent), messages.encode(message, key=key)


def record(agent: str, round_: int, accuracy: float, **figures: Any) -> AgentRound:
    row = AgentRound(
        round_, agent, accuracy, loss=2.0 - accuracy, train_loss=1.5, sparsity=0.5,
        bytes_sent=1000 * round_,
    )  # fmt: skip
    return dataclasses.replace(row, **figures)


def status(
    row: AgentRound,
    *,
    run_id: str = RUN,
    stopped: bool = False,
    limit: int = 6,
    strategy: str = "dadpfl",
) -> tuple[str, bytes]:
    """The status an agent publishes after the round `row` (as Session.finish_round)."""
    data = row.as_dict()
    saved = {"saved": early_stop_savings([data], row.round, limit)} if stopped else {}
    figures = {k: data[k] for k in STATUS_FIGURES} | {"strategy": strategy}
    message = messages.Status(
        fleet=FLEET,
        sender=row.agent,
        run_id=run_id,
        round=row.round,
        state="stopped" if stopped else "training",
        metrics=figures | saved | {"record": data},
        stopped=stopped,
    )
    return topics.status(FLEET, row.agent), messages.encode(message)


def fed_state() -> FleetState:
    """Two agents two rounds in (b stopped early after round 2) and the coordinator."""
    state = FleetState(FLEET)
    for topic, payload in (
        presence("a"),
        presence("b"),
        presence("coordinator", role="coordinator"),
        status(record("a", 1, 0.5, bytes_received=300, energy_j=2.0)),
        status(record("a", 2, 0.75, bytes_received=400, p_k=0.5, limited_by="time", energy_j=3.0)),
        status(record("a", 2, 0.1, p_k=0.5, limited_by="time", energy_j=9.0)),  # round 2 again
        status(record("b", 1, 0.25, stragglers=["a"])),
        status(record("b", 2, 0.5, train_flops=7000, stopped=True), stopped=True),
    ):
        state.feed(topic, payload)
    return state


def rows_by_agent(snapshot: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["agent"]: row for row in snapshot["agents"]}


def test_the_snapshot_holds_the_table_and_each_agents_rounds() -> None:
    snapshot = fed_state().snapshot()
    json.dumps(snapshot, allow_nan=False)
    a, b = rows_by_agent(snapshot)["a"], rows_by_agent(snapshot)["b"]
    assert [m["agent"] for m in snapshot["members"]] == ["coordinator"]
    assert (a["presence"], a["state"], a["round"], a["run_id"]) == ("online", "training", 2, RUN)
    assert (a["p_k"], a["limited_by"], a["loss"]) == (0.5, "time", pytest.approx(1.9))
    assert a["accuracy"] == 0.1  # the table shows the latest status...
    assert a["series"]["rounds"] == [1, 2]
    assert a["series"]["accuracy"] == [0.5, 0.75]  # ...the series the first copy of a round
    assert a["series"]["bytes_received"] == [300, 400]
    assert (a["bytes_sent"], a["bytes_received"]) == (3000, 700)
    assert a["energy_j"] == 9.0 and a["energy_total_j"] == 5.0  # latest figure; first copies
    assert a["series"]["energy_j"] == [2.0, 3.0]
    assert b["energy_j"] is None and b["energy_total_j"] is None, "no profile, no energy"
    assert not a["stopped"] and a["saved"] is None
    assert b["stopped"] and b["state"] == "stopped"
    assert b["saved"] == {
        "round": 2,
        "rounds": 4,
        "flops": 4 * 7000,
        "bytes": 4 * 2000,
        "energy_j": None,
    }
    assert b["stragglers"] == []  # its latest round had none
    assert snapshot["fleets"] == [
        {
            "fleet": FLEET,
            "agents": 2,
            "online": 2,
            "stopped": 1,
            "round": 2,
            "mean_accuracy": pytest.approx(0.3),
            "metric": "accuracy",
            "run_id": RUN,
            "strategy": "dadpfl",
        }
    ]


def idle(agent: str, run_id: str) -> tuple[str, bytes]:
    """The status of an agent back to idle after run `run_id`: round 0, no figures."""
    message = messages.Status(fleet=FLEET, sender=agent, run_id=run_id, round=0, state="idle")
    return topics.status(FLEET, agent), messages.encode(message)


def test_the_fleet_says_its_run_and_strategy_after_the_run_too() -> None:
    """The page's header: the run most agents are in and its strategy, still there once
    they are idle (whose statuses name no strategy), and the next run's once it starts."""
    state = FleetState(FLEET)
    for agent in ("a", "b"):
        state.feed(*status(record(agent, 1, 0.5), strategy="fedavg"))
        state.feed(*idle(agent, RUN))
    (fleet,) = state.snapshot()["fleets"]
    assert (fleet["run_id"], fleet["strategy"]) == (RUN, "fedavg")
    state.feed(*status(record("a", 1, 0.5), run_id="run-0002", strategy="fedspu"))
    state.feed(*status(record("b", 1, 0.5), run_id="run-0002", strategy="fedspu"))
    (fleet,) = state.snapshot()["fleets"]
    assert (fleet["run_id"], fleet["strategy"]) == ("run-0002", "fedspu")


def test_figures_that_are_not_finite_numbers_become_none() -> None:
    state = FleetState()
    bad = messages.Status(
        fleet=FLEET,
        sender="x",
        round=3,
        state="training",
        metrics={"accuracy": "high", "p_k": True, "stragglers": "a", "record": {"loss": []}},
    )
    state.feed(topics.status(FLEET, "x"), messages.encode(bad))
    row = rows_by_agent(state.snapshot())["x"]
    assert (row["accuracy"], row["p_k"], row["loss"], row["stragglers"]) == (None, None, None, [])
    assert row["presence"] == "unknown"
    json.dumps(state.snapshot(), allow_nan=False)
    assert [number(v) for v in (float("nan"), float("inf"), 10**400, 3)] == [None, None, None, 3.0]


def test_other_fleets_forged_messages_and_cleared_agents() -> None:
    key = FleetKey(b"k" * 32)
    state = FleetState(FLEET, key=key)
    state.feed(*presence("a", key=key))
    version = state.version
    state.feed(topics.presence("other", "z"), presence("z", key=key)[1])
    state.feed(*presence("b", key=FleetKey(b"wrong" * 8)))
    assert state.version == version and state.rejected == 1
    assert list(rows_by_agent(state.snapshot())) == ["a"]
    state.feed(topics.presence(FLEET, "a"), b"")  # its retained presence cleared: forgotten
    assert state.snapshot()["agents"] == [] and state.version == version + 1


def test_a_new_run_starts_the_series_anew_and_the_series_are_bounded(monkeypatch) -> None:
    monkeypatch.setattr(state_module, "MAX_ROUNDS", 3)
    monkeypatch.setattr(state_module, "MAX_AGENTS", 2)
    state = FleetState()
    for round_ in range(1, 6):
        state.feed(*status(record("a", round_, 0.1 * round_)))
    series = rows_by_agent(state.snapshot())["a"]["series"]
    assert series["rounds"] == [3, 4, 5]
    assert rows_by_agent(state.snapshot())["a"]["bytes_sent"] == 15000  # totals keep all
    state.feed(*status(record("a", 1, 0.9), run_id="run-0002"))
    assert rows_by_agent(state.snapshot())["a"]["series"]["accuracy"] == [0.9]
    state.feed(*presence("b"))
    state.feed(*presence("c"))  # a third member: beyond the bound
    assert list(rows_by_agent(state.snapshot())) == ["a", "b"] and state.dropped == 1


def test_readers_wait_for_the_next_change() -> None:
    state = FleetState()
    started = time.monotonic()
    assert state.wait_for_change(0, timeout_s=0.1) == 0
    assert time.monotonic() - started < 1
    timer = threading.Timer(0.1, state.feed, presence("a"))
    timer.start()
    assert state.wait_for_change(0, timeout_s=5) == 1
    timer.join()


# ----------------------------------------------------------------------------- HTTP


def request(
    url: str, path: str, headers: dict[str, str] | None = None
) -> tuple[int, http.client.HTTPMessage, bytes]:
    """(status, headers, body) of a GET, redirects not followed."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=10)
    try:
        connection.request("GET", path, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.headers, response.read()
    finally:
        connection.close()


@pytest.fixture
def dashboard() -> Iterator[Dashboard]:
    served = Dashboard(fed_state(), port=0)
    served.start()
    yield served
    served.stop()


def test_the_page_and_its_assets_ship_with_the_package(dashboard: Dashboard) -> None:
    code, headers, body = request(dashboard.url, "/")
    assert code == 200 and headers["content-type"].startswith("text/html")
    links = re.findall(r'(?:src|href)="([^"]+)"', body.decode())
    assert "static/uPlot.iife.min.js" in links and "static/app.js" in links
    for link in links:  # no CDN: every asset is a relative path this server answers
        assert "//" not in link, link
        assert request(dashboard.url, "/" + link)[0] == 200, link


def test_api_fleet_serves_the_snapshot(dashboard: Dashboard) -> None:
    code, headers, body = request(dashboard.url, "/api/fleet")
    assert code == 200 and headers["content-type"] == "application/json"
    served = json.loads(body)
    assert served["agents"] == dashboard.state.snapshot()["agents"]


INLINED = re.compile(r'<script id="snapshot" type="application/json">(.*?)</script>', re.S)


def test_the_page_carries_the_fleet_as_it_was_served() -> None:
    """The page shows the fleet from its first paint, not after its event stream's first
    event (before it: "connecting" and empty charts); no text an agent sends ends the
    script element that carries it."""
    state = fed_state()
    hostile = "</script><script>document.title = 'owned'</script><!--"
    failed = messages.Status(
        fleet=FLEET, sender="c", round=1, state="failed", metrics={"error": hostile}
    )
    state.feed(topics.status(FLEET, "c"), messages.encode(failed))
    served = Dashboard(state, port=0)
    served.start()
    try:
        page = request(served.url, "/")[2].decode()
    finally:
        served.stop()
    (inlined,) = INLINED.findall(page)
    assert "<" not in inlined
    snapshot = json.loads(inlined)
    assert snapshot["agents"] == state.snapshot()["agents"]
    assert rows_by_agent(snapshot)["c"]["error"] == hostile
    assert rows_by_agent(snapshot)["a"]["series"]["rounds"] == [1, 2]


def test_metrics_in_the_prometheus_format(dashboard: Dashboard) -> None:
    code, headers, body = request(dashboard.url, "/metrics")
    assert code == 200 and headers["content-type"].startswith("text/plain; version=")
    samples = {
        (s.name, s.labels.get("agent", "")): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
        if s.labels.get("fleet", FLEET) == FLEET
    }
    assert samples[("edgefl_agent_round", "a")] == 2
    assert samples[("edgefl_agent_accuracy", "b")] == 0.5
    assert samples[("edgefl_agent_metric", "b")] == 0.5, "the task's metric, named accuracy"
    assert samples[("edgefl_agent_bytes_sent_total", "a")] == 3000
    assert samples[("edgefl_agent_bytes_received_total", "a")] == 700
    assert samples[("edgefl_agent_p_k", "a")] == 0.5
    assert samples[("edgefl_agent_training_energy_joules_total", "a")] == 5.0, "first copy wins"
    assert ("edgefl_agent_training_energy_joules_total", "b") not in samples, "no profile"
    assert samples[("edgefl_agent_stopped", "a")] == 0
    assert samples[("edgefl_agent_stopped", "b")] == 1
    assert samples[("edgefl_agent_saved_rounds", "b")] == 4
    assert ("edgefl_agent_saved_rounds", "a") not in samples
    assert samples[("edgefl_agent_online", "b")] == 1
    assert ("edgefl_agent_online", "coordinator") not in samples
    assert samples[("edgefl_fleet_agents_online", "")] == 2
    assert samples[("edgefl_fleet_agents_stopped", "")] == 1
    assert samples[("edgefl_fleet_mean_accuracy", "")] == pytest.approx(0.3)


def test_with_a_token_every_route_needs_it() -> None:
    served = Dashboard(FleetState(), host="127.0.0.1", port=0, token=TOKEN)
    served.start()
    try:
        for path in ("/", "/api/fleet", "/api/events", "/metrics", "/static/app.js"):
            assert request(served.url, path)[0] == 401, path
        assert request(served.url, "/metrics", {"Authorization": "Bearer nope"})[0] == 401
        assert request(served.url, "/metrics", {"Authorization": f"Bearer {TOKEN}"})[0] == 200
        assert request(served.url, f"/api/fleet?token={TOKEN}")[0] == 200
        code, headers, _ = request(served.url, f"/?token={TOKEN}")
        assert code == 303 and headers["location"] == "./"  # the token leaves the address
        cookie = headers["set-cookie"].split(";")[0]
        assert "HttpOnly" in headers["set-cookie"]
        assert request(served.url, "/static/app.js", {"Cookie": cookie})[0] == 200
        assert request(served.url, "/", {"Cookie": cookie})[0] == 200
    finally:
        served.stop()


def test_beyond_loopback_it_needs_a_token() -> None:
    with pytest.raises(ValueError, match="reachable from other machines.*access token"):
        Dashboard(FleetState(), host="0.0.0.0")
    with pytest.raises(ValueError, match="access token must be"):
        Dashboard(FleetState(), host="0.0.0.0", token="has space")
    Dashboard(FleetState(), host="0.0.0.0", token=TOKEN)
    Dashboard(FleetState(), host="localhost")
    Dashboard(FleetState(), host="::1")


def test_a_taken_port_is_a_one_line_error(dashboard: Dashboard) -> None:
    with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{dashboard.port}"):
        Dashboard(FleetState(), port=dashboard.port).start()


def next_event(response: http.client.HTTPResponse) -> dict[str, Any]:
    """The data of the next `snapshot` event of a server-sent event stream."""
    event = ""
    while True:
        line = response.readline().decode()
        assert line, "the stream ended"
        if line.startswith("event: "):
            event = line[7:].strip()
        elif line.startswith("data: ") and event == "snapshot":
            data: dict[str, Any] = json.loads(line[6:])
            return data


def test_events_push_every_change_and_end_when_the_dashboard_stops() -> None:
    state = FleetState()
    served = Dashboard(state, port=0)
    served.start()
    connection = http.client.HTTPConnection("127.0.0.1", served.port, timeout=10)
    try:
        connection.request("GET", "/api/events")
        response = connection.getresponse()
        assert response.headers["content-type"].startswith("text/event-stream")
        assert next_event(response)["agents"] == []
        state.feed(*status(record("a", 1, 0.5)))
        pushed = next_event(response)
        assert pushed["version"] == 1 and pushed["agents"][0]["accuracy"] == 0.5
        started = time.monotonic()
        served.stop()
        assert time.monotonic() - started < 3, "a connected stream held the shutdown up"
        assert response.read().strip() == b""  # the stream ended cleanly, no more events
    finally:
        connection.close()
        served.stop()


# ----------------------------------------------------------------------------- the page


class Chromium:
    """Headless Chromium driven over the DevTools protocol (one page, one websocket)."""

    def __init__(self, binary: str, profile: Path) -> None:
        self.process = subprocess.Popen(
            [binary, "--headless=new", "--disable-gpu", "--no-sandbox", "--no-first-run"]
            + ["--remote-debugging-port=0", f"--user-data-dir={profile}"]
            + ["--window-size=1400,1200", "--hide-scrollbars", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its helper processes go with it in close()
        )
        port = self._wait_for_port(profile / "DevToolsActivePort")
        pages = json.loads(request(f"http://127.0.0.1:{port}", "/json/list")[2])
        url = next(p["webSocketDebuggerUrl"] for p in pages if p["type"] == "page")
        self.socket = websocket_connect(url, max_size=None, open_timeout=10)
        self._ids = 0

    def _wait_for_port(self, path: Path) -> int:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if path.exists() and (lines := path.read_text().split()):
                return int(lines[0])
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        self.close()
        pytest.fail("chromium did not open its DevTools port")

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._ids += 1
        self.socket.send(json.dumps({"id": self._ids, "method": method, "params": params}))
        while True:
            reply = json.loads(self.socket.recv(timeout=20))
            if reply.get("id") == self._ids:
                assert "error" not in reply, reply
                result: dict[str, Any] = reply["result"]
                return result

    def evaluate(self, expression: str) -> Any:
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)[
            "result"
        ].get("value")

    def screenshot(self, path: Path) -> None:
        size = self.call("Page.getLayoutMetrics")["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
        shot = self.call("Page.captureScreenshot", captureBeyondViewport=True, clip=clip)
        path.write_bytes(base64.b64decode(shot["data"]))

    def close(self) -> None:
        if getattr(self, "socket", None) is not None:
            self.socket.close()
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(10)


PAGE = """JSON.stringify({
  marker: window.edgeflMarker || null,
  charts: document.querySelectorAll('.chart canvas').length,
  rows: [...document.querySelectorAll('#fleet tbody tr')].map(tr => ({
    agent: tr.dataset.agent,
    round: Number(tr.querySelector('[data-field=round]').textContent),
    state: tr.querySelector('[data-field=state]').textContent,
  })),
  stopped: Object.fromEntries([...document.querySelectorAll('#stopped-list li')]
    .map(li => [li.dataset.agent, li.textContent])),
})"""


def wait_for_page(browser: Chromium, ready: Any, what: str, limit_s: float) -> dict[str, Any]:
    """The page's table once `ready(page)` holds (polled), or the test fails saying `what`."""
    deadline = time.monotonic() + limit_s
    while True:
        page: dict[str, Any] = json.loads(browser.evaluate(PAGE))
        if ready(page):
            return page
        if time.monotonic() > deadline:
            pytest.fail(f"the page never showed {what}: {page}")
        time.sleep(0.1)


@contextlib.contextmanager
def served_emulation(
    config: Any, port: int, options: EmulationOptions
) -> Iterator[tuple[Emulation, FleetState, Dashboard]]:
    """An emulation on an embedded broker at `port`, with a dashboard (on a port of its own)
    that follows its fleet; the dashboard stops at the end."""
    with EmbeddedBroker(port=port) as broker:
        emulation = Emulation(config, broker.address, options)
        state = FleetState(emulation.fleet)
        dashboard = Dashboard(state, port=0)
        with MqttTransport(broker.address) as transport:
            transport.subscribe(topics.presence(emulation.fleet), state.feed)
            transport.subscribe(topics.status(emulation.fleet), state.feed)
            assert transport.wait_subscribed(10)
            dashboard.start()
            try:
                yield emulation, state, dashboard
            finally:
                dashboard.stop()


def scrape(url: str) -> dict[tuple[str, str], float]:
    body = request(url, "/metrics")[2].decode()
    return {
        (s.name, s.labels.get("agent", "")): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }


def test_the_page_follows_an_emulated_run_live(
    chromium: Chromium, tmp_path: Path, unused_port: int
) -> None:
    """Acceptance: every agent appears, rounds advance with no reload, agents that stopped
    early show it with their savings; screenshots go to test-artifacts/dashboard/."""
    config = experiment_config(
        {
            "dataset": "mnist1d",
            "agents": 4,
            "rounds": 6,
            "early_stop": True,
            "stop_rule": "paper",
            "seed": 7,
        }
        | {"partition": "dirichlet:0.5", "neighbours": 3, "epochs": 1, "round_time_s": 0.01}
    )
    artifacts = REPO / "test-artifacts" / "dashboard"
    artifacts.mkdir(parents=True, exist_ok=True)
    options = EmulationOptions(workdir=tmp_path / "fleet", linger_s=10)
    with served_emulation(config, unused_port, options) as (emulation, _state, dashboard):
        report = watch_run(chromium, dashboard, emulation, artifacts)
    assert report["summary"]["failed_agents"] == {}


def watch_run(
    browser: Chromium, dashboard: Dashboard, emulation: Emulation, artifacts: Path
) -> dict[str, Any]:
    browser.call("Page.navigate", url=dashboard.url)
    wait_for_page(browser, lambda p: p["charts"] == 4, "its charts", 10)
    browser.evaluate("window.edgeflMarker = 'first load'")  # a reload would drop it
    reports: list[dict[str, Any]] = []
    runner = threading.Thread(target=lambda: reports.append(emulation.run()), daemon=True)
    runner.start()
    during = wait_for_page(
        browser,
        lambda p: len(p["rows"]) == 4 and any(r["round"] >= 1 for r in p["rows"]),
        "four agents training",
        60,
    )
    browser.screenshot(artifacts / "during-run.png")
    metrics = scrape(dashboard.url)
    assert {a for (name, a) in metrics if name == "edgefl_agent_round"} == set(emulation.roster)
    runner.join(90)
    assert reports, "the emulated run did not finish"
    stopped = {
        agent: saved
        for agent, saved in reports[0]["summary"]["stopped"].items()
        if saved["saved_rounds"] > 0
    }
    assert stopped, "no agent stopped early: the run's settings no longer show early stopping"
    final = wait_for_page(
        browser,
        lambda p: all(
            f"saved {s['saved_rounds']} round{'' if s['saved_rounds'] == 1 else 's'} "
            in p["stopped"].get(a, "")
            for a, s in stopped.items()
        ),
        "every early stop with its savings",
        10,
    )
    browser.screenshot(artifacts / "after-run.png")
    assert final["marker"] == "first load", "the page reloaded"
    assert {r["agent"] for r in final["rows"]} == set(emulation.roster)
    assert max(r["round"] for r in final["rows"]) > max(r["round"] for r in during["rows"])
    for row in final["rows"]:
        if row["agent"] in stopped:
            assert row["state"] == f"stopped after round {stopped[row['agent']]['round']}"
    return reports[0]


def test_a_regression_agents_metric_is_named_and_not_called_accuracy() -> None:
    from coordinator.dashboard.metrics import FleetCollector

    state = FleetState()
    row = {"fleet": FLEET, "agent": "r", "accuracy": 0.12, "metric": "mae"}
    empty = ("round", "loss", "sparsity", "p_k", "stopped", "online", "saved")
    counters = ("bytes_sent", "bytes_received", "train_flops", "energy_total_j")
    rows = [{**row, **dict.fromkeys(empty + counters)}]
    snapshot = {"agents": rows, "fleets": []}
    state.snapshot = lambda series=False: snapshot  # type: ignore[method-assign]
    families = {f.name: f for f in FleetCollector(state).collect()}
    assert families["edgefl_agent_accuracy"].samples == []
    (sample,) = families["edgefl_agent_metric"].samples
    assert sample.labels == {"fleet": FLEET, "agent": "r", "metric": "mae"}
    assert sample.value == 0.12
