"""The resource budget p_k: how much of a full dense local round a device can afford now.

An agent reads its device each round (`read_device`: psutil, jetson-stats where installed;
`nominal_reading` for an emulated device), describes the round's work (`RoundWork`) and turns
both, with its profile and limits, into a `Budget` (`compute_budget`, a pure function). Every
figure the rule used is a field of the `Budget`, so the agent can publish it in its status.

The rule (units in brackets):

    load_share  s = max(other_load / cpu_count, gpu_load_percent / 100), clipped to [0, 1]
                    (other_load: cores kept busy by other processes, the agent's own use
                    excluded; a missing figure counts as 0)
    effective   G = peak_fp32_gflops x efficiency / (1 + s)              [GFLOP/s]
                    fair share: competing runnable work takes its share of the processor, so
                    at s = 1 the agent gets half of it, never nothing; with `compute` ("cpu"
                    or "cuda", what the agent trains on) the peak is that compute's
                    (`DeviceProfile.peak_for`: a Jetson's CPU trains far slower than its
                    GPU), without it the profile's main compute, as simulate and emulate model
    afford(T)   = (T x G x 1e9 - fixed_flops) / train_flops, clipped to [0, 1]
                    the fraction of the density-scalable training that fits in T seconds once
                    the work that does not shrink with density (RigL's dense gradient) is paid
    time        = afford(round_time_s)
    energy      = afford(energy_j / (max_power_w - idle_power_w))
                    when energy_j is set (and the profile's max power is above idle)
                    energy counts power above idle, as in `agent.device.throttle.energy_j`
    battery     = 1 on mains power or without a battery; on battery (or unknown power source)
                  min_budget at or below min_battery_percent, 1 at or above
                  full_battery_percent, linear in between
    p_k         = clip(min(time, energy, battery), min_budget, 1)

p_k is monotone: more load, a weaker profile, a lower battery or tighter limits never raise
it. It is floored at min_budget (0.05) so an agent always trains something and stays in the
fleet; a floored budget still overruns its limits, which `Budget.reason` says.

`efficiency` (0.1 by default) is the fraction of peak that PyTorch training reaches. Measured
with one thread on an AMD EPYC (Zen 4) core of roughly 100 GFLOPS peak (32 FLOP/cycle), in a
shared VM: the bundled cnn1d and cnn2d (batch 128) train at 6-20 GFLOPS (5-20%), ResNet-18 on
32x32 inputs at 55-95 GFLOPS (55-90%); ARM CPU kernels and small batches on a Jetson GPU do
worse. 0.1 errs low on purpose: overestimating a device makes it overrun the round and become
the straggler its neighbours wait for, underestimating it only trains it a little sparser. On
a real device, replace it with `calibrated_efficiency` of the previous rounds.

Memory does not enter p_k: a pruned or frozen model keeps its masks and frozen entries in
dense tensors and takes the same memory; `allowed_mb` is what the measured reductions fit
(with a smaller batch when needed). The FLOP model of memory here limits the batch:
`Budget.batch_size` is the largest batch (at most the configured one) whose activations fit,
and `Budget.memory_factor` tells how far the configured batch is from
fitting. Allowed memory is memory_fraction x min(available, the profile's memory); when the
device does not report what is available, the profile's nominal share stands in for it.

What p_k controls (ALGORITHMS.md sections 1, 2 and 5; `agent.learning.reduction`):
`density_cap` for a pruned model, `active_fraction` for a frozen one; both count FLOPs the way
the papers do, and a masked-dense PyTorch kernel does the same work at any density, so for
them p_k cuts counted FLOPs and bytes on the wire, not wall time. A layer window or a
narrower sub-model (`--reduce prefix|width|auto`) is chosen by the device's measured costs
instead, so that p_k's share of a dense round is a share of real seconds; with a measured
table (`measured_dense_s`) a real board's time factor is measured too.

CPU frequency is read and reported but not used: between rounds the governor clocks an idle
CPU down, so current/max would shrink p_k exactly when nothing is wrong; thermal throttling
shows in the measured throughput instead (`calibrated_efficiency`).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import psutil
import torch
from torch import Tensor, nn

from agent.learning import forward_flops
from firmware_profiles import DeviceProfile
from protocol.extras import install_hint

log = logging.getLogger(__name__)

DEFAULT_EFFICIENCY = 0.1
MIB = 2**20
# Dense copies of the parameters held while training: weights, gradients, masks or the
# optimizer's momentum, and the aggregation result (or the initial weights DA-DPFL keeps).
PARAM_COPIES = 4
# A window shorter than this makes the CPU-time difference too coarse (10 ms jiffies).
MIN_LOAD_WINDOW_S = 1.0
# Share of an emulated board's memory left available by an idle headless OS.
NOMINAL_AVAILABLE_FRACTION = 0.75

T = TypeVar("T")


@dataclass(frozen=True)
class DeviceReading:
    """What the device reports at one moment; None where the platform does not say.

    `other_load` is the figure the budget uses: the cores kept busy by other processes,
    measured over the window since the previous reading with the agent's own CPU time taken
    out (otherwise the agent's last round would lower its next budget, which would raise the
    one after: p_k would oscillate). Without a usable window it falls back to `load_1m`,
    which includes the agent's own use of the last minute.
    `cpu_busy_s` and `own_cpu_s` are the cumulative counters that window is computed from.
    """

    timestamp: float
    cpu_count: int
    cpu_freq_mhz: float | None
    cpu_freq_max_mhz: float | None
    load_1m: float | None
    other_load: float | None
    available_memory_mb: float | None
    battery_percent: float | None
    on_ac_power: bool | None
    gpu_load_percent: float | None = None
    power_mode: str | None = None
    cpu_busy_s: float | None = None
    own_cpu_s: float | None = None


def _try(call: Callable[[], T]) -> T | None:
    """A monitoring read must never stop the agent: psutil raises platform-specific errors
    (NotImplementedError, OSError, parsing errors) or lacks the function altogether."""
    try:
        return call()
    except Exception:
        return None


def _positive(value: float | None) -> float | None:
    return float(value) if value is not None and value > 0 else None


def _cpu_busy_s() -> float:
    times = psutil.cpu_times()
    busy = ("user", "nice", "system", "irq", "softirq", "steal", "interrupt", "dpc")
    return sum(getattr(times, name, 0.0) for name in busy)


def _own_cpu_s() -> float:
    times = psutil.Process().cpu_times()
    return times.user + times.system + times.children_user + times.children_system


TEGRA_RELEASE = Path("/etc/nv_tegra_release")
"""Present on every Jetson (L4T): where jetson-stats is worth installing."""


@functools.cache
def _say_jetson_stats_missing() -> None:
    log.info(
        "this is a Jetson, but jetson-stats is not installed: GPU load and power mode go "
        "unread (%s)",
        install_hint("jetson"),
    )


def _read_jetson() -> tuple[float | None, str | None]:
    """GPU load [%] and power mode from jetson-stats, or (None, None) where it is missing or
    its service is not running. A Jetson without it says once what to install."""
    try:
        from jtop import jtop  # optional: the `jetson` extra, on Jetson boards
    except ImportError:
        if TEGRA_RELEASE.exists():
            _say_jetson_stats_missing()
        return None, None
    try:
        with jtop() as jetson:
            stats = jetson.stats if jetson.ok() else {}
    except Exception:
        return None, None
    gpu = stats.get("GPU")
    mode = stats.get("nvp model")
    return (
        float(gpu) if isinstance(gpu, int | float) else None,
        str(mode) if mode is not None else None,
    )


def read_device(previous: DeviceReading | None = None, *, jetson: bool = True) -> DeviceReading:
    """Read this device now. Pass the previous round's reading so that `other_load` covers the
    window between the two with the agent's own CPU time taken out."""
    now = time.time()
    cpu_count = _try(psutil.cpu_count) or os.cpu_count() or 1
    freq = _try(psutil.cpu_freq)
    load = _try(psutil.getloadavg)
    load_1m = float(load[0]) if load else None
    busy, own = _try(_cpu_busy_s), _try(_own_cpu_s)
    other_load = load_1m
    if (
        previous is not None
        and busy is not None
        and own is not None
        and previous.cpu_busy_s is not None
        and previous.own_cpu_s is not None
        and now - previous.timestamp >= MIN_LOAD_WINDOW_S
    ):
        window = now - previous.timestamp
        other_load = ((busy - previous.cpu_busy_s) - (own - previous.own_cpu_s)) / window
    if other_load is not None:
        other_load = min(max(other_load, 0.0), float(cpu_count))
    battery = _try(lambda: psutil.sensors_battery())
    gpu_load, power_mode = _read_jetson() if jetson else (None, None)
    return DeviceReading(
        timestamp=now,
        cpu_count=cpu_count,
        cpu_freq_mhz=_positive(freq.current) if freq else None,
        cpu_freq_max_mhz=_positive(freq.max) if freq else None,
        load_1m=load_1m,
        other_load=other_load,
        available_memory_mb=_try(lambda: psutil.virtual_memory().available / MIB),
        battery_percent=float(battery.percent) if battery else None,
        on_ac_power=battery.power_plugged if battery else None,
        gpu_load_percent=gpu_load,
        power_mode=power_mode,
        cpu_busy_s=busy,
        own_cpu_s=own,
    )


