"""HiRadixCache + HiCacheController on real CPU pools, and the Scheduler with the host tier.

The cache tests use a small MHA/MLA device pool whose KV rows are filled with values that
encode (token, layer), so a load-back can be checked by comparing device pool contents.
On the CPU every transfer completes synchronously, but acks still go through the
controller's queues: the tests hold ack processing back to see the in-flight states.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from hiserve.mem_cache.allocator import ReqToTokenPool, TokenToKVPoolAllocator
from hiserve.mem_cache.hiradix_cache import HiRadixCache, HiTreeNode
from hiserve.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from hiserve.mem_cache.memory_pool_host import MHATokenToKVPoolHost, MLATokenToKVPoolHost

POOL_SIZE = 64
LAYERS, HEADS, HEAD_DIM = 2, 2, 4  # 32-byte items: the CUDA kernels need 16-byte multiples
KV_LORA_RANK, ROPE_DIM = 4, 4


def make_cache(page_size: int = 1, policy: str = "write_through", kind: str = "MHA",
               layout: str = "page_first", ratio: float = 2.0, device: str = "cpu",
               io_backend: str = "direct", **kwargs) -> HiRadixCache:
    if kind == "MHA":
        pool = MHATokenToKVPool(POOL_SIZE, page_size, torch.float32, HEADS, HEAD_DIM, LAYERS, device)
        host = MHATokenToKVPoolHost(pool, ratio, 0, page_size, layout)
    else:
        pool = MLATokenToKVPool(POOL_SIZE, page_size, torch.float32, KV_LORA_RANK, ROPE_DIM, LAYERS,
                                device)
        host = MLATokenToKVPoolHost(pool, ratio, 0, page_size, layout)
    allocator = TokenToKVPoolAllocator(POOL_SIZE, page_size, device, kvcache=pool)
    rtt = ReqToTokenPool(size=8, max_context_len=128, device=device)
    return HiRadixCache(rtt, allocator, page_size, host, write_policy=policy, io_backend=io_backend,
                        **kwargs)


def pool_of(cache: HiRadixCache):
    return cache.token_to_kv_pool_allocator.get_kvcache()


def kv_rows(cache: HiRadixCache, tokens: list[int]) -> list[torch.Tensor]:
    """The KV a token sequence 'computes': every buffer row encodes (token, layer, buffer)."""
    pool = pool_of(cache)
    t = torch.tensor(tokens, dtype=torch.float32, device=pool.device)
    rows = []
    for b, buf in enumerate(pool.buffers()):
        shape = (len(tokens), *buf.shape[1:])
        rows.append((t * 100 + b).view(-1, *([1] * (len(shape) - 1))).expand(shape).clone())
    return rows


def write_kv(cache: HiRadixCache, slots: torch.Tensor, tokens: list[int]) -> None:
    for buf, rows in zip(pool_of(cache).buffers(), kv_rows(cache, tokens)):
        buf[slots] = rows


def read_kv(cache: HiRadixCache, slots: torch.Tensor) -> list[torch.Tensor]:
    return [buf[slots].clone() for buf in pool_of(cache).buffers()]


def insert_fresh(cache: HiRadixCache, key: list[int]) -> torch.Tensor:
    """Allocate slots for `key`, 'compute' their KV, insert; the tree owns the new part."""
    alloc = cache.token_to_kv_pool_allocator
    slots = alloc.alloc(len(key))
    write_kv(cache, slots, key)
    prefix_len = cache.insert(key, slots)
    alloc.free(slots[:prefix_len])
    return slots


def host_tokens_in_tree(cache: HiRadixCache) -> int:
    total, stack = 0, [cache.root_node]
    while stack:
        node = stack.pop()
        if node is not cache.root_node and node.host_value is not None:
            total += len(node.host_value)
        stack.extend(node.children.values())
    return total


def assert_consistent(cache: HiRadixCache, own_device_tokens: int = 0) -> None:
    """Every device slot is free, in the tree or owned by a request; every host slot is
    free or held by exactly one node."""
    alloc = cache.token_to_kv_pool_allocator
    assert cache.evictable_size() + cache.protected_size() == cache.total_size()
    assert alloc.available_size() + cache.total_size() + own_device_tokens == POOL_SIZE
    assert host_tokens_in_tree(cache) == cache.host_used_size()


def assert_everything_freed(cache: HiRadixCache) -> None:
    """Nothing locked; evicting both tiers returns every device and host slot exactly once."""
    cache.check_hicache_events()
    assert cache.protected_size() == 0
    total = cache.total_size()
    assert cache.evict(total) == total
    cache.evict_host(cache.host_total_size())
    assert not cache.root_node.children
    alloc, host = cache.token_to_kv_pool_allocator, cache.mem_pool_host
    assert alloc.available_size() == POOL_SIZE
    assert host.available_size() == host.size
    P = cache.page_size
    assert sorted(alloc.alloc(POOL_SIZE).cpu().tolist()) == list(range(P, P + POOL_SIZE))
    assert sorted(host.alloc(host.size).tolist()) == list(range(host.size))
    alloc.clear()
    host.clear()


def evict_to_host(cache: HiRadixCache) -> None:
    cache.check_hicache_events()
    cache.evict(cache.total_size())
    assert cache.total_size() == 0


# ---- a tiny scheduler driving the request hooks ----------------------------------------


@dataclass
class FakeReq:
    origin_input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    fill_ids: list[int] = field(default_factory=list)
    req_pool_idx: int = -1
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: HiTreeNode | None = None
    loaded: int = 0


class Driver:
    """Plays the scheduler: admit (match, load back, lock), prefill in chunks, decode, finish."""

    def __init__(self, cache: HiRadixCache) -> None:
        self.cache = cache
        self.rtt = cache.req_to_token_pool
        self.alloc = cache.token_to_kv_pool_allocator
        self.next_token = 1000

    def admit(self, req: FakeReq) -> None:
        match = self.cache.match_prefix(req.origin_input_ids[:-1])
        req.prefix_indices, req.last_node = match.device_indices, match.last_device_node
        if match.host_hit_length:
            loaded, last = self.cache.init_load_back(match.last_host_node, match.host_hit_length)
            if len(loaded):
                req.prefix_indices = torch.cat([req.prefix_indices, loaded])
                req.last_node, req.loaded = last, len(loaded)
        self.cache.ready_to_load_host_cache()
        self.cache.inc_lock_ref(req.last_node)
        req.req_pool_idx = self.rtt.alloc(1)[0]
        self.rtt.req_to_token[req.req_pool_idx, : len(req.prefix_indices)] = req.prefix_indices.int()

    def extend(self, req: FakeReq, end: int) -> None:
        row = self.rtt.req_to_token[req.req_pool_idx]
        start = len(req.prefix_indices)
        last_loc = int(row[start - 1]) if start > 0 else -1
        slots = self.alloc.alloc_extend([start], [end], [last_loc])
        assert slots is not None
        row[start:end] = slots.int()
        write_kv(self.cache, slots, req.origin_input_ids[start:end])
        req.fill_ids = req.origin_input_ids[:end]

    def prefill(self, req: FakeReq, chunk: int | None = None, stop_after_chunks: int | None = None) -> None:
        n = len(req.origin_input_ids)
        chunk = chunk or n
        chunks = 0
        while True:
            end = min(len(req.prefix_indices) + chunk, n)
            self.extend(req, end)
            if end == n:
                break
            self.cache.cache_unfinished_req(req)
            chunks += 1
            if stop_after_chunks is not None and chunks >= stop_after_chunks:
                return
        req.output_ids.append(self.new_token())

    def decode(self, req: FakeReq, steps: int) -> None:
        row = self.rtt.req_to_token[req.req_pool_idx]
        for _ in range(steps):
            seq_len = len(req.origin_input_ids) + len(req.output_ids)
            slot = self.alloc.alloc_decode([seq_len], [int(row[seq_len - 2])])
            assert slot is not None
            row[seq_len - 1] = int(slot[0])
            write_kv(self.cache, slot, [req.output_ids[-1]])
            req.output_ids.append(self.new_token())
            req.fill_ids = (req.origin_input_ids + req.output_ids)[:-1]

    def abort_chunked(self, req: FakeReq) -> None:
        """What the scheduler does for an unfinished prompt: free the tail, unlock, free the row."""
        P = self.cache.page_size
        n_tree = len(req.prefix_indices) // P * P
        self.alloc.free(req.prefix_indices[n_tree:])
        self.cache.dec_lock_ref(req.last_node)
        self.rtt.free(req.req_pool_idx)

    def new_token(self) -> int:
        self.next_token += 1
        return self.next_token

    def run(self, req: FakeReq, decode_steps: int = 2, chunk: int | None = None) -> FakeReq:
        self.admit(req)
        self.prefill(req, chunk)
        self.decode(req, decode_steps)
        self.cache.cache_finished_req(req)
        self.cache.check_hicache_events()
        return req


# ---- insert, split, states --------------------------------------------------------------


def test_write_through_backs_up_on_insert_and_locks_until_ack():
    cache = make_cache()
    insert_fresh(cache, [1, 2, 3, 4, 5])
    node = cache.match_prefix([1, 2, 3, 4, 5]).last_device_node
    assert node.backuped and not node.evicted
    assert cache.host_used_size() == 5 and cache.backed_up_tokens_total == 5
    # The write is in flight until its ack is processed: the node is protected.
    assert cache.protected_size() == 5 and cache.evict(5) == 0
    cache.check_hicache_events()
    assert cache.protected_size() == 0 and cache.evictable_size() == 5
    assert_consistent(cache)
    assert_everything_freed(cache)


def test_split_of_backed_up_and_host_only_nodes_splits_host_value():
    cache = make_cache()
    insert_fresh(cache, [1, 2, 3, 4, 5, 6])
    cache.check_hicache_events()
    whole = cache.match_prefix([1, 2, 3, 4, 5, 6]).last_device_node
    value, host_value = whole.value.clone(), whole.host_value.clone()
    upper = cache.match_prefix([1, 2, 9]).last_device_node  # splits after 2 tokens
    assert upper is whole.parent
    assert torch.equal(upper.value, value[:2]) and torch.equal(whole.value, value[2:])
    assert torch.equal(upper.host_value, host_value[:2]) and torch.equal(whole.host_value, host_value[2:])

    # A host-only node splits the same way, keeping both halves host-only.
    evict_to_host(cache)
    m = cache.match_prefix([1, 2, 3, 4, 7])
    assert m.host_hit_length == 4 and len(m.device_indices) == 0
    assert m.last_device_node is cache.root_node
    mid = m.last_host_node
    assert mid.evicted and torch.equal(mid.host_value, host_value[2:4])
    (low,) = mid.children.values()
    assert low.evicted and torch.equal(low.host_value, host_value[4:])
    assert_consistent(cache)
    assert_everything_freed(cache)


def test_evict_to_host_frees_device_keeps_host_then_host_eviction():
    cache = make_cache()
    insert_fresh(cache, [1, 2, 3, 4])
    insert_fresh(cache, [1, 2, 7, 8, 9])
    cache.check_hicache_events()
    assert cache.host_used_size() == 7
    evict_to_host(cache)
    assert cache.token_to_kv_pool_allocator.available_size() == POOL_SIZE
    assert cache.host_used_size() == 7 and cache.evictable_size() == 0
    m = cache.match_prefix([1, 2, 7, 8, 9])
    assert m.host_hit_length == 5 and len(m.device_indices) == 0

    # Host eviction: LRU host-only leaves first; [1,2,3,4] was touched least recently.
    assert cache.evict_host(1) == 2
    assert cache.host_used_size() == 5
    assert cache.match_prefix([1, 2, 3, 4]).host_hit_length == 2
    assert cache.match_prefix([1, 2, 7, 8, 9]).host_hit_length == 5
    assert_consistent(cache)
    assert_everything_freed(cache)


def test_device_eviction_is_lru_and_keeps_device_nodes_top_closed():
    cache = make_cache()
    insert_fresh(cache, [1, 2, 3, 4])
    insert_fresh(cache, [1, 2, 5, 6])
    cache.check_hicache_events()
    cache.match_prefix([1, 2, 5, 6])  # newer
    assert cache.evict(1) == 2  # the [3, 4] leaf goes to the host
    assert cache.match_prefix([1, 2, 3, 4]).host_hit_length == 2
    assert len(cache.match_prefix([1, 2, 5, 6]).device_indices) == 4
    # The shared parent leaves the device only after both children did.
    assert cache.evict(4) == 4
    m = cache.match_prefix([1, 2, 5, 6])
    assert m.host_hit_length == 4 and m.last_device_node is cache.root_node
    assert_consistent(cache)
    assert_everything_freed(cache)


# ---- load-back ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["MHA", "MLA"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_load_back_restores_the_original_kv(kind, layout):
    cache = make_cache(page_size=4, kind=kind, layout=layout)
    key = list(range(10, 26))  # 16 tokens, 4 pages
    slots = insert_fresh(cache, key)
    original = read_kv(cache, slots)
    evict_to_host(cache)
    for buf in pool_of(cache).buffers():
        buf.fill_(-1.0)  # the device copy is gone for good

    m = cache.match_prefix(key + [99])
    assert m.host_hit_length == 16
    loaded, last = cache.init_load_back(m.last_host_node, m.host_hit_length)
    assert len(loaded) == 16 and last is m.last_host_node and not last.evicted
    assert cache.loaded_back_tokens_total == 16
    assert cache.protected_size() == 16  # locked until the load's ack
    cache.ready_to_load_host_cache()
    for got, want in zip(read_kv(cache, loaded), original):
        assert torch.equal(got, want)
    cache.check_hicache_events()
    assert cache.protected_size() == 0 and cache.evictable_size() == 16
    # Back on the device, still backed up: a second eviction frees only device slots.
    m2 = cache.match_prefix(key)
    assert torch.equal(m2.device_indices, loaded) and m2.host_hit_length == 0
    assert last.backuped
    assert_consistent(cache)
    assert_everything_freed(cache)


def test_load_back_partial_chain_below_a_device_prefix():
    cache = make_cache()
    insert_fresh(cache, [1, 2, 3])
    insert_fresh(cache, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14])
    cache.check_hicache_events()
    cache.match_prefix([1, 2, 3])  # the shorter prefix is newer
    cache.evict(11)  # only the leaf past [1, 2, 3] goes
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14])
    assert len(m.device_indices) == 3 and m.host_hit_length == 11
    loaded, last = cache.init_load_back(m.last_host_node, m.host_hit_length)
    cache.ready_to_load_host_cache()
    assert len(loaded) == 11
    full = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]).device_indices
    for got, want in zip(read_kv(cache, full), kv_rows(cache, list(range(1, 15)))):
        assert torch.equal(got, want)
    cache.check_hicache_events()
    assert_consistent(cache)
    assert_everything_freed(cache)


def test_load_back_evicts_device_nodes_when_the_pool_is_full():
    cache = make_cache()
    a = list(range(100, 132))
    insert_fresh(cache, a)
    cache.check_hicache_events()
    evict_to_host(cache)
    insert_fresh(cache, list(range(200, 240)))  # 40 of the 64 device slots
    cache.check_hicache_events()
    m = cache.match_prefix(a)
    loaded, _ = cache.init_load_back(m.last_host_node, m.host_hit_length)
    cache.ready_to_load_host_cache()
    assert len(loaded) == 32  # the other prefix's node went to the host to make room
    assert cache.match_prefix(list(range(200, 240))).host_hit_length > 0
    for got, want in zip(read_kv(cache, loaded), kv_rows(cache, a)):
        assert torch.equal(got, want)
    cache.check_hicache_events()
    assert_consistent(cache)
    assert_everything_freed(cache)


def test_load_back_below_threshold_or_over_quota_is_skipped():
    cache = make_cache(load_back_threshold=10)
    insert_fresh(cache, [1, 2, 3, 4, 5])
    insert_fresh(cache, list(range(50, 70)))
    evict_to_host(cache)
    m = cache.match_prefix([1, 2, 3, 4, 5, 6])
    loaded, last = cache.init_load_back(m.last_host_node, m.host_hit_length)
    assert len(loaded) == 0 and last is cache.root_node  # 5 < 10: recompute instead
    m = cache.match_prefix(list(range(50, 70)))
    loaded, last = cache.init_load_back(m.last_host_node, m.host_hit_length, mem_quota=19)
    assert len(loaded) == 0 and last is cache.root_node  # all or nothing
    assert cache.loaded_back_tokens_total == 0 and cache.total_size() == 0
    assert_consistent(cache)
    assert_everything_freed(cache)


def test_recompute_after_host_eviction_matches_a_shorter_prefix():
    cache = make_cache()
    insert_fresh(cache, [1, 2, 3, 4])
    insert_fresh(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    evict_to_host(cache)
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).host_hit_length == 8
    cache.evict_host(4)  # the [5..8] leaf
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    assert m.host_hit_length == 4 and len(m.device_indices) == 0
    cache.evict_host(4)
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    assert m.host_hit_length == 0 and m.last_host_node is cache.root_node
    # A request recomputes it all and the tree is whole again.
    d = Driver(cache)
    d.run(FakeReq([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert len(cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).device_indices) == 8
    assert_consistent(cache)
    assert_everything_freed(cache)


# ---- pages -------------------------------------------------------------------------------


def test_hit_ending_mid_page_rounds_down():
    cache = make_cache(page_size=4)
    insert_fresh(cache, list(range(1, 13)))  # 3 pages
    m = cache.match_prefix(list(range(1, 11)) + [77, 78])  # 10 matching tokens
    assert len(m.device_indices) == 8
    evict_to_host(cache)
    m = cache.match_prefix(list(range(1, 11)) + [77, 78])
    assert m.host_hit_length == 8 and len(m.last_host_node.host_value) == 8
    assert m.last_host_node.children  # split at the page boundary, the rest stays below
    assert_consistent(cache)
    assert_everything_freed(cache)


def test_prefix_of_exactly_one_page():
    cache = make_cache(page_size=4, load_back_threshold=1)
    insert_fresh(cache, [5, 6, 7, 8])
    assert cache.host_used_size() == 4
    evict_to_host(cache)
    assert len(cache.match_prefix([5, 6, 7]).device_indices) == 0  # less than a page
    m = cache.match_prefix([5, 6, 7, 8, 9])
    assert m.host_hit_length == 4
    loaded, _ = cache.init_load_back(m.last_host_node, m.host_hit_length)
    cache.ready_to_load_host_cache()
    assert len(loaded) == 4
    for got, want in zip(read_kv(cache, loaded), kv_rows(cache, [5, 6, 7, 8])):
        assert torch.equal(got, want)
    cache.check_hicache_events()
    # With the default threshold (10 tokens) one page of 4 is recomputed instead.
    cache2 = make_cache(page_size=4)
    insert_fresh(cache2, [5, 6, 7, 8])
    evict_to_host(cache2)
    m = cache2.match_prefix([5, 6, 7, 8, 9])
    assert len(cache2.init_load_back(m.last_host_node, m.host_hit_length)[0]) == 0
    for c in (cache, cache2):
        assert_consistent(c)
        assert_everything_freed(c)


# ---- requests, chunked prefill, aborts -----------------------------------------------------


def test_requests_reuse_host_prefixes_with_page_size_and_chunks():
    cache = make_cache(page_size=4, load_back_threshold=1)
    d = Driver(cache)
    prompt = list(range(1, 31))
    d.run(FakeReq(prompt), chunk=8)  # chunked inserts are backed up too
    assert cache.host_used_size() >= 28
    evict_to_host(cache)
    r = d.run(FakeReq(prompt + [40, 41, 42, 43, 44]))
    assert r.loaded == 28
    assert_consistent(cache)
    assert_everything_freed(cache)


def test_chunked_prompt_ends_up_on_host_chunk_by_chunk():
    cache = make_cache(page_size=4)
    d = Driver(cache)
    req = FakeReq(list(range(1, 41)))
    d.admit(req)
    d.prefill(req, chunk=8, stop_after_chunks=3)
    assert cache.host_used_size() == 24  # every chunk's insert was written
    cache.check_hicache_events()
    d.prefill(req, chunk=8)
    d.cache.cache_finished_req(req)
    cache.check_hicache_events()
    assert cache.host_used_size() == 40
    assert_consistent(cache)
    assert_everything_freed(cache)


def test_abort_while_its_write_is_in_flight_neither_leaks_nor_double_frees():
    cache = make_cache(page_size=4)
    d = Driver(cache)
    req = FakeReq(list(range(1, 31)))
    d.admit(req)
    d.prefill(req, chunk=8, stop_after_chunks=2)  # two chunks inserted: writes issued, acks pending
    assert cache.cache_controller.ack_write_queue and cache.ongoing_write_through
    own = len(req.fill_ids) - len(req.prefix_indices) // 4 * 4
    assert_consistent(cache, own_device_tokens=-(-own // 4) * 4)
    d.abort_chunked(req)  # the request goes away before the acks are processed
    assert cache.protected_size() == 16  # still pinned by the in-flight writes
    assert cache.evict(POOL_SIZE) == 0
    cache.check_hicache_events()
    assert cache.protected_size() == 0 and not cache.ongoing_write_through
    assert_consistent(cache)

    # Same through the controller directly: write, free the node's request, then ack.
    insert_fresh(cache, [90, 91, 92, 93])
    cache.check_hicache_events()
    node = cache.match_prefix([90, 91, 92, 93]).last_device_node
    cache.evict(POOL_SIZE)  # everything to host
    loaded, _ = cache.init_load_back(node, 4)  # threshold 10 > 4: skipped
    assert len(loaded) == 0
    slots = cache.token_to_kv_pool_allocator.alloc(4)
    host = cache.cache_controller.write(slots, node_id=-1)
    cache.token_to_kv_pool_allocator.free(slots)  # aborted: the request's slots are freed
    cache.mem_pool_host.free(host)  # and the host copy nobody will own
    cache.check_hicache_events()  # the ack of an unknown node id is ignored
    assert_consistent(cache)
    assert_everything_freed(cache)


def test_finish_while_write_in_flight_then_eviction():
    cache = make_cache()
    d = Driver(cache)
    req = FakeReq(list(range(1, 11)))
    d.admit(req)
    d.prefill(req)
    d.decode(req, 3)
    cache.cache_finished_req(req)  # writes the whole sequence; ack not processed yet
    # 10 prompt + 4 output tokens, the last without KV: 13 tokens written, locked until the ack.
    assert cache.protected_size() == 13 and cache.evict(POOL_SIZE) == 0
    cache.check_hicache_events()
    assert cache.evict(POOL_SIZE) == 13
    assert cache.match_prefix(list(range(1, 11))).host_hit_length == 10
    assert_consistent(cache)
    assert_everything_freed(cache)


# ---- write policies ----------------------------------------------------------------------


def test_write_through_selective_backs_up_on_the_second_hit():
    cache = make_cache(policy="write_through_selective")
    d = Driver(cache)
    prompt = list(range(1, 9))
    d.run(FakeReq(prompt + [20]))
    assert cache.host_used_size() == 0  # one request: no backup
    assert cache.backed_up_tokens_total == 0
    # A second request through the same prefix: its nodes reach 2 hits and are written.
    d.run(FakeReq(prompt + [30]))
    shared = cache.match_prefix(prompt).last_device_node
    assert shared.backuped and shared.hit_count == 2
    assert cache.host_used_size() == 8
    # Unbacked leaves are deleted by device eviction; the backed-up prefix goes to host.
    evict_to_host(cache)
    assert cache.match_prefix(prompt + [20]).host_hit_length == 8
    assert_consistent(cache)
    assert_everything_freed(cache)


def test_write_through_selective_ignores_chunk_reinserts():
    cache = make_cache(policy="write_through_selective")
    d = Driver(cache)
    d.run(FakeReq(list(range(1, 33))), chunk=4)  # 8 chunks re-walk the same nodes
    assert cache.host_used_size() == 0


def test_write_back_writes_only_on_eviction():
    cache = make_cache(policy="write_back")
    d = Driver(cache)
    prompt = list(range(1, 13))
    d.run(FakeReq(prompt + [50]))
    d.run(FakeReq(prompt + [60]))
    assert cache.host_used_size() == 0 and cache.protected_size() == 0
    device_total = cache.total_size()
    assert cache.evict(device_total) == device_total  # written on the way out, no lock
    assert cache.host_used_size() == device_total == cache.backed_up_tokens_total
    for buf in pool_of(cache).buffers():
        buf.fill_(-1.0)
    r = d.run(FakeReq(prompt + [50, 51]))
    assert r.loaded == 13  # the prompt and token 50 come back from the host
    for got, want in zip(read_kv(cache, cache.match_prefix(prompt + [50]).device_indices),
                         kv_rows(cache, prompt + [50])):
        assert torch.equal(got, want)
    assert_consistent(cache)
    assert_everything_freed(cache)


def test_write_through_deletes_unbacked_leaves_when_host_is_full():
    # Host pool of 2 x 8 = 16 slots; a 40-token sequence cannot be fully backed up.
    cache = make_cache(ratio=0.25)
    assert cache.host_total_size() == 16
    d = Driver(cache)
    d.run(FakeReq(list(range(1, 41))), chunk=8)
    assert cache.host_used_size() <= 16
    evict_to_host(cache)
    m = cache.match_prefix(list(range(1, 41)))
    assert 0 < m.host_hit_length <= 16
    assert_consistent(cache)
    assert_everything_freed(cache)


def test_reset_frees_both_tiers():
    cache = make_cache(page_size=2)
    d = Driver(cache)
    for i in range(4):
        d.run(FakeReq([1, 2, 3, 4] + list(range(10 * i, 10 * i + 9))))
    evict_to_host(cache)
    d.run(FakeReq([1, 2, 3, 4, 5, 6]))
    assert cache.host_used_size() > 0
    cache.reset()
    cache.token_to_kv_pool_allocator.clear()
    assert cache.mem_pool_host.available_size() == cache.host_total_size()
    assert cache.total_size() == 0 and not cache.root_node.children
    assert not cache.cache_controller.has_pending()
    assert_everything_freed(cache)


# ---- CUDA: streams, events, per-layer waits ---------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout,io_backend", [("layer_first", "direct"), ("page_first", "kernel")])
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
@pytest.mark.parametrize("kind", ["MHA", "MLA"])
def test_cuda_write_evict_load_back_round_trip(policy, kind, layout, io_backend):
    cache = make_cache(page_size=4, policy=policy, kind=kind, layout=layout, device="cuda",
                       io_backend=io_backend)
    ctrl = cache.cache_controller
    assert ctrl.is_cuda and pool_of(cache).layer_transfer_counter is ctrl.layer_counter
    key = list(range(10, 42))  # 8 pages
    slots = insert_fresh(cache, key)  # KV written on the compute stream, then (write_through) backed up
    original = read_kv(cache, slots)
    torch.cuda.synchronize()
    cache.check_hicache_events()
    assert cache.protected_size() == 0 and not ctrl.ack_write_queue
    evict_to_host(cache)  # write_back: written here, compute stream ordered after the copy
    for buf in pool_of(cache).buffers():
        buf.fill_(-1.0)  # reuses the freed slots: must not reach the host copy
    m = cache.match_prefix(key + [1])
    assert m.host_hit_length == 32
    loaded, _ = cache.init_load_back(m.last_host_node, m.host_hit_length)
    assert cache.ready_to_load_host_cache() > 0
    # Attention reads layer by layer through the accessors, which wait on each layer's event.
    pool = pool_of(cache)
    got = []
    for layer in range(LAYERS):
        if kind == "MHA":
            got += [pool.get_key_buffer(layer)[loaded].clone(), pool.get_value_buffer(layer)[loaded].clone()]
        else:
            got.append(pool.get_key_buffer(layer)[loaded].clone())
    want = original if kind == "MLA" else [original[i] for l in range(LAYERS) for i in (l, LAYERS + l)]
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    torch.cuda.synchronize()
    cache.check_hicache_events()
    assert cache.protected_size() == 0 and ctrl.layer_counter._events is None
    assert_consistent(cache)
    assert_everything_freed(cache)


# ---- through the real scheduler ----------------------------------------------------------


def _drive(sched) -> dict:
    from hiserve.engine.io_struct import BatchTokenIDOut

    steps = 0
    while sched.waiting_queue or sched.running or sched.chunked_req:
        sched.step()
        steps += 1
        assert steps < 3000, "scheduler did not converge"
    outs = {}
    for msg in sched.outbox:
        if isinstance(msg, BatchTokenIDOut):
            for rid, ids, fin, host in zip(msg.rids, msg.new_output_ids, msg.finished_reasons,
                                           msg.cached_tokens_host):
                prev = outs.get(rid, ([], None, 0))[0]
                outs[rid] = (prev + ids, fin, host)
    sched.outbox.clear()
    return outs


def _multi_turn(sched, turns: int, max_new: int, conversations: int) -> dict:
    """Conversations in turns; turn t+1 = turn t's prompt + its answer + a follow-up question.

    All but the last turn run one request at a time, so older conversations are the least
    recently used when a newer one needs room; the last turn runs all at once (batched
    load-backs, and retraction when they do not fit).
    """
    from hiserve.engine.io_struct import TokenizedGenerateReqInput
    from hiserve.engine.sampling_params import SamplingParams

    questions = ["What is the capital of France?", "Write one sentence about the sea.",
                 "List three prime numbers.", "Why is the sky blue? Answer briefly."]
    tok = sched.tokenizer
    prompts = []
    for q in questions[:conversations]:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                      tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    follow_up = list(tok.encode(" Tell me more, please."))
    outs = {}
    for t in range(turns):
        for i, p in enumerate(prompts):
            sp = SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True)
            sched.add_request(TokenizedGenerateReqInput(rid=f"c{i}t{t}", input_ids=p, sampling_params=sp))
            if t < turns - 1:
                outs.update(_drive(sched))
        outs.update(_drive(sched))
        for i in range(len(prompts)):
            prompts[i] = prompts[i] + outs[f"c{i}t{t}"][0] + follow_up
    return outs


def test_scheduler_multi_turn_with_host_tier_matches_plain_cache():
    from hiserve.engine.scheduler import Scheduler
    from hiserve.server_args import ServerArgs

    # 96 device slots hold about two conversations: the third pushes the oldest to the host.
    def make(**kw):
        return Scheduler(ServerArgs(dtype="float32", device="cpu", max_total_tokens=96, page_size=4,
                                    **kw).resolve(), None)

    plain = make()
    expected = _multi_turn(plain, turns=3, max_new=4, conversations=3)
    assert plain.flush_cache()

    sched = make(enable_hierarchical_cache=True)
    assert isinstance(sched.tree_cache, HiRadixCache)
    got = _multi_turn(sched, turns=3, max_new=4, conversations=3)
    assert {rid: v[0] for rid, v in got.items()} == {rid: v[0] for rid, v in expected.items()}
    stats = sched._update_stats()
    assert stats.backed_up_tokens_total > 0 and stats.loaded_back_tokens_total > 0
    assert stats.hicache_host_total_tokens == sched.model_runner.host_pool.size
    assert 0 < stats.hicache_host_used_tokens <= stats.hicache_host_total_tokens
    # Later turns were served from the host tier; the plain cache never reports host tokens.
    host_served = {rid: v[2] for rid, v in got.items() if v[2] > 0}
    assert host_served and all(not rid.endswith("t0") for rid in host_served)
    assert all(v[2] == 0 for v in expected.values())

    assert sched.tree_cache.protected_size() == 0
    assert sched.flush_cache()
    assert sched.allocator.available_size() == sched.max_total_num_tokens
    assert sched.model_runner.host_pool.available_size() == sched.model_runner.host_pool.size
    assert sched.req_to_token_pool.available_size() == sched.model_runner.max_running_requests
    assert sched._update_stats().hicache_host_used_tokens == 0
