"""Faults of the disk under an agent: a full disk is one clear line that keeps the last
checkpoint and tells the fleet the agent is gone; a log that cannot be written is never
fatal; a round log torn mid-line is repaired on restore."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import logging
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from test_agent_service import write_data, write_run
from test_cli import EDGE_AGENT

from agent.experiment import ExperimentConfig
from agent.files import DiskFullError
from agent.learning import preset
from agent.runtime import AgentRuntime, Run, checkpoint
from agent.runtime.run_files import persist, restore
from agent.workload import build_workload
from protocol import BrokerAddress, MqttTransport, messages, topics
from protocol.cli import say, setup_logging
from tests.processes import Processes

FULL = OSError(errno.ENOSPC, "No space left on device")


def runtime_of(tmp_path: Path, run: Run, me: str = "a") -> AgentRuntime:
    """An agent of `run` whose transport never starts: persist and restore need none."""
    return AgentRuntime(
        agent_id=me,
        fleet="faults",
        run=run,
        workload=build_workload(run.config, list(run.roster), agents=[me]),
        transport=MqttTransport(BrokerAddress("127.0.0.1", 1)),
        state_dir=tmp_path / me,
    )


@pytest.fixture
def run() -> Run:
    config = ExperimentConfig(
        dataset="mnist1d", agents=2, seed=3, learning=preset("dadpfl", rounds=4, neighbours=1)
    )
    return Run("run-faults", ("a", "b"), config)


def record(round_: int) -> dict[str, Any]:
    return {"round": round_, "accuracy": 0.5 + round_ / 100, "note": "x" * 40}


def test_a_failed_checkpoint_write_keeps_the_previous_one_and_no_temporary_file(
    tmp_path: Path, run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = runtime_of(tmp_path, run)
    persist(agent.session, agent.driver, 1, record(1))

    def full(_descriptor: int) -> None:
        raise FULL

    monkeypatch.setattr("agent.files.os.fsync", full)  # where a full disk shows up, at last
    with pytest.raises(DiskFullError, match=r"disk full: cannot write .*checkpoint\.pt"):
        persist(agent.session, agent.driver, 2, record(2))
    monkeypatch.undo()
    saved = checkpoint.load(agent.session.checkpoint_path)
    assert saved is not None and saved["round"] == 1 and saved["record"] == record(1)
    assert sorted(p.name for p in agent.session.checkpoint_path.parent.iterdir()) == [
        "checkpoint.pt",
        "rounds.jsonl",
    ], "no temporary file left behind"
    assert list(checkpoint.read_records(agent.session.records_path)) == [1]


def test_a_torn_round_log_is_repaired_on_restore(tmp_path: Path, run: Run) -> None:
    agent = runtime_of(tmp_path, run)
    for round_ in (1, 2):
        persist(agent.session, agent.driver, round_, record(round_))
    log = agent.session.records_path
    text = log.read_text()
    log.write_text(text[: len(text) - 25])  # the crash cut round 2's line mid-JSON
    resumed = runtime_of(tmp_path, run)
    assert restore(resumed.session, resumed.driver) == 2
    lines = log.read_text().splitlines()
    assert [json.loads(line) for line in lines] == [record(1), record(2)]
    checkpoint.append_record(log, record(3))
    assert [json.loads(line)["round"] for line in log.read_text().splitlines()] == [1, 2, 3]


def test_an_append_never_glues_onto_a_torn_line(tmp_path: Path) -> None:
    log = tmp_path / "rounds.jsonl"
    log.write_text(json.dumps(record(1)) + "\n" + json.dumps(record(2))[:30])
    checkpoint.append_record(log, record(2))
    assert [json.loads(line) for line in log.read_text().splitlines()] == [record(1), record(2)]


class FullStream(io.StringIO):
    """A log file on a disk that is full for the lines of a round (and then has room)."""

    def write(self, text: str) -> int:
        if "round" in text:
            raise FULL
        return super().write(text)


def test_a_log_that_cannot_be_written_is_never_fatal(monkeypatch: pytest.MonkeyPatch) -> None:
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    stderr = FullStream()
    try:
        setup_logging(0, "text")
        monkeypatch.setattr("sys.stderr", stderr)
        logging.getLogger("agent").warning("round 3: waited for b")
        say("round 3: accuracy 0.9", Console(file=FullStream()))
        setup_logging(0, "json")
        say("round 4: accuracy 0.9")
        logging.getLogger("agent").warning("stopped")
    finally:
        monkeypatch.undo()
        setup_logging(0, "text")
        root.handlers[:], root.level = handlers, level
    assert stderr.getvalue().count("\n") == 1 and '"message": "stopped"' in stderr.getvalue()


@contextmanager
def tiny_disk(folder: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` at `folder` (root only), unmounted at the end."""
    folder.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill (needs root): {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False, timeout=30)


