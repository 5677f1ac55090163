"""RadixCache on real CPU pools: match/insert, splits, alignment, locks, eviction, request hooks."""

from __future__ import annotations

import pytest
import torch

from hiserve.mem_cache.allocator import ReqToTokenPool, TokenToKVPoolAllocator
from hiserve.mem_cache.radix_cache import RadixCache, TreeNode

from cache_driver import Driver, FakeReq

POOL_SIZE = 256


def make_cache(page_size: int, disable: bool = False) -> RadixCache:
    req_to_token_pool = ReqToTokenPool(size=8, max_context_len=128, device="cpu")
    allocator = TokenToKVPoolAllocator(POOL_SIZE, page_size, "cpu", kvcache=None)
    return RadixCache(req_to_token_pool, allocator, page_size, disable=disable)


def insert_fresh(cache: RadixCache, key: list[int]) -> torch.Tensor:
    """Allocate slots for `key` and insert them; the tree owns the new part."""
    slots = cache.token_to_kv_pool_allocator.alloc(len(key))
    prefix_len = cache.insert(key, slots)
    cache.token_to_kv_pool_allocator.free(slots[:prefix_len])
    return slots


def node_of(cache: RadixCache, key: list[int]) -> TreeNode:
    return cache.match_prefix(key).last_device_node


def assert_no_leak(cache: RadixCache, running: list[FakeReq] = ()) -> None:
    """Every page is exactly one of: free, in the tree, or owned by a running request."""
    P = cache.page_size
    alloc = cache.token_to_kv_pool_allocator
    own_pages = 0
    for req in running:
        cached_len = len(req.prefix_indices) // P * P
        seq_len = len(req.fill_ids)
        own_pages += -(-(seq_len - cached_len) // P)
    assert cache.evictable_size() + cache.protected_size() == cache.total_size()
    assert alloc.available_size() + cache.total_size() + own_pages * P == POOL_SIZE


def assert_all_released(cache: RadixCache) -> None:
    """After all requests finished: nothing locked, evicting everything returns every page."""
    assert cache.protected_size() == 0
    assert cache.evictable_size() == cache.total_size()
    assert cache.req_to_token_pool.available_size() == cache.req_to_token_pool.size
    total = cache.total_size()
    assert cache.evict(total) == total
    assert cache.total_size() == 0 and cache.evictable_size() == 0
    assert cache.token_to_kv_pool_allocator.available_size() == POOL_SIZE
    cache.reset()
    assert cache.total_size() == 0 and not cache.root_node.children
    # No page was freed twice: allocating everything yields each real slot once.
    slots = cache.token_to_kv_pool_allocator.alloc(POOL_SIZE)
    assert sorted(slots.tolist()) == list(range(cache.page_size, cache.page_size + POOL_SIZE))


# ---- match / insert --------------------------------------------------------------------


def test_insert_and_match_page_size_1():
    cache = make_cache(1)
    slots = insert_fresh(cache, [1, 2, 3, 4])
    assert cache.total_size() == 4 and cache.evictable_size() == 4

    m = cache.match_prefix([1, 2, 3, 4, 5])
    assert torch.equal(m.device_indices, slots)
    assert m.last_device_node is m.last_host_node and m.host_hit_length == 0

    m = cache.match_prefix([9, 1])
    assert len(m.device_indices) == 0 and m.last_device_node is cache.root_node
    assert len(cache.match_prefix([]).device_indices) == 0


def test_match_splits_mid_node():
    cache = make_cache(1)
    slots = insert_fresh(cache, [1, 2, 3, 4, 5, 6])
    leaf = node_of(cache, [1, 2, 3, 4, 5, 6])

    m = cache.match_prefix([1, 2, 3, 9])
    assert torch.equal(m.device_indices, slots[:3])
    upper = m.last_device_node
    assert upper.key == [1, 2, 3] and upper.parent is cache.root_node
    # The original node object keeps the lower half.
    assert leaf.key == [4, 5, 6] and leaf.parent is upper
    assert torch.equal(leaf.value, slots[3:])
    assert upper.children == {4: leaf}
    assert cache.total_size() == 6 and cache.evictable_size() == 6

    assert cache.insert([1, 2, 3, 7, 8], torch.tensor([50, 51, 52, 53, 54])) == 3
    assert set(upper.children) == {4, 7}
    assert cache.total_size() == 8
    expected = torch.cat([slots[:3], torch.tensor([53, 54])])
    assert torch.equal(cache.match_prefix([1, 2, 3, 7, 8]).device_indices, expected)


def test_page_alignment_rounds_down():
    P = 4
    cache = make_cache(P)
    key = list(range(10, 22))  # three pages
    slots = insert_fresh(cache, key)

    # A key ending mid-page matches only whole pages.
    assert torch.equal(cache.match_prefix(key[:7]).device_indices, slots[:4])
    # A mismatch inside the third page: the match stops at the end of the second.
    m = cache.match_prefix(key[:10] + [99, 98])
    assert torch.equal(m.device_indices, slots[:8])
    # The first match split after page 1, this one after page 2: every node holds whole pages.
    assert m.last_device_node.key == key[4:8]
    assert m.last_device_node.parent.key == key[:4]
    assert set(m.last_device_node.children) == {tuple(key[8:12])}
    # A mismatch in the first page matches nothing.
    assert len(cache.match_prefix([10, 11, 12, 0, 14]).device_indices) == 0

    with pytest.raises(ValueError):
        cache.insert(key[:6], slots[:6])
    with pytest.raises(ValueError):
        cache.insert(key[:4], slots[:8])


def test_page_keyed_children_and_paged_insert():
    P = 4
    cache = make_cache(P)
    a = insert_fresh(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    b = cache.token_to_kv_pool_allocator.alloc(8)
    # Same first page, second page differs at its last token -> shares 4 tokens.
    assert cache.insert([1, 2, 3, 4, 5, 6, 7, 0], b) == 4
    cache.token_to_kv_pool_allocator.free(b[:4])
    assert set(cache.root_node.children) == {(1, 2, 3, 4)}
    shared = cache.root_node.children[(1, 2, 3, 4)]
    assert set(shared.children) == {(5, 6, 7, 8), (5, 6, 7, 0)}
    assert torch.equal(cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 0]).device_indices, torch.cat([a[:4], b[4:]]))
    assert_no_leak(cache)


