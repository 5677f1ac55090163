"""Who owns which slot: request rows and device KV pages.

Two small pools sit above the device KV pool (L1):

* `ReqToTokenPool` hands out rows of `req_to_token`, a `[max_reqs, max_context_len]`
  int32 table mapping (request row, token position) to a KV slot.
* `TokenToKVPoolAllocator` hands out *pages* of the device KV pool. A slot is a
  row of the pool's per-layer buffers; page `p` is slots `p*page_size ..
  (p+1)*page_size - 1`. Page 0 is never handed out: it is the padding page that
  attention kernels may read or write for dummy tokens, which is why the pool's
  buffers have `size + page_size` rows.

Paging invariant the whole engine relies on: token position `j` of a request lives
at slot `page * page_size + j % page_size` of some page owned by that request (or by
the radix tree). So the slot after `last_loc` is the next position in the same page
whenever `position % page_size != 0`, and a page is always freed as a whole.
"""

from __future__ import annotations

from itertools import accumulate
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hiserve.mem_cache.memory_pool import KVCache


class ReqToTokenPool:
    """Rows of the `req_to_token` table, one per running request.

    Attributes:
        req_to_token: int32 `[size, max_context_len]` on `device` (`[size + 1, ...]` with a
            padding row); `req_to_token[row, pos]` is the KV slot of token `pos` of the
            request that holds `row`. Entries past a request's length are stale.
        padding_row: index of the padding row (`size`), or None. It is never handed out and
            stays all zeros, i.e. every position maps to slot 0 of the padding page: the
            row of the dummy requests that pad a CUDA-graph batch.
    """

    def __init__(
        self, size: int, max_context_len: int, device: str | torch.device, padding_row: bool = False
    ) -> None:
        if size <= 0 or max_context_len <= 0:
            raise ValueError(f"size and max_context_len must be > 0, got {size}, {max_context_len}")
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.padding_row: int | None = size if padding_row else None
        rows = size + 1 if padding_row else size
        self.req_to_token = torch.zeros((rows, max_context_len), dtype=torch.int32, device=self.device)
        # The scheduler reads slots back (last_loc, a finished request's slots) from a CPU
        # mirror: reading the device table would block on every kernel queued before it.
        self.req_to_token_cpu = (self.req_to_token if self.device.type == "cpu"
                                 else torch.zeros_like(self.req_to_token, device="cpu"))
        self._staged: list[tuple[torch.Tensor, torch.Tensor]] = []  # (flat positions, slots)
        self.free_slots: list[int] = list(range(size))

    def alloc(self, n: int = 1) -> list[int] | None:
        """Take `n` free rows; returns their indices, or None (nothing taken) if fewer are free."""
        if n > len(self.free_slots):
            return None
        rows, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return rows

    def free(self, idx: int | list[int]) -> None:
        """Return one row or a list of rows. The rows' table contents are left as they are."""
        if isinstance(idx, int):
            self.free_slots.append(idx)
        else:
            self.free_slots.extend(idx)

    def available_size(self) -> int:
        """Number of free rows."""
        return len(self.free_slots)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Set positions `start .. start+len(slots)-1` of `row` to `slots` (integer CPU `[n]`).

        The CPU mirror changes now; on a CUDA pool the device table changes at the next
        `flush()` (one copy for all writes staged since the last flush).
        """
        n = len(slots)
        if n == 0:
            return
        self.req_to_token_cpu[row, start:start + n] = slots
        if self.req_to_token_cpu is not self.req_to_token:
            flat = torch.arange(start, start + n, dtype=torch.int64) + row * self.max_context_len
            self._staged.append((flat, slots.to(torch.int32)))

    def write_positions(self, rows: list[int], positions: list[int], slots: torch.Tensor) -> None:
        """Set `req_to_token[rows[i], positions[i]] = slots[i]` (one position per request, as a
        decode step needs); staged for the device like `write`."""
        if not rows:
            return
        flat = torch.tensor(rows, dtype=torch.int64) * self.max_context_len + torch.tensor(
            positions, dtype=torch.int64)
        self.req_to_token_cpu.view(-1)[flat] = slots.to(torch.int32)
        if self.req_to_token_cpu is not self.req_to_token:
            self._staged.append((flat, slots.to(torch.int32)))

    def flush(self) -> None:
        """Apply the staged writes to the device table (no-op on the CPU).

        The indices travel through pinned memory with non-blocking copies, so the host does
        not wait for the kernels queued before them; kernels queued after see the writes.
        """
        if not self._staged:
            return
        flat = torch.cat([f for f, _ in self._staged]).pin_memory()
        vals = torch.cat([v for _, v in self._staged]).pin_memory()
        self._staged = []
        dev = self.req_to_token.device
        self.req_to_token.view(-1).index_copy_(0, flat.to(dev, non_blocking=True),
                                               vals.to(dev, non_blocking=True))

    def slots(self, row: int, start: int, end: int) -> torch.Tensor:
        """int64 CPU `[end - start]`: the slots of positions start..end-1 of `row`."""
        return self.req_to_token_cpu[row, start:end].to(torch.int64)

    def clear(self) -> None:
        """Mark every row free (staged writes are dropped: their rows are free too)."""
        self.free_slots = list(range(self.size))
        self._staged = []


class TokenToKVPoolAllocator:
    """Page-granular allocator of device KV slots.

    Free pages live in an int64 CPU tensor and slots are handed out as int64 CPU
    tensors whatever the pool's device: the scheduler's bookkeeping then never waits
    for the device (the caller copies a batch's slots to the device once). Allocations
    take from its front, so a fresh pool hands out ascending, contiguous pages. Freed pages go
    to a side list and are appended, sorted, only when the front runs short (FIFO
    between batches of frees, ascending within one): freeing is O(1) Python work and
    allocation is a slice, so neither costs a per-token Python loop. All sizes in
    this class are in tokens (slots) unless the name says pages.

    Args:
        size: device pool capacity in tokens; `size // page_size` real pages
            (pages 1..num_pages; page 0 is padding).
        page_size: tokens per page.
        device: the KV pool's device (slot tensors themselves are always on the CPU).
        kvcache: the device KV pool these slots index, kept for callers that reach
            the pool through the allocator.
    """

    def __init__(
        self,
        size: int,
        page_size: int = 1,
        device: str | torch.device = "cpu",
        kvcache: "KVCache | None" = None,
    ) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be > 0, got {page_size}")
        if size < page_size:
            raise ValueError(f"size ({size} tokens) is smaller than one page ({page_size} tokens)")
        self.size = size
        self.page_size = page_size
        self.num_pages = size // page_size
        self.device = torch.device(device)
        self._kvcache = kvcache
        self.clear()

    def get_kvcache(self) -> "KVCache | None":
        return self._kvcache

    # ---- state --------------------------------------------------------------------

    def clear(self) -> None:
        """Mark every real page free (pages 1..num_pages) and drop any open free group."""
        self._free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64)
        self._released_pages: list[torch.Tensor] = []
        self._num_released_pages = 0
        self._free_group: list[torch.Tensor] | None = None
        self._free_group_depth = 0

    def available_size(self) -> int:
        """Free tokens = free pages x page_size (pages held in an open free group not counted)."""
        return (len(self._free_pages) + self._num_released_pages) * self.page_size

    def _merge_released_pages(self) -> None:
        # Sorting only the released pages keeps the merge O(R log R) for R released
        # pages; the unallocated remainder (already sorted) stays in front of them.
        if not self._released_pages:
            return
        released = torch.sort(torch.cat(self._released_pages)).values
        self._free_pages = torch.cat([self._free_pages, released])
        self._released_pages = []
        self._num_released_pages = 0

    def _take_pages(self, num_pages: int) -> torch.Tensor | None:
        """Pop `num_pages` page ids (int64 [num_pages]) from the front, or None if too few."""
        if num_pages > len(self._free_pages):
            self._merge_released_pages()
            if num_pages > len(self._free_pages):
                return None
        pages = self._free_pages[:num_pages]
        self._free_pages = self._free_pages[num_pages:]
        return pages

    def _pages_to_slots(self, pages: torch.Tensor) -> torch.Tensor:
        """int64 [n] page ids -> int64 [n * page_size] slots, page by page in order."""
        if self.page_size == 1:
            return pages
        offsets = torch.arange(self.page_size, dtype=torch.int64)
        return (pages[:, None] * self.page_size + offsets).reshape(-1)

    # ---- allocation ---------------------------------------------------------------

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """Slots of `need_size // page_size` whole new pages.

        Returns int64 CPU `[need_size]`, ascending within each page; None
        (nothing taken) if not enough pages are free.
        Raises ValueError if `need_size` is not a multiple of page_size.
        """
        if need_size % self.page_size != 0:
            raise ValueError(f"need_size {need_size} is not a multiple of page_size {self.page_size}")
        pages = self._take_pages(need_size // self.page_size)
        if pages is None:
            return None
        return self._pages_to_slots(pages)

    def alloc_extend(
        self,
        prefix_lens: list[int],
        seq_lens: list[int],
        last_loc: list[int] | torch.Tensor,
    ) -> torch.Tensor | None:
        """Slots for positions `prefix_lens[i] .. seq_lens[i] - 1` of every request.

        Each request first fills the rest of the page that holds its position
        `prefix_len - 1` (slot `last_loc[i]`; -1 when prefix_len == 0), then takes new
        pages. Lengths are token counts.

        Returns int64 CPU `[sum(seq_lens) - sum(prefix_lens)]`, requests
        concatenated in order; None (nothing taken) if not enough pages are free.
        """
        if self.page_size == 1:
            return self.alloc(sum(seq_lens) - sum(prefix_lens))

        P = self.page_size
        extend_lens = [s - p for p, s in zip(prefix_lens, seq_lens)]
        # Free slots left in each request's current page, and the pages it needs past those.
        fill_lens = [min(-p % P, e) for p, e in zip(prefix_lens, extend_lens)]
        page_counts = [-(-(e - f) // P) for e, f in zip(extend_lens, fill_lens)]
        num_tokens = sum(extend_lens)
        pages = self._take_pages(sum(page_counts))
        if pages is None:
            return None
        if num_tokens == 0:
            return torch.empty(0, dtype=torch.int64)

        # Vectorised per-token gather. For output token j of request r at local index t:
        #   t <  fill_r : slot = last_loc_r + 1 + t                       (its partially used page)
        #   t >= fill_r : slot = new_slots[page_start_r * P - fill_r + t] (its new pages)
        def as_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64)

        out_starts = as_tensor([0, *accumulate(extend_lens)][:-1])
        fill = as_tensor(fill_lens)
        partial_base = torch.as_tensor(last_loc, dtype=torch.int64) + 1
        req = torch.repeat_interleave(
            torch.arange(len(extend_lens)), as_tensor(extend_lens), output_size=num_tokens
        )
        t = torch.arange(num_tokens, dtype=torch.int64) - out_starts[req]
        from_partial = partial_base[req] + t
        if len(pages) == 0:
            return from_partial
        page_base = as_tensor([0, *accumulate(page_counts)][:-1]) * P - fill
        # Only the t < fill_r entries can fall below 0 (they are discarded by the where).
        k = (page_base[req] + t).clamp_(min=0)
        return torch.where(t < fill[req], from_partial, self._pages_to_slots(pages)[k])

    def alloc_decode(self, seq_lens: list[int], last_loc: list[int] | torch.Tensor) -> torch.Tensor | None:
        """One slot per request for its position `seq_len - 1`.

        `last_loc[i]` is the slot of position `seq_len - 2`. A new page is taken only
        for requests whose new position starts a page.

        Returns int64 CPU `[len(seq_lens)]`; None (nothing taken) if not
        enough pages are free.
        """
        if self.page_size == 1:
            return self.alloc(len(seq_lens))
        needs_page = [i for i, s in enumerate(seq_lens) if (s - 1) % self.page_size == 0]
        pages = self._take_pages(len(needs_page))
        if pages is None:
            return None
        out = torch.as_tensor(last_loc, dtype=torch.int64) + 1
        if needs_page:
            out[torch.tensor(needs_page, dtype=torch.int64)] = pages * self.page_size
        return out

    # ---- freeing ------------------------------------------------------------------

    def free(self, indices: torch.Tensor) -> None:
        """Free the pages that contain these slots (integer tensor `[n]`, CPU preferred: a
        device tensor costs a synchronising copy).

        `indices` must be whole runs of a request's positions that start at a page boundary
        (a node's slots, a request's pages from an aligned position on, its unaligned
        tail): then every `page_size`-th slot starts a new page, which names the pages
        without sorting or `unique`. The caller must own every slot of those pages; a
        partial tail page frees the whole page. Inside a free group the pages are held
        back until `free_group_end()`.

        Raises:
            ValueError: a slot expected to start a page does not (the run was not aligned).
        """
        if indices.numel() == 0:
            return
        indices = indices.to("cpu", torch.int64)
        if self.page_size == 1:
            pages = indices.clone()
        else:
            firsts = indices[:: self.page_size]
            if bool((firsts % self.page_size).any()):
                raise ValueError("free() needs runs of slots that start at page boundaries")
            pages = firsts // self.page_size
        if self._free_group is not None:
            self._free_group.append(pages)
            return
        self._released_pages.append(pages)
        self._num_released_pages += len(pages)

    def free_group_begin(self) -> None:
        """Start collecting frees; they are applied together by the matching `free_group_end()`.

        Groups nest: only the outermost end applies the frees.
        """
        if self._free_group_depth == 0:
            self._free_group = []
        self._free_group_depth += 1

    def free_group_end(self) -> None:
        """Close a group; the outermost close releases everything collected.

        Raises RuntimeError without a matching `free_group_begin()`.
        """
        if self._free_group_depth == 0:
            raise RuntimeError("free_group_end() without free_group_begin()")
        self._free_group_depth -= 1
        if self._free_group_depth > 0:
            return
        group, self._free_group = self._free_group, None
        for pages in group:
            self._released_pages.append(pages)
            self._num_released_pages += len(pages)

    def free_page_ids(self) -> torch.Tensor:
        """int64 CPU: every free page id (for integrity checks; not on a hot path)."""
        return torch.cat([self._free_pages, *self._released_pages])
