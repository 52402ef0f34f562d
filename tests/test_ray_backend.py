"""`coordinator simulate --backend ray` on a Ray the run starts itself: the same report, bit
for bit, as the local backend, every agent-round trained on Ray; and the flags' one-line
mistakes. The two-node cluster is tests/test_ray_cluster.py.

Ray takes seconds to start, so one program (`tests.ray_runs`, in a network namespace of its
own: Ray listens on every interface) runs both strategies for the module (`on_ray`).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from coordinator.cli import main
from coordinator.ports import free_port
from coordinator.simulate import simulate
from tests.netns import Lan, skip_unless_netns
from tests.ray_runs import CONFIGS, command, ray_env, trained
from tests.test_simulate import without_wall_time

pytest.importorskip("ray")


@pytest.fixture(scope="module")
def on_ray(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """Each of `CONFIGS` run with `--backend ray` and no address: on a Ray of two CPUs
    that the run starts and stops, in a namespace whose only network is its own."""
    skip_unless_netns()
    folder = tmp_path_factory.mktemp("ray")
    out, log = folder / "runs.json", folder / "driver.log"
    with tempfile.TemporaryDirectory(prefix="ray-", dir="/tmp") as temp, Lan(["sim"]) as lan:
        driver = lan.popen("sim", command(out, list(CONFIGS)), env=ray_env(Path(temp)), log=log)
        status = driver.wait(timeout=240)  # a hang: the Lan ends the driver and its Ray
    assert status == 0, log.read_text()[-3000:]
    yield json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_ray_tasks_give_the_local_report_bit_for_bit(on_ray: dict, name: str) -> None:
    run = on_ray[name]
    local = json.loads(json.dumps(simulate(CONFIGS[name]())))  # as the report reads back
    assert without_wall_time(run["report"]) == without_wall_time(local)
    assert sum(run["nodes"].values()) == trained(run["report"])  # every round ran on Ray


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_agents_rounds_go_out_several_to_a_task(on_ray: dict, name: str) -> None:
    """DA-DPFL's rounds too; on a Ray started here, agents' states travel with their jobs
    (on a cluster they stay in Ray's object store: tests/test_ray_cluster.py)."""
    run = on_ray[name]
    assert run["tasks"] < trained(run["report"])
    assert run["stored_after_round_1"] == 0


def test_backend_flags_mistakes_are_one_line() -> None:
    runner = CliRunner()
    address_alone = runner.invoke(main, ["simulate", "--ray-address", "127.0.0.1:6379"])
    assert address_alone.exit_code == 2
    assert "--ray-address needs --backend ray" in address_alone.output
    unknown = runner.invoke(main, ["simulate", "--backend", "spark"])
    assert unknown.exit_code == 2 and "'spark' is not one of 'local', 'ray'" in unknown.output


def test_an_address_where_no_ray_answers_is_one_line(tmp_path: Path) -> None:
    """At once, not after Ray's minutes of retries; nothing of Ray starts."""
    nobody = f"127.0.0.1:{free_port()}"
    run = ["simulate", "--agents", "2", "--rounds", "1", "--report", str(tmp_path / "r.json")]
    result = CliRunner().invoke(main, [*run, "--backend", "ray", "--ray-address", nobody])
    assert result.exit_code == 1
    assert f"Error: no Ray cluster answers at {nobody} (Connection refused)" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "r.json").exists()
