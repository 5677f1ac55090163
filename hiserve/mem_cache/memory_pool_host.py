"""The host KV pool (L2): a copy of device pages in host memory, pinned when the device is CUDA.

One buffer holds every layer of every host slot in one of three layouts (S host slots,
L layers, P tokens per page, H KV heads, Dh head dim, Dm = kv_lora_rank + qk_rope_head_dim):

| layout                         | MHA `kv_buffer`          | MLA `kv_buffer`       |
|--------------------------------|--------------------------|-----------------------|
| `layer_first`                  | `[2, L, S, H, Dh]`       | `[L, S, 1, Dm]`       |
| `page_first` (default)         | `[2, S, L, H, Dh]`       | `[S, L, 1, Dm]`       |
| `page_first_direct`            | `[2, S/P, L, P, H, Dh]`  | `[S/P, L, P, 1, Dm]`  |

Host slots are handed out a whole page at a time by the pool's own allocator, so every
page is P consecutive, page-aligned slots; the page-first copy paths rely on that.

Host indices (what `alloc` returns, what the radix tree keeps as `host_value`) are CPU
int64 tensors and stay on the CPU: the write-back enqueues its copies with host addresses
computed on the CPU, and turning a device tensor back into a CPU one (`.cpu()`) would block
the scheduler until every transfer queued before it had finished.

Sizes: names ending in `_bytes` are bytes; `size`, slots and `page_num` are counts.
`--hicache-size` is in GB (10**9 bytes) per rank, like SGLang's.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import threading
import weakref
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from hiserve.jit_kernel import hicache
from hiserve.jit_kernel.reference import WRITE_BACK_STAGING_PAGE_CHUNK, check_layout, host_kind_shape

if TYPE_CHECKING:
    from hiserve.mem_cache.memory_pool import KVCache, MHATokenToKVPool, MLATokenToKVPool

logger = logging.getLogger(__name__)

GB = 10**9
GiB = 1 << 30
# One cudaHostRegister call covers at most this much (very large single registrations
# fail on some drivers); chunk ends are rounded to whole pages so no copy spans two.
HOST_REGISTER_CHUNK_BYTES = 64 * GiB


# ----------------------------------------------------------------------------- sizing


def host_pool_slots(
    size_per_token_bytes: int,
    page_size: int,
    device_pool_size: int,
    host_to_device_ratio: float,
    host_size_gb: int,
) -> int:
    """Host slots S: `host_size_gb` GB worth of tokens when > 0, else ratio x device slots,
    rounded down to whole pages.

    Raises:
        ValueError: the result is less than one page.
    """
    if host_size_gb > 0:
        slots = int(host_size_gb * GB) // size_per_token_bytes
        asked = f"--hicache-size {host_size_gb} GB ({host_size_gb * GB} bytes)"
    else:
        slots = int(device_pool_size * host_to_device_ratio)
        asked = f"--hicache-ratio {host_to_device_ratio} x {device_pool_size} device slots"
    slots = slots // page_size * page_size
    if slots <= 0:
        raise ValueError(
            f"{asked} gives less than one host page ({page_size} tokens x {size_per_token_bytes} bytes "
            "per token); raise --hicache-size or --hicache-ratio"
        )
    return slots


def read_host_memory_bytes() -> tuple[int, int]:
    """(available, total) host memory in bytes: /proc/meminfo MemAvailable / MemTotal,
    further limited by a cgroup v2 memory limit when there is one."""
    available = total = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key == "MemAvailable":
                    available = int(rest.split()[0]) * 1024
                elif key == "MemTotal":
                    total = int(rest.split()[0]) * 1024
    except OSError:
        pass
    if available is None or total is None:
        page = os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PHYS_PAGES") * page
        available = os.sysconf("SC_AVPHYS_PAGES") * page
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if limit != "max":
            total = min(total, int(limit))
            available = min(available, max(int(limit) - used, 0))
    except (OSError, ValueError):
        pass
    return available, total


def host_memory_reserve_bytes(total_bytes: int) -> int:
    """Host memory left alone for the OS and the rest of the process: 10% of the total,
    at least 2 GiB, at most 10 GiB."""
    return max(2 * GiB, min(total_bytes // 10, 10 * GiB))


def write_back_staging_bytes(
    layout: str, device: torch.device, page_num: int | None, page_size: int, layer_num: int,
    item_bytes: int, num_buffers: int,
) -> int:
    """Device bytes of the write-back staging buffers (0 unless `page_first` on CUDA).

    `item_bytes` is one token of one layer of one buffer (K or V or the MLA row);
    `num_buffers` is 2 for MHA, 1 for MLA; `page_num` None means the 64-page upper bound
    (for budgeting before the host pool exists).
    """
    if layout != "page_first" or torch.device(device).type != "cuda":
        return 0
    capacity = WRITE_BACK_STAGING_PAGE_CHUNK if page_num is None else min(page_num, WRITE_BACK_STAGING_PAGE_CHUNK)
    return num_buffers * capacity * page_size * layer_num * item_bytes


# ----------------------------------------------------------------------------- pinned buffer


class _RegisteredHostMemory:
    """An exact-size anonymous mmap registered with CUDA (cudaHostRegister) chunk by chunk.

    torch's `pin_memory=True` goes through a caching allocator that rounds every request up
    to a power of two (a 20 GiB pool would take 32 GiB); an mmap is exactly the size asked.
    """

    def __init__(self, nbytes: int, granularity_bytes: int) -> None:
        self._mmap = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
        chunk = max(HOST_REGISTER_CHUNK_BYTES // granularity_bytes, 1) * granularity_bytes
        self._registered: list[int] = []
        base = self.tensor.data_ptr()
        cudart = torch.cuda.cudart()
        for offset in range(0, nbytes, chunk):
            length = min(chunk, nbytes - offset)
            err = int(cudart.cudaHostRegister(base + offset, length, 0))
            if err != 0:
                self.release()
                raise RuntimeError(
                    f"cudaHostRegister of {length} bytes at offset {offset} of a {nbytes}-byte host KV "
                    f"pool failed with cudaError {err}; lower --hicache-size / --hicache-ratio"
                )
            self._registered.append(base + offset)

    def release(self) -> None:
        """Unregister every chunk (idempotent). The memory itself goes with the last tensor view."""
        if not self._registered:
            return
        cudart = torch.cuda.cudart()
        for ptr in self._registered:
            err = int(cudart.cudaHostUnregister(ptr))
            if err != 0:
                logger.warning("cudaHostUnregister(0x%x) failed with cudaError %d", ptr, err)
        self._registered = []


# ----------------------------------------------------------------------------- pools


class HostKVCache(ABC):
    """Host pool of S slots in `layout`, with a page-granular slot allocator.

    Args:
        device_pool: the device pool (L1) this pool backs; gives dtype, layers, item shape, device.
        host_to_device_ratio: S = ratio x device slots when `host_size_gb` is 0.
        host_size_gb: S = this many GB (10**9 bytes) of tokens when > 0 (per rank).
        page_size: tokens per page; must equal the device pool's.
        layout: `layer_first`, `page_first` or `page_first_direct`.
        pin_memory: register the buffer with CUDA; None = yes exactly when the device is CUDA.
    Attributes:
        kv_buffer: the host buffer (see the module table), on the CPU, device dtype.
        size, page_num: host slots and pages. size_bytes: bytes of kv_buffer.
        staging_page_capacity, staging_buffer_bytes: the write-back staging buffers' size
            (0 / 0 unless page_first on CUDA); count staging_buffer_bytes in the device budget.
    Raises:
        ValueError: unknown layout, page size mismatch, less than one page, pinning without
            CUDA, or a pool that does not fit in available host memory minus a reserve.
    """

    num_buffers = 1  # kinds stored: 2 for MHA (K, V), 1 for MLA

    def __init__(
        self,
        device_pool: "KVCache",
        host_to_device_ratio: float,
        host_size_gb: int,
        page_size: int,
        layout: str = "page_first",
        pin_memory: bool | None = None,
    ) -> None:
        check_layout(layout)
        if page_size != device_pool.page_size:
            raise ValueError(f"host page_size={page_size} != device pool page_size={device_pool.page_size}")
        self.device_pool = device_pool
        self.dtype = device_pool.dtype
        self.layer_num = device_pool.layer_num
        self.page_size = page_size
        self.layout = layout
        self.device = torch.device("cpu")

        self.size_per_token_bytes = self.get_size_per_token_bytes()
        self.size = host_pool_slots(
            self.size_per_token_bytes, page_size, device_pool.size, host_to_device_ratio, host_size_gb
        )
        self.page_num = self.size // page_size
        self.size_bytes = self.size * self.size_per_token_bytes
        if self.size < device_pool.size:
            logger.warning(
                "host KV pool (%d slots) is smaller than the device pool (%d slots); little will stay "
                "cached on the host", self.size, device_pool.size)
        self._check_fits_in_host_memory(host_to_device_ratio, host_size_gb)

        on_cuda = device_pool.device.type == "cuda"
        self.pin_memory = on_cuda if pin_memory is None else pin_memory
        if self.pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory=True needs CUDA; the host pool of a CPU device pool is plain memory")
        self._registered: _RegisteredHostMemory | None = None
        self.kv_buffer = self._alloc_buffer(self.get_buffer_shape())
        self._finalizer = (
            weakref.finalize(self, self._registered.release) if self._registered is not None else None
        )

        self._lock = threading.Lock()
        self.clear()
        self._init_write_back_staging_buffers()
        logger.info(
            "host KV pool: %s, %d slots (%d pages of %d), %.2f GB%s, staging %d bytes",
            layout, self.size, self.page_num, page_size, self.size_bytes / GB,
            " pinned" if self.pin_memory else "", self.staging_buffer_bytes)

    # -- per-kind shape, defined by MHA / MLA

    @property
    @abstractmethod
    def item_shape(self) -> tuple[int, ...]:
        """Shape of one token of one layer of one kind: (H, Dh) for MHA, (1, Dm) for MLA."""
        ...

    def get_size_per_token_bytes(self) -> int:
        """Bytes of one token across all layers and kinds (MHA: 2*H*Dh*L*itemsize; MLA: Dm*L*itemsize)."""
        return self.num_buffers * math.prod(self.item_shape) * self.layer_num * self.dtype.itemsize

    def get_buffer_shape(self) -> tuple[int, ...]:
        kind = host_kind_shape(self.layout, self.size, self.layer_num, self.page_size, self.item_shape)
        return (2, *kind) if self.num_buffers == 2 else kind

    # -- memory

    def _check_fits_in_host_memory(self, host_to_device_ratio: float, host_size_gb: int) -> None:
        available, total = read_host_memory_bytes()
        reserve = host_memory_reserve_bytes(total)
        budget = available - reserve
        if self.size_bytes > budget:
            asked = (f"--hicache-size {host_size_gb}" if host_size_gb > 0
                     else f"--hicache-ratio {host_to_device_ratio} (x {self.device_pool.size} device slots)")
            raise ValueError(
                f"host KV pool of {self.size_bytes} bytes ({self.size_bytes / GB:.2f} GB) from {asked} does not "
                f"fit: host memory available {available} bytes ({available / GB:.2f} GB) minus a reserve of "
                f"{reserve} bytes ({reserve / GB:.2f} GB) leaves {max(budget, 0)} bytes "
                f"({max(budget, 0) / GB:.2f} GB); lower --hicache-size or --hicache-ratio"
            )

    def _alloc_buffer(self, shape: tuple[int, ...]) -> torch.Tensor:
        if not self.pin_memory:
            return torch.empty(shape, dtype=self.dtype)
        # Chunk boundaries at multiples of one page of all layers keep every page-first page
        # (and every layer_first / page_first_direct (page, layer) run) in one registration.
        granularity = self.page_size * self.layer_num * math.prod(self.item_shape) * self.dtype.itemsize
        self._registered = _RegisteredHostMemory(self.size_bytes, granularity)
        return self._registered.tensor.view(self.dtype).view(shape)

    def close(self) -> None:
        """Unregister pinned memory now (idempotent); the pool must not be used afterwards."""
        if self._finalizer is not None:
            self._finalizer()
        self._registered = None
        self.kv_buffer = None
        self._free_staging()

    # -- allocator (page granular, CPU int64 slot tensors)

    def clear(self) -> None:
        """Free every host slot."""
        with self._lock:
            self._free_pages = torch.arange(self.page_num, dtype=torch.int64)
            self._released: list[torch.Tensor] = []

    def available_size(self) -> int:
        """Free host slots."""
        with self._lock:
            return (self._free_pages.numel() + sum(p.numel() for p in self._released)) * self.page_size

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """Take `need_size` slots as whole pages, lowest free pages first.

        Returns:
            int64 `[need_size]` CPU tensor of slots (page-aligned runs of P), or None when
            fewer slots are free (nothing is taken).
        Raises:
            ValueError: need_size is not a multiple of page_size.
        """
        if need_size % self.page_size:
            raise ValueError(f"host alloc of {need_size} slots is not a multiple of page_size={self.page_size}")
        num_pages = need_size // self.page_size
        with self._lock:
            if num_pages > self._free_pages.numel() and self._released:
                self._merge_released()
            if num_pages > self._free_pages.numel():
                return None
            pages, self._free_pages = self._free_pages[:num_pages], self._free_pages[num_pages:]
        offsets = torch.arange(self.page_size, dtype=torch.int64)
        return (pages[:, None] * self.page_size + offsets).reshape(-1)

    def free(self, indices: torch.Tensor) -> None:
        """Return slots from `alloc` (whole pages, CPU). Merged into the sorted free list lazily,
        when an alloc finds the list too short."""
        if indices.device.type != "cpu":
            raise ValueError(f"host indices must be a CPU tensor, got {indices.device}")
        if indices.numel() % self.page_size:
            raise ValueError(f"freeing {indices.numel()} host slots, not a multiple of page_size={self.page_size}")
        if indices.numel() == 0:
            return
        pages = indices[:: self.page_size].to(torch.int64) // self.page_size
        with self._lock:
            self._released.append(pages)

    def _merge_released(self) -> None:
        self._free_pages = torch.cat([self._free_pages, *self._released]).sort().values
        self._released = []

    # -- staging buffers for the staged write-back

    def _init_write_back_staging_buffers(self) -> None:
        """On CUDA with `page_first`, allocate the device staging buffers once:
        `[capacity, P, L, *item]` per kind (K and V for MHA, one for MLA), capacity =
        min(page_num, 64) pages. Otherwise allocate nothing."""
        self._free_staging()
        device = self.device_pool.device
        item_bytes = math.prod(self.item_shape) * self.dtype.itemsize
        self.staging_buffer_bytes = write_back_staging_bytes(
            self.layout, device, self.page_num, self.page_size, self.layer_num, item_bytes, self.num_buffers)
        if self.staging_buffer_bytes == 0:
            return
        self.staging_page_capacity = min(self.page_num, WRITE_BACK_STAGING_PAGE_CHUNK)
        shape = (self.staging_page_capacity, self.page_size, self.layer_num, *self.item_shape)
        self.staging_buffers = [torch.empty(shape, dtype=self.dtype, device=device) for _ in range(self.num_buffers)]

    def _free_staging(self) -> None:
        self.staging_buffers: list[torch.Tensor] = []
        self.staging_page_capacity = 0
        self.staging_buffer_bytes = 0

    # -- transfers

    def _check_layer_id(self, layer_id: int) -> None:
        if not 0 <= layer_id < self.layer_num:
            raise ValueError(f"layer_id={layer_id} out of range for {self.layer_num} layers")

    @abstractmethod
    def backup_from_device_all_layer(
        self, device_pool: "KVCache", host_indices: torch.Tensor, device_indices: torch.Tensor, io_backend: str
    ) -> None:
        """Write-back: copy every layer of `device_indices` (device slots, on the device) into
        `host_indices` (host slots from `alloc`, CPU). Raises as `hicache.write_back_all_layer`."""
        ...

    @abstractmethod
    def load_to_device_per_layer(
        self,
        device_pool: "KVCache",
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        layer_id: int,
        io_backend: str,
    ) -> None:
        """Load-back of one layer: host slots `host_indices` (CPU) into device slots
        `device_indices` (on the device) of layer `layer_id`."""
        ...


class MHATokenToKVPoolHost(HostKVCache):
    """Host pool for `MHATokenToKVPool`: K and V, `kv_buffer` = `[2, *per-kind layout shape]`.

    Attributes (besides HostKVCache's): head_num, head_dim; k_buffer / v_buffer =
    kv_buffer[0] / kv_buffer[1]; staging_k / staging_v (None unless page_first on CUDA).
    """

    num_buffers = 2

    def __init__(
        self,
        device_pool: "MHATokenToKVPool",
        host_to_device_ratio: float,
        host_size_gb: int,
        page_size: int,
        layout: str = "page_first",
        pin_memory: bool | None = None,
    ) -> None:
        self.head_num = device_pool.head_num
        self.head_dim = device_pool.head_dim
        super().__init__(device_pool, host_to_device_ratio, host_size_gb, page_size, layout, pin_memory)

    @property
    def item_shape(self) -> tuple[int, ...]:
        return (self.head_num, self.head_dim)

    @property
    def k_buffer(self) -> torch.Tensor:
        return self.kv_buffer[0]

    @property
    def v_buffer(self) -> torch.Tensor:
        return self.kv_buffer[1]

    @property
    def staging_k(self) -> torch.Tensor | None:
        return self.staging_buffers[0] if self.staging_buffers else None

    @property
    def staging_v(self) -> torch.Tensor | None:
        return self.staging_buffers[1] if self.staging_buffers else None

    def backup_from_device_all_layer(self, device_pool: "KVCache", host_indices: torch.Tensor,
                                     device_indices: torch.Tensor, io_backend: str) -> None:
        hicache.write_back_all_layer(
            device_pool.k_buffer, device_pool.v_buffer, self.kv_buffer, self.layout,
            device_indices=device_indices, host_indices=host_indices, page_size=self.page_size,
            io_backend=io_backend, staging_k=self.staging_k, staging_v=self.staging_v,
        )

    def load_to_device_per_layer(self, device_pool: "KVCache", host_indices: torch.Tensor,
                                 device_indices: torch.Tensor, layer_id: int, io_backend: str) -> None:
        self._check_layer_id(layer_id)
        hicache.load_back_one_layer(
            self.kv_buffer, device_pool.k_buffer[layer_id], device_pool.v_buffer[layer_id], self.layout, layer_id,
            host_indices=host_indices, device_indices=device_indices, page_size=self.page_size,
            io_backend=io_backend,
        )


class MLATokenToKVPoolHost(HostKVCache):
    """Host pool for `MLATokenToKVPool`: one latent row per token and layer.

    Attributes (besides HostKVCache's): kv_lora_rank, qk_rope_head_dim, kv_dim (= Dm);
    staging (None unless page_first on CUDA).
    """

    num_buffers = 1

    def __init__(
        self,
        device_pool: "MLATokenToKVPool",
        host_to_device_ratio: float,
        host_size_gb: int,
        page_size: int,
        layout: str = "page_first",
        pin_memory: bool | None = None,
    ) -> None:
        self.kv_lora_rank = device_pool.kv_lora_rank
        self.qk_rope_head_dim = device_pool.qk_rope_head_dim
        self.kv_dim = self.kv_lora_rank + self.qk_rope_head_dim
        super().__init__(device_pool, host_to_device_ratio, host_size_gb, page_size, layout, pin_memory)

    @property
    def item_shape(self) -> tuple[int, ...]:
        return (1, self.kv_dim)

    @property
    def staging(self) -> torch.Tensor | None:
        return self.staging_buffers[0] if self.staging_buffers else None

    def backup_from_device_all_layer(self, device_pool: "KVCache", host_indices: torch.Tensor,
                                     device_indices: torch.Tensor, io_backend: str) -> None:
        hicache.write_back_all_layer_mla(
            device_pool.kv_buffer, self.kv_buffer, self.layout,
            device_indices=device_indices, host_indices=host_indices, page_size=self.page_size,
            io_backend=io_backend, staging=self.staging,
        )

    def load_to_device_per_layer(self, device_pool: "KVCache", host_indices: torch.Tensor,
                                 device_indices: torch.Tensor, layer_id: int, io_backend: str) -> None:
        self._check_layer_id(layer_id)
        hicache.load_back_one_layer_mla(
            self.kv_buffer, device_pool.kv_buffer[layer_id], self.layout, layer_id,
            host_indices=host_indices, device_indices=device_indices, page_size=self.page_size,
            io_backend=io_backend,
        )

