"""`coordinator simulate` at 100, 1,000 and 10,000 agents, side by side with Flower: seconds
and CPU seconds per round, and memory, for the local backend (one process), `--backend ray`
(a Ray of 2 CPUs that the run starts), `--ray-address` of a Ray head of 2 CPUs started
here (`cluster`: agents' states in Ray's object store, models sparse, as on a cluster) and
Flower's Ray simulation of the same FedAvg task.

    python -m bench.sim_scale [--quick] [--agents 100,1000,10000]
        [--strategies fedavg,dadpfl] [--engines local,ray,cluster,flower] [--seeds 1,2]
        [--rounds 3] [--big-rounds 2] [--epochs 1] [--timeout 900]
        [--out bench/results/sim_scale.json]

`--quick`: 100 and 1,000 agents, seed 1, 2 rounds: a few minutes on an idle machine.

The task: FedProx's synthetic set with a group of 200 samples per 10 agents (so every agent
holds about 20 samples at every fleet size, and an agent-round costs the same), our MLP,
one local epoch; FedAvg with every agent every round (edgefl's FedAvg has no participation
fraction, so Flower's runs with `fraction_train` 1.0 too), DA-DPFL with M = 5 neighbours
(Flower has no decentralized strategy). Each run is a program of its own (`--one`; Flower's:
`bench.flower_sim`, in Flower's environment), watched from here every 0.25 s:

* s / round: the steady mean (rounds 2 to the last; the start, Ray's included, lands in
  round 1), from each round's end (the simulator's last agent; Flower's `evaluate_fn`).
* CPU s / round: user + system seconds of the run's whole process tree (Ray's processes
  included) over the same rounds: on a machine shared with other work, what the round
  cost; and per agent-round (ms), the figure issue 50 compares across fleet sizes.
* driver MB / agent: the run's own process (the simulator, Flower's server): its peak RSS
  less its RSS before the fleet was built, per agent; its RSS counts the pages of Ray's
  object store (shared memory) it wrote or read, so driver anon MB is its peak of private
  memory (RssAnon) alone. Tree MB: the peak of the tree's proportional set size (PSS:
  shared pages, Ray's object store among them, counted once).
* identical: the local and Ray reports of one (agents, strategy, seed) are the same, wall
  time aside.

The engines of one (agents, seed) run one after the other (interleaved, so the machine's
other work falls on all of them alike), each seed a pass. Runs that pass `--timeout` are
reported with the rounds they finished.

Ray (and Flower's Ray) listens on every interface of the machine it runs on; run this inside
a network namespace whose only network is its own, with a Ray token and temporary folder:
`ip netns add bench && ip -n bench link set lo up && ip netns exec bench env
RAY_AUTH_MODE=token RAY_AUTH_TOKEN=$(openssl rand -hex 32) RAY_TMPDIR=/tmp/bench-ray python
-m bench.sim_scale` (then `ip netns del bench`). Flower's environment: `bench/flower_sim.py`.

Measured here: docs/scaling.md, "Simulating on a Ray cluster" (bench/results/sim_scale.json).
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import hashlib
import json
import os
import pathlib
import resource
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import psutil
from rich.console import Console
from rich.table import Table

from bench.support import environment, seeds, steady_round_s, write_json

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENGINES = ("local", "ray", "cluster", "flower")
BACKEND = {"local": "local", "ray": "ray", "cluster": "ray"}
"""An engine's `simulate --backend` (`cluster`: `--ray-address` of a head started here)."""
HEAD_STARTED = "This command will now block forever"
FLOWER_PYTHON = os.environ.get("FLOWER_PYTHON", "/tmp/flwr-venv/bin/python")
"""The Python of Flower's environment (`bench/flower_sim.py` says how to make it)."""
NEIGHBOURS = 5
AGENTS_PER_GROUP = 10
"""Agents per synthetic group of 200 samples: about 20 samples an agent at every size."""
QUICK = {"agents": "100,1000", "seeds": [1], "rounds": 2}


