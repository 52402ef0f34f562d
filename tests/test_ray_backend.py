"""`coordinator simulate --backend ray` on a Ray started in this process: the same report, bit
for bit, as the local backend, and the flags' one-line mistakes.

Ray takes seconds to start, so one Ray (`local_ray`, two CPUs on loopback, its files in a
temporary folder removed at the end) serves the module. The two-node cluster is
tests/test_ray_cluster.py.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator

import pytest
from click.testing import CliRunner

from coordinator.cli import main
from coordinator.simulate import Simulation, simulate
from tests.test_simulate import FEDAVG_EVERY_AGENT_STOPS, small, without_wall_time

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """A Ray of two CPUs on 127.0.0.1 for the module, its temporary files removed after (a
    short path: Ray's sockets live there and a socket's path has at most 107 bytes)."""
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    ray.init(
        num_cpus=2,
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        _temp_dir=temp,
        logging_level="WARNING",
    )
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.parametrize(
    ("strategy", "learning"),
    [
        ("dadpfl", {}),  # reuse order: agents start once their prior neighbours published
        ("fedavg", FEDAVG_EVERY_AGENT_STOPS),  # a round's fits all at once; agents stop
    ],
)
def test_ray_tasks_give_the_local_report_bit_for_bit(
    local_ray: None, strategy: str, learning: dict
) -> None:
    config = small(strategy, **learning)
    on_ray = Simulation(config, backend="ray")
    report = on_ray.run()
    assert without_wall_time(report) == without_wall_time(simulate(config))
    assert sum(on_ray.training.nodes.values()) == trained(report)  # every round ran on Ray


def trained(report: dict) -> int:
    """The agent-rounds a report's agents trained: all but those of agents stopped before."""
    rounds = report["rounds"]
    before = [{k: False for k in rounds[0]["agents"]}] + [
        {k: a["stopped"] for k, a in r["agents"].items()} for r in rounds
    ]
    return sum(not stopped for r in before[: len(rounds)] for stopped in r.values())


def test_backend_flags_mistakes_are_one_line() -> None:
    runner = CliRunner()
    address_alone = runner.invoke(main, ["simulate", "--ray-address", "127.0.0.1:6379"])
    assert address_alone.exit_code == 2
    assert "--ray-address needs --backend ray" in address_alone.output
    unknown = runner.invoke(main, ["simulate", "--backend", "spark"])
    assert unknown.exit_code == 2 and "'spark' is not one of 'local', 'ray'" in unknown.output
