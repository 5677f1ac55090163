"""A tiny scheduler for the radix-cache tests: it drives the cache's request hooks (match,
lock, chunked prefill, decode, finish) on real pools, as the engine's scheduler does.
`RadixCache` tests use `Driver`; the HiRadixCache tests subclass it for load-back and
KV contents (test/unit/hiradix_helpers.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class FakeReq:
    """The request fields the cache uses (test data, not engine code)."""

    origin_input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    fill_ids: list[int] = field(default_factory=list)
    req_pool_idx: int = -1
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None
    loaded: int = 0  # tokens loaded back from the host tier at admission


class Driver:
    """Plays the scheduler's part: admit (match + lock), prefill in chunks, decode, finish."""

    decode_steps = 3

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self.rtt = cache.req_to_token_pool
        self.alloc = cache.token_to_kv_pool_allocator
        self.next_token = 1000

    def match(self, req: FakeReq) -> None:
        """Set the request's cached prefix. At least one input token must be computed, so
        match all but the last."""
        match = self.cache.match_prefix(req.origin_input_ids[:-1])
        req.prefix_indices, req.last_node = match.device_indices, match.last_device_node

    def admit(self, req: FakeReq) -> None:
        self.match(req)
        self.cache.inc_lock_ref(req.last_node)
        req.req_pool_idx = self.rtt.alloc(1)[0]
        self.rtt.req_to_token[req.req_pool_idx, : len(req.prefix_indices)] = req.prefix_indices.int()

    def write(self, slots: torch.Tensor, tokens: list[int]) -> None:
        """Fill the KV of newly computed slots (nothing here: these tests never read KV)."""

    def extend(self, req: FakeReq, end: int) -> None:
        """Compute positions len(prefix_indices)..end-1 of the input."""
        row = self.rtt.req_to_token[req.req_pool_idx]
        start = len(req.prefix_indices)
        last_loc = int(row[start - 1]) if start > 0 else -1
        slots = self.alloc.alloc_extend([start], [end], [last_loc])
        assert slots is not None
        row[start:end] = slots.int()
        self.write(slots, req.origin_input_ids[start:end])
        req.fill_ids = req.origin_input_ids[:end]

    def prefill(self, req: FakeReq, chunk: int | None = None, stop_after_chunks: int | None = None) -> None:
        """Prefill in chunks of `chunk` tokens (all at once by default); with
        `stop_after_chunks`, leave the prompt unfinished after that many cached chunks."""
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
            self.write(slot, [req.output_ids[-1]])
            req.output_ids.append(self.new_token())
            req.fill_ids = (req.origin_input_ids + req.output_ids)[:-1]  # positions with KV

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

    def finish(self, req: FakeReq) -> None:
        self.cache.cache_finished_req(req)

    def run(self, req: FakeReq, decode_steps: int | None = None, chunk: int | None = None) -> FakeReq:
        self.admit(req)
        self.prefill(req, chunk)
        self.decode(req, self.decode_steps if decode_steps is None else decode_steps)
        self.finish(req)
        return req
