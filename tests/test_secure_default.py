"""Acceptance: the secure path docs/deploy.md leads with, run as written on an emulated LAN.

The gateway and two devices are Linux network namespaces (`tests/netns.py`). The commands
are the ones of deploy.md's "Secure by default" block, with each host's address, data file
and state folder filled in: serve on the gateway's LAN address makes its key and logins; a
device started without a bundle stops with one line naming the command that admits it; that
command, run on the gateway, writes the bundle; the device started with it joins; a run
completes, signed; and a client without a login can neither connect nor start a run. Then
the same LAN with --open: it says what it allows and works as before.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from netns import Lan, skip_unless_netns
from test_agent_service import write_data, write_run

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "docs" / "deploy.md"
CLI = {
    "coordinator": [sys.executable, "-c", "from coordinator.cli import main; main()"],
    "edge-agent": [sys.executable, "-c", "from agent.cli import main; main()"],
}
GATEWAY, DEVICE, DEVICE_ID = "192.168.1.10", "pi-kitchen", "pi-kitchen"
DEVICES = ("d1", "d2")

ANONYMOUS_RUN = """
import ssl, sys, paho.mqtt.client as mqtt
client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="intruder")
port = int(sys.argv[2])
if len(sys.argv) > 3:
    client.username_pw_set(sys.argv[3], "guessed")
if port == 8883:
    client.tls_set(cert_reqs=ssl.CERT_NONE)  # an intruder checks nothing
    client.tls_insecure_set(True)
codes = []
client.on_connect = lambda c, u, f, reason, p: codes.append(reason.value)
client.connect(sys.argv[1], port, 10)
client.loop_start()
import time
deadline = time.monotonic() + 10
while not codes and time.monotonic() < deadline:
    time.sleep(0.05)
