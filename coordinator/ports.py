"""Free loopback ports, for a broker started on this machine (an embedded broker of
`coordinator emulate` or of the Python API, `edgefl.emulate`). Apart from the CLI so
that the Python API needs none of it."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the system's choice); the caller
    binds it next."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
