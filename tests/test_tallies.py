"""The coordinator keeps the round tallies: each agent receives one message a round instead of
every other agent's status and vote, and learns from it what those said (ready, done,
stopped, left, the votes), so t* and who is left out are what they were."""

from __future__ import annotations

import threading
import time

import pytest

from agent.runtime import Expected, Inbox, expected_shapes
from coordinator import tallies
from coordinator.tallies import TallyKeeper
from protocol import messages, topics

FLEET, RUN = "lab", "run-1"
ROSTER = ["a", "b", "c"]


class Recorder:
    """A transport that keeps what is published."""

    def __init__(self) -> None:
        self.published: list[tuple[str, bytes, bool]] = []

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        self.published.append((topic, payload, retain))

    def tallies(self) -> list[messages.Tally]:
        decoded = [messages.decode(payload) for _, payload, _ in self.published]
        return [m for m in decoded if isinstance(m, messages.Tally)]

    def absences(self) -> list[set[str]]:
        decoded = [messages.decode(payload) for _, payload, _ in self.published]
        return [messages.members(m.gone, ROSTER) for m in decoded if isinstance(m, messages.Absent)]


def keeper(
    wait_s: float = 60.0, start_wait_s: float = 60.0, crash_grace_s: float = 60.0
) -> tuple[TallyKeeper, Recorder]:
    transport = Recorder()
    kept = TallyKeeper(
        fleet=FLEET,
        run_id=RUN,
        roster=ROSTER,
        rounds=3,
        transport=transport,  # type: ignore[arg-type]
        sender="coordinator",
        key=None,
        wait_s=wait_s,
        start_wait_s=start_wait_s,
        crash_grace_s=crash_grace_s,
    )
    return kept, transport


def status(
    agent: str, round_: int, state: str = "training", stopped: bool = False
) -> messages.Status:
    return messages.Status(
        fleet=FLEET, sender=agent, run_id=RUN, round=round_, state=state, stopped=stopped
    )


def vote(agent: str, round_: int, yes: bool) -> messages.Vote:
    return messages.Vote(fleet=FLEET, sender=agent, run_id=RUN, round=round_, vote=yes, score=0.0)


def test_a_round_is_tallied_once_when_every_agent_reported_it() -> None:
    kept, transport = keeper()
    for agent in ROSTER:
        kept.on_status(status(agent, 0, "ready"))
    assert [t.round for t in transport.tallies()] == [0]
    assert messages.members(transport.tallies()[0].done, ROSTER) == set(ROSTER)
    kept.on_vote(vote("a", 1, True))
    kept.on_status(status("a", 1))
    kept.on_vote(vote("b", 1, False))
    kept.on_status(status("b", 1))
    assert [t.round for t in transport.tallies()] == [0], "c has not reported round 1"
    kept.on_vote(vote("c", 1, True))
    kept.on_status(status("c", 1))
    first = transport.tallies()[1]
    assert first.round == 1 and messages.members(first.yes, ROSTER) == {"a", "c"}
    assert messages.members(first.voted, ROSTER) == set(ROSTER)
    kept.on_status(status("c", 1))  # a repeated status publishes nothing more
    assert len(transport.tallies()) == 2
    assert all(retain for _, _, retain in transport.published)


def test_stopped_offline_and_left_agents_are_not_waited_for() -> None:
    kept, transport = keeper()
    kept.on_status(status("a", 0, "ready"))
    kept.on_status(status("b", 0, "rejected"))  # its data does not fit: it left
    kept.on_presence("c", online=False)
    assert [t.round for t in transport.tallies()] == [0]
    assert transport.tallies()[0].left == ["b"]
    kept.on_presence("c", online=True)
    kept.on_status(status("c", 1, "stopped", stopped=True))
    kept.on_status(status("a", 1))
    kept.on_status(status("a", 2))
    tallies = transport.tallies()
    assert [t.round for t in tallies] == [0, 1, 2], "c stopped after round 1: not waited for"
    assert tallies[-1].stopped == {"c": 1}