client.publish("fl/v1/default/run", b"forged", qos=1, retain=True)
time.sleep(0.5)
print(codes[0] if codes else "none")
"""


PLAIN_CONNECT = """
import socket, sys
sock = socket.create_connection((sys.argv[1], 8883), 10)
sock.sendall(bytes([0x10, 12]) + b"\\x00\\x04MQTT\\x04\\x02\\x00\\x1e\\x00\\x00")
sock.settimeout(12)
print("closed" if sock.recv(16) == b"" else "answered")
"""


def secure_block() -> list[list[str]]:
    """The command lines of deploy.md's secure-by-default block, comments dropped."""
    section = DEPLOY.read_text().split("### Secure by default", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block, "deploy.md's secure-by-default section has no sh block"
    return [shlex.split(line) for line in block.group(1).splitlines() if line[:1] not in "#"]


def of(lines: list[list[str]], program: str, sub: str | None = None) -> list[list[str]]:
    return [w for w in lines if w[0] == program and (sub is None or w[1] == sub)]


def text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def wait_for(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


class Site:
    """The LAN of one test: deploy.md's commands with this host's values swapped in."""

    def __init__(self, lan: Lan, tmp: Path) -> None:
        self.lan, self.tmp = lan, tmp
        self.gateway_state = tmp / "gw-state"

    def swap(self, words: list[str], host: str) -> list[str]:
        swaps = {
            GATEWAY: self.lan.address("gw"),
            "data.npz": str(self.tmp / f"{host}.npz"),
            "edgefl/agent.toml": str(self.bundle(host) / "agent.toml"),
            "report.json": str(self.tmp / "report.json"),
        }
        argv = [*CLI[words[0]], *(swaps.get(w, w) for w in words[1:])]
        if host == "gw":  # never the machine's own /var/lib/edgefl
            return [*argv, "--state-dir", str(self.gateway_state)]
        return [*argv, "--id", host, "--state-dir", str(self.tmp / host)]

    def bundle(self, host: str) -> Path:
        return self.gateway_state / "broker" / "members" / host

    def start(self, host: str, words: list[str], log: str) -> subprocess.Popen[bytes]:
        return self.lan.popen(host, self.swap(words, host), log=self.tmp / log)


@pytest.fixture
def lan() -> Iterator[Lan]:
    skip_unless_netns()
    with Lan(["gw", *DEVICES]) as network:
        yield network


def test_the_secure_path_of_deploy_md_admits_devices_and_runs_signed(
    lan: Lan, tmp_path: Path
) -> None:
    lines, site = secure_block(), Site(lan, tmp_path)
    (serve,) = of(lines, "coordinator", "serve")
    first, with_bundle = of(lines, "edge-agent")
    assert "--config" in with_bundle and "--config" not in first
    gateway = lan.address("gw")
    site.start("gw", serve, "gw.log")
    wait_for(lambda: "coordinator admit ID KEY" in text(tmp_path / "gw.log"), 30, "serve")
    for k, host in enumerate(DEVICES):
        write_data(tmp_path / f"{host}.npz", [k, k + 1, k + 2, k + 3], seed=k)
    refused = {host: site.start(host, first, f"{host}-first.log") for host in DEVICES}
    for host, process in refused.items():
        assert process.wait(60) == 2, text(tmp_path / f"{host}-first.log")
        said = text(tmp_path / f"{host}-first.log").strip()
        assert said.count("\n") == 0 and "not admitted" in said, said
        admit = re.search(r"`(coordinator admit [^`]+)`", said)
        assert admit and f"admit {host} ed25519:" in admit.group(1), said
        done = lan.run("gw", site.swap(shlex.split(admit.group(1)), "gw"), timeout=60)
        assert done.returncode == 0, done.stderr
        assert f"scp -r {site.bundle(host)} {host}:edgefl" in done.stderr
    agents = {host: site.start(host, with_bundle, f"{host}.log") for host in DEVICES}
    wait_for(
        lambda: all("joined fleet" in text(tmp_path / f"{h}.log") for h in DEVICES), 60, "joins"
    )
    assert all("signs with its own key" in text(tmp_path / f"{h}.log") for h in DEVICES)

    # d1's bundle on another board, which has a key of its own: refused at its CONNECT, and
    # the gateway says which id was claimed and from where; d1 stays in the fleet (below).
    impostor = site.swap(with_bundle, "d1")
    impostor[impostor.index("--state-dir") + 1] = str(tmp_path / "impostor")
    taken = lan.run("d2", impostor, timeout=60)
    assert taken.returncode != 0 and "--replace" in taken.stderr, taken.stderr
    gateway_log = text(tmp_path / "gw.log").splitlines()
    claimed = [line for line in gateway_log if "not the one admitted" in line]
    assert claimed and "'d1'" in claimed[0] and lan.address("d2") in claimed[0], claimed

    # Beyond loopback the broker speaks TLS only: nothing listens in clear on the LAN, and
    # a plain CONNECT to the TLS port gets no answer. Without a login nobody gets in over
    # TLS either; a member's name with a guessed password neither.
    assert not lan.reachable("d2", gateway, 1883, timeout_s=2)
    plain = lan.run("d2", [sys.executable, "-c", PLAIN_CONNECT, gateway], timeout=30)
    assert plain.stdout.strip() == "closed", plain.stdout + plain.stderr
    for who in ([], ["d1"]):
        intruder = [sys.executable, "-c", ANONYMOUS_RUN, gateway, "8883", *who]
        answer = lan.run("d2", intruder, timeout=30)
        assert answer.stdout.strip() not in ("0", "none"), answer.stdout + answer.stderr

    (run,) = of(lines, "coordinator", "run")
    run_file = write_run(
        tmp_path / "run.toml", strategy="dadpfl", agents=2, rounds=2, epochs=1, round_timeout=20
    )
    run_argv = site.swap(run, "gw")
    run_argv[run_argv.index("run.toml")] = str(run_file)
    if "--report" not in run_argv:  # the doc's run writes report.json, or report-N.json
        run_argv += ["--report", str(tmp_path / "report.json")]
    done = lan.run("gw", run_argv, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["config"]["roster"] == list(DEVICES)
    assert len(report["rounds"]) == 2 and report["summary"]["failed_agents"] == {}
    assert all(p.poll() is None for p in agents.values())
    assert "forged" not in text(tmp_path / "d1.log")
    assert "not admitted" not in text(tmp_path / "gw.log"), "serve saw the new members at once"

    (status,) = of(lines, "coordinator", "status")
    shown = lan.run("gw", [*site.swap(status, "gw"), "--json"], timeout=60)
    fleet = {entry["agent"]: entry for entry in json.loads(shown.stdout)}
    assert all(fleet[h]["online"] for h in DEVICES), shown.stdout + shown.stderr


def test_open_says_what_it_allows_and_works_as_before(lan: Lan, tmp_path: Path) -> None:
    site = Site(lan, tmp_path)
    gateway = lan.address("gw")
    site.start("gw", ["coordinator", "serve", "--host", GATEWAY, "--open"], "gw.log")
    wait_for(lambda: "following fleet" in text(tmp_path / "gw.log"), 30, "serve")
    warning = text(tmp_path / "gw.log")
    assert "--open" in warning and "without a login" in warning and "forged" in warning
    assert not (tmp_path / "gw-state").exists(), "an open gateway makes no keys"
    write_data(tmp_path / "d1.npz", [0, 1, 2, 3])
    site.start("d1", ["edge-agent", "--data", "data.npz", "--broker", GATEWAY, "--open"], "d1.log")
    wait_for(lambda: "joined fleet" in text(tmp_path / "d1.log"), 40, "the open agent")
    assert "signs nothing" in text(tmp_path / "d1.log")
    intruder = [sys.executable, "-c", ANONYMOUS_RUN, gateway, "1883"]
    anonymous = lan.run("d2", intruder, timeout=30)
    assert anonymous.stdout.strip() == "0", "an open broker lets anyone in"


def test_an_agent_beyond_loopback_without_a_bundle_says_how_to_be_admitted(
    tmp_path: Path,
) -> None:
    """Before it connects anywhere: its key is made, and the error is the command to run.
    (0.0.0.0 is no loopback address, yet were the agent to connect, it would stay on this
    machine: tests never reach the real network.)"""
    state = tmp_path / "pi"
    argv = [*CLI["edge-agent"], "--broker", "0.0.0.0", "--id", "pi", "--state-dir", str(state)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr
    key = subprocess.run(
        [*CLI["edge-agent"], "--id", "pi", "--state-dir", str(state), "key"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    ).stdout.strip()
    assert f"`coordinator admit {key}`" in result.stderr
    assert "--config" in result.stderr and "--open" in result.stderr


def test_admit_gives_a_device_its_key_its_login_and_its_bundle(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from coordinator.broker_config import BrokerAuth, member_password
    from coordinator.cli import main as coordinator
    from protocol.signing import public_line, public_text, read_keys

    state, runner = tmp_path / "gw", CliRunner()
    lines = [public_line(name, tmp_path / f"{name}.pem") for name in ("d1", "d2")]
    admit = ["admit", "--state-dir", str(state), "--fleet", "lab"]
    first = runner.invoke(coordinator, [*admit, *lines[0].split()])
    assert first.exit_code == 0, first.output
    password = member_password(state / "broker", "d1")
    assert runner.invoke(coordinator, [*admit, *lines[1].split()]).exit_code == 0
    again = runner.invoke(coordinator, ["admit", "--state-dir", str(state), *lines[0].split()])
    assert again.exit_code == 0, again.output
    assert set(read_keys(state / "admitted.keys")) == {"d1", "d2"}
    auth = BrokerAuth.load(state / "broker")
    assert auth.login("d1", password), "a member keeps its password when others are admitted"
    assert auth.may_publish("d1", "fl/v1/lab/status/d1")
    assert not auth.may_publish("d1", "fl/v1/lab/status/d2")
    assert not auth.may_publish("d1", "fl/v1/lab/run"), "only the coordinator starts runs"
    bundle = state / "broker" / "members" / "d1"
    config = (bundle / "agent.toml").read_text()
    assert "username" not in config, "the device logs in with its key"
    assert 'tls_ca = "ca.pem"' in config, "and over TLS, checked against the gateway's CA"
    assert (bundle / "ca.pem").read_text() == (state / "tls" / "ca.pem").read_text()
    assert (state / "tls" / "ca.key").stat().st_mode & 0o077 == 0
    coordinator_key = runner.invoke(coordinator, ["key", "--state-dir", str(state)]).output
    assert (bundle / "trust.keys").read_text() == coordinator_key
    assert all((bundle / name).stat().st_mode & 0o077 == 0 for name in ("password", "agent.toml"))
    taken = runner.invoke(coordinator, [*admit, "gateway", lines[0].split()[1]])
    assert taken.exit_code == 2 and "coordinator's own id" in taken.output
    reimaged = public_line("d1", tmp_path / "d1-reimaged.pem").split()[1]
    refused = runner.invoke(coordinator, [*admit, "d1", reimaged])
    assert refused.exit_code == 1 and "--replace" in refused.output
    rotated = runner.invoke(coordinator, [*admit, "d1", reimaged, "--replace"])
    assert rotated.exit_code == 0, rotated.output
    keys = read_keys(state / "admitted.keys")
    assert set(keys) == {"d1", "d2"} and public_text(keys["d1"]) == reimaged
