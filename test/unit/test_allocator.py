"""ReqToTokenPool and the paged TokenToKVPoolAllocator on CPU tensors."""

import pytest
import torch

from hiserve.mem_cache.allocator import ReqToTokenPool, TokenToKVPoolAllocator


def drain(allocator: TokenToKVPoolAllocator) -> torch.Tensor:
    """Allocate every free slot; returns them (checks the free list has no duplicates)."""
    slots = allocator.alloc(allocator.available_size())
    assert slots is not None
    assert allocator.available_size() == 0
    assert len(torch.unique(slots)) == len(slots)
    return slots


# ---- ReqToTokenPool ----------------------------------------------------------------


def test_req_to_token_pool_alloc_free():
    pool = ReqToTokenPool(size=4, max_context_len=16, device="cpu")
    assert pool.req_to_token.shape == (4, 16)
    assert pool.req_to_token.dtype == torch.int32
    rows = pool.alloc(3)
    assert rows == [0, 1, 2]
    assert pool.available_size() == 1
    assert pool.alloc(2) is None
    assert pool.available_size() == 1  # a refused alloc takes nothing
    pool.free(rows[1])
    pool.free([rows[0], rows[2]])
    assert pool.available_size() == 4
    assert sorted(pool.alloc(4)) == [0, 1, 2, 3]
    pool.clear()
    assert pool.available_size() == 4
    assert pool.padding_row is None


def test_req_to_token_pool_padding_row_is_never_handed_out():
    pool = ReqToTokenPool(size=3, max_context_len=8, device="cpu", padding_row=True)
    assert pool.padding_row == 3
    assert pool.req_to_token.shape == (4, 8)
    assert pool.size == 3 and pool.available_size() == 3
    assert pool.alloc(4) is None
    rows = pool.alloc(3)
    assert pool.padding_row not in rows
    pool.free(rows)
    pool.clear()
    assert pool.padding_row not in pool.alloc(3)
    assert not pool.req_to_token[pool.padding_row].any()  # every position maps to slot 0


# ---- alloc / free --------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 4])
def test_alloc_free_exhaustion_no_leak(page_size):
    size = 64
    allocator = TokenToKVPoolAllocator(size, page_size, "cpu", kvcache=None)
    assert allocator.available_size() == size

    a = allocator.alloc(8)
    b = allocator.alloc(16)
    assert a.dtype == torch.int64 and len(a) == 8 and len(b) == 16
    # Fresh pages are contiguous, ascending, and never the padding page 0.
    assert torch.equal(a, torch.arange(page_size, page_size + 8))
    assert int(torch.cat([a, b]).min()) >= page_size
    assert allocator.available_size() == size - 24

    assert allocator.alloc(size) is None
    assert allocator.available_size() == size - 24

    allocator.free(a)
    allocator.free(b)
    assert allocator.available_size() == size
    slots = drain(allocator)
    assert sorted(slots.tolist()) == list(range(page_size, page_size + size))
    assert allocator.alloc(page_size) is None

    allocator.free(slots)
    assert allocator.available_size() == size
    allocator.clear()
    assert allocator.available_size() == size


def test_alloc_rejects_unaligned_size():
    allocator = TokenToKVPoolAllocator(32, 4, "cpu", None)
    with pytest.raises(ValueError):
        allocator.alloc(3)


def test_freed_pages_come_back_sorted():
    allocator = TokenToKVPoolAllocator(8, 1, "cpu", None)
    slots = drain(allocator)
    allocator.free(slots[[5, 1, 3]])
    assert allocator.alloc(3).tolist() == [2, 4, 6]


def test_free_partial_page_frees_whole_page():
    allocator = TokenToKVPoolAllocator(16, 4, "cpu", None)
    slots = allocator.alloc(8)  # pages 1, 2 -> slots 4..11
    allocator.free(slots[4:6])  # two slots of page 2
    assert allocator.available_size() == 16 - 4
    allocator.free(slots[:4])
    assert allocator.available_size() == 16


def test_free_group_batches_frees():
    allocator = TokenToKVPoolAllocator(16, 1, "cpu", None)
    slots = allocator.alloc(10)
    allocator.free_group_begin()
    allocator.free(slots[:3])
    allocator.free(slots[3:])
    assert allocator.available_size() == 6
    allocator.free_group_end()
    assert allocator.available_size() == 16
    drain(allocator)


def test_free_groups_nest():
    allocator = TokenToKVPoolAllocator(16, 1, "cpu", None)
    slots = allocator.alloc(10)
    allocator.free_group_begin()
    allocator.free(slots[:3])
    allocator.free_group_begin()  # e.g. an eviction inside a batch of frees
    allocator.free(slots[3:5])
    allocator.free_group_end()
    assert allocator.available_size() == 6
    allocator.free(slots[5:])
    allocator.free_group_end()
    assert allocator.available_size() == 16
    with pytest.raises(RuntimeError):
        allocator.free_group_end()
    drain(allocator)