def nominal_reading(
    profile: DeviceProfile,
    *,
    other_load: float = 0.0,
    available_memory_mb: float | None = None,
    battery_percent: float | None = None,
    on_ac_power: bool | None = None,
) -> DeviceReading:
    """The reading of an emulated device: the profile's board, idle unless told otherwise.

    An emulated agent must budget as its board would, not as the host it runs on; by default
    NOMINAL_AVAILABLE_FRACTION of the board's memory is free (an idle headless OS).
    """
    if available_memory_mb is None:
        available_memory_mb = profile.memory_mb * NOMINAL_AVAILABLE_FRACTION
    return DeviceReading(
        timestamp=time.time(),
        cpu_count=profile.cpu_cores,
        cpu_freq_mhz=None,
        cpu_freq_max_mhz=None,
        load_1m=other_load,
        other_load=other_load,
        available_memory_mb=available_memory_mb,
        battery_percent=battery_percent,
        on_ac_power=on_ac_power,
    )


def _activation_floats(model: nn.Module, input_shape: tuple[int, ...]) -> int:
    """Floats that the leaf modules output for one sample: what autograd keeps for backward."""
    total = 0

    def count(_module: nn.Module, _inputs: tuple[Tensor, ...], output: Any) -> None:
        nonlocal total
        if isinstance(output, Tensor):
            total += output.numel()

    leaves = [m for m in model.modules() if next(m.children(), None) is None]
    handles = [m.register_forward_hook(count) for m in leaves]
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            param = next(model.parameters(), None)
            device = param.device if param is not None else None
            model(torch.zeros((1, *input_shape), device=device))
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return total


