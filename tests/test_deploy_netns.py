"""Acceptance: a gateway and devices on an emulated LAN, with the README's deploy commands.

Every host is a Linux network namespace (`tests/netns.py`): the gateway runs `coordinator
serve` (embedded broker, announced over mDNS on its interface), each device `edge-agent` on
its own data file with no --broker (it finds the gateway over mDNS), and `coordinator run`
starts runs from run files. The commands are the ones README.md's deploy section gives,
with each host's address, id, data file and state folder filled in.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from netns import Lan, skip_unless_netns
from test_agent_service import write_data, write_run

from agent.model_store import run_folder
from agent.runtime import checkpoint

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
DEVICES = ("d1", "d2", "d3", "d4")
README_GATEWAY, README_DEVICE = "192.168.1.10", "192.168.1.21"
CLI = {
    "coordinator": [sys.executable, "-c", "from coordinator.cli import main; main()"],
    "edge-agent": [sys.executable, "-c", "from agent.cli import main; main()"],
}


def readme_commands() -> dict[str, list[str]]:
    """The deploy section's commands by what they do: serve, first (a device's first start,
    which prints the command that admits it), admit, agent (with its bundle), run, status."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Deploy on a gateway and devices", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README's deploy section has no bash block"
    commands = {}
    for line in block.group(1).splitlines():
        words = line.split()
        if not words or words[0].startswith("#") or words[0] == "scp":
            continue
        kind = {"serve": "serve", "run": "run", "status": "status", "admit": "admit"}.get(
            words[1], "agent" if "--config" in words else "first"
        )
        commands[kind] = words
    assert set(commands) == {"serve", "first", "admit", "agent", "run", "status"}, commands
    return commands


def command(words: list[str], swaps: dict[str, str], *extra: str) -> list[str]:
    """A README command with its example values swapped for this host's, as a process."""
    return [*CLI[words[0]], *(swaps.get(w, w) for w in words[1:]), *extra]


def wait_for(check, timeout_s: float, what: str, poll_s: float = 0.2) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll_s)


def log_text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def rounds_logged(state: Path) -> list[int]:
    """The rounds an agent logged (any run), in log order, duplicates kept."""
    logs = sorted((state / "runs").glob("*/rounds.jsonl"))
    return [json.loads(line)["round"] for log in logs for line in log.read_text().splitlines()]


class Site:
    """The gateway and devices of one test: start them, run runs, read their files."""

    def __init__(self, lan: Lan, tmp: Path, broker_flags: list[str] | None = None) -> None:
        self.lan, self.tmp = lan, tmp
        self.broker_flags = broker_flags or []
        self.readme = readme_commands()
        self.devices: dict[str, subprocess.Popen[bytes]] = {}
        self.state = ("--state-dir", str(tmp / "gw-state"))
        """The gateway's keys and logins: never the machine's own /var/lib/edgefl."""

    def swaps(self, host: str) -> dict[str, str]:
        return {
            README_GATEWAY: self.lan.address("gw"),
            README_DEVICE: self.lan.address(host),
            "data.npz": str(self.tmp / f"{host}.npz"),
            "edgefl/agent.toml": str(self.tmp / "gw-state" / "broker" / "members" / host)
            + "/agent.toml",
        }

    def admit(self, hosts: tuple[str, ...]) -> None:
        """As the README says: each device's first start stops with the command that
        admits it, run on the gateway (all devices at once)."""
        logs = {host: self.tmp / f"{host}-first.log" for host in hosts}
        first = {
            host: self.lan.popen(host, self.device_argv("first", host), log=logs[host])
            for host in hosts
        }
        for host, process in first.items():
            assert process.wait(90) == 2, log_text(logs[host])
            printed = re.search(r"`(coordinator admit [^`]+)`", log_text(logs[host]))
            assert printed, log_text(logs[host])
            admit = command(printed.group(1).split(), {}, *self.state)
            assert self.lan.run("gw", admit, timeout=60).returncode == 0

    def device_argv(self, kind: str, host: str, *extra: str) -> list[str]:
        own = ("--id", host, "--state-dir", str(self.tmp / host))
        return command(self.readme[kind], self.swaps(host), *own, *extra)

    def start_device(self, host: str, *extra: str) -> subprocess.Popen[bytes]:
        """The device's agent: with its bundle, or, given broker credentials of its own,
        the README's first command with them."""
        argv = self.device_argv("first" if extra else "agent", host, *extra)
        process = self.lan.popen(host, argv, log=self.tmp / f"{host}.log")
        self.devices[host] = process
        return process

    def crash(self, host: str) -> None:
        """SIGKILL a device's agent: no goodbye, no flushing."""
        os.killpg(self.devices[host].pid, signal.SIGKILL)
        self.devices[host].wait(10)

    def run(self, run_file: Path, report: Path) -> subprocess.Popen[bytes]:
        swaps = {
            **self.swaps("gw"),
            "run.toml": str(run_file),
            "report.json": str(report),
            "plots": str(self.tmp / "plots"),
        }
        argv = command(self.readme["run"], swaps, *self.broker_flags, *self.state)
        if "--report" not in argv:  # the doc's run writes report.json, or report-N.json
            argv += ["--report", str(report)]
        return self.lan.popen("gw", argv, log=self.tmp / f"{report.stem}.log")

    def joined(self, hosts: tuple[str, ...]) -> bool:
        return all("joined fleet" in log_text(self.tmp / f"{h}.log") for h in hosts)


