"""Emulation throttle: an agent on a laptop takes the time its profile's board would take.

Compute. The emulated board trains at the budget's effective rate, peak_fp32_gflops x
efficiency (`agent.device.budget`), so a dense round of F counted training FLOPs takes F / rate
seconds there. A round the budget cut takes the share of that the host measured for its
reduction (`board_seconds`, from the cost table of `agent.device.calibration`): a pruned
masked-dense model takes as long as the dense one, as it would on the board. Without a cost
table (the centralized strategies) the round's counted FLOPs stand in. The agent sleeps for
whatever its real computation left of that. The target comes from
FLOPs, not from scaling the host's measured time by a host/board speed ratio, because:
several emulated agents share the host's cores, and contention would stretch a ratio-scaled
time but not this one; a host matmul benchmark against a board's datasheet peak compares an
achieved rate with a peak one; and the budget predicted its p_k with this same model, so an
emulated board meets the round time its budget planned for when its reduction really saves
that time. When the host is slower than the board the delay is 0 and the round is simply late.

Link. A transfer of B bytes takes latency + 8 B / (link_bandwidth_mbps x 1e6) seconds on the
board's link; the agent sleeps that long before it sends and after it receives, since the
loopback network or LAN of the host takes next to no time itself.

Energy (`energy_j`): the energy a round adds to what the board draws anyway,
compute_s x (max_power_w - idle_power_w) + radio_s x radio_power_w. The profiles' max power is
the whole board under load, idle included, so the idle part is taken out: it is spent whether
the agent trains or not and would only blur a comparison between strategies. The radio draws
radio_power_w while it sends or receives (the profiles give the transmit draw; receiving
draws somewhat less, so receive energy is a slight overestimate).

A round's reported energy is two figures (`round_energy`), both modelled (ENERGY_SOURCE):
- training energy (the records' `energy_j`): the board's time for the round's counted
  training FLOPs at its effective rate (as the budget plans and the throttle sleeps) times the
  power above idle. It depends on train_flops alone, which simulate and emulate compute
  bit-identically, so the two report exactly the same `energy_j` for the same seed. It is the
  DA-DPFL paper's measure (energy from training FLOPs), the one strategies are compared by.
- radio energy (`radio_energy_j`): the link time of the round's bytes sent and received times
  the radio's draw. Its bytes are each side's own count: simulate's encoded message sizes,
  emulate's whatever its MQTT connection carried (statuses, envelopes, re-sends), a little
  more; so radio energy is close between the two, not equal. It is reported apart so that the
  equal figure stays equal; the two add up to the round's energy above idle.
A real board (`Throttle(..., enabled=False)`) times its own training instead of modelling it.
The power stays the profile's: where a board can be read (jtop's power rails on a Jetson,
`agent.device.budget._read_jetson` already opens jtop) a measured figure would replace
compute_s x power; none is read yet, so every figure is modelled.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from agent.device.budget import DEFAULT_EFFICIENCY
from firmware_profiles import DeviceProfile


def compute_delay_s(measured_s: float, flops: float, device_gflops: float) -> float:
    """Seconds to sleep after `measured_s` of real compute so that the total is the time a
    device of `device_gflops` effective GFLOP/s takes for `flops`; 0 if the host was slower."""
    if device_gflops <= 0:
        raise ValueError(f"device_gflops must be positive, got {device_gflops}")
    return max(0.0, flops / (device_gflops * 1e9) - measured_s)


def link_delay_s(num_bytes: int, bandwidth_mbps: float, latency_s: float = 0.0) -> float:
    """Seconds that `num_bytes` take on a link of `bandwidth_mbps` megabit/s (10^6 bit/s)."""
    if bandwidth_mbps <= 0 or latency_s < 0 or num_bytes < 0:
        raise ValueError(
            f"need positive bandwidth, non-negative latency and size, got "
            f"{bandwidth_mbps} Mbit/s, {latency_s} s, {num_bytes} B"
        )
    return latency_s + 8 * num_bytes / (bandwidth_mbps * 1e6)


def energy_j(
    profile: DeviceProfile, compute_s: float, tx_bytes: int = 0, rx_bytes: int = 0
) -> float:
    """Energy [J] that `compute_s` of training and the transfers add above the board's idle
    draw (model in the module docstring)."""
    radio_s = link_delay_s(tx_bytes + rx_bytes, profile.link_bandwidth_mbps)
    return compute_s * (profile.max_power_w - profile.idle_power_w) + (
        radio_s * profile.radio_power_w
    )


ENERGY_SOURCE = "modelled"
"""Where reported energy comes from: the profile's power model (no board's power is read)."""


def training_energy_j(
    profile: DeviceProfile, train_flops: float, efficiency: float = DEFAULT_EFFICIENCY
) -> float:
    """Energy [J] above idle of `train_flops` counted training FLOPs on an idle board of
    `profile`: its time at peak x `efficiency` times its power above idle."""
    return energy_j(profile, train_flops / (profile.peak_fp32_gflops * efficiency * 1e9))


def radio_energy_j(profile: DeviceProfile, num_bytes: int) -> float:
    """Energy [J] of `num_bytes` sent or received on the board's link."""
    return energy_j(profile, 0.0, tx_bytes=num_bytes)