@dataclass(frozen=True)
class RoundWork:
    """A full dense local round: FLOPs [FLOP] and memory [MiB].

    `train_flops` scales with density (3 x dense forward FLOPs x samples x epochs);
    `fixed_flops` does not (RigL's dense gradient batches). Memory is `fixed_memory_mb`
    (parameter copies) plus `sample_memory_mb` per sample of a batch (activations).
    """

    train_flops: float
    fixed_flops: float = 0.0
    fixed_memory_mb: float = 0.0
    sample_memory_mb: float = 0.0
    batch_size: int = 1

    def __post_init__(self) -> None:
        figures = (self.train_flops, self.fixed_flops, self.fixed_memory_mb, self.sample_memory_mb)
        if min(figures) < 0 or self.batch_size < 1:
            raise ValueError(f"work figures must be non-negative and batch_size >= 1: {self}")

    @classmethod
    def for_model(
        cls,
        model: nn.Module,
        input_shape: Sequence[int],
        *,
        samples: int,
        epochs: int,
        batch_size: int,
        dense_grad_samples: int = 0,
        held_models: int = 0,
    ) -> RoundWork:
        """The round of `model` on `samples` local samples for `epochs` epochs.

        `dense_grad_samples`: samples of RigL's dense gradient (0 for dense strategies);
        `held_models`: other models in memory meanwhile (the neighbours' for aggregation).
        Memory is an estimate: PARAM_COPIES + held_models fp32 copies of the parameters, and
        per sample every leaf module's output twice (kept for backward, and its gradient).
        Framework overhead is left out: the available memory is read with it already loaded.
        """
        shape = tuple(input_shape)
        dense = forward_flops(model, shape)
        params = sum(p.numel() for p in model.parameters())
        return cls(
            train_flops=3.0 * dense * samples * epochs,
            fixed_flops=3.0 * dense * dense_grad_samples,
            fixed_memory_mb=4 * params * (PARAM_COPIES + held_models) / MIB,
            sample_memory_mb=2 * 4 * _activation_floats(model, shape) / MIB,
            batch_size=max(1, min(batch_size, samples)),
        )


