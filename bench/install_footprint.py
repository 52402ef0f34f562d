"""Install footprint: what each install profile puts on disk, and what an idle agent holds.

    python -m bench.install_footprint [--out bench/results/install_footprint.json]

Installs as a user does: the wheel is built with `--no-build-isolation` on the oldest
setuptools the metadata allows, then a fresh virtual environment (no system site-packages)
gets torch (`TORCH_PIN`, the local CPU wheel here), then the base package (a device), then
the `gateway` extra and the `lab` extra on top. Measured after each step:

* site-packages: MiB (2**20 bytes) of the files each installed distribution records, split
  into torch with its own requirements (sympy, networkx, ...), the virtual environment's own
  pip and setuptools, and the rest, which is what the profile adds. Target for the device install:
  the rest <= 250 MiB.
* idle agent (device install only): RSS of `edge-agent --data own.npz` connected to a broker
  and waiting for a run, 5 s after it said so, against RSS of a process that has imported
  torch (best of 3 each). Target: <= 60 MiB above torch's import.

tests/test_install.py runs the same install steps with the commands each profile must run.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import numpy as np
import psutil
from rich.console import Console
from rich.table import Table

from bench.support import broker, environment, write_json

ROOT = pathlib.Path(__file__).resolve().parents[1]

TORCH_PIN = os.environ.get("TORCH_PIN", "torch==2.13.0")
SETUPTOOLS_MINIMUM = "setuptools==77.0.1"
"""The oldest setuptools that reads the SPDX `license` string (PEP 639): pyproject.toml's."""
PROFILES = ("base", "gateway", "lab")
DEVICE_TARGET_MB = 250.0
IDLE_TARGET_MB = 60.0
MB = 2**20
"""MiB, as every benchmark here counts memory."""
SOURCES = (
    "pyproject.toml",
    "README.md",
    "protocol",
    "agent",
    "coordinator",
    "firmware_profiles",
    "edgefl",
)
"""What the wheel is built from: the packages and the files their metadata names."""

SPLIT = """
import importlib.metadata as md, json, re
from pip._vendor.packaging.requirements import Requirement
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
dists = {norm(d.metadata["Name"]): d for d in md.distributions()}
def size(d):
    return sum(p.stat().st_size for f in d.files or [] if (p := d.locate_file(f)).is_file())
torch, todo = set(), ["torch"]
while todo:
    name = todo.pop()
    if name in torch or name not in dists:
        continue
    torch.add(name)
    for text in dists[name].requires or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            todo.append(norm(req.name))
print(json.dumps({n: [size(d), n in torch] for n, d in dists.items()}))
"""
IMPORT_RSS = (
    "import {module}, psutil, time; time.sleep(0.5); print(psutil.Process().memory_info().rss)"
)


def run(args: Sequence[str | os.PathLike[str]], **kwargs: object) -> subprocess.CompletedProcess:
    """Run a command, its output captured; a failure raises with that output in the message."""
    done = subprocess.run(list(map(str, args)), capture_output=True, text=True, **kwargs)  # type: ignore[call-overload]
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(map(str, args))} failed ({done.returncode}):\n"
            f"{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    return done


class FreshVenv:
    """A virtual environment made anew, with none of this machine's site-packages. With
    `compile_bytecode` False, pip skips writing .pyc files (what a user's install has, and
    what the sizes here count), which makes a torch install take 10 s instead of 45 s."""

    def __init__(
        self, path: pathlib.Path, python: str = sys.executable, *, compile_bytecode: bool = True
    ) -> None:
        run([python, "-m", "venv", path])
        self.path = path
        self.python = path / "bin" / "python"
        self.compile = [] if compile_bytecode else ["--no-compile"]

    def bin(self, name: str) -> str:
        return str(self.path / "bin" / name)

    def install(self, *requirements: str | pathlib.Path) -> None:
        pip = [self.python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        run([*pip, *self.compile, *requirements])

    def site_packages(self) -> dict[str, float]:
        """MiB on disk: torch with its requirements, the environment's pip and setuptools,
        and the rest (what this project's profile brought)."""
        sizes = json.loads(run([self.python, "-c", SPLIT]).stdout)
        split = {"torch": 0.0, "pip": 0.0, "rest": 0.0}
        for name, (size, of_torch) in sizes.items():
            # pip and setuptools come with every venv (torch may claim setuptools too)
            part = "pip" if name in ("pip", "setuptools") else "torch" if of_torch else "rest"
            split[part] += size / MB
        return split


def externally_managed_python(python: str = "/usr/bin/python3") -> str | None:
    """`python` where it is a system Python that refuses pip installs (PEP 668: Debian 12,
    Raspberry Pi OS), else None."""
    if not pathlib.Path(python).is_file():
        return None
    probe = "import sysconfig; print(sysconfig.get_path('stdlib'))"
    stdlib = subprocess.run([python, "-c", probe], capture_output=True, text=True).stdout
    return python if (pathlib.Path(stdlib.strip()) / "EXTERNALLY-MANAGED").is_file() else None


def copy_sources(dest: pathlib.Path, names: Sequence[str] = SOURCES) -> pathlib.Path:
    """A copy of the checkout's `names` (files and folders) in `dest`, made here."""
    dest.mkdir(parents=True)
    for name in names:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, dest / name)
    return dest


