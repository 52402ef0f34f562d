"""Command-line pieces shared by `edge-agent` and `coordinator`.

Besides the parameter types and the signal handling, this holds the options both programs
take alike: how to reach the broker (`broker_options`: address, credentials, TLS, each also
from an environment variable or a config file), how to log (`logging_options`), how to talk
to the person running the program (`console`, `say`) and `version_option`.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import ipaddress
import json
import logging
import math
import os
import signal
import socket
import ssl
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource
from rich.console import Console
from rich.text import Text

from protocol import topics
from protocol.errors import ProtocolError
from protocol.limits import FOLLOWER_LIMITS, WEEK_S, Limits
from protocol.log_context import agent_of, current_agent, install, set_process_name
from protocol.mqtt import BrokerAddress, TlsOptions, TransportOptions
from protocol.signing import MIN_FLEET_KEY_BYTES, FleetKey
from protocol.version import DISTRIBUTION, PROTOCOL_VERSION

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


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


class FiniteRange(click.FloatRange):
    """click's FloatRange, which lets `nan` through (every comparison with it is false),
    refusing every non-finite number with click's one-line error."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{number} is not a finite number", param, ctx)
        return number


def seconds(low: float) -> FiniteRange:
    """A number of seconds from `low` to a week, finite: the type of timeout options."""
    return FiniteRange(low, WEEK_S)


BROKER = BrokerType()
NAME = NameType()


def read_key(path: str | None) -> FleetKey | None:
    """The fleet key signs every message; it lives in a file so it stays out of `ps`."""
    if path is None:
        return None
    with open(path, "rb") as handle:
        key = handle.read().strip()
    if len(key) < MIN_FLEET_KEY_BYTES:
        raise click.BadParameter(
            f"{path}: a fleet key needs at least {MIN_FLEET_KEY_BYTES} bytes",
            param_hint="--key-file",
        )
    return FleetKey(key)


def stop_on_signal() -> threading.Event:
    """An event set by SIGINT or SIGTERM, so Ctrl-C and service managers stop cleanly.

    Call it first thing: a signal that arrives while the program is still starting up is
    then remembered and honoured once start-up is done, instead of killing it half-way. A
    second Ctrl-C is not a reminder but a person who cannot wait (a start-up that loads a
    dataset for minutes): it interrupts at once, as Python's own Ctrl-C does.
    """
    stop = threading.Event()

    def stopping(signum: int, _frame: object) -> None:
        if signum == signal.SIGINT and stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stopping)
    return stop


def wait_for(stop: threading.Event) -> None:
    """Block until `stop` is set; short waits keep the main thread responsive to signals."""
    while not stop.wait(0.5):
        pass


class ConfigError(click.ClickException):
    """An impossible configuration: one line on stderr, exit status 2 like a bad flag."""

    exit_code = 2


# -- broker connection options --------------------------------------------------------------

MQTT_PORT = 1883
MQTTS_PORT = 8883


@dataclass(frozen=True)
class BrokerSettings:
    """How to reach the broker, resolved from flags, environment and config file."""

    address: BrokerAddress | None = None
    """None: not given (the agent discovers it over mDNS, the coordinator starts its own)."""
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: TlsOptions | None = None

    def transport_options(
        self, client_id: str | None, limits: Limits = FOLLOWER_LIMITS
    ) -> TransportOptions:
        """Options for MqttTransport; replace() the result to tune timings. The `limits`
        default to a follower's (`protocol.limits.FOLLOWER_LIMITS`: small single frames),
        so no connection a command opens accepts more than it reads; a connection that
        receives models raises them to the run's (`MqttTransport.set_limits`)."""
        return TransportOptions(
            client_id=client_id,
            username=self.username,
            password=self.password,
            tls=self.tls,
            limits=limits,
        )

    def describe(self) -> str:
        """One line for logs and messages; never holds the password."""
        parts = [str(self.address) if self.address else "no broker given"]
        if self.tls is not None:
            parts.append(f"TLS with CA {self.tls.ca_certs or 'of the system'}")
            if self.tls.certfile:
                parts.append(f"client certificate {self.tls.certfile}")
        if self.username is not None:
            parts.append(f"user {self.username}" + (" with a password" if self.password else ""))
        return ", ".join(parts)

    __str__ = describe


