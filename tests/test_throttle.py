"""Emulation throttle: compute and link delays, the energy model, and the agent-facing class."""

from __future__ import annotations

import time

import pytest

from agent.device import (
    DEFAULT_EFFICIENCY,
    BudgetLimits,
    RoundWork,
    Throttle,
    calibrated_efficiency,
    compute_budget,
    compute_delay_s,
    energy_j,
    link_delay_s,
    nominal_reading,
)
from firmware_profiles import load_profile

NANO = load_profile("jetson-nano")  # 235.9 GFLOPS peak, 200 Mbit/s, 1.5-10 W, radio 1.5 W
NANO_GFLOPS = 235.9 * DEFAULT_EFFICIENCY


class FakeSleep:
    def __init__(self) -> None:
        self.calls: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)


def test_compute_delay_fills_up_to_the_device_time() -> None:
    assert compute_delay_s(0.3, 1e9, 1.0) == pytest.approx(0.7)
    assert compute_delay_s(2.0, 1e9, 1.0) == 0.0  # the host was slower than the device
    assert compute_delay_s(0.0, 0.0, 1.0) == 0.0
    with pytest.raises(ValueError):
        compute_delay_s(0.0, 1e9, 0.0)


def test_link_delay() -> None:
    assert link_delay_s(1_000_000, 8.0) == pytest.approx(1.0)
    assert link_delay_s(1_000_000, 8.0, latency_s=0.02) == pytest.approx(1.02)
    assert link_delay_s(0, 100.0) == 0.0
    for bad in ((10, 0.0), (10, 1.0, -1.0), (-1, 1.0)):
        with pytest.raises(ValueError):
            link_delay_s(*bad)


def test_energy_counts_power_above_idle_and_the_radio() -> None:
    # 10 s at (10 - 1.5) W; 25 MB out and 25 MB in at 200 Mbit/s = 2 s at 1.5 W.
    assert energy_j(NANO, 10.0) == pytest.approx(85.0)
    assert energy_j(NANO, 10.0, tx_bytes=25_000_000, rx_bytes=25_000_000) == pytest.approx(88.0)
    assert energy_j(NANO, 0.0) == 0.0


def test_throttle_sleeps_the_device_time() -> None:
    sleep = FakeSleep()
    throttle = Throttle(NANO, sleep=sleep)
    assert throttle.after_compute(0.25, NANO_GFLOPS * 1e9) == pytest.approx(0.75)
    assert throttle.after_compute(3.0, NANO_GFLOPS * 1e9) == 0.0  # no sleep at all
    assert throttle.before_send(25_000_000) == pytest.approx(1.0)
    assert throttle.after_receive(2_500_000) == pytest.approx(0.1)
    assert sleep.calls == pytest.approx([0.75, 1.0, 0.1])


def test_throttle_latency_and_efficiency() -> None:
    sleep = FakeSleep()
    throttle = Throttle(NANO, efficiency=0.5, latency_s=0.05, sleep=sleep)
    assert throttle.after_compute(0.0, 235.9e9 * 0.5) == pytest.approx(1.0)
    assert throttle.before_send(0) == pytest.approx(0.05)
    with pytest.raises(ValueError):
        Throttle(NANO, efficiency=0.0)


def test_disabled_throttle_does_nothing() -> None:
    sleep = FakeSleep()
    throttle = Throttle(NANO, enabled=False, sleep=sleep)
    assert throttle.after_compute(0.0, 1e15) == 0.0
    assert throttle.before_send(10**9) == 0.0 and throttle.after_receive(10**9) == 0.0
    assert sleep.calls == []


def test_a_weaker_profile_is_throttled_longer() -> None:
    delays = {}
    for name in ("raspberry-pi-4", "jetson-nano", "x86-laptop", "jetson-orin-nano"):
        delays[name] = Throttle(load_profile(name), sleep=FakeSleep()).after_compute(0.0, 1e12)
    assert list(delays.values()) == sorted(delays.values(), reverse=True)


def test_emulated_round_takes_the_time_its_budget_planned() -> None:
    """Budget and throttle share one model: a round trained at p_k takes expected_train_s,
    and the efficiency measured from it is the one the budget assumed."""
    work = RoundWork(train_flops=8e12, fixed_flops=4e11)
    budget = compute_budget(NANO, nominal_reading(NANO), work, BudgetLimits(round_time_s=60))
    assert budget.p_k < 1
    flops = work.fixed_flops + budget.p_k * work.train_flops
    measured = 0.4  # what the host really took
    delay = Throttle(NANO, sleep=FakeSleep()).after_compute(measured, flops)
    assert measured + delay == pytest.approx(budget.expected_train_s) == pytest.approx(60)
    assert calibrated_efficiency(flops, measured + delay, NANO) == pytest.approx(DEFAULT_EFFICIENCY)


def test_real_sleep_is_short_and_accurate() -> None:
    throttle = Throttle(NANO)
    start = time.monotonic()
    delay = throttle.after_compute(0.0, NANO_GFLOPS * 1e9 * 0.005)  # 5 ms on a Nano
    elapsed = time.monotonic() - start
    assert delay == pytest.approx(0.005) and elapsed >= 0.005 * 0.9
