"""When a device is online: duty-cycled boards that sleep, links that drop.

A device's `Availability` is what a profile's `[availability]` table or a run's
`availability` spec says (online fraction, period, jitter; a link that drops); its `Pattern`
is that made concrete for one agent of one run: every phase and every random choice drawn
from (run seed, agent id) alone, so `simulate` (`coordinator.virtual_clock`) and `emulate`
(`agent.runtime.dozing`) place the same agent offline over the same spans of its run.

Time is seconds since the agent's rounds began. The duty cycle: period k spans
[phase + kP, phase + (k+1)P); the device is awake for `online_fraction` P of it, starting at
an offset drawn per period within `jitter` of the room left (jitter 0: the same place every
period), so the awake share is exactly the fraction over whole periods. The link: slot n
spans [phase' + nE, phase' + (n+1)E); with probability `drop_probability` (drawn per slot) the
link is down for the slot's first `drop_for_s`. A device is online when awake with its link
up; work (training, sending) only progresses while online (`finish`).

Pure and torch-free: plain arithmetic and a hash, no clock.
"""

from __future__ import annotations

import hashlib
import math
import random
import struct
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

MAX_PERIOD_S = 7 * 24 * 3600.0
"""The longest period or drop interval: a week."""
MAX_SLOTS_AHEAD = 100_000
"""How many drop slots `Pattern` looks ahead for the next drop (a rare drop is none)."""


@dataclass(frozen=True)
class Availability:
    """How a device comes and goes; the defaults are a device always online."""

    online_fraction: float = 1.0
    """Share of each period the device is awake, in (0, 1]."""
    period_s: float = 60.0
    """Length of one sleep-wake cycle, seconds."""
    jitter: float = 0.0
    """0: it wakes at the same point of every period; 1: anywhere its awake span fits."""
    drop_every_s: float = 0.0
    """The link may drop once per this many seconds; 0: it never drops."""
    drop_for_s: float = 0.0
    """How long a drop lasts, seconds (less than drop_every_s)."""
    drop_probability: float = 1.0
    """Chance that a given interval has its drop: 1 drops every drop_every_s seconds."""

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem:
            raise ValueError(problem)

    def problem(self) -> str | None:
        """Why these figures describe no device, in one line, or None."""
        checks = (
            (0 < self.online_fraction <= 1, "online_fraction must be in (0, 1]"),
            (0 < self.period_s <= MAX_PERIOD_S, f"period_s must be in (0, {MAX_PERIOD_S:g}]"),
            (0 <= self.jitter <= 1, "jitter must be in [0, 1]"),
            (0 <= self.drop_every_s <= MAX_PERIOD_S, "drop_every_s must be >= 0 and <= a week"),
            (0 <= self.drop_probability <= 1, "drop_probability must be in [0, 1]"),
        )
        for ok, text in checks:
            if not ok:
                return text
        if self.drop_every_s and not 0 < self.drop_for_s < self.drop_every_s:
            return "drop_for_s must be > 0 and less than drop_every_s"
        return None

    @property
    def always_online(self) -> bool:
        """Never asleep and never cut off."""
        return self.online_fraction >= 1 and not self.drops

    @property
    def drops(self) -> bool:
        """Whether the link ever drops."""
        return self.drop_every_s > 0 and self.drop_probability > 0

    @classmethod
    def of_table(cls, table: Mapping[str, Any], where: str) -> Availability:
        """From a profile's `[availability]` table; ValueError naming `where` and the key."""
        known = {f.name for f in fields(cls)}
        for key, value in table.items():
            if key not in known:
                raise ValueError(
                    f"{where}: field 'availability.{key}': unknown; expected "
                    f"{', '.join(sorted(known))}"
                )
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{where}: field 'availability.{key}': expected a number")
        try:
            return cls(**{key: float(value) for key, value in table.items()})
        except ValueError as exc:
            raise ValueError(f"{where}: [availability]: {exc}") from None


ALWAYS = Availability()
"""A device that never sleeps and whose link never drops."""