def test_a_late_round_is_tallied_with_what_came_after_the_wait() -> None:
    kept, transport = keeper(wait_s=0.2, start_wait_s=0.2)
    kept.start()
    try:
        kept.on_status(status("a", 1))
        deadline = time.monotonic() + 5
        while len(transport.tallies()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        kept.close()
    rounds = [t.round for t in transport.tallies()]
    assert rounds[:2] == [0, 1]
    assert messages.members(transport.tallies()[1].done, ROSTER) == {"a"}


def wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_the_keeper_says_who_of_the_run_is_gone_once_per_change(monkeypatch) -> None:
    monkeypatch.setattr(tallies, "ABSENT_EVERY_S", 0.5)
    kept, transport = keeper(crash_grace_s=1.0)
    kept.on_presence("c", online=False, reason="lost")  # an earlier run's will: not in this run
    kept.on_presence("c", online=True)  # its birth, before its first status of this run
    for agent in ROSTER:
        kept.on_status(status(agent, 0, "ready"))
    kept.start()
    try:
        kept.on_presence("a", online=False, reason="lost")  # a dropped out, and is back in time
        time.sleep(0.5)
        kept.on_presence("a", online=True)
        kept.on_presence("b", online=False, reason="shutdown")  # b left: gone at once
        assert transport.absences() == [{"b"}]
        kept.on_presence("c", online=False, reason="lost")  # c crashed: gone after the grace
        time.sleep(0.6)
        assert transport.absences() == [{"b"}], "c may still come back"
        wait_for(lambda: len(transport.absences()) == 2)
        assert transport.absences()[-1] == {"b", "c"}
        kept.on_presence("b", online=True)
        kept.on_presence("c", online=True)  # within POLL_S of the last change: one notice
        wait_for(lambda: len(transport.absences()) == 3)
        for agent in ROSTER:
            kept.on_status(status(agent, 3, "done"))
        for agent in ROSTER:  # leaving after the run: no notice
            kept.on_presence(agent, online=False, reason="shutdown")
        time.sleep(1.5)
    finally:
        kept.close()
    assert transport.absences()[2:] == [set()], "a's drop within the grace was never told"


def test_an_agent_learns_who_is_gone_from_the_keepers_notices() -> None:
    box = inbox()
    box.on_status(topics.status(FLEET, "a"), messages.encode(status("a", 0, "ready")))

    def notice(agents: set[str], sender: str = "coordinator") -> None:
        gone = messages.bitmap(agents, ROSTER)
        message = messages.Absent(fleet=FLEET, sender=sender, run_id=RUN, gone=gone)
        box.on_absent(topics.absent(FLEET, sender), messages.encode(message))

    notice({"a"})
    assert box.gone() == {"a"}, "the keeper served the grace"
    notice(set())
    assert box.gone() == set() and box.offline == set()
    notice({"a"}, sender="a")
    assert box.offline == set() and box.rejected == 1, "only the keeper says who is gone"


def inbox(keeper_id: str = "coordinator") -> Inbox:
    expected = Expected(
        FLEET, RUN, frozenset(ROSTER), expected_shapes({}), keeper=keeper_id, rounds=3
    )
    return Inbox(expected)


def tally_payload(round_: int, sender: str = "coordinator", **fields: object) -> bytes:
    tally = messages.Tally(fleet=FLEET, sender=sender, run_id=RUN, round=round_, **fields)  # type: ignore[arg-type]
    return messages.encode(tally)


def test_an_agent_learns_from_a_tally_what_the_statuses_and_votes_said() -> None:
    box = inbox()
    topic = topics.round_topic(FLEET, 2, "tally", "coordinator")
    bits = messages.bitmap
    box.on_tally(topic, tally_payload(
        2,
        done=bits(["a", "b"], ROSTER),
        voted=bits(["a", "b"], ROSTER),
        yes=bits(["b"], ROSTER),
        stopped={"c": 1},
    ))  # fmt: skip
    started = time.monotonic()
    assert box.wait_votes(2, ROSTER, timeout_s=30) == {"a": False, "b": True}
    assert time.monotonic() - started < 1, "a tallied round's votes are final: no wait"
    assert box.stopped_agents() == {"c": 1}
    assert box.reported_done(2, "a") and not box.reported_done(3, "a")
    final = topics.round_topic(FLEET, 3, "tally", "coordinator")
    box.on_tally(final, tally_payload(3, done=bits(["a", "b"], ROSTER)))
    assert box.wait_finished(ROSTER, box_stop(), 0.1) == set(), "c stopped: finished too"


def box_stop() -> threading.Event:
    return threading.Event()


@pytest.mark.parametrize("sender", ["a", "mallory"])
def test_a_tally_from_anyone_but_the_keeper_is_ignored(sender: str) -> None:
    box = inbox()
    topic = topics.round_topic(FLEET, 0, "tally", sender)
    box.on_tally(topic, tally_payload(0, sender=sender, done=messages.bitmap(ROSTER, ROSTER)))
    assert box.wait_ready(ROSTER, box_stop(), 0.05) == set(ROSTER)
    assert box.rejected == (1 if sender in ROSTER else 0)  # a stranger is ignored quietly


def test_bitmaps_round_trip_over_the_roster() -> None:
    roster = [f"agent-{k:03d}" for k in range(1000)]
    chosen = set(roster[::7]) | {roster[-1]}
    bits = messages.bitmap(chosen | {"stranger"}, roster)
    assert len(bits) == 125 and messages.members(bits, roster) == chosen
    assert messages.members(b"", roster) == set()


def test_an_agent_follows_everyone_itself_once_the_keeper_is_offline() -> None:
    box = inbox()
    lost: list[str] = []
    box.on_keeper_lost = lambda: lost.append("lost")

    def presence(agent: str, online: bool, since: float) -> None:
        message = messages.Presence(fleet=FLEET, sender=agent, online=online, since=since)
        box.on_presence(topics.presence(FLEET, agent), messages.encode(message))

    presence("coordinator", True, 1.0)
    presence("a", False, 2.0)
    assert lost == [], "an agent going offline is no reason"
    presence("coordinator", False, 3.0)
    presence("coordinator", False, 4.0)
    assert lost == ["lost"], "once"


def test_a_fleet_whose_coordinator_dies_mid_run_learns_as_simulate(amqtt_broker, tmp_path) -> None:
    """Its tallies stop; the agents follow every status and vote themselves, with the same
    votes (the statuses carry their vote histories), so t* and every figure stay."""
    from coordinator.emulate import Emulation
    from coordinator.simulate import simulate
    from tests.test_emulate import SHARED, assert_same_learning, config, options, run_in_background

    cfg = config(rounds=5, max_wait=2, delta_pr=100.0)
    emulation = Emulation(cfg, amqtt_broker.address, options(tmp_path, agents_per_process=SHARED))
    thread, result = run_in_background(emulation)
    deadline = time.monotonic() + 300
    while getattr(emulation, "conductor", None) is None or emulation.conductor.rounds_done() < 3:
        assert time.monotonic() < deadline and thread.is_alive(), result
        time.sleep(0.05)
    emulation.conductor.transport.abort()  # as a crash: the broker publishes its will
    thread.join(600)
    assert "error" not in result, result.get("error")
    logs = " ".join(emulation.log_path(a).read_text() for a in emulation.roster)
    assert "tally keeper coordinator went offline" in logs
    assert_same_learning(result["report"], simulate(cfg))