@dataclass(frozen=True)
class BudgetLimits:
    """What an agent may spend on one round's local training.

    round_time_s: training time per round [s]; 60 s suits a deployed fleet (set it from the
        run's round cadence). memory_fraction: share of the available memory training may
        take, leaving room for the page cache and the allocator's slack. min_battery_percent
        and full_battery_percent: the battery taper (on battery power only). energy_j: energy
        per round above idle [J], None for no limit (e.g. a solar node's harvest per round).
        min_budget: the floor of p_k.
    """

    round_time_s: float = 60.0
    memory_fraction: float = 0.8
    min_battery_percent: float = 20.0
    full_battery_percent: float = 50.0
    energy_j: float | None = None
    min_budget: float = 0.05

    def __post_init__(self) -> None:
        if not self.round_time_s > 0:
            raise ValueError(f"round_time_s must be positive, got {self.round_time_s}")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if not 0 <= self.min_battery_percent < self.full_battery_percent <= 100:
            raise ValueError(
                "need 0 <= min_battery_percent < full_battery_percent <= 100, got "
                f"{self.min_battery_percent} and {self.full_battery_percent}"
            )
        if self.energy_j is not None and not self.energy_j > 0:
            raise ValueError(f"energy_j must be positive or None, got {self.energy_j}")
        if not 0 < self.min_budget <= 1:
            raise ValueError(f"min_budget must be in (0, 1], got {self.min_budget}")


@dataclass(frozen=True)
class Budget:
    """p_k and every figure it came from (all plain values: the agent's status carries them).

    limited_by: the smallest factor, "time", "energy" or "battery", or "none" when all are 1, with
    " (floored)" when p_k was raised to min_budget. expected_train_s: the predicted training
    time of the round at p_k. batch_size: the largest batch that fits the memory limit
    (at least 1, at most the configured one); fits_memory is False when even 1 does not.
    """

    p_k: float
    effective_gflops: float
    load_share: float
    time_factor: float
    energy_factor: float | None
    battery_factor: float
    memory_factor: float
    batch_size: int
    fits_memory: bool
    expected_train_s: float
    limited_by: str
    reason: str
    allowed_mb: float | None = None
    """Memory the round's training may take [MiB] (what picks a reduction's batch)."""


def _clip(x: float, low: float = 0.0, high: float = 1.0) -> float:
    return min(max(x, low), high)


def _battery_factor(reading: DeviceReading, limits: BudgetLimits) -> float:
    if reading.battery_percent is None or reading.on_ac_power:
        return 1.0
    span = limits.full_battery_percent - limits.min_battery_percent
    taper = (reading.battery_percent - limits.min_battery_percent) / span
    return _clip(limits.min_budget + (1 - limits.min_budget) * taper, limits.min_budget)


@dataclass(frozen=True)
class _MemoryFit:
    """How the round's memory compares with what it may take [MiB]; see `_fit_memory`."""

    allowed_mb: float
    footprint_mb: float
    factor: float
    fits: bool
    batch_size: int


