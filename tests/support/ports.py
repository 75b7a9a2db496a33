"""Free TCP ports on the loopback interface, for the servers and processes the tests start."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port free on 127.0.0.1 now (free until someone else binds it: start the server right away)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
