"""A tiny scheduler for the prefix-cache tests: it drives a real `KVManager` (match, lock,
admit, chunked prefill, decode, finish, abort) on real pools, as the engine's scheduler does,
and checks the manager's integrity after every step. `RadixCache` / `ChunkCache` tests use
`Driver`; the HiRadixCache tests subclass it to give computed slots KV contents
(test/unit/hiradix_helpers.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hiserve.mem_cache.kv_manager import KVManager, ReqKV


@dataclass
class FakeReq:
    """The request fields the KV manager uses (test data, not engine code)."""

    origin_input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    fill_ids: list[int] = field(default_factory=list)
    kv: ReqKV = field(default_factory=ReqKV)
    loaded: int = 0  # tokens loaded back from the host tier at the latest admission


class Driver:
    """Plays the scheduler's part through the KV manager: admit (match + lock + admit),
    prefill in chunks, decode, finish, abort, retract."""

    decode_steps = 3

    def __init__(self, kv: KVManager) -> None:
        self.kv = kv
        self.cache = kv.prefix_cache
        self.rtt = kv.rtt
        self.alloc = kv.allocator
        self.next_token = 1000

    def check(self) -> None:
        self.kv.check_integrity()

    def prefix(self, req: FakeReq) -> torch.Tensor:
        """Slots of the positions that held KV when the request's current round started."""
        return self.rtt.slots(req.kv.row, 0, req.kv.prefix_len)

    def row(self, req: FakeReq) -> torch.Tensor:
        """The request's req_to_token row (CPU mirror)."""
        return self.rtt.req_to_token_cpu[req.kv.row]

    def admit(self, req: FakeReq) -> None:
        """Match (all but the last token: at least one must be computed), lock, admit
        (which loads back a host hit) and start the queued loads."""
        req.fill_ids = req.origin_input_ids + req.output_ids
        self.kv.match(req)
        self.kv.lock(req)
        req.loaded = self.kv.admit(req)
        self.kv.start_loads()
        self.check()

    def write(self, slots: torch.Tensor, tokens: list[int]) -> None:
        """Fill the KV of newly computed slots (nothing here: these tests never read KV)."""

    def extend(self, req: FakeReq, end: int) -> None:
        """Compute positions kv.prefix_len..end-1 of prompt + output."""
        tokens = req.origin_input_ids + req.output_ids
        start = req.kv.prefix_len
        req.fill_ids = tokens[:end]
        slots = self.kv.alloc_extend([req])
        assert len(slots) == end - start
        assert torch.equal(self.rtt.slots(req.kv.row, start, end), slots)
        self.write(slots, tokens[start:end])
        self.check()

    def cache_unfinished(self, req: FakeReq) -> None:
        self.kv.cache(req, finished=False)
        self.check()

    def prefill(self, req: FakeReq, chunk: int | None = None, stop_after_chunks: int | None = None) -> None:
        """Prefill in chunks of `chunk` tokens (all at once by default); with
        `stop_after_chunks`, leave the prompt unfinished after that many cached chunks.
        Once the prompt is done, sample a token and cache the prompt unfinished, as the
        scheduler does for a request that goes on decoding."""
        n = len(req.origin_input_ids) + len(req.output_ids)
        chunk = chunk or n
        chunks = 0
        while True:
            end = min(req.kv.prefix_len + chunk, n)
            self.extend(req, end)
            if end == n:
                break
            self.cache_unfinished(req)
            chunks += 1
            if stop_after_chunks is not None and chunks >= stop_after_chunks:
                return
        req.output_ids.append(self.new_token())
        self.cache_unfinished(req)

    def decode(self, req: FakeReq, steps: int) -> None:
        for _ in range(steps):
            seq_len = len(req.origin_input_ids) + len(req.output_ids)
            slot = self.kv.alloc_decode([req])
            assert len(slot) == 1 and int(self.row(req)[seq_len - 1]) == int(slot[0])
            self.write(slot, [req.output_ids[-1]])
            req.output_ids.append(self.new_token())
            req.fill_ids = (req.origin_input_ids + req.output_ids)[:-1]  # positions with KV
            self.check()

    def abort_chunked(self, req: FakeReq) -> None:
        """What the scheduler does for an aborted unfinished prompt: release everything."""
        self.kv.release(req)
        assert req.kv.row is None and req.kv.handle is None
        self.check()

    def retract(self, req: FakeReq) -> None:
        """What the scheduler does to a running request when decode runs out of room: its
        KV goes into the cache (unlocked) and it waits to be admitted again."""
        self.kv.cache(req, finished=True)
        assert req.kv.row is None and req.kv.handle is None
        self.kv.poll()
        self.check()

    def new_token(self) -> int:
        self.next_token += 1
        return self.next_token

    def finish(self, req: FakeReq) -> None:
        self.kv.cache(req, finished=True)
        assert req.kv.row is None and req.kv.handle is None
        self.kv.poll()
        self.check()

    def run(self, req: FakeReq, decode_steps: int | None = None, chunk: int | None = None) -> FakeReq:
        self.admit(req)
        self.prefill(req, chunk)
        self.decode(req, self.decode_steps if decode_steps is None else decode_steps)
        self.finish(req)
        return req
