"""The host KV pool (L2): a copy of device pages in host memory, pinned when the device is CUDA.

The pool stores the device pool's *kinds* (`KVCache.kv_kinds()`): K and V for MHA, one
latent row for MLA. Each kind has its own host buffer (`kv_buffers[i]`) holding every layer
of S host slots in one of three layouts (L layers, P tokens per page, item = `(H, Dh)` for
MHA, `(1, Dm)` for MLA with Dm = kv_lora_rank + qk_rope_head_dim):

| layout                         | per-kind buffer          | one page of one kind         |
|--------------------------------|--------------------------|------------------------------|
| `layer_first`                  | `[L, S, *item]`          | L runs of P tokens           |
| `page_first` (default)         | `[S, L, *item]`          | one contiguous `[P, L, *item]` |
| `page_first_direct`            | `[S/P, L, P, *item]`     | one contiguous `[L, P, *item]` |

All kinds share one allocation (`buffer`), kind after kind. In the page-first layouts a
page of a kind is one contiguous object (`page_object`, `page_byte_range`): what a storage
tier reads and writes zero-copy.

Host slots are handed out a whole page at a time by the pool's own allocator, so every
page is P consecutive, page-aligned slots; the page-first copy paths rely on that.

Host indices (what `alloc` returns, what the radix tree keeps as `host_value`) are CPU
int64 tensors and stay on the CPU: the write-back enqueues its copies with host addresses
computed on the CPU, and turning a device tensor back into a CPU one (`.cpu()`) would block
the scheduler until every transfer queued before it had finished.

Sizing and the pinned buffer: `host_memory.py`.
"""

from __future__ import annotations

import logging
import math
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hiserve.jit_kernel import hicache
from hiserve.jit_kernel.reference import WRITE_BACK_STAGING_PAGE_CHUNK, KVKind, check_layout, host_kind_shape
from hiserve.mem_cache.host_memory import (  # noqa: F401 (re-exported: callers import them from here)
    GB,
    GiB,
    RegisteredHostMemory,
    host_memory_reserve_bytes,
    host_pool_slots,
    read_host_memory_bytes,
    write_back_staging_bytes,
)

if TYPE_CHECKING:
    from hiserve.mem_cache.memory_pool import KVCache, MHATokenToKVPool, MLATokenToKVPool

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- pools


@dataclass(frozen=True)
class HostKVKind:
    """One kind the host pool stores (MHA: "k" and "v"; MLA: "kv", the latent row).

    Attributes:
        name: the device pool's kind name (`KVCache.kv_kinds`); namespaces storage keys.
        item_shape: one token of one layer, `(H, Dh)` or `(1, Dm)`.
        token_bytes: one token across all layers, L * prod(item_shape) * itemsize.
        page_bytes: one page, P * token_bytes: the size of one `page_object`.
    """

    name: str
    item_shape: tuple[int, ...]
    token_bytes: int
    page_bytes: int


