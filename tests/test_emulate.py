"""A fleet of real agent processes over a real broker: correctness and faults."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from agent.experiment import ExperimentConfig
from agent.learning import preset
from agent.onnx_model import OnnxModel
from agent.runtime import checkpoint
from coordinator.emulate import Emulation, EmulationOptions
from coordinator.simulate import Simulation, simulate
from protocol import BrokerAddress, MqttTransport, TransportOptions
from protocol.cli import setup_logging

AGENTS = 6
# Real processes on two cores: generous per-test limits, the runs themselves are bounded.
pytestmark = pytest.mark.timeout(900)


def config(
    strategy: str = "dadpfl", rounds: int = 3, profiles: str = "", **learning: object
) -> ExperimentConfig:
    learning = {"rounds": rounds, "neighbours": 3, "epochs": 1, **learning}
    return ExperimentConfig(
        dataset="mnist1d",
        agents=AGENTS,
        partition="dirichlet:0.5",
        seed=7,
        profiles=profiles,
        round_time_s=0.01,
        learning=preset(strategy, **learning),
    )


def figures(report: dict) -> dict[tuple[int, str], tuple[float, float]]:
    return {
        (r["round"], agent): (a["accuracy"], a["sparsity"])
        for r in report["rounds"]
        for agent, a in r["agents"].items()
    }


def assert_same_learning(emulated: dict, simulated: dict) -> None:
    got, want = figures(emulated), figures(simulated)
    assert got.keys() == want.keys()
    for key, (accuracy, sparsity) in want.items():
        assert got[key][0] == pytest.approx(accuracy, abs=1e-6), key
        assert got[key][1] == pytest.approx(sparsity, abs=1e-6), key


STATUS_BYTES = 1_500
"""What an emulated agent sends a round beyond the algorithm's messages, which are all that
simulate counts: its status and the status's plain-JSON telemetry copy (about 1,000 bytes)."""
ENVELOPE_BYTES = 300
"""What a round's messages to an emulated agent carry beyond simulate's, for the same values:
the fleet's and run's real names in each envelope, where simulate writes "sim"."""


def run_bytes(report: dict, agent: str, key: str) -> int:
    return sum(r["agents"][agent][key] for r in report["rounds"])


def assert_same_bytes(emulated: dict, simulated: dict) -> None:
    """Each agent's bytes sent and received over the run (payload bytes, the MQTT packets'
    own headers left out) are simulate's, plus at most the statuses and the envelopes.
    Compared over the run: an agent counts a model when it arrives, which is often a round
    early (it subscribes ahead), where simulate charges it to the round that uses it."""
    rounds = len(simulated["rounds"])
    for agent in simulated["rounds"][0]["agents"]:
        for key, extra in (("bytes_sent", STATUS_BYTES), ("bytes_received", ENVELOPE_BYTES)):
            got, want = run_bytes(emulated, agent, key), run_bytes(simulated, agent, key)
            assert want <= got <= want + extra * rounds, (agent, key, got, want)


def options(tmp_path: Path, **overrides: object) -> EmulationOptions:
    return EmulationOptions(workdir=tmp_path / "fleet", linger_s=20.0, **overrides)


SHARED = 3
"""Agents to a process in the cases that compare numbers with simulate: two processes start
the six agents in about a third of the time six take (each imports torch), and sharing a
process changes no number (tests/test_agents_per_process.py)."""


def per_process(request: pytest.FixtureRequest) -> int:
    """The first case of the decentralized comparison runs its agents a process each, as on
    devices; every other run that compares numbers shares processes (`SHARED`): a process
    each costs an interpreter and torch per agent and changes no number."""
    return 1 if request.node.callspec.indices["learning"] == 0 else SHARED


def test_agents_log_as_the_coordinator_does_unless_told(tmp_path: Path) -> None:
    config = ExperimentConfig(agents=2, learning=preset("fedavg", rounds=1))
    nowhere = BrokerAddress("127.0.0.1", 1)
    try:
        setup_logging(2, "json")  # coordinator -vv --log-format json emulate
        same = Emulation(config, nowhere, options(tmp_path)).agent_args(0)
        told = Emulation(config, nowhere, options(tmp_path, verbose=1)).agent_args(0)
    finally:
        setup_logging(0, "text")
    assert same[-3:] == ["-vv", "--log-format", "json"]
    assert told[-1] == "-v" and "--log-format" not in told


