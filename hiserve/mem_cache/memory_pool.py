"""The device KV pool (L1): one buffer per layer, indexed by slot.

Layout is `layer_first`: each layer owns one contiguous tensor whose first axis is the
slot (`size + page_size` rows; slots `0..page_size-1` are the padding page). Attention
reads a layer's buffer through `get_key_buffer` / `get_value_buffer` /
`get_kv_buffer`; those accessors first call `counter.wait_until(layer_id)` when a
layer transfer counter is registered, so a forward can start on layer i while a
host → device load-back is still bringing in layers > i.

Sizes: `*_bytes` are bytes; `size`, `slots` and token counts are elements (tokens).
"""

from __future__ import annotations


from abc import ABC, abstractmethod
from typing import Protocol

import torch


class LayerTransferCounter(Protocol):
    """Anything that can block (or make the compute stream wait) until a layer has arrived."""

    def wait_until(self, layer_id: int) -> None: ...


def _uint64_ptrs(buffers: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64, device=device)


class KVCache(ABC):
    """Common state of the device KV pools.

    Args:
        size: token slots for real pages (the buffers have `size + page_size` rows).
        page_size: tokens per page.
        dtype: element dtype of the stored KV.
        layer_num: number of attention layers held by this pool.
        device: where the buffers live.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        layer_num: int,
        device: str | torch.device,
    ) -> None:
        if size <= 0 or page_size <= 0 or layer_num <= 0:
            raise ValueError(
                f"size, page_size and layer_num must be > 0, got {size}, {page_size}, {layer_num}"
            )
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.layer_num = layer_num
        self.device = torch.device(device)
        self.layer_transfer_counter: LayerTransferCounter | None = None

    def register_layer_transfer_counter(self, counter: LayerTransferCounter | None) -> None:
        """Make the layer accessors call `counter.wait_until(layer_id)` first (None: stop waiting)."""
        self.layer_transfer_counter = counter

    def _wait_for_layer(self, layer_id: int) -> None:
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(layer_id)

    @abstractmethod
    def buffers(self) -> list[torch.Tensor]:
        """Every tensor this pool allocated."""
        ...

    @abstractmethod
    def kv_kinds(self) -> tuple[tuple[str, list[torch.Tensor]], ...]:
        """The stored kinds, in a fixed order: (name, `layer_num` tensors `[size + page_size, *item]`)
        per kind — MHA `("k", k_buffer), ("v", v_buffer)`, MLA `("kv", kv_buffer)`. The host tier
        mirrors exactly these (one host buffer per kind) and moves them through one code path."""
        ...

    def get_kv_size_bytes(self) -> int:
        """Bytes held by all buffers of this pool, padding page included."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    @abstractmethod
    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        ...

    @abstractmethod
    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        ...

    @abstractmethod
    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        ...

    @abstractmethod
    def set_kv_buffer(
        self,
        layer_id: int,
        loc: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor | None,
    ) -> None:
        ...


