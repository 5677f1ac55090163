"""RadixCache and ChunkCache on real CPU pools: match/insert, splits, alignment, locks,
eviction (tree level), and requests driven through the KV manager (cache_driver.Driver)."""

from __future__ import annotations

import pytest
import torch

from hiserve.mem_cache.hierarchy import KVSpec, build_kv_hierarchy
from hiserve.mem_cache.kv_manager import KVManager
from hiserve.mem_cache.prefix_cache import ChunkCache
from hiserve.mem_cache.radix_cache import RadixCache, TreeNode

from cache_driver import Driver, FakeReq

POOL_SIZE = 256


def make_kv(page_size: int, disable: bool = False) -> KVManager:
    spec = KVSpec(num_tokens=POOL_SIZE, page_size=page_size, dtype=torch.float32,
                  device=torch.device("cpu"), layer_num=1, num_kv_heads=1, head_dim=1,
                  max_running_requests=8, max_context_len=128, disable_radix_cache=disable)
    kv = KVManager(build_kv_hierarchy(spec))
    assert isinstance(kv.prefix_cache, ChunkCache if disable else RadixCache)
    return kv


def insert_fresh(kv: KVManager, key: list[int]) -> torch.Tensor:
    """Allocate slots for `key` and insert them; the tree owns the new part, the duplicates
    go back to the allocator (the tree never frees)."""
    slots = kv.allocator.alloc(len(key))
    res = kv.prefix_cache.insert(key, slots)
    assert res.handle.cached_len == len(key)
    kv.allocator.free(slots[:res.cached_len])
    return slots


def evict(kv: KVManager, num_tokens: int) -> torch.Tensor:
    """Tree eviction; the caller frees what it returns."""
    freed = kv.prefix_cache.evict(num_tokens)
    kv.allocator.free(freed)
    return freed


def node_of(cache: RadixCache, key: list[int]) -> TreeNode:
    return cache.match(key).handle._node