@pytest.mark.parametrize(
    "learning",
    [
        {"strategy": "dadpfl", "max_wait": 2},
        {"strategy": "dispfl"},
        {"strategy": "dadpfl", "max_wait": 2, "rounds": 5, "delta_pr": 100.0},
        {"strategy": "dadpfl", "max_wait": 2, "rounds": 4, "profiles": "mixed", "wire": "delta"},
        {
            "strategy": "dadpfl",
            "rounds": 6,
            "early_stop": True,
            "stop_patience": 2,
            "stop_delta": 0.3,
            "wire": "layers",
            "ldf_n": 2,
        },
    ],
    ids=[
        "dadpfl",
        "dispfl",
        "dadpfl-pruning",
        "dadpfl-budgets-delta",
        "dadpfl-layers-early-stop",
    ],  # fmt: skip
)
def test_emulate_gives_the_numbers_of_simulate(
    amqtt_broker, tmp_path: Path, monkeypatch, request, learning
) -> None:
    # A folder named like the agent package in the working directory must not shadow it.
    (tmp_path / "agent").mkdir()
    (tmp_path / "agent" / "__main__.py").write_text("raise SystemExit(3)\n")
    monkeypatch.chdir(tmp_path)
    cfg = config(**learning)
    shared = options(tmp_path, agents_per_process=per_process(request))
    emulated = Emulation(cfg, amqtt_broker.address, shared).run()
    assert emulated["summary"]["failed_agents"] == {}
    assert emulated["summary"]["stragglers"] == []
    simulation = Simulation(cfg)
    simulated = simulation.run()
    assert_same_learning(emulated, simulated)
    if learning.get("wire", "full") == "full" and not learning.get("early_stop"):
        assert_same_bytes(emulated, simulated)
    stopped = {
        a: (s["round"], s["saved_flops"]) for a, s in simulated["summary"]["stopped"].items()
    }
    assert {
        a: (s["round"], s["saved_flops"]) for a, s in emulated["summary"]["stopped"].items()
    } == stopped
    assert emulated["summary"]["rounds"] == simulated["summary"]["rounds"]
    if learning.get("early_stop"):
        assert stopped, "some agents stop early, and their neighbours leave them out"
    assert_onnx_models_match_torch(simulation, tmp_path / "fleet")
    if learning.get("profiles"):
        p_k = {a["p_k"] for r in emulated["rounds"] for a in r["agents"].values()}
        assert min(p_k) < 0.1 and max(p_k) == 1.0, "mixed boards get different budgets"
    if learning.get("delta_pr"):
        assert emulated["summary"]["t_star"] == 1
        assert emulated["summary"]["mean_sparsity"] > 0.5
    if learning.get("wire") == "layers":
        # A served layer is retained: every later asker gets the broker's copy, so the
        # agents send what the simulator counts (one publish per layer of a round model).
        assert emulated["summary"]["busiest_agent_bytes"] == pytest.approx(
            simulated["summary"]["busiest_agent_bytes"], rel=0.1
        )
        assert_nothing_retained(amqtt_broker.address, "fl/v1/+/round/+/model/+/+")


@pytest.mark.parametrize(
    "learning",
    [
        {"strategy": "fedavg"},
        {
            "strategy": "fedspu",
            "rounds": 6,
            "early_stop": True,
            "stop_patience": 2,
            "stop_delta": 0.3,
        },
        {"strategy": "fedadam-ssm", "fp16": True},
        {"strategy": "fedldf", "ldf_n": 2},
    ],
    ids=["fedavg", "fedspu-early-stop", "fedadam-ssm-fp16", "fedldf"],
)
def test_the_coordinator_aggregates_centralized_strategies_as_simulate_does(
    amqtt_broker, tmp_path: Path, learning
) -> None:
    cfg = config(**learning)
    shared = options(tmp_path, agents_per_process=SHARED)
    emulated = Emulation(cfg, amqtt_broker.address, shared).run()
    assert emulated["summary"]["failed_agents"] == {}
    assert emulated["summary"]["stragglers"] == []
    simulated = simulate(cfg)
    assert_same_learning(emulated, simulated)
    if not learning.get("early_stop"):
        assert_same_bytes(emulated, simulated)
    losses = {
        (r["round"], k): a["loss"] for r in simulated["rounds"] for k, a in r["agents"].items()
    }
    assert {
        (r["round"], k): a["loss"] for r in emulated["rounds"] for k, a in r["agents"].items()
    } == pytest.approx(losses, abs=1e-6)
    assert emulated["summary"]["stopped"].keys() == simulated["summary"]["stopped"].keys()
    if learning.get("early_stop"):
        assert simulated["summary"]["stopped"], "the case must exercise early stopping"
    # The same values travel (uploads, downloads, FedLDF's selected layers, the broadcast);
    # bytes differ only by the envelope (run id) and the statuses an MQTT link also carries.
    for got, want in zip(emulated["rounds"], simulated["rounds"], strict=True):
        assert got["coordinator"]["nonzeros_sent"] == want["coordinator"]["nonzeros_sent"]
        assert got["coordinator"]["sent"] == pytest.approx(want["coordinator"]["sent"], rel=0.02)
        for k, a in want["agents"].items():
            assert got["agents"][k]["nonzeros_sent"] == a["nonzeros_sent"], (got["round"], k)


