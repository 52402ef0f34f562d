"""The device side's public names, for type checkers and `lazy_loader.attach_stub`."""

from .budget import (
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
from .compute import DEVICE_CHOICES, resolve_device
from .throttle import Throttle, compute_delay_s, energy_j, link_delay_s

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
