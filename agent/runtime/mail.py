"""Who is in the fleet and what it decided: message checks, statuses, presence and votes.

Handlers run on the transport's dispatcher thread and only validate and store; the round loop
waits here with timeouts. `Inbox` adds the models on top of this fleet state, under the same
lock, so that a wait for a model can see an agent stop early or go offline.

An agent that took part in this run and whose presence then says offline (its last will after
a crash, or its goodbye) is `gone`: nobody waits for its messages until its presence says
online again (a restart that resumes). An offline presence of an agent not yet heard from in
this run does not count: it may be a retained one of an earlier run, before the agent came up.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass
from typing import Any

from agent.learning import running
from agent.runtime.quarantine import Quarantine
from protocol import ProtocolError, messages
from protocol.logs import RejectionLog, claimed_sender
from protocol.membership import CRASH_GRACE_S, LOST, PresenceClock
from protocol.signing import Signer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Expected:
    """What a valid message for this run looks like."""

    fleet: str
    run_id: str
    roster: frozenset[str]
    shapes: dict[str, tuple[tuple[int, ...], str]]
    key: Signer | None = None
    aggregator: str | None = None
    """The coordinator aggregating a centralized run (it sends globals and layer requests)."""
    delta_shapes: dict[str, tuple[tuple[int, ...], str]] | None = None
    """The tensors of a delta message (`--wire delta`); None: models come whole."""
    layer_groups: dict[str, list[str]] | None = None
    """`--wire layers`: the model's layers in order, each with its tensors."""
    window_layers: dict[str, list[str]] | None = None
    """A run whose budgeted rounds may train a window of layers (`--reduce prefix`, `auto`):
    the layers, each with its tensors; a model may come as some of them, each whole (the
    window its sender trained, `Learner.published`). None: models come whole."""
    keeper: str = ""
    """Who publishes the round tallies (the coordinator); empty: no tallies, every status
    and vote is followed instead."""
    rounds: int = 0
    """The run's rounds: the last round's tally says who finished the run."""


ROUND_DONE_STATES = ("training", "stopped", "done")
"""The states of the status an agent publishes after each round it finished."""