@pytest.mark.parametrize("wire", ["full", "layers"])
def test_agents_whose_training_diverges_finish_the_run_and_say_why(
    amqtt_broker, tmp_path: Path, wire: str
) -> None:
    """Training that sends every model to NaN (the largest learning rate and weight decay a
    run takes: each step multiplies the weights by 1 - 10 x 1 = -9, so they overflow float32
    within about 40 steps, fewer than a round at batch size 8 takes): the protocol carries
    finite numbers only (a NaN vote score or status loss used to crash every agent), so each
    agent keeps its model from before the round, sends that, finishes the run and logs why."""
    cfg = config(rounds=2, lr=10.0, weight_decay=1.0, batch_size=8, wire=wire)
    emulation = Emulation(
        cfg, amqtt_broker.address, options(tmp_path, round_timeout_s=3.0, agents_per_process=SHARED)
    )
    report = emulation.run()
    assert report["summary"]["failed_agents"] == {}
    assert [r["round"] for r in report["rounds"]] == [1, 2]
    for agent_id in emulation.processes:
        log = (tmp_path / "fleet" / f"{agent_id}.log").read_text()
        assert "model not finite; kept the model from before it" in log


def test_a_killed_participant_resumes_and_the_centralized_run_is_unchanged(
    amqtt_broker, tmp_path: Path
) -> None:
    cfg = config("fedadam-ssm", rounds=5)  # its checkpoint holds the server's W, M and V
    emulation = Emulation(cfg, amqtt_broker.address, options(tmp_path))
    thread, result = run_in_background(emulation)
    kill_and_restart(emulation, 2, after_round=2)
    thread.join(600)
    assert "error" not in result, result.get("error")
    report = result["report"]
    assert report["summary"]["stragglers"] == []
    assert_same_learning(report, simulate(cfg))


def test_a_vanished_participant_is_left_out_and_the_centralized_run_finishes(
    amqtt_broker, tmp_path: Path
) -> None:
    cfg = config("fedavg", rounds=4)
    emulation = Emulation(cfg, amqtt_broker.address, options(tmp_path, round_timeout_s=3.0))
    thread, result = run_in_background(emulation)
    wait_for_round(emulation, "agent-004", 1)
    emulation.processes["agent-004"].send_signal(signal.SIGKILL)
    thread.join(600)
    assert "error" not in result, result.get("error")
    report = result["report"]
    assert "agent-004" in report["summary"]["stragglers"]
    assert report["summary"]["failed_agents"] == {"agent-004": -signal.SIGKILL}
    assert len(report["rounds"]) == 4
    assert report["rounds"][-1]["participants"] == [
        f"agent-{k:03d}" for k in range(AGENTS) if k != 4
    ]


def assert_nothing_retained(address: BrokerAddress, topic_filter: str) -> None:
    """A subscriber that joins after the run gets no retained message on `topic_filter`:
    the agents cleared what they left on the broker."""
    received: list[str] = []
    watcher = MqttTransport(address, TransportOptions(client_id="after-the-run"))
    watcher.subscribe(topic_filter, lambda topic, _payload: received.append(topic))
    watcher.start()
    try:
        assert watcher.wait_subscribed(20.0)
        time.sleep(1.0)
    finally:
        watcher.stop()
    assert received == []


def assert_onnx_models_match_torch(simulation: Simulation, workdir: Path) -> None:
    """Every agent exported the model it kept (its personalized or its local-only one, as
    the simulated agent chose); onnxruntime agrees with torch."""
    model = simulation.learner.facts.model
    for agent_id, state in simulation.states.items():
        exported = OnnxModel.load(workdir / agent_id / "model.onnx", threads=1)
        assert exported.metadata["agent"] == agent_id
        assert state.kept is not None and exported.metadata["kept"] == state.kept.name
        x = simulation.data[agent_id].x_test
        model.load_state_dict(state.kept.weights)
        model.eval()
        with torch.no_grad():
            expected = model(x).numpy()
        assert np.abs(exported.predict(x.numpy()) - expected).max() <= 1e-5


