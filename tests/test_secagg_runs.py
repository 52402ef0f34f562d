"""Secure aggregation on real processes and a real broker (`--secure-aggregation`): the
fleet's numbers are the plain run's within quantization, no upload the coordinator receives
decodes to a device's model, and a round survives 30% of its devices dropping mid-round."""

from __future__ import annotations

import dataclasses
import signal
from pathlib import Path

import numpy as np
import pytest

from agent.experiment import ExperimentConfig
from agent.learning import central_strategy, preset
from agent.learning.central.secure import vector_length
from agent.workload import build_workload
from coordinator.emulate import Emulation, EmulationOptions, HostedProcess
from coordinator.simulate import simulate
from protocol import MqttTransport, TransportOptions, messages, secagg, topics
from protocol.tensors import decode_tensors

pytestmark = pytest.mark.timeout(600)
AGENTS = 4


def config(
    secure: bool = True,
    rounds: int = 2,
    agents: int = AGENTS,
    strategy: str = "fedavg",
    **extra: object,
) -> ExperimentConfig:
    return ExperimentConfig(
        dataset="mnist1d",
        agents=agents,
        partition="dirichlet:0.5",
        seed=3,
        round_time_s=0.01,
        learning=preset(
            strategy,
            rounds=rounds,
            epochs=1,
            aggregation="mean",
            secure_aggregation=secure,
            **extra,
        ),
    )


def options(tmp_path: Path, **overrides: object) -> EmulationOptions:
    """Two agents to a process: a process each costs an interpreter and torch per agent,
    and sharing one changes no number (tests/test_agents_per_process.py)."""
    return EmulationOptions(
        workdir=tmp_path / "fleet", linger_s=20.0, **{"agents_per_process": 2, **overrides}
    )


def figures(report: dict, what: str) -> dict[tuple[int, str], float]:
    return {(r["round"], k): a[what] for r in report["rounds"] for k, a in r["agents"].items()}


def run_bytes(report: dict, agent: str, key: str) -> int:
    return sum(r["agents"][agent][key] for r in report["rounds"])


def test_a_secure_run_gives_the_plain_numbers_and_the_coordinator_no_model(
    amqtt_broker, tmp_path: Path
) -> None:
    cfg = config()
    uploads: list[tuple[str, bytes]] = []
    emulation = Emulation(cfg, amqtt_broker.address, options(tmp_path))
    spy = MqttTransport(amqtt_broker.address, TransportOptions(client_id="spy"))
    spy.subscribe(
        topics.round_topic(emulation.fleet, "+", "masked"), lambda t, p: uploads.append((t, p))
    )
    spy.start()
    try:
        assert spy.wait_subscribed(20.0)
        emulated = emulation.run()
    finally:
        spy.stop()
    assert emulated["summary"]["failed_agents"] == {}
    assert emulated["summary"]["stragglers"] == []
    # The masks cancel exactly in the ring: the same sums as the one-process secure run...
    secure = simulate(cfg)
    assert figures(emulated, "loss") == pytest.approx(figures(secure, "loss"), abs=1e-6)
    # Simulate counts the secure messages as the agents send them (keys, shares, the masked
    # change, the reveal); emulate's transports count their statuses and real names beside.
    plain = simulate(config(secure=False))
    for agent in secure["rounds"][0]["agents"]:
        for key, extra in (("bytes_sent", 1_500), ("bytes_received", 1_000)):
            got, want = run_bytes(emulated, agent, key), run_bytes(secure, agent, key)
            assert want <= got <= want + extra * cfg.learning.rounds, (agent, key, got, want)
            assert want > run_bytes(plain, agent, key)  # keys, shares and reveals besides
    assert figures(emulated, "nonzeros_sent") == figures(secure, "nonzeros_sent")
    # ...and the plain run's within quantization (its error, ~1e-8 a weight, moves no figure).
    for what in ("loss", "strategy_accuracy"):
        assert figures(emulated, what) == pytest.approx(figures(plain, what), abs=1e-4)
    # Every upload the coordinator received is noise: no weight of the model near its value.
    assert len(uploads) == AGENTS * cfg.learning.rounds
    for topic, payload in uploads:
        message = messages.decode(payload)
        assert isinstance(message, messages.Masked), topic
        decoded = secagg.dequantize(np.frombuffer(message.values, dtype="<u4"))
        assert np.abs(decoded).mean() > 1.0  # a change of a model is ~1e-2; this is ~4


