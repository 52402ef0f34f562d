"""Discovery over real zeroconf stacks, one per agent, bound to 127.0.0.1 only.

Every stack sends with IP_MULTICAST_IF = 127.0.0.1 from sockets bound to 127.0.0.1 and joins
224.0.0.251 on loopback only, so no packet can leave through a real interface; the last test
checks the kernel's group memberships to prove it. Fleet names are random per run, so runs
sharing the host's loopback do not see each other's agents.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import shutil
import socket
import struct
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from zeroconf import ServiceInfo, Zeroconf

from protocol import AGENT_SERVICE, PROTOCOL_VERSION, AgentAdvert, Discovery, ProtocolError
from protocol.discovery import BrokerAdvert, choose_broker, discover_broker

pytestmark = pytest.mark.timeout(60)

LOOPBACK = ["127.0.0.1"]
MDNS_GROUP = "224.0.0.251"
N_AGENTS = 5
BROKER = "127.0.0.1:1883"

PROTO = str(PROTOCOL_VERSION).encode()
"""The protocol version as a TXT record carries it."""


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
        assert all(a.broker == BROKER and a.proto == PROTOCOL_VERSION for a in view.values())


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
    txt = {
        "id": "b",
        "fleet": fleet,
        "broker": BROKER,
        "profile": "x",
        "proto": PROTO.decode(),
        **changes,
    }
    return {key: value for key, value in txt.items() if value is not None}


BAD_TXT: dict[str, dict[str, str | bytes | None]] = {
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
        {b"id": b"a", b"fleet": b"f", b"broker": b"h:0", b"profile": b"p", b"proto": PROTO},
        {b"id": b"a", b"fleet": b"f", b"broker": b"[zz]:1", b"profile": b"p", b"proto": PROTO},
        {b"id": b"a", b"fleet": b"f", b"broker": b"h:1", b"profile": b"p", b"proto": b"-1"},
        {b"id": b"a", b"fleet": b"f", b"broker": b"h:1", b"profile": b"p", b"proto": None},
        {b"id": b"a", b"fleet": b"F", b"broker": b"h:1", b"profile": b"p", b"proto": PROTO},
    ],
)
def test_bad_txt_is_a_protocol_error(txt: dict[bytes, bytes | None]) -> None:
    with pytest.raises(ProtocolError):
        AgentAdvert.from_txt(txt)


def test_txt_round_trip() -> None:
    advert = AgentAdvert("a-1", "lab", "[::1]:8883", "jetson-nano")
    txt = {k.encode(): v.encode() for k, v in advert.to_txt().items()}
    assert AgentAdvert.from_txt({**txt, b"future": b"ignored"}) == advert


def test_interface_that_is_not_an_address_of_this_host_is_refused() -> None:
    with pytest.raises(ValueError, match="'198.51.100.77' is not an IP address of this host"):
        Discovery(["198.51.100.77"])  # TEST-NET-2: never assigned to a real interface


@pytest.fixture(scope="module")
def coordinators(fleet: str) -> Iterator[dict[str, BrokerAdvert]]:
    """Brokers announced for another fleet (on the lowest port, so a naive choice takes it),
    for any fleet, and for `fleet` over TLS; yields what each announced, by role."""
    port = random.randrange(20000, 60000)
    wanted = {
        "other": BrokerAdvert("127.0.0.1", port, fleets=(f"{fleet}-other",)),
        "any": BrokerAdvert("127.0.0.1", port + 1),
        "ours": BrokerAdvert("127.0.0.1", port + 2, tls=True, fleets=(fleet,)),
    }
    stacks = [Discovery(LOOPBACK) for _ in wanted]

    def announce(stack: Discovery, advert: BrokerAdvert) -> None:
        stack.advertise_broker(advert.host, advert.port, fleets=advert.fleets, tls=advert.tls)

    try:
        with ThreadPoolExecutor(len(wanted)) as pool:
            list(pool.map(announce, stacks, wanted.values()))
        yield wanted
    finally:
        for stack in stacks:
            stack.close()


def _same_broker(found: BrokerAdvert | None, expected: BrokerAdvert) -> bool:
    """Equal but for the instance name, which zeroconf may have changed on a conflict."""
    return found is not None and dataclasses.replace(found, name="") == expected


def test_agent_finds_the_tls_broker_announced_for_its_fleet(
    agents: tuple[list[Discovery], float], coordinators: dict[str, BrokerAdvert], fleet: str
) -> None:
    stacks, _ = agents
    start = time.monotonic()
    found = stacks[0].find_broker(fleet, timeout=5.0)
    assert _same_broker(found, coordinators["ours"]), found
    assert found is not None and found.name.startswith("edgefl-broker-127.0.0.1-")
    assert time.monotonic() - start < 4.0  # an explicit match returns without settling
    other = stacks[1].find_broker(f"{fleet}-other", timeout=5.0)
    assert _same_broker(other, coordinators["other"]), other


def test_broker_of_another_fleet_is_not_chosen(
    agents: tuple[list[Discovery], float], coordinators: dict[str, BrokerAdvert], fleet: str
) -> None:
    stacks, _ = agents
    _until(lambda: coordinators["any"] in _seen(stacks[2]), 5.0)
    found = stacks[2].find_broker(f"{fleet}-third", timeout=5.0)
    # Another run on this host may announce an any-fleet broker too: which one is chosen
    # then depends on ports, but it is never the broker of another fleet.
    assert found is not None and found.edgefl and found.fleets == (), found


def _seen(stack: Discovery) -> list[BrokerAdvert]:
    """The adverts a stack sees, without their instance names."""
    return [dataclasses.replace(a, name="") for a in stack.broker_adverts()]


def test_discover_broker_opens_browses_and_closes(
    coordinators: dict[str, BrokerAdvert], fleet: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ours, though the any-fleet broker may answer first. On a LAN the better answer comes
    within SETTLE_S; on a loaded test machine full of loopback responders it may take
    longer, which made this test fail now and then: it waits longer for it here."""
    monkeypatch.setattr("protocol.discovery.SETTLE_S", 4.0)
    found = discover_broker(fleet, LOOPBACK, timeout=8.0)
    assert _same_broker(found, coordinators["ours"]), found


