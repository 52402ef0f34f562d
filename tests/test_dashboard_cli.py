"""The dashboard as a person starts it: `coordinator emulate --http`, scraped mid-run."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from test_cli import COORDINATOR

from tests.processes import Processes


def scrape(url: str) -> dict[str, float]:
    """Sample name and agent label -> value, from a /metrics page."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {
        f"{sample.name}/{sample.labels.get('agent', '')}": sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_emulate_serves_metrics_that_follow_the_run(
    tmp_path: Path, unused_port: int, processes: Processes
) -> None:
    command = [
        *COORDINATOR, "emulate", "--agents", "3", "--rounds", "4", "--epochs", "3",
        "--http", str(unused_port), "--report", str(tmp_path / "report.json"),
    ]  # fmt: skip
    log = tmp_path / "emulate.log"
    process = processes.spawn(command, log)
    rounds_seen: set[float] = set()
    deadline = time.monotonic() + 120
    while process.poll() is None and time.monotonic() < deadline:
        try:
            samples = scrape(f"http://127.0.0.1:{unused_port}/metrics")
        except OSError:
            time.sleep(0.2)
            continue
        rounds_seen |= {v for k, v in samples.items() if k.startswith("edgefl_agent_round/")}
        time.sleep(0.3)
    assert process.wait(120) == 0, log.read_text()
    assert len(rounds_seen - {0.0}) >= 2, f"rounds advanced while scraped: {sorted(rounds_seen)}"
    assert f"dashboard on http://127.0.0.1:{unused_port}/" in log.read_text()