def test_a_secure_fedspu_run_aggregates_each_entry_over_the_devices_that_trained_it(
    amqtt_broker, tmp_path: Path
) -> None:
    """FedSPU's parts (tiers 0.2 to 0.8 here): each device masks its change over the whole
    model, 0 outside its part; the coordinator divides each entry by the weight of the
    devices it sent that entry to. The emulated fleet's numbers are the one-process secure
    run's and the plain run's within quantization; every upload is noise of the model's
    length."""
    cfg = config(strategy="fedspu")
    uploads: list[bytes] = []
    emulation = Emulation(cfg, amqtt_broker.address, options(tmp_path))
    spy = MqttTransport(amqtt_broker.address, TransportOptions(client_id="spy"))
    spy.subscribe(
        topics.round_topic(emulation.fleet, "+", "masked"), lambda t, p: uploads.append(p)
    )
    spy.start()
    try:
        assert spy.wait_subscribed(20.0)
        emulated = emulation.run()
    finally:
        spy.stop()
    assert emulated["summary"]["failed_agents"] == {}
    assert emulated["summary"]["stragglers"] == []
    secure, plain = simulate(cfg), simulate(config(secure=False, strategy="fedspu"))
    assert figures(emulated, "loss") == pytest.approx(figures(secure, "loss"), abs=1e-6)
    for what in ("loss", "strategy_accuracy"):
        assert figures(emulated, what) == pytest.approx(figures(plain, what), abs=1e-4)
    length = secure_length(cfg)
    assert len(uploads) == AGENTS * cfg.learning.rounds
    for payload in uploads:
        message = messages.decode(payload)
        assert isinstance(message, messages.Masked)
        decoded = secagg.dequantize(np.frombuffer(message.values, dtype="<u4"))
        assert decoded.size == length
        assert np.abs(decoded).mean() > 1.0 and (decoded == 0).mean() < 1e-3


@pytest.mark.parametrize(
    ("strategy", "extra"), [("fedldf", {"ldf_n": 2}), ("fedadam-top", {})], ids=["fedldf", "top"]
)
def test_a_secure_run_over_an_agreed_index_set_gives_the_plain_numbers(
    amqtt_broker, tmp_path: Path, strategy: str, extra: dict
) -> None:
    """FedLDF (each device masks its change on the layers it was asked for, after its
    divergence vector) and FedAdam-Top (each masks its three deltas over the union of the
    devices' top-k masks, sent before masking): the emulated fleet's numbers are the
    one-process secure run's and the plain run's within quantization; every upload is noise,
    of the model's length (FedLDF) or of the round's union, shorter than the model (Top)."""
    cfg = config(strategy=strategy, **extra)
    uploads: list[tuple[int, bytes]] = []
    emulation = Emulation(cfg, amqtt_broker.address, options(tmp_path))
    spy = MqttTransport(amqtt_broker.address, TransportOptions(client_id="spy"))
    spy.subscribe(
        topics.round_topic(emulation.fleet, "+", "masked"),
        lambda t, p: uploads.append((int(topics.parse(t)[2]["round"]), p)),
    )
    spy.start()
    try:
        assert spy.wait_subscribed(20.0)
        emulated = emulation.run()
    finally:
        spy.stop()
    assert emulated["summary"]["failed_agents"] == {}
    assert emulated["summary"]["stragglers"] == []
    secure, plain = simulate(cfg), simulate(config(secure=False, strategy=strategy, **extra))
    assert figures(emulated, "loss") == pytest.approx(figures(secure, "loss"), abs=1e-6)
    assert figures(emulated, "nonzeros_sent") == figures(secure, "nonzeros_sent")
    # Simulate counts the index set's messages too (the asks, empty ones included; each
    # device's support and the union), as the agents send and receive them.
    for agent in secure["rounds"][0]["agents"]:
        for key, slack in (("bytes_sent", 1_500), ("bytes_received", 1_000)):
            got, want = run_bytes(emulated, agent, key), run_bytes(secure, agent, key)
            assert want <= got <= want + slack * cfg.learning.rounds, (agent, key, got, want)
    for what in ("loss", "strategy_accuracy"):
        assert figures(emulated, what) == pytest.approx(figures(plain, what), abs=1e-4)
    length = secure_length(cfg)
    assert len(uploads) == AGENTS * cfg.learning.rounds
    sizes: dict[int, set[int]] = {}
    for round_, payload in uploads:
        message = messages.decode(payload)
        assert isinstance(message, messages.Masked)
        decoded = secagg.dequantize(np.frombuffer(message.values, dtype="<u4"))
        sizes.setdefault(round_, set()).add(decoded.size)
        assert np.abs(decoded).mean() > 1.0 and (decoded == 0).mean() < 1e-3
    for round_, sized in sizes.items():
        assert len(sized) == 1, round_  # one index set a round, the same for every device
        (size,) = sized
        assert size == length if strategy == "fedldf" else size < length