class MHATokenToKVPool(KVCache):
    """K and V per layer for multi-head / grouped-query attention.

    Attributes:
        k_buffer, v_buffer: `layer_num` tensors `[size + page_size, head_num, head_dim]`.
        k_data_ptrs, v_data_ptrs: uint64 `[layer_num]` on `device`, base address of
            each layer's K / V buffer (pointer tables for all-layer transfer kernels).
        data_ptrs: uint64 `[2 * layer_num]`, K layers then V layers.
        item_bytes: bytes of one token of one layer of K (or of V) = head_num*head_dim*itemsize.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: str | torch.device,
    ) -> None:
        super().__init__(size, page_size, dtype, layer_num, device)
        self.head_num = head_num
        self.head_dim = head_dim
        shape = (size + page_size, head_num, head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(layer_num)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(layer_num)]
        self.k_data_ptrs = _uint64_ptrs(self.k_buffer, self.device)
        self.v_data_ptrs = _uint64_ptrs(self.v_buffer, self.device)
        self.data_ptrs = torch.cat([self.k_data_ptrs, self.v_data_ptrs])
        self.item_bytes = head_num * head_dim * dtype.itemsize

    @staticmethod
    def cell_size_bytes(head_num: int, head_dim: int, layer_num: int, dtype: torch.dtype) -> int:
        """Bytes of K and V for one token across all layers (size a pool from a byte budget)."""
        return 2 * head_num * head_dim * layer_num * dtype.itemsize

    def buffers(self) -> list[torch.Tensor]:
        return self.k_buffer + self.v_buffer

    def kv_kinds(self) -> tuple[tuple[str, list[torch.Tensor]], ...]:
        return (("k", self.k_buffer), ("v", self.v_buffer))

    def get_contiguous_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """(data_ptrs, data_lens_bytes, item_bytes) per buffer, K layers then V layers."""
        bufs = self.buffers()
        return (
            [b.data_ptr() for b in bufs],
            [b.numel() * b.element_size() for b in bufs],
            [self.item_bytes] * len(bufs),
        )

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """K of one layer, `[size + page_size, head_num, head_dim]`."""
        self._wait_for_layer(layer_id)
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """V of one layer, `[size + page_size, head_num, head_dim]`."""
        self._wait_for_layer(layer_id)
        return self.v_buffer[layer_id]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._wait_for_layer(layer_id)
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(
        self,
        layer_id: int,
        loc: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor | None,
    ) -> None:
        """Store K/V of T new tokens.

        Args:
            loc: int64 `[T]` slots.
            cache_k, cache_v: `[T, head_num, head_dim]`, cast to the pool dtype.
        Raises:
            ValueError: if cache_v is None.
        """
        if cache_v is None:
            raise ValueError("MHATokenToKVPool.set_kv_buffer needs cache_v")
        self.k_buffer[layer_id][loc] = cache_k.to(self.dtype)
        self.v_buffer[layer_id][loc] = cache_v.to(self.dtype)


class MLATokenToKVPool(KVCache):
    """Compressed latent KV per layer for multi-head latent attention (DeepSeek V2/V3).

    A token stores `kv_lora_rank` latent elements followed by `qk_rope_head_dim`
    rotary key elements; the key is the whole row, the value is the latent part.

    Attributes:
        kv_buffer: `layer_num` tensors `[size + page_size, 1, kv_lora_rank + qk_rope_head_dim]`.
        data_ptrs: uint64 `[layer_num]` on `device`, base address of each layer's buffer.
        item_bytes: bytes of one token of one layer = (kv_lora_rank + qk_rope_head_dim)*itemsize.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        layer_num: int,
        device: str | torch.device,
    ) -> None:
        super().__init__(size, page_size, dtype, layer_num, device)
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.kv_dim = kv_lora_rank + qk_rope_head_dim
        shape = (size + page_size, 1, self.kv_dim)
        self.kv_buffer = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(layer_num)]
        self.data_ptrs = _uint64_ptrs(self.kv_buffer, self.device)
        self.item_bytes = self.kv_dim * dtype.itemsize

    @staticmethod
    def cell_size_bytes(kv_lora_rank: int, qk_rope_head_dim: int, layer_num: int, dtype: torch.dtype) -> int:
        """Bytes of the latent KV for one token across all layers."""
        return (kv_lora_rank + qk_rope_head_dim) * layer_num * dtype.itemsize

    def buffers(self) -> list[torch.Tensor]:
        return list(self.kv_buffer)

    def kv_kinds(self) -> tuple[tuple[str, list[torch.Tensor]], ...]:
        return (("kv", self.kv_buffer),)

    def get_contiguous_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """(data_ptrs, data_lens_bytes, item_bytes) per layer buffer."""
        return (
            [b.data_ptr() for b in self.kv_buffer],
            [b.numel() * b.element_size() for b in self.kv_buffer],
            [self.item_bytes] * self.layer_num,
        )

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """The whole row of one layer, `[size + page_size, 1, kv_lora_rank + qk_rope_head_dim]`."""
        self._wait_for_layer(layer_id)
        return self.kv_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """The latent part of one layer, a view `[size + page_size, 1, kv_lora_rank]`."""
        self._wait_for_layer(layer_id)
        return self.kv_buffer[layer_id][..., : self.kv_lora_rank]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._wait_for_layer(layer_id)
        buf = self.kv_buffer[layer_id]
        return buf, buf[..., : self.kv_lora_rank]

    def set_kv_buffer(
        self,
        layer_id: int,
        loc: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor | None = None,
    ) -> None:
        """Store T whole rows: loc int64 `[T]`, cache_k `[T, 1, kv_lora_rank + qk_rope_head_dim]`.

        cache_v is ignored (the value is a view of the key).
        """
        self.kv_buffer[layer_id][loc] = cache_k.to(self.dtype)

    def set_mla_kv_buffer(
        self,
        layer_id: int,
        loc: torch.Tensor,
        cache_k_nope: torch.Tensor,
        cache_k_rope: torch.Tensor,
    ) -> None:
        """Store T rows from their two parts.

        Args:
            loc: int64 `[T]` slots.
            cache_k_nope: `[T, 1, kv_lora_rank]` latent part.
            cache_k_rope: `[T, 1, qk_rope_head_dim]` rotary key part.
        """
        row = torch.cat([cache_k_nope.to(self.dtype), cache_k_rope.to(self.dtype)], dim=-1)
        self.kv_buffer[layer_id][loc] = row