def test_duplicate_insert_returns_old_prefix_length():
    cache = make_cache(1)
    slots = insert_fresh(cache, [1, 2, 3, 4])
    assert cache.insert([1, 2, 3, 4], torch.tensor([90, 91, 92, 93])) == 4
    assert torch.equal(cache.match_prefix([1, 2, 3, 4]).device_indices, slots)  # tree keeps its slots
    assert cache.insert([1, 2], torch.tensor([90, 91])) == 2
    assert cache.insert([1, 2, 3, 4, 5, 6], torch.tensor([90, 91, 92, 93, 94, 95])) == 4
    assert cache.total_size() == 6


# ---- locks, counters, eviction ---------------------------------------------------------


def test_lock_ref_protects_from_eviction_and_counters_are_exact():
    cache = make_cache(1)
    insert_fresh(cache, [1, 2, 3, 4])
    insert_fresh(cache, [1, 2, 5])  # splits [1,2] | [3,4] and adds [5]
    insert_fresh(cache, [7, 8])
    assert (cache.evictable_size(), cache.protected_size(), cache.total_size()) == (7, 0, 7)

    node = node_of(cache, [1, 2, 3, 4])
    assert cache.inc_lock_ref(node) == -4  # [1,2] and [3,4] became protected
    assert (cache.evictable_size(), cache.protected_size()) == (3, 4)
    node5 = node_of(cache, [1, 2, 5])
    assert cache.inc_lock_ref(node5) == -1  # [1,2] already protected
    assert (cache.evictable_size(), cache.protected_size()) == (2, 5)

    assert cache.evict(100) == 2  # only [7, 8] can go
    assert (cache.evictable_size(), cache.protected_size(), cache.total_size()) == (0, 5, 5)
    assert len(cache.match_prefix([1, 2, 3, 4]).device_indices) == 4

    assert cache.dec_lock_ref(node5) == 1
    assert cache.dec_lock_ref(node) == 4
    assert (cache.evictable_size(), cache.protected_size()) == (5, 0)
    assert cache.evict(100) == 5
    assert cache.token_to_kv_pool_allocator.available_size() == POOL_SIZE


