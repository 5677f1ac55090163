"""One constructor for the whole KV hierarchy: sizes in, pools + allocator + host tier +
controller + prefix cache out.

    KVSpec (shapes and sizes)  ──build_kv_hierarchy──▶  KVHierarchy
        req_to_token_pool        ReqToTokenPool            request rows → slots
        device_pool              MHA/MLATokenToKVPool      L1
        allocator                TokenToKVPoolAllocator    free device pages
        host_pool                MHA/MLATokenToKVPoolHost  L2 (with the hierarchical cache)
        controller               HiCacheController         L1 ⇄ L2 copies
        storage                  StorageController         L2 ⇄ L3 (with a storage backend)
        cache                    ChunkCache | RadixCache | HiRadixCache

The model runner only says how many device tokens fit (`cell_size_bytes` and
`reserved_device_bytes` help it decide) and hands the device pool to its attention
backends; everything else about the hierarchy is built here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from hiserve.mem_cache.allocator import ReqToTokenPool, TokenToKVPoolAllocator
from hiserve.mem_cache.memory_pool import KVCache, MHATokenToKVPool, MLATokenToKVPool
from hiserve.mem_cache.prefix_cache import ChunkCache, PrefixCache
from hiserve.mem_cache.radix_cache import RadixCache

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVSpec:
    """Shapes and sizes of the hierarchy.

    Attributes:
        num_tokens: device pool capacity in tokens (rounded down to whole pages).
        page_size: tokens per page.
        dtype: KV element dtype.
        device: where the device pool lives.
        layer_num: attention layers.
        num_kv_heads, head_dim: MHA shapes (ignored for MLA).
        kv_lora_rank, qk_rope_head_dim: MLA shapes (kv_lora_rank None or 0: MHA).
        max_running_requests: rows of `req_to_token`.
        max_context_len: columns of `req_to_token`.
        disable_radix_cache: no prefix sharing (ChunkCache).
        enable_hierarchical_cache: back the device pool with a host pool (HiRadixCache).
        hicache_ratio, hicache_size: host pool size (x device pool, or GB per rank when > 0).
        hicache_mem_layout, hicache_io_backend, hicache_write_policy: see --help.
        hicache_storage_backend: "file" / "mooncake" / None (no L3).
        hicache_storage_prefetch_policy: best_effort / wait_complete / timeout.
        hicache_storage_extra_config: the JSON text (or "@file") of
            --hicache-storage-backend-extra-config, or None.
        model_identity: what names the model's KV in storage keys (model path incl. the
            GGUF file, weight format, seed of dummy weights).
    """

    num_tokens: int
    page_size: int
    dtype: torch.dtype
    device: torch.device
    layer_num: int
    num_kv_heads: int = 0
    head_dim: int = 0
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int = 0
    max_running_requests: int = 256
    max_context_len: int = 4096
    disable_radix_cache: bool = False
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0
    hicache_size: int = 0
    hicache_mem_layout: str = "page_first"
    hicache_io_backend: str = "kernel"
    hicache_write_policy: str = "write_through"
    hicache_storage_backend: str | None = None
    hicache_storage_prefetch_policy: str = "timeout"
    hicache_storage_extra_config: str | None = None
    model_identity: str = ""

    @property
    def is_mla(self) -> bool:
        return bool(self.kv_lora_rank)


@dataclass
class KVHierarchy:
    """Everything that holds KV or says who owns it (see the module docstring)."""

    spec: KVSpec
    req_to_token_pool: ReqToTokenPool
    device_pool: KVCache
    allocator: TokenToKVPoolAllocator
    cache: PrefixCache
    host_pool: object | None = None
    controller: object | None = None
    storage: object | None = None

    def close(self, run_queued: bool = True) -> None:
        """Stop the storage worker (after its queued ops, unless `run_queued` is False: a
        process exit) and release the host pool's registered memory (CUDA); idempotent."""
        if self.storage is not None:
            if not self.storage.close(run_queued=run_queued, timeout=60.0 if run_queued else 3.0):
                return  # a transfer may still use the host pool: leave it to the process exit
        if self.host_pool is not None:
            self.host_pool.close()


def cell_size_bytes(spec: KVSpec) -> int:
    """Device KV bytes of one token across all layers."""
    if spec.is_mla:
        return MLATokenToKVPool.cell_size_bytes(spec.kv_lora_rank, spec.qk_rope_head_dim,
                                                spec.layer_num, spec.dtype)
    return MHATokenToKVPool.cell_size_bytes(spec.num_kv_heads, spec.head_dim, spec.layer_num, spec.dtype)


def reserved_device_bytes(spec: KVSpec) -> int:
    """Device bytes the hierarchy needs besides the KV pool (the host tier's write-back
    staging buffers, bounded at 64 pages), to keep out of the pool's budget."""
    if not spec.enable_hierarchical_cache:
        return 0
    from hiserve.mem_cache.host_memory import write_back_staging_bytes

    itemsize = torch.empty((), dtype=spec.dtype).element_size()
    if spec.is_mla:
        item_bytes, num_buffers = (spec.kv_lora_rank + spec.qk_rope_head_dim) * itemsize, 1
    else:
        item_bytes, num_buffers = spec.num_kv_heads * spec.head_dim * itemsize, 2
    return write_back_staging_bytes(spec.hicache_mem_layout, spec.device, None, spec.page_size,
                                    spec.layer_num, item_bytes, num_buffers)