def _fit_memory(
    profile: DeviceProfile, reading: DeviceReading, work: RoundWork, limits: BudgetLimits
) -> _MemoryFit:
    """The memory side of the budget: it limits the batch, never p_k (module docstring)."""
    available_mb = reading.available_memory_mb
    if available_mb is None:
        available_mb = profile.memory_mb * NOMINAL_AVAILABLE_FRACTION
    allowed_mb = limits.memory_fraction * min(available_mb, profile.memory_mb)
    footprint_mb = work.fixed_memory_mb + work.batch_size * work.sample_memory_mb
    batch_size = work.batch_size
    if work.sample_memory_mb > 0:
        room = (allowed_mb - work.fixed_memory_mb) / work.sample_memory_mb
        batch_size = int(_clip(room, 1, work.batch_size))
    return _MemoryFit(
        allowed_mb=allowed_mb,
        footprint_mb=footprint_mb,
        factor=_clip(allowed_mb / footprint_mb) if footprint_mb > 0 else 1.0,
        fits=allowed_mb >= work.fixed_memory_mb + work.sample_memory_mb,
        batch_size=batch_size,
    )


def _factors(
    profile: DeviceProfile,
    reading: DeviceReading,
    work: RoundWork,
    limits: BudgetLimits,
    flops_per_s: float,
) -> dict[str, float]:
    """The time, battery and (when limited) energy factors of p_k, in that order: `min`
    breaks ties by it, which decides the `limited_by` that is reported."""

    def afford(seconds: float) -> float:
        if work.train_flops <= 0:
            return 1.0
        return _clip((seconds * flops_per_s - work.fixed_flops) / work.train_flops)

    factors = {"time": afford(limits.round_time_s), "battery": _battery_factor(reading, limits)}
    marginal_w = profile.max_power_w - profile.idle_power_w
    if limits.energy_j is not None and marginal_w > 0:
        factors["energy"] = afford(limits.energy_j / marginal_w)
    return factors


def _limit_reason(
    limited_by: str,
    dense_s: float,
    marginal_w: float,
    reading: DeviceReading,
    limits: BudgetLimits,
) -> str:
    """Why a dense round does or does not fit, for the factor named by `limited_by`."""
    reasons = {
        "none": f"a dense round fits: {dense_s:.3g} s of {limits.round_time_s:g} s",
        "time": f"a dense round needs {dense_s:.3g} s, {limits.round_time_s:g} s allowed",
        "energy": (
            f"a dense round needs {dense_s * marginal_w:.3g} J above idle, "
            f"{limits.energy_j or 0:g} J allowed"
        ),
        "battery": (
            f"on battery at {reading.battery_percent or 0:g}% "
            f"(full budget from {limits.full_battery_percent:g}%)"
        ),
    }
    return reasons[limited_by.split()[0]]


def _peak(profile: DeviceProfile, compute: str | None) -> tuple[float, str]:
    """The peak GFLOPS the budget uses and how the reason names it: the profile's main
    compute without `compute`, else the peak of that device type (ValueError if the board
    has no such compute)."""
    if compute is None:
        return profile.peak_fp32_gflops, "peak"
    return profile.peak_for(compute), f"{compute} peak"


