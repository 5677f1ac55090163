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
    """Computes attention for every layer of one forward pass.

    A backend that can be captured in a CUDA graph for DECODE sets
    `supports_cuda_graph = True` and implements the three `*cuda_graph*` methods:
    its per-batch metadata then lives in static buffers sized for `max_bs`
    requests, filled outside the graph before each replay.
    """

    supports_cuda_graph: bool = False

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

    # ------------------------------------------------------------ CUDA graphs
    def init_cuda_graph_state(self, max_bs: int) -> None:
        """Allocate the static metadata buffers for DECODE batches of up to `max_bs` requests."""
        raise NotImplementedError(f"{type(self).__name__} cannot run under CUDA graphs")

    def init_forward_metadata_capture_cuda_graph(
        self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor
    ) -> None:
        """Point the metadata at the static buffers for a capture of batch size `bs`.

        Args:
            req_pool_indices: [bs] int64 static buffer (rows of `req_to_token`).
            seq_lens: [bs] int64 static buffer (context length incl. the new token).
        """
        raise NotImplementedError(f"{type(self).__name__} cannot run under CUDA graphs")

    def init_forward_metadata_replay_cuda_graph(
        self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, seq_lens_cpu: list[int]
    ) -> None:
        """Refill the static metadata for the batch about to replay (padded to `bs`;
        padded requests have seq_len `get_cuda_graph_seq_len_fill_value()`)."""
        raise NotImplementedError(f"{type(self).__name__} cannot run under CUDA graphs")

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """seq_len given to padded requests of a replayed batch (they read slot 0, the padding page)."""
        return 1

    # ------------------------------------------------- CUDA graphs of EXTEND
    # A backend whose EXTEND metadata can live in static buffers sets
    # `supports_extend_cuda_graph = True`: a graph of N token rows then holds one request's
    # t < N new tokens plus a padding request with the other N - t rows (on the padding row
    # of `req_to_token`, writing slot 0), so every captured shape is fixed.
    supports_extend_cuda_graph: bool = False

    def init_extend_graph_state(self) -> None:
        """Allocate the static EXTEND metadata of (one request + one padding request)."""
        raise NotImplementedError(f"{type(self).__name__} cannot capture EXTEND passes")

    def init_forward_metadata_capture_extend_graph(self, num_tokens: int) -> None:
        """Point the metadata at the static buffers for a capture of `num_tokens` rows."""
        raise NotImplementedError(f"{type(self).__name__} cannot capture EXTEND passes")

    def init_forward_metadata_replay_extend_graph(
        self, num_tokens: int, req_pool_index: torch.Tensor, seq_len: torch.Tensor, seq_len_cpu: int,
        extend_len: int
    ) -> None:
        """Refill the static metadata for one request with `extend_len` < `num_tokens` new
        tokens and `seq_len_cpu` tokens of context (prefix + new) in the graph of
        `num_tokens` rows; `req_pool_index`/`seq_len`: [1] int64 on the device.

        Raises:
            ValueError: `extend_len` leaves no row for the padding request.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot capture EXTEND passes")


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