def secure_length(cfg: ExperimentConfig) -> int:
    """How many values a device of `cfg` masks: every floating entry of the model."""
    learner = build_workload(cfg, [str(k) for k in range(cfg.agents)], agents=[]).learner
    return vector_length(central_strategy(cfg.learning.strategy), learner.facts)


def test_a_round_survives_30_percent_of_its_devices_dropping_mid_round(
    amqtt_broker, tmp_path: Path
) -> None:
    """Of ten agents, two crash once they sent their shares (before they upload: their pairwise
    masks are removed with their mask keys, rebuilt from the others' shares) and one once it
    uploaded (before it reveals: its self mask is rebuilt): round 2 completes without them."""
    cfg = config(rounds=3, agents=10)
    emulation = Emulation(cfg, amqtt_broker.address, options(tmp_path, agents_per_process=5))
    when = {"agent-001": "shares", "agent-006": "shares", "agent-003": "masked"}
    killed: list[str] = []
    globals_: dict[int, dict[str, np.ndarray]] = {}

    def on_message(topic: str, payload: bytes) -> None:
        _, kind, fields = topics.parse(topic)
        if kind == "global":
            message = messages.decode(payload)
            assert isinstance(message, messages.Global)
            decoded = decode_tensors(message.tensors)
            globals_[message.round] = {n: t.values for n, t in decoded.items()}
            return
        agent = fields["agent"]
        if fields["round"] == "2" and when.get(agent) == kind and agent not in killed:
            killed.append(agent)
            host = emulation.processes[agent]
            assert isinstance(host, HostedProcess)
            host.host.kill_agent(agent)

    spy = MqttTransport(amqtt_broker.address, TransportOptions(client_id="spy"))
    spy.subscribe(topics.round_topic(emulation.fleet, "+", "shares", "+", to="+"), on_message)
    spy.subscribe(topics.round_topic(emulation.fleet, "+", "masked"), on_message)
    spy.subscribe(topics.global_model(emulation.fleet, "+"), on_message)
    spy.start()
    try:
        assert spy.wait_subscribed(20.0)
        report = emulation.run()
    finally:
        spy.stop()
    assert sorted(killed) == sorted(when)
    assert report["summary"]["failed_agents"] == dict.fromkeys(sorted(when), -signal.SIGKILL)
    roster = [f"agent-{k:03d}" for k in range(10)]
    participants = [r["participants"] for r in report["rounds"]]
    assert participants[0] == roster
    assert participants[1] == [k for k in roster if when.get(k) != "shares"]
    assert participants[2] == [k for k in roster if k not in when]
    # Round 2's aggregate is a model, not masks left over: one round's step from round 1's.
    step = max(np.abs(globals_[2][n] - globals_[1][n]).max() for n in globals_[1])
    assert 0 < step < 1.0


def test_client_dp_under_secure_aggregation_emulates_as_it_simulates(
    amqtt_broker, tmp_path: Path
) -> None:
    """`--dp client --secure-aggregation --dp-seeded-noise` (the lab's reproducible noise):
    the devices' seeded noise shares are the same in both, so the emulated run is the
    simulated one within quantization, epsilon included."""
    base = config()
    learning = dataclasses.replace(
        base.learning, dp="client", dp_noise=1.1, dp_clip=0.5, dp_seeded_noise=True
    )
    cfg = dataclasses.replace(base, learning=learning)
    assert cfg.learning.aggregation == "mean" and cfg.learning.clip == "off"
    emulated = Emulation(cfg, amqtt_broker.address, options(tmp_path)).run()
    simulated = simulate(cfg)
    assert emulated["summary"]["failed_agents"] == {}
    assert emulated["summary"]["stragglers"] == []
    for what in ("loss", "strategy_accuracy", "epsilon"):
        assert figures(emulated, what) == pytest.approx(figures(simulated, what), abs=1e-6), what
    assert emulated["summary"]["max_epsilon"] == pytest.approx(simulated["summary"]["max_epsilon"])
