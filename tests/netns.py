"""An emulated LAN of hosts in Linux network namespaces, for multi-host acceptance tests.

A gateway and a few devices each get their own network stack (own loopback, own `eth0`, own
address), joined by a bridge in a "switch" namespace, so brokers, agents and mDNS talk across
real interfaces as on a LAN, yet nothing leaves the machine: no namespace has a default route
or any link to the machine's own network.

Processes started with `ip netns exec` share this machine's filesystem, /etc and Python; only
their network differs (`127.0.0.1` is the host namespace's own loopback).

Namespace names carry the creating process id and a random token, so parallel runs never
collide, and namespaces left behind by a run that died (its process is gone) are removed
before a new LAN is built.

    skip_unless_netns()
    with Lan(["gw", "d1"]) as lan:
        lan.popen("gw", [sys.executable, "-m", "coordinator.broker", "--host", "0.0.0.0"], log=p)
        assert lan.reachable("d1", lan.address("gw"), 1883, timeout_s=15)
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import ipaddress
import itertools
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

import pytest

PREFIX = "edgefl-lan"
_OWNED = re.compile(rf"^{PREFIX}-(\d+)-[0-9a-f]+(-|$)")
_HOST_NAME = re.compile(r"^[a-z][a-z0-9-]{0,31}$")
_STOP_GRACE_S = 3.0

_CONNECT_SCRIPT = """
import socket, sys, time
address, port = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + float(sys.argv[3])
while (left := deadline - time.monotonic()) > 0:
    try:
        socket.create_connection((address, port), left).close()
        sys.exit(0)
    except OSError:
        time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
sys.exit(1)
"""


def _ip_binary() -> str | None:
    """`ip` lives in /usr/sbin, which a non-login PATH may lack."""
    return shutil.which("ip") or next(
        (p for p in ("/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip") if os.access(p, os.X_OK)), None
    )


def _require_ip() -> str:
    binary = _ip_binary()
    if binary is None:
        raise RuntimeError("the `ip` command (iproute2) is not installed")
    return binary


def _ip(*args: str) -> str:
    """Run `ip ARGS`; a failure raises RuntimeError naming the command and ip's message."""
    result = subprocess.run([_require_ip(), *args], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result.stdout


def list_namespaces() -> list[str]:
    """Names of all named network namespaces (`ip netns list` prints `name (id: N)`)."""
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_inside(namespace: str) -> None:
    """SIGKILL whatever still runs in `namespace`: a namespace with processes in it outlives
    `ip netns del` (only its name goes), and with it the LAN's links."""
    try:
        pids = [int(pid) for pid in _ip("netns", "pids", namespace).split()]
    except RuntimeError:
        return
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _delete(namespace: str) -> None:
    _kill_inside(namespace)
    try:
        _ip("netns", "del", namespace)
    except RuntimeError:
        if namespace in list_namespaces():
            raise


def remove_leftovers() -> list[str]:
    """Delete namespaces of LANs whose creating process is gone (a crashed or killed run);
    returns their names. Namespaces of live processes, ours included, are left alone."""
    removed = []
    for namespace in list_namespaces():
        match = _OWNED.match(namespace)
        if match and not _alive(int(match.group(1))):
            _delete(namespace)
            removed.append(namespace)
    return removed


@functools.cache
def _netns_unavailable() -> str | None:
    """Why network namespaces cannot be used here, or None; probed once per session by
    creating and deleting one, since root alone does not guarantee it (containers)."""
    if _ip_binary() is None:
        return "network namespace tests need the `ip` command (Debian: apt-get install iproute2)"
    if os.geteuid() != 0:
        return "network namespace tests need root (ip netns add)"
    probe = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}-probe"
    try:
        _ip("netns", "add", probe)
        _ip("netns", "del", probe)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        return f"cannot create network namespaces here: {exc}"
    return None


def skip_unless_netns() -> None:
    """Skip the calling test, with the reason, where network namespaces cannot be created."""
    reason = _netns_unavailable()
    if reason is not None:
        pytest.skip(reason)


def _check_hosts(hosts: Sequence[str]) -> list[str]:
    if isinstance(hosts, str) or not hosts:
        raise ValueError("hosts must be a non-empty list of host names")
    for host in hosts:
        if not isinstance(host, str) or not _HOST_NAME.match(host):
            raise ValueError(f"host name {host!r} must match {_HOST_NAME.pattern}")
    if len(set(hosts)) != len(hosts):
        raise ValueError(f"host names must be unique, got {list(hosts)}")
    return list(hosts)


def _addresses(subnet: str, count: int) -> list[ipaddress.IPv4Interface]:
    """The first `count` host addresses of `subnet` (.1, .2, ...), with its prefix length."""
    network = ipaddress.ip_network(subnet)
    if not isinstance(network, ipaddress.IPv4Network):
        raise ValueError(f"subnet {subnet!r} must be IPv4 (mDNS here uses 224.0.0.251)")
    addresses = list(itertools.islice(network.hosts(), count))
    if len(addresses) < count:
        raise ValueError(f"subnet {subnet!r} has room for fewer than {count} hosts")
    return [ipaddress.IPv4Interface(f"{a}/{network.prefixlen}") for a in addresses]


