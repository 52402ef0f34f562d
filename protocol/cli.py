"""Command-line pieces shared by `edge-agent` and `coordinator`."""

from __future__ import annotations

import signal
import threading
from typing import Any

import click

from protocol import topics
from protocol.errors import ProtocolError
from protocol.mqtt import BrokerAddress


class BrokerType(click.ParamType):
    """HOST[:PORT] parsed into a BrokerAddress, with click's one-line error on bad input."""

    name = "HOST[:PORT]"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> BrokerAddress:
        if isinstance(value, BrokerAddress):
            return value
        try:
            return BrokerAddress.parse(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


class NameType(click.ParamType):
    """A fleet or agent name, which must be usable as one MQTT topic level."""

    name = "NAME"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        try:
            return topics.check_name(value, param.opts[0].lstrip("-") if param else "name")
        except ProtocolError as exc:
            self.fail(str(exc), param, ctx)


BROKER = BrokerType()
NAME = NameType()


def read_key(path: str | None) -> bytes | None:
    """The fleet key signs every message; it lives in a file so it stays out of `ps`."""
    if path is None:
        return None
    with open(path, "rb") as handle:
        key = handle.read().strip()
    if len(key) < 16:
        raise click.BadParameter(
            f"{path}: a fleet key needs at least 16 bytes", param_hint="--key-file"
        )
    return key


def stop_on_signal() -> threading.Event:
    """An event set by SIGINT or SIGTERM, so Ctrl-C and service managers stop cleanly.

    Call it first thing: a signal that arrives while the program is still starting up is
    then remembered and honoured once start-up is done, instead of killing it half-way.
    """
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def wait_for(stop: threading.Event) -> None:
    """Block until `stop` is set; short waits keep the main thread responsive to signals."""
    while not stop.wait(0.5):
        pass


class ConfigError(click.ClickException):
    """An impossible configuration: one line on stderr, exit status 2 like a bad flag."""

    exit_code = 2
