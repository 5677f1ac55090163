"""HiRadixCache + HiCacheController on real CPU pools: tree-level states, splits, eviction and
load-back, and requests driven through the KV manager (cache_driver.Driver).

The cache tests use a small MHA/MLA device pool whose KV rows are filled with values that
encode (token, layer), so a load-back can be checked by comparing device pool contents.
On the CPU every transfer completes synchronously, but acks still go through the
controller's queues until `poll()`. Writes in flight on a real device are simulated in
test_kv_manager.py.
"""

from __future__ import annotations

import pytest
import torch

from hiradix_helpers import (
    POOL_SIZE,
    make_kv,
    pool_of,
    kv_rows,
    read_kv,
    insert_fresh,
    evict,
    assert_consistent,
    assert_everything_freed,
    evict_to_host,
    FakeReq,
    HiDriver,
)


# ---- insert, split, states --------------------------------------------------------------


def test_write_through_backs_up_on_insert_without_locking():
    kv = make_kv()
    cache = kv.prefix_cache
    slots = insert_fresh(kv, [1, 2, 3, 4, 5])
    node = cache.match([1, 2, 3, 4, 5]).handle._node
    assert node.backuped and not node.evicted
    assert cache.host_used_size() == 5 and cache.backed_up_tokens_total == 5
    # A write takes no lock (it used to pin the node until its ack): the node is evictable
    # while its ack is still queued. On the CPU the copy is already complete, so eviction
    # frees the device slots at once instead of parking them on the pending list.
    assert cache.cache_controller.ack_write_queue
    assert cache.protected_size() == 0 and cache.evictable_size() == 5
    assert_consistent(kv)
    freed = evict(kv, 5)
    assert torch.equal(freed, slots) and cache.pending_slots() == 0
    assert node.evicted and node.backuped
    kv.poll()
    assert not cache.cache_controller.ack_write_queue
    assert cache.match([1, 2, 3, 4, 5]).host_hit_length == 5
    assert_consistent(kv)
    assert_everything_freed(kv)


def test_split_of_backed_up_and_host_only_nodes_splits_host_value():
    kv = make_kv()
    cache = kv.prefix_cache
    insert_fresh(kv, [1, 2, 3, 4, 5, 6])
    kv.poll()
    whole = cache.match([1, 2, 3, 4, 5, 6]).handle._node
    value, host_value = whole.value.clone(), whole.host_value.clone()
    upper = cache.match([1, 2, 9]).handle._node  # splits after 2 tokens
    assert upper is whole.parent
    assert torch.equal(upper.value, value[:2]) and torch.equal(whole.value, value[2:])
    assert torch.equal(upper.host_value, host_value[:2]) and torch.equal(whole.host_value, host_value[2:])

    # A host-only node splits the same way, keeping both halves host-only.
    evict_to_host(kv)
    m = cache.match([1, 2, 3, 4, 7])
    assert m.host_hit_length == 4 and len(m.device_indices) == 0
    assert m.handle._node is cache.root_node and m.host_handle.cached_len == 4
    mid = m.host_handle._node
    assert mid.evicted and torch.equal(mid.host_value, host_value[2:4])
    (low,) = mid.children.values()
    assert low.evicted and torch.equal(low.host_value, host_value[4:])
    assert_consistent(kv)
    assert_everything_freed(kv)


def test_evict_to_host_frees_device_keeps_host_then_host_eviction():
    kv = make_kv()
    cache = kv.prefix_cache
    insert_fresh(kv, [1, 2, 3, 4])
    insert_fresh(kv, [1, 2, 7, 8, 9])
    kv.poll()
    assert cache.host_used_size() == 7
    evict_to_host(kv)
    assert kv.allocator.available_size() == POOL_SIZE
    assert cache.host_used_size() == 7 and cache.evictable_size() == 0
    m = cache.match([1, 2, 7, 8, 9])
    assert m.host_hit_length == 5 and len(m.device_indices) == 0

    # Host eviction: LRU host-only leaves first; [1,2,3,4] was touched least recently.
    assert cache.evict_host(1) == 2
    assert cache.host_used_size() == 5
    assert cache.match([1, 2, 3, 4]).host_hit_length == 2
    assert cache.match([1, 2, 7, 8, 9]).host_hit_length == 5
    assert_consistent(kv)
    assert_everything_freed(kv)


