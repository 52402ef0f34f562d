"""The long-lived agent and runs from run files, as a person runs them on one machine:
real `edge-agent` and `coordinator` processes on a real broker (loopback)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from test_cli import COORDINATOR, EDGE_AGENT, REPO

from agent.data import load_dataset
from protocol import BrokerAddress, Identity, connect, messages, topics
from protocol.signing import MemberKeys, add_key
from tests.processes import Processes, interrupt, wait_for_text


def write_data(path: Path, classes: list[int], samples: int = 200, seed: int = 0) -> Path:
    dataset = load_dataset("mnist1d", seed=1)
    pick = np.random.default_rng(seed).choice(
        np.flatnonzero(np.isin(dataset.y, classes)), samples, replace=False
    )
    np.savez(path, x=dataset.x[pick], y=dataset.y[pick])
    return path


def write_run(path: Path, **keys: object) -> Path:
    path.write_text("[run]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items()))
    return path


def run_files_of(state: Path) -> dict[str, list[int]]:
    """Run id -> the rounds the agent logged in it."""
    return {
        log.parent.name: [json.loads(line)["round"] for line in log.read_text().splitlines()]
        for log in (state / "runs").glob("*/rounds.jsonl")
    }


def start_fleet(
    processes: Processes,
    tmp: Path,
    broker: str,
    run_file: Path,
    names: list[str],
    extra: tuple[str, ...] = (),
) -> list[subprocess.Popen]:
    fleet = []
    for k, name in enumerate(names):
        data = write_data(tmp / f"{name}.npz", [k, k + 1, k + 2, k + 3], seed=k)
        command = [
            *EDGE_AGENT, "--broker", broker, "--id", name, "--fleet", "solo",
            "--expect", str(len(names)), "--run", str(run_file), "--data", str(data),
            "--state-dir", str(tmp / name), "--round-timeout", "20", *extra,
        ]  # fmt: skip
        fleet.append(processes.spawn(command, tmp / f"{name}.log"))
    return fleet


def trust_file(tmp: Path, names: list[str]) -> Path:
    """The peers' public keys, as `edge-agent key` prints them on each device."""
    lines = [
        subprocess.run(
            [*EDGE_AGENT, "--id", name, "--state-dir", str(tmp / name), "key"],
            cwd=REPO,
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        for name in names
    ]
    path = tmp / "trust.keys"
    path.write_text("".join(lines))
    return path


@pytest.mark.slow
def test_a_fleet_without_coordinator_runs_from_one_run_file_and_reruns_fresh(
    amqtt_broker, tmp_path: Path, processes: Processes
) -> None:
    run_file = write_run(
        tmp_path / "run.toml",
        strategy="dadpfl",
        agents=3,
        rounds=3,
        input_shape=[1, 40],
        classes=10,
    )
    names = ["pi-a", "pi-b", "pi-c"]
    for attempt in (1, 2):
        # The rerun signs with a key per device, each trusting the others' (one trust file).
        extra = ("--trust", str(trust_file(tmp_path, names))) if attempt == 2 else ()
        fleet = start_fleet(processes, tmp_path, str(amqtt_broker.address), run_file, names, extra)
        for name, process in zip(names, fleet, strict=True):
            assert process.wait(180) == 0, (tmp_path / f"{name}.log").read_text()
        runs = [run_files_of(tmp_path / name) for name in names]
        assert all(len(r) == attempt for r in runs), "every start of the fleet is a fresh run"
        assert runs[0].keys() == runs[1].keys() == runs[2].keys(), "one run id for the fleet"
        assert all(rounds == [1, 2, 3] for r in runs for rounds in r.values())
        assert all((tmp_path / name / "model.onnx").exists() for name in names)


@pytest.mark.parametrize(
    ("keys", "extra", "message"),
    [
        ({"strategy": "dadpfl", "agents": 3, "neighbours": 3}, [], "neighbours"),
        ({"strategy": "fedspu", "agents": 3}, [], "fedspu is centralized"),
        ({"strategy": "dadpfl", "agents": 3, "rounds": "ten"}, [], "rounds must be an integer"),
        ({"strategy": "dadpfl", "agents": 3, "round": 5}, [], "did you mean 'rounds'"),
        ({"strategy": "dadpfl", "agents": 3}, ["--expect", "4"], "wants 3 agents"),
        (
            {"strategy": "dadpfl", "agents": 3, "input_shape": [3, 8, 8], "classes": 10},
            ["--data", "DATA"],
            "does not fit the run",
        ),
    ],
)
def test_a_run_file_that_cannot_work_is_a_one_line_error_before_anything_starts(
    tmp_path: Path, keys: dict, extra: list[str], message: str
) -> None:
    run_file = write_run(tmp_path / "run.toml", **{"input_shape": [1, 40], "classes": 10, **keys})
    data = str(write_data(tmp_path / "data.npz", [0, 1, 2]))
    command = [
        *EDGE_AGENT, "--broker", "127.0.0.1:9", "--run", str(run_file),
        *[data if word == "DATA" else word for word in extra],
    ]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()[-1]) > 0


