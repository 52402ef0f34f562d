"""The fleet's logs in one place: agents publish their log records of a run, the gateway
keeps them, `coordinator logs` and the dashboard show them.

A real fleet (`coordinator serve` with its dashboard, two `edge-agent` processes and
`coordinator run`, on loopback) whose model logs on the devices, one of them a flood; the
keeper on a real broker for forged records; the handler's limits in one process."""

from __future__ import annotations

import http.client
import json
import logging
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from processes import Processes, interrupt, wait_for_text
from test_cli import COORDINATOR, EDGE_AGENT, REPO

from coordinator.agent_logs import LOGS, LogKeeper, agents_logged, line_of
from coordinator.broker import EmbeddedBroker
from coordinator.ports import free_port
from protocol import Identity, MqttTransport, messages, topics
from protocol.errors import ProtocolError
from protocol.fleet_logs import (
    MAX_MESSAGE_CHARS,
    RECORDS_PER_INTERVAL,
    FleetLogHandler,
    RateLimit,
    checked,
)
from protocol.log_context import agent_scope, bound, process_name, set_process_name
from protocol.signing import FleetKey

pytestmark = pytest.mark.timeout(120)

FLEET = "logs"
LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR|CRITICAL) +(\S+): ")

LOGGING_MODEL = '''"""A model whose building logs on the device; pi-2's floods its log first."""
import logging
import sys

from torch import nn


def build(input_shape, num_outputs):
    if "pi-2" in sys.argv:
        for i in range(300):
            logging.getLogger("flood").warning("flood %d %s", i, "x" * 3000)
    logging.getLogger("nets").warning("building the model on this device")
    return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[-1], num_outputs))
'''


def coordinator(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*COORDINATOR, *args], cwd=REPO, capture_output=True, text=True, timeout=60
    )


def dashboard_text(port: int, path: str) -> str:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        assert response.status == 200, response.status
        return response.read().decode()
    finally:
        connection.close()


@pytest.fixture(scope="module")
def fleet_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, int]]:
    """One run of two agents on a served fleet: (the runs folder, the dashboard's port),
    with the agents gone (each takes one run) and `serve` still up."""
    tmp = tmp_path_factory.mktemp("fleet-logs")
    (tmp / "nets.py").write_text(LOGGING_MODEL)
    (tmp / "run.toml").write_text(
        f'[run]\nagents = 2\nrounds = 2\ndataset = "mnist1d"\nmodel = "{tmp / "nets.py"}:build"\n'
        "round_timeout = 30\nvote_timeout = 10\nlinger = 1\n"
    )
    port, web = free_port(), free_port()
    broker = f"127.0.0.1:{port}"
    serve_log = tmp / "serve.log"
    started = Processes()
    try:
        serve = started.spawn(
            [*COORDINATOR, "serve", "--fleet", FLEET, "--port", str(port), "--http", str(web)],
            serve_log,
        )
        wait_for_text(serve_log, "dashboard on", process=serve)
        agents = [
            started.spawn(
                [
                    *EDGE_AGENT,
                    "-v",
                    "--broker",
                    broker,
                    "--fleet",
                    FLEET,
                    "--id",
                    name,
                    "--once",
                    "--state-dir",
                    str(tmp / name),
                    "--fleet-logs",
                    "info",
                    "--linger",
                    "1",
                ],
                tmp / f"{name}.log",
            )  # fmt: skip
            for name in ("pi-1", "pi-2")
        ]
        runs = tmp / "runs"
        run = subprocess.run(
            [*COORDINATOR, "run", str(tmp / "run.toml"), "--broker", broker, "--fleet", FLEET,
             "--runs-dir", str(runs), "--report", str(tmp / "report.json")],
            cwd=REPO, capture_output=True, text=True, timeout=90,
        )  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr
        for agent in agents:
            assert agent.wait(30) == 0
        yield runs, web
    finally:
        started.close()


def lines_of(output: str) -> list[tuple[str, str]]:
    """(agent, line) of every line `coordinator logs` printed; each must be in its format."""
    found = []
    for line in output.splitlines():
        match = LINE.match(line)
        assert match, f"not in the format: {line!r}"
        found.append((match.group(2), line))
    return found


