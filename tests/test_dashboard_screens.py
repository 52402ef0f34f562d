"""What the dashboard's page says of a real FedAvg run opened mid-run, in headless Chromium:
data at once (the page carries the fleet as served, and asks for it while its event stream
gets nothing through), the run and its strategy in the header, the sparsity axis 0 % to
100 % with its labels whole when every sparsity is 0, and no p_k for a strategy that budgets
nothing, there, in the agents' log lines and in the report; no staleness in synchronous
rounds, and the report's time to its final accuracy on the agents' clock."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agent.options import experiment_config
from coordinator.dashboard import Dashboard, FleetState
from coordinator.emulate import Emulation, EmulationOptions
from tests.test_dashboard import Chromium, served_emulation

pytestmark = pytest.mark.timeout(180)

PAGE = """(() => {
  const cells = (field) => [...document.querySelectorAll(`#fleet tbody [data-field=${field}]`)]
    .map((td) => td.textContent);
  const plotted = typeof charts === "undefined" ? {} : charts;
  const sparsity = plotted["chart-sparsity"] && plotted["chart-sparsity"].plot;
  let axis = null;
  if (sparsity) {
    const y = sparsity.axes[1];
    sparsity.ctx.font = y.font[0];
    const widest = Math.max(...y._values.map((v) => sparsity.ctx.measureText(v).width));
    axis = { min: sparsity.scales.y.min, max: sparsity.scales.y.max, labels: y._values,
      fits: y._size >= widest / devicePixelRatio };
  }
  return JSON.stringify({
    ready: document.readyState,
    badge: document.getElementById("connection").textContent,
    run: document.getElementById("run").textContent,
    rounds: cells("round").map(Number),
    p_k: cells("p_k"),
    staleness: cells("staleness"),
    points: Object.fromEntries(Object.entries(plotted).map(([id, chart]) =>
      [id, chart.plot.data.slice(1).map((s) => s.filter((v) => v != null).length)])),
    axis,
  });
})()"""


def page_when(browser: Chromium, ready: Callable[[dict[str, Any]], bool], limit_s: float) -> Any:
    """The page's figures once `ready(page)` holds (polled), or the last ones seen."""
    deadline = time.monotonic() + limit_s
    while True:
        page: dict[str, Any] = json.loads(browser.evaluate(PAGE) or "{}")
        if (page and ready(page)) or time.monotonic() > deadline:
            return page
        time.sleep(0.05)


def wait_for_round(state: FleetState, round_: int, limit_s: float) -> None:
    deadline, version = time.monotonic() + limit_s, -1
    while time.monotonic() < deadline:
        agents = state.snapshot(series=False)["agents"]
        if agents and min(a["round"] for a in agents) >= round_:
            return
        version = state.wait_for_change(version, 1.0)


def opened_mid_run(
    browser: Chromium, dashboard: Dashboard, emulation: Emulation
) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """The page as it loaded once every agent had a round, and at the run's last round, with
    its event stream blocked (a proxy that buffers it, a browser out of connections to the
    address); and the run's report."""
    reports: list[dict[str, Any]] = []
    runner = threading.Thread(target=lambda: reports.append(emulation.run()), daemon=True)
    runner.start()
    try:
        wait_for_round(dashboard.state, 1, 90)
        browser.call("Network.enable")
        browser.call("Network.setBlockedURLs", urls=["*api/events*"])
        browser.call("Page.navigate", url=dashboard.url)
        loaded = page_when(browser, lambda p: p["ready"] == "complete", 20)
        rounds = emulation.config.learning.rounds
        later = page_when(browser, lambda p: p["rounds"] == [rounds] * len(p["rounds"]), 90)
    finally:
        runner.join(120)
    return loaded, later, reports


def test_a_fedavg_run_opened_mid_run_shows_its_figures_at_once(
    chromium: Chromium, tmp_path: Path, unused_port: int
) -> None:
    config = experiment_config(
        {"dataset": "mnist1d", "agents": 3, "rounds": 5, "strategy": "fedavg", "seed": 7}
        | {"epochs": 1, "round_time_s": 0.01}
    )
    workdir = tmp_path / "fleet"
    options = EmulationOptions(workdir=workdir, linger_s=10, agents_per_process=3)
    with served_emulation(config, unused_port, options) as (emulation, state, dashboard):
        loaded, later, reports = opened_mid_run(chromium, dashboard, emulation)
        chromium.screenshot(tmp_path / "dashboard.png")
    assert reports, "the emulated run did not finish"
    run_id = state.snapshot()["fleets"][0]["run_id"]
    # At its load, without any event: the fleet's rounds in the table and every chart.
    assert len(loaded["rounds"]) == 3 and min(loaded["rounds"]) >= 1, loaded
    assert all(min(counts) >= 1 for counts in loaded["points"].values()), loaded
    assert len(loaded["points"]) == 4
    assert loaded["run"] == f"run {run_id} · fedavg"
    assert loaded["p_k"] == ["–"] * 3, "FedAvg trains the full model: no p_k"
    assert loaded["staleness"] == ["–"] * 3, "synchronous rounds: no staleness"
    axis = loaded["axis"]
    assert (axis["min"], axis["max"]) == (0, 1) and axis["fits"], axis
    assert axis["labels"][0] == "0 %" and axis["labels"][-1] == "100 %", axis
    # The stream blocked, the page still followed the run to its end, and says how.
    assert later["rounds"] == [5, 5, 5] and later["badge"].startswith("polling"), later
    entries = [a for r in reports[0]["rounds"] for a in r["agents"].values()]
    assert entries and all(entry["p_k"] is None for entry in entries)
    assert all(entry["staleness"] is None for entry in entries)
    summary = reports[0]["summary"]
    reach = summary["time_to_target"]  # the agents' wall clock: the final accuracy's
    assert "staleness" not in summary and reach["timed"] and not reach["given"], reach
    assert 0 < reach["seconds"] <= summary["wall_seconds"] and 1 <= reach["round"] <= 5, reach
    for log in sorted(workdir.glob("agent-*.log")):
        lines = [line for line in log.read_text().splitlines() if ": accuracy " in line]
        assert lines and not any("p_k" in line for line in lines), log
