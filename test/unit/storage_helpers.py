"""Set-up of the storage-tier integration tests: the hiradix test pools (KV rows encode
(token, layer)) with a real `FileStorage` in a temporary directory behind a real storage
worker, and backends slowed or broken by subclassing FileStorage (a real backend, slowed)."""

from __future__ import annotations

import threading
import time

import torch

from hiserve.mem_cache.allocator import ReqToTokenPool, TokenToKVPoolAllocator
from hiserve.mem_cache.cache_controller import HiCacheController
from hiserve.mem_cache.hierarchy import KVHierarchy, KVSpec
from hiserve.mem_cache.hiradix_cache import HiRadixCache
from hiserve.mem_cache.kv_manager import KVManager
from hiserve.mem_cache.memory_pool import MHATokenToKVPool
from hiserve.mem_cache.memory_pool_host import MHATokenToKVPoolHost
from hiserve.mem_cache.storage.file_backend import FileStorage
from hiserve.mem_cache.storage.keys import storage_namespace
from hiserve.mem_cache.storage_controller import StorageConfig, StorageController

from hiradix_helpers import HEAD_DIM, HEADS, LAYERS, POOL_SIZE

PAGE = 4


class GatedFileStorage(FileStorage):
    """FileStorage whose reads wait for a permit per `batch_get_into` call (the test hands
    them out), so a prefetch can be observed half way."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.permits = threading.Semaphore(0)
        self.calls = 0

    def batch_get_into(self, keys: list[str], host_pages: list[int]) -> int:
        self.permits.acquire()
        self.calls += 1
        return super().batch_get_into(keys, host_pages)


class WriteGatedFileStorage(FileStorage):
    """FileStorage whose writes wait for a permit per `batch_set_from` call."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.permits = threading.Semaphore(0)

    def batch_set_from(self, keys: list[str], host_pages: list[int]) -> int:
        self.permits.acquire()
        return super().batch_set_from(keys, host_pages)


class RaisingFileStorage(FileStorage):
    """A backend that breaks the contract by raising: the worker must count it as a miss."""

    def batch_exists(self, keys: list[str]) -> int:
        raise RuntimeError("backend exploded")

    def batch_set_from(self, keys: list[str], host_pages: list[int]) -> int:
        raise RuntimeError("backend exploded")


def make_storage_kv(path: str, policy: str = "timeout", backend_cls: type = FileStorage,
                    threshold: int = 8, batch_pages: int = 2, timeout_base: float = 1.0,
                    timeout_per_ki: float = 0.25, ratio: float = 4.0, **extra) -> KVManager:
    """A KVManager over MHA pools (page 4) with `backend_cls` storing under `path`."""
    spec = KVSpec(num_tokens=POOL_SIZE, page_size=PAGE, dtype=torch.float32, device=torch.device("cpu"),
                  layer_num=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM, max_running_requests=8,
                  max_context_len=256, enable_hierarchical_cache=True, hicache_ratio=ratio,
                  hicache_io_backend="direct", hicache_storage_backend="file",
                  hicache_storage_prefetch_policy=policy)
    pool = MHATokenToKVPool(POOL_SIZE, PAGE, torch.float32, HEADS, HEAD_DIM, LAYERS, "cpu")
    host = MHATokenToKVPoolHost(pool, ratio, 0, PAGE, "page_first")
    ns = storage_namespace("test-model", "float32", PAGE, host.layout,
                           [(k.name, k.item_shape) for k in host.kinds], LAYERS)
    backend = backend_cls(host, ns, {"file_storage_path": str(path), **extra})
    config = StorageConfig(policy, threshold, timeout_base, timeout_per_ki, batch_pages=batch_pages)
    storage = StorageController(backend, batch_pages)
    controller = HiCacheController(pool, host, "direct")
    cache = HiRadixCache(PAGE, controller, storage=storage, storage_namespace=ns, storage_config=config)
    allocator = TokenToKVPoolAllocator(POOL_SIZE, PAGE, "cpu", kvcache=pool)
    rtt = ReqToTokenPool(size=8, max_context_len=256, device="cpu")
    return KVManager(KVHierarchy(spec, rtt, pool, allocator, cache, host, controller, storage))


def settle(kv: KVManager, until=None, timeout: float = 10.0) -> None:
    """Poll until the storage worker is idle and every op came back (or `until()` holds)."""
    deadline = time.monotonic() + timeout
    storage = kv.prefix_cache.storage
    while time.monotonic() < deadline:
        kv.poll()
        if until is not None and until():
            return
        if until is None and storage.in_flight() == 0:
            return
        time.sleep(0.005)
    raise TimeoutError("storage ops did not finish")


def backend(kv: KVManager) -> FileStorage:
    return kv.prefix_cache.storage.backend
