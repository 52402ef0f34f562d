"""The device side of an agent: its resource budget p_k (`budget`), the emulation
throttle that makes a host take its profile's time (`throttle`) and the torch device it
trains on (`compute`)."""

from agent.device.budget import (
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
from agent.device.compute import DEVICE_CHOICES, resolve_device
from agent.device.throttle import Throttle, compute_delay_s, energy_j, link_delay_s

__all__ = [
    "DEFAULT_EFFICIENCY",
    "DEVICE_CHOICES",
    "Budget",
    "BudgetLimits",
    "DeviceReading",
    "RoundWork",
    "Throttle",
    "calibrated_efficiency",
    "compute_budget",
    "compute_delay_s",
    "energy_j",
    "link_delay_s",
    "nominal_reading",
    "read_device",
    "resolve_device",
]
