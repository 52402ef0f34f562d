"""Soak: a gateway and four devices through many runs and the faults of months in the field.

    python -m bench.soak [--runs 10] [--broker embedded|mosquitto] [--no-init-previous]
        [--loopback] [--workdir DIR] [--out bench/results/soak.json]

Real processes on an emulated LAN (tests/netns.py: a network namespace per host, a bridge
between them; root and `ip` needed, else loopback, which the output says): the gateway runs
`coordinator serve` (its embedded broker on the gateway's address, or with `--broker
mosquitto` a mosquitto beside it), four devices `edge-agent --broker GW:PORT --data dK.npz`
on mnist1d data of different classes each, and every run is `coordinator run RUN.toml
--report ...` on the gateway (EDGEFL_RUNS_DIR in the soak's folder: ~/.edgefl is not
touched). The devices live through every run unless a fault kills one.

The runs, in turn (more than ten: the list again), with their faults:

     1 dadpfl       none                     6 fedavg       coordinator run SIGKILLed, resumed
     2 fedavg       none                     7 dadpfl-prev  d3's link down 12 s (> round timeout)
     3 dadpfl       gateway restart before   8 fedavg-prev  broker restart during the run
     4 fedspu       none                     9 fedspu       coordinator run SIGKILLed, resumed
     5 dadpfl-prev  d2 SIGKILLed, restarted 10 fedavg       gateway restart before

`-prev` run files say `init = "previous"` (each device starts from its current model;
`--no-init-previous` leaves the key out). Faults during a run strike once the watched device
has logged its round 2; a gateway restart strikes between runs (SIGTERM to serve, started
again). Without namespaces a link down is the device's processes stopped (SIGSTOP) as long.

Per run: rounds reported / planned, agents in the last round, whether the report is complete
(every round, every agent, no failed agents, centralized rounds aggregated from every agent;
"explained" when what is short is what a fault during the run can cause: the faulted device
failed or uploads were lost, but every round was aggregated), wall seconds, total bytes,
mean accuracy, the figures against the run file's first fault-free run (a fault between
runs must not change what the agents learned; total bytes within 0.1%, as alike runs were
seen to differ by 4 to 93 bytes; init = "previous" runs differ by design), every device's
round log for the run (rounds 1..N), what each device started from under init =
"previous", and each device's RSS (psutil) once it says it waits for the next run.

At the end: each device's RSS after the last run against after run 2 (the second run its
process lived through, if a fault restarted it), within 10%; every device's current model
and kept run models load with onnxruntime; every run's folder is still kept.

Measured (network namespaces, 2 cores, 10 runs in 109-116 s; bench/results/soak.json is the
embedded broker's): with the final code three passes (two embedded, one mosquitto), all
PASS: every report complete (every round, every agent, every centralized round aggregated
from all four), every device's round logs whole, all ten runs' folders and models kept and
loaded. RSS after run 2 296-297 MB, after run 10 297-298 MB (ratios 1.002-1.005). Gateway
restarts between runs left the figures as they were (total bytes at most 4 apart).
`coordinator run` SIGKILLed and run again costs traffic only (fedavg +168 to +178 kB: the
round's uploads sent again; fedspu +37 to +48 kB); its accuracies equal the fault-free
run's. Before the last fixes: the fedspu resume aggregated nothing in round 3 (4 of 4
soaks), a broker restart lost a fedavg round's uploads (2 of 5 soaks), and run 10 showed one
device receiving every status of the fleet in 2 of 5 soaks (+2.4 kB a round: a keeper's
offline presence handled after the run had ended subscribed it for good).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from agent.data import load_dataset
from agent.model_store import run_folder
from agent.runtime import checkpoint
from bench.support import environment, write_json
from coordinator.ports import free_port
from tests.netns import Lan

ROOT = Path(__file__).resolve().parents[1]

FLEET = "soak"
DEVICES = ("d1", "d2", "d3", "d4")
CLASSES = ([0, 1, 2, 3, 4, 5], [3, 4, 5, 6, 7, 8], [6, 7, 8, 9, 0, 1], [1, 3, 5, 7, 9, 2])
COORDINATOR = [sys.executable, "-c", "from coordinator.cli import main; main()"]
EDGE_AGENT = [sys.executable, "-c", "from agent.cli import main; main()"]
TIMEOUTS = {"round_timeout": 8, "vote_timeout": 8, "linger": 5, "join_timeout": 90}
RUN_FILES: dict[str, dict[str, Any]] = {
    "dadpfl": {"strategy": "dadpfl", "rounds": 5},
    "fedavg": {"strategy": "fedavg", "rounds": 6},
    "fedspu": {"strategy": "fedspu", "rounds": 5},
    "dadpfl-prev": {"strategy": "dadpfl", "rounds": 6, "init": "previous"},
    "fedavg-prev": {"strategy": "fedavg", "rounds": 4, "init": "previous"},
}
SCHEDULE = (
    ("dadpfl", "none"),
    ("fedavg", "none"),
    ("dadpfl", "gateway-restart"),
    ("fedspu", "none"),
    ("dadpfl-prev", "device-kill"),
    ("fedavg", "run-kill"),
    ("dadpfl-prev", "link-down"),
    ("fedavg-prev", "broker-restart"),
    ("fedspu", "run-kill"),
    ("fedavg", "gateway-restart"),
)
BETWEEN = ("none", "gateway-restart")
"""Faults that leave a run itself alone: its figures must equal its run file's first run's."""
WATCHED = {"device-kill": "d2", "link-down": "d3", "broker-restart": "d1", "run-kill": "d1"}
"""The device whose round 2 sets off a fault during a run (and the one it strikes)."""
IDLE = "waiting for the next run"
"""What an agent logs once a run is over for it and its model is kept."""
LINK_DOWN_S = TIMEOUTS["round_timeout"] + 4
TRIGGER_S = 150.0
RUN_LIMIT_S = 360.0
RSS_TOLERANCE = 0.10
MB = 2**20
VOLATILE = ("run_id", "wall_s", "finished_at", "started_at", "wait_s", "throttled_s")
"""Round record fields that differ between two runs of one run file: ids and clock readings."""
ROUND_BYTES = ("bytes_sent", "bytes_received", "sent", "received")
"""Per-round traffic: a model that arrives just before or after a round's end is counted in
one round or the next, so two alike runs share the total (compared) but not the split."""
BYTES_TOLERANCE = 0.001
CENTRALIZED = ("fedavg", "fedspu")
"""The soak's strategies whose rounds the coordinator aggregates."""