def test_agents_lists_the_adverts_of_every_fleet(
    agents: tuple[list[Discovery], float], fleet: str
) -> None:
    stacks, _ = agents
    strangers = [Discovery(LOOPBACK), Discovery(LOOPBACK)]
    adverts = [AgentAdvert("s", f"{fleet}-{i}", BROKER, "") for i in range(len(strangers))]
    try:
        with ThreadPoolExecutor(len(strangers)) as pool:
            list(pool.map(Discovery.advertise_agent, strangers, adverts))
        expected = {(fleet, f"a{i}") for i in range(N_AGENTS)} | {(a.fleet, "s") for a in adverts}
        _until(lambda: expected <= set(stacks[0].agents()), 5.0)
        view = stacks[0].agents()
        assert all(view[(a.fleet, "s")] == a for a in adverts)
        assert set(stacks[0].peers(fleet)) == {f"a{i}" for i in range(1, N_AGENTS)}
    finally:
        for stranger in strangers:
            stranger.close()


_NAMESPACE_SCRIPT = textwrap.dedent(
    """
    import json, socket, time
    from concurrent.futures import ThreadPoolExecutor
    from zeroconf import ServiceInfo, Zeroconf
    from protocol.discovery import BROKER_SERVICE, Discovery, discover_broker

    LO = ["127.0.0.1"]

    def timed(timeout):
        start = time.monotonic()
        found = discover_broker("lab", LO, timeout=timeout)
        return {"found": found and [found.port, found.edgefl], "s": time.monotonic() - start}

    results = {"nothing": timed(0.5)}
    mosquitto = Zeroconf(interfaces=LO)  # as avahi announces it: no TXT properties
    info = ServiceInfo(
        BROKER_SERVICE, "Mosquitto." + BROKER_SERVICE, port=1883,
        addresses=[socket.inet_aton("127.0.0.1")],
    )
    with Discovery(LO) as coordinator, ThreadPoolExecutor(2) as pool:
        done = [
            pool.submit(mosquitto.register_service, info),
            pool.submit(coordinator.advertise_broker, "127.0.0.1", 1884, fleets=["other"]),
        ]
        [future.result() for future in done]
        results["other_fleet_and_mosquitto"] = timed(1.0)
    results["mosquitto_only"] = timed(3.0)
    mosquitto.close()
    print(json.dumps(results))
    """
)