class FleetMail:
    """The fleet's state as this agent hears it, and the message checks every kind shares."""

    def __init__(self, expected: Expected) -> None:
        self.expected = expected
        self._votes: dict[int, dict[str, bool]] = {}
        self._changed = threading.Condition()
        self.rejected = 0
        self.ready: set[str] = set()
        self.finished: set[str] = set()
        self.stopped: dict[str, int] = {}
        """Agents stopped early -> their last round; their later models will never come."""
        self.offline: set[str] = set()
        self._crashed_at: dict[str, float] = {}
        """Offline agents whose will said "lost" (a crash), and when (monotonic)."""
        self._rejections = RejectionLog(log)
        self.quarantine = Quarantine()
        """Senders of invalid models (`reject_model`): not waited for, and after a few
        rounds of them quarantined for the run."""
        self._presences = PresenceClock()
        self._rounds_done: dict[str, int] = {}
        """The last round each agent's status (or a tally) says it finished."""
        self._tallied: set[int] = set()
        """Rounds whose tally came: their votes are all there will be."""
        self._noticed: set[str] = set()
        """Who the keeper's last `Absent` notice listed as gone."""
        self.on_keeper_lost: Callable[[], None] | None = None
        """Called once when the keeper's presence says it went offline: the agent then
        follows every status and vote itself, as in a fleet without a keeper."""

    def reject_model(self, kind: str, message: messages.Model, topic: str, problem: object) -> None:
        """Reject a model (or layer) whose tensors failed their checks: its waiters go on
        without it, and its sender may be quarantined (`Quarantine.invalid`)."""
        self.reject(kind, message.sender, topic, problem)
        self.quarantine.invalid(message.sender, message.round, problem)
        with self._changed:
            self._changed.notify_all()

    def reject(self, kind: str, sender: str, topic: str, reason: object) -> None:
        """Count a message that failed its checks and warn of it (rate-limited)."""
        self.rejected += 1
        self._rejections.reject(kind, sender, topic, reason)

    def _decode(
        self, topic: str, payload: bytes, kind: str, check_run: bool = True
    ) -> messages.Message | None:
        try:
            message = messages.decode_on_topic(
                topic, payload, kind, self.expected.fleet, self.expected.key
            )
        except ProtocolError as exc:
            self.reject(kind, claimed_sender(topic), topic, exc)
            return None
        aggregator = kind == "request" and message.sender == self.expected.aggregator
        keeper = kind in ("tally", "presence", "absent") and message.sender == self.expected.keeper
        if message.sender not in self.expected.roster and not (aggregator or keeper):
            log.debug("ignored %s of %s: not in this run's roster", kind, message.sender)
            return None
        if check_run and message.run_id != self.expected.run_id:
            return None
        return message

    def _from_keeper(self, topic: str, payload: bytes, kind: str) -> messages.Message | None:
        """A message of `kind` that only the run's keeper may send; from anyone else it is
        rejected."""
        message = self._decode(topic, payload, kind)
        if message is not None and message.sender != self.expected.keeper:
            self.reject(kind, message.sender, topic, "not the run's keeper")
            return None
        return message

    def on_vote(self, topic: str, payload: bytes) -> None:
        message = self._decode(topic, payload, "vote")
        if isinstance(message, messages.Vote):
            self.record_votes(message.sender, {message.round: message.vote})

    def decode_request(self, topic: str, payload: bytes) -> messages.Request | None:
        message = self._decode(topic, payload, "request")
        return message if isinstance(message, messages.Request) else None

    def on_status(self, topic: str, payload: bytes) -> None:
        """Retained statuses carry each agent's vote history: a restarted agent's way to
        learn the votes it missed while it was down."""
        message = self._decode(topic, payload, "status")
        if isinstance(message, messages.Status):
            with self._changed:
                self.ready.add(message.sender)
                if message.state in ("done", "rejected") or message.stopped:
                    self.finished.add(message.sender)
                if message.state == "rejected":  # its data does not fit: it will not train
                    self.offline.add(message.sender)
                if message.stopped:
                    self.stopped[message.sender] = message.round
                if message.state in ROUND_DONE_STATES:
                    self._finished_round(message.sender, message.round)
                self._changed.notify_all()
            history = message.metrics.get("votes")
            # A history longer than its status's round is forged: never build its dict.
            if (
                isinstance(history, str)
                and len(history) <= message.round
                and set(history) <= {"0", "1"}
            ):
                self.record_votes(
                    message.sender, {r: v == "1" for r, v in enumerate(history, start=1)}
                )

    def on_tally(self, topic: str, payload: bytes) -> None:
        """The keeper's tally of a round: what the statuses and votes of every agent would
        have said (ready, done, stopped, left, votes), in one message instead of two per
        agent."""
        message = self._from_keeper(topic, payload, "tally")
        if not isinstance(message, messages.Tally):
            return
        roster = sorted(self.expected.roster)
        done = messages.members(message.done, roster)
        stopped = {j: r for j, r in message.stopped.items() if j in self.expected.roster}
        left = set(message.left) & self.expected.roster
        voted = messages.members(message.voted, roster)
        yes = messages.members(message.yes, roster)
        with self._changed:  # re-entrant: the votes go in before the round counts as tallied
            for agent in sorted(voted):
                self.record_votes(agent, {message.round: agent in yes})
            if message.round == 0:
                self.ready |= done
            for agent in done:
                self._finished_round(agent, message.round)
            if message.round >= self.expected.rounds:
                self.finished |= done
            self.stopped.update(stopped)
            self.finished |= set(stopped) | left
            self.ready |= left
            self.offline |= left
            self._tallied.add(message.round)
            self._changed.notify_all()

    def born(self, member: str) -> float | None:
        """When `member`'s current session began (its latest birth), None if none was seen:
        a member born again has lost what was sent to it before."""
        with self._changed:
            return self._presences.born(member)

    def on_presence(self, topic: str, payload: bytes) -> None:
        """Track who is offline, so nobody waits out a timeout for an agent known gone."""
        message = self._decode(topic, payload, "presence", check_run=False)
        if isinstance(message, messages.Presence):
            with self._changed:
                if not self._presences.fresh(message):
                    self.reject("presence", message.sender, topic, "older than its last birth")
                    return
                if message.online:
                    self.offline.discard(message.sender)
                    self._crashed_at.pop(message.sender, None)
                else:
                    self.offline.add(message.sender)
                    if message.reason == LOST:
                        self._crashed_at.setdefault(message.sender, time.monotonic())
                self._changed.notify_all()
            lost = self.on_keeper_lost
            if lost is not None and not message.online and message.sender == self.expected.keeper:
                self.on_keeper_lost = None
                lost()

    def on_absent(self, topic: str, payload: bytes) -> None:
        """The keeper's word on who of the run is gone, instead of every presence: an agent
        it lists left, or crashed CRASH_GRACE_S ago and has not come back (the keeper served
        the grace), so nobody waits for it; one it no longer lists came back."""
        message = self._from_keeper(topic, payload, "absent")
        if not isinstance(message, messages.Absent):
            return
        absent = messages.members(message.gone, sorted(self.expected.roster))
        with self._changed:
            for agent in self._noticed - absent:
                self.offline.discard(agent)
            self.offline |= absent
            self._noticed = absent
            self._changed.notify_all()

    def _finished_round(self, agent: str, round_: int) -> None:
        """Note that `agent` finished `round_` (a status or a tally); reports may arrive out of
        order after a reconnect, so the latest round only ever grows."""
        self._rounds_done[agent] = max(self._rounds_done.get(agent, 0), round_)

    def reported_done(self, round_: int, sender: str) -> bool:
        """Whether `sender`'s status says it finished round `round_` (so it published what
        that round announces, which came before the status on its connection)."""
        with self._changed:
            return self._rounds_done.get(sender, 0) >= round_

    def stopped_agents(self) -> dict[str, int]:
        """A copy of who stopped early and after which round."""
        with self._changed:
            return dict(self.stopped)

    def record_votes(self, sender: str, votes: dict[int, bool]) -> None:
        with self._changed:
            for round_, vote in votes.items():
                self._votes.setdefault(round_, {}).setdefault(sender, vote)
            self._changed.notify_all()

    def gone(self) -> set[str]:
        """The agents that took part in this run and are offline now: their messages will
        not come until they are back."""
        with self._changed:
            return self._gone()

    def _gone(self) -> set[str]:
        """`gone`, with the lock held. An agent that left cleanly is gone at once; one that
        crashed only after CRASH_GRACE_S, since it may be restarting to resume the run (and
        its peers would otherwise go on without the models it is about to republish)."""
        now = time.monotonic()
        return {
            agent
            for agent in self.offline & self.ready
            if now - self._crashed_at.get(agent, -math.inf) >= CRASH_GRACE_S
        }

    def _wait_missing(
        self,
        needed: Iterable[Any],
        store: Container[Any],
        timeout_s: float,
        until: Callable[[], bool] | None = None,
    ) -> Any:
        """Wait until every key (round, sender, ...) is in `store` or will not come (its
        sender stopped early before that round, or is gone, or it came invalid or its sender
        is quarantined: `Quarantine.skips`), the timeout passes, or `until()` holds; returns
        the missing still worth waiting for (a gone sender's are left out)."""
        needed = set(needed)
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                gone = self._gone()
                missing = {
                    key
                    for key in needed
                    if key not in store
                    and running(key[1], key[0], self.stopped)
                    and key[1] not in gone
                    and not self.quarantine.skips(key[0], key[1])
                }
                remaining = deadline - time.monotonic()
                if not missing or remaining <= 0 or (until is not None and until()):
                    return missing
                self._changed.wait(min(remaining, 0.5))

    def wait_votes(self, round_: int, roster: Iterable[str], timeout_s: float) -> dict[str, bool]:
        """The votes of round_ once all of the roster voted, or what arrived by the timeout."""
        roster = set(roster)
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                votes = dict(self._votes.get(round_, {}))
                stopped = {j for j, last in self.stopped.items() if last < round_}
                everyone = roster - self.offline - stopped <= set(votes)
                if everyone or round_ in self._tallied or time.monotonic() >= deadline:
                    return votes
                self._changed.wait(min(deadline - time.monotonic(), 0.5))

    def wait_ready(
        self, agents: Iterable[str], stop: threading.Event, timeout_s: float
    ) -> set[str]:
        """Wait until every agent has subscribed (its first status of this run says so), is
        offline, `stop` is set, or timeout; returns the agents not heard from."""
        return self._wait_all(set(agents), self.ready, stop, timeout_s)

    def wait_finished(
        self, agents: Iterable[str], stop: threading.Event, timeout_s: float
    ) -> set[str]:
        """Wait until every agent reported its last round done, is offline, `stop` is set, or
        timeout; returns the agents still running."""
        return self._wait_all(set(agents), self.finished, stop, timeout_s)

    def _wait_all(
        self, agents: set[str], group: set[str], stop: threading.Event, timeout_s: float
    ) -> set[str]:
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                waiting = agents - group - self.offline
                remaining = deadline - time.monotonic()
                if not waiting or stop.is_set() or remaining <= 0:
                    return waiting
                self._changed.wait(min(remaining, 0.2))
