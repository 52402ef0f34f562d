"""Being a member of a fleet on MQTT: a connection that announces itself and says goodbye.

Presence is the fleet's source of truth for liveness. A member's connection carries a
retained birth (republished on every reconnect) and a retained last will, which the broker
publishes if the member vanishes; a clean shutdown publishes a goodbye instead, so the
fleet can tell a crash ("lost") from a stop ("shutdown") and knows when the stop happened.

A member id is one MQTT client id, and two live clients with one id take the broker session
from each other in turn, forever (two devices left at the default id `raspberrypi`). So
`connect` first claims the id: a short-lived client with a random id asks on
`topics.probe` whether a live process holds it, and the holder answers at once. Silence for
`probe_s` means the id is free; a crashed holder cannot answer, so a restart after a crash
is never blocked. Probes and answers are Presence messages: `online` tells a holder from a
rival claiming the id at this very moment, `reason` carries a per-claim nonce, an answer
names the nonce of the probe it answers (`answers`), and all are signed with the fleet's
key, so a process without it can neither block nor fake an id, and only an answer naming
this claim's nonce counts: a replayed birth or an old answer cannot block a restart. Two
rivals starting together settle it: each answers the other's claim once, and the one with
the earlier (since, nonce) wins.

With a broker login (or a connect proof) the login is the id: a broker that ties client
ids to logins (`coordinator broker-config`'s mosquitto, `use_username_as_clientid`) gives
the prober the member's client id too, so the prober leaves before the member connects.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from protocol import messages, topics
from protocol.errors import ProtocolError
from protocol.logs import RejectionLog
from protocol.mqtt import (
    BrokerAddress,
    Handler,
    MqttTransport,
    TransportOptions,
    tls_problem,
)
from protocol.signing import MemberKeys, Signer, connect_proof

log = logging.getLogger(__name__)

LOST = "lost"
SHUTDOWN = "shutdown"
PROBE_S = 1.0
"""How long a starting member waits for the holder of its id to answer; an answer on a
link the size of a fleet's takes milliseconds, so this is mostly the cost of a free id."""
CRASH_GRACE_S = 10.0
"""How long a fleet still waits for a member whose will says it crashed ("lost"): time to
restart and resume, or for a connection dropped on keep-alive to come back."""
STAMPS_FILE = "presence.stamp"
"""The name of the file in a member's own folder that keeps its latest presence stamp."""
BROKER_WAIT_S = 10.0
"""How long `connect` waits for the broker before it gives up checking the id (the member
still connects, whenever the broker comes up: an agent may start before its broker)."""


class StampFloor:
    """Keeps a member's presence stamps (`messages.Presence.at`) moving forward across its
    starts, whatever its clock does.

    Readers order one member's presences by `at` (`PresenceClock`) to tell a replay from
    the current one, so a device that once started with its clock 20 minutes ahead stamped
    a presence that every later start, its clock put right, would sort before: a reader
    that saw it would take the device's correct presences for replays until the clock
    caught up. So each new stamp is at least the latest one given out plus `STEP`, and that
    latest is kept in `path` (when the member has a folder of its own) for the next start:
    a hybrid logical clock. Stamps are the wall clock again as soon as it has passed the
    latest. One connection's birth and will share a stamp: a stamp given again gets the
    same lifted value."""

    STEP = 1e-3

    def __init__(self, path: Path | None) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._given: tuple[float, float] | None = None
        """The latest (stamp asked for, stamp given)."""

    def lift(self, at: float) -> float:
        """The stamp to publish for `at` (a wall-clock time)."""
        with self._lock:
            if self._given is not None and self._given[0] == at:
                return self._given[1]
            latest = self._given[1] if self._given is not None else self._read()
            lifted = at if latest is None else max(at, latest + self.STEP)
            self._given = (at, lifted)
            self._write(lifted)
            return lifted

    def _read(self) -> float | None:
        if self._path is None:
            return None
        try:
            return float(self._path.read_text(encoding="ascii"))
        except (OSError, ValueError):
            return None

    def _write(self, stamp: float) -> None:
        """Keep `stamp` for the next start; a folder that cannot take it costs only that."""
        if self._path is None:
            return
        temporary = self._path.with_name(f".{self._path.name}.tmp")
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            temporary.write_text(repr(stamp), encoding="ascii")
            os.replace(temporary, self._path)
        except OSError as exc:
            log.debug("cannot keep the presence stamp in %s: %s", self._path, exc)


