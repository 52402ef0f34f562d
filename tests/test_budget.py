"""Resource budget p_k: the rule's properties, the bundled profiles' ordering, device reads."""

from __future__ import annotations

import dataclasses
import sys
import types
from collections import namedtuple

import msgpack
import psutil
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.device import (
    DEFAULT_EFFICIENCY,
    Budget,
    BudgetLimits,
    DeviceReading,
    RoundWork,
    calibrated_efficiency,
    compute_budget,
    nominal_reading,
    read_device,
)
from agent.device import budget as budget_module
from agent.learning import active_fraction, density_cap, sparse
from agent.learning.models import build_model, forward_flops, prunable_names
from firmware_profiles import list_profiles, load_profile

BUNDLED = sorted(
    ["jetson-nano", "jetson-orin-nano", "jetson-xavier-nx"]
    + ["raspberry-pi-4", "raspberry-pi-5", "x86-laptop"],
    key=lambda name: load_profile(name).peak_fp32_gflops,
)
NANO = load_profile("jetson-nano")
Battery = namedtuple("Battery", "percent secsleft power_plugged")


def reading(**changes: object) -> DeviceReading:
    return dataclasses.replace(nominal_reading(NANO), **changes)


works = st.builds(
    RoundWork,
    train_flops=st.floats(0, 1e15),
    fixed_flops=st.floats(0, 1e13),
    fixed_memory_mb=st.floats(0, 1e4),
    sample_memory_mb=st.floats(0, 100),
    batch_size=st.integers(1, 512),
)
limits_st = st.builds(
    BudgetLimits,
    round_time_s=st.floats(0.01, 1e4),
    energy_j=st.none() | st.floats(0.1, 1e5),
)
readings = st.builds(
    reading,
    other_load=st.none() | st.floats(0, 8),
    available_memory_mb=st.none() | st.floats(0, 1e5),
    battery_percent=st.none() | st.floats(0, 100),
    on_ac_power=st.none() | st.booleans(),
    gpu_load_percent=st.none() | st.floats(0, 100),
)
profiles = st.sampled_from(BUNDLED).map(load_profile)


@settings(max_examples=200, deadline=None)
@given(profiles, readings, works, limits_st)
def test_p_k_is_in_range_and_explained(profile, device, work, limits) -> None:
    b = compute_budget(profile, device, work, limits)
    assert limits.min_budget <= b.p_k <= 1
    assert 1 <= b.batch_size <= work.batch_size
    assert b.reason.startswith(f"p_k={b.p_k:.3g}")
    assert b.limited_by.split()[0] in ("none", "time", "energy", "battery")


@settings(max_examples=200, deadline=None)
@given(profiles, readings, works, limits_st, st.floats(0, 8), st.floats(0, 100))
def test_more_load_never_raises_p_k(profile, device, work, limits, extra, extra_gpu) -> None:
    busier = dataclasses.replace(
        device,
        other_load=(device.other_load or 0) + extra,
        gpu_load_percent=min(100.0, (device.gpu_load_percent or 0) + extra_gpu),
    )
    assert compute_budget(profile, busier, work, limits).p_k <= (
        compute_budget(profile, device, work, limits).p_k
    )


@settings(max_examples=200, deadline=None)
@given(profiles, readings, works, limits_st, st.floats(1, 100))
def test_a_stronger_profile_never_lowers_p_k(profile, device, work, limits, factor) -> None:
    stronger = dataclasses.replace(profile, peak_fp32_gflops=profile.peak_fp32_gflops * factor)
    assert compute_budget(stronger, device, work, limits).p_k >= (
        compute_budget(profile, device, work, limits).p_k
    )


@settings(max_examples=200, deadline=None)
@given(profiles, readings, works, limits_st, st.floats(0, 100), st.floats(0, 100))
def test_lower_battery_never_raises_p_k(profile, device, work, limits, a, b) -> None:
    low, high = sorted((a, b))
    on_battery = dataclasses.replace(device, on_ac_power=False)
    p_low = compute_budget(
        profile, dataclasses.replace(on_battery, battery_percent=low), work, limits
    )
    p_high = compute_budget(
        profile, dataclasses.replace(on_battery, battery_percent=high), work, limits
    )
    assert p_low.p_k <= p_high.p_k


@settings(max_examples=200, deadline=None)
@given(profiles, readings, works, st.floats(0.01, 1e4), st.floats(1, 100))
def test_more_time_never_lowers_p_k(profile, device, work, seconds, factor) -> None:
    short = compute_budget(profile, device, work, BudgetLimits(round_time_s=seconds))
    long = compute_budget(profile, device, work, BudgetLimits(round_time_s=seconds * factor))
    assert long.p_k >= short.p_k