def test_logs_shows_every_agent_and_filters_by_agent(fleet_run: tuple[Path, int]) -> None:
    runs, _ = fleet_run
    shown = coordinator("logs", "--runs-dir", str(runs))
    assert shown.returncode == 0, shown.stderr
    lines = lines_of(shown.stdout)
    assert {agent for agent, _ in lines} == {"pi-1", "pi-2"}
    assert any(agent == "pi-1" and "building the model" in line for agent, line in lines)
    assert any(agent == "pi-1" and " INFO " in line for agent, line in lines), "--fleet-logs info"

    (run_id,) = [p.name for p in runs.iterdir() if p.is_dir()]
    only = coordinator("logs", run_id, "--agent", "pi-1", "--runs-dir", str(runs))
    assert only.returncode == 0, only.stderr
    assert {agent for agent, _ in lines_of(only.stdout)} == {"pi-1"}

    stranger = coordinator("logs", "--agent", "pi-9", "--runs-dir", str(runs))
    assert stranger.returncode == 1
    assert stranger.stderr.strip().splitlines() == [
        f"Error: no agent pi-9 in run {run_id}; its agents: pi-1, pi-2"
    ]
    unknown = coordinator("logs", "run-nope", "--runs-dir", str(runs))
    assert unknown.returncode == 1
    assert unknown.stderr.strip().splitlines() == [
        f"Error: no run run-nope in {runs}; known runs: {run_id}"
    ]


def test_a_flooding_agent_is_bounded_and_says_what_it_left_out(
    fleet_run: tuple[Path, int],
) -> None:
    runs, web = fleet_run
    (folder,) = [p / LOGS for p in runs.iterdir()]
    kept = [json.loads(line) for line in (folder / "pi-2.jsonl").read_text().splitlines()]
    assert len(kept) <= 2 * RECORDS_PER_INTERVAL, "rate-limited"
    assert all(len(row["message"]) <= MAX_MESSAGE_CHARS for row in kept)
    assert any(row["message"].endswith("... [cut]") for row in kept), "the flood's, cut"
    assert (folder / "pi-2.jsonl").stat().st_size < 2 * RECORDS_PER_INTERVAL * 1500
    pi_1_kept = (folder / "pi-1.jsonl").read_text().splitlines()
    assert pi_1_kept and {json.loads(line)["agent"] for line in pi_1_kept} == {"pi-1"}

    # The count of what was left out comes with the agent's next record; this run was over
    # before that, so the dashboard (which follows the fleet beyond the run) has it.
    deadline = time.monotonic() + 20
    while "earlier records left out" not in (page := dashboard_text(web, "/logs/pi-2")):
        assert time.monotonic() < deadline, page
        time.sleep(0.2)
    counted = re.findall(r"\[(\d+) earlier records left out\]", page)
    assert sum(map(int, counted)) >= 300 - 2 * RECORDS_PER_INTERVAL
    pi_1 = dashboard_text(web, "/logs/pi-1")
    assert "pi-1: building the model on this device" in pi_1
    assert "pi-2" not in pi_1
    assert dashboard_text(web, "/logs/pi-7").startswith("no log records of agent pi-7")


def test_the_dashboard_links_each_agent_to_its_log(fleet_run: tuple[Path, int], chromium) -> None:
    _, web = fleet_run
    chromium.call("Page.navigate", url=f"http://127.0.0.1:{web}/")
    links = (
        "JSON.stringify([...document.querySelectorAll('#fleet tbody tr a.log-link')]"
        ".map(a => a.href))"
    )
    deadline = time.monotonic() + 20
    while len(hrefs := json.loads(chromium.evaluate(links))) < 2:
        assert time.monotonic() < deadline, hrefs
        time.sleep(0.1)
    assert sorted(hrefs) == [
        f"http://127.0.0.1:{web}/logs/pi-1",
        f"http://127.0.0.1:{web}/logs/pi-2",
    ]
    chromium.call("Page.navigate", url=sorted(hrefs)[0])
    deadline = time.monotonic() + 20
    while "pi-1: building the model" not in (
        text := chromium.evaluate("document.body.innerText") or ""
    ):
        assert time.monotonic() < deadline, text
        time.sleep(0.1)