@dataclass(frozen=True)
class Identity:
    """Who a member is: its presence messages are built from this alone."""

    fleet: str
    sender: str
    role: str = "agent"
    profile: str = ""
    key: Signer | None = None
    since: float = field(default_factory=time.time)
    """When this process began: a claim on the id (`_Claim`) is ordered by it."""
    stamps: Path | None = None
    """The file that keeps the latest presence stamp between starts (`StampFloor`)."""
    floor: StampFloor = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "floor", StampFloor(self.stamps))

    @property
    def topic(self) -> str:
        return topics.presence(self.fleet, self.sender)

    def presence(
        self, online: bool, reason: str = "", since: float | None = None, *, at: float
    ) -> bytes:
        """A presence made at `at` (see `messages.Presence.at`), stamped by `floor`."""
        message = messages.Presence(
            fleet=self.fleet,
            sender=self.sender,
            online=online,
            since=self.since if since is None else since,
            role=self.role,
            profile=self.profile,
            reason=reason,
            at=self.floor.lift(at),
        )
        return messages.encode(message, key=self.key)

    def birth(self, at: float) -> bytes:
        """The birth of the connection that began at `at`: online since then (a member
        that connects again after its broker restarted is online since it came back)."""
        return self.presence(True, since=at, at=at)

    def will(self, at: float) -> bytes:
        """The will of the connection that began at `at`: ordered after its birth, and
        lost after being online since `at`."""
        return self.presence(False, LOST, since=at, at=at)


class PresenceClock:
    """Tells a member's current presence from a replay of an older one.

    Every presence carries `at` (`messages.Presence`): a birth and the will of one
    connection the start of that connection, a goodbye its stop. Ordered by (at, offline
    after online), one member's presences only move forward: a will follows its birth, the
    next connection's birth follows both, a goodbye follows everything. A presence that
    sorts before the latest accepted one is a replay (an old birth making a member that left
    look online, an old will making a live one look lost) and is stale; the latest itself,
    delivered again (a retained message to a new subscription), changes nothing and passes.
    Each member's own clock is compared only with itself, so clocks that disagree across
    devices do no harm, and a member's stamps never go back (`StampFloor`), so neither does
    a device whose clock was set back.
    """

    def __init__(self) -> None:
        self._latest: dict[str, tuple[float, bool]] = {}
        self._born: dict[str, float] = {}

    def fresh(self, message: messages.Presence) -> bool:
        """Whether `message` is current; it also moves the member's clock on."""
        if message.at == 0:  # made without a stamp (by hand, not by `connect`): `since` only
            born = self._born.get(message.sender)
            if born is not None and message.since < born:
                return False
        else:
            order = (message.at, not message.online)
            latest = self._latest.get(message.sender)
            if latest is not None and order < latest:
                return False
            self._latest[message.sender] = order
        if message.online:
            self._born[message.sender] = message.since
        return True

    def born(self, member: str) -> float | None:
        """When `member`'s current session began (its latest birth), None if none was seen:
        a member that comes back has lost what was in flight to it."""
        return self._born.get(member)


class DuplicateMember(ProtocolError):
    """Another live process holds this member's id (or claims it at this very moment)."""

    def __init__(self, identity: Identity, since: float | None) -> None:
        self.fleet, self.agent, self.since = identity.fleet, identity.sender, since
        hint = (
            "give this device its own --id"
            if identity.role == "agent"
            else f"stop the other {identity.role} of this fleet first"
        )
        held = (
            f"is already in use in fleet {self.fleet!r} (online since {_clock(since)})"
            if since is not None
            else f"is being claimed at this moment by another process in fleet {self.fleet!r}"
        )
        super().__init__(f"{identity.role} id {self.agent!r} {held}; {hint}")


def _clock(when: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when))


