"""Asynchronous decentralized rounds (`--asynchronous`): the staleness weighting of the
aggregate, which model of each neighbour a round takes, the refusals, and simulate's
event-driven order on the virtual clock."""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from agent.learning import Published, preset, robust_rules, sparse
from agent.learning.asynchronous import freshest
from agent.learning.learner import AgentState, combine
from agent.learning.staleness import staleness_weight
from agent.runtime import checkpoint
from coordinator.emulate import Emulation, EmulationOptions
from coordinator.simulate import ExperimentConfig, simulate

MEAN = robust_rules.parse_rule("mean")


def masked_models() -> tuple[dict, dict]:
    ones = torch.ones(4, dtype=torch.bool)
    models = {
        "a": (
            {"w": torch.tensor([1.0, 2.0, 0.0, 4.0]), "b": torch.tensor([1.0])},
            {"w": torch.tensor([True, True, False, True])},
        ),
        "b": (
            {"w": torch.tensor([3.0, 0.0, 5.0, 8.0]), "b": torch.tensor([3.0])},
            {"w": torch.tensor([True, False, True, True])},
        ),
    }
    return models, {"w": ones}


def test_unit_weights_give_eq7_exactly() -> None:
    models, own = masked_models()
    plain = sparse.aggregate_masked(models, own)
    weighted = sparse.aggregate_masked(models, own, {"a": 1.0, "b": 1.0})
    assert all(torch.equal(plain[n], weighted[n]) for n in plain)


def test_a_stale_sender_counts_by_its_weight_over_the_entries_it_holds() -> None:
    models, own = masked_models()
    out = sparse.aggregate_masked(models, own, {"a": 1.0, "b": 0.25})
    # entry 0 both hold: (1 + 0.25 * 3) / 1.25; entry 1 only a; entry 2 only b (its own value)
    assert out["w"].tolist() == pytest.approx([1.4, 2.0, 5.0, (4 + 2) / 1.25])
    assert out["b"].item() == pytest.approx((1 + 0.75) / 1.25)  # dense: the weighted mean
    cut = sparse.aggregate_masked(
        models, {"w": torch.tensor([True, True, False, False])}, {"a": 1.0, "b": 0.25}
    )
    assert cut["w"].tolist()[2:] == [0.0, 0.0]  # the own mask cuts the aggregate


def test_combine_weights_the_neighbours_and_counts_the_agent_once_at_weight_one() -> None:
    agent = AgentState("k", {"w": torch.tensor([0.0])}, None, {"w": torch.tensor([0.0])})
    inbox = {"j": Published({"w": torch.tensor([3.0])}, None, 10)}
    assert combine(agent, inbox, MEAN)["w"].item() == pytest.approx(1.5)
    assert combine(agent, inbox, MEAN, weights={"j": 0.5})["w"].item() == pytest.approx(1.0)


def test_freshest_takes_the_newest_held_within_max_staleness() -> None:
    held = {"a": [0, 3, 5], "b": [0, 1], "c": [0, 6]}

    def newest(sender: str, up_to: int) -> int | None:
        return max((r for r in held[sender] if r <= up_to), default=None)

    chosen = freshest({(6, "a"), (5, "b"), (5, "c")}, newest, 2, "polynomial")
    assert set(chosen.taken) == {"a"}
    assert chosen.taken["a"].round == 5 and chosen.taken["a"].staleness == 1
    assert chosen.taken["a"].weight == pytest.approx(staleness_weight(1, "polynomial"))
    assert "b" in chosen.ignored  # its newest (round 1) is 4 rounds stale > 2
    assert "c" in chosen.ignored  # round 6 is newer than round 5 needs, round 0 too stale
    assert chosen.staleness == 1.0
    fresh = freshest({(6, "a")}, lambda j, r: r, 2, "polynomial")
    assert fresh.weights is None and fresh.staleness == 0.0  # eq. 7 as a synchronous round
    nothing = freshest({(6, "b")}, newest, 2, "constant")
    assert nothing.taken == {} and nothing.staleness is None and nothing.weights is None


@pytest.mark.parametrize(
    ("over", "words"),
    [
        ({"strategy": "fedavg"}, "--asynchronous runs dadpfl, dispfl, dfedavgm only"),
        ({"strategy": "local"}, "--asynchronous runs dadpfl, dispfl, dfedavgm only"),
        ({"wire": "delta"}, "use --wire full"),
        ({"wire": "layers"}, "use --wire full"),
        ({"aggregation": "median"}, "use --aggregation mean"),
        ({"max_staleness": -1}, "--max-staleness must be >= 0"),
    ],
)
def test_what_asynchronous_rounds_cannot_run_is_refused_in_one_line(over: dict, words: str) -> None:
    strategy = over.pop("strategy", "dadpfl")
    config = ExperimentConfig(
        dataset="digits", agents=8, learning=preset(strategy, asynchronous=True, **over)
    )
    with pytest.raises(ValueError, match=words) as caught:
        config.validate()
    assert "\n" not in str(caught.value)


def fleet(**learning: object) -> ExperimentConfig:
    return ExperimentConfig(
        dataset="digits",
        agents=4,
        seed=5,
        learning=preset("dadpfl", **{"rounds": 4, "neighbours": 2, "epochs": 1, **learning}),
    )


