"""`topics.matches`, the transports' subscription matching, answers as paho's
`topic_matches_sub` (MQTT's rules: `+` one level, `#` the rest and the parent, no wildcard
at the first level of a `$` topic) on every filter and topic of a small alphabet."""

from __future__ import annotations

import itertools

import paho.mqtt.client as paho

from protocol import topics

FILTER_LEVELS = ("a", "b", "+", "#", "", "$SYS")
TOPIC_LEVELS = ("a", "b", "", "$SYS")


def _filters():
    for depth in range(1, 4):
        for levels in itertools.product(FILTER_LEVELS, repeat=depth):
            if "#" not in levels[:-1]:  # '#' is only valid last
                yield "/".join(levels)


def _topics():
    for depth in range(1, 4):
        for levels in itertools.product(TOPIC_LEVELS, repeat=depth):
            yield "/".join(levels)


def test_matches_as_paho_does():
    checked = matched = 0
    for topic_filter in _filters():
        for topic in _topics():
            expected = paho.topic_matches_sub(topic_filter, topic)
            assert topics.matches(topic_filter, topic) == expected, (topic_filter, topic)
            checked += 1
            matched += expected
    assert checked > 10_000 and 0 < matched < checked


def test_fleet_topics_match_their_filters():
    model = topics.round_topic("f1", 3, "model", "agent-7")
    assert topics.matches(topics.round_topic("f1", "+", "model", "+"), model)
    assert topics.matches("fl/v1/f1/#", model)
    assert not topics.matches(topics.round_topic("f1", 4, "model", "+"), model)
    assert not topics.matches(topics.status("f1"), model)
