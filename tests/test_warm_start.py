"""`init = "previous"` in a decentralized run: each agent starts from its own model, and a
peer's round-0 model (never sent) stands at that start rather than at the seed, for every
`--wire` format. Real agents on one embedded broker, in threads."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from conftest import run_in_threads

from agent.experiment import ExperimentConfig
from agent.learning import State, preset
from agent.runtime import AgentRuntime, Run, Timeouts, new_run_id
from agent.workload import build_workload
from protocol import BrokerAddress, MqttTransport, TransportOptions

FLEET = "warm"
ROSTER = ("a", "b", "c")

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def broker(embedded_address: BrokerAddress) -> BrokerAddress:
    return embedded_address


def warm_run(
    address: BrokerAddress, tmp_path: Path, wire: str, starts: dict[str, State]
) -> dict[str, State]:
    """A two-round dfedavgm run at learning rate 0 whose agents start from `starts` (deltas
    carry every changed value); returns each agent's final weights."""
    config = ExperimentConfig(
        dataset="mnist1d",
        agents=len(ROSTER),
        seed=5,
        init="previous",
        learning=preset("dfedavgm", rounds=2, neighbours=2, lr=0.0, wire=wire, delta_fraction=1.0),
    )
    run = Run(new_run_id(), ROSTER, config)
    finals: dict[str, State] = {}

    def keep(me: str) -> object:
        return lambda state: finals.__setitem__(me, state.weights)

    transports = {
        me: MqttTransport(address, TransportOptions(client_id=f"{FLEET}-{wire}-{me}"))
        for me in ROSTER
    }
    runtimes = [
        AgentRuntime(
            agent_id=me,
            fleet=f"{FLEET}-{wire}",
            run=run,
            workload=build_workload(config, list(ROSTER), agents=[me]),
            transport=transports[me],
            state_dir=tmp_path / f"{wire}-{time.monotonic_ns()}" / me,
            timeouts=Timeouts(round_s=15.0, vote_s=15.0, linger_s=1.0),
            on_finish=keep(me),
            start_from=({n: t.clone() for n, t in starts[me].items()}, None),
        )
        for me in ROSTER
    ]
    for transport in transports.values():
        transport.start()
        assert transport.wait_connected(20)
    try:
        run_in_threads([runtime.run for runtime in runtimes])
    finally:
        for transport in transports.values():
            transport.stop()
    return finals


def seeded_weights() -> State:
    config = ExperimentConfig(
        dataset="mnist1d", agents=len(ROSTER), seed=5, learning=preset("dfedavgm", neighbours=2)
    )
    return build_workload(config, list(ROSTER), agents=["a"]).learner.init_agent("a").weights


@pytest.mark.parametrize("wire", ["full", "delta", "layers"])
def test_agents_that_start_from_one_model_and_learn_nothing_end_on_it(
    broker: BrokerAddress, tmp_path: Path, wire: str
) -> None:
    start = {name: tensor + 0.5 for name, tensor in seeded_weights().items()}
    finals = warm_run(broker, tmp_path, wire, dict.fromkeys(ROSTER, start))
    assert sorted(finals) == list(ROSTER)
    for me, weights in finals.items():
        for name, tensor in weights.items():
            # a seeded round-0 stand-in would pull every value 0.5 / 3 or more towards the seed
            assert torch.allclose(tensor, start[name], atol=1e-5), f"{me}: {name} moved"


def test_peers_rebuild_deltas_on_a_warm_start_they_could_not_derive(
    broker: BrokerAddress, tmp_path: Path
) -> None:
    seeded = seeded_weights()
    starts = {
        me: {name: tensor + 0.25 * (k + 1) for name, tensor in seeded.items()}
        for k, me in enumerate(ROSTER)
    }
    whole = warm_run(broker, tmp_path, "full", starts)
    deltas = warm_run(broker, tmp_path, "delta", starts)
    for me in ROSTER:
        for name, tensor in whole[me].items():
            assert torch.allclose(deltas[me][name], tensor, atol=1e-5), f"{me}: {name} differs"
