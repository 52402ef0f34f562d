"""Devices that come and go: availability patterns (online share, determinism, work across
offline spans), the run's spec and profiles' tables with one-line errors, the virtual
clock, a link dropped over a real broker, and a duty-cycled agent in a real emulated fleet."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from agent.device.availability import Availability, FleetAvailability, Pattern
from agent.experiment import ExperimentConfig, agent_availability
from agent.learning import preset
from coordinator.virtual_clock import VirtualClock
from firmware_profiles import ProfileError, load_profile
from protocol import BrokerAddress, MqttTransport, TransportOptions, messages, topics

ROSTER = [f"agent-{k:03d}" for k in range(10)]


def online_share(pattern: Pattern, horizon_s: float) -> float:
    """The share of [0, horizon_s) the pattern is online, from its spans."""
    online, t = 0.0, 0.0
    while True:
        t = pattern.next_online(t)
        if t >= horizon_s:
            return online / horizon_s
        end = min(pattern.online_until(t), horizon_s)
        online += end - t
        t = end


@pytest.mark.parametrize("jitter", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("fraction", [0.1, 1 / 3, 0.9])
def test_a_duty_cycle_is_online_its_fraction_over_a_long_horizon(
    fraction: float, jitter: float
) -> None:
    for agent in ROSTER[:3]:
        pattern = Pattern(Availability(fraction, 60.0, jitter), seed=5, agent=agent)
        assert online_share(pattern, 60.0 * 2000) == pytest.approx(fraction, abs=1e-3)


def test_a_dropping_link_is_down_its_share_and_spans_match_online() -> None:
    figures = Availability(drop_every_s=100.0, drop_for_s=10.0, drop_probability=0.5)
    pattern = Pattern(figures, seed=2, agent="a")
    assert online_share(pattern, 100.0 * 4000) == pytest.approx(1 - 0.5 * 0.1, abs=0.01)
    both = Pattern(Availability(0.5, 30.0, 1.0, 100.0, 10.0, 0.5), seed=2, agent="a")
    for t in [k * 0.37 for k in range(3000)]:
        up = both.next_online(t)
        assert both.online(up) and (up == t) == both.online(t)
        assert all(not both.online(s) for s in (t, (t + up) / 2) if s < up)


def test_patterns_are_drawn_from_the_seed_and_the_agent_alone() -> None:
    figures = Availability(0.3, 60.0, 0.8, 300.0, 20.0, 0.5)
    times = [k * 7.3 for k in range(500)]

    def timeline(seed: int, agent: str) -> list[bool]:
        return [Pattern(figures, seed, agent).online(t) for t in times]

    assert timeline(1, "a") == timeline(1, "a")
    assert timeline(1, "a") != timeline(1, "b")
    assert timeline(1, "a") != timeline(2, "a")
    # Another interpreter (its own hash salt) draws the same.
    code = (
        "from agent.device.availability import Availability, Pattern;"
        "p = Pattern(Availability(0.3, 60.0, 0.8, 300.0, 20.0, 0.5), 1, 'a');"
        "print([p.online(k * 7.3) for k in range(500)])"
    )
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert other.strip() == str(timeline(1, "a"))


def a_waking(pattern: Pattern) -> float:
    """The start of an awake span (the first may have begun before time 0)."""
    return pattern.next_online(pattern.online_until(pattern.next_online(0.0)))


def test_work_progresses_only_while_online() -> None:
    pattern = Pattern(Availability(0.5, 10.0), seed=1, agent="a")
    wake = a_waking(pattern)
    sleep = pattern.online_until(wake)
    assert sleep == pytest.approx(wake + 5.0)
    assert pattern.finish(wake, 3.0) == pytest.approx(wake + 3.0)
    # 7 s of work from waking: 5 s now, the other 2 s after the 5 s asleep.
    assert pattern.finish(wake, 7.0) == pytest.approx(wake + 12.0)
    # Started asleep: it waits to wake first.
    assert pattern.finish(sleep + 1.0, 1.0) == pytest.approx(wake + 11.0)
    # 23 s of work: four whole awake spans, four asleep, 3 s of a fifth.
    assert pattern.finish(wake, 23.0) == pytest.approx(wake + 43.0)
    always = Pattern(Availability(), seed=1, agent="a")
    assert always.finish(3.0, 4.5) == 7.5 and always.online(123.0)


def test_the_virtual_clock_finishes_work_around_offline_spans() -> None:
    config = ExperimentConfig(agents=10, seed=4, availability="0.3:0.5:10")
    clock = VirtualClock.of(config, ROSTER)
    sleepers = set(agent_availability(config, ROSTER))
    assert len(sleepers) == 3 and set(clock.patterns) == sleepers
    awake = next(a for a in ROSTER if a not in sleepers)
    assert clock.finish(awake, 2.0, 7.0) == 9.0
    for agent in sleepers:
        wake = a_waking(clock.patterns[agent])
        assert clock.finish(agent, wake, 7.0) == pytest.approx(wake + 12.0)
    plain = VirtualClock.of(ExperimentConfig(agents=10), ROSTER)
    assert not plain.comes_and_goes and plain.finish(ROSTER[0], 1.0, 2.0) == 3.0


def test_the_spec_draws_its_share_of_the_fleet_from_the_seed() -> None:
    def sleepers(seed: int, spec: str = "0.3:0.33:60") -> set[str]:
        return set(agent_availability(ExperimentConfig(seed=seed, availability=spec), ROSTER))

    assert len(sleepers(1)) == 3 and sleepers(1) == sleepers(1) != sleepers(2)
    assert sleepers(1, "0:0.5:60") == set() and sleepers(1, "1:0.5:60") == set(ROSTER)
    spec = FleetAvailability.parse("0.5:0.25:30:0.2,drop=120:15:0.4")
    assert spec.share == 0.5
    assert spec.availability == Availability(0.25, 30.0, 0.2, 120.0, 15.0, 0.4)
    assert FleetAvailability.parse("1:1:60").availability.always_online


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("0.3:0.33", "give SHARE:ONLINE:PERIOD"),
        ("0.3:x:60", "must be a number"),
        ("0.3:nan:60", "finite"),
        ("1.5:0.3:60", "SHARE must be in [0, 1]"),
        ("0.3:0:60", "online_fraction must be in (0, 1]"),
        ("0.3:0.3:0", "period_s must be in"),
        ("0.3:0.3:60:2", "jitter must be in [0, 1]"),
        ("0.3:0.3:60,drip=1:2", "unknown part 'drip=1:2'"),
        ("0.3:0.3:60,drop=10", "give drop=EVERY:FOR"),
        ("0.3:0.3:60,drop=10:20", "drop_for_s must be > 0 and less than drop_every_s"),
    ],
)
def test_a_bad_spec_is_refused_in_one_line(spec: str, says: str) -> None:
    with pytest.raises(ValueError) as caught:
        ExperimentConfig(availability=spec).validate()
    text = str(caught.value)
    assert says in text and "\n" not in text and text.startswith(f"--availability {spec!r}")


def test_real_devices_are_not_told_to_sleep() -> None:
    config = ExperimentConfig(
        dataset="device", input_shape=(4,), classes=2, availability="0.3:0.33:60"
    )
    with pytest.raises(ValueError, match="real devices .* come and go by themselves"):
        config.validate()


def test_a_bad_spec_on_the_command_line_is_one_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", "from coordinator.cli import main; main(prog_name='coordinator')",
         "simulate", "--availability", "0.3:2:60", "--rounds", "1",
         "--report", str(tmp_path / "r.json")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert "online_fraction must be in (0, 1]" in result.stderr
    assert "Traceback" not in result.stderr


PROFILE = """name = "sleepy-board"
description = "A battery board that sleeps"
peak_fp32_gflops = 10.0
memory_mb = 512
idle_power_w = 0.5
max_power_w = 2.0
link_bandwidth_mbps = 5.0
radio_power_w = 0.3
cpu_cores = 2
"""


def test_a_profile_carries_an_availability_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "sleepy-board.toml"
    path.write_text(PROFILE + "\n[availability]\nonline_fraction = 0.25\nperiod_s = 120\n")
    monkeypatch.setenv("EDGEFL_PROFILE_PATH", str(tmp_path))
    assert load_profile(str(path)).availability == Availability(0.25, 120.0)
    assert load_profile("raspberry-pi-4").availability is None
    config = ExperimentConfig(agents=10, seed=1, profiles="sleepy-board")
    patterns = agent_availability(config, ROSTER)
    assert set(patterns) == set(ROSTER)
    assert patterns[ROSTER[0]].availability == Availability(0.25, 120.0)
    # The run's spec takes the devices it draws; the others keep their profile's.
    spec = ExperimentConfig(agents=10, seed=1, profiles="sleepy-board", availability="0.3:0.5:10")
    figures = {p.availability.period_s for p in agent_availability(spec, ROSTER).values()}
    assert figures == {10.0, 120.0}


@pytest.mark.parametrize(
    ("table", "says"),
    [
        ("online_fraction = 2", "online_fraction must be in (0, 1]"),
        ("sleep = 1", "field 'availability.sleep': unknown"),
        ('period_s = "long"', "field 'availability.period_s': expected a number"),
    ],
)
def test_a_bad_availability_table_names_its_file_in_one_line(
    tmp_path: Path, table: str, says: str
) -> None:
    path = tmp_path / "sleepy-board.toml"
    path.write_text(PROFILE + f"\n[availability]\n{table}\n")
    with pytest.raises(ProfileError) as caught:
        load_profile(str(path))
    assert says in str(caught.value) and str(path) in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.timeout(60)
def test_a_dropped_link_goes_down_at_the_broker_and_comes_back(
    embedded_address: BrokerAddress,
) -> None:
    gone = threading.Event()
    will = ("t/presence/sleepy", b"offline")
    sleepy = MqttTransport(embedded_address, TransportOptions(client_id="sleepy"), will=will)
    watcher = MqttTransport(embedded_address, TransportOptions(client_id="watcher"))
    watcher.subscribe(will[0], lambda _topic, payload: gone.set())
    try:
        sleepy.start()
        watcher.start()
        assert sleepy.wait_connected(10) and watcher.wait_subscribed(10)
        sleepy.drop_link(1.0)
        assert gone.wait(10), "the broker published the dropped device's will"
        for _ in range(100):
            if sleepy.connects == 2 and sleepy.connected:
                break
            threading.Event().wait(0.1)
        assert sleepy.connects == 2 and sleepy.connected
    finally:
        sleepy.stop()
        watcher.stop()


@pytest.mark.timeout(600)
def test_a_duty_cycled_agent_sleeps_in_an_emulated_fleet_that_finishes(
    amqtt_broker, tmp_path: Path
) -> None:
    from coordinator.emulate import Emulation, EmulationOptions

    config = ExperimentConfig(
        dataset="digits",
        agents=4,
        partition="iid",
        seed=3,
        availability="0.25:0.3:4",
        learning=preset("dfedavgm", rounds=4, neighbours=2, epochs=1),
    )
    roster = [f"agent-{k:03d}" for k in range(4)]
    (sleeper,) = agent_availability(config, roster)
    options = EmulationOptions(workdir=tmp_path / "fleet", round_timeout_s=30.0, linger_s=10.0)
    emulation = Emulation(config, amqtt_broker.address, options)
    asleep: dict[str, list[float]] = {}
    reader = MqttTransport(amqtt_broker.address, TransportOptions(client_id="reader"))

    def on_status(_topic: str, payload: bytes) -> None:
        status = messages.decode(payload)
        if isinstance(status, messages.Status) and "asleep_s" in status.metrics:
            asleep.setdefault(status.sender, []).append(status.metrics["asleep_s"])

    reader.subscribe(topics.status(emulation.fleet), on_status)
    try:
        reader.start()
        assert reader.wait_subscribed(10)
        report = emulation.run()
    finally:
        reader.stop()
    assert report["summary"]["failed_agents"] == {}
    assert set(asleep) == {sleeper}, "the duty-cycled agent alone said it slept"
    assert all(0 < seconds <= 4 * 0.7 + 0.1 for seconds in asleep[sleeper])
    last = report["rounds"][-1]
    assert last["round"] == 4 and set(last["agents"]) == set(roster)
    assert len(emulation.round_log(sleeper).read_text().splitlines()) == 4


def fleet_config(strategy: str, availability: str) -> ExperimentConfig:
    neighbours = {"neighbours": 2} if strategy == "dadpfl" else {}
    return ExperimentConfig(
        dataset="digits",
        agents=6,
        partition="iid",
        seed=2,
        profiles="mixed",
        availability=availability,
        learning=preset(strategy, rounds=3, epochs=1, **neighbours),
    )


def finishes(report: dict) -> dict[tuple[int, str], float]:
    return {
        (r["round"], agent): a["finished_at"]
        for r in report["rounds"]
        for agent, a in r["agents"].items()
    }


@pytest.mark.parametrize("strategy", ["dadpfl", "fedavg"])
def test_simulate_places_a_synchronous_run_on_the_virtual_clock(strategy: str) -> None:
    from agent.learning import RoundTopology
    from coordinator.simulate import simulate

    config = fleet_config(strategy, "0.5:0.25:20")
    report = simulate(config)
    plain = simulate(fleet_config(strategy, ""))
    assert plain["rounds"][0]["agents"]["agent-000"]["finished_at"] is None
    for got, want in zip(report["rounds"], plain["rounds"], strict=True):
        for agent, entry in got["agents"].items():
            assert entry["finished_at"] is not None
            assert {**entry, "finished_at": None} == want["agents"][agent]
    ends, roster = finishes(report), report["config"]["roster"]
    patterns = agent_availability(config, roster)
    assert len(patterns) == 3
    for (t, agent), end in ends.items():
        if agent in patterns:  # work ends while its device is online
            assert patterns[agent].online(end - 1e-6), (t, agent)
        if strategy == "fedavg" and t > 1:  # a round starts when the last one ended
            assert end > max(ends[t - 1, other] for other in roster)
        if strategy == "dadpfl":  # once it has its models
            needs = RoundTopology(config.seed, t, roster, config.learning).needs(agent)
            assert all(end > ends[need] for need in needs if need[0] >= 1)
    assert report["summary"]["virtual_s"] == max(ends.values())
    # Sleeping devices hold the fleet up: the run takes longer than its work alone.
    assert report["summary"]["virtual_s"] > 20
