"""The dashboard as `coordinator serve --http` serves it: its token never on a command line,
and only requests that name the dashboard's own address (no DNS rebinding)."""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
from pathlib import Path

import pytest
from test_cli import COORDINATOR, REPO

from coordinator.dashboard.app import allowed_names
from tests.processes import Processes, wait_for_text

TOKEN = "dash-Token_0123456789"


def get(port: int, path: str, host: str, token: str | None = None) -> int:
    """The status of GET `path` from 127.0.0.1:`port` with this Host header (and token)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    headers = {"Host": host} | ({"Authorization": f"Bearer {token}"} if token else {})
    try:
        connection.request("GET", path, headers=headers)
        return connection.getresponse().status
    finally:
        connection.close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def serving(
    tmp_path: Path, request: pytest.FixtureRequest, processes: Processes
) -> tuple[int, int]:
    """`coordinator serve` on loopback with --http on HOST (the test's parameter) and the
    token in a file; (broker port, dashboard port)."""
    http_host, token_from = request.param
    broker, web = free_port(), free_port()
    (tmp_path / "token").write_text(TOKEN + "\n")
    command = [*COORDINATOR, "serve", "--port", str(broker), "--http", f"{http_host}:{web}"]
    env = dict(os.environ)
    if token_from == "file":
        command += ["--http-token-file", str(tmp_path / "token")]
    else:
        env["EDGEFL_HTTP_TOKEN"] = TOKEN
    log = tmp_path / "serve.log"
    serve = processes.spawn(command, log, env=env)
    wait_for_text(log, "dashboard on", process=serve)
    return serve.pid, web


@pytest.mark.parametrize("serving", [("127.0.0.1", "file")], indirect=True)
def test_a_loopback_dashboard_refuses_a_rebound_host_name(serving: tuple[int, int]) -> None:
    pid, port = serving
    for host in (f"127.0.0.1:{port}", "127.0.0.1", f"localhost:{port}", "LOCALHOST"):
        assert get(port, "/api/fleet", host, TOKEN) == 200, host
    # A page from attacker.example whose name now resolves to 127.0.0.1 sends its own name.
    for host in (f"attacker.example:{port}", "attacker.example", f"10.1.2.3:{port}", ""):
        assert get(port, "/api/fleet", host, TOKEN) == 400, host
    assert get(port, "/api/fleet", f"127.0.0.1:{port}") == 401, "the token is needed"
    assert TOKEN not in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")


@pytest.mark.parametrize("serving", [("0.0.0.0", "environment")], indirect=True)
def test_a_dashboard_on_every_address_takes_its_token_from_the_environment(
    serving: tuple[int, int],
) -> None:
    pid, port = serving
    assert get(port, "/metrics", f"127.0.0.1:{port}", TOKEN) == 200
    assert get(port, "/metrics", f"192.168.1.10:{port}", TOKEN) == 200, "an address is no name"
    assert get(port, "/metrics", f"{os.uname().nodename}:{port}", TOKEN) == 200
    assert get(port, "/metrics", f"attacker.example:{port}", TOKEN) == 400
    assert get(port, "/metrics", f"127.0.0.1:{port}", "wrong") == 401
    assert TOKEN not in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")


def test_a_token_on_the_command_line_is_a_one_line_error() -> None:
    result = subprocess.run(
        [*COORDINATOR, "serve", "--port", str(free_port()), "--http", "0", "--http-token", TOKEN],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert "--http-token-file" in result.stderr and "EDGEFL_HTTP_TOKEN" in result.stderr
    assert "ps" in result.stderr


def test_an_unreadable_token_file_is_a_one_line_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-token"
    result = subprocess.run(
        [*COORDINATOR, "serve", "--http", "0", "--http-token-file", str(missing)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert str(missing) in result.stderr and "Traceback" not in result.stderr


def test_the_names_a_dashboard_answers_to() -> None:
    assert allowed_names("192.168.1.10") == {"192.168.1.10"}
    assert {"localhost", "127.0.0.1", "::1"} <= allowed_names("127.0.0.1")
    assert "localhost" not in allowed_names("192.168.1.10")