def test_split_keeps_lock_counts_consistent():
    cache = make_cache(1)
    insert_fresh(cache, [1, 2, 3, 4, 5, 6])
    leaf = node_of(cache, [1, 2, 3, 4, 5, 6])
    cache.inc_lock_ref(leaf)
    cache.match_prefix([1, 2, 3, 0])  # splits the locked node
    assert leaf.parent.lock_ref == 1 and leaf.lock_ref == 1
    assert (cache.evictable_size(), cache.protected_size()) == (0, 6)
    cache.dec_lock_ref(leaf)
    assert (cache.evictable_size(), cache.protected_size()) == (6, 0)
    assert cache.evict(1) == 3  # a whole leaf goes even when fewer tokens are asked
    assert cache.evict(1) == 3  # its parent became a leaf
    assert cache.total_size() == 0


def test_lru_eviction_order():
    cache = make_cache(1)
    insert_fresh(cache, [1, 1])
    insert_fresh(cache, [2, 2])
    insert_fresh(cache, [3, 3])
    cache.match_prefix([1, 1])  # touch: [2,2] is now the least recently used

    assert cache.evict(1) == 2
    assert len(cache.match_prefix([2, 2]).device_indices) == 0
    assert len(cache.match_prefix([3, 3]).device_indices) == 2  # touch [3,3]: [1,1] is next
    assert cache.evict(2) == 2
    assert len(cache.match_prefix([1, 1]).device_indices) == 0
    assert cache.total_size() == 2


def test_eviction_climbs_to_parents_that_become_leaves():
    cache = make_cache(1)
    insert_fresh(cache, [1, 2, 3, 4])
    insert_fresh(cache, [1, 2, 5, 6])
    insert_fresh(cache, [9])
    cache.match_prefix([9])  # [9] is the most recent
    # Leaves [3,4] and [5,6] go first, then their parent [1,2]; [9] survives.
    assert cache.evict(5) == 6
    assert cache.total_size() == 1
    assert list(cache.root_node.children) == [9]
    assert cache.evict(0) == 0
    assert cache.evict(10) == 1
    assert cache.token_to_kv_pool_allocator.available_size() == POOL_SIZE


# ---- request hooks ---------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 4])
def test_finished_requests_share_prefixes_without_leaks(page_size):
    cache = make_cache(page_size)
    driver = Driver(cache)
    system = list(range(100, 113))  # 13 tokens: not page-aligned at page_size 4

    first = driver.run(FakeReq(system + [1, 2, 3]))
    assert len(first.prefix_indices) == 0
    assert_no_leak(cache)
    cached = cache.total_size()
    assert cached == (len(system) + 3 + 3) // page_size * page_size  # input + outputs - 1 token

    second = FakeReq(system + [7, 8, 9, 10])
    driver.admit(second)
    assert len(second.prefix_indices) == len(system) // page_size * page_size
    assert cache.protected_size() == len(second.prefix_indices)
    driver.prefill(second)
    driver.decode(second, 5)
    assert_no_leak(cache, [second])
    cache.cache_finished_req(second)
    assert_no_leak(cache)

    # The same prompt twice at once: both miss, the second insert finds the first's copy.
    a, b = FakeReq([5, 6, 7, 8, 9, 10, 11]), FakeReq([5, 6, 7, 8, 9, 10, 11])
    driver.admit(a)
    driver.admit(b)
    driver.prefill(a)
    driver.prefill(b)
    assert_no_leak(cache, [a, b])
    cache.cache_finished_req(a)
    before = cache.total_size()
    cache.cache_finished_req(b)
    assert cache.total_size() == before  # same tokens with KV: all of b's were duplicates
    assert_no_leak(cache)
    assert_all_released(cache)


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunked_prefill_with_cache_unfinished_req(page_size):
    cache = make_cache(page_size)
    driver = Driver(cache)
    prompt = list(range(200, 230))  # 30 tokens
    req = FakeReq(prompt)
    driver.admit(req)

    driver.extend(req, 10)  # first chunk: 10 tokens
    cache.cache_unfinished_req(req)
    aligned = 10 // page_size * page_size
    row = cache.req_to_token_pool.req_to_token[req.req_pool_idx]
    assert len(req.prefix_indices) == 10
    assert torch.equal(req.prefix_indices, row[:10].long())
    assert cache.total_size() == aligned
    assert cache.protected_size() == aligned and cache.evictable_size() == 0
    assert req.last_node is cache.match_prefix(prompt[:aligned]).last_device_node
    assert_no_leak(cache, [req])

    driver.extend(req, 23)  # second chunk
    cache.cache_unfinished_req(req)
    assert len(req.prefix_indices) == 23
    assert cache.protected_size() == 23 // page_size * page_size
    assert_no_leak(cache, [req])

    driver.extend(req, 30)
    req.output_ids.append(driver.new_token())
    driver.decode(req, 2)
    cache.cache_finished_req(req)
    assert cache.protected_size() == 0
    assert cache.total_size() == (30 + 2) // page_size * page_size
    assert_no_leak(cache)
    assert_all_released(cache)