def test_low_battery_gives_a_smaller_budget_and_says_so() -> None:
    work = RoundWork(train_flops=1e9)
    full = compute_budget(NANO, reading(), work)
    assert full.p_k == 1 and full.limited_by == "none"
    for plugged in (False, None):  # an unknown power source counts as battery
        low = compute_budget(NANO, reading(battery_percent=10.0, on_ac_power=plugged), work)
        assert low.p_k == BudgetLimits().min_budget and low.limited_by == "battery"
        assert "on battery at 10%" in low.reason
    half = compute_budget(NANO, reading(battery_percent=35.0, on_ac_power=False), work)
    assert half.p_k == pytest.approx(0.05 + 0.95 * 0.5)
    charging = compute_budget(NANO, reading(battery_percent=10.0, on_ac_power=True), work)
    assert charging.p_k == 1


def test_the_time_rule_by_hand() -> None:
    """Jetson Nano, 23.59 effective GFLOPS; half its CPU busy: 23.59 / 1.5 GFLOPS."""
    gflops = 235.9 * DEFAULT_EFFICIENCY / 1.5
    work = RoundWork(train_flops=100 * gflops * 1e9, fixed_flops=10 * gflops * 1e9)
    b = compute_budget(NANO, reading(other_load=2.0), work, BudgetLimits(round_time_s=60))
    assert b.load_share == 0.5
    assert b.effective_gflops == pytest.approx(gflops)
    assert b.p_k == pytest.approx(0.5)  # (60 s - 10 s fixed) of 100 s
    assert b.expected_train_s == pytest.approx(60)
    assert b.limited_by == "time" and "needs 110 s, 60 s allowed" in b.reason
    floored = compute_budget(NANO, reading(other_load=2.0), work, BudgetLimits(round_time_s=5))
    assert floored.p_k == 0.05 and floored.limited_by == "time (floored)"
    assert "overruns" in floored.reason


def test_the_energy_rule_by_hand() -> None:
    """A dense round of 100 s on a Nano costs 100 s x (10 - 1.5) W = 850 J above idle."""
    work = RoundWork(train_flops=100 * 23.59e9)
    limits = BudgetLimits(round_time_s=1e6, energy_j=425)
    b = compute_budget(NANO, reading(), work, limits)
    assert b.p_k == pytest.approx(0.5) and b.energy_factor == pytest.approx(0.5)
    assert b.limited_by == "energy" and "850 J above idle, 425 J allowed" in b.reason


def test_memory_caps_the_batch_not_p_k() -> None:
    work = RoundWork(train_flops=1e9, fixed_memory_mb=100, sample_memory_mb=10, batch_size=128)
    roomy = compute_budget(NANO, reading(available_memory_mb=4000), work)
    assert (roomy.batch_size, roomy.memory_factor, roomy.fits_memory) == (128, 1.0, True)
    tight = compute_budget(NANO, reading(available_memory_mb=500), work)  # 400 MiB allowed
    assert tight.p_k == 1 and tight.batch_size == 30 and tight.fits_memory
    assert tight.memory_factor == pytest.approx(400 / 1380)
    assert "batch 128 needs 1380 MiB, 400 MiB allowed: batch 30" in tight.reason
    full = compute_budget(NANO, reading(available_memory_mb=100), work)
    assert full.batch_size == 1 and not full.fits_memory
    assert "does not fit even at batch 1" in full.reason
    # A device never counts on more memory than its profile has.
    capped = compute_budget(NANO, reading(available_memory_mb=1e6), work)
    assert capped == compute_budget(NANO, reading(available_memory_mb=NANO.memory_mb), work)
    # Unknown available memory: the profile's nominal share.
    assert compute_budget(NANO, reading(available_memory_mb=None), work) == (
        compute_budget(NANO, reading(available_memory_mb=0.75 * NANO.memory_mb), work)
    )


def test_limits_are_validated() -> None:
    for bad in (
        {"round_time_s": 0},
        {"memory_fraction": 0},
        {"min_battery_percent": 60},
        {"energy_j": 0},
        {"min_budget": 0},
    ):
        with pytest.raises(ValueError):
            BudgetLimits(**bad)
    with pytest.raises(ValueError):
        compute_budget(NANO, reading(), RoundWork(1.0), efficiency=0)
    for bad_work in ({"train_flops": -1.0}, {"train_flops": 1.0, "batch_size": 0}):
        with pytest.raises(ValueError):
            RoundWork(**bad_work)
    always_full = BudgetLimits(round_time_s=0.001, min_budget=1.0)
    raised = compute_budget(NANO, reading(), RoundWork(1e15), always_full)
    assert raised.p_k == 1 and raised.limited_by == "time (floored)"


