"""Child processes that end with their parent (Linux).

`rljob run --local` starts redis-server, rollout workers and trainers each in a session of its
own, so that a terminal's Ctrl-C reaches them only through the parent's orderly shutdown. A parent
that is SIGKILLed (the OOM killer, ``kill -9``) has no shutdown, and those children ran on for
good, holding the port, the model's memory and the job's Redis. The kernel can signal a child when
its parent dies (``PR_SET_PDEATHSIG``), but only the child can ask for that, and subprocess has no
option for it; so each child starts through this module, which asks and then execs the real
command (the request survives exec). The signal comes when the *thread* that started the child
ends, so start guarded children from a thread that lives as long as they should (the main one).

  python -m rljob.parent_death PARENT_PID SIGNAL -- COMMAND [ARGS...]
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Sequence

_PR_SET_PDEATHSIG = 1
SUPPORTED = sys.platform.startswith("linux")


def guarded(command: Sequence[str], sig: signal.Signals = signal.SIGTERM) -> list[str]:
    """`command`, wrapped so that it receives `sig` when the thread that starts it ends (from the
    main thread: when this process ends); unchanged where the kernel has no such request (not Linux)."""
    if not SUPPORTED:
        return list(command)
    return [sys.executable, "-m", "rljob.parent_death", str(os.getpid()), str(int(sig)), "--", *command]


def main(argv: Sequence[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print("usage: python -m rljob.parent_death PARENT_PID SIGNAL -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    parent, sig, command = int(argv[0]), int(argv[1]), list(argv[3:])
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
    if os.getppid() != parent:  # the parent died before the request was in place: nothing would come
        return 128 + sig
    os.execvp(command[0], command)
    return 127  # not reached: execvp replaces this process or raises


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