def test_logs_follow_prints_new_records_and_stops_cleanly_on_ctrl_c(
    tmp_path: Path, processes: Processes
) -> None:
    """Through a rotation too: the keeper's files are tiny here."""
    runs = tmp_path / "runs"
    keeper = LogKeeper(FLEET, "run-1", ["pi-1"], runs / "run-1", None, max_file_bytes=600)

    def record(text: str) -> None:
        log = messages.Log(
            fleet=FLEET, sender="pi-1", run_id="run-1", time=time.time(), level="ERROR",
            message=text,
        )  # fmt: skip
        keeper.feed(topics.log(FLEET, "pi-1"), messages.encode(log))

    record("before the follow")
    output = tmp_path / "follow.log"
    follow = processes.spawn([*COORDINATOR, "logs", "--follow", "--runs-dir", str(runs)], output)
    wait_for_text(output, "pi-1: before the follow", process=follow)
    for k in range(4):
        record(f"after the follow {k} " + "y" * 100)
    wait_for_text(output, "pi-1: after the follow 3", process=follow)
    assert (runs / "run-1" / LOGS / "pi-1.jsonl.1").exists(), "it rotated meanwhile"
    assert interrupt(follow) == 0
    said = output.read_text()
    assert "Traceback" not in said
    printed = [line for line in said.splitlines() if "pi-1: " in line]
    assert [line.split("pi-1: ")[1][:18] for line in printed] == [
        "before the follow",
        *(f"after the follow {k}" for k in range(4)),
    ]


def test_the_gateway_keeps_signed_records_and_rejects_forged_ones(
    unused_port: int, tmp_path: Path
) -> None:
    key, wrong = FleetKey(b"k" * 32), FleetKey(b"w" * 32)
    folder = tmp_path / "run-1"
    with EmbeddedBroker(port=unused_port) as broker:
        keeper = LogKeeper(FLEET, "run-1", ["pi-1", "pi-2"], folder, key)
        gateway, agent = MqttTransport(broker.address), MqttTransport(broker.address)
        keeper.subscribe(gateway)
        for transport in (gateway, agent):
            transport.start()
        try:
            assert gateway.wait_subscribed(10)

            def send(sender: str, on: str, signer: FleetKey | None, text: str) -> None:
                log = messages.Log(
                    fleet=FLEET, sender=sender, run_id="run-1", time=time.time(),
                    level="WARNING", message=text,
                )  # fmt: skip
                agent.publish(topics.log(FLEET, on), messages.encode(log, key=signer), qos=1)

            send("pi-1", "pi-1", wrong, "forged: another key")
            send("pi-1", "pi-1", None, "forged: unsigned")
            send("pi-1", "pi-2", key, "forged: on another agent's topic")
            send("pi-2", "pi-2", key, "signed")
            deadline = time.monotonic() + 10
            while keeper.kept + keeper.rejected < 4:
                assert time.monotonic() < deadline, (keeper.kept, keeper.rejected)
                time.sleep(0.05)
        finally:
            gateway.stop()
            agent.stop()
        assert (keeper.kept, keeper.rejected) == (1, 3)
        rows = [
            json.loads(line) for line in (folder / LOGS / "pi-2.jsonl").read_text().splitlines()
        ]
        assert [row["message"] for row in rows] == ["signed"]
        assert not (folder / LOGS / "pi-1.jsonl").exists()


# -- the handler, in one process -----------------------------------------------------------


class Recorded:
    """A transport that keeps what is published; its `publish` logs (as a real one may) and
    can be made to block."""

    def __init__(self) -> None:
        self.sent: list[messages.Log] = []
        self.open = threading.Event()
        self.open.set()

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, **_: object) -> None:
        self.open.wait(30)
        logging.getLogger("protocol.mqtt").warning("publishing on %s", topic)
        message = messages.decode(payload)
        assert isinstance(message, messages.Log)
        self.sent.append(message)


def attached(transport: Recorded, limit: RateLimit | None = None, queue_records: int = 100):
    identity = Identity(FLEET, "pi-1")
    handler = FleetLogHandler(
        transport,  # type: ignore[arg-type]
        identity,
        "run-1",
        "INFO",
        limit=limit,
        queue_records=queue_records,
    )
    logging.getLogger().addHandler(handler)
    return handler


def detach(handler: FleetLogHandler) -> None:
    logging.getLogger().removeHandler(handler)
    handler.close()


@pytest.fixture
def info_logging() -> Iterator[logging.Logger]:
    """INFO and up, logged as agent pi-1's (its scope), in a process of other agents."""
    root = logging.getLogger()
    level, name = root.level, process_name()
    root.setLevel(logging.INFO)
    set_process_name("pytest")
    try:
        with agent_scope("pi-1"):
            yield logging.getLogger("agent.test")
    finally:
        root.setLevel(level)
        set_process_name(name)