def test_budget_and_reading_go_into_a_status_message() -> None:
    b = compute_budget(NANO, read_device(), RoundWork(1e12), BudgetLimits(energy_j=100))
    for record in (dataclasses.asdict(b), dataclasses.asdict(read_device())):
        assert msgpack.unpackb(msgpack.packb(record)) == record


# -- density cap and active fraction --------------------------------------------------------


@given(st.floats(0.01, 1), st.floats(0.01, 1), st.floats(0.1, 5))
def test_density_cap_keeps_flops_within_p_k(p_k, initial, ratio) -> None:
    cap = density_cap(p_k, initial, ratio)
    assert 0 < cap <= initial
    assert cap * ratio <= p_k * (1 + 1e-12)
    assert density_cap(min(1.0, p_k * 1.5), initial, ratio) >= cap


def test_density_cap_does_not_bind_at_full_budget() -> None:
    assert density_cap(1.0, 0.5) == 0.5
    # Current density 0.2 with a FLOP fraction of 0.5: the cap (0.4) stays above it.
    assert density_cap(1.0, 0.5, 0.5 / 0.2) == pytest.approx(0.4)
    assert density_cap(0.1, 0.5) == 0.1  # below the target density 1 - s* = 0.2: allowed
    for bad in ((0.0, 0.5), (0.5, 0.0), (1.1, 0.5)):
        with pytest.raises(ValueError):
            density_cap(*bad)


def test_active_fraction_is_p_k() -> None:
    assert active_fraction(0.3) == 0.3 and active_fraction(1.0) == 1.0
    with pytest.raises(ValueError):
        active_fraction(0.0)


# -- the requirement: weaker profiles train fewer FLOPs per round ----------------------


def _erk_masks(model: torch.nn.Module, density: float) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    shapes = {name: tuple(state[name].shape) for name in prunable_names(model)}
    densities = sparse.erk_densities(shapes, density)
    return sparse.random_masks(shapes, densities, torch.Generator().manual_seed(0))


def _round_flops(
    name: str, shape: tuple[int, ...], samples: int, limits: BudgetLimits
) -> dict[str, float]:
    """Training FLOPs of one DA-DPFL round (E = 5, batch 128, one RigL batch)
    per bundled profile: its ERK model pruned to its density cap, counted with masks."""
    model = build_model(name, shape, 10, seed=0)
    rigl = min(128, samples)
    work = RoundWork.for_model(
        model, shape, samples=samples, epochs=5, batch_size=128, dense_grad_samples=rigl
    )
    dense = forward_flops(model, shape)
    ratio = forward_flops(model, shape, _erk_masks(model, 0.5)) / dense / 0.5
    flops = {}
    for profile_name in BUNDLED:
        profile = load_profile(profile_name)
        b = compute_budget(profile, nominal_reading(profile), work, limits)
        masks = _erk_masks(model, density_cap(b.p_k, 0.5, ratio))
        flops[profile_name] = 3 * forward_flops(model, shape, masks) * samples * 5
        flops[profile_name] += work.fixed_flops
    return flops


def test_bundled_profiles_are_ordered_by_peak() -> None:
    assert set(BUNDLED) <= set(list_profiles())
    assert BUNDLED == [
        "raspberry-pi-4",
        "raspberry-pi-5",
        "jetson-nano",
        "x86-laptop",
        "jetson-xavier-nx",
        "jetson-orin-nano",
    ]


def test_resnet18_cifar10_round_weaker_boards_train_fewer_flops() -> None:
    """500 CIFAR-10 samples x 5 epochs: 8.3 TFLOP dense, far beyond a minute on the small
    boards, so every board's cap binds except the Orin's: strictly increasing with peak."""
    flops = _round_flops("resnet18", (3, 32, 32), 500, BudgetLimits(round_time_s=60))
    ordered = [flops[name] for name in BUNDLED]
    assert ordered == sorted(ordered) and len(set(ordered)) == len(ordered)
    assert flops["raspberry-pi-4"] < flops["jetson-nano"] < flops["x86-laptop"]
    assert flops["jetson-nano"] < flops["jetson-orin-nano"]


