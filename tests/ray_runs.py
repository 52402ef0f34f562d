"""Runs of `simulate --backend ray` as a program of their own, for tests/test_ray_*.py.

Ray 2.60 listens on every interface whatever node address it is given (`ray start
--node-ip-address 127.0.0.1` and `ray.init(_node_ip_address="127.0.0.1")` are both turned
into the machine's reachable address), so the tests run Ray only inside network namespaces
(`tests.netns.Lan`), where nothing reaches the machine's own network: the run is a program
started in a namespace (`python -m tests.ray_runs OUT NAME... [--address HOST:PORT] [--lose
PGID]`) that writes each named run's report, and the Ray nodes its agents trained on, to OUT
as JSON. Every Ray program of a test has the environment `ray_env` gives: a token of its
own (never ~/.ray's) and its temporary files in the test's folder.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from coordinator.ray_backend import RayTraining
from coordinator.simulate import ExperimentConfig, Simulation
from coordinator.training_pool import Stored
from tests.processes import REPO
from tests.test_simulate import FEDAVG_EVERY_AGENT_STOPS, small

CONFIGS: dict[str, Callable[[], ExperimentConfig]] = {
    "dadpfl": lambda: small("dadpfl"),  # reuse order: agents wait for prior neighbours
    # a round's fits at once, 12 in 8 batches (`BATCHES_PER_CPU` x 2 CPUs); agents stop early
    "fedavg": lambda: small("fedavg", agents=12, **FEDAVG_EVERY_AGENT_STOPS),
}
"""The runs a test asks for, by name: the driver and the test build the same config."""

WORKERS = 2
"""The CPUs of the Ray a run without --address starts (`--workers`)."""


def ray_env(temp: Path) -> dict[str, str]:
    """The environment of a test's Ray programs: token authentication with a token of their
    own, temporary files under `temp` (a short path: Ray's sockets live there, and a
    socket's path has at most 107 bytes), this checkout importable."""
    return {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "RAY_TMPDIR": str(temp),
        "PYTHONPATH": str(REPO),
    }


def command(out: Path, names: list[str], *options: str) -> list[str]:
    """The driver's command line."""
    return [sys.executable, "-m", "tests.ray_runs", str(out), *names, *options]


def trained(report: dict) -> int:
    """The agent-rounds a report's agents trained: all but those of agents stopped before."""
    rounds = report["rounds"]
    before = [{k: False for k in rounds[0]["agents"]}] + [
        {k: a["stopped"] for k, a in r["agents"].items()} for r in rounds
    ]
    return sum(not stopped for r in before[: len(rounds)] for stopped in r.values())


def run(name: str, address: str | None, lose: int | None) -> dict:
    """The named run on Ray: its report, the agent-rounds each node trained, the Ray tasks
    the run sent, how many agents' states the simulator held only by reference (`Stored`)
    once round 1 was done, and (with `lose`, a process group killed after round 1's last
    agent, before round 2 starts) the agent-rounds each node had trained before. Ray takes a
    while to see a node die, so it still sends some of round 2's tasks to a lost node, and
    they must run again elsewhere."""
    config = CONFIGS[name]()
    simulation = Simulation(config, WORKERS, "ray", address)
    before_loss: dict[str, int] = {}
    done: list[str] = []
    stored: list[int] = []

    def progress(round_: int, agent: str) -> None:
        done.append(agent)
        if round_ == 1 and len(done) == config.agents:
            held = [simulation.states.held(k) for k in simulation.roster]
            stored.append(sum(isinstance(state, Stored) for state in held))
            if lose:
                before_loss.update(simulation.training.nodes)
                os.killpg(lose, signal.SIGKILL)

    report = simulation.run(progress)
    training = simulation.training
    assert isinstance(training, RayTraining)
    return {
        "report": report,
        "nodes": dict(training.nodes),
        "tasks": training.tasks,
        "stored_after_round_1": stored[0],
        "before_loss": before_loss,
    }


def wait_for_nodes(address: str, count: int, timeout_s: float = 120.0) -> None:
    """Until the cluster at `address` has `count` live nodes: a node whose `ray start` said
    it runs may not have joined the head yet, and tasks spread only over the nodes there."""
    import ray

    ray.init(address=address, logging_level="WARNING")
    try:
        deadline = time.monotonic() + timeout_s
        while sum(n["Alive"] for n in ray.nodes()) < count:
            if time.monotonic() > deadline:
                raise SystemExit(f"the cluster at {address} has not {count} nodes")
            time.sleep(0.2)
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.ray_runs")
    parser.add_argument("out", type=Path)
    parser.add_argument("names", nargs="+", choices=sorted(CONFIGS))
    parser.add_argument("--address", help="the cluster's head (none: start a Ray here)")
    parser.add_argument("--lose", type=int, help="a process group to kill in the first run")
    parser.add_argument("--nodes", type=int, default=1, help="wait for this many nodes")
    args = parser.parse_args()
    if args.address:
        wait_for_nodes(args.address, args.nodes)
    runs = {}
    for i, name in enumerate(args.names):  # a lost node is lost in the first run
        runs[name] = run(name, args.address, args.lose if i == 0 else None)
    args.out.write_text(json.dumps(runs))


if __name__ == "__main__":
    main()
