"""A fleet in one process: the real agent runtime (`AgentRuntime`, its session, round driver
and wire format) over in-memory transports sharing one `MemoryBroker`, no broker process
(under a centralized strategy with the coordinator's real `Aggregator` beside it). It learns
exactly what `coordinator simulate` computes for the same configuration, as real agents over
a real broker do (tests/test_emulate.py), also when every message reaches the handlers
twice."""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Any

import pytest
from conftest import run_in_threads

from agent.experiment import ExperimentConfig, config_to_dict
from agent.learning import preset
from agent.model_store import FINISHED_MARK, run_folder
from agent.runtime import AgentRuntime, Run, Timeouts, checkpoint, new_run_id
from agent.service import ROUND_LOG, AgentService, ServiceOptions
from agent.workload import build_workload
from coordinator.aggregator import Aggregator
from coordinator.simulate import simulate
from protocol import Identity, MemoryBroker, MemoryTransport, messages, topics

FLEET = "memory"
ROSTER = ("agent-000", "agent-001", "agent-002")
RUN_S = 120.0

pytestmark = pytest.mark.timeout(300)

Figures = dict[tuple[int, str], tuple[float, float]]


def config(**learning: Any) -> ExperimentConfig:
    learning = {"rounds": 2, "neighbours": 2, "epochs": 1, "max_wait": 2, **learning}
    return ExperimentConfig(
        dataset="mnist1d",
        agents=len(ROSTER),
        partition="dirichlet:0.5",
        seed=7,
        learning=preset("dadpfl", **learning),
    )


def run_fleet(
    cfg: ExperimentConfig,
    broker: MemoryBroker,
    tmp_path: Path,
    duplicates: bool,
    run: Run | None = None,
) -> dict[tuple[int, str], dict[str, Any]]:
    """Every agent of ROSTER in a thread of its own, as `coordinator emulate` runs them in a
    host process (agent/host.py) but on transports in memory; returns their round records."""
    run = run or Run(new_run_id(), ROSTER, cfg)
    records: dict[tuple[int, str], dict[str, Any]] = {}
    transports = {me: MemoryTransport(broker, me, duplicates=duplicates) for me in ROSTER}

    def keep(me: str) -> Any:
        return lambda row: records.__setitem__((row["round"], me), row)

    runtimes = [
        AgentRuntime(
            agent_id=me,
            fleet=FLEET,
            run=run,
            workload=build_workload(cfg, list(ROSTER), agents=[me]),
            transport=transports[me],
            state_dir=tmp_path / me,
            timeouts=Timeouts(round_s=RUN_S, vote_s=RUN_S, linger_s=5.0),
            on_round=keep(me),
        )
        for me in ROSTER
    ]
    for transport in transports.values():
        transport.start()
    try:
        run_in_threads([runtime.run for runtime in runtimes], timeout_s=RUN_S)
    finally:
        for transport in transports.values():
            transport.stop()
    assert all(runtime.session.finished for runtime in runtimes)
    for me, transport in transports.items():
        stats = transport.stats
        assert stats["received_messages"] > 0, me
        assert not {k: n for k, n in stats.items() if "dropped" in k or "error" in k}, me
    return records


def simulated(cfg: ExperimentConfig) -> Figures:
    report = simulate(cfg)
    return {
        (r["round"], agent): (a["accuracy"], a["sparsity"])
        for r in report["rounds"]
        for agent, a in r["agents"].items()
    }


def retained(broker: MemoryBroker, topic_filter: str) -> list[str]:
    """The topics `broker` retains a message on under `topic_filter`: what a new subscriber
    gets first (a marker published after it comes last)."""
    got: queue.Queue[str] = queue.Queue()
    with MemoryTransport(broker, "reader") as reader:
        reader.subscribe(topic_filter, lambda topic, _: got.put(topic))
        reader.subscribe("test/marker", lambda topic, _: got.put(topic))
        reader.publish("test/marker", b"")
        return list(iter(lambda: got.get(timeout=5), "test/marker"))


def assert_learns_as_simulate(cfg: ExperimentConfig, records: dict[tuple[int, str], Any]) -> None:
    got = {key: (row["accuracy"], row["sparsity"]) for key, row in records.items()}
    want = simulated(cfg)
    assert got.keys() == want.keys() == {(r, a) for r in (1, 2) for a in ROSTER}
    for key, (accuracy, sparsity) in want.items():
        assert got[key][0] == pytest.approx(accuracy, abs=1e-6), key
        assert got[key][1] == pytest.approx(sparsity, abs=1e-6), key
    assert all(not row["stragglers"] for row in records.values()), "nothing is lost in memory"


