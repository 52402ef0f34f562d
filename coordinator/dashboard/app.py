"""The dashboard's web app (Starlette) and the uvicorn server that runs it in a thread.

Routes: `/` the page (with the fleet as it is now inlined: `page`), `/api/fleet` the
snapshot as JSON, `/api/events` the snapshot as server-sent events on every change,
`/logs/AGENT` the agent's log records of its latest run as text (`coordinator.agent_logs`),
`/metrics` for Prometheus, `/static/...` the page's assets (all shipped in the package: the
page works with no internet).

With an access token every route needs it, as `Authorization: Bearer TOKEN` (what a
Prometheus scrape config sends), `?token=TOKEN`, or the cookie that opening the page with
`?token=` sets (it then redirects to the page without the token in its address, and the
page's own requests, the event stream included, carry the cookie).

Every request must name the dashboard's own address in its Host header (`HostCheck`): a
web page a browser loaded from elsewhere cannot read the dashboard by pointing a name it
controls at 127.0.0.1 (DNS rebinding).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import re
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.authentication import (
    AuthCredentials,
    AuthenticationBackend,
    AuthenticationError,
    SimpleUser,
)
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import (
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from coordinator.agent_logs import RecentLogs, line_of
from coordinator.dashboard.metrics import registry_for
from coordinator.dashboard.state import FleetState

log = logging.getLogger(__name__)

STATIC = Path(__file__).resolve().parent / "static"
COOKIE = "edgefl_dashboard_token"
POLL_S = 0.25
"""How often an event stream looks for a change: updates to the page are coalesced to at
most four a second, however fast statuses arrive."""
KEEPALIVE_S = 15.0
"""A comment line this often keeps proxies and the browser from closing a quiet stream."""
_TOKEN = re.compile(r"^[A-Za-z0-9._~-]{1,256}$")


class TokenBackend(AuthenticationBackend):
    """Admits a request that carries the token (header, query or cookie), refuses others."""

    def __init__(self, token: str) -> None:
        self.token = token

    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, SimpleUser]:
        scheme, _, given = conn.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            given = conn.query_params.get("token") or conn.cookies.get(COOKIE, "")
        if not secrets.compare_digest(given.encode(), self.token.encode()):
            raise AuthenticationError("an access token is needed")
        return AuthCredentials(["fleet"]), SimpleUser("viewer")


def refuse(conn: HTTPConnection, exc: Exception) -> Response:
    return PlainTextResponse(
        f"401: {exc} (Authorization: Bearer TOKEN, or open the page with ?token=TOKEN)\n",
        status_code=401,
        headers={"WWW-Authenticate": "Bearer"},
    )


class HostCheck:
    """ASGI middleware that answers 400 to a request whose Host header names no address of
    the dashboard's. DNS rebinding needs a host name the attacker controls (an address
    cannot be rebound), so names are checked against the ones the dashboard answers to and
    an address is taken when it is the bound one, or any address when bound to all of them.
    """

    def __init__(self, app: ASGIApp, host: str) -> None:
        self.app = app
        self.names = allowed_names(host)
        self.any_address = host in WILDCARD_HOSTS

    def allows(self, header: str) -> bool:
        name = host_name(header)
        if name in self.names:
            return True
        return self.any_address and is_address(name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            header = Headers(scope=scope).get("host", "")
            if not self.allows(header):
                refused = PlainTextResponse(
                    f"400: this dashboard does not serve host {header[:100]!r}\n",
                    status_code=400,
                )
                await refused(scope, receive, send)
                return
        await self.app(scope, receive, send)


WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def host_name(header: str) -> str:
    """The host of a Host header, without its port or an IPv6 address's brackets, lowercase."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def allowed_names(host: str) -> frozenset[str]:
    """The host names and addresses the dashboard answers to when bound to `host`: that
    host; localhost and the loopback addresses when it is loopback; the machine's own names
    when it is every address."""
    names = {host.strip("[]").lower()}
    if is_loopback(host) or host in WILDCARD_HOSTS:
        names |= {"localhost", "127.0.0.1", "::1"}
    if host in WILDCARD_HOSTS:
        machine = socket.gethostname().lower()
        names |= {machine, f"{machine}.local", socket.getfqdn().lower()}
    return frozenset(names - {""})


def create_app(
    state: FleetState,
    token: str | None = None,
    host: str = "127.0.0.1",
    logs: RecentLogs | None = None,
) -> Starlette:
    """The dashboard app over `state` (and the agents' `logs`) bound to `host` (the Host
    header every request must name, see `HostCheck`); with `token`, every route needs it."""
    registry = registry_for(state)
    closing = threading.Event()

    async def index(request: Request) -> Response:
        if token is not None and "token" in request.query_params:
            response: Response = RedirectResponse("./", status_code=303)
            response.set_cookie(COOKIE, token, httponly=True, samesite="strict")
            return response
        return HTMLResponse(page(state), headers={"Cache-Control": "no-cache"})

    async def fleet(request: Request) -> Response:
        return JSONResponse(state.snapshot())

    async def events(request: Request) -> Response:
        return StreamingResponse(
            event_stream(state, closing),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def agent_log(request: Request) -> Response:
        return PlainTextResponse(log_text(logs, request.path_params["agent"]))

    middleware = [Middleware(HostCheck, host=host)]
    if token is not None:
        backend = TokenBackend(check_token(token))
        middleware.append(Middleware(AuthenticationMiddleware, backend=backend, on_error=refuse))
    app = Starlette(
        routes=[
            Route("/", index),
            Route("/api/fleet", fleet),
            Route("/api/events", events),
            Route("/metrics", metrics),
            Route("/logs/{agent}", agent_log),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),
        ],
        middleware=middleware,
    )
    app.state.closing = closing
    return app