def test_device_eviction_is_lru_and_keeps_device_nodes_top_closed():
    kv = make_kv()
    cache = kv.prefix_cache
    insert_fresh(kv, [1, 2, 3, 4])
    insert_fresh(kv, [1, 2, 5, 6])
    kv.poll()
    cache.match([1, 2, 5, 6])  # newer
    assert len(evict(kv, 1)) == 2  # the [3, 4] leaf goes to the host
    assert cache.match([1, 2, 3, 4]).host_hit_length == 2
    assert len(cache.match([1, 2, 5, 6]).device_indices) == 4
    kv.check_integrity()
    # The shared parent leaves the device only after both children did.
    assert len(evict(kv, 4)) == 4
    m = cache.match([1, 2, 5, 6])
    assert m.host_hit_length == 4 and m.handle._node is cache.root_node
    assert_consistent(kv)
    assert_everything_freed(kv)


# ---- load-back (tree level: the caller allocates the slots) ------------------------------


@pytest.mark.parametrize("kind", ["MHA", "MLA"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_load_back_restores_the_original_kv(kind, layout):
    kv = make_kv(page_size=4, kind=kind, layout=layout)
    cache = kv.prefix_cache
    key = list(range(10, 26))  # 16 tokens, 4 pages
    slots = insert_fresh(kv, key)
    original = read_kv(kv, slots)
    evict_to_host(kv)
    for buf in pool_of(kv).buffers():
        buf.fill_(-1.0)  # the device copy is gone for good

    m = cache.match(key + [99])
    assert m.host_hit_length == 16 and m.host_handle.cached_len == 16
    loaded = kv.allocator.alloc(16)
    with cache.pinned(m.host_handle):
        assert m.host_handle._node.host_ref == 1
    cache.load_back(m.host_handle, loaded)
    last = m.host_handle._node
    assert not last.evicted and torch.equal(last.value, loaded[-len(last.value):])
    assert cache.loaded_back_tokens_total == 16
    assert cache.protected_size() == 16  # locked until the load's ack
    kv.check_integrity()
    ticket = kv.start_loads()
    assert ticket is not None and ticket.layer_events is None  # CPU: complete already
    assert kv.start_loads() is None  # nothing left queued
    for got, want in zip(read_kv(kv, loaded), original):
        assert torch.equal(got, want)
    kv.poll()
    assert cache.protected_size() == 0 and cache.evictable_size() == 16
    # Back on the device, still backed up: a second eviction frees only device slots.
    m2 = cache.match(key)
    assert torch.equal(m2.device_indices, loaded) and m2.host_hit_length == 0
    assert last.backuped
    assert_consistent(kv)
    assert_everything_freed(kv)


def test_load_back_partial_chain_below_a_device_prefix():
    kv = make_kv()
    cache = kv.prefix_cache
    insert_fresh(kv, [1, 2, 3])
    insert_fresh(kv, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14])
    kv.poll()
    cache.match([1, 2, 3])  # the shorter prefix is newer
    evict(kv, 11)  # only the leaf past [1, 2, 3] goes
    m = cache.match([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14])
    assert len(m.device_indices) == 3 and m.host_hit_length == 11
    loaded = kv.allocator.alloc(11)
    cache.load_back(m.host_handle, loaded)
    kv.start_loads()
    full = cache.match([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]).device_indices
    assert torch.equal(full[3:], loaded)
    for got, want in zip(read_kv(kv, full), kv_rows(kv, list(range(1, 15)))):
        assert torch.equal(got, want)
    kv.poll()
    assert_consistent(kv)
    assert_everything_freed(kv)


def test_load_back_evicts_device_nodes_when_the_pool_is_full():
    kv = make_kv()
    cache = kv.prefix_cache
    a = list(range(100, 132))
    insert_fresh(kv, a)
    kv.poll()
    evict_to_host(kv)
    insert_fresh(kv, list(range(200, 240)))  # 40 of the 64 device slots
    kv.poll()
    # The manager allocates the load-back's slots at admission, evicting what it must.
    d = HiDriver(kv)
    r = FakeReq(a + [999])
    d.admit(r)
    assert r.loaded == 32  # the other prefix's node went to the host to make room
    assert cache.match(list(range(200, 240))).host_hit_length > 0
    for got, want in zip(read_kv(kv, d.prefix(r)), kv_rows(kv, a)):
        assert torch.equal(got, want)
    d.prefill(r)
    d.finish(r)
    assert_consistent(kv)
    assert_everything_freed(kv)


def test_load_back_below_threshold_or_without_room_is_skipped():
    kv = make_kv(load_back_threshold=10)
    cache = kv.prefix_cache
    d = HiDriver(kv)
    insert_fresh(kv, [1, 2, 3, 4, 5])
    insert_fresh(kv, list(range(50, 70)))
    evict_to_host(kv)
    r = FakeReq([1, 2, 3, 4, 5, 6])
    d.admit(r)  # 5 < 10: recompute instead
    assert r.loaded == 0 and r.kv.prefix_len == 0 and r.kv.handle._node is cache.root_node
    d.abort_chunked(r)
    # No device room even after evicting (a running request locks it): all or nothing.
    q = FakeReq(list(range(100, 150)))
    d.admit(q)
    d.prefill(q)  # 50 tokens cached and locked by q, 14 slots free
    total = cache.total_size()
    r = FakeReq(list(range(50, 70)) + [1])
    d.admit(r)
    assert r.loaded == 0 and r.kv.prefix_len == 0
    assert cache.match(list(range(50, 70))).host_hit_length == 20  # still host-only
    assert cache.loaded_back_tokens_total == 0 and cache.total_size() == total
    d.abort_chunked(r)
    d.finish(q)
    assert_consistent(kv)
    assert_everything_freed(kv)


def test_recompute_after_host_eviction_matches_a_shorter_prefix():
    kv = make_kv()
    cache = kv.prefix_cache
    insert_fresh(kv, [1, 2, 3, 4])
    insert_fresh(kv, [1, 2, 3, 4, 5, 6, 7, 8])
    evict_to_host(kv)
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8]).host_hit_length == 8
    cache.evict_host(4)  # the [5..8] leaf
    m = cache.match([1, 2, 3, 4, 5, 6, 7, 8])
    assert m.host_hit_length == 4 and len(m.device_indices) == 0
    cache.evict_host(4)
    m = cache.match([1, 2, 3, 4, 5, 6, 7, 8])
    assert m.host_hit_length == 0 and m.host_handle._node is cache.root_node
    # A request recomputes it all and the tree is whole again.
    d = HiDriver(kv)
    d.run(FakeReq([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert len(cache.match([1, 2, 3, 4, 5, 6, 7, 8]).device_indices) == 8
    assert_consistent(kv)
    assert_everything_freed(kv)


# ---- pages -------------------------------------------------------------------------------


def test_hit_ending_mid_page_rounds_down():
    kv = make_kv(page_size=4)
    cache = kv.prefix_cache
    insert_fresh(kv, list(range(1, 13)))  # 3 pages
    m = cache.match(list(range(1, 11)) + [77, 78])  # 10 matching tokens
    assert len(m.device_indices) == 8
    evict_to_host(kv)
    m = cache.match(list(range(1, 11)) + [77, 78])
    assert m.host_hit_length == 8 and len(m.host_handle._node.host_value) == 8
    assert m.host_handle._node.children  # split at the page boundary, the rest stays below
    assert_consistent(kv)
    assert_everything_freed(kv)


def test_prefix_of_exactly_one_page():
    kv = make_kv(page_size=4, load_back_threshold=1)
    cache = kv.prefix_cache
    insert_fresh(kv, [5, 6, 7, 8])
    assert cache.host_used_size() == 4
    evict_to_host(kv)
    assert len(cache.match([5, 6, 7]).device_indices) == 0  # less than a page
    d = HiDriver(kv)
    r = FakeReq([5, 6, 7, 8, 9])
    d.admit(r)
    assert r.loaded == 4
    for got, want in zip(read_kv(kv, d.prefix(r)), kv_rows(kv, [5, 6, 7, 8])):
        assert torch.equal(got, want)
    d.abort_chunked(r)
    kv.poll()
    # With the default threshold (10 tokens) one page of 4 is recomputed instead.
    kv2 = make_kv(page_size=4)
    insert_fresh(kv2, [5, 6, 7, 8])
    evict_to_host(kv2)
    d2 = HiDriver(kv2)
    r2 = FakeReq([5, 6, 7, 8, 9])
    r2.fill_ids = list(r2.origin_input_ids)
    assert kv2.match(r2).host_hit_length == 4 and kv2.loadable_len(r2) == 0
    r2.kv.match = None
    d2.admit(r2)
    assert r2.loaded == 0 and kv2.prefix_cache.loaded_back_tokens_total == 0
    d2.abort_chunked(r2)
    for k in (kv, kv2):
        assert_consistent(k)
        assert_everything_freed(k)


# ---- requests, chunked prefill, aborts -----------------------------------------------------


def test_requests_reuse_host_prefixes_with_page_size_and_chunks():
    kv = make_kv(page_size=4, load_back_threshold=1)
    cache = kv.prefix_cache
    d = HiDriver(kv)
    prompt = list(range(1, 31))
    d.run(FakeReq(prompt), chunk=8)  # chunked inserts are backed up too
    assert cache.host_used_size() >= 28
    evict_to_host(kv)
    r = d.run(FakeReq(prompt + [40, 41, 42, 43, 44]))
    assert r.loaded == 28 and r.kv.cached_tokens_host == 28
    assert_consistent(kv)
    assert_everything_freed(kv)


def test_chunked_prompt_ends_up_on_host_chunk_by_chunk():
    kv = make_kv(page_size=4)
    cache = kv.prefix_cache
    d = HiDriver(kv)
    req = FakeReq(list(range(1, 41)))
    d.admit(req)
    d.prefill(req, chunk=8, stop_after_chunks=3)
    assert cache.host_used_size() == 24  # every chunk's insert was written
    kv.poll()
    d.prefill(req, chunk=8)
    d.finish(req)
    assert cache.host_used_size() == 40
    assert_consistent(kv)
    assert_everything_freed(kv)


def test_abort_while_its_write_is_in_flight_neither_leaks_nor_double_frees():
    kv = make_kv(page_size=4)
    cache = kv.prefix_cache
    ctrl = cache.cache_controller
    d = HiDriver(kv)
    req = FakeReq(list(range(1, 31)))
    d.admit(req)
    d.prefill(req, chunk=8, stop_after_chunks=2)  # two chunks inserted: writes issued, acks pending
    assert ctrl.ack_write_queue and cache._writing
    own = req.kv.kv_len - req.kv.cache_len
    assert_consistent(kv, own_device_tokens=-(-own // 4) * 4)
    d.abort_chunked(req)  # the request goes away before the acks are processed
    # The writes lock nothing (they used to pin the 16 cached tokens until their acks):
    # the aborted prompt's cached pages are evictable at once, and with the copy complete
    # (CPU) they are freed, not parked.
    assert cache.protected_size() == 0 and cache.evictable_size() == 16
    assert len(evict(kv, POOL_SIZE)) == 16 and cache.pending_slots() == 0
    kv.poll()
    assert not ctrl.ack_write_queue and not cache._writing
    assert cache.match(list(range(1, 17))).host_hit_length == 16
    assert_consistent(kv)

    # Same through the controller directly: write, free the node's request, then ack.
    insert_fresh(kv, [90, 91, 92, 93])
    kv.poll()
    evict(kv, POOL_SIZE)  # everything to host
    r = FakeReq([90, 91, 92, 93, 94])
    r.fill_ids = list(r.origin_input_ids)
    assert kv.match(r).host_hit_length == 4 and kv.loadable_len(r) == 0  # threshold 10 > 4
    r.kv.match = None
    slots = kv.allocator.alloc(4)
    host, _ = ctrl.write(slots, node_id=-1)
    kv.allocator.free(slots)  # aborted: the request's slots are freed
    cache.mem_pool_host.free(host)  # and the host copy nobody will own
    kv.poll()  # the ack of an unknown node id is ignored
    assert_consistent(kv)
    assert_everything_freed(kv)


def test_finish_while_write_in_flight_then_eviction():
    kv = make_kv()
    cache = kv.prefix_cache
    d = HiDriver(kv)
    req = FakeReq(list(range(1, 11)))
    d.admit(req)
    d.prefill(req)
    d.decode(req, 3)
    kv.cache(req, finished=True)  # writes the whole sequence; ack not processed yet
    assert cache.cache_controller.ack_write_queue
    kv.check_integrity()
    # 10 prompt + 4 output tokens, the last without KV: 13 tokens written. No lock waits for
    # the ack any more (it used to protect all 13): on the CPU the copy is complete, so
    # eviction frees them at once.
    assert cache.protected_size() == 0 and cache.evictable_size() == 13
    assert cache.host_used_size() == 13
    assert len(evict(kv, POOL_SIZE)) == 13 and cache.pending_slots() == 0
    kv.poll()
    assert cache.match(list(range(1, 11))).host_hit_length == 10
    assert_consistent(kv)
    assert_everything_freed(kv)


# ---- write policies ----------------------------------------------------------------------


def test_write_through_selective_backs_up_on_the_second_hit():
    kv = make_kv(policy="write_through_selective")
    cache = kv.prefix_cache
    d = HiDriver(kv)
    prompt = list(range(1, 9))
    d.run(FakeReq(prompt + [20]))
    assert cache.host_used_size() == 0  # one request: no backup
    assert cache.backed_up_tokens_total == 0
    # A second request through the same prefix: its nodes reach 2 hits and are written.
    d.run(FakeReq(prompt + [30]))
    shared = cache.match(prompt).handle._node
    assert shared.backuped and shared.hit_count == 2
    assert cache.host_used_size() == 8
    # Unbacked leaves are deleted by device eviction; the backed-up prefix goes to host.
    evict_to_host(kv)
    assert cache.match(prompt + [20]).host_hit_length == 8
    assert_consistent(kv)
    assert_everything_freed(kv)


def test_write_through_selective_ignores_chunk_reinserts():
    kv = make_kv(policy="write_through_selective")
    d = HiDriver(kv)
    d.run(FakeReq(list(range(1, 33))), chunk=4)  # 8 chunks re-walk the same nodes
    assert kv.prefix_cache.host_used_size() == 0
    assert_consistent(kv)
    assert_everything_freed(kv)


def test_write_back_writes_only_on_eviction():
    kv = make_kv(policy="write_back")
    cache = kv.prefix_cache
    d = HiDriver(kv)
    prompt = list(range(1, 13))
    d.run(FakeReq(prompt + [50]))
    d.run(FakeReq(prompt + [60]))
    assert cache.host_used_size() == 0 and cache.protected_size() == 0
    device_total = cache.total_size()
    assert len(evict(kv, device_total)) == device_total  # written on the way out, no lock
    assert cache.host_used_size() == device_total == cache.backed_up_tokens_total
    kv.check_integrity()
    for buf in pool_of(kv).buffers():
        buf.fill_(-1.0)
    r = FakeReq(prompt + [50, 51])
    d.admit(r)
    assert r.loaded == 13  # the prompt and token 50 come back from the host
    for got, want in zip(read_kv(kv, cache.match(prompt + [50]).device_indices),
                         kv_rows(kv, prompt + [50])):
        assert torch.equal(got, want)
    d.prefill(r)
    d.decode(r, 2)
    d.finish(r)
    assert_consistent(kv)
    assert_everything_freed(kv)


def test_write_through_deletes_unbacked_leaves_when_host_is_full():
    # Host pool of 2 x 8 = 16 slots; a 40-token sequence cannot be fully backed up.
    kv = make_kv(ratio=0.25)
    cache = kv.prefix_cache
    assert cache.host_total_size() == 16
    d = HiDriver(kv)
    d.run(FakeReq(list(range(1, 41))), chunk=8)
    assert cache.host_used_size() <= 16
    evict_to_host(kv)
    m = cache.match(list(range(1, 41)))
    assert 0 < m.host_hit_length <= 16
    assert_consistent(kv)
    assert_everything_freed(kv)


def test_flush_cache_frees_both_tiers():
    kv = make_kv(page_size=2)
    cache = kv.prefix_cache
    d = HiDriver(kv)
    for i in range(4):
        d.run(FakeReq([1, 2, 3, 4] + list(range(10 * i, 10 * i + 9))))
    evict_to_host(kv)
    running = FakeReq([1, 2, 3, 4, 5, 6])
    d.admit(running)
    assert not kv.flush_cache()  # a request holds KV: nothing is dropped
    assert cache.host_used_size() > 0
    d.prefill(running)
    d.finish(running)
    assert cache.host_used_size() > 0
    assert kv.flush_cache()
    assert cache.mem_pool_host.available_size() == cache.host_total_size()
    assert kv.allocator.available_size() == POOL_SIZE
    assert cache.total_size() == 0 and not cache.root_node.children
    assert not cache.cache_controller.has_pending()
    assert_consistent(kv)
    assert_everything_freed(kv)