class HostKVCache:
    """Host pool of S slots in `layout`, one buffer per kind, with a page-granular slot allocator.

    The kinds are the device pool's (`device_pool.kv_kinds()`); every transfer moves all of
    them through one path, `hicache.write_back_all_layer` / `hicache.load_back_one_layer`.

    Args:
        device_pool: the device pool (L1) this pool backs; gives kinds, dtype, layers, device.
        host_to_device_ratio: S = ratio x device slots when `host_size_gb` is 0.
        host_size_gb: S = this many GB (10**9 bytes) of tokens when > 0 (per rank).
        page_size: tokens per page; must equal the device pool's.
        layout: `layer_first`, `page_first` or `page_first_direct`.
        pin_memory: register the buffer with CUDA; None = yes exactly when the device is CUDA.
    Attributes:
        kinds: a `HostKVKind` per kind, in the device pool's order.
        kv_buffers: per kind the host buffer (shape in the module table), on the CPU, device
            dtype; consecutive, non-overlapping views of `buffer`.
        buffer: the pool's one allocation, uint8 `[size_bytes]`.
        size, page_num: host slots and pages. size_bytes: bytes of all kinds.
        staging_buffers, staging_page_capacity, staging_buffer_bytes: the write-back staging
            buffers, one per kind, and their size ([] / 0 / 0 unless page_first on CUDA);
            count staging_buffer_bytes in the device budget.
    Raises:
        ValueError: unknown layout, page size mismatch, less than one page, pinning without
            CUDA, or a pool that does not fit in available host memory minus a reserve.
        TypeError: a subclass given a device pool of other kinds than it states.
    """

    expected_kinds: tuple[str, ...] = ()  # a subclass states its model's kinds; () takes any

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
        self.kinds = self._describe_kinds(device_pool)

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
        self._registered: RegisteredHostMemory | None = None
        self._transfer_kinds_cache: tuple["KVCache", list[KVKind]] | None = None
        self.kv_buffers = self._alloc_buffers()
        self._finalizer = (
            weakref.finalize(self, self._registered.release) if self._registered is not None else None
        )

        self.clear()
        self._init_write_back_staging_buffers()
        logger.info(
            "host KV pool: %s, kinds %s, %d slots (%d pages of %d), %.2f GB%s, staging %d bytes",
            layout, "/".join(k.name for k in self.kinds), self.size, self.page_num, page_size,
            self.size_bytes / GB, " pinned" if self.pin_memory else "", self.staging_buffer_bytes)

    # -- kinds

    def _describe_kinds(self, device_pool: "KVCache") -> tuple[HostKVKind, ...]:
        kinds = []
        for name, layers in device_pool.kv_kinds():
            item = tuple(layers[0].shape[1:])
            token_bytes = self.layer_num * math.prod(item) * self.dtype.itemsize
            kinds.append(HostKVKind(name, item, token_bytes, self.page_size * token_bytes))
        names = tuple(k.name for k in kinds)
        if self.expected_kinds and names != self.expected_kinds:
            raise TypeError(f"{type(self).__name__} stores kinds {self.expected_kinds}, the device pool "
                            f"{type(device_pool).__name__} has {names}")
        return tuple(kinds)

    def kind_index(self, kind: int | str) -> int:
        """Position of `kind` (an index or a name such as "k", "v", "kv") in `kinds`.

        Raises:
            ValueError: no such kind.
        """
        for index, k in enumerate(self.kinds):
            if kind == index or kind == k.name:
                return index
        raise ValueError(f"unknown KV kind {kind!r}; this pool has {[k.name for k in self.kinds]}")

    def get_size_per_token_bytes(self) -> int:
        """Bytes of one token across all layers and kinds (MHA: 2*H*Dh*L*itemsize; MLA: Dm*L*itemsize)."""
        return sum(k.token_bytes for k in self.kinds)

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

    def _alloc_buffers(self) -> tuple[torch.Tensor, ...]:
        """One allocation, cut into the kinds' buffers one after the other (for MHA the same
        bytes as the former `[2, ...]` buffer: K then V)."""
        if self.pin_memory:
            # Chunk boundaries at multiples of one page of all layers keep every page-first page
            # (and every layer_first / page_first_direct (page, layer) run) in one registration;
            # exact for equal-size kinds, which every model here has.
            granularity = math.lcm(*(k.page_bytes for k in self.kinds))
            self._registered = RegisteredHostMemory(self.size_bytes, granularity)
            self.buffer = self._registered.tensor
        else:
            self.buffer = torch.empty(self.size_bytes, dtype=torch.uint8)
        views, offset = [], 0
        for kind in self.kinds:
            shape = host_kind_shape(self.layout, self.size, self.layer_num, self.page_size, kind.item_shape)
            nbytes = self.size * kind.token_bytes
            views.append(self.buffer[offset:offset + nbytes].view(self.dtype).view(shape))
            offset += nbytes
        return tuple(views)

    def close(self) -> None:
        """Unregister pinned memory now (idempotent); the pool must not be used afterwards."""
        if self._finalizer is not None:
            self._finalizer()
        self._registered = None
        self.kv_buffers = ()
        self.buffer = None
        self._transfer_kinds_cache = None
        self._free_staging()

    # -- per-page objects (for a storage tier)

    def page_object(self, kind: int | str, page: int) -> torch.Tensor:
        """Host page `page` (host slots `page*P .. page*P+P-1`) of one kind, as a contiguous view
        of the pool's memory: the unit a storage tier reads or writes as one object, zero-copy
        (`view.data_ptr()`, `kinds[i].page_bytes` bytes; writing the view writes the pool).

        Shapes: `page_first` `[P, L, *item]` (token-major); `page_first_direct` `[L, P, *item]`.

        Raises:
            ValueError: `layer_first` (a page is L separate runs there), an unknown kind, or a
                page outside `[0, page_num)`.
        """
        index = self.kind_index(kind)
        if self.layout == "layer_first":
            raise ValueError("host layout 'layer_first' has no contiguous page objects; use page_first "
                             "(--hicache-mem-layout page_first) or page_first_direct")
        if not 0 <= page < self.page_num:
            raise ValueError(f"host page {page} outside the {self.page_num} host pages")
        buf = self.kv_buffers[index]
        if self.layout == "page_first":
            return buf[page * self.page_size:(page + 1) * self.page_size]
        return buf[page]

    def page_byte_range(self, kind: int | str, page: int) -> tuple[int, int]:
        """(offset, nbytes) of `page_object(kind, page)` inside `buffer`, for a backend that
        registers the whole pool once and addresses pages by offset. Raises as `page_object`."""
        view = self.page_object(kind, page)
        return view.data_ptr() - self.buffer.data_ptr(), view.numel() * view.element_size()

    # -- allocator (page granular, CPU int64 slot tensors)

    def clear(self) -> None:
        """Free every host slot."""
        self._free_pages = torch.arange(self.page_num, dtype=torch.int64)
        self._released: list[torch.Tensor] = []

    def available_size(self) -> int:
        """Free host slots."""
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
        self._released.append(pages)

    def _merge_released(self) -> None:
        self._free_pages = torch.cat([self._free_pages, *self._released]).sort().values
        self._released = []

    # -- staging buffers for the staged write-back

    def _init_write_back_staging_buffers(self) -> None:
        """On CUDA with `page_first`, allocate the device staging buffers once:
        `[capacity, P, L, *item]` per kind, capacity = min(page_num, 64) pages. Otherwise
        allocate nothing."""
        self._free_staging()
        device = self.device_pool.device
        self.staging_buffer_bytes = sum(
            write_back_staging_bytes(self.layout, device, self.page_num, self.page_size, self.layer_num,
                                     math.prod(k.item_shape) * self.dtype.itemsize, 1)
            for k in self.kinds)
        if self.staging_buffer_bytes == 0:
            return
        self.staging_page_capacity = min(self.page_num, WRITE_BACK_STAGING_PAGE_CHUNK)
        self.staging_buffers = [
            torch.empty((self.staging_page_capacity, self.page_size, self.layer_num, *k.item_shape),
                        dtype=self.dtype, device=device)
            for k in self.kinds]

    def _free_staging(self) -> None:
        self.staging_buffers: list[torch.Tensor] = []
        self.staging_page_capacity = 0
        self.staging_buffer_bytes = 0

    # -- transfers: one path for every kind

    def transfer_kinds(self, device_pool: "KVCache") -> list[KVKind]:
        """Per kind the `KVKind(device layers, host buffer)` pair the transfer functions take
        (built once per device pool: a load-back asks for it once per layer).

        Raises:
            ValueError: `device_pool` has other kinds than this pool.
        """
        cached = self._transfer_kinds_cache
        if cached is not None and cached[0] is device_pool:
            return cached[1]
        device_kinds = device_pool.kv_kinds()
        if len(device_kinds) != len(self.kinds) or any(
                name != k.name for (name, _), k in zip(device_kinds, self.kinds)):
            raise ValueError(f"device pool kinds {[name for name, _ in device_kinds]} != host pool kinds "
                             f"{[k.name for k in self.kinds]}")
        kinds = [KVKind(layers, host) for (_, layers), host in zip(device_kinds, self.kv_buffers)]
        self._transfer_kinds_cache = (device_pool, kinds)
        return kinds

    def backup_from_device_all_layer(
        self, device_pool: "KVCache", host_indices: torch.Tensor, device_indices: torch.Tensor, io_backend: str
    ) -> None:
        """Write-back: copy every layer of every kind of `device_indices` (device slots, on the
        device) into `host_indices` (host slots from `alloc`, CPU). Raises as
        `hicache.write_back_all_layer`."""
        hicache.write_back_all_layer(
            self.transfer_kinds(device_pool), self.layout, device_indices=device_indices,
            host_indices=host_indices, page_size=self.page_size, io_backend=io_backend,
            stagings=self.staging_buffers or None)

    def load_to_device_per_layer(
        self,
        device_pool: "KVCache",
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        layer_id: int,
        io_backend: str,
    ) -> None:
        """Load-back of one layer of every kind: host slots `host_indices` (CPU) into device
        slots `device_indices` (on the device) of layer `layer_id`. Raises as
        `hicache.load_back_one_layer`."""
        if not 0 <= layer_id < self.layer_num:
            raise ValueError(f"layer_id={layer_id} out of range for {self.layer_num} layers")
        hicache.load_back_one_layer(
            self.transfer_kinds(device_pool), self.layout, layer_id, host_indices=host_indices,
            device_indices=device_indices, page_size=self.page_size, io_backend=io_backend)