# ---- alloc_extend / alloc_decode -----------------------------------------------------


def test_alloc_extend_page_size_1():
    allocator = TokenToKVPoolAllocator(32, 1, "cpu", None)
    out = allocator.alloc_extend(prefix_lens=[0, 3], seq_lens=[5, 7], last_loc=[-1, 9])
    assert out.tolist() == list(range(1, 10))
    assert allocator.available_size() == 32 - 9
    assert allocator.alloc_extend([0], [100], [-1]) is None
    assert allocator.available_size() == 32 - 9


def test_alloc_decode_page_size_1():
    allocator = TokenToKVPoolAllocator(4, 1, "cpu", None)
    assert allocator.alloc_decode([5, 9, 2], [1, 2, 3]).tolist() == [1, 2, 3]
    assert allocator.alloc_decode([6, 10], [1, 2]) is None
    assert allocator.available_size() == 1


def test_alloc_extend_fills_partial_page_first():
    P = 4
    allocator = TokenToKVPoolAllocator(64, P, "cpu", None)
    # Request A: fresh, 6 tokens -> pages 1, 2 (slots 4..9; slots 10, 11 still free in page 2).
    # Request B: fresh, 3 tokens -> page 3 (slots 12..14).
    first = allocator.alloc_extend([0, 0], [6, 3], [-1, -1])
    assert first.tolist() == [4, 5, 6, 7, 8, 9, 12, 13, 14]
    assert allocator.available_size() == 64 - 3 * P

    # A extends 6 -> 13: fills slots 10, 11 of its page 2, then takes pages 4, 5.
    # B extends 3 -> 4: fills slot 15 of page 3, no new page.
    # C: prefix 8 (page-aligned, last at slot 7 of a shared page): takes a new page 6.
    second = allocator.alloc_extend([6, 3, 8], [13, 4, 9], [9, 14, 7])
    assert second.tolist() == [10, 11, 16, 17, 18, 19, 20, 15, 24]
    assert allocator.available_size() == 64 - 6 * P

    # Position j always sits at offset j % P of its page.
    a_slots = first[:6].tolist() + second[:7].tolist()
    assert [s % P for s in a_slots] == [j % P for j in range(13)]


def test_alloc_extend_exhaustion_has_no_side_effects():
    allocator = TokenToKVPoolAllocator(8, 4, "cpu", None)  # two pages
    assert allocator.alloc_extend([0, 0], [5, 4], [-1, -1]) is None  # needs three pages
    assert allocator.available_size() == 8
    out = allocator.alloc_extend([0], [5], [-1])
    assert out.tolist() == [4, 5, 6, 7, 8]
    # Only filling the partial page needs no new page, even with none free.
    assert allocator.available_size() == 0
    assert allocator.alloc_extend([5], [8], [8]).tolist() == [9, 10, 11]
    assert allocator.alloc_extend([8], [9], [11]) is None


