"""The coordinator as tally keeper: one message a round instead of two per agent to each agent.

Agents used to follow every other agent's status and vote: 2K deliveries to each agent every
round, for K agents, which grew past the training time long before the broker was busy. The
coordinator follows them anyway; it now publishes each round's `Tally` (who finished the
round, who voted 1, who stopped early, who will not take part), retained, and the agents
subscribe to the tallies alone. Each agent still publishes its status (the coordinator and
dashboards read them) and its votes (the keeper counts them).

A round's tally goes out when every agent still in the run reported that round (or is
offline, stopped before it, or left), or `wait_s` after the first report of it, with what
came; round 0's (who is ready) when every agent is ready or after `start_wait_s`. An agent's
vote of a round reaches the keeper before its status of that round (one connection, in
order), so the votes of every agent that reported the round are in its tally: the settled
tally, and with it t* (ALGORITHMS.md 1.7), is the one every agent computed itself before.

Likewise for liveness: agents of a run with a keeper do not follow every presence of the
fleet (retained, so a run's start delivered K of them to each agent: 10^6 at K = 1,000).
The keeper follows them and publishes, retained, one `Absent` notice of who took part in
the run, has not finished or stopped and is gone (left, or crashed CRASH_GRACE_S ago and
not back), again whenever that changes, at most once per ABSENT_EVERY_S: a mass outage is a
few notices, not one per agent; connections that drop and come back within the grace, and
agents that finished the run leaving at its end, send none.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from protocol import Transport, messages, topics
from protocol.membership import CRASH_GRACE_S, LOST
from protocol.signing import Signer

log = logging.getLogger(__name__)

DONE_STATES = ("training", "stopped", "done")
"""Statuses an agent publishes after finishing a round (its `round` field)."""
LEFT_STATES = ("rejected", "failed")
"""Statuses after which an agent will report no further round."""
DEFAULT_VOTE_WAIT_S = 60.0
"""How long a round's tally waits for late reports when the run sets no `vote_s` (the
agents' own default vote timeout)."""
POLL_S = 0.5
"""How often the keeper looks for a round whose wait ran out."""
ABSENT_EVERY_S = 2.0
"""The `Absent` notice goes out at most this often: an outage of many agents at once (a
broker restart, a saturated host) is a few notices to each agent, not one per agent."""


@dataclass
class _Heard:
    """What the keeper heard of the agents."""

    ready: set[str] = field(default_factory=set)
    done_up_to: dict[str, int] = field(default_factory=dict)
    votes: dict[int, dict[str, bool]] = field(default_factory=dict)
    stopped: dict[str, int] = field(default_factory=dict)
    left: set[str] = field(default_factory=set)
    offline: dict[str, tuple[str, float]] = field(default_factory=dict)
    """Agents whose presence says offline -> its reason, and since when (monotonic)."""
    first_report: dict[int, float] = field(default_factory=dict)


