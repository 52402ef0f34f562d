"""Command start-up: the CPU time and peak memory of the commands a user types on a device
or a gateway that neither train nor aggregate.

    python -m bench.startup [--code DIR] [--repeats 5] [--out bench/results/startup.json]

Each command runs in a fresh process of this Python (`python -c "from agent.cli import
main; main()" ARGS`, what the console scripts do), from the code in `--code` (default: this
checkout; another checkout, e.g. a `git worktree` of an older commit, gives the figures to
compare with). Per command: the least user + system CPU seconds (the child's own, from
`os.wait4`, so other load on the machine hardly moves them) and the least peak RSS (MiB,
VmHWM at exit) of `--repeats` runs. `predict` serves a small exported MLP on 4 samples.

What it shows: whether a command pays torch's import (about 2-3 s of CPU and 200 MB here,
several times the seconds on a Raspberry Pi) though it needs nothing of it.
tests/test_layering.py asserts that none of these loads torch.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np
from rich.console import Console
from rich.table import Table

from bench.support import environment, write_json

ROOT = pathlib.Path(__file__).resolve().parents[1]

MB = 2**20


def commands(work: pathlib.Path) -> list[tuple[str, str, list[str]]]:
    """(label, the module whose `main` runs, its arguments)."""
    state = ["--state-dir", str(work / "state")]
    predict = ["predict", str(work / "x.npy"), "--model", str(work / "m.onnx")]
    return [
        ("edge-agent --help", "agent.cli", ["--help"]),
        ("edge-agent --version", "agent.cli", ["--version"]),
        ("edge-agent key", "agent.cli", [*state, "key"]),
        ("edge-agent models", "agent.cli", [*state, "models"]),
        ("edge-agent predict", "agent.cli", [*predict, "--latency-samples", "0"]),
        ("coordinator --help", "coordinator.cli", ["--help"]),
        ("coordinator status --help", "coordinator.cli", ["status", "--help"]),
        ("coordinator simulate --help", "coordinator.cli", ["simulate", "--help"]),
    ]


def exported_model(work: pathlib.Path) -> None:
    """A small exported MLP and 4 samples for `predict`."""
    from agent.learning.models import build_model
    from agent.onnx_export import export_onnx

    model = build_model("mlp", (6,), 3, seed=0)
    export_onnx(model, model.state_dict(), (6,), work / "m.onnx")
    np.save(work / "x.npy", np.random.default_rng(0).random((4, 6), dtype=np.float32))


PEAK_PROBE = """
import atexit, os, sys

def peak():
    status = open("/proc/self/status").read()
    kb = next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))
    open(os.environ["STARTUP_PEAK_FILE"], "w").write(kb)

atexit.register(peak)
sys.argv = ["x", *sys.argv[1:]]
from {module} import main
main()
"""
"""The command, reporting its own peak RSS at exit: VmHWM belongs to the process's own memory
map, which exec starts afresh, where a child's ru_maxrss also counts the parent it forked from."""


def measure(
    code: pathlib.Path, module: str, args: list[str], work: pathlib.Path
) -> tuple[float, float]:
    """CPU seconds (user + system) and peak RSS in MiB of one run of the command."""
    peak_file = work / "peak"
    child = subprocess.Popen(
        [sys.executable, "-c", PEAK_PROBE.format(module=module), *args],
        cwd=code,
        env={**os.environ, "STARTUP_PEAK_FILE": str(peak_file)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    assert child.stderr is not None
    errors = child.stderr.read()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise SystemExit(f"{module} {' '.join(args)} failed: {errors.decode()[-500:]}")
    return usage.ru_utime + usage.ru_stime, int(peak_file.read_text()) * 1024 / MB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--code", type=pathlib.Path, default=ROOT, help="checkout to run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench/results/startup.json")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        exported_model(work)
        for label, module, command in commands(work):
            runs = [
                measure(args.code.resolve(), module, command, work) for _ in range(args.repeats)
            ]
            rows.append(
                {
                    "command": label,
                    "cpu_s": round(min(cpu for cpu, _ in runs), 3),
                    "peak_rss_mb": round(min(rss for _, rss in runs), 1),
                }
            )
    table = Table(title=f"command start-up, code from {args.code}, best of {args.repeats}")
    for column in ("command", "CPU s", "peak RSS MiB"):
        table.add_column(column, justify="left" if column == "command" else "right")
    for row in rows:
        table.add_row(row["command"], f"{row['cpu_s']:.2f}", f"{row['peak_rss_mb']:.0f}")
    Console().print(table)
    write_json(args.out, {"environment": environment(), "code": str(args.code), "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