def test_alloc_decode_new_page_only_at_page_start():
    P = 4
    allocator = TokenToKVPoolAllocator(32, P, "cpu", None)
    slots = allocator.alloc_extend([0, 0], [4, 6], [-1, -1])  # A: page 1; B: pages 2, 3
    assert slots.tolist() == [4, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    free_before = allocator.available_size()
    # A decodes position 4 (starts a page) -> page 4; B decodes position 6 -> slot 14 of page 3.
    out = allocator.alloc_decode(seq_lens=[5, 7], last_loc=torch.tensor([7, 13]))
    assert out.tolist() == [16, 14]
    assert allocator.available_size() == free_before - P
    out = allocator.alloc_decode([6, 8], [16, 14])
    assert out.tolist() == [17, 15]
    assert allocator.available_size() == free_before - P


def test_alloc_decode_exhaustion_has_no_side_effects():
    allocator = TokenToKVPoolAllocator(4, 4, "cpu", None)
    allocator.alloc(4)
    assert allocator.alloc_decode([5, 3], [7, 6]) is None
    assert allocator.available_size() == 0
    assert allocator.alloc_decode([3], [5]).tolist() == [6]


@pytest.mark.parametrize("page_size", [1, 4])
def test_random_extend_decode_free_no_leak(page_size):
    """Requests grow by extend and decode, the oldest is freed on exhaustion; no page is lost."""
    gen = torch.Generator().manual_seed(0)
    size = 256
    allocator = TokenToKVPoolAllocator(size, page_size, "cpu", None)
    reqs: list[list[int]] = []  # slots of each request, by position

    def rand(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi, (1,), generator=gen))

    for step in range(60):
        if step % 3 == 0:
            reqs.extend([] for _ in range(rand(1, 4)))
        prefix_lens = [len(r) for r in reqs]
        grow = [rand(0, 9) for _ in reqs]
        last_loc = [r[-1] if r else -1 for r in reqs]
        out = allocator.alloc_extend(prefix_lens, [p + g for p, g in zip(prefix_lens, grow)], last_loc)
        if out is None:
            allocator.free(torch.tensor(reqs.pop(0), dtype=torch.int64))
            continue
        for r, chunk in zip(reqs, out.split(grow)):
            r.extend(chunk.tolist())
        decodable = [r for r in reqs if r]
        out = allocator.alloc_decode([len(r) + 1 for r in decodable], [r[-1] for r in decodable])
        if out is not None:
            for r, s in zip(decodable, out.tolist()):
                r.append(s)

        all_slots = [s for r in reqs for s in r]
        assert len(set(all_slots)) == len(all_slots)
        for r in reqs:
            assert all(s % page_size == j % page_size for j, s in enumerate(r))
            assert all(s >= page_size for s in r)
        pages_held = sum(-(-len(r) // page_size) for r in reqs)
        assert allocator.available_size() == size - pages_held * page_size

    for r in reqs:
        if r:
            allocator.free(torch.tensor(r, dtype=torch.int64))
    assert allocator.available_size() == size
    drain(allocator)


# ---- CPU slot tensors, aligned frees, the req_to_token mirror ----------------------------


def test_free_needs_runs_that_start_at_page_boundaries():
    allocator = TokenToKVPoolAllocator(16, 4, "cpu", None)
    slots = allocator.alloc(8)
    assert slots.device.type == "cpu" and slots.dtype == torch.int64
    with pytest.raises(ValueError, match="page boundaries"):
        allocator.free(slots[1:4])  # starts inside page 1
    allocator.free_group_begin()
    with pytest.raises(ValueError, match="page boundaries"):
        allocator.free(slots[2:8])  # checked inside a group too
    allocator.free_group_end()
    assert allocator.available_size() == 8  # nothing was freed by the bad calls
    allocator.free(slots[4:])
    allocator.free(slots[:4])
    assert allocator.available_size() == 16
    drain(allocator)


def test_free_page_ids_lists_exactly_the_free_pages():
    allocator = TokenToKVPoolAllocator(32, 4, "cpu", None)  # pages 1..8
    slots = allocator.alloc(20)  # pages 1..5
    allocator.free(slots[8:12])  # page 3
    allocator.free_group_begin()
    allocator.free(slots[16:])  # page 5, held back by the group
    assert sorted(allocator.free_page_ids().tolist()) == [3, 6, 7, 8]
    allocator.free_group_end()
    assert sorted(allocator.free_page_ids().tolist()) == [3, 5, 6, 7, 8]
    assert allocator.available_size() == 5 * 4


def test_req_to_token_write_positions_and_slots():
    pool = ReqToTokenPool(size=2, max_context_len=16, device="cpu")
    assert pool.req_to_token_cpu is pool.req_to_token  # on the CPU the mirror is the table
    pool.write(0, 2, torch.tensor([5, 6, 7]))
    pool.write(1, 0, torch.empty(0, dtype=torch.int64))  # no-op
    pool.write_positions([0, 1], [5, 3], torch.tensor([9, 10]))
    pool.write_positions([], [], torch.empty(0, dtype=torch.int64))  # no-op
    pool.flush()
    s = pool.slots(0, 2, 6)
    assert s.dtype == torch.int64 and s.tolist() == [5, 6, 7, 9]
    assert int(pool.req_to_token[0, 5]) == 9 and int(pool.req_to_token[1, 3]) == 10
    assert pool.req_to_token[1].tolist().count(0) == 15


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_req_to_token_device_table_changes_at_flush():
    pool = ReqToTokenPool(size=2, max_context_len=16, device="cuda")
    assert pool.req_to_token_cpu.device.type == "cpu"
    pool.write(0, 1, torch.tensor([4, 5, 6]))
    pool.write_positions([1], [7], torch.tensor([11]))
    assert pool.slots(0, 1, 4).tolist() == [4, 5, 6]  # the mirror changes at once
    assert int(pool.req_to_token.sum()) == 0  # the device table at the next flush
    pool.flush()
    assert torch.equal(pool.req_to_token.cpu(), pool.req_to_token_cpu)
    pool.flush()  # nothing staged: no-op
    pool.clear()
    assert pool.available_size() == 2