def config_of(spec: dict[str, Any]) -> Any:
    """The run a spec names (the simulator's and Flower's alike)."""
    from agent.experiment import ExperimentConfig
    from agent.learning import preset

    extra = {"neighbours": NEIGHBOURS} if spec["strategy"] == "dadpfl" else {}
    groups = max(1, spec["agents"] // AGENTS_PER_GROUP)
    return ExperimentConfig(
        dataset=f"synthetic:1,1,{groups}",
        agents=spec["agents"],
        seed=spec["seed"],
        learning=preset(spec["strategy"], rounds=spec["rounds"], epochs=1, **extra),
    )


def one(spec: dict[str, Any]) -> dict[str, Any]:
    """One simulate run of `spec` in this process: round ends, memory, the report's digest."""
    from coordinator.simulate import Simulation

    before_mb = psutil.Process().memory_info().rss / 2**20
    ends: dict[int, float] = {}

    def progress(round_: int, _agent: str) -> None:
        ends[round_] = time.time()

    started = time.time()
    workers = 2 if spec["engine"] == "ray" else 1  # a Ray of 2 CPUs; locally, one process
    backend, address = BACKEND[spec["engine"]], spec.get("address")
    report = Simulation(config_of(spec), workers, backend, address).run(progress)
    report["summary"]["wall_seconds"] = None
    return {
        "ends": {str(t): end for t, end in ends.items()},
        "started": started,
        "wall_s": time.time() - started,
        "rounds_done": len(ends),
        "failed": None,
        "before_mb": before_mb,
        "driver_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "driver_cpu_s": time.process_time(),
        "digest": hashlib.sha256(json.dumps(report, sort_keys=True).encode()).hexdigest(),
    }


class TreeWatch(threading.Thread):
    """A process and its descendants, sampled every `period_s`: their CPU seconds (a process
    that ended keeps its last sample) with the time, and the peak of their summed PSS."""

    def __init__(self, pids: list[int], period_s: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.roots, self.period_s = [psutil.Process(pid) for pid in pids], period_s
        self.cpu: dict[int, float] = {}
        self.samples: list[tuple[float, float]] = []
        self.peak_pss_mb = 0.0
        self.peak_anon_mb = 0.0
        """The first root's peak of private memory (RssAnon: its heap, not the shared
        pages of Ray's object store that RSS counts once it touched them)."""
        self.done = threading.Event()

    def sample(self) -> None:
        pss = 0.0
        tree = []
        for root in self.roots:
            with contextlib.suppress(psutil.Error):
                tree += [root, *root.children(recursive=True)]
        for process in tree:
            try:
                times = process.cpu_times()
                pss += process.memory_full_info().pss
            except psutil.Error:
                continue
            self.cpu[process.pid] = times.user + times.system
        self.samples.append((time.time(), sum(self.cpu.values())))
        self.peak_pss_mb = max(self.peak_pss_mb, pss / 2**20)
        with contextlib.suppress(OSError):
            status = pathlib.Path(f"/proc/{self.roots[0].pid}/status").read_text()
            anon = next(line for line in status.splitlines() if line.startswith("RssAnon:"))
            self.peak_anon_mb = max(self.peak_anon_mb, int(anon.split()[1]) / 1024)

    def run(self) -> None:
        while not self.done.is_set():
            self.sample()
            self.done.wait(self.period_s)

    def at(self, when: float) -> float:
        """CPU seconds used by `when`, interpolated between the samples around it."""
        i = bisect.bisect_left(self.samples, (when, -1.0))
        if i == 0 or i == len(self.samples):
            return self.samples[min(i, len(self.samples) - 1)][1]
        (t0, c0), (t1, c1) = self.samples[i - 1], self.samples[i]
        return c0 + (c1 - c0) * (when - t0) / (t1 - t0) if t1 > t0 else c1


@contextlib.contextmanager
def ray_head() -> Iterator[tuple[str, int]]:
    """A Ray head of 2 CPUs on this machine (`ray start --head --block`, its own process
    group, ended at the end): its address and pid."""
    from coordinator.ports import free_port

    port = free_port()
    ray = str(pathlib.Path(sys.executable).with_name("ray"))
    command = [ray, "start", "--head", "--port", str(port), "--num-cpus", "2", "--block"]
    command += ["--include-dashboard", "false", "--node-ip-address", "127.0.0.1"]
    head = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        assert head.stdout is not None
        for line in head.stdout:
            if HEAD_STARTED in line:
                break
        else:
            raise RuntimeError("the Ray head did not start")
        yield f"127.0.0.1:{port}", head.pid
    finally:
        os.killpg(head.pid, signal.SIGKILL)
        head.wait()


def run_one(spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """`spec` run as a program of its own, watched (with the head it joins, for `cluster`):
    its figures (those of the rounds it finished, if it passed `timeout_s`)."""
    if spec["engine"] != "cluster":
        return run_watched(spec, timeout_s, [])
    with ray_head() as (address, head):
        return {**run_watched({**spec, "address": address}, timeout_s, [head]), "address": None}


def run_watched(spec: dict[str, Any], timeout_s: float, others: list[int]) -> dict[str, Any]:
    """`spec` run as a program of its own, its process tree (and `others`') watched."""
    python, module = sys.executable, "bench.sim_scale"
    if spec["engine"] == "flower":
        python, module = FLOWER_PYTHON, "bench.flower_sim"
    command = [python, "-m", module, *(["--one"] if module == "bench.sim_scale" else [])]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(
        [*command, json.dumps(spec)], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
    )
    watch = TreeWatch([child.pid, *others])
    watch.start()
    try:
        out, _ = child.communicate(timeout=timeout_s)
        result = json.loads(out.strip().splitlines()[-1]) if child.returncode == 0 else None
    except subprocess.TimeoutExpired:
        end_tree(child.pid)
        child.communicate()
        result = None
    finally:
        watch.done.set()
        watch.join()
    return {**spec, **figures(spec, result, watch, timeout_s)}


def end_tree(pid: int) -> None:
    """Kill a run that passed its time and every process it started (a Ray among them)."""
    root = psutil.Process(pid)
    for process in [*root.children(recursive=True), root]:
        try:
            process.kill()
        except psutil.Error:
            continue


def figures(
    spec: dict[str, Any], result: dict[str, Any] | None, watch: TreeWatch, timeout_s: float
) -> dict[str, Any]:
    """A run's row: steady s and CPU s per round, memory, and what failed if anything."""
    if result is None:
        return {"failed": f"no result in {timeout_s:.0f} s", "rounds_done": 0}
    ends = {int(t): end for t, end in result["ends"].items()}
    steady_cpu = None
    if len(ends) >= 2:
        first, last = min(ends), max(ends)
        steady_cpu = (watch.at(ends[last]) - watch.at(ends[first])) / (last - first)
    driver_mb = result["driver_peak_mb"] - result.get("before_mb", 0.0)
    return {
        **{k: v for k, v in result.items() if k not in ("ends", "started")},
        "steady_round_s": steady_round_s(ends),
        "steady_cpu_round_s": steady_cpu,
        "cpu_ms_per_agent_round": steady_cpu and 1000 * steady_cpu / spec["agents"],
        "driver_mb_per_agent": driver_mb / spec["agents"],
        "tree_peak_mb": watch.peak_pss_mb,
        "driver_anon_peak_mb": watch.peak_anon_mb,
        "first_round_s": ends[min(ends)] - result["started"] if ends else None,
    }


def spread(values: list[float], digits: int = 3) -> str:
    """Mean, and the range over seeds."""
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    low, high = min(values), max(values)
    return f"{statistics.mean(values):.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def ratio(runs: list[dict[str, Any]], base: list[dict[str, Any]], key: str) -> str:
    """Mean of `key` over `runs` against `base`'s."""
    mine = [r[key] for r in runs if r.get(key)]
    theirs = [r[key] for r in base if r.get(key)]
    if not mine or not theirs:
        return "-"
    return f"{statistics.mean(mine) / statistics.mean(theirs):.2f}x"


COLUMNS = (
    "agents", "strategy", "engine", "s / round", "vs local", "vs flower", "CPU s / round",
    "CPU vs local", "CPU ms / agent-round", "first round s", "driver MB / agent",
    "driver anon MB", "tree peak MB", "identical",
)  # fmt: skip


def same(runs: list[dict[str, Any]]) -> str:
    """Whether the runs' reports equal the other engines' of their cell (-: no report)."""
    if any(r["identical"] is False for r in runs):
        return "NO"
    return "yes" if any(r["identical"] for r in runs) else "-"


def table(rows: list[dict[str, Any]], title: str) -> Table:
    """One line per (agents, strategy, engine): the figures over the seeds."""
    out = Table(title=title)
    for column in COLUMNS:
        out.add_column(column, justify="left" if column in ("strategy", "engine") else "right")
    groups: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["agents"], r["strategy"], r["engine"]), []).append(r)
    for (agents, strategy, engine), runs in groups.items():
        done = [r for r in runs if r.get("steady_round_s")]
        local = groups.get((agents, strategy, "local"), runs)
        flower = groups.get((agents, strategy, "flower"), [])
        failed = [r["failed"] for r in runs if r.get("failed")]
        out.add_row(
            str(agents),
            strategy,
            engine + (f" ({failed[0]})" if failed else ""),
            spread([r["steady_round_s"] for r in done]),
            ratio(done, local, "steady_round_s"),
            ratio(done, flower, "steady_round_s"),
            spread([r["steady_cpu_round_s"] for r in done]),
            ratio(done, local, "steady_cpu_round_s"),
            spread([r["cpu_ms_per_agent_round"] for r in done], 2),
            spread([r["first_round_s"] for r in runs if r.get("first_round_s")], 1),
            spread([r["driver_mb_per_agent"] for r in runs if "driver_mb_per_agent" in r], 3),
            spread([r["driver_anon_peak_mb"] for r in runs if r.get("driver_anon_peak_mb")], 0),
            spread([r["tree_peak_mb"] for r in runs if r.get("tree_peak_mb")], 0),
            same(runs),
        )
    return out


def mean_of(rows: list[dict[str, Any]], key: str, **cell: Any) -> float | None:
    """The mean of `key` over the finished runs of one cell (None: none)."""
    values = [r[key] for r in rows if all(r[k] == v for k, v in cell.items()) and r.get(key)]
    return statistics.mean(values) if values else None


def checks(rows: list[dict[str, Any]]) -> list[str]:
    """Issue 50's targets, as far as these rows measure them: Ray within 1.3x of local,
    edgefl's s / round at most 0.5x Flower's at 1,000 agents, DA-DPFL's CPU per
    agent-round at the largest fleet within 1.2x of the smallest's."""
    lines, sizes = [], sorted({r["agents"] for r in rows})
    for agents in sizes:
        for strategy in ("fedavg", "dadpfl"):
            cell = {"agents": agents, "strategy": strategy}
            for key, what in (("steady_round_s", "s / round"), ("steady_cpu_round_s", "CPU")):
                local = mean_of(rows, key, engine="local", **cell)
                for engine in ("ray", "cluster"):
                    mine = mean_of(rows, key, engine=engine, **cell)
                    if local and mine:
                        lines.append(
                            f"{agents} {strategy} {engine}/local {what}: {mine / local:.2f}x"
                        )
            flower = mean_of(rows, "steady_round_s", engine="flower", **cell)
            for engine in ("local", "ray") if flower else ():
                mine = mean_of(rows, "steady_round_s", engine=engine, **cell)
                if mine:
                    ratio_ = mine / flower
                    lines.append(f"{agents} {strategy} {engine}/flower s / round: {ratio_:.2f}x")
    small, large = (mean_of(rows, "cpu_ms_per_agent_round", engine="local", strategy="dadpfl",
                            agents=a) for a in (sizes[0], sizes[-1]))  # fmt: skip
    if small and large and sizes[-1] > sizes[0]:
        lines.append(f"dadpfl CPU per agent-round {sizes[-1]}/{sizes[0]}: {large / small:.2f}x")
    return lines


def plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The runs, interleaved: for each size and seed, each strategy on each engine."""
    specs = []
    for agents in (int(a) for a in args.agents.split(",")):
        rounds = args.rounds if agents < 10_000 else args.big_rounds
        for seed in args.seeds:
            for strategy in args.strategies.split(","):
                for engine in args.engines.split(","):
                    if engine == "flower" and strategy != "fedavg":
                        continue  # Flower has no decentralized strategy
                    specs.append({"agents": agents, "strategy": strategy, "engine": engine})
                    specs[-1] |= {"seed": seed, "rounds": rounds}
    return specs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100, 1,000 agents; seed 1; 2 rounds")
    parser.add_argument("--agents", default="100,1000,10000")
    parser.add_argument("--strategies", default="fedavg,dadpfl")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--seeds", type=seeds, default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--big-rounds", type=int, default=2, help="rounds at 10,000 agents")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a run may take")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench/results/sim_scale.json")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one(json.loads(args.one))))
        return 0
    if args.quick:
        vars(args).update(QUICK)
    if min(args.rounds, args.big_rounds) < 2:
        parser.error("need --rounds and --big-rounds >= 2 (s / round leaves round 1 out)")
    if "flower" in args.engines and not pathlib.Path(FLOWER_PYTHON).exists():
        print(f"Flower's environment is not at {FLOWER_PYTHON} (bench/flower_sim.py): skipped")
        args.engines = ",".join(e for e in args.engines.split(",") if e != "flower")
    rows: list[dict[str, Any]] = []
    for spec in plan(args):
        row = run_one(spec, args.timeout)
        # the reports of a cell's local and Ray runs are the same (Flower writes no report;
        # a run that passed its time, none)
        digests = {r["digest"] for r in rows if r.get("digest") and _cell(r) == _cell(row)}
        row["identical"] = len(digests | {row["digest"]}) == 1 if row.get("digest") else None
        rows.append(row)
        print(json.dumps(row), flush=True)
    console = Console(width=200)
    console.print(table(rows, "simulate at scale: synthetic, ~20 samples an agent"))
    verdicts = checks(rows)
    console.print("\n".join(verdicts))
    config = {k: v for k, v in vars(args).items() if k not in ("out", "one")}
    result = {"config": config, "rows": rows, "checks": verdicts, "machine": environment()}
    write_json(args.out, result)
    return 0 if all(r["identical"] is not False for r in rows) else 1


def _cell(row: dict[str, Any]) -> tuple[int, str, int]:
    """The (agents, strategy, seed) whose reports must be identical across engines."""
    return row["agents"], row["strategy"], row["seed"]


if __name__ == "__main__":
    sys.exit(main())
