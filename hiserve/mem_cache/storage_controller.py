"""The storage worker: one thread that runs every storage-backend call (L2 ⇄ L3).

The scheduler loop never waits for storage. It hands operations to `StorageController`
and gets them back, finished, from `poll()`:

    scheduler thread                         worker thread
    ────────────────                         ─────────────
    submit(BackupOp)     ──queue──▶          batch_exists → skip stored pages → batch_set_from
    submit(PrefetchOp)   ──queue──▶          phase "exists": batch_exists(keys) → hit_pages
    (poll: allocate host slots)
    submit(PrefetchOp)   ──queue──▶          phase "fetch": batch_get_into, `batch_pages` pages a
                                             call, `completed_pages` advancing; stops early when
                                             `cancelled` is set (after its current call)
    poll()               ◀──completions──    every finished op, in order

Ownership: the worker reads an op's keys and host page numbers and writes only the op's
result fields (`hit_pages`, `stored_pages`, `completed_pages`, timings, `error`) and the
host pages it was given. Allocators, the radix tree and host-slot bookkeeping belong to
the scheduler thread; it does not touch an op's host pages while the worker holds the op
(`in_worker`), which `poll()` clears. Backends never raise for I/O failures (they count
them, `storage/base.py`); an exception escaping one anyway is logged once, counted as
`worker_error`, and the op finishes as a miss.

The design follows SGLang's HiCacheController storage threads (`prefetch_thread_func`,
`backup_thread_func` in `managers/cache_controller.py`), reduced to one thread and one queue.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from hiserve.mem_cache.storage.base import HiCacheStorage

logger = logging.getLogger(__name__)

# Pages per batch_get_into call of a prefetch: a cancelled prefetch stops after at most this
# many more pages, and the completed counter advances this often (SGLang: 8-32 pages).
DEFAULT_BATCH_PAGES = 16
# Finished ops kept for the metrics exporter between two stats messages (>= 1 per second).
RECENT_OPS = 512


@dataclass(eq=False)
class BackupOp:
    """Write host pages to storage (write-through to L3).

    Attributes:
        keys: page keys (`keys.page_keys`), one per page.
        host_pages: host page numbers holding those pages (same order).
        nodes: tree nodes pinned while the op runs (the scheduler thread's; the worker
            never reads them).
        write: False on TP ranks other than 0 for MLA (rank 0 writes the shared latent pages).
        stored_pages: leading pages the store holds afterwards (written or already there).
        skipped_pages: leading pages that were already stored (not written again).
        seconds: worker wall time; error: an unexpected exception's text, else None.
    """

    keys: list[str]
    host_pages: list[int]
    nodes: list = field(default_factory=list)
    write: bool = True  # False: another TP rank writes these (MLA); report every page stored
    op_id: int = field(default_factory=lambda: next(_op_ids))
    stored_pages: int = 0
    skipped_pages: int = 0
    seconds: float = 0.0
    error: str | None = None
    in_worker: bool = False


@dataclass(eq=False)
class PrefetchOp:
    """Read the pages of a request's prefix that storage holds into host pages (L3 → L2).

    Scheduler-thread fields: `token_ids` (the page-aligned prefix), `start_len` (tokens
    the tree held when the op started), `page_size`, `started` (monotonic s), `host_slots` (int64 CPU,
    allocated after phase "exists"), `path` (tree nodes pinned so the prefix the pages
    extend stays on the host), `taken_pages` (pages handed to the tree), `cancelled`.
    Worker fields: `hit_pages` (phase "exists"), `completed_pages` (phase "fetch": leading
    pages now valid in the host pool), `seconds`, `error`.
    """

    keys: list[str]
    token_ids: list[int]
    start_len: int
    page_size: int
    started: float = field(default_factory=time.monotonic)
    op_id: int = field(default_factory=lambda: next(_op_ids))
    phase: str = "exists"  # "exists" -> "fetch" -> "done"
    host_pages: list[int] = field(default_factory=list)
    host_slots: "torch.Tensor | None" = None
    path: list = field(default_factory=list)
    hit_pages: int = 0
    completed_pages: int = 0
    taken_pages: int = -1  # -1: not taken yet
    cancelled: bool = False
    seconds: float = 0.0
    error: str | None = None
    in_worker: bool = False

    @property
    def num_tokens(self) -> int:
        """Tokens this op may bring: all its keys' pages before phase "exists", its hits after."""
        return (len(self.keys) if self.phase == "exists" else self.hit_pages) * self.page_size


