"""The KV manager: the scheduler's one front door to the KV hierarchy.

The scheduler decides *which* requests run; the manager decides *where their KV lives*.
It is the only code that touches the prefix cache, the device allocator, `req_to_token`
and the host tier's transfers. One request's walk through it:

    match(req)           longest cached prefix of req.fill_ids[:-1]: device part + host part
    lock(req)            pin the device prefix (the admission budget is checked after this)
    admit(req)           take a request row; load back the host part (only now, for an
                         admitted request); write the prefix into req_to_token
    alloc_extend(reqs)   slots for this round's new tokens (evicting if needed)
    start_loads()        issue the queued load-backs; the ticket rides with the batch
    cache(req, False)    after a prefill chunk: the computed prefix goes into the cache
    alloc_decode(reqs)   one slot per request per decode step
    cache(req, True)     finished: KV into the cache, the rest freed, the lock dropped
    poll()               every iteration: transfer acks, slots freed by finished writes

With a storage tier (L3) two more calls frame a request's wait in the queue:

    start_prefetch(req)  at queue entry: storage pages past the cached prefix start coming
                         to the host in the background (the queue wait hides the read)
    prefetch_ready(req)  when the scheduler considers it: the prefetch policy says whether
                         to wait longer; if not, the pages that arrived join the tree as
                         host-only nodes, so match → admit loads them back like any host hit
    cancel_prefetch(req) an aborted request's prefetch stops; its host slots are freed

Ownership of one request's row (`ReqKV`): positions `[0, cache_len)` are the cache's
(locked through `handle`), `[cache_len, kv_len)` are the request's own slots; `prefix_len`
is how many positions held KV when the current round started. Every device page is owned
exactly once: by the cache, by one request, by the free list, or by the cache's pending
list (evicted while its write to the host is in flight). `check_integrity()` verifies it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from hiserve.distributed import get_tp_group, tp_gather_objects, tp_min_ints
from hiserve.mem_cache.hierarchy import KVHierarchy
from hiserve.mem_cache.prefix_cache import MatchResult, PrefixHandle, empty_slots

logger = logging.getLogger(__name__)


@dataclass
class ReqKV:
    """One request's KV bookkeeping (owned by the KVManager; the scheduler reads it).

    Attributes:
        row: its `req_to_token` row, or None while it holds no KV.
        prefix_len: positions holding KV when the current round started.
        cache_len: positions `[0, cache_len)` owned by the cache (page-aligned).
        kv_len: positions with a slot (`[cache_len, kv_len)` are the request's own).
        handle: the locked end of its cached prefix (None: nothing locked).
        match: the latest match, before admission.
        cached_tokens_device, cached_tokens_host, cached_tokens_storage: prefix tokens
            served from each tier at the first admission (usage reporting); storage ones
            were read from L3 by this request's prefetch (and loaded back from the host).
        prefetch: its storage prefetch in progress (opaque; None: none).
        storage_tokens: tokens its prefetch inserted into the tree.
    """

    row: int | None = None
    prefix_len: int = 0
    cache_len: int = 0
    kv_len: int = 0
    handle: PrefixHandle | None = None
    match: MatchResult | None = None
    cached_tokens_device: int = 0
    cached_tokens_host: int = 0
    cached_tokens_storage: int = 0
    admitted_once: bool = False
    prefetch: object | None = None
    storage_tokens: int = 0


class KVRequest(Protocol):
    """The request fields the manager reads (the scheduler's `Req` has more)."""

    origin_input_ids: list[int]
    output_ids: list[int]
    fill_ids: list[int]
    kv: ReqKV
    # Tokens a launched forward has sampled whose ids the host does not have yet (overlap
    # scheduling; 0 otherwise): they count in the sequence (`_seq_len`), not in output_ids.
    num_pending_tokens: int


def _seq_len(req: KVRequest) -> int:
    """Positions of the sequence, including a token still in flight (overlap scheduling)."""
    return len(req.origin_input_ids) + len(req.output_ids) + getattr(req, "num_pending_tokens", 0)


@dataclass
class KVStats:
    """Sizes in tokens, for logs, metrics and /get_server_info."""

    available: int
    evictable: int
    protected: int
    pending: int
    host_total: int = 0
    host_used: int = 0
    backed_up_tokens_total: int = 0
    loaded_back_tokens_total: int = 0


class KVManager:
    """Front door to the KV hierarchy (see the module docstring).

    Args:
        hierarchy: the pools, allocator, cache and host tier (`build_kv_hierarchy`).
        debug_checks: run `check_integrity()` after every `poll()` (slow; for debugging).
    """

    def __init__(self, hierarchy: KVHierarchy, debug_checks: bool = False) -> None:
        self.h = hierarchy
        self.prefix_cache = hierarchy.cache
        self.allocator = hierarchy.allocator
        self.rtt = hierarchy.req_to_token_pool
        self.page_size = hierarchy.spec.page_size
        self.debug_checks = debug_checks
        self.is_hierarchical = hierarchy.controller is not None
        self.has_storage = self.is_hierarchical and self.prefix_cache.storage is not None
        self._live: dict[int, ReqKV] = {}  # row -> state, for integrity checks
        self._tp_size = get_tp_group().size

    @property
    def shares_prefixes(self) -> bool:
        return self.prefix_cache.shares_prefixes

    # ------------------------------------------------------------------ admission

    def match(self, req: KVRequest, max_len: int | None = None) -> MatchResult:
        """Match `req.fill_ids[:max_len]` (default: all but the last token, which is always
        recomputed: its logits pick the next token; a request owing prompt logprobs passes a
        shorter limit). Only for a request that holds no KV; nothing is locked yet."""
        assert req.kv.row is None, "match() of a request that holds KV"
        limit = len(req.fill_ids) - 1 if max_len is None else min(max_len, len(req.fill_ids) - 1)
        m = self.prefix_cache.match(req.fill_ids[:limit])
        if self._tp_size > 1:
            self._agree_match(m)
        req.kv.match = m
        req.kv.prefix_len = m.device_len
        return m

    @staticmethod
    def _agree_match(m: MatchResult) -> None:
        """TP: every rank must match the same device and host lengths, so every rank loads back
        the same pages into the same slots (one all-reduce MIN of [dev, host, -dev, -host] on
        the CPU group). Ranks run the same schedule on equal-sized pools and agree on transfer
        completions, so their trees are equal by construction; a MIN could not repair a
        difference (the slots behind the lengths would differ too), so one is an error.

        Raises:
            RuntimeError: the ranks' lengths differ (their hierarchies diverged).
        """
        lo = tp_min_ints([m.device_len, m.host_hit_length, -m.device_len, -m.host_hit_length])
        if lo[0] != -lo[2] or lo[1] != -lo[3]:
            raise RuntimeError(f"TP ranks matched different prefixes (device {lo[0]}..{-lo[2]}, host "
                               f"{lo[1]}..{-lo[3]} tokens): their KV hierarchies diverged")

    def cached_len(self, token_ids: list[int]) -> int:
        """Device-cached prefix length of `token_ids[:-1]` (queue ordering; locks nothing)."""
        return self.prefix_cache.match(token_ids[:-1]).device_len

    def loadable_len(self, req: KVRequest) -> int:
        """Tokens past the device prefix that admission would load back from the host."""
        m = req.kv.match
        if m is None or not self.is_hierarchical or m.host_hit_length < self.prefix_cache.load_back_threshold:
            return 0
        return m.host_hit_length

    def lock(self, req: KVRequest) -> int:
        """Pin the matched device prefix; returns the tokens that stopped being evictable."""
        before = self.prefix_cache.evictable_size()
        req.kv.handle = req.kv.match.handle
        self.prefix_cache.lock(req.kv.handle)
        return before - self.prefix_cache.evictable_size()

    def unlock(self, req: KVRequest) -> int:
        """Undo `lock` for a request the budget refused; returns tokens evictable again."""
        before = self.prefix_cache.evictable_size()
        self.prefix_cache.unlock(req.kv.handle)
        req.kv.handle = None
        return self.prefix_cache.evictable_size() - before

    def admit(self, req: KVRequest) -> int:
        """Admit a locked request: take a row, load back its host part (if worth it), and
        write its prefix into req_to_token. Returns the tokens loaded back.

        Raises:
            RuntimeError: no free request row (the scheduler checks rows before admitting).
        """
        kv, m = req.kv, req.kv.match
        rows = self.rtt.alloc(1)
        if rows is None:
            raise RuntimeError("admit() without a free req_to_token row")
        kv.row = rows[0]
        self._live[kv.row] = kv
        loaded = self._load_back(req) if self.loadable_len(req) else empty_slots()
        prefix = torch.cat([m.device_indices, loaded]) if len(loaded) else m.device_indices
        self.rtt.write(kv.row, 0, prefix)
        kv.prefix_len = kv.cache_len = kv.kv_len = len(prefix)
        if not kv.admitted_once:
            # Prefetched pages hang below the rest of the host part: they are its tail.
            kv.cached_tokens_storage = min(kv.storage_tokens, len(loaded))
            kv.cached_tokens_device = m.device_len
            kv.cached_tokens_host = len(loaded) - kv.cached_tokens_storage
            kv.admitted_once = True
        kv.match = None
        return len(loaded)

    def _load_back(self, req: KVRequest) -> torch.Tensor:
        kv, m = req.kv, req.kv.match
        with self.prefix_cache.pinned(m.host_handle):
            slots = self._alloc(m.host_hit_length, lambda: self.allocator.alloc(m.host_hit_length))
        if slots is None:
            return empty_slots()  # no room even after evicting: the host part is recomputed
        self.prefix_cache.load_back(m.host_handle, slots)
        self.prefix_cache.lock(m.host_handle)
        self.prefix_cache.unlock(kv.handle)
        kv.handle = m.host_handle
        return slots

    def start_loads(self, fence: Callable[[], object | None] | None = None) -> object | None:
        """Issue the load-backs queued by this round's admissions; returns the ticket the
        consuming batch's forward carries (None: nothing to load).

        fence: with overlap scheduling a forward may still be running that reads slots freed
        meanwhile (a request's duplicate prefix slots) which a load-back now overwrites. Called
        only when loads are queued, it returns once the load may be ordered after that
        forward: a CUDA event the load stream waits for, or None (nothing left to wait for;
        on the CPU it blocks until the forward has finished)."""
        if not self.is_hierarchical or not self.h.controller.load_queue:
            return None
        after = fence() if fence is not None else None
        return self.h.controller.start_loading(after=after)

    # ------------------------------------------------------------------ allocation

    def evict(self, num_tokens: int) -> int:
        """Drop at least `num_tokens` tokens of unlocked cached prefixes (fewer if not
        enough are evictable); returns the tokens freed now (writes in flight pend)."""
        freed = self.prefix_cache.evict(num_tokens)
        self.allocator.free(freed)
        return len(freed)

    def _alloc(self, need_tokens: int, alloc_fn) -> torch.Tensor | None:
        """`alloc_fn()` after evicting enough; as a last resort waits for writes in flight."""
        short = need_tokens - self.allocator.available_size()
        if short > 0:
            self.evict(short)
        out = alloc_fn()
        if out is None and self.prefix_cache.pending_slots() > 0:
            self.allocator.free(self.prefix_cache.wait_pending())
            out = alloc_fn()
        return out

    def new_pages(self, prefix_lens: list[int], seq_lens: list[int]) -> int:
        """Pages an allocation needs: position j lives on page j // page_size of its request."""
        p = self.page_size
        return sum(-(-s // p) - -(-q // p) for q, s in zip(prefix_lens, seq_lens))

    def alloc_extend(self, reqs: list[KVRequest]) -> torch.Tensor:
        """Slots for positions `kv.prefix_len .. len(fill_ids)-1` of each request, written
        into req_to_token. Returns int64 CPU `[sum of extend lengths]`.

        Raises:
            RuntimeError: the pool is exhausted (the admission budget should prevent it).
        """
        prefix_lens = [r.kv.prefix_len for r in reqs]
        seq_lens = [len(r.fill_ids) for r in reqs]
        cpu = self.rtt.req_to_token_cpu
        last_loc = [int(cpu[r.kv.row, p - 1]) if p > 0 else -1 for r, p in zip(reqs, prefix_lens)]
        need = self.new_pages(prefix_lens, seq_lens) * self.page_size
        out = self._alloc(need, lambda: self.allocator.alloc_extend(prefix_lens, seq_lens, last_loc))
        if out is None:
            raise RuntimeError("KV pool exhausted during prefill admission (budget accounting bug)")
        offset = 0
        for r, p, s in zip(reqs, prefix_lens, seq_lens):
            self.rtt.write(r.kv.row, p, out[offset:offset + s - p])
            r.kv.kv_len = s
            offset += s - p
        self.rtt.flush()
        return out

    def alloc_decode(self, reqs: list[KVRequest]) -> torch.Tensor:
        """One slot per request for its position seqlen - 1 (the KV of its newest token; the
        sequence length counts a token still in flight, see `KVRequest.num_pending_tokens`).

        Returns int64 CPU `[len(reqs)]`. Raises RuntimeError when the pool is exhausted
        (the scheduler retracts until `room()` covers `decode_need()` first)."""
        seq_lens = [_seq_len(r) for r in reqs]
        rows = [r.kv.row for r in reqs]
        cpu = self.rtt.req_to_token_cpu
        last_loc = cpu[torch.tensor(rows), torch.tensor(seq_lens) - 2].to(torch.int64)
        need = self.new_pages([s - 1 for s in seq_lens], seq_lens) * self.page_size
        out = self._alloc(need, lambda: self.allocator.alloc_decode(seq_lens, last_loc))
        if out is None:
            raise RuntimeError("KV pool exhausted after retraction (accounting bug)")
        self.rtt.write_positions(rows, [s - 1 for s in seq_lens], out)
        for r, s in zip(reqs, seq_lens):
            r.kv.kv_len = s
        self.rtt.flush()
        return out

    def decode_need(self, reqs: list[KVRequest]) -> int:
        """Tokens of new pages the next decode step of `reqs` takes."""
        lens = [_seq_len(r) for r in reqs]
        return self.new_pages([n - 1 for n in lens], lens) * self.page_size

    def room(self) -> int:
        """Tokens allocatable now or after eviction (free + evictable + pending writes)."""
        return self.allocator.available_size() + self.prefix_cache.evictable_size() + self.prefix_cache.pending_slots()

    # ------------------------------------------------------------------ caching

    def cache(self, req: KVRequest, finished: bool) -> None:
        """Hand the request's computed KV to the prefix cache.

        finished (or retracted): tokens with KV are `(origin_input_ids + output_ids)[:-1]`;
        the aligned part goes into the cache, duplicates and the unaligned tail (up to
        `kv_len`, which covers a dropped extra token's slot under overlap scheduling) are freed,
        the row is freed and the lock dropped. Unfinished (after a prefill chunk): `fill_ids`
        go in, the row is re-pointed at the cache's slots, the lock moves to the new end.
        """
        kv = req.kv
        token_ids = (req.origin_input_ids + req.output_ids)[:-1] if finished else req.fill_ids
        n = len(token_ids)
        if not finished and not self.prefix_cache.shares_prefixes:
            kv.prefix_len = n  # nothing is shared: the request keeps its own slots
            return
        slots = self.rtt.slots(kv.row, 0, n)
        aligned = n - n % self.page_size
        res = self.prefix_cache.insert(token_ids[:aligned], slots[:aligned], hit=finished)
        assert res.cached_len >= kv.cache_len, "the request's locked prefix left the cache"
        self.allocator.free(slots[kv.cache_len:res.cached_len])  # duplicates
        if finished:
            # kv_len may exceed n by one: overlap scheduling's extra token of a request that a
            # launched forward held when it finished (its slot is freed with the tail).
            self.allocator.free(self.rtt.slots(kv.row, aligned, kv.kv_len))
            self._drop(req)
            return
        tree_slots = self.prefix_cache.match(token_ids[:aligned]).device_indices
        assert len(tree_slots) == aligned, "the prefix just inserted must match in full"
        self.rtt.write(kv.row, kv.cache_len, tree_slots[kv.cache_len:])
        self.rtt.flush()
        self.prefix_cache.lock(res.handle)
        self.prefix_cache.unlock(kv.handle)
        kv.handle, kv.cache_len, kv.prefix_len = res.handle, aligned, n

    def release(self, req: KVRequest) -> None:
        """Free everything an unfinished request holds, caching nothing (an aborted
        chunked prompt): its own slots, its row and its lock."""
        kv = req.kv
        if kv.row is None:
            return
        self.allocator.free(self.rtt.slots(kv.row, kv.cache_len, kv.kv_len))
        self._drop(req)

    def _drop(self, req: KVRequest) -> None:
        kv = req.kv
        self.rtt.free(kv.row)
        self._live.pop(kv.row, None)
        if kv.handle is not None:
            self.prefix_cache.unlock(kv.handle)
        kv.row, kv.handle, kv.match = None, None, None
        kv.prefix_len = kv.cache_len = kv.kv_len = 0

    # ------------------------------------------------------------------ storage tier

    def start_prefetch(self, req: KVRequest) -> None:
        """At queue entry: prefetch the storage pages of `(origin_input_ids + output_ids)[:-1]`
        past what the tree holds (`HiRadixCache.start_prefetch`); no-op without storage."""
        if self.has_storage and req.kv.prefetch is None:
            tokens = (req.origin_input_ids + req.output_ids)[:-1]
            req.kv.prefetch = self.prefix_cache.start_prefetch(tokens)

    def prefetch_ready(self, req: KVRequest) -> bool:
        """Whether `req` may be considered for admission now. False: its prefetch policy
        holds it in the queue this round. True: no prefetch, or it ended now, and the pages
        that arrived are in the tree (the next `match` finds them as a host hit)."""
        op = req.kv.prefetch
        if op is None:
            return True
        if not self.prefix_cache.prefetch_ready(op):
            return False
        req.kv.storage_tokens += self.prefix_cache.take_prefetch(op)
        req.kv.prefetch = None
        return True

    def cancel_prefetch(self, req: KVRequest) -> None:
        """Abandon `req`'s prefetch (aborted in the queue); its host slots are freed once the
        storage worker lets go."""
        if req.kv.prefetch is not None:
            self.prefix_cache.cancel_prefetch(req.kv.prefetch)
            req.kv.prefetch = None

    def storage_busy(self) -> bool:
        """Storage ops are in flight (the scheduler may nap instead of spinning)."""
        return self.has_storage and self.prefix_cache.storage.in_flight() > 0

    def storage_metrics(self) -> dict | None:
        """Storage counters for /metrics (`HiRadixCache.storage_metrics`; None without one)."""
        return self.prefix_cache.storage_metrics() if self.has_storage else None

    def storage_state(self) -> dict | None:
        """The storage backend's state and counters for /get_server_info (None without one)."""
        return self.prefix_cache.storage_state() if self.has_storage else None

    # ------------------------------------------------------------------ every iteration

    def poll(self) -> None:
        """Process transfer acknowledgements; free slots whose writes finished."""
        self.allocator.free(self.prefix_cache.poll())
        if self.debug_checks:
            self.check_integrity()
            self.check_ranks_agree()

    def check_ranks_agree(self) -> None:
        """Under TP every rank's hierarchy must be in the same state (each rank runs the same
        schedule on its own pools); compare the counts across ranks (CPU group).

        Raises:
            AssertionError: the ranks differ (each rank's state in the message).
        """
        if get_tp_group().size == 1:
            return
        s = self.stats()
        mine = (s.available, s.evictable, s.protected, s.pending, s.host_used, len(self._live),
                self.rtt.available_size())
        states = tp_gather_objects(mine)
        assert all(st == states[0] for st in states), \
            f"TP ranks' KV hierarchies diverged (available, evictable, protected, pending, host used, rows): {states}"

    def flush_cache(self) -> bool:
        """Drop every cached prefix (both tiers); False (nothing done) while requests hold KV."""
        if self._live:
            return False
        self.prefix_cache.reset()  # waits for storage ops too; storage keeps its pages
        self.allocator.clear()
        self.rtt.clear()
        return True

    def stats(self) -> KVStats:
        s = KVStats(self.allocator.available_size(), self.prefix_cache.evictable_size(),
                    self.prefix_cache.protected_size(), self.prefix_cache.pending_slots())
        if self.is_hierarchical:
            c = self.prefix_cache
            s.host_total, s.host_used = c.host_total_size(), c.host_used_size()
            s.backed_up_tokens_total = c.backed_up_tokens_total
            s.loaded_back_tokens_total = c.loaded_back_tokens_total
        return s

    def check_integrity(self) -> None:
        """Every device page owned exactly once (cache, one request, free list or pending
        list), every request row live or free, and the cache's own invariants. Raises
        AssertionError naming what is wrong."""
        P = self.page_size
        tree = self.prefix_cache.check_integrity()
        own = [self.rtt.slots(kv.row, kv.cache_len, kv.kv_len) for kv in self._live.values()]
        for kv in self._live.values():
            assert kv.cache_len % P == 0 and kv.cache_len <= kv.prefix_len <= kv.kv_len, f"bad {kv}"
            assert kv.handle is not None, f"row {kv.row} holds cache slots without a lock"
        pending = self.prefix_cache.pending_indices()
        pages = [self.allocator.free_page_ids(), tree[::P] // P, pending[::P] // P]
        pages += [s[::P] // P for s in own if len(s)]
        allp = torch.cat(pages)
        num_pages = self.allocator.num_pages
        assert len(allp) == num_pages, f"{len(allp)} page owners for {num_pages} pages"
        assert torch.equal(torch.sort(allp).values, torch.arange(1, num_pages + 1)), \
            "a device page is owned twice or by nobody"
        assert len(self._live) + self.rtt.available_size() == self.rtt.size, "a request row leaked"