def round_energy(
    profile: DeviceProfile, train_flops: float, traffic_bytes: int
) -> tuple[float, float]:
    """(training energy, radio energy) of a round on an emulated or simulated board, the
    figures simulate and emulate both report (module docstring)."""
    return training_energy_j(profile, train_flops), radio_energy_j(profile, traffic_bytes)


class Throttle:
    """Makes one agent's compute and link take its profile's time.

    The agent calls `after_compute` once its local training is done, `before_send` before it
    publishes bytes and `after_receive` when it takes a received message in. Each sleeps and
    returns the seconds slept, for the agent's status. Disabled (a real board: its own speed
    is the truth), every call returns 0 at once.
    """

    def __init__(
        self,
        profile: DeviceProfile,
        *,
        efficiency: float = DEFAULT_EFFICIENCY,
        latency_s: float = 0.0,
        enabled: bool = True,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not 0 < efficiency <= 1:
            raise ValueError(f"efficiency must be in (0, 1], got {efficiency}")
        self.profile = profile
        self.efficiency = efficiency
        self.device_gflops = profile.peak_fp32_gflops * efficiency
        self.latency_s = latency_s
        self.enabled = enabled
        self._sleep = sleep

    def _wait(self, seconds: float) -> float:
        if not self.enabled:
            return 0.0
        if seconds > 0:
            self._sleep(seconds)
        return seconds

    def after_compute(self, measured_s: float, flops: float) -> float:
        """Sleep out the rest of the board's time for `flops` counted training FLOPs."""
        return self._wait(compute_delay_s(measured_s, flops, self.device_gflops))

    def board_seconds(self, fixed_flops: float, train_flops: float, share: float) -> float:
        """The board's time for a round whose training takes `share` of a dense round by
        this host's measured costs (`agent.device.calibration`): the dense round's time on
        the board (its counted FLOPs at the effective rate, as its budget plans) scaled by
        the measured share; the fixed part (RigL's dense gradient) is not reduced."""
        return (fixed_flops + share * train_flops) / (self.device_gflops * 1e9)

    def until(self, measured_s: float, board_s: float) -> float:
        """Sleep out the rest of `board_s` after `measured_s` of real compute."""
        return self._wait(max(0.0, board_s - measured_s))

    def before_send(self, num_bytes: int) -> float:
        """Sleep for the time `num_bytes` take on the board's uplink."""
        return self._wait(link_delay_s(num_bytes, self.profile.link_bandwidth_mbps, self.latency_s))

    def after_receive(self, num_bytes: int) -> float:
        """Sleep for the time `num_bytes` took to arrive over the board's link."""
        return self._wait(link_delay_s(num_bytes, self.profile.link_bandwidth_mbps, self.latency_s))

    def round_energy(
        self, train_flops: float, trained_s: float, traffic_bytes: int
    ) -> tuple[float, float]:
        """(training energy, radio energy) of a round: an emulated board's training time is
        modelled from its FLOPs, as the simulator does; a real one's is the `trained_s` it
        measured."""
        if not self.enabled:
            return energy_j(self.profile, trained_s), radio_energy_j(self.profile, traffic_bytes)
        return round_energy(self.profile, train_flops, traffic_bytes)
