"""`coordinator simulate --backend ray --ray-address` on a real two-node Ray cluster: a head
and a second node (`ray start`, one CPU each) on two hosts of an emulated LAN
(`tests.netns.Lan`: network namespaces, nothing reaches the machine's network), with a token
and temporary folders of their own. The run's agents train on both nodes; the second node is
killed after round 1, before Ray can know (it sends round 2's tasks to both nodes), and the
run completes, the tasks the lost node was sent run again on the head (Ray's task retries),
with the numbers of the local backend; agents' states stay in Ray's object store between
rounds (the simulator holds references), DA-DPFL's too (a second run, on the head alone).

A node is `ray start --block` in a process group of its own: killing the group kills the
node's raylet, object store and workers. The head checks its nodes' health every half second,
so a killed node is declared dead in about 2 s rather than Ray's default tens of seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from coordinator.simulate import simulate
from tests.netns import Lan, skip_unless_netns
from tests.processes import wait_for_text
from tests.ray_runs import CONFIGS, command, ray_env, trained
from tests.test_simulate import without_wall_time

pytest.importorskip("ray")

RAY = str(Path(sys.executable).with_name("ray"))
PORT = 6379
"""The head's port: the namespace's own, so free."""
STARTED = "This command will now block forever"
"""What `ray start --block` says once its node runs."""
HEALTH_CHECKS = {
    "RAY_health_check_initial_delay_ms": "0",
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "500",
    "RAY_health_check_failure_threshold": "3",
}
"""The head's checks of its nodes: a dead node known in about 2 s."""


@dataclass
class Cluster:
    lan: Lan
    address: str
    env: dict[str, str]
    """The environment of the cluster's programs (`ray_env`)."""
    second: subprocess.Popen[bytes]
    """The second node's `ray start` (its process group holds the node's processes)."""


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A head on host `head` and a second node on host `second`, one CPU each; the LAN ends
    them, and their temporary folders go, at the end."""
    skip_unless_netns()
    with (
        tempfile.TemporaryDirectory(prefix="ray-", dir="/tmp") as temp,
        Lan(["head", "second"]) as lan,
    ):
        env = ray_env(Path(temp))
        address = f"{lan.address('head')}:{PORT}"
        start = ["--head", "--port", str(PORT), "--include-dashboard", "false"]
        _node(lan, "head", start, {**env, **HEALTH_CHECKS}, tmp_path)
        second = _node(lan, "second", ["--address", address], env, tmp_path)
        yield Cluster(lan, address, env, second)


def _node(
    lan: Lan, host: str, args: list[str], env: dict[str, str], logs: Path
) -> subprocess.Popen[bytes]:
    """A node on `host`, started (`ray start --block`, its temporary files its own)."""
    log = logs / f"{host}.log"
    temp = Path(env["RAY_TMPDIR"]) / host
    node = lan.popen(
        host,
        [RAY, "start", *args, "--node-ip-address", lan.address(host), "--num-cpus", "1"]
        + ["--temp-dir", str(temp), "--block"],
        env=env,
        log=log,
    )
    wait_for_text(log, STARTED, timeout_s=120, process=node)
    return node


@pytest.mark.slow
def test_agents_train_on_both_nodes_and_a_lost_node_changes_no_number(
    cluster: Cluster, tmp_path: Path
) -> None:
    out, log = tmp_path / "run.json", tmp_path / "driver.log"
    options = ["--address", cluster.address, "--nodes", "2", "--lose", str(cluster.second.pid)]
    names = ["fedavg", "dadpfl"]  # the second node is lost in the first
    driver = cluster.lan.popen("head", command(out, names, *options), env=cluster.env, log=log)
    assert driver.wait(timeout=240) == 0, log.read_text()[-3000:]
    runs = json.loads(out.read_text())
    for name in names:
        local = json.loads(json.dumps(simulate(CONFIGS[name]())))  # as the report reads back
        assert without_wall_time(runs[name]["report"]) == without_wall_time(local)
        assert sum(runs[name]["nodes"].values()) == trained(local)  # every agent-round, once
        # between rounds the simulator held every agent's state by reference only
        assert runs[name]["stored_after_round_1"] == CONFIGS[name]().agents
    before, after = runs["fedavg"]["before_loss"], runs["fedavg"]["nodes"]
    assert len(before) == 2  # both nodes trained agents in round 1
    assert cluster.second.poll() is not None  # the second node was lost mid-run
    assert sorted(after[node] > before[node] for node in before) == [False, True]  # the head
