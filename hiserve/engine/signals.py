"""SIGTERM handling shared by the launcher and the scheduler processes."""

from __future__ import annotations

import signal
import sys


def exit_on_sigterm() -> None:
    """Make the first SIGTERM leave through SystemExit (so `finally` blocks run: the launcher
    stops its schedulers, a scheduler its storage worker) and ignore any later one.

    A scheduler is often sent two: one from whoever stops the server (a test harness signals the
    whole process group) and one from the launcher stopping its schedulers. The second used to
    arrive while the interpreter was already exiting and raise SystemExit inside an atexit
    callback, which printed a traceback into the server log (`test_tp.py` failed on it once).
    """
    def leave(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, leave)
