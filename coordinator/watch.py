"""`coordinator status` and `coordinator status --watch`: follow a broker's retained presence
and status messages and show the fleet table, once or kept current until Ctrl-C.

On a terminal `--watch` redraws the table in place (rich `Live`) as messages arrive. Off a
terminal (a pipe, a log file, `watch -n`) cursor control would only garble the output, so it
prints a fresh table, headed by the time, whenever the fleet changed: at most once per
interval, and never the same table twice in a row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import threading
import time
from collections.abc import Callable, Iterator

import click
from rich.console import Console
from rich.live import Live
from rich.table import Table

from coordinator.fleet import AgentEntry, FleetView, fleet_table
from protocol import BrokerAddress, MqttTransport, topics
from protocol.cli import BrokerSettings
from protocol.mqtt import unreachable
from protocol.signing import Signer

Sightings = Callable[[], set[tuple[str, str]]]
"""The (fleet, agent) pairs mDNS sees right now."""

LOG_WIDTH = 250
"""Off a terminal, the widest a table grows to keep one line per agent."""

MIN_REDRAW_S = 0.1
"""At most ten redraws a second, however many statuses a large fleet sends at once."""


class FleetFeed:
    """A fleet view fed by a transport's presence and status subscriptions; `changed` is set
    by every message, for a watcher to wait on. Its view follows `MAX_MEMBERS` members at
    most (`FleetView.dropped`)."""

    def __init__(self, transport: MqttTransport, fleet: str | None, key: Signer | None) -> None:
        self.transport = transport
        self.fleet = fleet
        self.changed = threading.Event()
        self._view = FleetView(key=key)
        self._lock = threading.Lock()
        transport.subscribe(topics.presence(fleet or "+"), self._on_message)
        transport.subscribe(topics.status(fleet or "+"), self._on_message)

    @property
    def dropped(self) -> int:
        """Messages of members beyond MAX_MEMBERS, left out."""
        with self._lock:
            return self._view.dropped

    def _on_message(self, topic: str, payload: bytes) -> None:
        with self._lock:
            self._view.feed(topic, payload)
        self.changed.set()

    def entries(self, seen: set[tuple[str, str]] | None = None) -> list[AgentEntry]:
        """Every agent heard of, and (with `seen`) those only mDNS sees, of the fleet."""
        with self._lock:  # copies: the dispatcher thread changes the view's entries
            entries = [dataclasses.replace(e) for e in self._view.entries()]
        known = {(e.fleet, e.agent) for e in entries}
        return entries + [
            AgentEntry(f, a)
            for f, a in sorted(seen or ())
            if (f, a) not in known and self.fleet in (None, f)
        ]


LOCAL_BROKER = BrokerAddress("127.0.0.1", 1883)
"""The broker of a command not given --broker: this machine's (`coordinator serve`'s)."""


def require_broker(broker: BrokerAddress, given: bool, timeout_s: float = 3.0) -> None:
    """One line naming the address and the cause (exit 1) when nothing answers there: an
    MQTT client retries a dead address in silence, and a command would wait out its
    timeout, or forever, with the user none the wiser."""
    problem = unreachable(broker, timeout_s)
    if problem is not None:
        hint = "check --broker" if given else "give --broker, or start `coordinator serve`"
        raise click.ClickException(f"{problem}: {hint}")


def connected(transport: MqttTransport, timeout_s: float) -> None:
    """Wait for `transport` to connect; a refusal (a wrong password, a user the broker does
    not know) or silence is a one-line error."""
    if transport.wait_connected(timeout_s):
        return
    if transport.refused:
        raise click.ClickException(
            f"the MQTT broker at {transport.broker} refused the connection: {transport.refused}"
        )
    raise click.ClickException(
        f"cannot reach the MQTT broker at {transport.broker} within {timeout_s:g}s"
    )


@contextlib.contextmanager
def follow(
    settings: BrokerSettings, fleet: str | None, key: Signer | None, timeout_s: float
) -> Iterator[FleetFeed]:
    """A connected `FleetFeed` of the broker (default: this machine's); a broker that cannot
    be reached is a one-line error, within `timeout_s` at most."""
    broker = settings.address or LOCAL_BROKER
    require_broker(broker, settings.address is not None, min(timeout_s, 3.0))
    transport = MqttTransport(broker, settings.transport_options(None))
    feed = FleetFeed(transport, fleet, key)
    transport.start()
    try:
        connected(transport, timeout_s)
        yield feed
    finally:
        transport.stop()


@contextlib.contextmanager
def mdns_sightings(interfaces: tuple[str, ...]) -> Iterator[Sightings | None]:
    """What mDNS sees on `interfaces`, kept current while open; None without interfaces."""
    if not interfaces:
        yield None
        return
    from protocol.discovery import Discovery  # zeroconf: only when asked for

    try:
        discovery = Discovery(interfaces=list(interfaces))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--mdns") from None
    with discovery:
        yield lambda: set(discovery.agents())


def render(
    entries: list[AgentEntry],
    seen: set[tuple[str, str]] | None,
    caption: str | None = None,
    width: int | None = None,
) -> Table:
    """The fleet table within `width` (or a one-row note while no agent has announced
    itself)."""
    if not entries:
        table = Table.grid()
        table.add_row("no agents have announced themselves on this broker")
        if caption:
            table.add_row(caption)
        return table
    return fleet_table(entries, seen, caption, width)


def show(
    console: Console,
    entries: list[AgentEntry],
    seen: set[tuple[str, str]] | None,
    caption: str | None = None,
) -> None:
    """Print the fleet table: within the terminal's width (or COLUMNS); elsewhere as wide
    as its content, up to LOG_WIDTH, so a log or a pipe keeps one line per agent."""
    if console.is_terminal or os.environ.get("COLUMNS"):
        console.print(render(entries, seen, caption, console.width))
        return
    table = render(entries, seen, caption, LOG_WIDTH)
    width = Console(width=LOG_WIDTH, file=io.StringIO()).measure(table).maximum
    Console(file=console.file, width=width, color_system=None).print(table)


def watch(
    feed: FleetFeed,
    console: Console,
    interval_s: float,
    stop: threading.Event,
    sightings: Sightings | None = None,
) -> None:
    """Show the fleet table until `stop` (Ctrl-C): redrawn in place on a terminal, printed
    afresh when it changed otherwise."""
    if not console.is_terminal:
        print_changes(feed, console, interval_s, stop, sightings)
        return
    with Live(console=console, auto_refresh=False) as live:
        while not stop.is_set():
            seen = sightings() if sightings is not None else None
            table = render(feed.entries(seen), seen, caption(feed), console.width)
            live.update(table, refresh=True)
            wait_for_change(feed, stop, interval_s)


def print_changes(
    feed: FleetFeed,
    console: Console,
    interval_s: float,
    stop: threading.Event,
    sightings: Sightings | None,
) -> None:
    """`watch` off a terminal: a table, headed by the time, each interval in which the fleet
    (or what mDNS sees, or the broker connection) changed; the ages in the presence column
    alone do not count, so a quiet fleet does not fill the log."""
    shown: object = None
    while not stop.is_set():
        seen = sightings() if sightings is not None else None
        entries = feed.entries(seen)
        state = ([vars(e) for e in entries], seen, feed.transport.connected)
        if state != shown:
            console.rule(time.strftime("%Y-%m-%d %H:%M:%S"))
            show(console, entries, seen, caption(feed, live=False))
            shown = state
        stop.wait(interval_s)


def wait_for_change(feed: FleetFeed, stop: threading.Event, interval_s: float) -> None:
    """Return on the next message (after at least MIN_REDRAW_S), on `stop`, or after
    `interval_s` at most, so the ages in the presence column keep ticking."""
    deadline = time.monotonic() + interval_s
    stop.wait(min(MIN_REDRAW_S, interval_s))
    while not stop.is_set() and not feed.changed.is_set():
        left = deadline - time.monotonic()
        if left <= 0:
            break
        feed.changed.wait(min(left, MIN_REDRAW_S))
    feed.changed.clear()


def caption(feed: FleetFeed, live: bool = True) -> str:
    """Under the table: what its figures are, a lost broker connection and, when live, when
    it was drawn and how to leave."""
    parts = [time.strftime("updated %H:%M:%S")] if live else []
    if not feed.transport.connected:
        parts.append(f"[red]broker {feed.transport.broker} unreachable; reconnecting[/]")
    parts.append("figures of each agent's latest round")
    if live:
        parts.append("Ctrl-C to stop")
    return " · ".join(parts)