def test_edge_agent_predict_reports_classes_and_latency(tmp_path: Path) -> None:
    from agent.learning import build_model
    from agent.onnx_export import export_onnx

    model = build_model("cnn1d", (1, 40), 10, seed=0)
    export_onnx(model, model.state_dict(), (1, 40), tmp_path / "model.onnx")
    x = np.random.default_rng(0).normal(size=(5, 1, 40)).astype(np.float32)
    np.savez(tmp_path / "inputs.npz", x=x)
    code = "from agent.cli import main; main(prog_name='edge-agent')"
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "predict",
            str(tmp_path / "inputs.npz"),
            "--model",
            str(tmp_path / "model.onnx"),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parent.parent,
    )
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert len(answer["predictions"]) == 5
    assert answer["latency"]["samples"] == 5 and answer["latency"]["mean_ms"] > 0
    bad = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "predict",
            str(tmp_path / "model.onnx"),
            "--model",
            str(tmp_path / "model.onnx"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parent.parent,
    )
    assert bad.returncode == 1 and "Traceback" not in bad.stderr


def run_in_background(emulation: Emulation) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def target() -> None:
        try:
            result["report"] = emulation.run()
        except BaseException as exc:  # surfaced by the test
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, result


def kill_and_restart(emulation: Emulation, index: int, after_round: int) -> None:
    """SIGKILL an agent once it logged `after_round`, and start it again."""
    agent = emulation.roster[index]
    wait_for_round(emulation, agent, after_round)
    emulation.processes[agent].send_signal(signal.SIGKILL)
    emulation.processes[agent].wait(10)
    emulation.start_agent(index)


def wait_for_round(emulation: Emulation, agent: str, round_: int, timeout_s: float = 120) -> None:
    path = emulation.round_log(agent)
    deadline = time.monotonic() + timeout_s
    while round_ not in checkpoint.read_records(path):
        assert time.monotonic() < deadline, f"{agent} never finished round {round_}"
        time.sleep(0.05)


@pytest.mark.parametrize("wire", [{}, {"wire": "layers", "ldf_n": 1}], ids=["full", "layers"])
def test_a_killed_agent_resumes_from_its_checkpoint(amqtt_broker, tmp_path: Path, wire) -> None:
    cfg = config(rounds=5, **wire)
    emulation = Emulation(cfg, amqtt_broker.address, options(tmp_path))
    thread, result = run_in_background(emulation)
    kill_and_restart(emulation, 2, after_round=2)
    thread.join(600)
    assert "error" not in result, result.get("error")
    report = result["report"]
    lines = emulation.round_log("agent-002").read_text().splitlines()
    rounds_logged = [int(line.split('"round": ')[1].split(",")[0]) for line in lines]
    assert rounds_logged == [1, 2, 3, 4, 5], "no round lost or repeated"
    assert len(report["rounds"]) == 5
    assert_same_learning(report, simulate(cfg))


def test_a_vanished_agent_is_named_and_the_fleet_finishes(amqtt_broker, tmp_path: Path) -> None:
    cfg = config(rounds=4)
    emulation = Emulation(cfg, amqtt_broker.address, options(tmp_path, round_timeout_s=3.0))
    thread, result = run_in_background(emulation)
    wait_for_round(emulation, "agent-004", 1)
    emulation.processes["agent-004"].send_signal(signal.SIGKILL)
    thread.join(600)
    assert "error" not in result, result.get("error")
    summary = result["report"]["summary"]
    assert "agent-004" in summary["stragglers"]
    assert summary["failed_agents"] == {"agent-004": -signal.SIGKILL}
    last = result["report"]["rounds"][-1]["agents"]
    assert set(last) == {f"agent-{k:03d}" for k in range(AGENTS)} - {"agent-004"}


def test_every_agent_reconnects_after_a_broker_restart(broker, tmp_path: Path) -> None:
    cfg = config(rounds=5)
    emulation = Emulation(cfg, broker.address, options(tmp_path, round_timeout_s=60.0))
    thread, result = run_in_background(emulation)
    wait_for_round(emulation, "agent-000", 2)
    broker.kill()
    time.sleep(1.0)
    broker.start()
    thread.join(600)
    assert "error" not in result, result.get("error")
    report = result["report"]
    assert report["summary"]["failed_agents"] == {}
    assert all(len(r["agents"]) == AGENTS for r in report["rounds"])
    assert len(report["rounds"]) == 5