class MHATokenToKVPoolHost(HostKVCache):
    """Host pool for `MHATokenToKVPool`: kinds "k" and "v", items `(H, Dh)`; `head_num`, `head_dim`."""

    expected_kinds = ("k", "v")

    def __init__(self, device_pool: "MHATokenToKVPool", host_to_device_ratio: float, host_size_gb: int,
                 page_size: int, layout: str = "page_first", pin_memory: bool | None = None) -> None:
        super().__init__(device_pool, host_to_device_ratio, host_size_gb, page_size, layout, pin_memory)
        self.head_num, self.head_dim = device_pool.head_num, device_pool.head_dim


class MLATokenToKVPoolHost(HostKVCache):
    """Host pool for `MLATokenToKVPool`: one kind "kv", items `(1, Dm)`, Dm = `kv_dim` =
    `kv_lora_rank` + `qk_rope_head_dim`."""

    expected_kinds = ("kv",)

    def __init__(self, device_pool: "MLATokenToKVPool", host_to_device_ratio: float, host_size_gb: int,
                 page_size: int, layout: str = "page_first", pin_memory: bool | None = None) -> None:
        super().__init__(device_pool, host_to_device_ratio, host_size_gb, page_size, layout, pin_memory)
        self.kv_lora_rank, self.qk_rope_head_dim = device_pool.kv_lora_rank, device_pool.qk_rope_head_dim
        self.kv_dim = self.kv_lora_rank + self.qk_rope_head_dim