def test_cnn1d_mnist1d_round_weaker_boards_never_train_more() -> None:
    """200 MNIST-1D samples x 5 epochs is 0.34 GFLOP: at most 72 ms even on a Raspberry Pi 4,
    so with a minute per round every board trains it at full density (equal FLOPs); only a
    deadline of tens of milliseconds makes the Pi 4's cap bind."""
    relaxed = _round_flops("cnn1d", (1, 40), 200, BudgetLimits(round_time_s=60))
    assert len(set(relaxed.values())) == 1
    tight = _round_flops("cnn1d", (1, 40), 200, BudgetLimits(round_time_s=0.02))
    ordered = [tight[name] for name in BUNDLED]
    assert ordered == sorted(ordered)
    assert tight["raspberry-pi-4"] < tight["jetson-nano"] <= tight["jetson-orin-nano"]
    assert tight["raspberry-pi-4"] < tight["x86-laptop"]


@settings(max_examples=100, deadline=None)
@given(works, st.floats(0.01, 1e4))
def test_under_a_time_limit_flops_follow_peak(work, seconds) -> None:
    limits = BudgetLimits(round_time_s=seconds)
    flops = []
    for name in BUNDLED:
        profile = load_profile(name)
        p_k = compute_budget(profile, nominal_reading(profile), work, limits).p_k
        flops.append(density_cap(p_k, 0.5) * work.train_flops + work.fixed_flops)
    assert flops == sorted(flops)


def test_under_an_energy_limit_flops_follow_gflops_per_watt() -> None:
    """An energy limit favours efficient boards: the laptop (35 W above idle for 35.8
    effective GFLOPS) affords less than a Jetson Nano (8.5 W for 23.6)."""
    work = RoundWork(train_flops=1e13)
    limits = BudgetLimits(round_time_s=1e6, energy_j=500)
    p = {
        name: compute_budget(load_profile(name), nominal_reading(load_profile(name)), work, limits)
        for name in BUNDLED
    }

    def per_joule(name: str) -> float:
        profile = load_profile(name)
        return profile.peak_fp32_gflops / (profile.max_power_w - profile.idle_power_w)

    by_efficiency = sorted(BUNDLED, key=per_joule)
    assert by_efficiency[0] == "x86-laptop"
    ps = [p[name].p_k for name in by_efficiency]
    assert ps == sorted(ps)
    assert p["x86-laptop"].p_k < p["jetson-nano"].p_k < p["jetson-orin-nano"].p_k


# -- the work of a round ---------------------------------------------------------------------


def test_round_work_of_a_model() -> None:
    model = build_model("cnn1d", (1, 40), 10, seed=0)
    dense = forward_flops(model, (1, 40))
    work = RoundWork.for_model(
        model, (1, 40), samples=200, epochs=5, batch_size=128, dense_grad_samples=128
    )
    assert work.train_flops == 3 * dense * 200 * 5
    assert work.fixed_flops == 3 * dense * 128
    params = sum(p.numel() for p in model.parameters())
    assert work.fixed_memory_mb == pytest.approx(4 * params * 4 / 2**20)
    assert work.sample_memory_mb > 0 and work.batch_size == 128
    held = RoundWork.for_model(model, (1, 40), samples=50, epochs=1, batch_size=128, held_models=5)
    assert held.batch_size == 50  # the local set when smaller than a batch
    assert held.fixed_memory_mb == pytest.approx(4 * params * 9 / 2**20)
    assert model.training  # left as it was


# -- reading the device ----------------------------------------------------------------------


def test_read_device_on_this_machine() -> None:
    r = read_device()
    assert isinstance(r.cpu_count, int) and r.cpu_count >= 1
    assert r.available_memory_mb > 0
    assert r.other_load is None or 0 <= r.other_load <= r.cpu_count
    for value in (r.cpu_freq_mhz, r.cpu_freq_max_mhz, r.load_1m, r.battery_percent):
        assert value is None or (isinstance(value, float) and value > 0)
    assert r.on_ac_power in (None, True, False)
    assert isinstance(compute_budget(NANO, r, RoundWork(1e12)), Budget)


def test_other_load_leaves_out_the_agents_own_cpu_time() -> None:
    now = read_device()
    assert now.cpu_busy_s is not None and now.own_cpu_s is not None
    # Ten seconds ago the machine had done 5 s less CPU work, 1 s of it this process's.
    before = dataclasses.replace(
        now,
        timestamp=now.timestamp - 10,
        cpu_busy_s=now.cpu_busy_s - 5,
        own_cpu_s=now.own_cpu_s - 1,
    )
    assert read_device(before).other_load == pytest.approx(0.4, abs=0.1)