def test_chunk_whose_partial_page_was_cached_by_another_request():
    """Chunk 1 leaves an unaligned tail; another request then caches that page; chunk 2
    must free the tail page as a duplicate and point the row at the tree's page."""
    P = 4
    cache = make_cache(P)
    driver = Driver(cache)
    prompt = list(range(300, 320))  # 20 tokens
    x = FakeReq(prompt)
    driver.admit(x)
    driver.extend(x, 10)  # pages [0,4) [4,8) in the tree after caching, tail 8..9 own
    cache.cache_unfinished_req(x)
    assert len(x.prefix_indices) == 10

    y = driver.run(FakeReq(prompt[:13]), decode_steps=0)  # caches 12 tokens: 3 pages
    assert cache.total_size() == 12
    assert_no_leak(cache, [x])

    driver.extend(x, 16)  # fills x's own page (8..11), then a page for 12..15
    cache.cache_unfinished_req(x)
    row = cache.req_to_token_pool.req_to_token[x.req_pool_idx]
    tree_slots = cache.match_prefix(prompt[:16]).device_indices
    assert torch.equal(row[:16].long(), tree_slots)
    assert torch.equal(x.prefix_indices, tree_slots)
    assert_no_leak(cache, [x])

    driver.extend(x, 20)
    x.output_ids.append(driver.new_token())
    cache.cache_finished_req(x)
    assert len(y.output_ids) == 1
    assert_no_leak(cache)
    assert_all_released(cache)


def test_disable_mode_is_a_chunk_cache():
    for page_size in (1, 4):
        cache = make_cache(page_size, disable=True)
        driver = Driver(cache)
        driver.run(FakeReq(list(range(12))))
        req = FakeReq(list(range(12)))
        driver.admit(req)
        assert len(req.prefix_indices) == 0 and req.last_node is cache.root_node

        driver.extend(req, 6)
        cache.cache_unfinished_req(req)
        row = cache.req_to_token_pool.req_to_token[req.req_pool_idx]
        assert torch.equal(req.prefix_indices, row[:6].long())
        assert cache.total_size() == 0
        driver.extend(req, 12)
        req.output_ids.append(driver.new_token())
        driver.decode(req, 3)
        cache.cache_finished_req(req)

        assert cache.total_size() == 0 and cache.evict(100) == 0
        assert cache.insert([1] * page_size, torch.arange(page_size)) == 0
        assert cache.token_to_kv_pool_allocator.available_size() == POOL_SIZE
        assert cache.req_to_token_pool.available_size() == cache.req_to_token_pool.size


def test_pretty_print(capsys):
    cache = make_cache(1)
    insert_fresh(cache, [1, 2, 3])
    insert_fresh(cache, [1, 2, 4])
    cache.pretty_print()
    out = capsys.readouterr().out
    assert "total=4" in out and "[2]" in out and "[1]" in out
