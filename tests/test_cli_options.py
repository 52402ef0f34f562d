"""The options both programs share: broker connection, logging, console and --version.

A tiny click command wears the decorators, and CliRunner plays the user: flags, environment
variables and config files, and the mistakes a user makes with them.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import io
import json
import logging
import queue
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import pytest
from click.testing import CliRunner, Result
from test_docs_deploy import subcommands

from protocol.cli import (
    BrokerSettings,
    broker_options,
    console,
    log_flags,
    logging_options,
    say,
    setup_logging,
    version_option,
)
from protocol.log_context import agent_scope, bound
from protocol.mqtt import BrokerAddress, MqttTransport, TlsOptions
from protocol.version import PROTOCOL_VERSION

if TYPE_CHECKING:
    from conftest import BrokerProcess

pytestmark = pytest.mark.timeout(60)

CLEAN_ENV = {
    name: None
    for name in (
        "EDGEFL_BROKER",
        "EDGEFL_USERNAME",
        "EDGEFL_PASSWORD",
        "EDGEFL_PASSWORD_FILE",
        "EDGEFL_TLS",
        "EDGEFL_TLS_CA",
        "EDGEFL_TLS_CERT",
        "EDGEFL_TLS_KEY",
        "EDGEFL_CONFIG",
        "EDGEFL_LOG_FORMAT",
    )
}
LONG_LINE = " ".join(f"word{i:03d}" for i in range(25))  # 199 characters, with spaces


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """setup_logging changes the root logger: give the next test the one it had."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    setup_logging(0, "text")
    root.handlers[:], root.level = handlers, level


def probe(seen: list[BrokerSettings]) -> click.Command:
    """A command with the shared options that records its settings and logs a little."""

    @click.command()
    @version_option
    @logging_options
    @broker_options
    def command(broker_settings: BrokerSettings) -> None:
        seen.append(broker_settings)
        logging.getLogger("probe").info("info from the command")
        logging.getLogger("probe").warning("warning from the command")
        say(f"connecting to [bold]{broker_settings}[/]")

    return command


def invoke(args: list[str], env: dict[str, str] | None = None) -> tuple[Result, BrokerSettings]:
    seen: list[BrokerSettings] = []
    result = CliRunner().invoke(probe(seen), args, env={**CLEAN_ENV, **(env or {})})
    assert result.exit_code == 0, result.output
    return result, seen[0]


def settings(args: list[str], env: dict[str, str] | None = None) -> BrokerSettings:
    return invoke(args, env)[1]


def fails(args: list[str], env: dict[str, str] | None = None) -> str:
    """The one error line of a refused invocation (exit status 2, no traceback)."""
    result = CliRunner().invoke(probe([]), args, env={**CLEAN_ENV, **(env or {})})
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.stderr
    return errors[0]