def test_broker_choice_in_a_private_network_namespace() -> None:
    """Runs where no other broker can be announced: alone on the loopback of a user and
    network namespace that ends with the process."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs unshare and ip (util-linux, iproute2) to create a network namespace")
    if subprocess.run(["unshare", "-rn", "true"], capture_output=True, timeout=60).returncode != 0:
        pytest.skip("this host does not allow unprivileged user and network namespaces")
    command = ["unshare", "-rn", "sh", "-c", 'ip link set lo up && exec "$0" -c "$1"']
    done = subprocess.run(
        [*command, sys.executable, _NAMESPACE_SCRIPT],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    assert results["nothing"]["found"] is None
    assert 0.5 <= results["nothing"]["s"] < 2.0
    # An edgefl coordinator is on the LAN, for another fleet: mosquitto is not a fallback.
    assert results["other_fleet_and_mosquitto"]["found"] is None
    # No coordinator at all: the plain mosquitto announced by avahi is used.
    assert results["mosquitto_only"]["found"] == [1883, False]


LAB = "lab"
OTHER = BrokerAdvert("10.0.0.1", 1883, fleets=("other",))
ANY = BrokerAdvert("10.0.0.3", 1883)
OURS = BrokerAdvert("10.0.0.4", 8883, tls=True, fleets=(LAB, "other"))
FOREIGN = BrokerAdvert("10.0.0.0", 1883, edgefl=False)


@pytest.mark.parametrize(
    ("adverts", "expected"),
    [
        ([OTHER, ANY, OURS, FOREIGN], OURS),
        ([OTHER, ANY, FOREIGN], ANY),
        ([OTHER, FOREIGN], None),
        ([FOREIGN], FOREIGN),
        ([], None),
    ],
)
def test_choose_broker_prefers_the_fleet_then_any_fleet_then_another_product(
    adverts: list[BrokerAdvert], expected: BrokerAdvert | None
) -> None:
    assert choose_broker(adverts, LAB) == expected
    assert choose_broker(reversed(adverts), LAB) == expected


def test_choose_broker_is_the_same_for_every_agent() -> None:
    candidates = [
        BrokerAdvert("fd00::1", 1883, fleets=(LAB,)),
        BrokerAdvert("10.0.0.9", 1884, fleets=(LAB,)),
        BrokerAdvert("10.0.0.9", 1883, fleets=(LAB,), name="b"),
        BrokerAdvert("10.0.0.9", 1883, fleets=(LAB,), name="a"),
    ]
    first = candidates[-1]  # IPv4 before IPv6, then lowest address, port, name
    for _ in range(10):
        random.shuffle(candidates)
        assert choose_broker(candidates, LAB) == first


def test_broker_txt_round_trip() -> None:
    advert = BrokerAdvert("fd00::1", 8883, tls=True, fleets=("a", "b"), name="gw")
    txt = {k.encode(): v.encode() for k, v in advert.to_txt().items()}
    assert txt[b"fleets"] == b"a,b" and txt[b"product"] == b"edgefl"
    assert BrokerAdvert.from_txt("fd00::1", 8883, "gw", {**txt, b"future": b"x"}) == advert
    plain = BrokerAdvert.from_txt("10.0.0.2", 1883, "Mosquitto", {})
    assert plain == BrokerAdvert("10.0.0.2", 1883, name="Mosquitto", edgefl=False)


_EDGEFL_TXT = {
    b"txtvers": b"1",
    b"product": b"edgefl",
    b"proto": PROTO,
    b"fleets": b"",
    b"tls": b"0",
}


@pytest.mark.parametrize(
    "changes",
    [
        {b"txtvers": b"2"},
        {b"proto": b"9"},
        {b"proto": None},
        {b"tls": b"yes"},
        {b"fleets": b"lab,Lab"},
        {b"fleets": b"\xff"},
    ],
)
def test_bad_broker_txt_is_a_protocol_error(changes: dict[bytes, bytes | None]) -> None:
    with pytest.raises(ProtocolError):
        BrokerAdvert.from_txt("10.0.0.2", 1883, "gw", {**_EDGEFL_TXT, **changes})


def test_advertise_broker_rejects_bad_arguments(igmp_before: dict[str, int]) -> None:
    with Discovery(LOOPBACK) as coordinator:
        with pytest.raises(ValueError, match="must be an IP address"):
            coordinator.advertise_broker("gateway.local", 1883)
        with pytest.raises(ValueError, match="list of fleet names"):
            coordinator.advertise_broker("127.0.0.1", 1883, fleets="lab")
        with pytest.raises(ValueError, match="invalid fleet"):
            coordinator.advertise_broker("127.0.0.1", 1883, fleets=["Lab"])
        with pytest.raises(ValueError, match="longer than 255 bytes"):
            coordinator.advertise_broker("127.0.0.1", 1883, fleets=[f"f{i:03}" for i in range(80)])