class TallyKeeper:
    """Publishes round 0..rounds' tallies of one run, in order, each once."""

    def __init__(
        self,
        *,
        fleet: str,
        run_id: str,
        roster: list[str],
        rounds: int,
        transport: Transport,
        sender: str,
        key: Signer | None,
        wait_s: float,
        start_wait_s: float,
        crash_grace_s: float = CRASH_GRACE_S,
    ) -> None:
        self.fleet, self.run_id, self.sender, self.key = fleet, run_id, sender, key
        self.roster = sorted(roster)
        self.rounds = rounds
        self.transport = transport
        self.wait_s, self.start_wait_s = wait_s, start_wait_s
        self.crash_grace_s = crash_grace_s
        self.next_round = 0
        self._heard = _Heard()
        self._absent: set[str] = set()
        """What the last `Absent` notice said."""
        self._absent_at = -float("inf")
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="tally-keeper", daemon=True)

    def start(self) -> None:
        self._started = time.monotonic()
        self._thread.start()

    def close(self) -> None:
        self._stop.set()

    # ------------------------------------------------------------------ what agents say

    def on_status(self, message: messages.Status) -> None:
        """A status of this run from a roster member (the conductor checked both)."""
        with self._lock:
            heard = self._heard
            heard.ready.add(message.sender)
            if message.state in DONE_STATES and message.round >= 1:
                done = max(heard.done_up_to.get(message.sender, 0), message.round)
                heard.done_up_to[message.sender] = done
                heard.first_report.setdefault(message.round, time.monotonic())
            if message.stopped:
                heard.stopped[message.sender] = message.round
            if message.state in LEFT_STATES:
                heard.left.add(message.sender)
            self._publish_due()

    def on_vote(self, message: messages.Vote) -> None:
        with self._lock:
            self._heard.votes.setdefault(message.round, {}).setdefault(message.sender, message.vote)

    def on_presence(self, agent: str, online: bool, reason: str = "") -> None:
        """A fresh presence of a roster member (the conductor checked both)."""
        with self._lock:
            if online:
                self._heard.offline.pop(agent, None)
            else:
                self._heard.offline.setdefault(agent, (reason, time.monotonic()))
            self._publish_due()
            self._publish_absent(at_most_every_s=ABSENT_EVERY_S)

    # ------------------------------------------------------------------ absences

    def absent(self) -> set[str]:
        """Who took part in the run (is ready), has not finished it, stopped early or left,
        and is gone: left ("shutdown"), or crashed ("lost") `crash_grace_s` ago and not back.
        The agents wait for nobody listed here; a connection that drops on keep-alive and
        comes back within the grace is never listed, so it costs the fleet no notice."""
        heard, now = self._heard, time.monotonic()
        return {
            agent
            for agent, (reason, since) in heard.offline.items()
            if (reason != LOST or now - since >= self.crash_grace_s)
            and agent in heard.ready
            and agent not in heard.left
            and agent not in heard.stopped
            and heard.done_up_to.get(agent, 0) < self.rounds
        }

    def _publish_absent(self, at_most_every_s: float) -> None:
        """Publish the `Absent` notice if it changed, unless one went out within
        `at_most_every_s` (the poll sends it then). Lock held."""
        absent = self.absent()
        if absent == self._absent or time.monotonic() - self._absent_at < at_most_every_s:
            return
        notice = messages.Absent(
            fleet=self.fleet,
            sender=self.sender,
            run_id=self.run_id,
            gone=messages.bitmap(absent, self.roster),
        )
        self._absent, self._absent_at = absent, time.monotonic()
        self._send(topics.absent(self.fleet, self.sender), messages.encode(notice, key=self.key))

    # ------------------------------------------------------------------ tallies

    def _poll(self) -> None:
        while not self._stop.wait(POLL_S):
            with self._lock:
                self._publish_absent(at_most_every_s=ABSENT_EVERY_S)
                if self.next_round <= self.rounds:
                    self._publish_due()

    def _complete(self, round_: int) -> bool:
        """Every agent still in the run reported `round_` (round 0: is ready)."""
        heard = self._heard
        for agent in self.roster:
            if agent in heard.left or agent in heard.offline:
                continue
            if round_ == 0:
                if agent not in heard.ready:
                    return False
            elif (
                heard.done_up_to.get(agent, 0) < round_
                and heard.stopped.get(agent, round_) >= round_
            ):
                return False
        return True

    def _timed_out(self, round_: int) -> bool:
        if round_ == 0:
            return time.monotonic() - self._started >= self.start_wait_s
        first = self._heard.first_report.get(round_)
        return first is not None and time.monotonic() - first >= self.wait_s

    def _publish_due(self) -> None:
        """Publish the next rounds' tallies that are complete or timed out (lock held)."""
        while self.next_round <= self.rounds and (
            self._complete(self.next_round) or self._timed_out(self.next_round)
        ):
            self._publish(self.next_round)
            self.next_round += 1

    def _publish(self, round_: int) -> None:
        heard = self._heard
        if round_ == 0:
            done = heard.ready
        else:
            done = {a for a, last in heard.done_up_to.items() if last >= round_}
        votes = heard.votes.get(round_, {})
        tally = messages.Tally(
            fleet=self.fleet,
            sender=self.sender,
            run_id=self.run_id,
            round=round_,
            done=messages.bitmap(done, self.roster),
            voted=messages.bitmap(votes, self.roster) if votes else b"",
            yes=messages.bitmap((a for a, v in votes.items() if v), self.roster) if votes else b"",
            stopped=dict(heard.stopped),
            left=sorted(heard.left),
        )
        topic = topics.round_topic(self.fleet, round_, "tally", self.sender)
        self._send(topic, messages.encode(tally, key=self.key))

    def _send(self, topic: str, payload: bytes) -> None:
        try:
            self.transport.publish(topic, payload, retain=True)
        except RuntimeError as exc:  # the transport stopped: the run is over
            log.debug("%s not sent: %s", topic, exc)

    def clear(self) -> None:
        """Clear the retained tallies and absence notice (the run is over)."""
        if self._absent_at > -float("inf"):
            self.transport.clear_retained(topics.absent(self.fleet, self.sender))
        for round_ in range(self.next_round):
            self.transport.clear_retained(
                topics.round_topic(self.fleet, round_, "tally", self.sender)
            )