@dataclass(frozen=True)
class _Setting:
    """A value and where it came from, so an error can name the flag, variable or file."""

    value: Any
    origin: str
    rank: int
    """0 command line, 1 environment, 2 config file: the lower wins."""


_COMMAND_LINE, _ENVIRONMENT, _CONFIG = 0, 1, 2
_ENVVARS = {
    "broker": "EDGEFL_BROKER",
    "username": "EDGEFL_USERNAME",
    "password_file": "EDGEFL_PASSWORD_FILE",
    "tls": "EDGEFL_TLS",
    "tls_ca": "EDGEFL_TLS_CA",
    "tls_cert": "EDGEFL_TLS_CERT",
    "tls_key": "EDGEFL_TLS_KEY",
}
_CONFIG_KEYS = tuple(_ENVVARS)
_FILE_KEYS = ("password_file", "tls_ca", "tls_cert", "tls_key")
PASSWORD_ENV = "EDGEFL_PASSWORD"
CONFIG_ENV = "EDGEFL_CONFIG"


def _broker_option_decorators() -> list[Callable[[Any], Any]]:
    def file(name: str, text: str) -> Callable[[Any], Any]:
        flag = "--" + name.replace("_", "-")
        return click.option(
            flag, metavar="FILE", envvar=_ENVVARS[name], show_envvar=True, help=text
        )

    return [
        click.option(
            "--broker",
            metavar="HOST[:PORT]",
            envvar=_ENVVARS["broker"],
            show_envvar=True,
            help=f"MQTT broker (port {MQTT_PORT}, or {MQTTS_PORT} with TLS, unless given).",
        ),
        click.option(
            "--username", envvar=_ENVVARS["username"], show_envvar=True, help="Broker user name."
        ),
        file(
            "password_file",
            f"File holding the broker password, or set {PASSWORD_ENV}. There is no "
            "--password: a command line is visible to every user in `ps`.",
        ),
        click.option(
            "--tls/--no-tls",
            default=None,
            envvar=_ENVVARS["tls"],
            show_envvar=True,
            help="Connect over TLS, checking the broker against the system's CAs "
            "(implied by --tls-ca, --tls-cert and --tls-key).",
        ),
        file("tls_ca", "CA certificates (PEM) to check the broker against instead."),
        file("tls_cert", "Client certificate (PEM), for brokers that ask for one."),
        file("tls_key", "Unencrypted private key (PEM) of --tls-cert."),
        click.option(
            "--config",
            "config_file",
            metavar="FILE",
            envvar=CONFIG_ENV,
            show_envvar=True,
            help="TOML file whose [broker] table sets these options (keys: "
            + ", ".join(_CONFIG_KEYS)
            + "); flags and environment variables win over it.",
        ),
    ]


