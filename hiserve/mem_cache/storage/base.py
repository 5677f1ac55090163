"""The storage tier (L3) contract: what the host tier may ask of a page store.

A storage backend keeps host pages under string keys, one object per page *and kind*
(MHA: "k" and "v"; MLA: "kv"), so a page-first host pool reads and writes each object
zero-copy from its own memory (`HostKVCache.page_object`). The KV hierarchy calls it only
from its storage worker thread (never from the scheduler loop), through four operations:

    batch_exists(keys)                 -> leading pages present (every kind)
    batch_get_into(keys, host_pages)   -> leading pages read into those host pages
    batch_set_from(keys, host_pages)   -> pages written from those host pages
    clear()                            drop every object this namespace owns (where possible)

`keys` are page keys from `keys.page_keys` (a chained hash per page, namespaced); the backend
appends the kind itself. Storage is an optimisation: a backend **never raises** for an I/O
failure, a time-out or a missing server. It counts the failure by reason in `stats()`,
logs the first one of each reason, and reports fewer pages (a read stops at the first
page it cannot deliver whole and verified; later pages are useless without it, because
each page's key covers every token before it). The caller treats the rest as a miss.

The contract follows SGLang's `HiCacheStorage` (`mem_cache/hicache_storage.py`:
`batch_exists` returning a count of leading hits, zero-copy `batch_get_v1`/`batch_set_v1`),
reduced to what hiserve uses.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hiserve.mem_cache.memory_pool_host import HostKVCache

logger = logging.getLogger(__name__)


@dataclass
class StorageStats:
    """Counters since start (pages count whole pages, all kinds; bytes count every kind).

    Attributes:
        pages_read, pages_written, pages_skipped: pages read, written, and not written
            because the store already had them.
        bytes_read, bytes_written: payload bytes moved.
        read_seconds, write_seconds: wall time inside batch_get_into / batch_set_from.
        failures: failure count by reason (e.g. "timeout", "io_error", "checksum", "no_space",
            "unavailable").
    """

    pages_read: int = 0
    pages_written: int = 0
    pages_skipped: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0
    failures: Counter = field(default_factory=Counter)


class HiCacheStorage(ABC):
    """Base of the storage backends (`file`, `mooncake`).

    Args:
        host_pool: the host pool whose pages are read and written (page-first layout:
            `page_object(kind, page)` must be one contiguous object).
        namespace: prefix of every object name (`keys.storage_namespace`): model, dtype,
            page size, layout and KV kinds, so two configurations never share pages.
    Attributes:
        kinds: the host pool's kind names, in order; object name = f"{key}.{kind}".
        page_bytes: bytes of one page of one kind (all kinds are equal-sized here).
    Raises:
        ValueError: a host pool without contiguous page objects (`layer_first`).
    """

    name: str = "base"

    def __init__(self, host_pool: "HostKVCache", namespace: str) -> None:
        if host_pool.layout == "layer_first":
            raise ValueError("a storage backend needs a page-first host layout, not 'layer_first'")
        self.host_pool = host_pool
        self.namespace = namespace
        self.kinds = [k.name for k in host_pool.kinds]
        self.page_bytes = host_pool.kinds[0].page_bytes
        self._stats = StorageStats()
        self._stats_lock = threading.Lock()  # stats are read by the scheduler thread
        self._logged_reasons: set[str] = set()

    def object_keys(self, key: str) -> list[str]:
        """The object names of one page key: one per kind."""
        return [f"{key}.{kind}" for kind in self.kinds]

    @abstractmethod
    def batch_exists(self, keys: list[str]) -> int:
        """How many of `keys`, from the first, are present with every kind (0..len(keys))."""

    @abstractmethod
    def batch_get_into(self, keys: list[str], host_pages: list[int]) -> int:
        """Read page `keys[i]` into host page `host_pages[i]` (every kind), in order; stops at
        the first page it cannot deliver whole. Returns the leading pages now valid in the
        host pool (pages after that may hold garbage: the caller must not use them)."""

    @abstractmethod
    def batch_set_from(self, keys: list[str], host_pages: list[int]) -> int:
        """Write host page `host_pages[i]` under `keys[i]` (every kind). Returns the leading
        pages stored (written now or already present; a page after one that failed does not
        count, even if it was written: the caller marks exactly `pages[:n]` as stored)."""

    @abstractmethod
    def clear(self) -> None:
        """Drop every object of this namespace this backend can enumerate."""

    def close(self) -> None:
        """Release connections and registrations (idempotent)."""

    def state(self) -> dict:
        """What /get_server_info shows: backend name, namespace and backend specifics."""
        return {"backend": self.name, "namespace": self.namespace}

    # ------------------------------------------------------------------ stats

    def stats(self) -> StorageStats:
        """A snapshot of the counters."""
        with self._stats_lock:
            s = self._stats
            return StorageStats(s.pages_read, s.pages_written, s.pages_skipped, s.bytes_read,
                                s.bytes_written, s.read_seconds, s.write_seconds, Counter(s.failures))

    def _count(self, **delta: float) -> None:
        with self._stats_lock:
            for name, value in delta.items():
                setattr(self._stats, name, getattr(self._stats, name) + value)

    def _fail(self, reason: str, detail: str) -> None:
        """Count a failure by reason; log the first of each reason (a failure is a miss)."""
        with self._stats_lock:
            self._stats.failures[reason] += 1
            first = reason not in self._logged_reasons
            self._logged_reasons.add(reason)
        if first:
            logger.warning("storage backend %s: %s (%s); counted as a miss, further %r failures "
                           "are counted without logging", self.name, reason, detail, reason)