_op_ids = itertools.count()


@dataclass
class StorageOpStats:
    """Scheduler-side storage counters since start (metrics and /get_server_info).

    Attributes:
        prefetched_tokens_total: tokens read from storage and inserted into the tree.
        backuped_tokens_total: tokens written to storage (not counting pages already there).
        prefetch_bytes_total, backup_bytes_total: payload bytes of those (every kind).
        recent: the latest finished ops (at most RECENT_OPS), oldest first, as
            (seq, "prefetch" | "backup", pages moved, seconds, bytes moved); `seq` counts
            from 1, so an exporter that remembers the last seq it saw observes each op once.
        failures: count by reason, the integration's own ("worker_error", "host_full");
            the backend's are in `StorageStats.failures`.
    """

    prefetched_tokens_total: int = 0
    backuped_tokens_total: int = 0
    prefetch_bytes_total: int = 0
    backup_bytes_total: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_OPS))
    seq: int = 0
    failures: Counter = field(default_factory=Counter)

    def record(self, kind: str, pages: int, seconds: float, nbytes: int) -> None:
        """Remember one finished op for the metrics exporter."""
        self.seq += 1
        self.recent.append((self.seq, kind, pages, seconds, nbytes))


class StorageController:
    """One daemon worker thread running a storage backend's calls (module docstring).

    Args:
        backend: the storage backend (`storage.create_storage`).
        batch_pages: pages per `batch_get_into` call of a prefetch.
    """

    def __init__(self, backend: "HiCacheStorage", batch_pages: int = DEFAULT_BATCH_PAGES) -> None:
        self.backend = backend
        self.batch_pages = max(1, batch_pages)
        self._tasks: queue.Queue = queue.Queue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._in_flight = 0  # scheduler thread only: submitted, not yet returned by poll()
        self._errors_logged: set[str] = set()
        self._closed = False
        self._skip_queued = False
        self._thread = threading.Thread(target=self._run, name="hicache-storage", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ scheduler thread

    def submit(self, op: BackupOp | PrefetchOp) -> None:
        """Queue `op` for the worker (a PrefetchOp in its current `phase`).

        Raises:
            RuntimeError: after `close()`.
        """
        if self._closed:
            raise RuntimeError("storage controller is closed")
        op.in_worker = True
        self._in_flight += 1
        self._tasks.put(op)

    def poll(self) -> list[BackupOp | PrefetchOp]:
        """Ops the worker has finished since the last call, in finishing order; each is the
        scheduler thread's again (`in_worker` False)."""
        out = []
        while True:
            try:
                op = self._done.get_nowait()
            except queue.Empty:
                return out
            op.in_worker = False
            self._in_flight -= 1
            out.append(op)

    def in_flight(self) -> int:
        """Ops submitted and not yet returned by `poll()`."""
        return self._in_flight

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until the worker has finished every queued op (they still come back through
        `poll()`); False if `timeout` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._tasks.all_tasks_done:
            while self._tasks.unfinished_tasks:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._tasks.all_tasks_done.wait(left)
        return True

    def close(self, run_queued: bool = True, timeout: float = 60.0) -> bool:
        """Stop the worker, then close the backend (idempotent). Returns False when the worker
        is still inside a backend call after `timeout`: then the backend is left open (closing
        it would unregister memory a transfer may still be reading or writing) and the
        caller must not free the host pool either.

        Args:
            run_queued: finish the ops already queued first; False (process exit) skips
                them, so only the op running now is waited for (storage is a cache: a
                skipped backup is a later miss, and a file write is atomic anyway).
            timeout: seconds to wait for the worker (it is a daemon thread either way).
        """
        if self._closed:
            return not self._thread.is_alive()
        self._closed = True
        self._skip_queued = not run_queued
        self._tasks.put(None)
        self._thread.join(timeout=timeout)
        if self._thread.is_alive():
            logger.warning("storage worker still inside a backend call after %.0f s: leaving the "
                           "backend and the host pool open for the process exit", timeout)
            return False
        self.backend.close()
        return True

    # ------------------------------------------------------------------ worker thread

    def _run(self) -> None:
        while True:
            op = self._tasks.get()
            try:
                if op is None:
                    return
                if self._skip_queued:  # closing: hand it back undone (a miss)
                    op.error = "storage closed"
                    self._done.put(op)
                    continue
                t0 = time.perf_counter()
                try:
                    self._execute(op)
                except Exception as e:  # a backend must not raise; if one does, it is a miss
                    op.error = f"{type(e).__name__}: {e}"
                    if type(e).__name__ not in self._errors_logged:
                        self._errors_logged.add(type(e).__name__)
                        logger.exception("storage worker: %s raised; counted as a miss", type(op).__name__)
                op.seconds = time.perf_counter() - t0
                self._done.put(op)
            finally:
                self._tasks.task_done()

    def _execute(self, op: BackupOp | PrefetchOp) -> None:
        if isinstance(op, BackupOp):
            if not op.write:
                op.skipped_pages = op.stored_pages = len(op.keys)
                return
            skip = self.backend.batch_exists(op.keys)
            op.skipped_pages = skip
            written = self.backend.batch_set_from(op.keys[skip:], op.host_pages[skip:]) if skip < len(op.keys) else 0
            op.stored_pages = skip + written
        elif op.phase == "exists":
            op.hit_pages = 0 if op.cancelled else self.backend.batch_exists(op.keys)
        else:
            self._fetch(op)

    def _fetch(self, op: PrefetchOp) -> None:
        """Phase "fetch": read `op.hit_pages` pages in batches; stop on cancel or a short read."""
        n, b = op.hit_pages, self.batch_pages
        for start in range(0, n, b):
            if op.cancelled:
                return
            end = min(start + b, n)
            got = self.backend.batch_get_into(op.keys[start:end], op.host_pages[start:end])
            op.completed_pages = start + max(0, min(got, end - start))
            if got < end - start:
                return


PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


@dataclass(frozen=True)
class StorageConfig:
    """How the cache uses its storage tier (from `--hicache-storage-prefetch-policy` and the
    common keys of `--hicache-storage-backend-extra-config`, SGLang's names and defaults).

    Attributes:
        prefetch_policy: `best_effort` (take what arrived when the request is considered),
            `wait_complete` (hold it until the prefetch is done), `timeout` (hold it until done
            or `prefetch_timeout_base + prefetch_timeout_per_ki_token * tokens / 1024` s).
        prefetch_threshold: tokens; shorter storage hits are not fetched.
        prefetch_timeout_base, prefetch_timeout_per_ki_token: seconds (see `timeout`).
        prefetch_host_fraction: most of the host pool prefetches may hold at once (SGLang 0.5).
        batch_pages: pages per `batch_get_into` call.
    """

    prefetch_policy: str = "timeout"
    prefetch_threshold: int = 256
    prefetch_timeout_base: float = 1.0
    prefetch_timeout_per_ki_token: float = 0.25
    prefetch_host_fraction: float = 0.5
    batch_pages: int = DEFAULT_BATCH_PAGES

    @classmethod
    def from_extra_config(cls, prefetch_policy: str, extra: dict) -> "StorageConfig":
        """Read the common keys of an extra-config dict (others are the backend's).

        Raises:
            ValueError: an unknown policy, or a key of the wrong type or out of range (the
                message names the key).
        """
        if prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(f"--hicache-storage-prefetch-policy {prefetch_policy!r}: expected one of "
                             f"{PREFETCH_POLICIES}")
        values = {}
        for key, conv, default in (("prefetch_threshold", int, cls.prefetch_threshold),
                                   ("prefetch_timeout_base", float, cls.prefetch_timeout_base),
                                   ("prefetch_timeout_per_ki_token", float, cls.prefetch_timeout_per_ki_token)):
            raw = extra.get(key, default)
            if isinstance(raw, bool) or not isinstance(raw, (int, float)) or raw < 0:
                raise ValueError(f"--hicache-storage-backend-extra-config: {key} must be a number >= 0, "
                                 f"got {raw!r}")
            values[key] = conv(raw)
        return cls(prefetch_policy=prefetch_policy, **values)