def broker_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Add the broker connection options to a command; it gets `broker_settings` instead.

    Put it below `@click.command()`. Each option comes from the command line, else its
    environment variable, else the config file, else its default. Every mistake (a missing
    file, a bad key, a certificate without its key, ...) is a one-line error, exit status 2.
    """

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        given = {name: kwargs.pop(name) for name in _CONFIG_KEYS}
        config_file = kwargs.pop("config_file")
        ctx = click.get_current_context()
        settings = _explicit(ctx, given)
        if config_file is not None:
            settings = {**_load_config(config_file), **settings}
        kwargs["broker_settings"] = _resolve(settings, os.environ)
        return command(*args, **kwargs)

    for option in reversed(_broker_option_decorators()):
        wrapper = option(wrapper)
    return wrapper


def _explicit(ctx: click.Context, given: Mapping[str, Any]) -> dict[str, _Setting]:
    """The options given on the command line or by environment variable."""
    settings = {}
    for name, value in given.items():
        source = ctx.get_parameter_source(name)
        if source is ParameterSource.ENVIRONMENT:
            settings[name] = _Setting(value, _ENVVARS[name], _ENVIRONMENT)
        elif source not in (None, ParameterSource.DEFAULT):
            flag = "--" + ("no-tls" if name == "tls" and not value else name.replace("_", "-"))
            settings[name] = _Setting(value, flag, _COMMAND_LINE)
    return settings


def _load_config(path: str) -> dict[str, _Setting]:
    """The [broker] table of a config file; relative paths in it are from the file's folder."""
    try:
        with open(path, "rb") as stream:
            data = tomllib.load(stream)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    for key in data:
        if key != "broker":
            raise ConfigError(f"{path}: unknown table or key {key!r}; expected a [broker] table")
    table = data.get("broker", {})
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: broker must be a table: [broker] followed by its keys")
    folder = Path(path).parent
    return {key: _config_value(path, folder, key, value) for key, value in table.items()}