def test_coordinator_run_says_why_when_the_agents_do_not_come(amqtt_broker, tmp_path: Path) -> None:
    run_file = write_run(tmp_path / "run.toml", strategy="fedavg", agents=2, join_timeout=2)
    command = [
        *COORDINATOR, "run", str(run_file), "--broker", str(amqtt_broker.address),
        "--report", str(tmp_path / "report.json"),
    ]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "only 0 of the 2 agents the run wants were online" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "report.json").exists()


def admitted_fleet(tmp: Path, names: list[str]) -> tuple[Path, Path]:
    """The coordinator's key pair (made now) and an admission list of `names`' keys
    (`coordinator admit --admitted`); every device trusts the coordinator (tmp/trust.keys)."""
    identity, admitted = tmp / "coordinator.pem", tmp / "admitted.keys"
    line = subprocess.run(
        [*COORDINATOR, "key", "--identity", str(identity)],
        cwd=REPO, check=True, capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    for name in names:
        agent_id, public = trust_file(tmp, [name]).read_text().split()
        subprocess.run([*COORDINATOR, "admit", agent_id, public, "--admitted", str(admitted)],
                       cwd=REPO, check=True, timeout=60)  # fmt: skip
    (tmp / "trust.keys").write_text(line)
    return identity, admitted


def start_trusting(
    processes: Processes, tmp: Path, broker: str, names: list[str]
) -> list[subprocess.Popen]:
    """`edge-agent` per name, with data of classes 0-3, trusting tmp/trust.keys."""
    agents = []
    for k, name in enumerate(names):
        data = write_data(tmp / f"{name}.npz", [0, 1, 2, 3], seed=k)
        command = [
            *EDGE_AGENT, "--broker", broker, "--id", name, "--data", str(data),
            "--state-dir", str(tmp / name), "--trust", str(tmp / "trust.keys"),
        ]  # fmt: skip
        agents.append(processes.spawn(command, tmp / f"{name}.log"))
    return agents


def run_admitted(
    tmp: Path,
    broker: str,
    run_file: Path,
    identity: Path,
    admitted: Path,
    agents: list[subprocess.Popen],
    *flags: str,
) -> subprocess.CompletedProcess[str]:
    """`coordinator run` with the admission list (and `flags`), its report in
    tmp/report.json; the agents are stopped after it."""
    try:
        return subprocess.run(
            [*COORDINATOR, "run", str(run_file), "--broker", broker, "--admitted", str(admitted),
             "--identity", str(identity), "--report", str(tmp / "report.json"), *flags],
            cwd=REPO, capture_output=True, text=True, timeout=180,
        )  # fmt: skip
    finally:
        for process in agents:
            process.terminate()
        for process in agents:
            process.wait(30)


@pytest.mark.slow
def test_coordinator_run_admits_by_key_and_agents_take_runs_only_from_it(
    amqtt_broker, tmp_path: Path, processes: Processes
) -> None:
    """Two admitted devices and a stranger with a key of its own: the run takes the two
    (fedavg: the coordinator aggregates their signed updates); the stranger is never seen."""
    broker = str(amqtt_broker.address)
    identity, admitted = admitted_fleet(tmp_path, ["pi-a", "pi-b"])
    # pi-0 first by id: would be taken
    agents = start_trusting(processes, tmp_path, broker, ["pi-a", "pi-b", "pi-0"])
    run_file = write_run(tmp_path / "run.toml", strategy="fedavg", agents=2, rounds=2,
                         join_timeout=60)  # fmt: skip
    target = ("--target-accuracy", "0")
    result = run_admitted(tmp_path, broker, run_file, identity, admitted, agents, *target)
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["config"]["roster"] == ["pi-a", "pi-b"]
    assert [len(r["agents"]) for r in report["rounds"]] == [2, 2]
    reach = report["summary"]["time_to_target"]  # from the run's start, on the devices' clocks
    assert (reach["target"], reach["given"], reach["round"]) == (0, True, 1), reach
    assert 0 < reach["seconds"] < report["summary"]["wall_seconds"] + 60, reach
    assert "not admitted" in result.stderr, "the stranger's messages were rejected"
    assert not (tmp_path / "pi-0" / "runs").exists()


def test_a_device_that_does_not_trust_the_run_says_so_and_the_run_ends(
    amqtt_broker, tmp_path: Path, processes: Processes
) -> None:
    """A device trusting another coordinator key (a wrong trust file) refuses the run in
    its status, so `coordinator run` ends with the reason instead of waiting for it."""
    broker = str(amqtt_broker.address)
    identity, admitted = tmp_path / "coordinator.pem", tmp_path / "admitted.keys"
    agent_id, public = trust_file(tmp_path, ["pi-w"]).read_text().split()
    subprocess.run([*COORDINATOR, "admit", agent_id, public, "--admitted", str(admitted)],
                   cwd=REPO, check=True, timeout=60)  # fmt: skip
    other = subprocess.run(
        [*COORDINATOR, "key", "--identity", str(tmp_path / "another.pem")],
        cwd=REPO, check=True, capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    (tmp_path / "trust.keys").write_text(other)
    data = write_data(tmp_path / "pi-w.npz", [0, 1, 2, 3])
    command = [
        *EDGE_AGENT, "--broker", broker, "--id", "pi-w", "--data", str(data),
        "--state-dir", str(tmp_path / "pi-w"), "--trust", str(tmp_path / "trust.keys"),
    ]  # fmt: skip
    device = processes.spawn(command, tmp_path / "pi-w.log")
    run_file = write_run(tmp_path / "run.toml", strategy="fedavg", agents=1, rounds=2,
                         join_timeout=60, round_timeout=60)  # fmt: skip
    try:
        result = subprocess.run(
            [*COORDINATOR, "run", str(run_file), "--broker", broker, "--admitted", str(admitted),
             "--identity", str(identity), "--report", str(tmp_path / "report.json")],
            cwd=REPO, capture_output=True, text=True, timeout=100,
        )  # fmt: skip
    finally:
        device.terminate()
        device.wait(30)
    assert result.returncode == 1
    assert "made a new coordinator key" in result.stderr
    assert "pi-w" in result.stderr and "fails its checks" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[run]\nstrategy = 'dadpfl'\n", "give agents = N"),
        ("[run\n", "line 1"),
        ("[run]\nagents = 2\nwire = 'zip'\n", "wire"),
        (
            "[run]\nagents = 2\ndataset = 'device'\ninput_shape = [6]\nclasses = 3\n"
            "model = './nonexist.py:build'\n",
            "nonexist.py:build': no such file",
        ),
    ],
)
def test_coordinator_run_rejects_a_bad_run_file_in_one_line(
    tmp_path: Path, text: str, message: str
) -> None:
    run_file = tmp_path / "run.toml"
    run_file.write_text(text)
    result = subprocess.run(
        [*COORDINATOR, "run", str(run_file), "--broker", "127.0.0.1:9"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and str(run_file) in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("run", "loaded"),
    [
        ("dataset = 'mnist1d'\nstrategy = 'dadpfl'", False),  # only the devices build it
        ("dataset = 'mnist1d'\nstrategy = 'fedavg'", True),  # the aggregate is built here
        ("dataset = 'device'\ninput_shape = [6]\nclasses = 3", True),  # its fingerprint
    ],
)
def test_coordinator_run_loads_the_model_code_only_where_it_builds_the_model(
    tmp_path: Path, run: str, loaded: bool
) -> None:
    from agent.runfile import load_run_file
    from coordinator.gateway import load_for_run

    path = tmp_path / "run.toml"
    path.write_text(f"[run]\nagents = 2\n{run}\nmodel = 'devicepkg.nets:build'\n")
    if not loaded:
        assert load_for_run(load_run_file(path)).config(2).model == "devicepkg.nets:build"
        return
    with pytest.raises(ValueError, match="cannot import devicepkg.nets") as error:
        load_for_run(load_run_file(path))
    assert str(error.value).startswith(f"{path}: ")


def test_coordinator_run_stopped_while_it_waits_for_agents_says_so(
    amqtt_broker, tmp_path: Path, processes: Processes
) -> None:
    """Ctrl-C before the run started is no timeout: the command says it stopped (exit 1, as
    for a run it interrupts), and the run, which never ran, is recorded as cancelled."""
    run_file = tmp_path / "run.toml"
    run_file.write_text("[run]\nagents = 2\nrounds = 1\n")
    runs = ["--runs-dir", str(tmp_path / "runs")]
    log = tmp_path / "run.log"
    run = processes.spawn(
        [*COORDINATOR, "run", str(run_file), "--broker", str(amqtt_broker.address), *runs], log
    )
    wait_for_text(log, "waiting for 2 agents", process=run)
    assert interrupt(run, 30) == 1
    said = log.read_text()
    assert "Error: stopped while waiting for agents, before the run started: 0 of the 2" in said
    assert "within" not in said and "Traceback" not in said, said
    listed = subprocess.run(
        [*COORDINATOR, "runs", *runs, "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert [r["state"] for r in json.loads(listed.stdout)] == ["cancelled"], listed.stdout


def test_a_second_device_with_the_same_id_is_refused_in_one_line(
    amqtt_broker, tmp_path: Path, processes: Processes
) -> None:
    def agent(log: str) -> subprocess.Popen[bytes]:
        command = [*EDGE_AGENT, "--broker", str(amqtt_broker.address), "--id", "raspberrypi"]
        command += ["--state-dir", str(tmp_path / log)]
        return processes.spawn(command, tmp_path / f"{log}.log")

    first = agent("first")
    wait_for_text(tmp_path / "first.log", "joined fleet", process=first)
    second = agent("second")
    assert second.wait(60) == 1
    text = (tmp_path / "second.log").read_text()
    assert "agent id 'raspberrypi' is already in use in fleet 'default'" in text
    assert "Traceback" not in text
    assert first.poll() is None, "the first device keeps its id and its session"
    first.terminate()
    assert first.wait(30) == 0


@pytest.mark.mosquitto
def test_a_broker_certificate_the_ca_does_not_sign_is_explained_in_one_line(
    mosquitto_tls_broker, tmp_path: Path
) -> None:
    broker, _ = mosquitto_tls_broker
    stranger = tmp_path / "stranger.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
        + ["-keyout", str(tmp_path / "stranger-key.pem"), "-out", str(stranger)]
        + ["-subj", "/CN=stranger"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    (tmp_path / "password").write_text("secret\n")
    command = [
        *EDGE_AGENT, "--broker", str(broker.address), "--tls-ca", str(stranger),
        "--username", "alice", "--password-file", str(tmp_path / "password"),
        "--state-dir", str(tmp_path / "state"),
    ]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=90)
    assert result.returncode == 1, result.stderr
    assert f"TLS handshake with {broker.address} failed: CERTIFICATE_VERIFY_FAILED" in result.stderr
    assert "Traceback" not in result.stderr


def forged_members(broker: str, fleet: str, keys: dict[str, MemberKeys], labels: dict) -> list:
    """Admitted members online with a signed idle status whose data description claims
    `labels[member]` (a member bending the run's classes: issue 46)."""
    transports = []
    for member, claimed in labels.items():
        identity = Identity(fleet, member, key=keys[member])
        transport = connect(BrokerAddress.parse(broker), identity, probe_s=0)
        data = {"samples": 200, "shape": [40], "labels": claimed}
        status = messages.Status(fleet=fleet, sender=member, state="idle", metrics={"data": data})
        transport.publish(
            topics.status(fleet, member), messages.encode(status, key=keys[member]), retain=True
        ).wait_for_publish(5)
        transports.append(transport)
    return transports


def test_a_members_absurd_labels_never_build_the_run(
    amqtt_broker, tmp_path: Path, processes: Processes
) -> None:
    """Two admitted members claim labels [0, "x"] (which crashed `coordinator run`) and
    [0, 99999] (which built a 100,000-class run); the run is built from the fleet's own
    labels with the two devices whose data fits, and says why each member was left out."""
    broker = str(amqtt_broker.address)
    identity, admitted = admitted_fleet(tmp_path, ["pi-a", "pi-b"])
    keys = {name: MemberKeys(name, Ed25519PrivateKey.generate()) for name in ("pi-0", "pi-1")}
    for name, key in keys.items():
        add_key(admitted, name, key.public)
    liars = forged_members(broker, "default", keys, {"pi-0": [0, "x"], "pi-1": [0, 99999]})
    agents = start_trusting(processes, tmp_path, broker, ["pi-a", "pi-b"])
    run_file = write_run(tmp_path / "run.toml", strategy="fedavg", agents=2, rounds=1,
                         join_timeout=60)  # fmt: skip
    try:
        result = run_admitted(tmp_path, broker, run_file, identity, admitted, agents)
    finally:
        for transport in liars:
            transport.stop()
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["config"]["roster"] == ["pi-a", "pi-b"]
    assert report["config"]["classes"] == 4
    assert "agent pi-0 cannot join" in result.stderr and "label" in result.stderr
    assert "agent pi-1 cannot join: label 99999" in result.stderr