@pytest.fixture
def lan() -> Iterator[Lan]:
    skip_unless_netns()
    with Lan(["gw", *DEVICES, "d5"]) as network:
        yield network


def test_gateway_runs_a_fleet_of_devices_that_find_it_over_mdns(lan: Lan, tmp_path: Path) -> None:
    site = Site(lan, tmp_path)
    serve = lan.popen(
        "gw", command(site.readme["serve"], site.swaps("gw"), *site.state), log=tmp_path / "gw.log"
    )
    assert lan.reachable("d1", lan.address("gw"), 8883, timeout_s=30), log_text(tmp_path / "gw.log")
    mixes = ([0, 1, 2, 3, 4, 5], [3, 4, 5, 6, 7, 8], [6, 7, 8, 9, 0, 1], [1, 3, 5, 7, 9, 2])
    for k, host in enumerate(DEVICES):
        write_data(tmp_path / f"{host}.npz", mixes[k], seed=k)
    np.savez(tmp_path / "d5.npz", x=np.zeros((60, 3, 8, 8), np.float32), y=np.zeros(60, np.int64))
    site.admit((*DEVICES, "d5"))
    for host in (*DEVICES, "d5"):
        site.start_device(host)
    wait_for(lambda: site.joined((*DEVICES, "d5")), 90, "the agents to find the broker")

    decentralized = write_run(
        tmp_path / "dadpfl.toml",
        strategy="dadpfl",
        agents=4,
        rounds=16,
        round_timeout=3,
        vote_timeout=3,
        linger=30,
        join_timeout=60,
    )
    run = site.run(decentralized, tmp_path / "dadpfl.json")
    state = {host: tmp_path / host for host in DEVICES}
    wait_for(lambda: rounds_logged(state["d2"])[-1:] >= [2], 120, "d2's round 2")
    site.crash("d2")
    site.start_device("d2")
    wait_for(lambda: rounds_logged(state["d3"])[-1:] >= [4], 120, "d3's round 4")
    lan.link("d3", False)
    time.sleep(8)  # longer than the round timeout: the others go on without d3
    lan.link("d3", True)
    assert run.wait(300) == 0, log_text(tmp_path / "dadpfl.log")

    report = json.loads((tmp_path / "dadpfl.json").read_text())
    assert report["config"]["roster"] == list(DEVICES)
    assert len(report["rounds"]) == 16
    assert report["summary"]["failed_agents"] == {}
    run_id = report["config"]["run_id"]
    for host in DEVICES:
        log = run_folder(state[host], run_id) / "rounds.jsonl"
        assert list(checkpoint.read_records(log)) == list(range(1, 17)), host
    assert rounds_logged(state["d2"]) == list(range(1, 17)), (
        "d2 resumed: no round lost or run twice"
    )
    assert "resuming after round" in log_text(tmp_path / "d2.log") or "round 3" in log_text(
        tmp_path / "d2.log"
    )
    assert "d3" in report["summary"]["stragglers"], "the others went on without d3"
    d5 = log_text(tmp_path / "d5.log")
    assert "its data does not fit the run: samples have shape (3, 8, 8)" in d5
    assert "agent d5 cannot join" in log_text(tmp_path / "dadpfl.log")
    assert (tmp_path / "plots").is_dir() and any((tmp_path / "plots").iterdir())

    centralized = write_run(
        tmp_path / "fedspu.toml", strategy="fedspu", agents=4, rounds=4, round_timeout=10
    )
    run = site.run(centralized, tmp_path / "fedspu.json")
    assert run.wait(180) == 0, log_text(tmp_path / "fedspu.log")
    report = json.loads((tmp_path / "fedspu.json").read_text())
    assert report["config"]["run_id"] != run_id, "every run gets a fresh id"
    assert len(report["rounds"]) == 4
    assert all(len(r["participants"]) == 4 for r in report["rounds"])
    assert all(r["coordinator"]["sent"] > 0 for r in report["rounds"])

    mdns = ("--mdns", lan.address("gw"), "--json", *site.state)
    status = lan.run("gw", command(site.readme["status"], site.swaps("gw"), *mdns), 60)
    fleet = {entry["agent"]: entry for entry in json.loads(status.stdout)}
    assert all(fleet[h]["online"] and fleet[h]["state"] == "idle" for h in DEVICES), fleet
    assert all(fleet[h]["mdns"] for h in (*DEVICES, "d5")), "agents advertise over mDNS"
    assert fleet["d5"]["state"] == "rejected"
    assert "does not fit" in fleet["d5"]["metrics"]["error"]
    assert serve.poll() is None


