"""The prefix-cache contract: what the KV manager may ask of a cache of token prefixes.

A prefix cache maps token-id prefixes to the device slots holding their KV. The KV manager
(`kv_manager.py`) is its only caller, through these operations:

    match(key)          -> MatchResult      longest cached prefix (page-aligned), with handles
    insert(key, slots)  -> InsertResult     hand slots to the cache; says which were duplicates
    lock(h) / unlock(h)                      pin / unpin a prefix (and its ancestors)
    evict(n)            -> slots             free >= n tokens of unlocked prefixes, LRU first;
                                             the *caller* returns the slots to the allocator
    check_integrity()   -> slots             verify invariants; returns every slot it owns

Handles are typed and opaque: the manager never sees tree nodes. Two caches implement it:
`RadixCache` (radix_cache.py; `HiRadixCache` adds a host tier) and `ChunkCache` (below),
used with --disable-radix-cache: it keeps nothing, so every request owns all of its slots.
The contract follows mini-sglang's `kvcache/base.py` (match / insert / lock / evict), with
handles that are typed, `InsertResult` carrying the handle of the inserted path, and an
integrity check.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, eq=False)
class PrefixHandle:
    """The end of a cached prefix, as returned by `match` / `insert`; pass it to lock/unlock.

    Attributes:
        cached_len: tokens from the start of the key to this handle.
    """

    cached_len: int
    _node: object = field(repr=False, default=None)  # the cache's own node; callers never read it


def empty_slots() -> torch.Tensor:
    """int64 CPU `[0]`."""
    return torch.empty(0, dtype=torch.int64)


@dataclass(frozen=True)
class MatchResult:
    """What `match` found for a key.

    Attributes:
        device_indices: int64 CPU `[n]`: device slots of the matched prefix held on the device.
        handle: end of that device prefix (lock it before relying on the slots).
        host_hit_length: tokens past the device prefix that only the host tier holds (0
            without one); `host_handle` ends them.
        host_handle: end of the host part (== handle when host_hit_length is 0).
    """

    device_indices: torch.Tensor
    handle: PrefixHandle
    host_hit_length: int = 0
    host_handle: PrefixHandle | None = None

    @property
    def device_len(self) -> int:
        return len(self.device_indices)


@dataclass(frozen=True)
class InsertResult:
    """What `insert(key, slots)` did.

    Attributes:
        cached_len: leading tokens of `key` whose slots the cache did not take: it already
            held that prefix (or, for ChunkCache, keeps nothing). The caller still owns
            `slots[:cached_len]`; the cache owns the rest.
        handle: end of the inserted key in the cache (unlocked).
    """

    cached_len: int
    handle: PrefixHandle


class PrefixCache(ABC):
    """Base of the prefix caches (see the module docstring for the contract).

    Attributes:
        page_size: tokens per page; keys and slot runs are page-aligned.
        shares_prefixes: whether inserted prefixes are found by later matches (False for
            ChunkCache: an unfinished request then keeps its own slots).
    """

    shares_prefixes = True

    def __init__(self, page_size: int) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be > 0, got {page_size}")
        self.page_size = page_size

    @abstractmethod
    def match(self, key: list[int]) -> MatchResult:
        """Longest cached page-aligned prefix of `key` (token ids)."""

    @abstractmethod
    def insert(self, key: list[int], slots: torch.Tensor, hit: bool = False) -> InsertResult:
        """Offer `slots` (int64 CPU `[len(key)]`, len a multiple of page_size) for `key`;
        `hit`: this insert ends a request's use of the prefix (caches that count reuse,
        e.g. for a selective write policy, count it)."""

    @abstractmethod
    def lock(self, handle: PrefixHandle) -> None:
        """Pin the prefix ending at `handle` (evict skips it) until `unlock`."""

    @abstractmethod
    def unlock(self, handle: PrefixHandle) -> None:
        """Undo one `lock(handle)`."""

    @abstractmethod
    def evict(self, num_tokens: int) -> torch.Tensor:
        """Drop at least `num_tokens` tokens of unlocked prefixes (fewer if not enough are
        evictable); returns int64 CPU slots that are free now, for the caller to free."""

    @abstractmethod
    def evictable_size(self) -> int:
        """Device tokens held by unlocked prefixes."""

    @abstractmethod
    def protected_size(self) -> int:
        """Device tokens held by locked prefixes."""

    @abstractmethod
    def reset(self) -> None:
        """Forget everything (slots are not freed: the caller clears the allocator)."""

    @abstractmethod
    def check_integrity(self) -> torch.Tensor:
        """Check internal invariants (raises AssertionError naming the broken one); returns
        int64 CPU: every device slot the cache owns."""

    def pending_slots(self) -> int:
        """Device tokens evicted but not yet free (their write to a lower tier is in flight)."""
        return 0

    def pending_indices(self) -> torch.Tensor:
        """int64 CPU: the slots counted by `pending_slots()` (integrity checks only)."""
        return empty_slots()

    def poll(self) -> torch.Tensor:
        """Process finished transfers; returns slots that became free (none without tiers)."""
        return empty_slots()


class ChunkCache(PrefixCache):
    """The no-sharing cache (--disable-radix-cache): matches nothing and keeps nothing.

    `insert` reports every token as not taken (`cached_len == len(key)`), so a finished
    request frees all its slots, and `shares_prefixes` is False, so an unfinished one keeps
    its own. Chunked prefill still works: a request's earlier chunks stay in its row.
    """

    shares_prefixes = False
    _ROOT = PrefixHandle(0)

    def match(self, key: list[int]) -> MatchResult:
        return MatchResult(empty_slots(), self._ROOT, 0, self._ROOT)

    def insert(self, key: list[int], slots: torch.Tensor, hit: bool = False) -> InsertResult:
        return InsertResult(len(key), self._ROOT)

    def lock(self, handle: PrefixHandle) -> None:
        return None

    def unlock(self, handle: PrefixHandle) -> None:
        return None

    def evict(self, num_tokens: int) -> torch.Tensor:
        return empty_slots()

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def reset(self) -> None:
        return None

    def check_integrity(self) -> torch.Tensor:
        return empty_slots()
