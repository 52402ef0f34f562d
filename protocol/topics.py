"""MQTT topic names: lower case, general to specific, no leading slash.

fl/v1/<fleet>/presence/<agent>            retained birth / last will
fl/v1/<fleet>/status/<agent>              retained status
fl/v1/<fleet>/absent/<keeper>             the run's keeper: who of the run is offline (retained)
fl/v1/<fleet>/telemetry/<agent>           retained JSON copy of the status (optional; plain
                                          UTF-8, unframed, for MQTT tools)
fl/v1/<fleet>/log/<agent>                 the agent's log records of its current run (QoS 0,
                                          never retained; `protocol.fleet_logs`)
fl/v1/<fleet>/probe/<agent>               "is this agent id taken?" (never retained)
fl/v1/<fleet>/probe/<agent>/answer        "yes: I hold it" (never retained)
fl/v1/<fleet>/run                         retained run config and roster
fl/v1/<fleet>/announce/<agent>            the coordinator asks a live agent to publish its
                                          presence and status again (`coordinator forget`)
fl/v1/<fleet>/round/<t>/<kind>/<agent>    model, vote, divergence, update, tally (the
                                          keeper's, retained)
fl/v1/<fleet>/round/<t>/<kind>/<agent>    secure aggregation: keys, keylist, support,
                                          masked, survivors, consent, reveal
                                          (`protocol.secagg`)
fl/v1/<fleet>/round/<t>/request/<agent>/<to>  a request, addressed to its target alone
fl/v1/<fleet>/round/<t>/shares/<agent>/<to>   encrypted secret shares, to the aggregator
                                              or relayed by it to their holder
fl/v1/<fleet>/round/<t>/resend/<agent>/<to>   what <agent> published after round t, sent
                                              again to the one peer that asked for it
fl/v1/<fleet>/round/<t>/model/<agent>/<i>     layer i of a model (`--wire layers`: only the
                                              layers neighbours asked for)
fl/v1/<fleet>/round/<t>/global            the aggregate of a centralized round
fl/v1/<fleet>/round/<t>/global/<agent>    one participant's own part of it (FedSPU)
"""

from __future__ import annotations

import functools
import re

from protocol.errors import ProtocolError

PREFIX = "fl/v1"
ROUND_KINDS = ("model", "vote", "divergence", "request", "update", "tally")
SECAGG_KINDS = ("keys", "keylist", "support", "masked", "survivors", "consent", "reveal")
"""Secure aggregation's round messages (`protocol.secagg`): a participant's keys, the
entries its vector covers (support: FedAdam-Top and -SSM), masked vector, signature on the
survivors (consent) and reveal; the aggregator's key list, union of the supports, survivors
and the signatures it forwards (consent) (`shares` are addressed)."""
ADDRESSED_KINDS = ("request", "resend", "shares")
"""Round messages addressed to one agent (`round_topic`'s `to`): only their target needs them."""
_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
_INDEX = re.compile(r"^(0|[1-9][0-9]{0,3})$")


def check_name(name: str, what: str = "name") -> str:
    """Fleet and agent names become topic levels, so they must not hold '/', '+' or '#'."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ProtocolError(
            f"invalid {what} {name!r}: use 1-64 of a-z 0-9 _ . - starting with a letter or digit"
        )
    return name


def fleet_root(fleet: str) -> str:
    """The topic prefix of one fleet, or of every fleet for the wildcard '+'."""
    return f"{PREFIX}/{fleet if fleet == '+' else check_name(fleet, 'fleet')}"


def presence(fleet: str, agent: str = "+") -> str:
    return f"{fleet_root(fleet)}/presence/{agent if agent == '+' else check_name(agent, 'agent')}"


def status(fleet: str, agent: str = "+") -> str:
    return f"{fleet_root(fleet)}/status/{agent if agent == '+' else check_name(agent, 'agent')}"


def absent(fleet: str, keeper: str = "+") -> str:
    """Where a run's keeper (the coordinator) says which of its agents are offline, so that
    agents need not follow every presence of the fleet."""
    return f"{fleet_root(fleet)}/absent/{keeper if keeper == '+' else check_name(keeper, 'agent')}"


def telemetry(fleet: str, agent: str = "+") -> str:
    """Where an agent asked to mirrors its status as plain JSON, for tools that read no
    msgpack (mosquitto_sub, Node-RED, Telegraf)."""
    return f"{fleet_root(fleet)}/telemetry/{agent if agent == '+' else check_name(agent, 'agent')}"


def log(fleet: str, agent: str = "+") -> str:
    """Where an agent publishes its log records during a run, so that the gateway keeps the
    fleet's logs in one place (`coordinator logs`) and nobody needs to log in to each board."""
    return f"{fleet_root(fleet)}/log/{agent if agent == '+' else check_name(agent, 'agent')}"


