"""Agents forked from a server against fresh interpreters: what `coordinator emulate` costs
in CPU and wall time either way (EDGEFL_AGENT_START, coordinator/agent_starts.py).

    python -m bench.agent_starts [--runs 8x4,8x1] [--rounds 10] [--repeats 2]
        [--out bench/results/agent_starts.json]

Each run AxK is `coordinator emulate --agents A --agents-per-process K --rounds R` (its
defaults otherwise: DA-DPFL on mnist1d, the embedded broker), a child of this process; its
CPU is the child's and all its descendants' user + system seconds (`os.wait4`: the agents
and the fork server are reaped below it, so they count). The two start methods alternate,
run by run, so a change in the machine's other load falls on both alike; the load average
is recorded beside each run. Both methods must end with the same mean accuracy.

Session 37 (bench/results/agent_starts.json; 2 cores shared with other benchmarks, load
average 2.2-6.8 over the runs), 10 rounds, two runs of each: 8 agents 4 to a process,
forked 16.2 and 16.2 CPU-s (wall 15.3 and 17.6 s), fresh 18.9 and 17.6 CPU-s (20.6 and
18.6 s); 8 agents a process each, forked 24.2 and 25.4 CPU-s (24.9 and 25.9 s), fresh 37.4
and 33.3 CPU-s (37.5 and 33.7 s). Again at load 2.8-6.5 (agent_starts-2.json): 8x4 forked
16.7 and 15.9, fresh 17.5 and 17.1 CPU-s; 8x1 forked 22.1 and 21.9, fresh 32.8 and 32.9.
Every run's mean accuracy 0.68435.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.support import environment, write_json
from coordinator.agent_starts import START_ENV

ROOT = pathlib.Path(__file__).resolve().parents[1]
METHODS = ("fork", "fresh")


def emulate(agents: int, per_process: int, rounds: int, method: str) -> dict[str, Any]:
    """One `coordinator emulate` run: its CPU, wall time, load and mean accuracy."""
    with tempfile.TemporaryDirectory(prefix="agent-starts-") as tmp:
        work = pathlib.Path(tmp)
        command = [
            sys.executable, "-c", "from coordinator.cli import main; main()", "emulate",
            "--agents", str(agents), "--agents-per-process", str(per_process),
            "--rounds", str(rounds), "--workdir", str(work / "fleet"),
            "--report", str(work / "report.json"),
        ]  # fmt: skip
        load = os.getloadavg()[0]
        started = time.perf_counter()
        child = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            env={**os.environ, START_ENV: method}, cwd=work,
        )  # fmt: skip
        assert child.stderr is not None
        errors = child.stderr.read()
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - started
        if os.waitstatus_to_exitcode(status) != 0:
            raise RuntimeError(f"emulate failed: {errors.decode(errors='replace')[-2000:]}")
        summary = json.loads((work / "report.json").read_text())["summary"]
    return {
        "method": method,
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        "user_s": round(usage.ru_utime, 2),
        "sys_s": round(usage.ru_stime, 2),
        "wall_s": round(wall, 2),
        "load_before": round(load, 2),
        "load_after": round(os.getloadavg()[0], 2),
        "mean_accuracy": summary.get("mean_accuracy"),
        "failed_agents": summary.get("failed_agents"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default="8x4,8x1", help="AGENTSxPER_PROCESS, comma-separated")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--out", type=pathlib.Path, default=ROOT / "bench/results/agent_starts.json"
    )
    args = parser.parse_args()
    runs = [tuple(int(x) for x in run.split("x")) for run in args.runs.split(",")]
    results = []
    table = Table(title=f"coordinator emulate, {args.rounds} rounds")
    for column in ("agents", "per process", "method", "CPU s", "wall s", "load", "accuracy"):
        table.add_column(column)
    for agents, per_process in runs:
        for repeat in range(args.repeats):
            for method in METHODS if repeat % 2 == 0 else METHODS[::-1]:
                result = emulate(agents, per_process, args.rounds, method)
                results.append({"agents": agents, "per_process": per_process, **result})
                table.add_row(
                    str(agents), str(per_process), method, f"{result['cpu_s']:.1f}",
                    f"{result['wall_s']:.1f}", f"{result['load_before']:.1f}",
                    str(result["mean_accuracy"]),
                )  # fmt: skip
                write_json(args.out, {"environment": environment(), "runs": results})
    Console().print(table)


if __name__ == "__main__":
    main()
