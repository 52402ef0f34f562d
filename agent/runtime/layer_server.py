"""The sender's side of `--wire layers`: neighbours ask for chosen layers of a recent model,
and the layer server batches their requests so that one publish serves every asker."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator

log = logging.getLogger(__name__)

PublishLayers = Callable[[int, set[str]], Iterator[tuple[str, int, bool]]]
"""Publishes a round's layers one by one, yielding (layer, values it carried, retained)."""


class LayerServer:
    """Collects neighbours' requests for layers (--wire layers) and publishes each layer
    asked for once per batch: the requests that come within `delay_s` of a batch's first
    share one publish, which reaches every neighbour that subscribed before asking.

    A layer small enough to be retained goes out once per round: a neighbour asks only after
    its subscription is acknowledged, and the broker hands it the retained copy on
    subscribing, so later askers need no publish. One that asks a second time missed it and
    gets a new publish, and so does everyone after a reconnect (`reconnected`: the broker
    may have restarted without its retained messages)."""

    def __init__(self, publish: PublishLayers, delay_s: float) -> None:
        self._publish = publish
        self._delay_s = delay_s
        self._lock = threading.Lock()
        self._flushing = threading.Lock()
        """Held while a batch is published and recorded, so that `forget` and `close`, which
        wait for it, see every layer it retained."""
        self._pending: dict[int, set[str]] = {}
        self._timer: threading.Timer | None = None
        self._served = 0
        self._closed = False
        self._retained: dict[int, set[str]] = {}
        """Layers the broker may retain, per round: cleared when the round is forgotten."""
        self._trusted: dict[int, set[str]] = {}
        """Retained layers published on the current connection: a new asker has them."""
        self._askers: dict[tuple[int, str], set[str]] = {}

    def ask(self, round_: int, layers: list[str], asker: str) -> None:
        with self._lock:
            if self._closed:
                return
            wanted = set()
            for layer in layers:
                askers = self._askers.setdefault((round_, layer), set())
                if layer not in self._trusted.get(round_, ()) or asker in askers:
                    wanted.add(layer)
                askers.add(asker)
            if not wanted:
                return
            self._pending.setdefault(round_, set()).update(wanted)
            if self._timer is None:
                self._timer = threading.Timer(self._delay_s, self.flush)
                self._timer.daemon = True
                self._timer.start()

    def flush(self) -> None:
        with self._flushing:
            with self._lock:
                pending, self._pending, self._timer = self._pending, {}, None
            for round_, layers in sorted(pending.items()):
                try:
                    for layer, values, retained in self._publish(round_, layers):
                        with self._lock:
                            self._served += values
                            if retained:
                                self._retained.setdefault(round_, set()).add(layer)
                                self._trusted.setdefault(round_, set()).add(layer)
                except Exception:  # the transport stopped, a queue stayed full: they ask again
                    log.exception("could not publish the layers of round %d", round_)

    def take_served(self) -> int:
        """Values published since the last call."""
        with self._lock:
            served, self._served = self._served, 0
        return served

    def reconnected(self) -> None:
        """Publish again for every asker: the broker may have lost what it retained."""
        with self._lock:
            self._trusted = {}

    def may_retain(self, round_: int, layers: Iterable[str]) -> None:
        """Layers the broker may hold from before a restart: cleared with their round."""
        with self._lock:
            self._retained.setdefault(round_, set()).update(layers)

    def forget(self, round_: int) -> set[str]:
        """Stop serving `round_` (after a batch being published); returns its layers the
        broker may still retain."""
        with self._flushing, self._lock:
            self._askers = {key: a for key, a in self._askers.items() if key[0] != round_}
            self._pending.pop(round_, None)
            self._trusted.pop(round_, None)
            return self._retained.pop(round_, set())

    def close(self) -> dict[int, set[str]]:
        """Drop what is pending and take no more requests (the run is over); returns, after
        a batch being published, the layers the broker may still retain, per round."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self._pending, self._timer, self._closed = {}, None, True
        with self._flushing, self._lock:
            retained, self._retained, self._trusted, self._askers = self._retained, {}, {}, {}
            return retained
