"""Cluster DNS for a process run beside the hostlet (the operator in e2e tests): on PYTHONPATH,
this makes every `*.svc` and `*.svc.cluster.local` name resolve to loopback, where the hostlet's
pods listen. Test harness only; see e2e/hostlet/README.md."""

import socket

_getaddrinfo = socket.getaddrinfo


def _loopback_for_services(host, *args, **kwargs):
    name = host.decode() if isinstance(host, bytes) else host
    if isinstance(name, str) and (name.endswith(".svc") or name.endswith(".svc.cluster.local")):
        host = "127.0.0.1"
    return _getaddrinfo(host, *args, **kwargs)


socket.getaddrinfo = _loopback_for_services