def tls_broker(lan: Lan, tmp: Path, users: dict[str, str]) -> Path:
    """mosquitto on the gateway over TLS only (a certificate for its address) with a
    password per user; returns the CA file the others check it with."""
    openssl, passwd = shutil.which("openssl"), shutil.which("mosquitto_passwd")
    mosquitto = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    if not (openssl and passwd and os.access(mosquitto, os.X_OK)):
        pytest.skip("needs openssl and mosquitto (scripts/setup.sh installs them)")
    gateway = lan.address("gw")
    cert, key, passwords = tmp / "gw-cert.pem", tmp / "gw-key.pem", tmp / "passwords"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
        + ["-keyout", str(key), "-out", str(cert), "-subj", "/CN=gateway"]
        + ["-addext", f"subjectAltName=IP:{gateway}"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    passwords.touch()
    for user, password in users.items():
        subprocess.run([passwd, "-b", str(passwords), user, password], check=True, timeout=60)
        (tmp / f"{user}.password").write_text(password + "\n")
    config = tmp / "mosquitto.conf"
    config.write_text(
        f"listener 8883 {gateway}\ncertfile {cert}\nkeyfile {key}\n"
        f"password_file {passwords}\nallow_anonymous false\nuser root\npersistence false\n"
        "log_dest stdout\nlog_type error\nlog_type warning\n"
    )
    lan.popen("gw", [mosquitto, "-c", str(config)], log=tmp / "mosquitto.log")
    assert lan.reachable("d1", gateway, 8883, timeout_s=20), log_text(tmp / "mosquitto.log")
    return cert


def credentials(tmp: Path, user: str, ca: Path) -> list[str]:
    return [
        "--tls-ca",
        str(ca),
        "--username",
        user,
        "--password-file",
        str(tmp / f"{user}.password"),
    ]


def test_the_same_fleet_over_tls_with_broker_credentials(lan: Lan, tmp_path: Path) -> None:
    users = {"gateway": "gw-secret", **{h: f"{h}-secret" for h in (*DEVICES, "d5")}}
    ca = tls_broker(lan, tmp_path, users)
    broker = f"{lan.address('gw')}:8883"
    site = Site(lan, tmp_path, ["--broker", broker, *credentials(tmp_path, "gateway", ca)])
    serve_argv = command(site.readme["serve"], site.swaps("gw"), *site.broker_flags)
    lan.popen("gw", serve_argv, log=tmp_path / "gw.log")
    wait_for(lambda: "announcing the broker" in log_text(tmp_path / "gw.log"), 60, "serve")
    for k, host in enumerate(DEVICES):
        write_data(tmp_path / f"{host}.npz", [k, k + 1, k + 2, k + 5, k + 6], seed=k)
        site.start_device(host, *credentials(tmp_path, host, ca))
    (tmp_path / "d5.password").write_text("wrong\n")
    write_data(tmp_path / "d5.npz", [1, 2], seed=5)
    intruder = site.start_device("d5", *credentials(tmp_path, "d5", ca))
    wait_for(lambda: site.joined(DEVICES), 90, "the agents to find the TLS broker")

    run_file = write_run(
        tmp_path / "tls.toml", strategy="dadpfl", agents=4, rounds=5, round_timeout=10
    )
    run = site.run(run_file, tmp_path / "tls.json")
    assert run.wait(240) == 0, log_text(tmp_path / "tls.log")
    report = json.loads((tmp_path / "tls.json").read_text())
    assert report["config"]["roster"] == list(DEVICES)
    assert len(report["rounds"]) == 5 and report["summary"]["failed_agents"] == {}
    assert intruder.wait(60) == 1
    assert "refused the connection" in log_text(tmp_path / "d5.log")
    assert "Traceback" not in log_text(tmp_path / "d5.log")