def assert_no_leak(kv: KVManager, running: list[FakeReq] = ()) -> None:
    """Every page is exactly one of: free, in the tree, or owned by a running request."""
    P = kv.page_size
    cache = kv.prefix_cache
    own_pages = sum(-(-(r.kv.kv_len - r.kv.cache_len) // P) for r in running)
    assert cache.evictable_size() + cache.protected_size() == cache.total_size()
    assert kv.allocator.available_size() + cache.total_size() + own_pages * P == POOL_SIZE
    kv.check_integrity()


def assert_all_released(kv: KVManager) -> None:
    """After all requests finished: nothing locked, evicting everything returns every page."""
    cache = kv.prefix_cache
    assert cache.protected_size() == 0
    assert cache.evictable_size() == cache.total_size()
    assert kv.rtt.available_size() == kv.rtt.size
    kv.check_integrity()
    total = cache.total_size()
    assert len(evict(kv, total)) == total
    assert cache.total_size() == 0 and cache.evictable_size() == 0
    assert kv.allocator.available_size() == POOL_SIZE
    cache.reset()
    assert cache.total_size() == 0 and not cache.root_node.children
    kv.check_integrity()
    # No page was freed twice: allocating everything yields each real slot once.
    slots = kv.allocator.alloc(POOL_SIZE)
    assert sorted(slots.tolist()) == list(range(kv.page_size, kv.page_size + POOL_SIZE))
    kv.allocator.clear()


# ---- match / insert --------------------------------------------------------------------


def test_insert_and_match_page_size_1():
    kv = make_kv(1)
    cache = kv.prefix_cache
    slots = insert_fresh(kv, [1, 2, 3, 4])
    assert slots.device.type == "cpu" and slots.dtype == torch.int64
    assert cache.total_size() == 4 and cache.evictable_size() == 4

    m = cache.match([1, 2, 3, 4, 5])
    assert torch.equal(m.device_indices, slots) and m.device_len == 4
    assert m.host_handle is m.handle and m.host_hit_length == 0 and m.handle.cached_len == 4

    m = cache.match([9, 1])
    assert len(m.device_indices) == 0 and m.handle._node is cache.root_node
    assert m.handle.cached_len == 0
    assert len(cache.match([]).device_indices) == 0
    assert_no_leak(kv)


def test_match_splits_mid_node():
    kv = make_kv(1)
    cache = kv.prefix_cache
    slots = insert_fresh(kv, [1, 2, 3, 4, 5, 6])
    leaf = node_of(cache, [1, 2, 3, 4, 5, 6])

    m = cache.match([1, 2, 3, 9])
    assert torch.equal(m.device_indices, slots[:3])
    upper = m.handle._node
    assert upper.key == [1, 2, 3] and upper.parent is cache.root_node
    # The original node object keeps the lower half.
    assert leaf.key == [4, 5, 6] and leaf.parent is upper
    assert torch.equal(leaf.value, slots[3:])
    assert upper.children == {4: leaf}
    assert cache.total_size() == 6 and cache.evictable_size() == 6

    other = kv.allocator.alloc(5)
    res = cache.insert([1, 2, 3, 7, 8], other)
    assert res.cached_len == 3 and res.handle.cached_len == 5
    kv.allocator.free(other[:3])  # the caller's duplicates: the tree never frees
    assert set(upper.children) == {4, 7}
    assert cache.total_size() == 8
    expected = torch.cat([slots[:3], other[3:]])
    assert torch.equal(cache.match([1, 2, 3, 7, 8]).device_indices, expected)
    assert_no_leak(kv)


def test_page_alignment_rounds_down():
    P = 4
    kv = make_kv(P)
    cache = kv.prefix_cache
    key = list(range(10, 22))  # three pages
    slots = insert_fresh(kv, key)

    # A key ending mid-page matches only whole pages.
    assert torch.equal(cache.match(key[:7]).device_indices, slots[:4])
    # A mismatch inside the third page: the match stops at the end of the second.
    m = cache.match(key[:10] + [99, 98])
    assert torch.equal(m.device_indices, slots[:8]) and m.handle.cached_len == 8
    # The first match split after page 1, this one after page 2: every node holds whole pages.
    assert m.handle._node.key == key[4:8]
    assert m.handle._node.parent.key == key[:4]
    assert set(m.handle._node.children) == {tuple(key[8:12])}
    # A mismatch in the first page matches nothing.
    assert len(cache.match([10, 11, 12, 0, 14]).device_indices) == 0

    with pytest.raises(ValueError):
        cache.insert(key[:6], slots[:6])
    with pytest.raises(ValueError):
        cache.insert(key[:4], slots[:8])
    assert_no_leak(kv)


def test_page_keyed_children_and_paged_insert():
    P = 4
    kv = make_kv(P)
    cache = kv.prefix_cache
    a = insert_fresh(kv, [1, 2, 3, 4, 5, 6, 7, 8])
    b = kv.allocator.alloc(8)
    # Same first page, second page differs at its last token -> shares 4 tokens.
    assert cache.insert([1, 2, 3, 4, 5, 6, 7, 0], b).cached_len == 4
    kv.allocator.free(b[:4])
    assert set(cache.root_node.children) == {(1, 2, 3, 4)}
    shared = cache.root_node.children[(1, 2, 3, 4)]
    assert set(shared.children) == {(5, 6, 7, 8), (5, 6, 7, 0)}
    assert torch.equal(cache.match([1, 2, 3, 4, 5, 6, 7, 0]).device_indices, torch.cat([a[:4], b[4:]]))
    assert_no_leak(kv)


def test_duplicate_insert_returns_old_prefix_length():
    kv = make_kv(1)
    cache = kv.prefix_cache
    slots = insert_fresh(kv, [1, 2, 3, 4])
    dup = kv.allocator.alloc(6)
    assert cache.insert([1, 2, 3, 4], dup[:4]).cached_len == 4
    assert torch.equal(cache.match([1, 2, 3, 4]).device_indices, slots)  # tree keeps its slots
    assert cache.insert([1, 2], dup[:2]).cached_len == 2
    assert cache.insert([1, 2, 3, 4, 5, 6], dup).cached_len == 4
    kv.allocator.free(dup[:4])
    assert cache.total_size() == 6
    assert torch.equal(cache.match([1, 2, 3, 4, 5, 6]).device_indices, torch.cat([slots, dup[4:]]))
    assert_no_leak(kv)


# ---- locks, counters, eviction ---------------------------------------------------------


def test_lock_ref_protects_from_eviction_and_counters_are_exact():
    kv = make_kv(1)
    cache = kv.prefix_cache
    insert_fresh(kv, [1, 2, 3, 4])
    insert_fresh(kv, [1, 2, 5])  # splits [1,2] | [3,4] and adds [5]
    s78 = insert_fresh(kv, [7, 8])
    assert (cache.evictable_size(), cache.protected_size(), cache.total_size()) == (7, 0, 7)

    handle = cache.match([1, 2, 3, 4]).handle
    cache.lock(handle)  # [1,2] and [3,4] became protected
    assert (cache.evictable_size(), cache.protected_size()) == (3, 4)
    handle5 = cache.match([1, 2, 5]).handle
    cache.lock(handle5)  # [1,2] already protected
    assert (cache.evictable_size(), cache.protected_size()) == (2, 5)
    kv.check_integrity()

    freed = evict(kv, 100)  # only [7, 8] can go; its slots come back to the caller
    assert torch.equal(torch.sort(freed).values, torch.sort(s78).values)
    assert (cache.evictable_size(), cache.protected_size(), cache.total_size()) == (0, 5, 5)
    assert len(cache.match([1, 2, 3, 4]).device_indices) == 4

    cache.unlock(handle5)
    assert (cache.evictable_size(), cache.protected_size()) == (1, 4)
    cache.unlock(handle)
    assert (cache.evictable_size(), cache.protected_size()) == (5, 0)
    assert len(evict(kv, 100)) == 5
    assert kv.allocator.available_size() == POOL_SIZE
    assert_no_leak(kv)
    with pytest.raises(AssertionError, match="negative"):
        cache.unlock(handle)  # one unlock too many


def test_split_keeps_lock_counts_consistent():
    kv = make_kv(1)
    cache = kv.prefix_cache
    insert_fresh(kv, [1, 2, 3, 4, 5, 6])
    handle = cache.match([1, 2, 3, 4, 5, 6]).handle
    leaf = handle._node
    cache.lock(handle)
    cache.match([1, 2, 3, 0])  # splits the locked node
    assert leaf.parent.lock_ref == 1 and leaf.lock_ref == 1
    assert (cache.evictable_size(), cache.protected_size()) == (0, 6)
    kv.check_integrity()
    cache.unlock(handle)  # the handle still names the lower half, which ends at the same place
    assert (cache.evictable_size(), cache.protected_size()) == (6, 0)
    assert len(evict(kv, 1)) == 3  # a whole leaf goes even when fewer tokens are asked
    assert len(evict(kv, 1)) == 3  # its parent became a leaf
    assert cache.total_size() == 0
    assert_no_leak(kv)


def test_lru_eviction_order():
    kv = make_kv(1)
    cache = kv.prefix_cache
    insert_fresh(kv, [1, 1])
    s22 = insert_fresh(kv, [2, 2])
    s33 = insert_fresh(kv, [3, 3])
    cache.match([1, 1])  # touch: [2,2] is now the least recently used

    assert torch.equal(evict(kv, 1), s22)
    assert len(cache.match([2, 2]).device_indices) == 0
    assert torch.equal(cache.match([3, 3]).device_indices, s33)  # touch [3,3]: [1,1] is next
    assert len(evict(kv, 2)) == 2
    assert len(cache.match([1, 1]).device_indices) == 0
    assert cache.total_size() == 2
    assert_no_leak(kv)


def test_eviction_climbs_to_parents_that_become_leaves():
    kv = make_kv(1)
    cache = kv.prefix_cache
    insert_fresh(kv, [1, 2, 3, 4])
    insert_fresh(kv, [1, 2, 5, 6])
    insert_fresh(kv, [9])
    cache.match([9])  # [9] is the most recent
    # Leaves [3,4] and [5,6] go first, then their parent [1,2]; [9] survives.
    assert len(evict(kv, 5)) == 6
    assert cache.total_size() == 1
    assert list(cache.root_node.children) == [9]
    assert len(evict(kv, 0)) == 0
    assert len(evict(kv, 10)) == 1
    assert kv.allocator.available_size() == POOL_SIZE
    assert_no_leak(kv)


def test_check_integrity_catches_a_slot_owned_twice():
    kv = make_kv(1)
    slots = insert_fresh(kv, [1, 2, 3])
    kv.allocator.free(slots[:1])  # the tree still holds it: owned twice
    with pytest.raises(AssertionError, match="owned twice|page owners"):
        kv.check_integrity()


# ---- requests through the KV manager ---------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 4])
def test_finished_requests_share_prefixes_without_leaks(page_size):
    kv = make_kv(page_size)
    cache = kv.prefix_cache
    driver = Driver(kv)
    system = list(range(100, 113))  # 13 tokens: not page-aligned at page_size 4

    first = driver.run(FakeReq(system + [1, 2, 3]))
    assert first.kv.cached_tokens_device == 0
    assert_no_leak(kv)
    cached = cache.total_size()
    assert cached == (len(system) + 3 + 3) // page_size * page_size  # input + outputs - 1 token

    second = FakeReq(system + [7, 8, 9, 10])
    driver.admit(second)
    assert second.kv.prefix_len == len(system) // page_size * page_size
    assert second.kv.cached_tokens_device == second.kv.prefix_len
    assert cache.protected_size() == second.kv.prefix_len
    driver.prefill(second)
    driver.decode(second, 5)
    assert_no_leak(kv, [second])
    driver.finish(second)
    assert_no_leak(kv)

    # The same prompt twice at once: both miss, the second insert finds the first's copy.
    a, b = FakeReq([5, 6, 7, 8, 9, 10, 11]), FakeReq([5, 6, 7, 8, 9, 10, 11])
    driver.admit(a)
    driver.admit(b)
    assert a.kv.prefix_len == b.kv.prefix_len == 0
    driver.prefill(a)
    driver.prefill(b)
    assert_no_leak(kv, [a, b])
    # b's prompt pages were duplicates: its row now points at a's cached slots.
    aligned = 7 // page_size * page_size
    assert torch.equal(driver.row(b)[:aligned], driver.row(a)[:aligned])
    driver.finish(a)
    before = cache.total_size()
    driver.finish(b)
    assert cache.total_size() == before  # same tokens with KV: all of b's were duplicates
    assert_no_leak(kv)
    assert_all_released(kv)


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunked_prefill_caches_each_chunk(page_size):
    kv = make_kv(page_size)
    cache = kv.prefix_cache
    driver = Driver(kv)
    prompt = list(range(200, 230))  # 30 tokens
    req = FakeReq(prompt)
    driver.admit(req)

    driver.extend(req, 10)  # first chunk: 10 tokens
    driver.cache_unfinished(req)
    aligned = 10 // page_size * page_size
    row = driver.row(req)
    assert req.kv.prefix_len == 10 and req.kv.cache_len == aligned and req.kv.kv_len == 10
    assert torch.equal(row[:aligned].long(), cache.match(prompt[:aligned]).device_indices)
    assert cache.total_size() == aligned
    assert cache.protected_size() == aligned and cache.evictable_size() == 0
    assert req.kv.handle._node is cache.match(prompt[:aligned]).handle._node
    assert_no_leak(kv, [req])

    driver.extend(req, 23)  # second chunk
    driver.cache_unfinished(req)
    assert req.kv.prefix_len == 23
    assert cache.protected_size() == 23 // page_size * page_size
    assert_no_leak(kv, [req])

    driver.extend(req, 30)
    req.output_ids.append(driver.new_token())
    driver.decode(req, 2)
    driver.finish(req)
    assert cache.protected_size() == 0
    assert cache.total_size() == (30 + 2) // page_size * page_size
    assert_no_leak(kv)
    assert_all_released(kv)


def test_chunk_whose_partial_page_was_cached_by_another_request():
    """Chunk 1 leaves an unaligned tail; another request then caches that page; chunk 2
    must free the tail page as a duplicate and point the row at the tree's page."""
    P = 4
    kv = make_kv(P)
    cache = kv.prefix_cache
    driver = Driver(kv)
    prompt = list(range(300, 320))  # 20 tokens
    x = FakeReq(prompt)
    driver.admit(x)
    driver.extend(x, 10)  # pages [0,4) [4,8) in the tree after caching, tail 8..9 own
    driver.cache_unfinished(x)
    assert x.kv.prefix_len == 10 and x.kv.cache_len == 8

    y = driver.run(FakeReq(prompt[:13]), decode_steps=0)  # caches 12 tokens: 3 pages
    assert y.kv.cached_tokens_device == 8
    assert cache.total_size() == 12
    assert_no_leak(kv, [x])

    own_tail_page = driver.row(x)[8:10].long()
    driver.extend(x, 16)  # fills x's own page (8..11), then a page for 12..15
    free_before = kv.allocator.available_size()
    driver.cache_unfinished(x)
    assert kv.allocator.available_size() == free_before + P  # the duplicate page came back
    row = driver.row(x)
    tree_slots = cache.match(prompt[:16]).device_indices
    assert torch.equal(row[:16].long(), tree_slots)
    assert not bool(torch.isin(own_tail_page, tree_slots).any())
    assert x.kv.prefix_len == x.kv.cache_len == x.kv.kv_len == 16
    assert_no_leak(kv, [x])

    driver.extend(x, 20)
    x.output_ids.append(driver.new_token())
    driver.finish(x)
    assert len(y.output_ids) == 1
    assert_no_leak(kv)
    assert_all_released(kv)


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunk_cache_keeps_nothing(page_size):
    kv = make_kv(page_size, disable=True)
    cache = kv.prefix_cache
    assert not cache.shares_prefixes and not kv.shares_prefixes
    driver = Driver(kv)
    driver.run(FakeReq(list(range(12))))
    req = FakeReq(list(range(12)))
    driver.admit(req)
    assert req.kv.prefix_len == 0 and req.kv.handle.cached_len == 0
    assert kv.cached_len(list(range(12))) == 0

    driver.extend(req, 6)
    driver.cache_unfinished(req)
    # The request keeps its own slots: nothing went to the cache.
    assert req.kv.prefix_len == 6 and req.kv.cache_len == 0 and req.kv.kv_len == 6
    assert cache.evictable_size() == cache.protected_size() == 0
    assert kv.allocator.available_size() == POOL_SIZE - -(-6 // page_size) * page_size
    assert len(cache.check_integrity()) == 0
    driver.extend(req, 12)
    req.output_ids.append(driver.new_token())
    driver.decode(req, 3)
    driver.finish(req)

    assert len(cache.evict(100)) == 0
    assert cache.insert([1] * page_size, torch.arange(page_size)).cached_len == page_size
    assert len(cache.match([1] * page_size * 2).device_indices) == 0
    assert kv.allocator.available_size() == POOL_SIZE
    assert kv.rtt.available_size() == kv.rtt.size
    kv.check_integrity()


def test_pretty_print(capsys):
    kv = make_kv(1)
    insert_fresh(kv, [1, 2, 3])
    insert_fresh(kv, [1, 2, 4])
    kv.prefix_cache.pretty_print()
    out = capsys.readouterr().out
    assert "total=4" in out and "[2]" in out and "[1]" in out
    assert_no_leak(kv)
