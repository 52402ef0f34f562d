"""Who may publish where: the fleet's broker ACL, written once for every broker.

Every member logs in to the broker under its own id. An agent may read its own fleet's
topics, not another fleet's (fleets sharing a broker do not see each other's models); the
coordinator's login, which runs the broker, reads every fleet (`coordinator status` and
`watch` follow every fleet at once). Within a fleet, confidentiality comes from TLS,
authenticity from the signatures. A member publishes only the topics that carry its own
id: its presence, status, telemetry, log records and id probe, its round messages, the requests and
re-sends it sends and the layers of its own model. The coordinator also publishes the run,
the centralized rounds' global models, requests to announce again and who of a run is
offline.
A member that could publish on another's topics could impersonate it (a retained presence,
a forged model): the broker refuses it before any receiver has to.

The same grants become mosquitto's `acl_file` (`render_acl`) and are read back from it by the
embedded broker (`parse_acl`), so both brokers enforce one rule.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from protocol import topics
from protocol.errors import ProtocolError

READ_ALL = f"{topics.PREFIX}/#"
"""What the coordinator's login may subscribe to: every fleet's topics (tools such as
`coordinator watch` follow every fleet at once)."""


def fleet_reads(fleet: str) -> str:
    """What an agent may subscribe to: its own fleet's topics."""
    return f"{topics.fleet_root(fleet)}/#"


def member_topics(fleet: str, member: str) -> list[str]:
    """The topic filters that carry `member`'s own id: the only ones an agent may publish."""
    topics.check_name(member, "member")
    own = [
        topics.presence(fleet, member),
        topics.status(fleet, member),
        topics.telemetry(fleet, member),
        topics.log(fleet, member),
        topics.probe(fleet, member),
        topics.probe_answer(fleet, member),
    ]
    # Kinds one by one: `round/+/+/<id>` would also match `round/<t>/global/<id>`, the
    # coordinator's message to that member.
    kinds = [
        kind
        for kind in topics.ROUND_KINDS + topics.SECAGG_KINDS
        if kind not in topics.ADDRESSED_KINDS
    ]
    own += [topics.round_topic(fleet, "+", kind, member) for kind in kinds]
    own += [topics.round_topic(fleet, "+", kind, member, to="+") for kind in topics.ADDRESSED_KINDS]
    own.append(topics.layer(fleet, "+", member, "+"))
    return own


def coordinator_topics(fleet: str) -> list[str]:
    """What only a coordinator publishes: the run, the centralized rounds' global models, the
    requests to announce again and, as the run's keeper, who of the run is offline; and it
    may clear a gone agent's retained presence, status and telemetry (`coordinator forget`:
    an ACL cannot grant empty payloads alone, so the signatures keep it from speaking for
    an agent)."""
    return [
        topics.run(fleet),
        topics.announce(fleet, "+"),
        topics.presence(fleet, "+"),
        topics.status(fleet, "+"),
        topics.telemetry(fleet, "+"),
        topics.absent(fleet, "+"),
        topics.global_model(fleet, "+"),
        topics.global_model(fleet, "+", "+"),
    ]


def covers(pattern: str, topic_filter: str) -> bool:
    """Whether every topic that matches `topic_filter` also matches `pattern` (for a topic
    without wildcards: whether it matches). A `+` in `topic_filter` is covered only by `+`
    or `#` in `pattern`, a `#` only by `#`."""
    wanted, allowed = topic_filter.split("/"), pattern.split("/")
    for index, level in enumerate(allowed):
        if level == "#":
            return True
        if index >= len(wanted) or wanted[index] == "#":
            return False
        if level != "+" and (level != wanted[index] or wanted[index] == "+"):
            return False
    return len(wanted) == len(allowed)


@dataclass(frozen=True)
class Grant:
    """What one broker user may read (subscribe to) and write (publish on)."""

    user: str
    read: tuple[str, ...]
    write: tuple[str, ...]

    def may_publish(self, topic: str) -> bool:
        return any(covers(pattern, topic) for pattern in self.write)

    def may_subscribe(self, topic_filter: str) -> bool:
        return any(covers(pattern, topic_filter) for pattern in self.read)

    def member_ids(self) -> list[tuple[str, str]]:
        """The (fleet, member id) pairs this user publishes the presence of: the member
        ids it speaks as, whose client ids (`<fleet>-<id>`) are its alone."""
        ids = []
        for pattern in self.write:
            try:
                fleet, kind, fields = topics.parse(pattern)
            except ProtocolError:
                continue
            if kind == "presence" and fields["agent"] != "+" and fleet != "+":
                ids.append((fleet, fields["agent"]))
        return ids


def fleet_grants(
    fleet: str,
    agents: Iterable[str],
    coordinator: str | None,
    coordinator_ids: Sequence[str] = (),
) -> list[Grant]:
    """The grants of a fleet: one per agent, and one for the coordinator's login when there
    is one, which may publish as each of `coordinator_ids` (the ids it takes in the fleet)
    besides the coordinator's topics. Without a coordinator, every agent may publish the
    run: the first agent of a fleet formed with `--expect` does."""
    topics.check_name(fleet, "fleet")
    run_topics = [] if coordinator else [topics.run(fleet)]
    grants = []
    for agent in dict.fromkeys(agents):
        writes = tuple(member_topics(fleet, agent) + run_topics)
        grants.append(Grant(agent, (fleet_reads(fleet),), writes))
    if coordinator is not None:
        ids = dict.fromkeys([coordinator, *coordinator_ids])
        own = [pattern for member in ids for pattern in member_topics(fleet, member)]
        grants.append(Grant(coordinator, (READ_ALL,), tuple(own + coordinator_topics(fleet))))
    users = [grant.user for grant in grants]
    if len(set(users)) != len(users):
        raise ProtocolError(f"the coordinator {coordinator!r} is also listed as an agent")
    return grants


def render_acl(grants: Iterable[Grant], header: str = "") -> str:
    """mosquitto's `acl_file` for these grants: one `user` block each."""
    lines = [f"# {line}" for line in header.splitlines()]
    for grant in grants:
        lines += ["", f"user {grant.user}"]
        lines += [f"topic read {pattern}" for pattern in grant.read]
        lines += [f"topic write {pattern}" for pattern in grant.write]
    return "\n".join(lines) + "\n"


def parse_acl(text: str, source: str = "acl") -> dict[str, Grant]:
    """The grants of an `acl_file` in the subset `render_acl` writes (`user` blocks of
    `topic read|write|readwrite PATTERN` lines); anything else is a ProtocolError."""
    read: dict[str, list[str]] = {}
    write: dict[str, list[str]] = {}
    user: str | None = None
    for number, raw in enumerate(text.splitlines(), 1):
        words = raw.split()
        if not words or words[0].startswith("#"):
            continue
        if words[0] == "user" and len(words) == 2:
            user = words[1]
            read.setdefault(user, [])
            write.setdefault(user, [])
        elif words[0] == "topic" and len(words) == 3 and user is not None:
            access, pattern = words[1], words[2]
            if access not in ("read", "write", "readwrite"):
                raise ProtocolError(f"{source}:{number}: unknown access {access!r}")
            if access != "write":
                read[user].append(pattern)
            if access != "read":
                write[user].append(pattern)
        else:
            raise ProtocolError(f"{source}:{number}: expected `user NAME` or `topic ACCESS TOPIC`")
    return {name: Grant(name, tuple(read[name]), tuple(write[name])) for name in read}
