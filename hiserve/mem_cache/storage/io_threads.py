"""A few daemon threads that run one batch of a storage backend's file reads at a time.

Daemon threads, like the storage worker that calls them: a read stuck on a hung mount must
not keep the process from exiting (a `concurrent.futures` pool is joined at exit). A job
that raises counts as a miss through `on_error`; `run` never raises and never returns while
one of its jobs still runs, so no read can land in host memory after the caller has
handed those pages on.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from typing import Callable, Optional

logger = logging.getLogger(__name__)

MAX_DEFAULT_IO_THREADS = 8  # a default cap; more threads may still help on a fast disk


def usable_cpus() -> int:
    """CPUs this process may run on (affinity and cgroup cpusets respected where exposed)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def io_threads_from(extra_config: dict) -> int:
    """`file_io_threads` from the extra config, else min(usable CPUs, 8).

    Raises:
        ValueError: not an integer >= 1.
    """
    n = extra_config.get("file_io_threads")
    if n is None:
        return min(usable_cpus(), MAX_DEFAULT_IO_THREADS)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"file_io_threads must be an integer >= 1, got {n!r}")
    return n


class _Latch:
    """Counts a batch's jobs down; `wait` returns when all have run."""

    def __init__(self, n: int) -> None:
        self._left, self._lock, self._done = n, threading.Lock(), threading.Event()

    def count_down(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left == 0:
                self._done.set()

    def wait(self) -> None:
        self._done.wait()


class ReadThreads:
    """`num_threads` daemon threads running boolean jobs.

    Args:
        num_threads: threads (>= 1).
        name: thread name prefix.
        on_error: called on the thread with a job's exception (the job then counts as False).
    """

    def __init__(self, num_threads: int, name: str, on_error: Callable[[BaseException], None]) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._on_error = on_error
        self._lock = threading.Lock()  # orders `run`'s enqueueing against `close`'s sentinels
        self._closed = False
        self._num_threads = num_threads
        for i in range(num_threads):
            threading.Thread(target=self._loop, name=f"{name}-{i}", daemon=True).start()

    def _loop(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, results, index, latch = item
            try:
                results[index] = bool(job())
            except BaseException as exc:  # a miss, never a crash of the caller
                results[index] = False
                try:
                    self._on_error(exc)
                except Exception:
                    logger.exception("storage read thread: error handler failed")
            finally:
                latch.count_down()

    def run(self, jobs: list[Callable[[], bool]]) -> Optional[list[bool]]:
        """Each job's result, in order, once every job has run; None after `close()` (the
        caller then runs the jobs itself)."""
        results: list[bool] = [False] * len(jobs)
        latch = _Latch(len(jobs))
        with self._lock:
            if self._closed:
                return None
            for i, job in enumerate(jobs):
                self._jobs.put((job, results, i, latch))
        if jobs:
            latch.wait()
        return results

    def close(self) -> None:
        """Let the threads end after the jobs already queued (idempotent; does not wait)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for _ in range(self._num_threads):
                self._jobs.put(None)
