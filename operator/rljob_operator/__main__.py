"""`python -m rljob_operator`: run the operator (kopf) with its liveness endpoint.

Flags are kopf's; defaults: all namespaces, standalone (one replica, no peering objects),
liveness on :8081/healthz.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    from kopf.cli import main as kopf_main

    args = list(sys.argv[1:] if argv is None else argv)
    scoped = any(a.startswith(("-n", "--namespace", "-A", "--all-namespaces")) for a in args)
    scope = [] if scoped else ["--all-namespaces"]
    liveness = os.environ.get("RLJOB_LIVENESS", "http://0.0.0.0:8081/healthz")
    cmd = ["run", "--standalone", f"--liveness={liveness}", *scope, *args, "-m", "rljob_operator.handlers"]
    return kopf_main(args=cmd, prog_name="rljob-operator", standalone_mode=False) or 0


if __name__ == "__main__":
    raise SystemExit(main())