class Lan:
    """Hosts on one emulated Ethernet segment; a context manager that removes everything
    (processes, namespaces, links) on exit, on an exception, and at interpreter exit.

    Host i has `eth0` with the subnet's (i+1)-th address, a multicast route for mDNS and no
    default route; its cable is the veth `port<i>` on the switch namespace's bridge.
    """

    def __init__(self, hosts: Sequence[str], subnet: str = "10.203.7.0/24") -> None:
        self.hosts = _check_hosts(hosts)
        self._interfaces = dict(zip(self.hosts, _addresses(subnet, len(self.hosts)), strict=True))
        base = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"
        self.switch = base
        self.namespaces = {host: f"{base}-{host}" for host in self.hosts}
        self._processes: list[subprocess.Popen[bytes]] = []
        self._created: list[str] = []

    def __enter__(self) -> Lan:
        remove_leftovers()
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def namespace(self, host: str) -> str:
        """The network namespace of `host` (for `ip -n` or `ip netns exec`)."""
        if host not in self.namespaces:
            raise ValueError(f"unknown host {host!r}; this LAN has {self.hosts}")
        return self.namespaces[host]

    def address(self, host: str) -> str:
        """The IPv4 address of `host` on the LAN, e.g. 10.203.7.1 for the first host."""
        self.namespace(host)
        return str(self._interfaces[host].ip)

    def popen(
        self,
        host: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        log: Path,
    ) -> subprocess.Popen[bytes]:
        """Start `argv` in `host`, stdout and stderr appended to `log`; `env` adds to (does
        not replace) this process's environment. It runs in its own process group, killed
        on exit."""
        command = [_require_ip(), "netns", "exec", self.namespace(host), *argv]
        with open(log, "ab") as out:
            process = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **env} if env is not None else None,
                start_new_session=True,
            )
        self._processes.append(process)
        return process

    def run(
        self, host: str, argv: Sequence[str], timeout: float
    ) -> subprocess.CompletedProcess[str]:
        """Run `argv` in `host` to completion (killed after `timeout` s, raising
        subprocess.TimeoutExpired); output is captured as text, the exit status not checked."""
        command = [_require_ip(), "netns", "exec", self.namespace(host), *argv]
        return subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )

    def reachable(self, host: str, address: str, port: int, timeout_s: float) -> bool:
        """Whether a TCP connection from `host` to address:port succeeds within timeout_s;
        refused attempts are retried, so this also waits for a server to start listening."""
        argv = [sys.executable, "-c", _CONNECT_SCRIPT, address, str(port), str(timeout_s)]
        return self.run(host, argv, timeout=timeout_s + 10).returncode == 0

    def link(self, host: str, up: bool) -> None:
        """Plug or unplug `host`'s cable: its switch port goes up or down.

        The switch side, not `eth0`: the host keeps its address and routes (including the
        multicast route, which `eth0` going down would delete), and its traffic silently
        vanishes as with a pulled cable, instead of failing at once with "unreachable".
        """
        self.namespace(host)  # rejects an unknown host
        state = "up" if up else "down"
        _ip("-n", self.switch, "link", "set", f"port{self.hosts.index(host)}", state)

    def kill(self, process: subprocess.Popen[bytes]) -> int:
        """Stop `process` and its process group: SIGTERM, then SIGKILL after a grace period;
        returns its exit status."""
        if process.poll() is None:
            self._signal_group(process, signal.SIGTERM)
        return self._reap(process)

    def _reap(self, process: subprocess.Popen[bytes]) -> int:
        """Wait out a process told to stop, SIGKILL it after the grace period; its status."""
        try:
            process.wait(_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self._signal_group(process, signal.SIGKILL)
            process.wait(_STOP_GRACE_S)
        if process in self._processes:
            self._processes.remove(process)
        return process.returncode

    def close(self) -> None:
        """Kill every process started here and delete the namespaces; safe to call twice.
        Every process is told to stop before any is waited for: they stop together (each
        agent takes about a second to shut down, and a test may leave seven running)."""
        for process in self._processes:
            if process.poll() is None:
                self._signal_group(process, signal.SIGTERM)
        for process in list(self._processes):
            self._reap(process)
        errors = []
        for namespace in reversed(self._created):
            try:
                _delete(namespace)
            except RuntimeError as exc:
                errors.append(exc)
        self._created.clear()
        atexit.unregister(self.close)
        if errors:
            raise errors[0]

    def _build(self) -> None:
        self._add_namespace(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge", "mcast_snooping", "0")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for index, host in enumerate(self.hosts):
            self._add_host(index, host)

    def _add_host(self, index: int, host: str) -> None:
        namespace, port = self.namespaces[host], f"port{index}"
        self._add_namespace(namespace)
        _ip(
            "-n",
            self.switch,
            "link",
            "add",
            port,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            namespace,
        )
        _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
        _ip("-n", namespace, "addr", "add", str(self._interfaces[host]), "dev", "eth0")
        _ip("-n", namespace, "link", "set", "eth0", "up")
        # zeroconf sends to 224.0.0.251 via the bound address's interface; without a route
        # for multicast (there is no default route) sending fails with "unreachable".
        _ip("-n", namespace, "route", "add", "224.0.0.0/4", "dev", "eth0")

    def _add_namespace(self, namespace: str) -> None:
        _ip("netns", "add", namespace)
        self._created.append(namespace)
        _ip("-n", namespace, "link", "set", "lo", "up")

    @staticmethod
    def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
