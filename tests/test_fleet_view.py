"""How the coordinator folds retained presence and status messages into the fleet table."""

from __future__ import annotations

import io

from coordinator.fleet import FleetView, describe_since, describe_state
from protocol import messages as m
from protocol import topics
from protocol.signing import FleetKey


def _presence(agent: str, online: bool, since: float = 100.0, fleet: str = "lab") -> bytes:
    return m.encode(m.Presence(fleet=fleet, sender=agent, online=online, since=since, profile="pi"))


def test_presence_and_status_make_one_entry_per_agent() -> None:
    view = FleetView()
    view.feed(topics.presence("lab", "b"), _presence("b", True))
    view.feed(topics.presence("lab", "a"), _presence("a", True))
    view.feed(
        topics.status("lab", "a"),
        m.encode(m.Status(fleet="lab", sender="a", round=4, state="training")),
    )
    view.feed(topics.presence("lab", "a"), _presence("a", False, since=200.0))
    entries = view.entries()
    assert [e.agent for e in entries] == ["a", "b"]
    a, b = entries
    assert (a.online, a.since, a.state, a.round, a.profile) == (False, 200.0, "training", 4, "pi")
    assert b.online and b.state == ""


def test_spoofed_malformed_and_foreign_messages_are_counted_not_applied() -> None:
    view = FleetView()
    assert view.feed(topics.presence("lab", "a"), _presence("mallory", True)) is None
    assert view.feed(topics.presence("lab", "a"), _presence("a", True, fleet="other")) is None
    assert view.feed(topics.presence("lab", "a"), b"\x00garbage") is None
    assert view.feed("some/other/topic", _presence("a", True)) is None
    assert view.entries() == []
    assert view.rejected == 4


def test_signed_fleets_ignore_unsigned_presence() -> None:
    key = FleetKey(b"k" * 16)
    view = FleetView(key=key)
    view.feed(topics.presence("lab", "a"), _presence("a", True))
    signed = m.encode(m.Presence(fleet="lab", sender="b", online=True, since=1.0), key=key)
    view.feed(topics.presence("lab", "b"), signed)
    assert [e.agent for e in view.entries()] == ["b"]
    assert view.rejected == 1


def test_a_cleared_retained_message_forgets_the_agent() -> None:
    view = FleetView()
    view.feed(topics.presence("lab", "a"), _presence("a", True))
    view.feed(topics.presence("lab", "a"), b"")
    assert view.entries() == []


def test_ages_read_naturally() -> None:
    assert describe_since(1000.0, now=1042.0) == "42s ago"
    assert describe_since(1000.0, now=1000.0 + 185) == "3m05s ago"
    assert describe_since(1000.0, now=1000.0 + 3 * 3600 + 5 * 60) == "3h05m ago"
    assert describe_since(1000.0, now=1000.0 + 2 * 86400 + 3600) == "2d01h ago"
    assert describe_since(0.0) == "unknown"


def test_an_agent_stopped_early_says_when_and_what_it_saved() -> None:
    view = FleetView()
    saved = {"round": 7, "saved_rounds": 23, "saved_flops": 4.5e9, "saved_bytes": 1_234_567}
    status = m.Status(
        fleet="lab", sender="a", round=7, state="stopped", stopped=True, metrics={"saved": saved}
    )
    entry = view.feed(topics.status("lab", "a"), m.encode(status))
    assert entry is not None and entry.stopped
    assert describe_state(entry) == (
        "stopped early after round 7: saved 23 rounds, 4.50e+09 FLOPs, 1.2 MB"
    )
    training = m.Status(fleet="lab", sender="b", round=3, state="training")
    other = view.feed(topics.status("lab", "b"), m.encode(training))
    assert other is not None and describe_state(other) == "training"


def test_the_status_table_names_a_metric_that_is_not_accuracy() -> None:
    from coordinator.fleet import COLUMNS, AgentEntry

    accuracy = AgentEntry("lab", "a", metrics={"accuracy": 0.5, "metric": "accuracy"})
    mae = AgentEntry("lab", "b", metrics={"accuracy": 0.125, "metric": "mae"})
    forged = AgentEntry("lab", "c", metrics={"accuracy": 0.1, "metric": "[red]x" * 20})
    assert COLUMNS["accuracy"](accuracy) == "0.500"
    assert COLUMNS["accuracy"](mae) == "0.125 mae"
    assert COLUMNS["accuracy"](forged).startswith("0.100 \\[red]x")


def test_a_replayed_older_presence_does_not_change_what_the_fleet_view_shows() -> None:
    """A recorded birth replayed after a goodbye, even after a forget, leaves the agent off."""
    key = FleetKey(b"k" * 32)
    view = FleetView(key=key)

    def presence(online: bool, at: float) -> bytes:
        message = m.Presence(fleet="lab", sender="a", online=online, since=at, at=at)
        return m.encode(message, key=key)

    birth = presence(True, at=100.0)
    view.feed(topics.presence("lab", "a"), birth)
    view.feed(topics.presence("lab", "a"), presence(False, at=200.0))
    assert view.feed(topics.presence("lab", "a"), birth) is None
    assert [e.online for e in view.entries()] == [False]
    view.feed(topics.presence("lab", "a"), b"")  # forgotten: the entry goes, the clock stays
    assert view.feed(topics.presence("lab", "a"), birth) is None
    assert view.entries() == [] and view.rejected == 2
    view.feed(topics.presence("lab", "a"), presence(True, at=300.0))
    assert [e.online for e in view.entries()] == [True]


def test_the_fleet_view_follows_a_bounded_number_of_members(monkeypatch) -> None:
    """Anyone may send under new names: past the bound they are counted, not kept."""
    monkeypatch.setattr("coordinator.fleet.MAX_MEMBERS", 3)
    view = FleetView()
    for name in ["a", "b", "c", "d", "e"]:
        view.feed(topics.presence("lab", name), _presence(name, True))
    view.feed(topics.presence("lab", "a"), _presence("a", False, since=300.0))
    assert [(e.agent, e.online) for e in view.entries()] == [("a", False), ("b", True), ("c", True)]
    assert view.dropped == 2


def test_the_table_names_whom_an_agent_quarantined_only_when_someone_did() -> None:
    from rich.console import Console

    from coordinator.fleet import fleet_table

    def shown(quarantined: list[str]) -> str:
        view = FleetView()
        view.feed(topics.presence("lab", "a"), _presence("a", True))
        status = m.Status(
            fleet="lab", sender="a", round=3, state="training",
            metrics={"quarantined": quarantined, "accuracy": 0.5},
        )  # fmt: skip
        view.feed(topics.status("lab", "a"), m.encode(status))
        console = Console(width=200, record=True, file=io.StringIO())
        console.print(fleet_table(view.entries()))
        return console.export_text()

    assert "quarantined" not in shown([])
    table = shown(["mallory"])
    assert "quarantined" in table and "mallory" in table
