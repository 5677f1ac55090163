"""The attention backend interface and the model-side attention layer.

A model never computes attention itself: each `RadixAttention` layer hands its
projected q, k, v to the batch's backend, which stores the new K/V in the device
pool and attends over each request's whole context (cached prefix + new tokens).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from hiserve.layers.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """Computes attention for every layer of one forward pass."""

    @abstractmethod
    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        """Build the per-batch index tensors once, before the first layer runs."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: "RadixAttention",
        forward_batch: "ForwardBatch",
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """q [T, Hq*D], k [T, Hkv*D], v [T, Hkv*Dv] -> [T, Hq*Dv].

        With `save_kv_cache`, k/v are first written to the pool at
        `forward_batch.out_cache_loc`.
        """


class RadixAttention(nn.Module):
    """Per-layer attention parameters; the computation is the backend's."""

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scaling: float,
        num_kv_heads: int,
        layer_id: int,
        v_head_dim: int | None = None,
    ):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim if v_head_dim is not None else head_dim
        self.scaling = scaling
        self.layer_id = layer_id

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        forward_batch: "ForwardBatch",
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch, save_kv_cache)

    def extra_repr(self) -> str:
        return (
            f"layer_id={self.layer_id}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, v_head_dim={self.v_head_dim}, scaling={self.scaling:.4g}"
        )