def probe(fleet: str, agent: str) -> str:
    """Where a member starting under `agent` asks whether a live process holds that id."""
    return f"{fleet_root(fleet)}/probe/{check_name(agent, 'agent')}"


def probe_answer(fleet: str, agent: str) -> str:
    """Where the live holder of `agent` (or a rival claiming it right now) answers."""
    return f"{probe(fleet, agent)}/answer"


def run(fleet: str) -> str:
    return f"{fleet_root(fleet)}/run"


def announce(fleet: str, agent: str = "+") -> str:
    """Where the coordinator asks `agent` to announce itself again: after `coordinator forget`
    cleared its retained messages, a live agent publishes them anew."""
    return f"{fleet_root(fleet)}/announce/{agent if agent == '+' else check_name(agent, 'agent')}"


def round_topic(
    fleet: str, round_: int | str, kind: str, agent: str = "+", to: str | None = None
) -> str:
    """A round message of `agent`, or with `to` one addressed to that agent alone (requests
    and re-sends always are: only their target needs them)."""
    if (to is not None) != (kind in ADDRESSED_KINDS):
        raise ValueError(f"{', '.join(ADDRESSED_KINDS)} and only they are addressed to one agent")
    if kind not in ROUND_KINDS + SECAGG_KINDS + ADDRESSED_KINDS:
        raise ValueError(f"unknown round message kind {kind!r}; expected one of {ROUND_KINDS}")
    who = agent if agent == "+" else check_name(agent, "agent")
    topic = f"{fleet_root(fleet)}/round/{round_}/{kind}/{who}"
    if to is None:
        return topic
    return f"{topic}/{to if to == '+' else check_name(to, 'agent')}"


def layer(fleet: str, round_: int | str, agent: str, index: int | str) -> str:
    """Layer `index` (in the model's layer order) of `agent`'s round model."""
    return f"{round_topic(fleet, round_, 'model', agent)}/{index}"


def global_model(fleet: str, round_: int | str, agent: str | None = None) -> str:
    """The round's broadcast, or with `agent` the part addressed to that participant alone."""
    topic = f"{fleet_root(fleet)}/round/{round_}/global"
    if agent is None:
        return topic
    return f"{topic}/{agent if agent == '+' else check_name(agent, 'agent')}"


def parse(topic: str) -> tuple[str, str, dict[str, str]]:
    """Split a topic into (fleet, kind, fields); raises ProtocolError for foreign topics."""
    parts = topic.split("/")
    if len(parts) < 4 or "/".join(parts[:2]) != PREFIX:
        raise ProtocolError(f"not a fleet topic: {topic!r}")
    fleet, rest = parts[2], parts[3:]
    if rest[0] in ("presence", "status", "absent", "announce", "log") and len(rest) == 2:
        return fleet, rest[0], {"agent": rest[1]}
    if rest == ["run"]:
        return fleet, "run", {}
    if rest[0] == "round" and len(rest) == 3 and rest[2] == "global":
        return fleet, "global", {"round": rest[1]}
    if rest[0] == "round" and len(rest) == 4 and rest[2] == "global":
        return fleet, "global", {"round": rest[1], "to": rest[3]}
    if rest[0] == "round" and len(rest) == 4 and rest[2] in ROUND_KINDS + SECAGG_KINDS:
        return fleet, rest[2], {"round": rest[1], "agent": rest[3]}
    if rest[0] == "round" and len(rest) == 5 and rest[2] in ADDRESSED_KINDS:
        return fleet, rest[2], {"round": rest[1], "agent": rest[3], "to": rest[4]}
    if rest[0] == "round" and len(rest) == 5 and rest[2] == "model" and _INDEX.match(rest[4]):
        return fleet, "model", {"round": rest[1], "agent": rest[3], "layer": rest[4]}
    raise ProtocolError(f"unknown fleet topic: {topic!r}")


def matches(topic_filter: str, topic: str) -> bool:
    """Whether `topic` matches `topic_filter` (`+` one level, `#` the rest, neither at the
    first level of a `$` topic): what paho's `topic_matches_sub` answers, which builds a
    matcher object on every call. A transport asks it for each subscription of each
    delivery, dozens of times a message, so both split forms are cached."""
    levels, parts = _levels(topic_filter), _levels(topic)
    if topic.startswith("$") and levels[0] in ("+", "#"):
        return False
    for index, level in enumerate(levels):
        if level == "#":
            return True
        if index >= len(parts) or (level != "+" and level != parts[index]):
            return False
    return len(levels) == len(parts)


@functools.lru_cache(maxsize=4096)
def _levels(name: str) -> tuple[str, ...]:
    return tuple(name.split("/"))
