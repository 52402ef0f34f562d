"""The message envelope: typed round trips, versions, signatures, hostile input."""

from __future__ import annotations

import contextlib
import random

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol import PROTOCOL_VERSION, Limits, ProtocolError, topics
from protocol import messages as m
from protocol.signing import FleetKey

KEY = FleetKey(b"0123456789abcdef-fleet-key")

EXAMPLES: list[m.Message] = [
    m.Presence(
        fleet="lab", sender="pi-1", online=True, since=1700000000.5, profile="raspberry-pi-4"
    ),
    m.Presence(fleet="lab", sender="pi-1", online=False, since=1700000000.5),
    m.Status(
        fleet="lab",
        sender="pi-1",
        round=7,
        state="training",
        metrics={"accuracy": 0.91, "sparsity": 0.6, "stragglers": ["pi-2"], "p_k": None},
    ),
    m.RunConfig(
        fleet="lab",
        sender="coordinator",
        run_id="run-1",
        roster=["a", "b", "c"],
        seed=42,
        config={"strategy": "dadpfl", "rounds": 30, "nested": {"lr": 0.1}},
    ),
    m.Model(
        fleet="lab", sender="a", run_id="run-1", round=3, tensors=bytes(range(256)), num_samples=120
    ),
    m.Model(fleet="lab", sender="a", round=4, tensors=b"", num_samples=1, base_round=3),
    m.Vote(fleet="lab", sender="a", round=3, vote=True, score=0.013),
    m.Divergence(fleet="lab", sender="a", round=3, layers=["conv1", "fc"], values=[0.5, 2]),
    m.Request(fleet="lab", sender="b", round=3, target="a", layers=["fc"]),
    m.Update(fleet="lab", sender="a", round=3, tensors=b"\x01\x02", num_samples=9),
    m.Global(fleet="lab", sender="coordinator", round=3, tensors=b"\x03", participants=["a"]),
    m.Tally(
        fleet="lab",
        sender="coordinator",
        round=3,
        done=b"\x07",
        voted=b"\x03",
        yes=b"\x01",
        stopped={"c": 2},
        left=["d"],
    ),
    m.Absent(fleet="lab", sender="coordinator", run_id="r1", gone=b"\x05"),
    m.Log(
        fleet="lab",
        sender="pi-1",
        run_id="r1",
        time=1700000000.5,
        level="WARNING",
        message="straggler pi-2",
        logger="agent.runtime",
        dropped=3,
    ),
    m.Keys(
        fleet="lab", sender="pi-1", run_id="r1", round=2, cipher_key=b"c" * 32,
        mask_key=b"m" * 32, num_samples=120, sign_key=b"g" * 32,
    ),
    m.KeyList(fleet="lab", sender="coordinator", run_id="r1", round=2, keys=[b"k1", b"k2"]),
    m.Shares(
        fleet="lab", sender="pi-1", run_id="r1", round=2, target="coordinator",
        peers=["pi-1", "pi-2"], sealed=[b"s" * 76, b"t" * 76],
    ),
    m.Support(fleet="lab", sender="pi-1", run_id="r1", round=2, mask=b"\x92\x03\xc4\x01\x05"),
    m.Masked(fleet="lab", sender="pi-1", run_id="r1", round=2, values=b"\x01\x00\x00\x00"),
    m.Survivors(fleet="lab", sender="coordinator", run_id="r1", round=2, survivors=["pi-1"]),
    m.Reveal(
        fleet="lab", sender="pi-1", run_id="r1", round=2, owners=["pi-1"], shares=[b"r" * 16]
    ),
    m.Consent(
        fleet="lab", sender="pi-1", run_id="r1", round=2, signers=["pi-1"],
        signatures=[b"g" * 64],
    ),
]  # fmt: skip


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda x: type(x).__name__)
@pytest.mark.parametrize("key", [None, KEY], ids=["unsigned", "signed"])
def test_every_message_type_round_trips(message: m.Message, key: FleetKey | None) -> None:
    decoded = m.decode(m.encode(message, key=key), key=key)
    assert decoded == message
    assert type(decoded) is type(message)


def test_every_message_type_has_an_example() -> None:
    assert {type(x) for x in EXAMPLES} == set(m.MESSAGE_CLASSES.values())


