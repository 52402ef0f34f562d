"""Discovery over real zeroconf stacks, one per agent, bound to 127.0.0.1 only.

Every stack sends with IP_MULTICAST_IF = 127.0.0.1 from sockets bound to 127.0.0.1 and joins
224.0.0.251 on loopback only, so no packet can leave through a real interface; the last test
checks the kernel's group memberships to prove it. Fleet names are random per run, so runs
sharing the host's loopback do not see each other's agents.
"""

from __future__ import annotations

import logging
import random
import socket
import struct
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from zeroconf import ServiceInfo, Zeroconf

from protocol import AGENT_SERVICE, AgentAdvert, Discovery, ProtocolError

pytestmark = pytest.mark.timeout(60)

LOOPBACK = ["127.0.0.1"]
MDNS_GROUP = "224.0.0.251"
N_AGENTS = 5
BROKER = "127.0.0.1:1883"


def _loopback_multicast_works() -> bool:
    """Send one datagram to the mDNS group over loopback and see whether it comes back."""
    with (
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as rx,
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx,
    ):
        rx.bind(("", 0))
        group = socket.inet_aton(MDNS_GROUP) + socket.inet_aton("127.0.0.1")
        rx.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, group)
        rx.settimeout(1.0)
        tx.bind(("127.0.0.1", 0))
        tx.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton("127.0.0.1"))
        tx.sendto(b"probe", (MDNS_GROUP, rx.getsockname()[1]))
        try:
            return rx.recv(16) == b"probe"
        except TimeoutError:
            return False


def _mdns_members() -> dict[str, int]:
    """Sockets joined to 224.0.0.251 per network device, from /proc/net/igmp."""
    members: dict[str, int] = {}
    device = ""
    group_hex = f"{struct.unpack('<I', socket.inet_aton(MDNS_GROUP))[0]:08X}"
    for line in Path("/proc/net/igmp").read_text().splitlines()[1:]:
        if not line.startswith(("\t", " ")):
            device = line.split()[1]
        elif line.split()[0] == group_hex:
            members[device] = members.get(device, 0) + int(line.split()[1])
    return members