def test_other_load_falls_back_to_the_load_average(monkeypatch) -> None:
    monkeypatch.setattr(psutil, "getloadavg", lambda: (1.5, 1.0, 1.0))
    monkeypatch.setattr(psutil, "cpu_count", lambda: 4)
    assert read_device().other_load == 1.5  # no previous reading
    assert read_device(read_device()).other_load == 1.5  # a window under a second
    monkeypatch.setattr(psutil, "getloadavg", lambda: (9.0, 1.0, 1.0))
    assert read_device().other_load == 4  # at most every core


def test_read_device_survives_a_platform_that_reports_nothing(monkeypatch) -> None:
    def broken(*_args: object) -> None:
        raise NotImplementedError("not on this platform")

    names = ("cpu_freq", "getloadavg", "sensors_battery", "cpu_times", "cpu_count")
    for name in (*names, "virtual_memory"):
        monkeypatch.setattr(psutil, name, broken)
    r = read_device(read_device())
    assert r.cpu_count >= 1
    unknown = (r.cpu_freq_mhz, r.load_1m, r.other_load, r.battery_percent, r.cpu_busy_s)
    assert unknown == (None,) * 5 and r.available_memory_mb is None
    assert compute_budget(NANO, r, RoundWork(1e9)).p_k == 1
    monkeypatch.setattr(psutil, "cpu_freq", lambda: None)
    monkeypatch.setattr(psutil, "sensors_battery", lambda: None)
    assert read_device().cpu_freq_mhz is None and read_device().on_ac_power is None


def test_read_device_reports_a_battery(monkeypatch) -> None:
    monkeypatch.setattr(psutil, "sensors_battery", lambda: Battery(15, 600, False))
    r = read_device()
    assert (r.battery_percent, r.on_ac_power) == (15.0, False)
    assert compute_budget(NANO, r, RoundWork(1e9)).limited_by == "battery"


class _FakeJtop:
    stats = {"GPU": 42.0, "nvp model": "MAXN"}

    def __enter__(self) -> _FakeJtop:
        return self

    def __exit__(self, *_exc: object) -> None:
        pass

    def ok(self) -> bool:
        return True


class _DeadJtop(_FakeJtop):
    def __enter__(self) -> _FakeJtop:
        raise RuntimeError("The jetson_stats.service is not active")


def test_jetson_stats_where_installed(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "jtop", types.SimpleNamespace(jtop=_FakeJtop))
    r = read_device()
    assert (r.gpu_load_percent, r.power_mode) == (42.0, "MAXN")
    assert compute_budget(NANO, r, RoundWork(1e9)).load_share >= 0.42
    assert read_device(jetson=False).gpu_load_percent is None
    monkeypatch.setitem(sys.modules, "jtop", types.SimpleNamespace(jtop=_DeadJtop))
    assert (read_device().gpu_load_percent, read_device().power_mode) == (None, None)


def test_jetson_stats_absent(monkeypatch, tmp_path, caplog) -> None:
    monkeypatch.setitem(sys.modules, "jtop", None)  # import jtop raises ImportError
    monkeypatch.setattr(budget_module, "TEGRA_RELEASE", tmp_path / "nv_tegra_release")
    budget_module._say_jetson_stats_missing.cache_clear()
    with caplog.at_level("INFO", logger=budget_module.__name__):
        assert budget_module._read_jetson() == (None, None)
        assert caplog.messages == []  # not a Jetson: nothing to install
        (tmp_path / "nv_tegra_release").write_text("# R32 (release), REVISION: 7.1\n")
        assert read_device().gpu_load_percent is None
        assert read_device().power_mode is None
    hints = [m for m in caplog.messages if "jetson-stats is not installed" in m]
    assert hints == [
        "this is a Jetson, but jetson-stats is not installed: GPU load and power mode go "
        "unread (pip install 'edgefl-fleet[jetson]')"
    ]


def test_nominal_reading_is_an_idle_board() -> None:
    r = nominal_reading(NANO)
    assert r.cpu_count == 4 and r.other_load == 0 and r.battery_percent is None
    assert r.available_memory_mb == 0.75 * 4096


def test_calibrated_efficiency_recovers_the_rate() -> None:
    # 23.59 GFLOP in one second on a Nano: 10% of its 235.9 GFLOPS peak.
    assert calibrated_efficiency(23.59e9, 1.0, NANO) == pytest.approx(0.1)
    assert calibrated_efficiency(23.59e9, 1.0, NANO, load_share=1.0) == pytest.approx(0.2)
    assert calibrated_efficiency(1e15, 1.0, NANO) == 1.0
    with pytest.raises(ValueError):
        calibrated_efficiency(0, 1.0, NANO)
