"""Shared set-up of the HiRadixCache tests: small real CPU (or CUDA) pools whose KV rows encode
(token, layer), so a load-back can be checked by comparing pool contents, wrapped in a
KVHierarchy and driven through a KVManager (cache_driver.Driver)."""

from __future__ import annotations

import torch

from hiserve.mem_cache.allocator import ReqToTokenPool, TokenToKVPoolAllocator
from hiserve.mem_cache.cache_controller import HiCacheController
from hiserve.mem_cache.hierarchy import KVHierarchy, KVSpec
from hiserve.mem_cache.hiradix_cache import DEFAULT_LOAD_BACK_THRESHOLD, HiRadixCache
from hiserve.mem_cache.kv_manager import KVManager
from hiserve.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from hiserve.mem_cache.memory_pool_host import MHATokenToKVPoolHost, MLATokenToKVPoolHost

from cache_driver import Driver, FakeReq

POOL_SIZE = 64
LAYERS, HEADS, HEAD_DIM = 2, 2, 4  # 32-byte items: the CUDA kernels need 16-byte multiples
KV_LORA_RANK, ROPE_DIM = 4, 4


def make_hierarchy(page_size: int = 1, policy: str = "write_through", kind: str = "MHA",
                   layout: str = "page_first", ratio: float = 2.0, device: str = "cpu",
                   io_backend: str = "direct", load_back_threshold: int = DEFAULT_LOAD_BACK_THRESHOLD,
                   controller_cls: type = HiCacheController) -> KVHierarchy:
    """Hand-built pools (a `controller_cls` subclass can hold acks back) in a KVHierarchy."""
    mla = kind != "MHA"
    spec = KVSpec(num_tokens=POOL_SIZE, page_size=page_size, dtype=torch.float32,
                  device=torch.device(device), layer_num=LAYERS, num_kv_heads=HEADS,
                  head_dim=HEAD_DIM, kv_lora_rank=KV_LORA_RANK if mla else None,
                  qk_rope_head_dim=ROPE_DIM if mla else 0, max_running_requests=8,
                  max_context_len=128, enable_hierarchical_cache=True, hicache_ratio=ratio,
                  hicache_mem_layout=layout, hicache_io_backend=io_backend,
                  hicache_write_policy=policy)
    if mla:
        pool = MLATokenToKVPool(POOL_SIZE, page_size, torch.float32, KV_LORA_RANK, ROPE_DIM, LAYERS,
                                device)
        host = MLATokenToKVPoolHost(pool, ratio, 0, page_size, layout)
    else:
        pool = MHATokenToKVPool(POOL_SIZE, page_size, torch.float32, HEADS, HEAD_DIM, LAYERS, device)
        host = MHATokenToKVPoolHost(pool, ratio, 0, page_size, layout)
    allocator = TokenToKVPoolAllocator(POOL_SIZE, page_size, device, kvcache=pool)
    rtt = ReqToTokenPool(size=8, max_context_len=128, device=device)
    controller = controller_cls(pool, host, io_backend)
    cache = HiRadixCache(page_size, controller, write_policy=policy,
                         load_back_threshold=load_back_threshold)
    return KVHierarchy(spec, rtt, pool, allocator, cache, host, controller)


def make_kv(**kwargs) -> KVManager:
    return KVManager(make_hierarchy(**kwargs))


def pool_of(kv: KVManager):
    return kv.h.device_pool


def kv_rows(kv: KVManager, tokens: list[int]) -> list[torch.Tensor]:
    """The KV a token sequence 'computes': every buffer row encodes (token, layer, buffer)."""
    pool = pool_of(kv)
    t = torch.tensor(tokens, dtype=torch.float32, device=pool.device)
    rows = []
    for b, buf in enumerate(pool.buffers()):
        shape = (len(tokens), *buf.shape[1:])
        rows.append((t * 100 + b).view(-1, *([1] * (len(shape) - 1))).expand(shape).clone())
    return rows


def write_kv(kv: KVManager, slots: torch.Tensor, tokens: list[int]) -> None:
    idx = slots.to(pool_of(kv).device)
    for buf, rows in zip(pool_of(kv).buffers(), kv_rows(kv, tokens)):
        buf[idx] = rows


def read_kv(kv: KVManager, slots: torch.Tensor) -> list[torch.Tensor]:
    idx = slots.to(pool_of(kv).device)
    return [buf[idx].clone() for buf in pool_of(kv).buffers()]


def insert_fresh(kv: KVManager, key: list[int]) -> torch.Tensor:
    """Allocate slots for `key`, 'compute' their KV, insert; the tree owns the new part and
    the duplicates go back to the allocator (the tree never frees)."""
    slots = kv.allocator.alloc(len(key))
    write_kv(kv, slots, key)
    res = kv.prefix_cache.insert(key, slots)
    kv.allocator.free(slots[:res.cached_len])
    return slots


def evict(kv: KVManager, num_tokens: int) -> torch.Tensor:
    """Device eviction; frees what it returns (the caller's job now)."""
    freed = kv.prefix_cache.evict(num_tokens)
    kv.allocator.free(freed)
    return freed


def host_tokens_in_tree(cache: HiRadixCache) -> int:
    total, stack = 0, [cache.root_node]
    while stack:
        node = stack.pop()
        if node is not cache.root_node and node.host_value is not None:
            total += len(node.host_value)
        stack.extend(node.children.values())
    return total


def assert_consistent(kv: KVManager, own_device_tokens: int = 0) -> None:
    """Every device slot is free, in the tree, pending or owned by a request; every host
    slot is free or held by exactly one node; and the manager's integrity check agrees."""
    cache = kv.prefix_cache
    assert cache.evictable_size() + cache.protected_size() == cache.total_size()
    assert (kv.allocator.available_size() + cache.total_size() + cache.pending_slots()
            + own_device_tokens) == POOL_SIZE
    assert host_tokens_in_tree(cache) == cache.host_used_size()
    kv.check_integrity()


def assert_everything_freed(kv: KVManager) -> None:
    """Nothing locked; evicting both tiers returns every device and host slot exactly once."""
    cache = kv.prefix_cache
    kv.poll()
    assert cache.protected_size() == 0
    kv.check_integrity()
    total = cache.total_size()
    assert len(evict(kv, total)) + cache.pending_slots() == total
    kv.allocator.free(cache.wait_pending())
    cache.evict_host(cache.host_total_size())
    assert not cache.root_node.children
    kv.check_integrity()
    host = cache.mem_pool_host
    assert kv.allocator.available_size() == POOL_SIZE
    assert host.available_size() == host.size
    P = cache.page_size
    assert sorted(kv.allocator.alloc(POOL_SIZE).tolist()) == list(range(P, P + POOL_SIZE))
    assert sorted(host.alloc(host.size).tolist()) == list(range(host.size))
    kv.allocator.clear()
    host.clear()


def evict_to_host(kv: KVManager) -> None:
    kv.poll()
    evict(kv, kv.prefix_cache.total_size())
    assert kv.prefix_cache.total_size() == 0
    kv.check_integrity()


# ---- the shared test scheduler, with KV contents --------------------------------------


class HiDriver(Driver):
    """`cache_driver.Driver` whose computed slots get their (token, layer) KV rows, so a
    later load-back can be compared with what was computed."""

    decode_steps = 2

    def write(self, slots: torch.Tensor, tokens: list[int]) -> None:
        write_kv(self.kv, slots, tokens)
