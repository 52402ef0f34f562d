"""Which agent a log line is about, on every line, however many agents share the process.

Several agents may run in one process (the Python API's `run_agent`, `python -m
agent.host` under `coordinator emulate`), and one agent's work spans threads: its own, and
its MQTT connection's network and dispatcher threads. So the agent is a context variable,
set where an agent's session starts (`agent_scope`), carried into the callbacks and threads
that agent's objects make (`bound`, captured when they are made), and put on every log
record as `record.agent` by a log record factory (`install`): every handler sees it (the
stderr one of `protocol.cli.setup_logging`, one that forwards records to the gateway,
pytest's caplog). A line outside any agent's scope carries the process's name
(`set_process_name`: the program, or the id of an agent that has the process to itself).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

_AGENT: ContextVar[str | None] = ContextVar("edgefl_agent", default=None)
_process_name = "edgefl"
_install_lock = threading.Lock()
_installed = False


def current_agent() -> str | None:
    """The agent whose work this thread is doing now, or None outside any agent's scope."""
    return _AGENT.get()


def set_process_name(name: str) -> None:
    """What lines outside any agent's scope carry: the program's name, or the id of the one
    agent the process runs (then every thread's lines carry it, library threads' too)."""
    global _process_name
    _process_name = name


def process_name() -> str:
    return _process_name


@contextlib.contextmanager
def agent_scope(agent_id: str) -> Iterator[None]:
    """Within: this thread's log lines are agent `agent_id`'s (and `bound` captures it)."""
    install()
    token = _AGENT.set(agent_id)
    try:
        yield
    finally:
        _AGENT.reset(token)


def bound(function: Callable[P, R]) -> Callable[P, R]:
    """`function` running, on whatever thread calls it, in the agent scope of the caller of
    `bound` (as it is now): for callbacks and thread targets, which a new thread would
    otherwise run outside any agent's scope. Returns `function` itself outside a scope."""
    agent = _AGENT.get()
    if agent is None:
        return function

    @functools.wraps(function)
    def in_scope(*args: P.args, **kwargs: P.kwargs) -> R:
        token = _AGENT.set(agent)
        try:
            return function(*args, **kwargs)
        finally:
            _AGENT.reset(token)

    return in_scope


def agent_of(record: logging.LogRecord) -> str:
    """The agent a record is about: what the factory put on it, else the process's name
    (a record made before `install`, or by a factory installed over ours that skips it)."""
    return getattr(record, "agent", None) or _process_name


def install() -> None:
    """Put `agent` on every log record from now on (once per process; keeps whatever record
    factory was installed before, calling it first)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        previous = logging.getLogRecordFactory()

        def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
            record = previous(*args, **kwargs)
            record.agent = _AGENT.get() or _process_name
            return record

        logging.setLogRecordFactory(factory)
        _installed = True