def build_wheel(dest: pathlib.Path) -> pathlib.Path:
    """The project's wheel, built from a copy of its sources without build isolation on
    the oldest setuptools pyproject.toml allows (an offline or distribution build)."""
    source = copy_sources(dest / "source")
    builder = FreshVenv(dest / "build-venv")
    builder.install(SETUPTOOLS_MINIMUM)
    run(
        [
            builder.python,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            dest / "dist",
            source,
        ]
    )
    (wheel,) = (dest / "dist").glob("*.whl")
    return wheel


def requirement(wheel: pathlib.Path, profile: str) -> str:
    """The pip requirement that installs `profile` from the wheel."""
    return str(wheel) if profile == "base" else f"{wheel}[{profile}]"


def rss_mb(venv: FreshVenv, module: str) -> float:
    """RSS of a process of the environment once it has imported `module` (best of 3)."""
    return min(
        int(run([venv.python, "-c", IMPORT_RSS.format(module=module)]).stdout) / MB
        for _ in range(3)
    )


def idle_agent_mb(venv: FreshVenv, workdir: pathlib.Path) -> float:
    """RSS of an edge-agent with its own data, connected and waiting for a run (best of 3)."""
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, 2000)
    np.savez(workdir / "own.npz", x=rng.random((2000, 1, 8, 8), np.float32), y=labels)
    samples = []
    with broker("embedded", workdir) as address:
        for attempt in range(3):
            log = workdir / f"idle-{attempt}.log"
            with log.open("w") as out:
                agent = subprocess.Popen(
                    [
                        venv.bin("edge-agent"),
                        "--broker",
                        str(address),
                        "--id",
                        f"idle{attempt}",
                        "--data",
                        workdir / "own.npz",
                        "--state-dir",
                        workdir / f"state{attempt}",
                    ],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            try:
                deadline = time.monotonic() + 60
                while "waiting for a run" not in log.read_text():
                    if agent.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"the agent did not get idle:\n{log.read_text()}")
                    time.sleep(0.1)
                time.sleep(5)
                samples.append(psutil.Process(agent.pid).memory_info().rss / MB)
            finally:
                agent.send_signal(signal.SIGTERM)
                agent.wait(30)
    return min(samples)


def measure(workdir: pathlib.Path) -> dict[str, dict[str, float]]:
    """Each profile's site-packages split, and the device install's idle figures."""
    wheel = build_wheel(workdir)
    venv = FreshVenv(workdir / "venv")
    venv.install(TORCH_PIN)
    results: dict[str, dict[str, float]] = {}
    for profile in PROFILES:
        venv.install(requirement(wheel, profile))
        results[profile] = venv.site_packages()
        print(f"{profile}: installed", file=sys.stderr)
        if profile == "base":
            results[profile]["torch_import_rss"] = rss_mb(venv, "torch")
            results[profile]["idle_agent_rss"] = idle_agent_mb(venv, workdir)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "bench/results/install_footprint.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="install-footprint-") as tmp:
        results = measure(pathlib.Path(tmp))
    base = results["base"]
    table = Table(
        "profile",
        "torch + its requirements",
        "pip + setuptools",
        "the profile adds",
        title="site-packages (MiB)",
    )
    for profile, split in results.items():
        table.add_row(
            profile, f"{split['torch']:.0f}", f"{split['pip']:.0f}", f"{split['rest']:.0f}"
        )
    console = Console()
    console.print(table)
    idle_over = base["idle_agent_rss"] - base["torch_import_rss"]
    verdicts = {
        "device_adds_mib": base["rest"],
        "device_target_met": base["rest"] <= DEVICE_TARGET_MB,
        "idle_agent_over_torch_mib": idle_over,
        "idle_target_met": idle_over <= IDLE_TARGET_MB,
    }
    console.print(
        f"device install adds {base['rest']:.0f} MiB to torch (target <= {DEVICE_TARGET_MB:.0f});"
        f" idle agent {base['idle_agent_rss']:.0f} MiB RSS, torch's import "
        f"{base['torch_import_rss']:.0f} MiB: {idle_over:+.0f} MiB (target <= {IDLE_TARGET_MB:.0f})"
    )
    write_json(
        pathlib.Path(args.out), {"environment": environment(), "profiles": results, **verdicts}
    )


if __name__ == "__main__":
    main()