def figures(report: dict) -> list:
    return [
        {
            k: (a["accuracy"], a["sparsity"], a.get("staleness"), a.get("finished_at"))
            for k, a in r["agents"].items()
        }
        for r in report["rounds"]
    ]


def test_asynchronous_simulation_is_deterministic_and_records_staleness_and_time() -> None:
    first, second = simulate(fleet(asynchronous=True)), simulate(fleet(asynchronous=True))
    assert figures(first) == figures(second)
    last = first["rounds"][-1]["agents"]
    assert all(a["finished_at"] == 4.0 for a in last.values())  # 1 virtual second a round
    # equally fast: a prior neighbour's round-t model ends with round t, so it comes 1 stale
    assert any(a["staleness"] > 0 for r in first["rounds"] for a in r["agents"].values())


def test_equal_speeds_without_prior_neighbours_reduce_to_the_synchronous_run() -> None:
    same = {"max_wait": 0, "staleness_weight": "polynomial"}
    synchronous = simulate(fleet(**same))
    asynchronous = simulate(fleet(asynchronous=True, **same))
    strip = [{k: a[:2] for k, a in r.items()} for r in figures(asynchronous)]
    assert strip == [{k: a[:2] for k, a in r.items()} for r in figures(synchronous)]
    assert {a["staleness"] for r in asynchronous["rounds"] for a in r["agents"].values()} == {0.0}


def test_a_slow_board_is_taken_late_and_the_fast_ones_do_not_wait_for_it() -> None:
    config = dataclasses.replace(fleet(asynchronous=True, rounds=6), profiles="mixed")
    report = simulate(config)
    ends = {k: a["finished_at"] for k, a in report["rounds"][-1]["agents"].items()}
    assert max(ends.values()) > 2 * min(ends.values())  # nobody waited for the slowest
    staleness = [a.get("staleness") for r in report["rounds"] for a in r["agents"].values()]
    assert max(s for s in staleness if s is not None) > 1


ROUNDS = 10
WAIT_BOUND_S = 120.0


def test_a_fleet_that_never_waits_over_a_real_broker(amqtt_broker, tmp_path: Path) -> None:
    """Four agent processes, DA-DPFL --asynchronous: agent-003 is stopped (SIGSTOP) after its
    first round and agent-002 killed (SIGKILL) after its second; the other two get 4 rounds
    further while agent-003 sleeps (a synchronous round would wait the 300 s round timeout), and
    after SIGCONT agent-003 catches up and every live agent finishes. The others' records
    show agent-003 left out past --max-staleness or taken stale, and the dead one left out."""
    learning = preset(
        "dadpfl", rounds=ROUNDS, neighbours=3, epochs=1, asynchronous=True, max_staleness=2
    )
    config = ExperimentConfig(dataset="digits", agents=4, seed=2, learning=learning)
    options = EmulationOptions(workdir=tmp_path / "fleet", round_timeout_s=300.0, linger_s=2.0)
    emulation = Emulation(config, amqtt_broker.address, options)
    result: dict[str, Any] = {}
    stop = threading.Event()  # set on a failure: the run ends its agents
    thread = threading.Thread(
        target=lambda: result.update(report=emulation.run(stop=stop)), daemon=True
    )
    sleeper, dead = emulation.processes, ["agent-003", "agent-002"]
    thread.start()
    try:
        wait_for_round(emulation, thread, "agent-003", 1)
        sleeper["agent-003"].send_signal(signal.SIGSTOP)
        asleep = max(checkpoint.read_records(emulation.round_log("agent-003")))
        wait_for_round(emulation, thread, "agent-002", 2)
        sleeper["agent-002"].send_signal(signal.SIGKILL)
        for awake in ("agent-000", "agent-001"):  # its models are > 2 rounds stale by then
            wait_for_round(emulation, thread, awake, asleep + 4)
        assert max(checkpoint.read_records(emulation.round_log("agent-003"))) == asleep
    except BaseException:
        stop.set()
        raise
    finally:
        sleeper["agent-003"].send_signal(signal.SIGCONT)
        thread.join(240)
    assert not thread.is_alive(), "the run did not end"
    report = result["report"]
    assert report["summary"]["failures"].keys() == {dead[1]}
    for agent in ("agent-000", "agent-001", "agent-003"):  # agent-003 caught up
        assert max(checkpoint.read_records(emulation.round_log(agent))) == ROUNDS
    awake = [r["agents"][k] for r in report["rounds"][2:] for k in ("agent-000", "agent-001")]
    assert any(dead[0] in a["stragglers"] for a in awake)  # too stale: left out
    assert any(dead[1] in a["stragglers"] for a in awake)  # gone: left out
    assert any(a.get("staleness", 0) > 0 for a in awake)  # taken late


def wait_for_round(emulation: Emulation, thread: threading.Thread, agent: str, round_: int):
    """Wait until `agent` logged round `round_` (while the run goes on), for at most
    `WAIT_BOUND_S`: far less than the round timeout a synchronous agent would wait out."""
    path = emulation.round_log(agent)
    deadline = time.monotonic() + WAIT_BOUND_S
    while round_ not in checkpoint.read_records(path):
        assert thread.is_alive(), f"the run ended before {agent} logged round {round_}"
        assert time.monotonic() < deadline, f"{agent} did not log round {round_}: it waited"
        thread.join(0.05)
