"""A flood of garbage messages costs a bounded number of log lines, and each line says the
sender is only claimed."""

from __future__ import annotations

import logging
from collections.abc import Callable

import paho.mqtt.client as paho
import pytest

from agent.runtime import Expected, Inbox, expected_shapes
from coordinator.aggregator import Intake
from coordinator.fleet import FleetView
from protocol import BrokerAddress, MqttTransport, messages, topics
from protocol import mqtt as mqtt_module
from protocol.logs import BURST, RejectionLog

FLEET, RUN = "lab", "run-1"
FLOOD = 1000


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_one_warning_per_kind_and_claimed_sender_per_interval_then_a_count() -> None:
    clock = Clock()
    written = logging.getLogger("test.rejections")
    rejections = RejectionLog(written, interval_s=10.0, clock=clock)
    assert rejections.reject("model", "b", "t", "bad")
    assert not any(rejections.reject("model", "b", "t", "bad") for _ in range(41))
    assert rejections.reject("vote", "b", "t", "bad"), "another kind has its own limit"
    clock.now = 10.0
    assert rejections.reject("model", "b", "t", "bad")


def test_the_next_warning_counts_those_left_out(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    rejections = RejectionLog(logging.getLogger("test.rejections"), clock=clock)
    with caplog.at_level(logging.WARNING):
        for _ in range(FLOOD):
            rejections.reject("model", "b", "fl/v1/lab/round/1/model/b", "bad")
        clock.now = 60.0
        rejections.reject("model", "b", "fl/v1/lab/round/1/model/b", "bad")
    first, second = lines(caplog)
    assert "claimed sender 'b'" in first and "more rejected" not in first
    assert f"({FLOOD - 1} more rejected since the last warning)" in second


def flood(feed: Callable[[str, bytes], object], kind: str = "model") -> None:
    """Garbage under many claimed senders, and under one."""
    for i in range(FLOOD):
        sender = f"x{i}" if i % 2 else "b"
        topic = (
            topics.presence(FLEET, sender)
            if kind == "presence"
            else topics.round_topic(FLEET, 1, kind, sender)
        )
        feed(topic, b"\x93garbage" * (i % 7 + 1))


def assert_bounded(caplog: pytest.LogCaptureFixture) -> None:
    written = lines(caplog)
    assert 1 <= len(written) <= BURST
    assert all("claimed sender" in line for line in written), written
    assert sum(len(line) for line in written) < 2000


def test_an_agents_inbox_logs_a_flood_in_a_few_lines(caplog: pytest.LogCaptureFixture) -> None:
    box = Inbox(Expected(FLEET, RUN, frozenset({"a", "b"}), expected_shapes({})))
    with caplog.at_level(logging.WARNING):
        flood(box.on_model)
        flood(box.on_vote, "vote")
    assert box.rejected == 2 * FLOOD
    assert_bounded(caplog)


def test_the_aggregator_logs_a_flood_in_a_few_lines(caplog: pytest.LogCaptureFixture) -> None:
    intake = Intake(
        fleet=FLEET,
        run_id=RUN,
        roster=["a", "b"],
        me="coordinator",
        key=None,
        layer_groups={},
        resend=lambda round_: None,
    )
    with caplog.at_level(logging.WARNING):
        flood(intake.on_update, "update")
    assert intake.rejected == FLOOD
    assert_bounded(caplog)


def test_the_fleet_view_logs_a_flood_in_a_few_lines(caplog: pytest.LogCaptureFixture) -> None:
    view = FleetView()
    spoofed = messages.encode(messages.Presence(fleet=FLEET, sender="b", online=True, since=1.0))
    with caplog.at_level(logging.WARNING):
        flood(view.feed, "presence")
        for i in range(FLOOD):
            view.feed(topics.presence(FLEET, f"y{i}"), spoofed)
    assert view.rejected == 2 * FLOOD and view.entries() == []
    assert_bounded(caplog)


def test_a_transport_logs_a_flood_of_bad_frames_in_a_few_lines(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mqtt_module, "_DROPS", RejectionLog(mqtt_module.log))
    transport = MqttTransport(BrokerAddress("127.0.0.1", 1))  # never connected: fed directly
    transport.subscribe(topics.round_topic(FLEET, "+", "model"), lambda topic, payload: None)

    def feed(topic: str, payload: bytes) -> None:
        frame = paho.MQTTMessage(topic=topic.encode())
        frame.payload = payload
        transport._on_message(None, None, frame)  # type: ignore[arg-type]

    with caplog.at_level(logging.WARNING):
        flood(feed)
    assert transport.stats["dropped_frames"] == FLOOD
    assert_bounded(caplog)