@pytest.fixture(scope="module")
def pems(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two self-signed certificates with their keys (c1/k1, c2/k2) and an encrypted k1."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed (Debian: apt-get install openssl)")
    folder = tmp_path_factory.mktemp("pems")
    for n in (1, 2):
        subprocess.run(
            [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"]
            + ["-nodes", "-days", "1", "-subj", f"/CN=test{n}"]
            + ["-keyout", str(folder / f"k{n}.pem"), "-out", str(folder / f"c{n}.pem")],
            check=True,
            capture_output=True,
            timeout=60,
        )
    subprocess.run(
        [openssl, "ec", "-in", str(folder / "k1.pem"), "-aes256", "-passout", "pass:x"]
        + ["-out", str(folder / "k1-encrypted.pem")],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return folder


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


# -- precedence ------------------------------------------------------------------------------


def test_flag_beats_environment_beats_config_file_beats_default(tmp_path: Path) -> None:
    config = write(tmp_path / "edgefl.toml", '[broker]\nbroker = "file:1001"\nusername = "ann"\n')
    env = {"EDGEFL_BROKER": "env:1002", "EDGEFL_CONFIG": config}
    assert settings([]).address is None
    assert settings(["--config", config]).address == BrokerAddress("file", 1001)
    both = settings([], env)
    assert both.address == BrokerAddress("env", 1002)
    assert both.username == "ann"  # keys the environment does not set still come from the file
    flagged = settings(["--broker", "flag:1003", "--username", "bob"], env)
    assert (flagged.address, flagged.username) == (BrokerAddress("flag", 1003), "bob")


def test_the_port_defaults_to_8883_with_tls_and_1883_without(pems: Path) -> None:
    assert settings(["--broker", "gw"]).address == BrokerAddress("gw", 1883)
    assert settings(["--broker", "gw", "--tls"]).address == BrokerAddress("gw", 8883)
    with_ca = settings(["--broker", "gw"], {"EDGEFL_TLS_CA": str(pems / "c1.pem")})
    assert with_ca.address == BrokerAddress("gw", 8883)
    assert with_ca.tls == TlsOptions(ca_certs=str(pems / "c1.pem"))
    assert settings(["--tls"]).tls == TlsOptions()  # the system's CAs
    assert settings(["--broker", "gw:1884", "--tls"]).address == BrokerAddress("gw", 1884)


def test_client_certificate_and_key_from_a_config_file_relative_to_it(pems: Path) -> None:
    config = write(pems / "edgefl.toml", '[broker]\ntls_cert = "c1.pem"\ntls_key = "k1.pem"\n')
    tls = settings(["--config", config]).tls
    assert tls == TlsOptions(certfile=str(pems / "c1.pem"), keyfile=str(pems / "k1.pem"))


def test_no_tls_on_the_command_line_overrides_the_config_files_tls(pems: Path) -> None:
    config = write(pems / "tls.toml", '[broker]\nbroker = "gw"\ntls_ca = "c1.pem"\n')
    plain = settings(["--config", config, "--no-tls"])
    assert (plain.tls, plain.address) == (None, BrokerAddress("gw", 1883))


# -- password -------------------------------------------------------------------------------


def test_password_from_a_file_or_the_environment_and_never_shown(tmp_path: Path) -> None:
    secret_file = write(tmp_path / "password", "s3cret-from-file\n")
    from_file = settings(["--username", "alice", "--password-file", secret_file])
    assert from_file.password == "s3cret-from-file"
    env = {"EDGEFL_USERNAME": "alice", "EDGEFL_PASSWORD": "s3cret-from-env"}
    result, from_env = invoke(["-v"], env)
    assert from_env.password == "s3cret-from-env"
    assert settings(["--password-file", secret_file], env).password == "s3cret-from-file"
    for shown in (str(from_env), from_env.describe(), repr(from_env), result.output):
        assert "s3cret" not in shown
        assert "alice" in shown
    assert from_env.transport_options("me").password == "s3cret-from-env"


# -- mistakes -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "env", "config", "expected"),
    [
        (["--broker", "gw:70000"], {}, None, "--broker: bad broker port"),
        ([], {"EDGEFL_BROKER": "a:b:c"}, None, "EDGEFL_BROKER: bad broker address"),
        (["--tls-ca", "{dir}/missing.pem"], {}, None, "--tls-ca: cannot read"),
        (["--tls-ca", "{pems}/k1.pem"], {}, None, "no PEM certificate"),
        (["--tls-cert", "{pems}/c1.pem"], {}, None, "--tls-cert: a client certificate needs"),
        ([], {"EDGEFL_TLS_KEY": "{pems}/k1.pem"}, None, "EDGEFL_TLS_KEY: a private key needs"),
        (["--tls-cert", "{pems}/c1.pem", "--tls-key", "{pems}/k2.pem"], {}, None, "mismatch"),
        (
            ["--tls-cert", "{pems}/c1.pem", "--tls-key", "{pems}/k1-encrypted.pem"],
            {},
            None,
            "unencrypted private key",
        ),
        (["--no-tls", "--tls-ca", "{pems}/c1.pem"], {}, None, "--no-tls contradicts --tls-ca"),
        ([], {"EDGEFL_TLS": "maybe"}, None, "EDGEFL_TLS"),
        (["--username", "u", "--password-file", "{dir}/empty"], {}, None, "is empty"),
        ([], {"EDGEFL_PASSWORD": "x"}, None, "EDGEFL_PASSWORD: a password needs a user name"),
        (
            [],
            {"EDGEFL_USERNAME": "u", "EDGEFL_PASSWORD": "x", "EDGEFL_PASSWORD_FILE": "{dir}/empty"},
            None,
            "both EDGEFL_PASSWORD and",
        ),
        (["--config", "{dir}/none.toml"], {}, None, "cannot read config file"),
        ([], {}, "[broker]\ntls_cafile = 'c.pem'\n", "did you mean 'tls_ca'?"),
        ([], {}, "[brokers]\nbroker = 'gw'\n", "unknown table or key 'brokers'"),
        ([], {}, "[broker]\nbroker = gw\n", "(at line 2, column 10)"),
        ([], {}, "[broker]\ntls = 'yes'\n", "[broker] tls: must be true or false"),
        ([], {}, "[broker]\nbroker = 1883\n", "[broker] broker: must be a string"),
        ([], {}, "[broker]\npassword_file = 'nowhere'\n", "[broker] password_file: cannot"),
    ],
)
def test_each_mistake_is_one_line_and_exit_status_2(
    tmp_path: Path,
    pems: Path,
    args: list[str],
    env: dict[str, str],
    config: str | None,
    expected: str,
) -> None:
    (tmp_path / "empty").write_text("\n")
    places = {"dir": tmp_path, "pems": pems}
    args = [arg.format(**places) for arg in args]
    env = {name: value.format(**places) for name, value in env.items()}
    if config is not None:
        env["EDGEFL_CONFIG"] = write(tmp_path / "edgefl.toml", config)
    assert expected in fails(args, env)


# -- logging, console, version --------------------------------------------------------------


def test_json_logs_are_one_object_per_line_messages_included() -> None:
    result, _ = invoke(["-v", "--username", "alice"], {"EDGEFL_LOG_FORMAT": "json"})
    entries = [json.loads(line) for line in result.stderr.splitlines()]
    assert [(e["level"], e["logger"]) for e in entries] == [
        ("INFO", "probe"),
        ("WARNING", "probe"),
        ("INFO", "edgefl"),
    ]
    assert entries[1]["message"] == "warning from the command"
    assert entries[2]["message"] == "connecting to no broker given, user alice"  # no markup
    assert entries[0]["time"].endswith("Z")


def test_json_logs_carry_the_exception() -> None:
    stream = io.StringIO()
    setup_logging(0, "json")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("sys.stderr", stream)
        try:
            1 / 0  # noqa: B018
        except ZeroDivisionError:
            logging.getLogger("probe").exception("division failed")
    (entry,) = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert entry["message"] == "division failed"
    assert "ZeroDivisionError" in entry["exception"]
    assert log_flags() == ["--log-format", "json"]


def test_text_logs_follow_verbosity_and_messages_are_printed() -> None:
    """Outside any agent's scope a line names the program (here `command`)."""
    quiet, _ = invoke([])
    warning = r"\d\d:\d\d:\d\d WARNING command: warning from the command"
    assert re.fullmatch(warning, quiet.stderr.splitlines()[0])
    assert quiet.stderr.splitlines()[1] == "connecting to no broker given"
    chatty, _ = invoke(["-vv"])
    assert " INFO command: info from the command" in chatty.stderr
    assert log_flags() == ["-vv", "--log-format", "text"]


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_an_agents_messages_and_its_threads_lines_name_it(fmt: str) -> None:
    """In an agent's scope a message is a log line too, and a thread it starts through
    `bound` logs in its name, beside another agent of the process."""
    stream = io.StringIO()
    setup_logging(0, fmt)

    def agent(agent_id: str) -> None:
        with agent_scope(agent_id):
            say(f"agent {agent_id} joined")
            worker = threading.Thread(
                target=bound(logging.getLogger("probe").warning),
                args=(f"agent {agent_id}'s thread",),
            )
            worker.start()
            worker.join()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("sys.stderr", stream)
        for agent_id in ("a1", "a2"):
            agent(agent_id)
        logging.getLogger("probe").warning("nobody's")
    lines = stream.getvalue().splitlines()
    if fmt == "json":
        said = [(e["agent"], e["message"]) for e in map(json.loads, lines)]
    else:
        assert all(re.fullmatch(r"\d\d:\d\d:\d\d (INFO|WARNING) \S+: .+", line) for line in lines)
        said = [tuple(line.split(" ", 2)[2].split(": ", 1)) for line in lines]
    assert said[:4] == [
        ("a1", "agent a1 joined"),
        ("a1", "agent a1's thread"),
        ("a2", "agent a2 joined"),
        ("a2", "agent a2's thread"),
    ]
    assert said[4][1] == "nobody's" and said[4][0] not in ("a1", "a2")


def test_console_output_does_not_wrap_when_not_on_a_terminal() -> None:
    out = console(stderr=False)
    stream = io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("sys.stdout", stream)
        out.print(LONG_LINE)
        say(LONG_LINE, out)
    assert stream.getvalue().splitlines() == [LONG_LINE, LONG_LINE]


def test_version_names_the_package_and_protocol_versions() -> None:
    result = CliRunner().invoke(probe([]), ["--version"], prog_name="edge-agent")
    assert result.exit_code == 0
    version = importlib.metadata.version("edgefl-fleet")
    assert result.stdout == f"edge-agent {version} (edgefl protocol {PROTOCOL_VERSION})\n"


# -- a real TLS broker ----------------------------------------------------------------------


def fast(settings: BrokerSettings, client_id: str) -> Any:
    options = settings.transport_options(client_id)
    return dataclasses.replace(options, keepalive_s=5, backoff_min_s=0.1, backoff_max_s=0.5)


@pytest.mark.mosquitto
def test_options_reach_a_tls_broker_with_a_password(
    mosquitto_tls_broker: tuple[BrokerProcess, Path], tmp_path: Path
) -> None:
    broker, ca = mosquitto_tls_broker
    password_file = write(tmp_path / "password", "secret\n")
    args = ["--broker", str(broker.address), "--tls-ca", str(ca), "--username", "alice"]
    good = settings([*args, "--password-file", password_file])
    assert good.address == broker.address
    received: queue.Queue[tuple[str, bytes]] = queue.Queue()
    transport = MqttTransport(good.address or broker.address, fast(good, "cli-options"))
    transport.subscribe("t/#", lambda topic, payload: received.put((topic, payload)))
    transport.start()
    try:
        assert transport.wait_subscribed(10)
        assert transport.publish("t/hello", b"over tls").wait_for_publish(10)
        assert received.get(timeout=10) == ("t/hello", b"over tls")
    finally:
        transport.stop()
    wrong = settings(args, {"EDGEFL_PASSWORD": "not-the-secret"})
    refused = MqttTransport(broker.address, fast(wrong, "cli-options-wrong"))
    refused.start()
    try:
        assert not refused.wait_connected(2.0)
    finally:
        refused.stop()


def test_no_command_has_two_parameters_of_one_name() -> None:
    """Two parameters of one name overwrite each other's value (click only warns): `coordinator
    run RUN_FILE` once also took simulate's --run."""
    import click

    from agent.cli import main as edge_agent
    from coordinator.cli import main as coordinator

    for group in (coordinator, edge_agent):
        commands = [group, *subcommands(group).values()]
        for command in commands:
            names = [p.name for p in command.params]
            duplicated = {n for n in names if names.count(n) > 1}
            assert not duplicated, f"{command.name}: {sorted(duplicated)}"
            assert isinstance(command, click.Command)