class SoakError(RuntimeError):
    """Something the soak waited for did not happen: recorded against the run, not fatal."""


def text(path: Path, since: int = 0) -> str:
    """A log from byte `since` on: each run reads only what was written during it."""
    if not path.exists():
        return ""
    with open(path, "rb") as handle:
        handle.seek(since)
        return handle.read().decode(errors="replace")


def size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def tail(path: Path, since: int = 0, lines: int = 12) -> list[str]:
    """The last lines of a log (from `since`): what a failure report quotes."""
    return text(path, since).splitlines()[-lines:]


def wait_for(check: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def stable(value: Any, volatile: tuple[str, ...] = VOLATILE) -> Any:
    """`value` without the fields two alike runs may not share (ids, clock readings)."""
    if isinstance(value, dict):
        return {k: stable(v, volatile) for k, v in value.items() if k not in volatile}
    if isinstance(value, list):
        return [stable(v, volatile) for v in value]
    return value


def write_data(folder: Path) -> None:
    """Each device's own .npz: mnist1d samples of six of the ten classes, a different six
    per device, so the fleet is as non-iid as real sites are."""
    dataset = load_dataset("mnist1d", seed=1)
    for k, (name, classes) in enumerate(zip(DEVICES, CLASSES, strict=True)):
        pick = np.random.default_rng(k).choice(
            np.flatnonzero(np.isin(dataset.y, classes)), 200, replace=False
        )
        np.savez(folder / f"{name}.npz", x=dataset.x[pick], y=dataset.y[pick])


def write_run_files(folder: Path, init_previous: bool) -> dict[str, Path]:
    """The run files, as a user writes them, each with the soak's short timeouts."""
    files = {}
    for name, given in RUN_FILES.items():
        keys = {"agents": len(DEVICES), **given, **TIMEOUTS}
        if not init_previous:
            keys.pop("init", None)
        files[name] = folder / f"{name}.toml"
        body = "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items())
        files[name].write_text("[run]\n" + body)
    return files


def plan(runs: int) -> list[tuple[str, str]]:
    """The schedule, repeated for more runs than it lists."""
    return [SCHEDULE[i % len(SCHEDULE)] for i in range(runs)]


class Site:
    """The gateway's and devices' processes, on the emulated LAN or on loopback: started,
    stopped and restarted by role ("serve", "mosquitto", a device), a log per role."""

    def __init__(self, folder: Path, lan: Any | None, broker_kind: str) -> None:
        self.folder, self.lan, self.broker_kind = folder, lan, broker_kind
        self.gateway = lan.address("gw") if lan is not None else "127.0.0.1"
        self.port = 1883 if lan is not None else free_port()
        self.address = (self.gateway, self.port)
        self.broker = f"{self.gateway}:{self.port}"
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        self.env = {"EDGEFL_RUNS_DIR": str(folder / "runs"), "PYTHONPATH": path}
        self.roles: dict[str, subprocess.Popen[bytes]] = {}
        self.started: list[subprocess.Popen[bytes]] = []

    def log(self, role: str) -> Path:
        return self.folder / f"{role}.log"

    def popen(self, host: str, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
        """Start `argv` on `host` in its own process group, output appended to `log`."""
        if self.lan is not None:
            process: subprocess.Popen[bytes] = self.lan.popen(host, argv, env=self.env, log=log)
        else:
            with open(log, "ab") as out:
                process = subprocess.Popen(
                    argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, env={**os.environ, **self.env},
                    start_new_session=True,
                )  # fmt: skip
        self.started.append(process)
        return process

    def reachable(self, timeout_s: float) -> bool:
        """Whether the broker's port takes connections (from a device, on the LAN)."""
        if self.lan is not None:
            return bool(self.lan.reachable("d1", self.gateway, self.port, timeout_s=timeout_s))

        def connects() -> bool:
            with contextlib.suppress(OSError), socket.create_connection(self.address, 1):
                return True
            return False

        return wait_for(connects, timeout_s)

    def start(self, role: str) -> None:
        """Start the gateway's serve or mosquitto, or a device, and wait until it is up."""
        if role in DEVICES:
            argv = [
                *EDGE_AGENT, "--broker", self.broker, "--fleet", FLEET, "--id", role,
                "--data", str(self.folder / f"{role}.npz"),
                "--state-dir", str(self.folder / role),
            ]  # fmt: skip
            self.roles[role] = self.popen(role, argv, self.log(role))
            return
        mark = size(self.log(role))
        if role == "mosquitto":
            binary = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
            argv = [binary, "-c", str(self.mosquitto_conf())]
            self.roles[role] = self.popen("gw", argv, self.log(role))
            if not self.reachable(30):
                raise SoakError(f"mosquitto did not listen: {tail(self.log(role), mark)}")
            return
        broker = ["--broker", self.broker] if self.broker_kind == "mosquitto" else []
        where = ["--host", self.gateway, "--port", str(self.port)] if not broker else []
        argv = [*COORDINATOR, "serve", "--fleet", FLEET, *broker, *where]
        self.roles[role] = self.popen("gw", argv, self.log(role))
        if not wait_for(lambda: "following fleet" in text(self.log(role), mark), 90):
            raise SoakError(f"serve did not start: {tail(self.log(role), mark)}")

    def mosquitto_conf(self) -> Path:
        """Like the embedded broker: anonymous, nothing kept across a restart."""
        config = self.folder / "mosquitto.conf"
        config.write_text(
            f"listener {self.port} {self.gateway}\nallow_anonymous true\npersistence false\n"
            "user root\nlog_dest stdout\nlog_type error\nlog_type warning\n"
        )
        return config

    def stop(self, role: str, sig: signal.Signals = signal.SIGTERM) -> int:
        """Signal a role's process group and wait for it (SIGKILL after 30 s); its status."""
        process = self.roles[role]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            return process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            return process.wait(10)

    def restart(self, role: str) -> int:
        """SIGTERM and start again; the exit status of the stopped process."""
        status = self.stop(role)
        self.start(role)
        return status

    def broker_role(self) -> str:
        """What a broker restart restarts: the embedded broker lives in serve."""
        return "mosquitto" if self.broker_kind == "mosquitto" else "serve"

    def link(self, device: str, up: bool) -> None:
        """Plug or unplug a device's cable; on loopback, stop or continue its processes."""
        if self.lan is not None:
            self.lan.link(device, up)
        else:
            os.killpg(self.roles[device].pid, signal.SIGCONT if up else signal.SIGSTOP)

    def start_run(self, run_file: Path, report: Path, log: Path) -> subprocess.Popen[bytes]:
        argv = [
            *COORDINATOR, "run", str(run_file), "--broker", self.broker, "--fleet", FLEET,
            "--report", str(report),
        ]  # fmt: skip
        return self.popen("gw", argv, log)

    def rss(self, device: str) -> int | None:
        """Resident memory of a device's agent and its children, None if it is gone."""
        try:
            process = psutil.Process(self.roles[device].pid)
            family = [process, *process.children(recursive=True)]
            return sum(p.memory_info().rss for p in family)
        except psutil.Error:
            return None

    def revive(self) -> list[str]:
        """Start again any role that exited on its own; what exited, with its last lines."""
        problems = []
        for role, process in list(self.roles.items()):
            if process.poll() is not None:
                problems.append(
                    f"{role} exited ({process.returncode}) by itself: "
                    + " | ".join(tail(self.log(role), lines=5))
                )
                self.start(role)
        return problems

    def close(self) -> None:
        """Stop everything started here, together: SIGTERM, then SIGKILL after 5 s."""
        alive = [p for p in self.started if p.poll() is None]
        for process in alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGCONT)
                os.killpg(process.pid, signal.SIGTERM)
        for process in alive:
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(5)


@dataclass
class Soak:
    """What the runs share: the site, the run files, and each run file's first fault-free
    report, which later runs of the file are compared with."""

    site: Site
    files: dict[str, Path]
    init_previous: bool
    baselines: dict[str, tuple[int, dict[str, Any]]] = field(default_factory=dict)


def strike(
    site: Site,
    fault: str,
    run: subprocess.Popen[bytes],
    marks: dict[str, int],
    again: Callable[[], subprocess.Popen[bytes]],
) -> subprocess.Popen[bytes]:
    """Inject a fault during the run once the watched device has logged its round 2;
    returns the run's process (a new one when `coordinator run` was killed and restarted)."""
    if fault in BETWEEN:
        return run
    device = WATCHED[fault]
    log, mark = site.log(device), marks[device]
    if not wait_for(lambda: "round 2:" in text(log, mark) or run.poll() is not None, TRIGGER_S):
        raise SoakError(f"fault not injected: {device} logged no round 2 in {TRIGGER_S:.0f} s")
    if run.poll() is not None:
        raise SoakError(f"fault not injected: the run ended ({run.returncode}) before round 2")
    if fault == "device-kill":
        site.stop(device, signal.SIGKILL)
        site.start(device)
    elif fault == "link-down":
        site.link(device, False)
        try:
            time.sleep(LINK_DOWN_S)
        finally:
            site.link(device, True)
    elif fault == "broker-restart":
        status = site.restart(site.broker_role())
        if status != 0:
            raise SoakError(f"the broker exited {status} on SIGTERM")
    elif fault == "run-kill":
        os.killpg(run.pid, signal.SIGKILL)
        run.wait(10)
        return again()
    return run


def settle(site: Site, marks: dict[str, int]) -> list[str]:
    """Wait until every device says it waits for the next run (its model kept, its memory
    what an idle agent holds): RSS is compared between such moments."""

    def idle() -> list[str]:
        return [d for d in DEVICES if IDLE not in text(site.log(d), marks[d])]

    wait_for(lambda: not idle(), 30)
    return [
        f"{d} not idle 30 s after the run: " + " | ".join(tail(site.log(d), marks[d], 5))
        for d in idle()
    ]


def run_once(soak: Soak, index: int, name: str, fault: str) -> dict[str, Any]:
    """One run with its fault, measured: a row of the table."""
    site, tag = soak.site, f"run{index:02d}-{name}"
    report_path, log = site.folder / f"{tag}.json", site.folder / f"{tag}.log"
    problems = site.revive()
    marks = {d: size(site.log(d)) for d in DEVICES}
    started = time.monotonic()
    run = None
    try:
        if fault == "gateway-restart" and (stopped := site.restart("serve")) != 0:
            serve = " | ".join(tail(site.log("serve"), lines=5))
            problems.append(f"serve exited {stopped} on SIGTERM: {serve}")
        started = time.monotonic()
        again = functools.partial(site.start_run, soak.files[name], report_path, log)
        run = strike(site, fault, again(), marks, again)
    except SoakError as exc:
        problems.append(str(exc))
    status = finish(run, started)
    wall = time.monotonic() - started
    if status != 0:
        problems.append(f"coordinator run exited {status}: " + " | ".join(tail(log)))
    if fault == "run-kill" and "resuming run" not in text(log):
        problems.append("the restarted coordinator run did not say 'resuming run'")
    problems += settle(site, marks)
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    row = measure(soak, index, name, fault, report, problems)
    row.update(
        wall_s=round(wall, 1),
        exit_status=status,
        rss={d: site.rss(d) for d in DEVICES},
        pids={d: site.roles[d].pid for d in DEVICES},
        init=init_sources(site, marks) if previous(soak, name) else None,
    )
    return row


def previous(soak: Soak, name: str) -> bool:
    """Whether the run file says init = "previous": its figures follow the runs before it."""
    return soak.init_previous and "init" in RUN_FILES[name]


def finish(run: subprocess.Popen[bytes] | None, started: float) -> int | None:
    """The run's exit status; None when it never started or overran RUN_LIMIT_S (killed)."""
    if run is None:
        return None
    try:
        return run.wait(max(1.0, RUN_LIMIT_S - (time.monotonic() - started)))
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        run.wait(10)
        return None


def init_sources(site: Site, marks: dict[str, int]) -> dict[str, str]:
    """Under init = "previous": what each device says it started from, and why."""
    sources = {}
    for device in DEVICES:
        said = text(site.log(device), marks[device]).splitlines()
        start = next((line for line in said if ": starting from " in line), "")
        sources[device] = start.split(": starting from ", 1)[1] if start else "?"
    return sources


def measure(
    soak: Soak,
    index: int,
    name: str,
    fault: str,
    report: dict[str, Any] | None,
    problems: list[str],
) -> dict[str, Any]:
    """The run's report read against its plan: rounds, agents, completeness, figures, and
    every device's round log for it."""
    planned = int(RUN_FILES[name]["rounds"])
    row: dict[str, Any] = {
        "run": index, "run_file": name, "strategy": RUN_FILES[name]["strategy"], "fault": fault,
        "rounds_planned": planned, "problems": problems, "notes": [],
    }  # fmt: skip
    if report is None:
        problems.append("no report was written")
        empty: dict[str, Any] = {
            "run_id": None,
            "rounds_reported": 0,
            "agents_reported": 0,
            "folders": {},
        }
        return {**row, **empty, "complete": "no"}
    summary = report["summary"]
    run_id = report["config"]["run_id"]
    logged = {d: rounds_logged(soak.site.folder / d, run_id) for d in DEVICES}
    folders = {d: logged[d] == list(range(1, planned + 1)) for d in DEVICES}
    if not all(folders.values()):
        bad = ", ".join(f"{d} {logged[d]}" for d, ok in folders.items() if not ok)
        problems.append(f"round logs not 1..{planned}: {bad}")
    row.update(
        run_id=run_id,
        rounds_reported=len(report["rounds"]),
        agents_reported=summary.get("agents_reported", 0),
        complete=completeness(report, planned, fault, row),
        failed_agents=summary.get("failed_agents") or {},
        stragglers=summary.get("stragglers", []),
        interrupted=summary.get("interrupted"),
        total_bytes=summary.get("total_bytes"),
        mean_accuracy=summary.get("mean_accuracy"),
        report_wall_s=summary.get("wall_seconds"),
        folders=folders,
    )
    row["figures"] = figures(soak, index, name, fault, report, row)
    return row


def completeness(report: dict[str, Any], planned: int, fault: str, row: dict[str, Any]) -> str:
    """ "yes": every round, every agent, no failed agent and, centralized, every round
    aggregated from every agent. "explained": short of that only where a fault during the
    run can cause it (an agent failed or an upload lost, but every round aggregated and no
    other agent failed). Else "no". What is short goes to the row's notes or problems."""
    rounds, failed = report["rounds"], report["summary"].get("failed_agents") or {}
    per_round = [len(r["agents"]) for r in rounds]
    gaps = [f"{len(rounds)}/{planned} rounds"] if len(rounds) != planned else []
    if any(n != len(DEVICES) for n in per_round):
        gaps.append(f"agents per round {per_round}")
    if failed:
        gaps.append(f"failed agents {failed}")
    aggregated = {r["round"]: r.get("participants") for r in rounds if "coordinator" in r}
    central = RUN_FILES[row["run_file"]]["strategy"] in CENTRALIZED
    short = {t: who for t, who in aggregated.items() if len(who or ()) != len(DEVICES)}
    unaggregated = [r["round"] for r in rounds if not aggregated.get(r["round"])] if central else []
    if short:
        gaps.append(f"rounds aggregated from fewer agents: {short}")
    if unaggregated:
        gaps.append(f"rounds the coordinator aggregated nothing in: {unaggregated}")
    if not gaps:
        return "yes"
    explained = (
        fault in WATCHED and len(rounds) == planned and not unaggregated
        and set(failed) <= {WATCHED[fault]}
    )  # fmt: skip
    (row["notes"] if explained else row["problems"]).append("incomplete: " + "; ".join(gaps))
    return "explained" if explained else "no"


def rounds_logged(state: Path, run_id: str) -> list[int]:
    return sorted(checkpoint.read_records(run_folder(state, run_id) / "rounds.jsonl"))


def figures(
    soak: Soak, index: int, name: str, fault: str, report: dict[str, Any], row: dict[str, Any]
) -> str:
    """The run's figures against its run file's first fault-free run. What each agent
    learned each round and the accuracy must be equal when the fault could not touch the
    run; total bytes within BYTES_TOLERANCE (alike runs were seen to differ by a few bytes:
    timing-dependent message contents); the per-round split is not compared (ROUND_BYTES)."""
    if previous(soak, name):
        return "n/a (init prev)"
    if name not in soak.baselines:
        if fault in BETWEEN and row["complete"] == "yes":
            soak.baselines[name] = (index, report)
            return "baseline"
        return "-"
    first, base = soak.baselines[name]
    learned = VOLATILE + ROUND_BYTES
    now, then = report["summary"], base["summary"]
    extra = now.get("total_bytes", 0) - then.get("total_bytes", 0)
    differ = [
        what for what, same in (
            ("rounds", stable(report["rounds"], learned) == stable(base["rounds"], learned)),
            ("accuracy", now.get("mean_accuracy") == then.get("mean_accuracy")),
            ("bytes", abs(extra) <= BYTES_TOLERANCE * then.get("total_bytes", 0)),
        ) if not same
    ]  # fmt: skip
    shown = f"{', '.join(differ)}, " if differ else ""
    verdict = f"{'≠' if differ else '='} run {first}" + (
        f" ({shown}bytes {extra:+,})" if extra else ""
    )
    if differ and fault in BETWEEN:
        row["problems"].append(f"figures {verdict}: {fault} cannot change them")
    return verdict


def rss_check(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each device's RSS after the last run against after run 2, or, when a fault restarted
    it, after the second run its current process lived through (the first warms it up).
    "passed" is None where there is no such earlier run to compare with."""
    checks = {}
    last = results[-1]
    for device in DEVICES:
        lived = [r for r in results[:-1] if r["pids"][device] == last["pids"][device]]
        base = lived[1] if len(lived) > 1 else None
        before, after = (base["rss"][device] if base else None), last["rss"][device]
        ratio = after / before if before and after else None
        passed = ratio is not None and abs(ratio - 1) <= RSS_TOLERANCE
        checks[device] = {
            "from_run": base["run"] if base else None,
            "to_run": last["run"],
            "rss_before_mb": before / MB if before else None,
            "rss_after_mb": after / MB if after else None,
            "ratio": ratio,
            "passed": passed if base else None,
        }
    return checks


def models_check(folder: Path, results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Whether every device's current model (STATE_DIR/model.onnx) and each run's kept model
    load with onnxruntime: what `edge-agent predict` and a later run rely on."""
    import onnxruntime

    def loads(path: Path) -> bool:
        try:
            onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        except Exception:  # any failure to load it is what is reported
            return False
        return True

    run_ids = [r["run_id"] for r in results if r.get("run_id")]
    checks = {}
    for device in DEVICES:
        state = folder / device
        kept = [run_folder(state, run_id) / "model.onnx" for run_id in run_ids]
        checks[device] = {
            "current": (state / "model.onnx").exists() and loads(state / "model.onnx"),
            "kept_loading": sum(p.exists() and loads(p) for p in kept),
            "kept_expected": len(kept),
        }
    return checks


def folders_kept(folder: Path, results: list[dict[str, Any]]) -> dict[str, list[int]]:
    """Per device, the runs whose round log is no longer whole at the end (none expected:
    a device keeps its last 20 runs' folders)."""
    lost: dict[str, list[int]] = {d: [] for d in DEVICES}
    for r in results:
        if r.get("run_id"):
            expected = list(range(1, r["rounds_planned"] + 1))
            for device in DEVICES:
                if rounds_logged(folder / device, r["run_id"]) != expected:
                    lost[device].append(r["run"])
    return lost


FAULT_NAMES = {
    "none": "none",
    "gateway-restart": "gateway restart",
    "device-kill": "d2 SIGKILL",
    "link-down": f"d3 link down {LINK_DOWN_S}s",
    "broker-restart": "broker restart",
    "run-kill": "run SIGKILL",
}


def cells(r: dict[str, Any]) -> list[str]:
    """A run's row of the table."""
    folders, init = r.get("folders") or {}, r["init"]
    started_from = sum(s.startswith("the current model") for s in init.values()) if init else 0
    return [
        str(r["run"]), r["run_file"], FAULT_NAMES[r["fault"]],
        f"{r['rounds_reported']}/{r['rounds_planned']}",
        f"{r['agents_reported']}/{len(DEVICES)}",
        r["complete"], f"{r['wall_s']:.0f}",
        f"{r['total_bytes'] / MB:.1f}" if r.get("total_bytes") else "-",
        f"{r['mean_accuracy']:.3f}" if r.get("mean_accuracy") is not None else "-",
        r.get("figures", "-"),
        f"{started_from}/{len(DEVICES)} prev" if init else "seed",
        "ok" if folders and all(folders.values()) else "BAD",
        " ".join(f"{v / MB:.0f}" if v else "-" for v in r["rss"].values()),
    ]  # fmt: skip


def show(console: Console, results: list[dict[str, Any]], final: dict[str, Any]) -> None:
    """The table, the end checks, then every note and problem with its log lines."""
    table = Table(title=f"soak: {len(results)} runs, {len(DEVICES)} devices ({final['network']})")
    columns = (
        "#",
        "run file",
        "fault",
        "rounds",
        "agents",
        "complete",
        "wall s",
        "MB",
        "acc",
        "figures",
        "init",
        "logs",
        "RSS MB " + " ".join(DEVICES),
    )
    for column in columns:
        left = column in ("run file", "fault", "figures", "complete")
        table.add_column(column, justify="left" if left else "right", no_wrap=True)
    for r in results:
        table.add_row(*cells(r))
    console.print(table)
    for device, check in final["rss"].items():
        if check["passed"] is None:
            console.print(f"RSS {device}: n/a, its process lived through too few runs")
            continue
        ratio = f"{check['ratio']:.3f}" if check["ratio"] is not None else "-"
        console.print(
            f"RSS {device}: run {check['from_run']} {check['rss_before_mb'] or 0:.0f} MB -> run "
            f"{check['to_run']} {check['rss_after_mb'] or 0:.0f} MB, ratio {ratio}: "
            f"{'PASS' if check['passed'] else 'FAIL'}"
        )
    for device, check in final["models"].items():
        console.print(
            f"models {device}: current {'loads' if check['current'] else 'MISSING/BROKEN'}, "
            f"{check['kept_loading']}/{check['kept_expected']} runs' models load"
        )
    lost = {d: runs for d, runs in final["folders_lost"].items() if runs}
    console.print(f"run folders kept to the end: {lost or 'all'}")
    for r in results:
        where = f"run {r['run']} ({r['run_file']}, {r['fault']})"
        for note in r["notes"]:
            console.print(f"[yellow]{where}, note:[/] {escape(note)}", highlight=False)
        for problem in r["problems"]:
            console.print(f"[red]{where}:[/] {escape(problem)}", highlight=False)
    console.print(f"soak {'PASSED' if final['passed'] else 'FAILED'} in {final['wall_s']:.0f} s")


def progress(console: Console, row: dict[str, Any]) -> None:
    """One run's outcome as soon as it is known: a soak takes minutes."""
    console.print(
        f"  {row['run_id']}: {row['rounds_reported']}/{row['rounds_planned']} rounds, complete "
        f"{row['complete']}, {row['wall_s']} s, figures {row.get('figures', '-')}",
        highlight=False,
    )
    for line in row["notes"] + row["problems"]:
        console.print(f"  {escape(line)}", highlight=False)


def network(stack: contextlib.ExitStack, loopback: bool) -> tuple[Any | None, str]:
    """The emulated LAN, or None and why the soak runs on loopback instead."""
    if loopback:
        return None, "loopback (--loopback)"
    try:
        lan = stack.enter_context(Lan(["gw", *DEVICES]))
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        return None, f"loopback: network namespaces cannot be made here ({exc})"
    return lan, "netns LAN"


def bring_up(site: Site) -> None:
    """The gateway, then the devices, until every device has joined the fleet."""
    if site.broker_kind == "mosquitto":
        site.start("mosquitto")
    site.start("serve")
    for device in DEVICES:
        site.start(device)
    joined = lambda: all("joined fleet" in text(site.log(d)) for d in DEVICES)  # noqa: E731
    if not wait_for(joined, 180):
        raise SoakError(
            "devices did not join: "
            + "; ".join(f"{d}: {tail(site.log(d), lines=3)}" for d in DEVICES)
        )


def soak(args: argparse.Namespace, folder: Path, console: Console) -> dict[str, Any]:
    """Bring the site up, run the plan, check the end state; the results, written to
    args.out after every run so that an interrupted soak leaves what it measured."""
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        lan, where = network(stack, args.loopback)
        console.print(f"soak in {folder}: {where}, {args.broker} broker")
        site = Site(folder, lan, args.broker)
        stack.callback(site.close)
        write_data(folder)
        state = Soak(site, write_run_files(folder, args.init_previous), args.init_previous)
        bring_up(site)
        results: list[dict[str, Any]] = []
        final: dict[str, Any] = {
            "network": where,
            "broker": args.broker,
            "init_previous": args.init_previous,
            "timeouts": TIMEOUTS,
            "workdir": str(folder),
        }
        for index, (name, fault) in enumerate(plan(args.runs), start=1):
            console.print(f"run {index}: {name}, fault: {FAULT_NAMES[fault]}", highlight=False)
            results.append(run_once(state, index, name, fault))
            progress(console, results[-1])
            write_json(args.out, {"environment": environment(), "summary": final, "runs": results})
        final.update(
            rss=rss_check(results),
            models=models_check(folder, results),
            folders_lost=folders_kept(folder, results),
        )
    final["wall_s"] = time.monotonic() - started
    final["passed"] = (
        all(not r["problems"] for r in results)
        and all(c["passed"] is not False for c in final["rss"].values())
        and all(
            m["current"] and m["kept_loading"] == m["kept_expected"]
            for m in final["models"].values()
        )
        and not any(final["folders_lost"].values())
    )
    write_json(args.out, {"environment": environment(), "summary": final, "runs": results})
    show(console, results, final)
    return final


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=len(SCHEDULE))
    parser.add_argument("--broker", choices=("embedded", "mosquitto"), default="embedded")
    parser.add_argument(
        "--no-init-previous",
        dest="init_previous",
        action="store_false",
        help='leave init = "previous" out of the -prev run files',
    )
    parser.add_argument("--loopback", action="store_true", help="no network namespaces")
    parser.add_argument(
        "--workdir", type=Path, help="the soak's folder (default: a new one in /tmp; kept)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/soak.json")
    args = parser.parse_args(argv)
    folder = args.workdir or Path(tempfile.mkdtemp(prefix="edgefl-soak-"))
    folder.mkdir(parents=True, exist_ok=True)
    # SIGTERM unwinds like Ctrl-C, so every process and namespace is cleaned up
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    console = Console(width=max(Console().width, 200))
    try:
        final = soak(args, folder, console)
    except KeyboardInterrupt:
        console.print(f"interrupted; the runs so far are in {args.out}, the logs in {folder}")
        return 130
    return 0 if final["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