class _Claim:
    """One process's claim on a member id: it answers probes for the id and notices rivals.

    Handlers run on the dispatcher threads of two transports (the prober and the member),
    the decision on the caller's thread, hence the lock.
    """

    def __init__(self, identity: Identity) -> None:
        self.identity = identity
        self.nonce = secrets.token_hex(8)
        self._lock = threading.Lock()
        self._holding = False
        self._rival: messages.Presence | None = None
        self._answered: set[str] = set()
        """Rival claims answered while claiming: each once, so two claims cannot echo."""
        self._defeated = threading.Event()
        self._rejections = RejectionLog(log)

    def message(self, answers: str = "") -> bytes:
        """A probe, or an answer to the probe whose nonce is `answers`: `online` once this
        process holds the id."""
        with self._lock:
            online = self._holding
        who = self.identity
        claim = messages.Presence(
            fleet=who.fleet,
            sender=who.sender,
            online=online,
            since=who.since,
            role=who.role,
            profile=who.profile,
            reason=self.nonce,
            at=time.time(),
            answers=answers,
        )
        return messages.encode(claim, key=who.key)

    def handler(self, transport: MqttTransport) -> Handler:
        """The handler of the probes and answers arriving on `transport`: a probe is
        answered unless this claim is defeated; an answer counts only if it names this
        claim's nonce, and a rival's claim among them is answered once (so that it learns
        of this one too)."""
        answers = topics.probe_answer(self.identity.fleet, self.identity.sender)

        def on_message(_topic: str, payload: bytes) -> None:
            rival = self._read(payload)
            if rival is None:
                return
            if rival.answers and (
                rival.answers != self.nonce or not self._consider(rival) or rival.online
            ):
                return
            if self._answers(rival.reason):
                # QoS 0: never waits on an outgoing queue full of model frames.
                transport.publish(answers, self.message(answers=rival.reason), qos=0)

        return on_message

    def probe(self, prober: MqttTransport, probe_s: float, broker_wait_s: float) -> bool:
        """Claim the id through `prober`: True once held, False when the broker could not be
        reached to ask (the id is then taken unchecked); DuplicateMember if a rival wins."""
        fleet, agent = self.identity.fleet, self.identity.sender
        prober.subscribe(topics.probe_answer(fleet, agent), self.handler(prober))
        prober.subscribe(topics.probe(fleet, agent), self.handler(prober))
        asked = prober.wait_subscribed(broker_wait_s, or_refused=True)
        if asked:
            prober.publish(topics.probe(fleet, agent), self.message())
            self._defeated.wait(probe_s)
        self.hold()
        return asked

    def hold(self) -> None:
        """Take the id from now on, unless a rival has won it (DuplicateMember)."""
        with self._lock:
            if self._rival is not None:
                rival = self._rival
                raise DuplicateMember(self.identity, rival.since if rival.online else None)
            self._holding = True

    def _read(self, payload: bytes) -> messages.Presence | None:
        """A rival's probe or answer, or None for our own, a foreign or an unsigned one."""
        try:
            message = messages.decode(payload, key=self.identity.key)
        except ProtocolError as exc:
            self._rejections.reject("probe", self.identity.sender, self.identity.topic, exc)
            return None
        if (
            not isinstance(message, messages.Presence)
            or message.fleet != self.identity.fleet
            or message.sender != self.identity.sender
            or message.reason == self.nonce
        ):
            return None
        return message

    def _answers(self, nonce: str) -> bool:
        """Whether to answer the probe or claim `nonce`: always while holding the id, once
        each while claiming it, never once defeated."""
        with self._lock:
            if self._rival is not None:
                return False
            if self._holding:
                return True
            fresh = nonce not in self._answered
            self._answered.add(nonce)
            return fresh

    def _consider(self, rival: messages.Presence) -> bool:
        """Note a rival that answered this claim; False once this claim is lost. While
        claiming, a holder's answer or an earlier claim defeats this one; once held, the
        id is defended, never given up."""
        with self._lock:
            if not self._holding and self._rival is None:
                mine = (self.identity.since, self.nonce)
                if rival.online or (rival.since, rival.reason) < mine:
                    self._rival = rival
                    self._defeated.set()
            return self._rival is None


