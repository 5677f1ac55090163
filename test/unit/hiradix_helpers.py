"""Shared set-up of the HiRadixCache tests: small real CPU (or CUDA) pools whose KV rows encode
(token, layer), so a load-back can be checked by comparing pool contents, and a tiny driver of
the request hooks."""

from __future__ import annotations

import torch

from hiserve.mem_cache.allocator import ReqToTokenPool, TokenToKVPoolAllocator
from hiserve.mem_cache.hiradix_cache import HiRadixCache
from hiserve.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from hiserve.mem_cache.memory_pool_host import MHATokenToKVPoolHost, MLATokenToKVPoolHost

from cache_driver import Driver, FakeReq

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


# ---- the shared test scheduler, with load-back and KV contents ------------------------


class HiDriver(Driver):
    """`cache_driver.Driver` for a HiRadixCache: admission loads host hits back, computed
    slots get their (token, layer) KV rows, and finishing processes the controller's acks."""

    decode_steps = 2

    def match(self, req: FakeReq) -> None:
        match = self.cache.match_prefix(req.origin_input_ids[:-1])
        req.prefix_indices, req.last_node = match.device_indices, match.last_device_node
        if match.host_hit_length:
            loaded, last = self.cache.init_load_back(match.last_host_node, match.host_hit_length)
            if len(loaded):
                req.prefix_indices = torch.cat([req.prefix_indices, loaded])
                req.last_node, req.loaded = last, len(loaded)
        self.cache.ready_to_load_host_cache()

    def write(self, slots: torch.Tensor, tokens: list[int]) -> None:
        write_kv(self.cache, slots, tokens)

    def finish(self, req: FakeReq) -> None:
        super().finish(req)
        self.cache.check_hicache_events()