def _config_value(path: str, folder: Path, key: str, value: Any) -> _Setting:
    origin = f"{path} [broker] {key}"
    if key not in _CONFIG_KEYS:
        close = difflib.get_close_matches(key, _CONFIG_KEYS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{path}: unknown key {key!r} in [broker]{hint}")
    wanted = bool if key == "tls" else str
    if not isinstance(value, wanted):
        kind = "true or false" if wanted is bool else "a string"
        raise ConfigError(f"{origin}: must be {kind}, not {value!r}")
    if key in _FILE_KEYS:
        value = str(folder / Path(str(value)).expanduser())
    return _Setting(value, origin, _CONFIG)


def _resolve(settings: Mapping[str, _Setting], environ: Mapping[str, str]) -> BrokerSettings:
    """Check the chosen options together and read the files they name (ConfigError)."""
    tls = _tls(settings)
    username = settings["username"].value if "username" in settings else None
    password = _password(settings, environ)
    if password is not None and username is None:
        raise ConfigError(f"{password.origin}: a password needs a user name (--username)")
    address = None
    if "broker" in settings:
        broker = settings["broker"]
        try:
            address = BrokerAddress.parse(broker.value, MQTTS_PORT if tls else MQTT_PORT)
        except ValueError as exc:
            raise ConfigError(f"{broker.origin}: {exc}") from None
    return BrokerSettings(address, username, _value(password), tls)


def _tls(settings: Mapping[str, _Setting]) -> TlsOptions | None:
    """TLS options when asked for or implied by a TLS file; None for a plain connection."""
    ca, cert, key = (settings.get(k) for k in ("tls_ca", "tls_cert", "tls_key"))
    files = [f for f in (ca, cert, key) if f is not None]
    switch = settings.get("tls")
    if switch is not None and not switch.value:
        clash = [f.origin for f in files if f.rank <= switch.rank]
        if clash:
            raise ConfigError(f"{switch.origin} contradicts {clash[0]}")
        return None  # a --no-tls of higher precedence overrides the config file's TLS files
    if not files and switch is None:
        return None
    if cert is not None and key is None:
        raise ConfigError(f"{cert.origin}: a client certificate needs its key (--tls-key)")
    if key is not None and cert is None:
        raise ConfigError(f"{key.origin}: a private key needs its certificate (--tls-cert)")
    _check_tls_files(ca, cert, key)
    return TlsOptions(ca_certs=_value(ca), certfile=_value(cert), keyfile=_value(key))


def _value(setting: _Setting | None) -> Any:
    return None if setting is None else setting.value


def _check_tls_files(ca: _Setting | None, cert: _Setting | None, key: _Setting | None) -> None:
    """Load the files as paho will, so a wrong one is a one-line error, not a traceback."""
    for setting in (ca, cert, key):
        if setting is not None:
            _check_readable(setting)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if ca is not None:
        try:
            context.load_verify_locations(cafile=ca.value)
        except ssl.SSLError as exc:
            raise ConfigError(
                f"{ca.origin}: no PEM certificate in {ca.value} ({exc.reason})"
            ) from None
    if cert is not None and key is not None:
        try:
            # A password prompt would hang a service: an encrypted key fails here instead.
            context.load_cert_chain(cert.value, key.value, password=b"")
        except ssl.SSLError as exc:
            raise ConfigError(
                f"{cert.origin}: {cert.value} and {key.value} are not a PEM certificate and "
                f"its unencrypted private key ({_reason(exc)})"
            ) from None


def _reason(exc: ssl.SSLError) -> str:
    """OpenSSL's reason code in words ("KEY_VALUES_MISMATCH": "key values mismatch")."""
    return (exc.reason or "not PEM, or an encrypted key").lower().replace("_", " ")


def _check_readable(setting: _Setting) -> None:
    try:
        with open(setting.value, "rb"):
            pass
    except OSError as exc:
        raise ConfigError(
            f"{setting.origin}: cannot read {setting.value}: {exc.strerror}"
        ) from None


def _password(settings: Mapping[str, _Setting], environ: Mapping[str, str]) -> _Setting | None:
    """The password from its file or EDGEFL_PASSWORD, whichever comes first in precedence."""
    candidates = [settings["password_file"]] if "password_file" in settings else []
    if environ.get(PASSWORD_ENV):
        candidates.append(_Setting(environ[PASSWORD_ENV], PASSWORD_ENV, _ENVIRONMENT))
    if not candidates:
        return None
    chosen = min(candidates, key=lambda s: s.rank)
    if [s.rank for s in candidates] == [_ENVIRONMENT, _ENVIRONMENT]:
        raise ConfigError(f"both {PASSWORD_ENV} and {_ENVVARS['password_file']} are set")
    if chosen.origin == PASSWORD_ENV:
        return chosen
    try:
        with open(chosen.value, encoding="utf-8") as stream:
            password = stream.read().rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as exc:
        why = getattr(exc, "strerror", None) or str(exc)
        raise ConfigError(f"{chosen.origin}: cannot read {chosen.value}: {why}") from None
    if not password:
        raise ConfigError(f"{chosen.origin}: password file {chosen.value} is empty")
    return _Setting(password, chosen.origin, chosen.rank)


# -- logging and messages -------------------------------------------------------------------

TEXT_FORMAT = "%(asctime)s %(levelname)s %(agent)s: %(message)s"
"""Every line on stderr, in every program: `12:03:07 WARNING pi-1: lost MQTT broker ...`,
the agent being the one the line is about (`protocol.log_context`), else the program."""
TIME_FORMAT = "%H:%M:%S"
LOG_FORMATS = ("text", "json")
MESSAGES = logging.getLogger("edgefl")
"""The logger `say` writes through when its message is a log line, at INFO whatever the
verbosity."""


@dataclass
class _LogState:
    verbose: int = 0
    fmt: str = "text"


_log_state = _LogState()


class TextFormatter(logging.Formatter):
    """`TEXT_FORMAT` lines; a record made without the agent factory gets the process's name."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT, TIME_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        record.agent = agent_of(record)
        return super().formatMessage(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per record and line, for log collectors (journald, Loki, ...)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, timezone.utc)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname,
            "agent": agent_of(record),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


class _StderrHandler(logging.StreamHandler):
    """Writes to sys.stderr as it is at each record (like logging's last resort handler).

    A harness that swaps stderr for a while (click's CliRunner) then gets the logs, and no
    handler is left holding a stream closed since.
    """

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self) -> Any:
        return sys.stderr

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        """A log line that cannot be written is dropped: a full disk or a closed pipe under
        the log must not stop the program, nor print logging's traceback. Any other failure
        (a bad format string) is one line, when stderr takes it."""
        failure = sys.exc_info()[1]
        if isinstance(failure, OSError):
            return
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.write(f"logging error in {record.name}: {failure!r}\n")


def setup_logging(verbose: int, fmt: str) -> None:
    """Log to stderr at WARNING, INFO (-v) or DEBUG (-vv), as text lines or JSON lines,
    each naming the agent it is about (`protocol.log_context`).

    Calling it again replaces what an earlier call set up; other handlers are left alone
    (they get the records with their `agent` too).
    """
    if fmt not in LOG_FORMATS:
        raise ValueError(f"unknown log format {fmt!r}; expected one of {', '.join(LOG_FORMATS)}")
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _StderrHandler)]:
        root.removeHandler(old)
    install()
    handler = _StderrHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root.addHandler(handler)
    root.setLevel((logging.WARNING, logging.INFO, logging.DEBUG)[min(verbose, 2)])
    MESSAGES.setLevel(logging.INFO)
    _log_state.verbose, _log_state.fmt = verbose, fmt


def log_settings() -> tuple[int, str]:
    """This process's (verbosity, format), to set a worker process's logging up alike."""
    return _log_state.verbose, _log_state.fmt


def log_flags() -> list[str]:
    """The flags that make a child edgefl process log like this one (coordinator emulate)."""
    verbosity = ["-" + "v" * _log_state.verbose] if _log_state.verbose else []
    return [*verbosity, "--log-format", _log_state.fmt]


def logging_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Add -v/--verbose and --log-format and set logging up before the command runs.

    Put it below `@click.command()` (or `@click.group()`). The command does not get the two
    values: `log_flags()` gives them to whoever passes them on to a child process.
    """

    @functools.wraps(command)
    def wrapper(*args: Any, verbose: int, log_format: str, **kwargs: Any) -> Any:
        set_process_name(click.get_current_context().find_root().info_name or "edgefl")
        setup_logging(verbose, log_format)
        return command(*args, **kwargs)

    wrapper = click.option(
        "--log-format",
        type=click.Choice(LOG_FORMATS),
        default="text",
        show_default=True,
        envvar="EDGEFL_LOG_FORMAT",
        show_envvar=True,
        help="Log lines as text or as JSON objects; json also turns messages into log lines.",
    )(wrapper)
    return click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")(
        wrapper
    )


def console(stderr: bool = True) -> Console:
    """A rich Console that wraps lines only on a terminal.

    Into a file, a pipe or journald each message stays one line (rich would otherwise wrap
    at 80 columns there).
    """
    out = Console(stderr=stderr)
    out.soft_wrap = not out.is_terminal
    return out


_stderr_console = console()


def say(message: str, out: Console | None = None) -> None:
    """Tell the person running the program something (rich markup allowed).

    Printed on `out` (stderr by default). An agent's messages (said in its scope,
    `protocol.log_context.agent_scope`) and, with --log-format json, every message sent to
    stderr become log lines instead (logger "edgefl", INFO, markup removed): an agent's
    output is its log, one line format with its id on each line, and json output is all
    JSON. A message that cannot be written (a full disk under the log) is dropped, never
    fatal.
    """
    if _log_state.fmt == "json" or (out is None and current_agent() is not None):
        MESSAGES.info("%s", Text.from_markup(message).plain)
        return
    with contextlib.suppress(OSError, ValueError):  # a full disk or a closed stream
        (out or _stderr_console).print(message)


version_option = click.version_option(
    package_name=DISTRIBUTION,
    message=f"%(prog)s %(version)s (edgefl protocol {PROTOCOL_VERSION})",
)
"""`--version`: the installed edgefl's version and the wire protocol version it speaks."""


def loopback(host: str) -> bool:
    """Whether `host` (an address or a name, resolved) is this machine's loopback."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False