def log_text(logs: RecentLogs | None, agent: str) -> str:
    """An agent's records of its latest run, one line each as `coordinator logs` prints
    them, or a line saying why there are none."""
    run_id, rows = logs.of(agent) if logs is not None else ("", [])
    if not rows:
        return f"no log records of agent {agent[:64]} yet\n"
    return f"agent {agent}, run {run_id}\n" + "".join(line_of(row) + "\n" for row in rows)


async def event_stream(state: FleetState, closing: threading.Event) -> AsyncIterator[str]:
    """The snapshot now and after every change (`id:` its version), with keep-alive
    comments; ends when the app is closing (a client that leaves cancels it)."""
    yield "retry: 2000\n\n"
    version, quiet_since = -1, time.monotonic()
    while not closing.is_set():
        if state.version != version:
            snapshot = state.snapshot()
            version = snapshot["version"]
            data = json.dumps(snapshot, allow_nan=False, separators=(",", ":"))
            yield f"id: {version}\nevent: snapshot\ndata: {data}\n\n"
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= KEEPALIVE_S:
            yield ": keep-alive\n\n"
            quiet_since = time.monotonic()
        await asyncio.sleep(POLL_S)


SNAPSHOT_TAG = '<script id="snapshot" type="application/json">null</script>'
"""Where the page carries the fleet as it was served (`page`)."""


def page(state: FleetState) -> str:
    """The page with the fleet's snapshot inlined, so that it shows the fleet from its first
    paint: fed only by its event stream, it showed "connecting" and empty charts until the
    stream's first event, all the while a screenshot taken at the page's load, a busy machine
    or a proxy holding the stream back kept that event from it. `<` is escaped: no text an
    agent sends can end the script element."""
    data = json.dumps(state.snapshot(), allow_nan=False, separators=(",", ":"))
    inlined = SNAPSHOT_TAG.replace("null", data.replace("<", "\\u003c"))
    return (STATIC / "index.html").read_text(encoding="utf-8").replace(SNAPSHOT_TAG, inlined)


def check_token(token: str) -> str:
    if not _TOKEN.match(token):
        raise ValueError(
            "the dashboard's access token must be 1-256 of A-Z a-z 0-9 . _ ~ - "
            "(for example from: python -c 'import secrets; print(secrets.token_urlsafe())')"
        )
    return token


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only (localhost, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Dashboard:
    """The dashboard app served by uvicorn in a background thread.

    Bound beyond loopback it needs a token: a fleet's table, accuracy and traffic are no
    business of every machine on the LAN (ValueError otherwise).
    """

    def __init__(
        self,
        state: FleetState,
        host: str = "127.0.0.1",
        port: int = 8080,
        token: str | None = None,
        logs: RecentLogs | None = None,
    ) -> None:
        if not 0 <= port < 65536:
            raise ValueError(f"the dashboard's port must be in 0..65535, got {port}")
        if token is None and not is_loopback(host):
            raise ValueError(
                f"the dashboard on {host} would be reachable from other machines: give it an "
                "access token (--http-token-file or EDGEFL_HTTP_TOKEN) or bind it to 127.0.0.1"
            )
        self.state = state
        self.host = host.strip("[]")
        self.port = port
        self.app = create_app(state, token, self.host, logs)
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The page's address (after `start`, with the port actually bound)."""
        host = "127.0.0.1" if self.host in ("", "0.0.0.0") else self.host
        host = "[::1]" if host == "::" else f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}/"

    def start(self, timeout_s: float = 10.0) -> None:
        """Listen (port 0: a free one, see `url`) and serve; returns once serving.
        Raises OSError when the address cannot be bound."""
        if self._thread is not None:
            raise RuntimeError("the dashboard is already started")
        sock = bind(self.host, self.port)
        self.app.state.closing.clear()
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            log_config=None,  # the program's logging, not uvicorn's own
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=5,
        )
        server = self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, name="dashboard", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the dashboard did not start on {self.url}")
            time.sleep(0.02)
        log.info("dashboard on %s", self.url)

    def stop(self, timeout_s: float = 10.0) -> None:
        """End every event stream, stop serving and wait for the thread."""
        self.app.state.closing.set()
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._server = self._thread = None


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port), IPv4 or IPv6 as the host is written."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=128)
    except OSError as exc:
        raise OSError(f"the dashboard cannot listen on {host}:{port}: {exc.strerror}") from exc