def test_secure_aggregation_lists_of_different_lengths_are_refused() -> None:
    header = {"fleet": "lab", "sender": "pi-1", "run_id": "r1", "round": 2}
    with pytest.raises(ProtocolError, match="peers and shares"):
        m.encode(m.Shares(**header, target="coordinator", peers=["a", "b"], sealed=[b"x"]))
    with pytest.raises(ProtocolError, match="owners and shares"):
        m.encode(m.Reveal(**header, owners=["a"], shares=[]))


def test_small_messages_stay_small() -> None:
    vote = m.Vote(fleet="lab", sender="a", round=3, vote=True, score=0.013)
    assert len(m.encode(vote)) < 64
    assert len(m.encode(vote, key=KEY)) < 100


def _envelope(**overrides: object) -> bytes:
    items = {
        "version": PROTOCOL_VERSION,
        "type": "vote",
        "fleet": "lab",
        "sender": "a",
        "run_id": "",
        "round": 1,
        "body": {"vote": True, "score": 0.5},
        "signature": None,
    }
    items.update(overrides)
    return msgpack.packb(list(items.values()), use_bin_type=True)


def test_the_hand_built_envelope_is_what_encode_writes() -> None:
    message = m.Vote(fleet="lab", sender="a", round=1, vote=True, score=0.5)
    assert _envelope() == m.encode(message)


@pytest.mark.parametrize("version", [0, 1, 3, 99, "2", None, True, 2.0])
def test_unknown_versions_are_rejected(version: object) -> None:
    with pytest.raises(ProtocolError, match="version"):
        m.decode(_envelope(version=version))


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"type": "bogus"}, "unknown message type"),
        ({"type": 3}, "unknown message type"),
        ({"fleet": "Bad/Fleet"}, "invalid fleet"),
        ({"sender": "+"}, "invalid sender"),
        ({"sender": ""}, "invalid sender"),
        ({"round": -1}, "round"),
        ({"round": 1.5}, "round"),
        ({"body": []}, "body must be a map"),
        ({"body": {"vote": True}}, "incomplete"),
        ({"body": {"vote": True, "score": 0.5, "extra": 1}}, "unexpected fields"),
        ({"body": {"vote": True, "score": 0.5, "round": 2}}, "unexpected fields"),
        ({"body": {"vote": 1, "score": 0.5}}, "vote.vote"),
        ({"body": {"vote": True, "score": "x"}}, "vote.score"),
        ({"body": {"vote": True, "score": float("nan")}}, "vote.score"),
        ({"body": {"vote": True, "score": float("inf")}}, "vote.score"),
        ({"type": "divergence", "body": {"layers": ["a"], "values": [1.0, 2.0]}}, "number of"),
        ({"type": "divergence", "body": {"layers": [1], "values": [1.0]}}, r"list\[str\]"),
        ({"type": "status", "body": {"state": "x", "metrics": {"a": float("nan")}}}, "metrics"),
        ({"type": "status", "body": {"state": "x", "metrics": {"a": b"raw"}}}, "metrics"),
    ],
)
def test_malformed_envelopes_get_a_clear_protocol_error(overrides: dict, reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason):
        m.decode(_envelope(**overrides))


def test_non_envelopes_are_rejected() -> None:
    for payload in (b"", b"\xc1", msgpack.packb([1, 2, 3]), msgpack.packb({"a": 1}), b"\x98"):
        with pytest.raises(ProtocolError):
            m.decode(payload)
    with pytest.raises(ProtocolError, match="bytes"):
        m.decode("not bytes")  # type: ignore[arg-type]


def test_deeply_nested_config_is_rejected_not_a_crash() -> None:
    config: object = 1
    for _ in range(100):
        config = [config]
    with pytest.raises(ProtocolError):
        m.decode(_envelope(type="run", body={"roster": [], "seed": 1, "config": {"x": config}}))


def test_oversized_messages_are_rejected_before_parsing() -> None:
    data = m.encode(EXAMPLES[4])
    with pytest.raises(ProtocolError, match="exceeds"):
        m.decode(data, limits=Limits(max_message_bytes=len(data) - 1))
    assert m.decode(data, limits=Limits(max_message_bytes=len(data))) == EXAMPLES[4]


def test_a_fleet_key_rejects_unsigned_tampered_and_foreign_messages() -> None:
    message = EXAMPLES[4]
    signed = m.encode(message, key=KEY)
    with pytest.raises(ProtocolError, match="not signed"):
        m.decode(m.encode(message), key=KEY)
    with pytest.raises(ProtocolError, match="signature"):
        m.decode(m.encode(message, key=FleetKey(b"another-fleet-key-123")), key=KEY)
    tampered = bytearray(signed)
    tampered[40] ^= 0x01
    with pytest.raises(ProtocolError):
        m.decode(bytes(tampered), key=KEY)
    assert m.decode(signed) == message