def connect(
    broker: BrokerAddress,
    identity: Identity,
    options: TransportOptions | None = None,
    *,
    probe_s: float = PROBE_S,
    broker_wait_s: float = BROKER_WAIT_S,
) -> MqttTransport:
    """A started transport whose birth and will announce `identity`, once its id is claimed.

    Raises DuplicateMember when a live process holds the id. Waits up to `probe_s` for
    such an answer (0: no check, for callers whose ids cannot collide) and up to
    `broker_wait_s` for the broker; when it stays unreachable the id is taken unchecked and
    the transport keeps connecting in the background, as it always does.
    The will's `since` is the time the member came online: the broker sends it later, at a
    moment the member cannot know, so readers show it as "lost after coming online then".
    A member with its own key pair and no login proves its key on every connect
    (`signing.connect_proof`), as a broker that checks keys (`--admitted`) requires.
    """
    options = options or TransportOptions()
    proves = options.username is None and options.credentials is None
    if proves and isinstance(identity.key, MemberKeys):
        options = dataclasses.replace(options, credentials=connect_proof(identity.key))
    if options.client_id is None:
        options = dataclasses.replace(options, client_id=f"{identity.fleet}-{identity.sender}")
    claim = _Claim(identity)
    if probe_s <= 0:
        claim.hold()
        return _join(broker, identity, options, claim)
    prober = MqttTransport(broker, dataclasses.replace(options, client_id=None))
    prober.start()
    try:
        asked = claim.probe(prober, probe_s, broker_wait_s)
        if not asked and prober.refused is not None:
            raise ProtocolError(
                f"the MQTT broker {broker} refused the connection ({prober.refused}): "
                + _refusal_hint(options, identity)
            )
        problem = tls_problem(broker, options.tls) if not asked and options.tls else None
        if problem is not None:
            raise ProtocolError(f"{problem}: check --tls-ca and the broker's address")
        if not asked:  # the caller says why no broker answers (`protocol.mqtt.unreachable`)
            log.info("broker %s unreachable: id %r taken unchecked", broker, identity.sender)
        if _logged_in(options):
            prober.stop()  # its client id may be the member's (see the module docstring)
        transport = _join(broker, identity, options, claim)
        # The prober answers for the id until the member does (without a login: no gap
        # between). A broker that let the prober in but refuses the member refuses its id
        # (a per-member login may connect and publish only as itself, its will included).
        subscribed = not asked or transport.wait_subscribed(broker_wait_s, or_refused=True)
        if not subscribed and transport.refused is not None:
            transport.stop()
            raise ProtocolError(
                f"the MQTT broker {broker} refused {identity.role} {identity.sender!r} "
                f"({transport.refused}) although it let its login in: with per-member "
                "logins the id must be the login's (--id)"
            )
        return transport
    finally:
        prober.stop()


def _join(
    broker: BrokerAddress, identity: Identity, options: TransportOptions, claim: _Claim
) -> MqttTransport:
    """Start the member's own transport, which answers the probes for its id from now on."""
    transport = MqttTransport(
        broker,
        options,
        will=(identity.topic, identity.will),
        birth=(identity.topic, identity.birth),
    )
    transport.subscribe(topics.probe(identity.fleet, identity.sender), claim.handler(transport))
    transport.start()
    return transport


def _refusal_hint(options: TransportOptions, identity: Identity) -> str:
    """What to check when the broker refuses: the login, or for a member proving its key,
    whether the gateway admitted this key (a re-imaged board, or a bundle copied to another
    board, has another)."""
    if not isinstance(identity.key, MemberKeys):
        return "check the user name, password and TLS options"
    if options.username == identity.sender:
        return (
            "check the user name, password and TLS options; a gateway whose `coordinator "
            "admit` took this device's key logs it in with that key, not a password: remove "
            "username and password_file from an older bundle's agent.toml"
        )
    if options.username is not None:
        return "check the user name, password and TLS options"
    return (
        f"the gateway takes {identity.sender!r} only with the key it admitted; this device's is "
        f"{identity.key.public} (a re-imaged device is admitted again on the gateway with "
        f"`coordinator admit {identity.sender} {identity.key.public} --replace`)"
    )


def _logged_in(options: TransportOptions) -> bool:
    return options.username is not None or options.credentials is not None


def leave(transport: MqttTransport, identity: Identity, timeout_s: float = 5.0) -> None:
    """Publish the goodbye (when connected), wait for the broker to take it, disconnect."""
    if transport.connected:
        now = time.time()
        goodbye = identity.presence(
            False, SHUTDOWN, since=now, at=max(now, transport.announced.stamp)
        )
        transport.publish(identity.topic, goodbye, retain=True).wait_for_publish(timeout_s)
    transport.stop()