def _unit(*parts: object) -> float:
    """A number in [0, 1) fixed by `parts`: the same in every process and Python (no
    `hash()` salt), so simulate and emulate draw alike."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return struct.unpack(">Q", digest)[0] / 2.0**64


@dataclass(frozen=True)
class Pattern:
    """One agent's availability in one run: `online(t)`, `next_online(t)`, `finish`."""

    availability: Availability
    seed: int
    agent: str

    @property
    def always_online(self) -> bool:
        """Never asleep and never cut off."""
        return self.availability.always_online

    def _draw(self, kind: str, index: int = 0) -> float:
        return _unit(self.seed, self.agent, kind, index)

    # -- the duty cycle ------------------------------------------------------------------

    def _awake_span(self, k: int) -> tuple[float, float]:
        """The awake span of period k."""
        a = self.availability
        awake = a.online_fraction * a.period_s
        start = (self._draw("phase") + k) * a.period_s
        start += self._draw("wake", k) * a.jitter * (a.period_s - awake)
        return start, start + awake

    def _awake_around(self, t: float) -> tuple[float, float]:
        """The awake span that holds `t`, else the next one after it."""
        a = self.availability
        k = math.floor(t / a.period_s - self._draw("phase"))
        for index in (k - 1, k, k + 1):
            start, end = self._awake_span(index)
            if t < end:
                return start, end
        return self._awake_span(k + 2)

    # -- the link ------------------------------------------------------------------------

    def _drop_span(self, n: int) -> tuple[float, float] | None:
        """The drop of slot n, if it has one."""
        a = self.availability
        if self._draw("drop", n) >= a.drop_probability:
            return None
        start = (self._draw("drop-phase") + n) * a.drop_every_s
        return start, start + a.drop_for_s

    def _drop_around(self, t: float) -> tuple[float, float]:
        """The drop that holds `t`, else the next one after it (infinite: none ahead)."""
        a = self.availability
        n = math.floor(t / a.drop_every_s - self._draw("drop-phase"))
        for index in range(n - 1, n + MAX_SLOTS_AHEAD):
            span = self._drop_span(index)
            if span is not None and t < span[1]:
                return span
        return math.inf, math.inf

    # -- together ------------------------------------------------------------------------

    def asleep(self, t: float) -> bool:
        """Whether the device sleeps at `t` (its duty cycle alone)."""
        if self.availability.online_fraction >= 1:
            return False
        start, _ = self._awake_around(t)
        return t < start

    def link_down(self, t: float) -> bool:
        """Whether the device's link is down at `t` (its drops alone)."""
        return self.next_drop(t)[0] <= t

    def next_drop(self, t: float) -> tuple[float, float]:
        """The link's drop that holds `t`, else its next one: (start, end); infinite when
        its link never drops."""
        if not self.availability.drops:
            return math.inf, math.inf
        return self._drop_around(t)

    def online(self, t: float) -> bool:
        """Awake with its link up at `t`."""
        return not self.asleep(t) and not self.link_down(t)

    def next_online(self, t: float) -> float:
        """The first time >= `t` the device is online."""
        for _ in range(4 * MAX_SLOTS_AHEAD):
            moved = t
            if self.availability.online_fraction < 1:
                moved = max(moved, self._awake_around(moved)[0])
            if self.availability.drops:
                start, end = self._drop_around(moved)
                if start <= moved:
                    moved = end
            if moved == t:
                return t
            t = moved
        raise RuntimeError(f"{self.agent}: no online time found")  # pragma: no cover

    def online_until(self, t: float) -> float:
        """When the online span holding `t` ends (`t` itself if offline at `t`)."""
        if not self.online(t):
            return t
        end = math.inf
        if self.availability.online_fraction < 1:
            end = self._awake_around(t)[1]
        if self.availability.drops:
            end = min(end, self._drop_around(t)[0])
        return end

    def finish(self, start: float, seconds: float) -> float:
        """When `seconds` of work started at `start` ends, progressing only while online."""
        if self.always_online:
            return start + seconds
        left, t = seconds, start
        while True:
            t = self.next_online(t)
            end = self.online_until(t)
            if t + left <= end:
                return t + left
            left -= end - t
            t = end


def draw_duty_cycled(roster: list[str], share: float, seed: int) -> set[str]:
    """Which agents of `roster` are the `share` that the fleet's spec duty-cycles: the
    roster in an order drawn from `seed`, its first round(share x K); the same set in
    simulate and emulate."""
    ordered = sorted(roster)
    random.Random(f"availability:{seed}").shuffle(ordered)
    return set(ordered[: round(share * len(ordered))])


SPEC_SYNTAX = "SHARE:ONLINE:PERIOD[:JITTER][,drop=EVERY:FOR[:PROBABILITY]]"
"""The run's `availability` spec, e.g. "0.3:0.33:60": 30% of the devices awake a third of
every 60 s; "1:1:60,drop=300:20:0.5": every device awake, its link down 20 s in half of its
300 s intervals."""


@dataclass(frozen=True)
class FleetAvailability:
    """A run's `availability`: the share of its devices that follow `availability`."""

    share: float
    availability: Availability

    @classmethod
    def parse(cls, spec: str) -> FleetAvailability:
        """Read `SPEC_SYNTAX`; ValueError with one line naming what is wrong."""

        def fail(problem: str) -> ValueError:
            return ValueError(f"--availability {spec!r}: {problem}; expected {SPEC_SYNTAX}")

        cycle, _, drop = spec.partition(",")
        parts = cycle.split(":")
        if len(parts) not in (3, 4):
            raise fail("give SHARE:ONLINE:PERIOD, and optionally :JITTER")
        if drop and not drop.startswith("drop="):
            raise fail(f"unknown part {drop!r} after the comma")
        drops = drop.removeprefix("drop=").split(":") if drop else []
        if drop and len(drops) not in (2, 3):
            raise fail("give drop=EVERY:FOR, and optionally :PROBABILITY")
        try:
            numbers = [float(part) for part in [*parts, *drops]]
        except ValueError:
            raise fail("every part must be a number") from None
        if not all(math.isfinite(number) for number in numbers):
            raise fail("every part must be a finite number")
        share, figures = numbers[0], dict(zip(CYCLE_KEYS, numbers[1 : len(parts)], strict=False))
        figures |= dict(zip(DROP_KEYS, numbers[len(parts) :], strict=False))
        if not 0 <= share <= 1:
            raise fail("SHARE must be in [0, 1]")
        try:
            return cls(share, Availability(**figures))
        except ValueError as exc:
            raise fail(str(exc)) from None

    def patterns(self, roster: list[str], seed: int) -> dict[str, Pattern]:
        """The agents this spec covers (`draw_duty_cycled`) and their patterns."""
        chosen = draw_duty_cycled(roster, self.share, seed)
        return {agent: Pattern(self.availability, seed, agent) for agent in sorted(chosen)}


CYCLE_KEYS = ("online_fraction", "period_s", "jitter")
DROP_KEYS = ("drop_every_s", "drop_for_s", "drop_probability")
