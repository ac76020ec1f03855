"""A free loopback port, for the local servers rljob starts (embedded Redis, the operator's
metrics in a local run, a test's rendezvous or control plane)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port the kernel just handed out and released. Another process may take it before the
    caller binds it: servers started on it retry with a new one (see EmbeddedRedis.start)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
