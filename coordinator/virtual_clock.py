"""Virtual seconds for the simulator: when each agent's rounds would start and end on its
board, so that `simulate` can order asynchronous rounds as a real fleet would and report the
time a run takes without waiting for it.

A round's work is its training FLOPs at the board's effective rate and its bytes over the
board's link (the very figures `agent.device.throttle` sleeps out in `emulate`); an agent
without a profile (no `--profiles`) takes `DEFAULT_ROUND_S` a round. `finish` places that
work on the agent's timeline; availability patterns (a device that sleeps, a link that
drops) extend it past the spans the device is offline.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from agent.device.budget import DEFAULT_EFFICIENCY
from agent.device.throttle import link_delay_s

if TYPE_CHECKING:
    from agent.device.availability import Pattern
    from agent.experiment import ExperimentConfig
    from firmware_profiles import DeviceProfile

DEFAULT_ROUND_S = 1.0
"""Virtual seconds of a round of an agent that is no emulated board."""


@dataclass(frozen=True)
class VirtualClock:
    """Each agent's modelled seconds of work, and when work started at a time ends."""

    profiles: Mapping[str, DeviceProfile] = field(default_factory=dict)
    """Each agent's board (`agent.experiment.agent_profiles`); empty: none is a board."""
    efficiency: float = DEFAULT_EFFICIENCY
    """The share of a board's peak its training reaches, as the throttle assumes."""
    patterns: Mapping[str, Pattern] = field(default_factory=dict)
    """Each agent's availability (`agent.experiment.agent_availability`); one not named is
    always online."""

    @classmethod
    def of(cls, config: ExperimentConfig, roster: list[str]) -> VirtualClock:
        """The clock of a run: its agents' boards and availability patterns."""
        from agent.experiment import agent_availability, agent_profiles

        return cls(agent_profiles(config, roster), patterns=agent_availability(config, roster))

    @property
    def comes_and_goes(self) -> bool:
        """Whether some agent of the run is ever offline."""
        return bool(self.patterns)

    def seconds(self, agent: str, train_flops: float, num_bytes: int) -> float:
        """Modelled seconds of a round of `train_flops` that sends and receives `num_bytes`
        on `agent`'s board; `DEFAULT_ROUND_S` for an agent without one."""
        profile = self.profiles.get(agent)
        if profile is None:
            return DEFAULT_ROUND_S
        compute = train_flops / (profile.peak_fp32_gflops * self.efficiency * 1e9)
        return compute + link_delay_s(num_bytes, profile.link_bandwidth_mbps)

    def finish(self, agent: str, start: float, seconds: float) -> float:
        """The virtual time at which `seconds` of `agent`'s work started at `start` ends: it
        progresses only while the agent is online (`Pattern.finish`)."""
        pattern = self.patterns.get(agent)
        if pattern is None:
            return start + seconds
        return pattern.finish(start, seconds)
