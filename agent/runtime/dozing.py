"""An emulated device that comes and goes: its availability pattern acted out in real time.

The session's round thread asks `wait_online` before each round (the first starts the
pattern's clock), and `hold` after each
computation: while the device sleeps it trains and publishes nothing, and its work only
progresses while it is online, so a round's computation ends when
`Pattern.finish(start, seconds)` says, as the simulator's virtual clock places it. A
link that drops is a real lost connection: a thread cuts the transport at each drop of the
pattern (`Transport.drop_link`), the broker publishes the device's will, and the transport
connects again when the drop ends, as a board's would.

Time is the pattern's: seconds since `begin` (the agent's first round). What the device
answers on other threads (a re-send a peer asks for) is not held while it sleeps.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from agent.device.availability import Pattern
from protocol import Transport

log = logging.getLogger(__name__)


class Dozing:
    """One agent's availability in its session; without a pattern every call returns 0."""

    def __init__(
        self,
        pattern: Pattern | None,
        transport: Transport,
        stop: threading.Event,
        on_sleep: Callable[[float], None],
    ) -> None:
        """`on_sleep(seconds)`: told before the device sleeps that long (its status)."""
        self.pattern = pattern
        self.transport = transport
        self.stop = stop
        self.on_sleep = on_sleep
        self._t0: float | None = None
        self._link: threading.Thread | None = None
        self._over = threading.Event()
        self.shown: tuple[str, int, dict[str, Any], Mapping[int, bool]] | None = None
        """The session's last status (state, round, metrics, votes): what it says again,
        with `asleep_s`, when it sleeps."""

    def now(self) -> float:
        """The pattern's time: seconds since `begin`."""
        if self._t0 is None:
            self.begin()
        assert self._t0 is not None
        return time.monotonic() - self._t0

    def begin(self) -> None:
        """The rounds begin (the first `wait_online`): the pattern's time 0, and its link
        starts dropping."""
        self._t0 = time.monotonic()
        if self.pattern is not None and self.pattern.availability.drops:
            self._link = threading.Thread(target=self._drop_links, name="link-drops", daemon=True)
            self._link.start()

    def wait_online(self) -> float:
        """Sleep until the device is online (telling `on_sleep` first); the seconds slept."""
        if self.pattern is None:
            return 0.0
        now = self.now()
        waking = self.pattern.next_online(now)
        if waking <= now:
            return 0.0
        self.on_sleep(waking - now)
        return self._sleep_until(waking)

    def hold(self, started: float, seconds: float) -> float:
        """Sleep so that `seconds` of work started at monotonic time `started` ends when
        the pattern lets it (it progresses only while online); the seconds slept."""
        if self.pattern is None:
            return 0.0
        ends = self.pattern.finish(self.now() - (time.monotonic() - started), seconds)
        return self._sleep_until(ends)

    def _sleep_until(self, t: float) -> float:
        wait = max(0.0, t - self.now())
        if wait > 0:
            self.stop.wait(wait)
        return wait

    def _drop_links(self) -> None:
        """Cut the transport at each of the pattern's drops until the run is over."""
        assert self.pattern is not None
        while not self.stop.is_set():
            start, end = self.pattern.next_drop(self.now())
            if math.isinf(start) or self._over.wait(max(0.0, start - self.now())):
                return
            log.info("link down for %.0f s (availability)", end - start)
            self.transport.drop_link(end - self.now())
            if self._over.wait(max(0.0, end - self.now())):
                return

    def close(self) -> None:
        """The run is over: no more drops."""
        self._over.set()
        if self._link is not None:
            self._link.join(timeout=5)
