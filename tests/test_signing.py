"""Per-member keys: a member signs only as itself, receivers check before decoding, runs
come only from trusted members, and the key files and commands give one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.cli import main as edge_agent
from coordinator.cli import main as coordinator
from protocol import PROTOCOL_VERSION, topics
from protocol import messages as m
from protocol.errors import ProtocolError
from protocol.membership import PresenceClock
from protocol.signing import (
    FleetKey,
    MemberKeys,
    add_key,
    key_line,
    load_or_create_private,
    member_keys,
    public_text,
    read_keys,
    signer_for_run,
)

FLEET = "lab"


def keys_of(*members: str) -> dict[str, Ed25519PrivateKey]:
    return {member: Ed25519PrivateKey.generate() for member in members}


def signer(me: str, private: dict[str, Ed25519PrivateKey], **kwargs: object) -> MemberKeys:
    known = {member: key.public_key() for member, key in private.items()}
    return MemberKeys(me, private[me], known, **kwargs)  # type: ignore[arg-type]


def vote(sender: str, round_: int = 1, run_id: str = "r1") -> m.Vote:
    return m.Vote(fleet=FLEET, sender=sender, run_id=run_id, round=round_, vote=True, score=0.5)


def test_a_member_signs_as_itself_and_no_member_can_sign_as_another() -> None:
    private = keys_of("a", "b", "c")
    a, c = signer("a", private), signer("c", private)
    assert m.decode(m.encode(vote("a"), key=a), key=c) == vote("a")
    with pytest.raises(ProtocolError, match="bad signature for sender 'b'"):
        m.decode(m.encode(vote("b"), key=a), key=c)  # a member of the fleet forging b
    outsider = MemberKeys("x", Ed25519PrivateKey.generate())
    with pytest.raises(ProtocolError, match="'x' is not admitted"):
        m.decode(m.encode(vote("x"), key=outsider), key=c)
    with pytest.raises(ProtocolError, match="not signed"):
        m.decode(m.encode(vote("a")), key=c)
    with pytest.raises(ProtocolError, match="not signed"):  # a fleet key's shorter HMAC
        m.decode(m.encode(vote("a"), key=FleetKey(b"k" * 32)), key=c)
    tampered = bytearray(m.encode(vote("a"), key=a))
    tampered[-70] ^= 1
    with pytest.raises(ProtocolError, match="bad signature"):
        m.decode(bytes(tampered), key=c)


def test_a_bad_signature_is_rejected_before_anything_is_unpacked(monkeypatch) -> None:
    private = keys_of("a", "b")
    forged = m.Model(fleet=FLEET, sender="b", round=1, tensors=b"\0" * (8 << 20), num_samples=1)
    data = m.encode(forged, key=signer("a", private))

    def unpack(*_: object) -> None:
        raise AssertionError("a forged message was unpacked")

    monkeypatch.setattr(m, "_unpack", unpack)
    with pytest.raises(ProtocolError, match="bad signature for sender 'b'"):
        m.decode(data, key=signer("b", private))
    with pytest.raises(ProtocolError, match="malformed message header"):
        header = bytes([0x98, PROTOCOL_VERSION])  # an envelope of 8 items, this version
        m.decode(header + b"\xc4\x40" + b"\0" * 64, key=signer("b", private))


def test_a_message_replayed_on_another_topic_or_run_does_not_pass() -> None:
    private = keys_of("a", "b")
    data = m.encode(vote("a", round_=1), key=signer("a", private))
    on_its_topic = topics.round_topic(FLEET, 1, "vote", "a")
    assert m.decode_on_topic(on_its_topic, data, "vote", FLEET, signer("b", private)).round == 1
    for topic in (
        topics.round_topic(FLEET, 2, "vote", "a"),
        topics.round_topic(FLEET, 1, "vote", "b"),
    ):
        with pytest.raises(ProtocolError, match="does not match its topic"):
            m.decode_on_topic(topic, data, "vote", FLEET, signer("b", private))


def test_runs_come_only_from_trusted_members_and_list_the_roster_keys() -> None:
    private = keys_of("coordinator", "a", "b")
    coordinator_keys = signer("coordinator", private)
    agent = MemberKeys(
        "a",
        private["a"],
        {"coordinator": private["coordinator"].public_key()},
        runners=frozenset({"coordinator"}),
    )
    run = m.RunConfig(
        fleet=FLEET,
        sender="coordinator",
        run_id="r1",
        roster=["a", "b"],
        seed=1,
        keys=coordinator_keys.roster_keys(["a", "b"]),
    )
    received = m.decode(m.encode(run, key=coordinator_keys), key=agent)
    for_run = signer_for_run(agent, received)
    assert m.decode(m.encode(vote("b"), key=signer("b", private)), key=for_run) == vote("b")
    with pytest.raises(ProtocolError, match="not admitted"):  # b only exists for the run
        m.decode(m.encode(vote("b"), key=signer("b", private)), key=agent)
    self_made = m.RunConfig(fleet=FLEET, sender="b", run_id="r2", roster=["a", "b"], seed=1)
    with pytest.raises(ProtocolError, match="does not trust to start runs"):
        signer_for_run(agent, self_made)
    lying = m.RunConfig(
        fleet=FLEET,
        sender="coordinator",
        run_id="r3",
        roster=["a"],
        seed=1,
        keys={"a": public_text(Ed25519PrivateKey.generate().public_key())},
    )
    with pytest.raises(ProtocolError, match="another key for 'a'"):
        signer_for_run(agent, lying)
    with pytest.raises(ProtocolError, match="no admitted public key for z"):
        coordinator_keys.roster_keys(["a", "z"])


def test_an_old_presence_replayed_after_a_newer_birth_is_stale() -> None:
    clock = PresenceClock()

    def presence(online: bool, since: float) -> m.Presence:
        return m.Presence(fleet=FLEET, sender="a", online=online, since=since)

    assert clock.fresh(presence(True, 100.0))
    assert clock.fresh(presence(False, 100.0)), "this session's own will"
    assert clock.fresh(presence(True, 200.0)), "a restart"
    assert not clock.fresh(presence(False, 100.0)), "the first session's will, replayed"
    assert not clock.fresh(presence(False, 150.0)), "the first session's goodbye, replayed"
    assert clock.fresh(presence(False, 250.0)), "the goodbye of this session"


def test_keys_files_are_read_with_errors_that_name_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "admitted.keys"
    public = public_text(Ed25519PrivateKey.generate().public_key())
    path.write_text(f"# the lab's devices\n\n{key_line('d1', public)}  # bench 3\n")
    assert list(read_keys(path)) == ["d1"]
    for text, error in (
        ("d1\n", ":1: expected 'ID ed25519:BASE64'"),
        (f"D/1 {public}\n", ":1: invalid member id"),
        ("d1 ed25519:AAAA\n", ":1: not a 32-byte Ed25519 public key"),
        ("d1 rsa:AAAA\n", ":1: expected ed25519:BASE64"),
        (f"d1 {public}\nd1 {public}\n", ":2: 'd1' is listed twice"),
    ):
        path.write_text(text)
        with pytest.raises(ProtocolError, match=error):
            read_keys(path)


def test_a_private_key_is_made_once_private_to_its_owner(tmp_path: Path) -> None:
    path = tmp_path / "state" / "identity.pem"
    first = load_or_create_private(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert public_text(load_or_create_private(path).public_key()) == public_text(first.public_key())
    path.write_text("not a key")
    with pytest.raises(ProtocolError, match="not an unencrypted PEM private key"):
        load_or_create_private(path)


def test_a_trust_file_that_lists_another_key_for_this_member_is_refused(tmp_path: Path) -> None:
    trust = tmp_path / "trust.keys"
    trust.write_text(key_line("d1", public_text(Ed25519PrivateKey.generate().public_key())))
    with pytest.raises(ProtocolError, match="another public key for 'd1'"):
        member_keys("d1", tmp_path / "identity.pem", trust)


def test_admitting_agents_from_the_printed_lines(tmp_path: Path) -> None:
    runner = CliRunner()
    state, admitted = tmp_path / "d1", tmp_path / "admitted.keys"
    printed = runner.invoke(edge_agent, ["--id", "d1", "--state-dir", str(state), "key"])
    assert printed.exit_code == 0, printed.output
    member, public = printed.output.split()
    assert member == "d1" and (state / "identity.pem").exists()
    again = runner.invoke(edge_agent, ["--id", "d1", "--state-dir", str(state), "key"])
    assert again.output == printed.output, "the key is made once"
    admit = ["admit", "--admitted", str(admitted)]
    assert runner.invoke(coordinator, [*admit, "d1", public]).exit_code == 0
    assert runner.invoke(coordinator, [*admit, "d1", public]).exit_code == 0
    assert "d1" in read_keys(admitted)
    other = public_text(Ed25519PrivateKey.generate().public_key())
    clash = runner.invoke(coordinator, [*admit, "d1", other])
    assert clash.exit_code == 1 and "already admitted with another key" in clash.output
    bad = runner.invoke(coordinator, [*admit, "d2", "ed25519:nope"])
    assert bad.exit_code == 1 and "not a 32-byte Ed25519 public key" in bad.output
    assert "Traceback" not in clash.output + bad.output
    identity = tmp_path / "coordinator.pem"
    line = runner.invoke(coordinator, ["key", "--identity", str(identity)])
    assert line.exit_code == 0 and line.output.startswith("coordinator ed25519:")


def test_one_fleet_key_and_per_member_keys_do_not_mix(tmp_path: Path) -> None:
    key, trust = tmp_path / "fleet.key", tmp_path / "trust.keys"
    key.write_bytes(b"k" * 32)
    trust.write_text("")
    result = CliRunner().invoke(
        edge_agent, ["--broker", "127.0.0.1:1", "--key-file", str(key), "--trust", str(trust)]
    )
    assert result.exit_code == 2 and "give --key-file (one fleet key) or --trust" in result.output
    result = CliRunner().invoke(
        coordinator, ["emulate", "--key-file", str(key), "--agent-keys", "--agents", "2"]
    )
    assert result.exit_code == 2 and "--key-file (one fleet key) or --agent-keys" in result.output


def test_add_key_refuses_a_clash_and_keeps_the_file(tmp_path: Path) -> None:
    path = tmp_path / "admitted.keys"
    first = public_text(Ed25519PrivateKey.generate().public_key())
    assert add_key(path, "d1", first) is True
    before = path.read_text()
    with pytest.raises(ProtocolError):
        add_key(path, "d1", public_text(Ed25519PrivateKey.generate().public_key()))
    assert path.read_text() == before