def compute_budget(
    profile: DeviceProfile,
    reading: DeviceReading,
    work: RoundWork,
    limits: BudgetLimits | None = None,
    efficiency: float = DEFAULT_EFFICIENCY,
    compute: str | None = None,
    measured_dense_s: float | None = None,
    measured_fixed_s: float = 0.0,
) -> Budget:
    """The budget of one round by the rule in the module docstring (a pure function).

    `compute`: the device type the agent trains on ("cpu" or "cuda", `torch.device.type`);
    None budgets the profile's main compute (`peak_fp32_gflops`), as simulate and emulate do.
    `measured_dense_s`: a dense round's seconds on this device by its measured cost table
    (`agent.device.calibration`), of which `measured_fixed_s` no reduction cuts (RigL's
    dense steps, the evaluation); given, the time factor is the share of the rest that fits
    what round_time_s leaves after the fixed part (both stretched by the load share), as
    the FLOP rule's `afford` does with counted FLOPs.
    """
    limits = limits or BudgetLimits()
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency}")
    peak, peak_name = _peak(profile, compute)
    cpu_share = (reading.other_load or 0.0) / max(reading.cpu_count, 1)
    gpu_share = (reading.gpu_load_percent or 0.0) / 100
    load_share = _clip(max(cpu_share, gpu_share))
    gflops = peak * efficiency / (1 + load_share)
    flops_per_s = gflops * 1e9

    factors = _factors(profile, reading, work, limits, flops_per_s)
    if measured_dense_s is not None and measured_dense_s > measured_fixed_s:
        stretch = 1 + load_share
        reducible = (measured_dense_s - measured_fixed_s) * stretch
        factors["time"] = _clip((limits.round_time_s - measured_fixed_s * stretch) / reducible)
    smallest = min(factors, key=lambda name: factors[name])
    p_k = _clip(factors[smallest], limits.min_budget)
    floored = factors[smallest] < limits.min_budget
    limited_by = smallest if factors[smallest] < 1 else "none"
    if floored:
        limited_by += " (floored)"
    memory = _fit_memory(profile, reading, work, limits)

    dense_s = (work.fixed_flops + work.train_flops) / flops_per_s
    expected_s = (work.fixed_flops + p_k * work.train_flops) / flops_per_s
    if measured_dense_s is not None and measured_dense_s > measured_fixed_s:
        dense_s = measured_dense_s * (1 + load_share)
        fixed_s = measured_fixed_s * (1 + load_share)
        expected_s = fixed_s + p_k * (dense_s - fixed_s)
    marginal_w = profile.max_power_w - profile.idle_power_w
    reason = (
        f"p_k={p_k:.3g}: {_limit_reason(limited_by, dense_s, marginal_w, reading, limits)} "
        f"at {gflops:.3g} effective GFLOPS ({peak:g} {peak_name} x "
        f"{efficiency:g} efficiency / (1 + load {load_share:.2f}))"
    )
    if floored:
        reason += f"; raised to the floor {limits.min_budget:g}, so the round overruns"
    if memory.batch_size < work.batch_size:
        reason += (
            f"; memory: batch {work.batch_size} needs {memory.footprint_mb:.0f} MiB, "
            f"{memory.allowed_mb:.0f} MiB allowed: batch {memory.batch_size}"
        )
    if not memory.fits:
        reason += "; memory: does not fit even at batch 1"
    return Budget(
        p_k=p_k,
        effective_gflops=gflops,
        load_share=load_share,
        time_factor=factors["time"],
        energy_factor=factors.get("energy"),
        battery_factor=factors["battery"],
        memory_factor=memory.factor,
        batch_size=memory.batch_size,
        fits_memory=memory.fits,
        expected_train_s=expected_s,
        limited_by=limited_by,
        reason=reason,
        allowed_mb=memory.allowed_mb,
    )


def calibrated_efficiency(
    executed_flops: float,
    seconds: float,
    profile: DeviceProfile,
    load_share: float = 0.0,
    compute: str | None = None,
) -> float:
    """The efficiency a device actually reached, to feed back into `compute_budget`.

    `executed_flops` must be what the hardware computed: for masked-dense PyTorch that is the
    dense count, not the sparse one. Feeding the sparse count would read a sparser model's
    unchanged wall time as lower efficiency, shrink p_k, prune further, and spiral to the
    floor. Clipped to (0, 1]. `compute` as in `compute_budget`: pass the same to both.
    """
    if not (executed_flops > 0 and seconds > 0):
        raise ValueError(f"need positive flops and seconds, got {executed_flops}, {seconds}")
    peak = _peak(profile, compute)[0] * 1e9 / (1 + _clip(load_share))
    return _clip(executed_flops / (seconds * peak), 1e-6)