def test_the_rate_limit_allows_a_burst_per_interval() -> None:
    now = [0.0]
    limit = RateLimit(3, 10.0, clock=lambda: now[0])
    assert [limit.allow() for _ in range(5)] == [True, True, True, False, False]
    now[0] = 9.9
    assert not limit.allow()
    now[0] = 10.0
    assert [limit.allow() for _ in range(4)] == [True, True, True, False]


def test_the_handler_publishes_its_own_records_once_each_never_what_publishing_logs(
    info_logging: logging.Logger,
) -> None:
    transport = Recorded()
    handler = attached(transport)
    try:
        info_logging.debug("below the level")
        info_logging.info("round %d done", 1)
        info_logging.warning("x" * 5000)
        elsewhere = threading.Thread(target=info_logging.warning, args=("another agent's",))
        elsewhere.start()
        elsewhere.join()
        connection = threading.Thread(  # made in its scope, as the transport's threads are
            target=bound(info_logging.warning),
            args=("on my connection",),
            name=f"mqtt-dispatch-{FLEET}-pi-1",
        )
        connection.start()
        connection.join()
    finally:
        detach(handler)
    texts = [log.message for log in transport.sent]
    assert texts[0] == "round 1 done" and transport.sent[0].level == "INFO"
    assert texts[1].endswith("... [cut]") and len(texts[1]) == MAX_MESSAGE_CHARS
    assert texts[2:] == ["on my connection"], "the publisher's own warnings are not published"
    assert {log.run_id for log in transport.sent} == {"run-1"}


def test_a_flood_never_blocks_the_agent_and_what_was_left_out_is_counted(
    info_logging: logging.Logger,
) -> None:
    transport = Recorded()
    transport.open.clear()  # the broker is stuck: publishing blocks
    handler = attached(transport, RateLimit(5, 3600.0), queue_records=2)
    try:
        for k in range(1000):
            info_logging.warning("flood %d", k)  # returns at once: nothing waits on the broker
        transport.open.set()
    finally:
        detach(handler)
    *records, note = transport.sent
    numbers = [int(log.message.split()[1]) for log in records]
    assert numbers == sorted(numbers) and 0 < len(records) <= 3, "one published, two queued"
    assert note.message.startswith("log records left out") and note.dropped > 900
    assert len(records) + sum(log.dropped for log in transport.sent) == 1000, "sent or counted"


def test_a_printed_record_says_what_was_left_out_and_never_drives_the_terminal() -> None:
    row = {"time": 0.0, "agent": "pi.1", "level": "ERROR", "message": "a\x1b[2Jb\tc", "dropped": 2}
    assert line_of(row).endswith("ERROR    pi.1: a?[2Jb\tc [2 earlier records left out]")
    forged = {**row, "message": "ok\n2024-01-01 00:00:00 ERROR    pi-2: disk\u202efailing"}
    lines = line_of(forged).splitlines()
    assert lines[1].startswith("    2024-01-01 00:00:00 ERROR    pi-2: disk?failing"), "not pi-2"


def test_a_record_from_no_era_is_refused_where_it_arrives() -> None:
    """Its time would break every reader's date formatting (`coordinator logs`, /logs)."""
    for when in (1e300, -1.0):
        log = messages.Log(
            fleet=FLEET, sender="pi-1", run_id="run-1", time=when, level="ERROR", message="m"
        )
        with pytest.raises(ProtocolError, match="no time of this era"):
            checked(log)


def test_agents_with_dots_in_their_ids_are_found(tmp_path: Path) -> None:
    keeper = LogKeeper(FLEET, "run-1", ["pi.1", "pi-2"], tmp_path, None, max_file_bytes=200)
    for sender in ("pi.1", "pi.1", "pi-2"):
        log = messages.Log(
            fleet=FLEET, sender=sender, run_id="run-1", time=1.0, level="INFO", message="m" * 80
        )
        keeper.feed(topics.log(FLEET, sender), messages.encode(log))
    assert agents_logged(tmp_path) == ["pi-2", "pi.1"]
    assert (tmp_path / LOGS / "pi.1.jsonl.1").exists(), "the second record rotated the first"