def _until(check: Callable[[], bool], timeout: float) -> float:
    """Poll until `check()` holds; returns the seconds it took, or fails after `timeout`."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            pytest.fail(f"condition not met within {timeout} s")
        time.sleep(0.02)
    return time.monotonic() - start


@pytest.fixture(scope="module")
def igmp_before() -> dict[str, int]:
    if not Path("/proc/net/igmp").exists():
        pytest.skip("needs Linux /proc/net/igmp to check multicast confinement")
    if not _loopback_multicast_works():
        pytest.skip("this host does not loop multicast back over 127.0.0.1 (lo)")
    return _mdns_members()


@pytest.fixture(scope="module")
def fleet(igmp_before: dict[str, int]) -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module")
def agents(fleet: str) -> Iterator[tuple[list[Discovery], float]]:
    """Five agents start at once, as on five devices; yields them and the time until every
    one of them saw the other four."""
    stacks = [Discovery(LOOPBACK) for _ in range(N_AGENTS)]
    try:
        start = time.monotonic()
        with ThreadPoolExecutor(N_AGENTS) as pool:
            adverts = [AgentAdvert(f"a{i}", fleet, BROKER, "x") for i in range(N_AGENTS)]
            list(pool.map(Discovery.advertise_agent, stacks, adverts))
            for stack in stacks:
                stack.wait_for_peers(fleet, N_AGENTS - 1, timeout=10.0)
        yield stacks, time.monotonic() - start
    finally:
        for stack in stacks:
            stack.close()


def test_five_agents_find_each_other_within_5s(
    agents: tuple[list[Discovery], float], fleet: str
) -> None:
    stacks, elapsed = agents
    print(f"5 agents found each other in {elapsed:.2f} s")
    assert elapsed < 5.0
    everyone = {f"a{i}" for i in range(N_AGENTS)}
    for i, stack in enumerate(stacks):
        view = stack.peers(fleet)
        assert set(view) == everyone - {f"a{i}"}
        assert all(a.broker == BROKER and a.proto == 1 for a in view.values())


def test_closed_agent_disappears(agents: tuple[list[Discovery], float], fleet: str) -> None:
    stacks, _ = agents
    leaver = Discovery(LOOPBACK)
    try:
        leaver.advertise_agent(AgentAdvert("leaver", fleet, BROKER, "x"))
        _until(lambda: all("leaver" in s.peers(fleet) for s in stacks), 5.0)
    finally:
        start = time.monotonic()
        leaver.close()
    _until(lambda: not any("leaver" in s.peers(fleet) for s in stacks), 5.0)
    elapsed = time.monotonic() - start
    print(f"closed agent disappeared in {elapsed:.2f} s")
    assert elapsed < 3.0


def test_updated_advert_replaces_the_old_one(
    agents: tuple[list[Discovery], float], fleet: str
) -> None:
    stacks, _ = agents
    stacks[1].advertise_agent(AgentAdvert("a1", fleet, "127.0.0.1:1884", "x"))
    _until(lambda: all(s.peers(fleet)["a1"].broker == "127.0.0.1:1884" for s in stacks[2:]), 5.0)
    assert all(len(s.peers(fleet)) == N_AGENTS - 1 for s in stacks)


def test_broker_advertisement_is_found_and_withdrawn(
    agents: tuple[list[Discovery], float],
) -> None:
    stacks, _ = agents
    broker = ("127.0.0.1", random.randrange(20000, 60000))
    with Discovery(LOOPBACK) as coordinator:
        coordinator.advertise_broker(*broker)
        _until(lambda: all(broker in s.brokers() for s in stacks), 5.0)
    _until(lambda: not any(broker in s.brokers() for s in stacks), 5.0)


def test_peer_of_another_fleet_is_filtered_out(
    agents: tuple[list[Discovery], float], fleet: str
) -> None:
    stacks, _ = agents
    with Discovery(LOOPBACK) as stranger:
        stranger.advertise_agent(AgentAdvert("stranger", f"{fleet}-other", BROKER, "x"))
        _until(lambda: "stranger" in stacks[0].peers(f"{fleet}-other"), 5.0)
        assert all("stranger" not in s.peers(fleet) for s in stacks)
        assert len(stacks[0].peers(fleet)) == N_AGENTS - 1


def _txt(fleet: str, **changes: str | bytes | None) -> dict[str, str | bytes]:
    """A valid agent TXT record with some properties replaced (or removed, with None)."""
    txt = {"id": "b", "fleet": fleet, "broker": BROKER, "profile": "x", "proto": "1", **changes}
    return {key: value for key, value in txt.items() if value is not None}


BAD_TXT = {
    "missing-id": {"id": None},
    "bad-proto": {"proto": "v1"},
    "other-proto": {"proto": "9"},
    "bad-broker": {"broker": "nohost"},
    "bad-id": {"id": "B/#"},
    "not-utf8": {"id": b"\xff\xfe"},
}


def test_malformed_txt_records_are_ignored(
    agents: tuple[list[Discovery], float], fleet: str, caplog: pytest.LogCaptureFixture
) -> None:
    stacks, _ = agents
    caplog.set_level(logging.DEBUG, logger="protocol.discovery")
    infos = [
        ServiceInfo(
            AGENT_SERVICE,
            f"{label}-{fleet}.{AGENT_SERVICE}",
            port=0,
            properties=_txt(fleet, **changes),
            addresses=[socket.inet_aton("127.0.0.1")],
        )
        for label, changes in BAD_TXT.items()
    ]
    rogue = Zeroconf(interfaces=LOOPBACK)
    try:
        with ThreadPoolExecutor(len(infos)) as pool:
            list(pool.map(rogue.register_service, infos))

        def ignored_everywhere() -> bool:
            ignored = [r.getMessage() for r in caplog.records]
            ignored = [message for message in ignored if message.startswith("ignoring")]
            return all(sum(i.name in message for message in ignored) >= N_AGENTS for i in infos)

        _until(ignored_everywhere, 5.0)
        assert all(len(s.peers(fleet)) == N_AGENTS - 1 for s in stacks)
    finally:
        rogue.close()


def test_multicast_stays_on_loopback(
    agents: tuple[list[Discovery], float], igmp_before: dict[str, int]
) -> None:
    """While the stacks run, they are members of the mDNS group on lo and nowhere else."""
    now = _mdns_members()
    assert now.get("lo", 0) >= igmp_before.get("lo", 0) + N_AGENTS
    assert {d: n for d, n in now.items() if d != "lo"} == {
        d: n for d, n in igmp_before.items() if d != "lo"
    }


@pytest.mark.parametrize("interfaces", [[], ["0.0.0.0"], ["::"], ["eth0"], "127.0.0.1"])
def test_interfaces_must_be_explicit_addresses(interfaces: list[str]) -> None:
    with pytest.raises(ValueError):
        Discovery(interfaces)


@pytest.mark.parametrize(
    "txt",
    [
        {},
        {b"id": b"a", b"fleet": b"f", b"broker": b"h:1", b"profile": b"p"},
        {b"id": b"a", b"fleet": b"f", b"broker": b"h:0", b"profile": b"p", b"proto": b"1"},
        {b"id": b"a", b"fleet": b"f", b"broker": b"[zz]:1", b"profile": b"p", b"proto": b"1"},
        {b"id": b"a", b"fleet": b"f", b"broker": b"h:1", b"profile": b"p", b"proto": b"-1"},
        {b"id": b"a", b"fleet": b"f", b"broker": b"h:1", b"profile": b"p", b"proto": None},
        {b"id": b"a", b"fleet": b"F", b"broker": b"h:1", b"profile": b"p", b"proto": b"1"},
    ],
)
def test_bad_txt_is_a_protocol_error(txt: dict[bytes, bytes | None]) -> None:
    with pytest.raises(ProtocolError):
        AgentAdvert.from_txt(txt)


def test_txt_round_trip() -> None:
    advert = AgentAdvert("a-1", "lab", "[::1]:8883", "jetson-nano")
    txt = {k.encode(): v.encode() for k, v in advert.to_txt().items()}
    assert AgentAdvert.from_txt({**txt, b"future": b"ignored"}) == advert