@pytest.mark.parametrize(
    ("learning", "duplicates"),
    [({}, False), ({"wire": "layers", "ldf_n": 1}, False), ({"wire": "delta"}, True)],
    ids=["full", "layers", "delta-duplicates"],
)
def test_a_fleet_in_memory_learns_what_simulate_computes(
    tmp_path: Path, learning: dict[str, Any], duplicates: bool
) -> None:
    cfg, broker = config(**learning), MemoryBroker()
    records = run_fleet(cfg, broker, tmp_path, duplicates)
    assert_learns_as_simulate(cfg, records)
    assert all(row["bytes_sent"] > 0 and row["bytes_received"] > 0 for row in records.values())
    # Served layers are retained until their sender clears them, at the latest at its end.
    assert retained(broker, topics.layer(FLEET, "+", "+", "+")) == []
    statuses = [topics.status(FLEET, me) for me in ROSTER]
    assert sorted(retained(broker, topics.status(FLEET))) == statuses


def test_agents_as_the_cli_runs_them_join_a_run_from_its_retained_message(tmp_path: Path) -> None:
    """`AgentService`, what `edge-agent` runs on a transport it joined with: the run comes
    from the retained run message (published here before any agent subscribed), and each
    agent keeps its model and marks the run finished."""
    cfg, broker, stop = config(), MemoryBroker(), threading.Event()
    offer = messages.RunConfig(
        fleet=FLEET,
        sender="coordinator",
        run_id=new_run_id(),
        roster=list(ROSTER),
        seed=cfg.seed,
        config=config_to_dict(cfg),
    )
    with MemoryTransport(broker, "coordinator") as coordinator:
        coordinator.publish(topics.run(FLEET), messages.encode(offer), retain=True)
        transports = {me: MemoryTransport(broker, me) for me in ROSTER}
        timeouts = Timeouts(round_s=RUN_S, vote_s=RUN_S, linger_s=5.0)
        services = [
            AgentService(
                Identity(FLEET, me),
                transports[me],
                ServiceOptions(state_dir=tmp_path / me, timeouts=timeouts, once=True),
                stop,
            )
            for me in ROSTER
        ]
        for transport in transports.values():
            transport.start()
        try:
            run_in_threads([service.serve for service in services], timeout_s=RUN_S)
        finally:
            stop.set()
            for transport in transports.values():
                transport.stop()
    folders = {me: run_folder(tmp_path / me, offer.run_id) for me in ROSTER}
    assert all((folder / FINISHED_MARK).exists() for folder in folders.values())
    records = {
        (round_, me): row
        for me, folder in folders.items()
        for round_, row in checkpoint.read_records(folder / ROUND_LOG).items()
    }
    assert_learns_as_simulate(cfg, records)


JUDGED = ("accuracy", "loss", "train_loss", "sparsity", "train_flops", "p_k", "kept")
"""A participant's figures of its round (`AgentRound.of_fit`), beside its traffic."""


@pytest.mark.parametrize(
    "learning",
    [{"strategy": "fedavg"}, {"strategy": "fedspu"}, {"strategy": "fedldf", "ldf_n": 1}],
    ids=["fedavg", "fedspu-downloads", "fedldf-asks-layers"],
)
def test_a_centralized_fleet_in_memory_learns_what_simulate_computes(
    tmp_path: Path, learning: dict[str, Any]
) -> None:
    """Participants' rounds as the agent runtime takes them, over the wire to the
    coordinator's aggregator, give every figure of each round simulate reports: the
    participant's side of a centralized round is written once (`central.participant`)."""
    cfg = ExperimentConfig(
        dataset="mnist1d",
        agents=len(ROSTER),
        partition="dirichlet:0.5",
        seed=7,
        learning=preset(learning.pop("strategy"), rounds=2, epochs=1, **learning),
    )
    broker = MemoryBroker()
    run = Run(new_run_id(), ROSTER, cfg, aggregator="coordinator")
    with MemoryTransport(broker, "coordinator") as transport:
        aggregator = Aggregator(
            fleet=FLEET,
            run_id=run.run_id,
            roster=list(ROSTER),
            config=cfg,
            transport=transport,
            round_timeout_s=RUN_S,
        )
        aggregator.start()
        thread = threading.Thread(target=aggregator.run)
        thread.start()
        try:
            records = run_fleet(cfg, broker, tmp_path, False, run)
        finally:
            aggregator.stop.set()
            thread.join(RUN_S)
    assert aggregator.error is None
    assert [r.participants for r in aggregator.records] == [list(ROSTER)] * 2
    report = simulate(cfg)
    want = {(r["round"], k): a for r in report["rounds"] for k, a in r["agents"].items()}
    assert records.keys() == want.keys()
    for key, row in records.items():
        assert {f: row[f] for f in JUDGED} == pytest.approx({f: want[key][f] for f in JUDGED})
        assert not row["stragglers"], key
