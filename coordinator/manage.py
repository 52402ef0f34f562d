"""`coordinator runs`, `cancel` and `forget`: looking after a fleet that runs for months.

`runs` reads the gateway's run registry (`coordinator.runs`); it needs no broker. `cancel`
and `forget` act on the fleet's broker through a plain connection of their own, not as a
member: the member id `coordinator` is held by a running `coordinator run`, and taking it
would look like a second coordinator to the fleet.

- cancel: the fleet's retained run message is published again, signed like it, with
  `cancelled` set (`protocol.messages.RunConfig`); its agents end the run after the round
  they are in and say so in their status ("cancelled"), and the `coordinator run` that
  conducts it ends it too.
- forget: an agent's retained presence, status and telemetry are cleared, so a device that
  is gone for good leaves the fleet's table; an agent that is in fact alive is asked to
  announce itself again (`topics.announce`), and does.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import click
import msgpack
from rich import box
from rich.table import Table

from coordinator.broker_config import COORDINATOR
from coordinator.runs import INTERRUPTED, RunEntry, end_entry, find_entry
from coordinator.watch import LOCAL_BROKER, connected, require_broker
from protocol import MqttTransport, ProtocolError, messages, topics
from protocol.cli import BrokerSettings
from protocol.messages import FINAL_STATES
from protocol.signing import MemberKeys, Signer

CONNECT_TIMEOUT_S = 5.0
RETAINED_WAIT_S = 1.5
"""How long retained messages may take to arrive after a subscription is acknowledged."""
STATE_STYLES = {"running": "green", INTERRUPTED: "yellow", "failed": "red", "cancelled": "dim"}


def runs_table(entries: list[RunEntry], base: Path) -> Table:
    """The recorded runs, oldest first: what each is, how far it got and when it began."""
    fleets = {entry.fleet for entry in entries}
    table = Table(title=f"runs in {base}", box=box.SIMPLE_HEAD, pad_edge=False)
    # The id and the state whole, however narrow the output: `cancel` and `forget` need the
    # id, and a pipe or journald is 80 columns to rich.
    ids = max((len(e.run_id) for e in entries), default=0)
    states = max((len(e.shown_state) for e in entries), default=0)
    table.add_column("run", no_wrap=True, min_width=ids)
    if len(fleets) > 1:
        table.add_column("fleet")
    table.add_column("strategy")
    table.add_column("state", no_wrap=True, min_width=states)
    for name in ("rounds", "agents", "started"):
        table.add_column(name, justify="right", no_wrap=True)
    for entry in entries:
        state = entry.shown_state
        style = STATE_STYLES.get(state)
        table.add_row(
            entry.run_id,
            *((entry.fleet,) if len(fleets) > 1 else ()),
            entry.strategy,
            f"[{style}]{state}[/]" if style else state,
            f"{entry.rounds_done}/{entry.rounds}",
            str(len(entry.agents)),
            time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.started)),
        )
    return table


@contextmanager
def fleet_connection(settings: BrokerSettings) -> Iterator[MqttTransport]:
    """A plain connection to the fleet's broker (this machine's unless given) under a
    client id of its own: no member id, no presence. Nothing answering there, or a refusal,
    is a one-line error."""
    broker = settings.address or LOCAL_BROKER
    require_broker(broker, settings.address is not None)
    transport = MqttTransport(broker, settings.transport_options(None))
    transport.start()
    try:
        connected(transport, CONNECT_TIMEOUT_S)
        yield transport
    finally:
        transport.stop()


def is_signed(payload: bytes) -> bool:
    """Whether a message carries a signature (the envelope's last item); a fleet whose
    messages are signed takes none that is not."""
    try:
        items = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        return False
    return isinstance(items, list) and bool(items) and items[-1] is not None


def require_key(payload: bytes, key: Signer | None, fleet: str) -> None:
    if key is None and is_signed(payload):
        raise click.ClickException(
            f"fleet {fleet} signs its messages: give the key `coordinator run` signs with "
            "(--key-file, or --admitted with --identity)"
        )


class Retained:
    """The messages of some subscriptions as they come, the retained ones first; `changed`
    wakes a waiter on each."""

    def __init__(self, transport: MqttTransport) -> None:
        self.transport = transport
        self.messages: list[tuple[float, str, bytes]] = []
        self.changed = threading.Condition()

    def follow(self, *topic_filters: str) -> None:
        """Subscribe and wait until the broker acknowledged (and sent what it retains)."""
        for topic_filter in topic_filters:
            self.transport.subscribe(topic_filter, self._on_message)
        if not self.transport.wait_subscribed(CONNECT_TIMEOUT_S):
            raise click.ClickException(f"the MQTT broker at {self.transport.broker} did not answer")

    def _on_message(self, topic: str, payload: bytes) -> None:
        with self.changed:
            self.messages.append((time.monotonic(), topic, payload))
            self.changed.notify_all()

    def wait(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until `done()` (checked on every message) or `timeout_s` passed."""
        with self.changed:
            return self.changed.wait_for(done, timeout_s)

    def latest(self, topic: str, since: float = 0.0) -> bytes | None:
        with self.changed:
            found = [p for at, t, p in self.messages if t == topic and at >= since]
        return found[-1] if found else None


# ----------------------------------------------------------------------------- cancel


@dataclasses.dataclass
class Cancellation:
    """What `coordinator cancel` did: the run, and the state each of its agents showed."""

    run_id: str
    fleet: str
    agents: dict[str, str]
    """agent -> its final state for the run (cancelled, done, ...), "idle" when not in it,
    "offline", or the state it is still in when the wait ran out."""
    rounds: dict[str, int] = dataclasses.field(default_factory=dict)
    already: bool = False
    """The run had been cancelled before."""

    @property
    def pending(self) -> list[str]:
        """Agents still in the run."""
        return [a for a, s in self.agents.items() if s not in (*FINAL_STATES, "idle", "offline")]

    def as_json(self) -> dict[str, object]:
        return {"run_id": self.run_id, "cancelled": True, "agents": self.agents}


def on_run_message(
    retained: Retained, fleet: str, run_id: str, key: Signer | None
) -> messages.RunConfig:
    """The fleet's run message, checked to be `run_id`'s: anything else is a one-line
    error that says what is on instead."""
    payload = retained.latest(topics.run(fleet))
    on: messages.Message | None = None
    if payload:
        require_key(payload, key, fleet)
        try:
            on = messages.decode(payload, key=key)
        except ProtocolError as exc:
            raise click.ClickException(
                f"the run message of fleet {fleet} does not check with this key ({exc}): give "
                "the key `coordinator run` signs with"
            ) from None
    if not isinstance(on, messages.RunConfig) or on.run_id != run_id:
        now = (
            f"the run on now: {on.run_id}" if isinstance(on, messages.RunConfig) else "no run is on"
        )
        raise click.ClickException(f"run {run_id} is not on in fleet {fleet} ({now})")
    if isinstance(key, MemberKeys) and on.sender not in {key.me, *key.aliases}:
        raise click.ClickException(
            f"run {run_id} was published by {on.sender}, not by a coordinator: only its "
            "publisher can cancel it"
        )
    return on


class RunAgents:
    """Each roster agent's state as far as one run goes (see `Cancellation.agents`), folded
    from the statuses and presences received, in order: a final state of the run, once
    seen, stays, though "idle" follows it."""

    def __init__(self, run: messages.RunConfig, key: Signer | None) -> None:
        self.run = run
        self._key = key
        self._read = 0
        self._states: dict[str, str] = {}
        self._rounds: dict[str, int] = {}
        self._online: dict[str, bool] = {}

    def update(self, retained: Retained) -> Cancellation:
        """Fold in what arrived since the last call (called with `retained.changed` held
        by `Retained.wait`, or not: the lock is re-entrant)."""
        with retained.changed:
            received = retained.messages[self._read :]
            self._read += len(received)
        for _at, _topic, payload in received:
            self._fold(payload)
        states = {}
        for agent in sorted(self.run.roster):
            state = self._states.get(agent, "unknown")
            if state not in (*FINAL_STATES, "idle") and not self._online.get(agent, False):
                state = "offline"
            states[agent] = state
        return Cancellation(self.run.run_id, self.run.fleet, states, dict(self._rounds))

    def heard_all(self, retained: Retained) -> bool:
        """Whether every roster agent's presence has arrived: the broker sends the retained
        presences after the run message, and an agent not heard of yet is not offline."""
        self.update(retained)
        return set(self.run.roster) <= set(self._online)

    def _fold(self, payload: bytes) -> None:
        try:
            message = messages.decode(payload, key=self._key)
        except ProtocolError:
            return
        agent = message.sender
        if agent not in self.run.roster:
            return
        if isinstance(message, messages.Presence):
            self._online[agent] = message.online
        elif isinstance(message, messages.Status) and self._states.get(agent) not in FINAL_STATES:
            ours = message.run_id == self.run.run_id
            self._states[agent] = message.state if ours else "idle"
            self._rounds[agent] = message.round if ours else 0


def cancel_run(
    settings: BrokerSettings,
    fleet: str,
    run_id: str,
    key: Signer | None,
    wait_s: float,
    say: Callable[[str], None],
) -> Cancellation:
    """Publish `run_id`'s run message again with `cancelled` set and wait (up to `wait_s`,
    after up to RETAINED_WAIT_S for the agents' retained presences) until every agent of it
    that is online has ended it."""
    with fleet_connection(settings) as transport:
        retained = Retained(transport)
        retained.follow(topics.run(fleet), topics.status(fleet), topics.presence(fleet))
        retained.wait(lambda: retained.latest(topics.run(fleet)) is not None, RETAINED_WAIT_S)
        run = on_run_message(retained, fleet, run_id, key)
        called_off = dataclasses.replace(run, cancelled=True)
        sent = transport.publish(
            topics.run(fleet), messages.encode(called_off, key=key), retain=True
        )
        if not sent.wait_for_publish(CONNECT_TIMEOUT_S):
            raise click.ClickException(f"the MQTT broker at {transport.broker} did not take it")
        say(
            f"cancelled run {run_id} in fleet {fleet}; waiting up to {wait_s:g}s for its "
            f"{len(run.roster)} agents to end their round"
        )
        agents = RunAgents(run, key)
        retained.wait(lambda: agents.heard_all(retained), RETAINED_WAIT_S)
        retained.wait(lambda: not agents.update(retained).pending, wait_s)
        done = agents.update(retained)
        done.already = run.cancelled
        return done


def describe_cancellation(done: Cancellation, wait_s: float) -> list[str]:
    """Who stopped, who is offline and who is still in its round, one line each group."""
    groups: dict[str, list[str]] = {"stopped": [], "offline": [], "pending": []}
    for agent, state in done.agents.items():
        if state == "offline":
            groups["offline"].append(agent)
        elif agent in done.pending:
            where = f" round {done.rounds[agent]}" if done.rounds.get(agent) else ""
            groups["pending"].append(f"{agent} ({state}{where})")
        elif state == "cancelled" and done.rounds.get(agent):
            groups["stopped"].append(f"{agent} (cancelled after round {done.rounds[agent]})")
        else:
            groups["stopped"].append(f"{agent} ({state})")
    lines = [
        f"run {done.run_id} in fleet {done.fleet} is cancelled"
        + (" (it already was)" if done.already else "")
    ]
    if groups["stopped"]:
        lines.append(f"stopped: {', '.join(groups['stopped'])}")
    if groups["offline"]:
        lines.append(
            f"offline: {', '.join(groups['offline'])} (they end the run when they are back)"
        )
    if groups["pending"]:
        lines.append(
            f"still in the run after {wait_s:g}s: {', '.join(groups['pending'])} (each ends it "
            "after its round)"
        )
    return lines


def after_rounds(rounds: Mapping[str, int]) -> str:
    """'after round 9', or each agent's where they differ ('after round 9 (a1), 10 (a2)'):
    the rounds a cancelled run's agents say they ended after, each ending the round it was
    in when the cancel reached it."""
    ended = sorted(set(rounds.values()))
    if len(ended) <= 1:
        return f"after round {ended[0] if ended else 0}"
    return "after round " + ", ".join(f"{r} ({a})" for a, r in sorted(rounds.items()))


def mark_cancelled(base: Path, run_id: str) -> bool:
    """Record the run as cancelled in the gateway's registry when no `coordinator run`
    conducts it any more (that one records it itself); whether it did."""
    entry = find_entry(base, run_id)
    if entry is None or entry.shown_state != INTERRUPTED:
        return False
    end_entry(base, entry, "cancelled")
    return True


# ----------------------------------------------------------------------------- forget


@dataclasses.dataclass
class Forgotten:
    """What `coordinator forget` found: the agent's presence before, and whether it
    announced itself again (it is alive)."""

    fleet: str
    agent: str
    was: str
    """online, offline, lost, or unknown (no presence retained, or one that did not check)."""
    online: bool

    def as_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        if self.online:
            return f"agent {self.agent} is online: it announced itself again"
        if self.was == "online":
            return (
                f"forgot agent {self.agent}; its presence said online, but it did not announce "
                "itself again (it will when it reconnects)"
            )
        return f"forgot agent {self.agent} (it was {self.was})"


def presence_word(payload: bytes | None, agent: str, key: Signer | None) -> str:
    if not payload:
        return "unknown"
    try:
        message = messages.decode(payload, key=key)
    except ProtocolError:
        return "unknown"
    if not isinstance(message, messages.Presence) or message.sender != agent:
        return "unknown"
    return "online" if message.online else "lost" if message.reason == "lost" else "offline"


def forget_agent(
    settings: BrokerSettings, fleet: str, agent: str, key: Signer | None, wait_s: float
) -> Forgotten:
    """Clear `agent`'s retained presence, status and telemetry, check the broker did, ask
    the agent to announce itself again, and wait `wait_s` for it to."""
    own = (topics.presence(fleet, agent), topics.status(fleet, agent))
    with fleet_connection(settings) as transport:
        retained = Retained(transport)
        retained.follow(*own)  # not the telemetry: plain JSON, which is no frame
        retained.wait(lambda: all(retained.latest(t) for t in own), RETAINED_WAIT_S)
        held = [t for t in own if retained.latest(t)]
        if not held:
            raise click.ClickException(f"fleet {fleet} has no agent {agent} on this broker")
        require_key(retained.latest(held[0]) or b"", key, fleet)
        was = presence_word(retained.latest(own[0]), agent, key)
        for topic in (*own, topics.telemetry(fleet, agent)):
            if not transport.clear_retained(topic).wait_for_publish(CONNECT_TIMEOUT_S):
                raise click.ClickException(f"the MQTT broker at {transport.broker} did not take it")
        check_cleared(settings, held[0])
        asked = time.monotonic()
        request = messages.Request(fleet=fleet, sender=COORDINATOR, target=agent)
        transport.publish(topics.announce(fleet, agent), messages.encode(request, key=key))
        back = retained.wait(
            lambda: presence_word(retained.latest(own[0], asked), agent, key) == "online", wait_s
        )
        return Forgotten(fleet, agent, was, back)


def check_cleared(settings: BrokerSettings, topic: str) -> None:
    """Subscribe to `topic` anew: a broker that still holds its message refused to clear it
    (an ACL that lets a login publish only on its own member's topics). A connection of its
    own, since one that received the message takes it again for a duplicate. The presence
    is the topic to ask of: a live agent publishes it only when asked or reconnecting."""
    with fleet_connection(settings) as transport:
        retained = Retained(transport)
        retained.follow(topic)
        if retained.wait(lambda: retained.latest(topic) is not None, RETAINED_WAIT_S / 3):
            raise click.ClickException(
                f"the broker kept {topic}: its ACL does not let this login clear another "
                "member's topics (log in as the coordinator, with an ACL that grants it)"
            )
