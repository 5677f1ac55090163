"""HiRadixCache + HiCacheController on real CPU pools, and the Scheduler with the host tier.

The cache tests use a small MHA/MLA device pool whose KV rows are filled with values that
encode (token, layer), so a load-back can be checked by comparing device pool contents.
On the CPU every transfer completes synchronously, but acks still go through the
controller's queues: the tests hold ack processing back to see the in-flight states.
"""

from __future__ import annotations

import pytest
import torch

from hiradix_helpers import (
    POOL_SIZE,
    make_cache,
    pool_of,
    kv_rows,
    read_kv,
    insert_fresh,
    assert_consistent,
    assert_everything_freed,
    evict_to_host,
    FakeReq,
    HiDriver,
)


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
    d = HiDriver(cache)
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
    d = HiDriver(cache)
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
    d = HiDriver(cache)
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
    d = HiDriver(cache)
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
    d = HiDriver(cache)
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
    d = HiDriver(cache)
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
    d = HiDriver(cache)
    d.run(FakeReq(list(range(1, 33))), chunk=4)  # 8 chunks re-walk the same nodes
    assert cache.host_used_size() == 0


def test_write_back_writes_only_on_eviction():
    cache = make_cache(policy="write_back")
    d = HiDriver(cache)
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
    d = HiDriver(cache)
    d.run(FakeReq(list(range(1, 41))), chunk=8)
    assert cache.host_used_size() <= 16
    evict_to_host(cache)
    m = cache.match_prefix(list(range(1, 41)))
    assert 0 < m.host_hit_length <= 16
    assert_consistent(cache)
    assert_everything_freed(cache)


def test_reset_frees_both_tiers():
    cache = make_cache(page_size=2)
    d = HiDriver(cache)
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
