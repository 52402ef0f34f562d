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
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from protocol import MqttTransport, messages, topics
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


@dataclass
class _Heard:
    """What the keeper heard of the agents."""

    ready: set[str] = field(default_factory=set)
    done_up_to: dict[str, int] = field(default_factory=dict)
    votes: dict[int, dict[str, bool]] = field(default_factory=dict)
    stopped: dict[str, int] = field(default_factory=dict)
    left: set[str] = field(default_factory=set)
    offline: set[str] = field(default_factory=set)
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
        transport: MqttTransport,
        sender: str,
        key: Signer | None,
        wait_s: float,
        start_wait_s: float,
    ) -> None:
        self.fleet, self.run_id, self.sender, self.key = fleet, run_id, sender, key
        self.roster = sorted(roster)
        self.rounds = rounds
        self.transport = transport
        self.wait_s, self.start_wait_s = wait_s, start_wait_s
        self.next_round = 0
        self._heard = _Heard()
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

    def on_presence(self, agent: str, online: bool) -> None:
        with self._lock:
            (self._heard.offline.discard if online else self._heard.offline.add)(agent)
            self._publish_due()

    # ------------------------------------------------------------------ tallies

    def _poll(self) -> None:
        while not self._stop.wait(POLL_S) and self.next_round <= self.rounds:
            with self._lock:
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
        try:
            self.transport.publish(topic, messages.encode(tally, key=self.key), retain=True)
        except RuntimeError as exc:  # the transport stopped: the run is over
            log.debug("tally of round %d not sent: %s", round_, exc)

    def clear(self) -> None:
        """Clear the retained tallies (the run is over)."""
        for round_ in range(self.next_round):
            self.transport.clear_retained(
                topics.round_topic(self.fleet, round_, "tally", self.sender)
            )