def _device_pool(spec: KVSpec, size: int) -> KVCache:
    if spec.is_mla:
        return MLATokenToKVPool(size, spec.page_size, spec.dtype, spec.kv_lora_rank,
                                spec.qk_rope_head_dim, spec.layer_num, spec.device)
    return MHATokenToKVPool(size, spec.page_size, spec.dtype, spec.num_kv_heads, spec.head_dim,
                            spec.layer_num, spec.device)


def _storage_tier(spec: KVSpec, host_pool) -> tuple[object | None, str, object | None]:
    """The storage worker around a backend (`storage.create_storage`), its key namespace
    and its config; (None, "", None) without --hicache-storage-backend."""
    if spec.hicache_storage_backend is None:
        return None, "", None
    from hiserve.mem_cache.storage import create_storage, parse_extra_config
    from hiserve.mem_cache.storage.keys import storage_namespace
    from hiserve.mem_cache.storage_controller import StorageConfig, StorageController
    from hiserve.distributed import get_tp_group

    extra = parse_extra_config(spec.hicache_storage_extra_config)
    config = StorageConfig.from_extra_config(spec.hicache_storage_prefetch_policy, extra)
    kinds = [(k.name, k.item_shape) for k in host_pool.kinds]
    # TP: an MHA rank's pages hold only its heads (its own namespace); MLA's latent is the
    # same on every rank and at TP=1 (one namespace, written by rank 0: hiradix_storage.py).
    tp = get_tp_group()
    ns_extra = f"tp_rank={tp.rank}/tp_size={tp.size}" if tp.size > 1 and not spec.is_mla else ""
    namespace = storage_namespace(
        spec.model_identity, str(spec.dtype).replace("torch.", ""), spec.page_size, host_pool.layout,
        kinds, spec.layer_num, ns_extra)
    backend = create_storage(spec.hicache_storage_backend, host_pool, namespace, extra)
    logger.info("storage tier: %s, namespace %s, prefetch %s (threshold %d tokens)",
                spec.hicache_storage_backend, namespace, config.prefetch_policy, config.prefetch_threshold)
    return StorageController(backend, config.batch_pages), namespace, config


def _hierarchical_cache(spec: KVSpec, device_pool: KVCache) -> tuple[PrefixCache, object, object, object]:
    from hiserve.mem_cache.cache_controller import HiCacheController
    from hiserve.mem_cache.hiradix_cache import HiRadixCache
    from hiserve.mem_cache.memory_pool_host import MHATokenToKVPoolHost, MLATokenToKVPoolHost

    host_cls = MLATokenToKVPoolHost if spec.is_mla else MHATokenToKVPoolHost
    host_pool = host_cls(device_pool, spec.hicache_ratio, spec.hicache_size, spec.page_size,
                         spec.hicache_mem_layout)
    controller = HiCacheController(device_pool, host_pool, spec.hicache_io_backend)
    storage, namespace, config = _storage_tier(spec, host_pool)
    cache = HiRadixCache(spec.page_size, controller, write_policy=spec.hicache_write_policy,
                         storage=storage, storage_namespace=namespace, storage_config=config)
    return cache, host_pool, controller, storage


def build_kv_hierarchy(spec: KVSpec) -> KVHierarchy:
    """Build the hierarchy described by `spec`.

    Raises:
        ValueError: the pool holds fewer than two pages, a host pool does not fit in host
            memory, or the storage tier's config is invalid (the message names the flags).
    """
    size = spec.num_tokens // spec.page_size * spec.page_size
    if size < 2 * spec.page_size:
        raise ValueError(f"--max-total-tokens {size} is too small for --page-size {spec.page_size}")
    # The padding row is the request row of the dummy requests padding a CUDA-graph batch.
    rtt = ReqToTokenPool(spec.max_running_requests, spec.max_context_len, spec.device, padding_row=True)
    device_pool = _device_pool(spec, size)
    allocator = TokenToKVPoolAllocator(size, spec.page_size, spec.device, device_pool)
    host_pool = controller = storage = None
    if spec.enable_hierarchical_cache:
        cache, host_pool, controller, storage = _hierarchical_cache(spec, device_pool)
    elif spec.disable_radix_cache:
        cache = ChunkCache(spec.page_size)
    else:
        cache = RadixCache(spec.page_size)
    logger.info("KV pool: %d tokens, %.1f MB; %d request rows; prefix cache: %s", size,
                size * cell_size_bytes(spec) / 1e6, spec.max_running_requests, type(cache).__name__)
    return KVHierarchy(spec, rtt, device_pool, allocator, cache, host_pool, controller, storage)