def test_encode_refuses_invalid_messages() -> None:
    with pytest.raises(ProtocolError):
        m.encode(m.Vote(fleet="lab", sender="a", vote=True, score=float("nan")))
    with pytest.raises(ProtocolError):
        m.encode(m.Presence(fleet="LAB", sender="a", online=True, since=0.0))


def test_random_garbage_only_raises_protocol_error() -> None:
    rng = random.Random(7)
    valid = [m.encode(x, key=KEY) for x in EXAMPLES]
    for _ in range(3000):
        data = bytearray(rng.choice(valid))
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        if rng.random() < 0.3:
            data = data[: rng.randrange(len(data))]
        with contextlib.suppress(ProtocolError):
            m.decode(bytes(data), key=rng.choice([None, KEY]))


@given(
    state=st.text(max_size=20),
    round_=st.integers(0, 2**40),
    metrics=st.dictionaries(
        st.text(max_size=8),
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(-(2**63), 2**63 - 1),
            st.floats(allow_nan=False, allow_infinity=False),
            st.text(max_size=8),
        ),
        max_size=6,
    ),
)
def test_status_round_trips_any_plain_metrics(state: str, round_: int, metrics: dict) -> None:
    message = m.Status(fleet="f", sender="s", round=round_, state=state, metrics=metrics)
    assert m.decode(m.encode(message)) == message


def test_topics_are_built_and_parsed_consistently() -> None:
    assert topics.presence("lab", "pi-1") == "fl/v1/lab/presence/pi-1"
    assert topics.presence("+") == "fl/v1/+/presence/+"
    assert topics.round_topic("lab", 3, "model", "a") == "fl/v1/lab/round/3/model/a"
    assert topics.parse("fl/v1/lab/round/3/model/a") == (
        "lab",
        "model",
        {"round": "3", "agent": "a"},
    )
    assert topics.parse(topics.global_model("lab", 2)) == ("lab", "global", {"round": "2"})
    assert topics.parse(topics.run("lab")) == ("lab", "run", {})
    assert topics.parse(topics.status("lab", "x")) == ("lab", "status", {"agent": "x"})
    for bad in ("fl/v1/lab", "other/v1/lab/run", "fl/v1/lab/round/3/bogus/a", "fl/v2/lab/run"):
        with pytest.raises(ProtocolError):
            topics.parse(bad)
    for name in ("", "A", "a/b", "a+", "#", "-a", "x" * 65):
        with pytest.raises(ProtocolError):
            topics.check_name(name)
    with pytest.raises(ValueError, match="unknown round message kind"):
        topics.round_topic("lab", 1, "bogus")


def test_a_message_must_match_the_topic_it_arrived_on() -> None:
    """Nobody can speak for another agent, another round or another target by choosing the
    topic: the receivers (agent inbox, aggregator) check every message against it."""
    vote = m.encode(m.Vote(fleet="f", sender="a1", run_id="r", round=3, vote=True, score=0.1))
    own = topics.round_topic("f", 3, "vote", "a1")
    assert m.decode_on_topic(own, vote, "vote", "f", None).sender == "a1"
    mismatched = [
        (topics.round_topic("f", 3, "vote", "a2"), "vote", "f"),  # another agent's topic
        (topics.round_topic("f", 4, "vote", "a1"), "vote", "f"),  # another round
        (topics.round_topic("f", 3, "model", "a1"), "model", "f"),  # another kind
        (topics.round_topic("g", 3, "vote", "a1"), "vote", "g"),  # another fleet's topic
        (own, "vote", "g"),  # a receiver of another fleet
    ]
    for topic, kind, fleet in mismatched:
        with pytest.raises(ProtocolError, match="does not match its topic"):
            m.decode_on_topic(topic, vote, kind, fleet, None)
    ask = m.encode(m.Request(fleet="f", sender="a1", run_id="r", round=3, target="a2"))
    m.decode_on_topic(
        topics.round_topic("f", 3, "request", "a1", to="a2"), ask, "request", "f", None
    )
    with pytest.raises(ProtocolError, match="does not match its topic"):
        m.decode_on_topic(
            topics.round_topic("f", 3, "request", "a1", to="a3"), ask, "request", "f", None
        )
