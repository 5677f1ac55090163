"""Shared set-up of the HiRadixCache tests: small real CPU (or CUDA) pools whose KV rows encode
(token, layer), so a load-back can be checked by comparing pool contents, and a tiny driver of
the request hooks."""

from __future__ import annotations

from dataclasses import dataclass, field

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