def presence_of(address: BrokerAddress, fleet: str, agent: str) -> messages.Presence:
    """The retained presence of `agent`, as a newcomer reads it."""
    got: list[messages.Presence] = []
    arrived = threading.Event()

    def keep(_topic: str, payload: bytes) -> None:
        message = messages.decode(payload)
        assert isinstance(message, messages.Presence)
        got.append(message)
        arrived.set()

    with MqttTransport(address) as transport:
        transport.subscribe(topics.presence(fleet, agent), keep)
        assert arrived.wait(10), f"no retained presence of {agent}"
    return got[-1]


def fill(folder: Path) -> None:
    """Leave no byte free on the disk of `folder`."""
    with contextlib.suppress(OSError), open(folder / "filler", "wb", buffering=0) as handle:
        while True:
            handle.write(b"\0" * 4096)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_an_agent_on_a_full_disk_stops_in_one_line_and_the_fleet_finishes(
    amqtt_broker, tmp_path: Path, processes: Processes
) -> None:
    """pi-b's state is on a disk with room for one checkpoint; pi-a logs to a full disk."""
    run_file = write_run(
        tmp_path / "run.toml",
        strategy="dadpfl",
        agents=2,
        rounds=3,
        input_shape=[1, 40],
        classes=10,
        round_timeout=2,
        vote_timeout=2,
        linger=1,
    )
    with tiny_disk(tmp_path / "disk", "256k") as disk, tiny_disk(tmp_path / "logs", "16k") as full:
        fill(full)
        agents, logs = {}, {}
        for k, name in enumerate(["pi-a", "pi-b"]):
            data = write_data(tmp_path / f"{name}.npz", [k, k + 1, k + 2, k + 3], seed=k)
            state = disk / name if name == "pi-b" else tmp_path / name
            command = [
                *EDGE_AGENT, "--broker", str(amqtt_broker.address), "--id", name,
                "--fleet", "disk", "--expect", "2", "--run", str(run_file), "--data", str(data),
                "--state-dir", str(state),
            ]  # fmt: skip
            log = open(full / "pi-a.log", "w") if name == "pi-a" else subprocess.PIPE  # noqa: SIM115
            agents[name] = processes.popen(command, stderr=log, text=True)
        for name, process in agents.items():
            logs[name] = process.communicate(timeout=150)[1]
        assert (full / "pi-a.log").stat().st_size == 0, "pi-a's log lines all failed"
        assert agents["pi-a"].returncode == 0, "a log on a full disk is not fatal"
        assert (tmp_path / "pi-a" / "model.onnx").exists(), "pi-a finished without pi-b"
        assert agents["pi-b"].returncode == 1, logs["pi-b"]
        errors = [line for line in logs["pi-b"].splitlines() if line.startswith("Error")]
        assert len(errors) == 1 and "disk full" in errors[0], logs["pi-b"]
        assert str(disk / "pi-b") in errors[0] and "No space left" in errors[0]
        assert "Traceback" not in logs["pi-b"]
        (folder,) = (disk / "pi-b" / "runs").iterdir()
        saved = checkpoint.load(folder / "checkpoint.pt")
        assert saved is not None and saved["round"] == 1, "the last checkpoint is kept"
        assert list(checkpoint.read_records(folder / "rounds.jsonl")) == [1]
        assert sorted(p.name for p in folder.iterdir()) == ["checkpoint.pt", "rounds.jsonl"]
    assert not presence_of(amqtt_broker.address, "disk", "pi-b").online
