"""One backend for EXTEND, another for DECODE (`--prefill-attention-backend` differs from
`--decode-attention-backend`).

Each pass goes whole to one side, chosen by its forward mode: that side builds the
batch's metadata and runs every layer. So the DECODE graph methods and
`supports_cuda_graph` are the decode backend's, the EXTEND graph methods and
`supports_extend_cuda_graph` the prefill backend's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hiserve.layers.attention.base import AttentionBackend, RadixAttention
from hiserve.layers.attention.mla import forward_mla_as_mqa
from hiserve.layers.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from hiserve.layers.attention.mla import MLAAttention


class HybridAttnBackend(AttentionBackend):
    """Dispatches EXTEND passes to `prefill_backend` and DECODE passes to `decode_backend`."""

    def __init__(self, prefill_backend: AttentionBackend, decode_backend: AttentionBackend) -> None:
        self.prefill_backend = prefill_backend
        self.decode_backend = decode_backend
        self.supports_cuda_graph = decode_backend.supports_cuda_graph
        self.supports_extend_cuda_graph = prefill_backend.supports_extend_cuda_graph

    def backend_for(self, forward_batch: ForwardBatch) -> AttentionBackend:
        """The backend that runs this pass."""
        return self.decode_backend if forward_batch.forward_mode.is_decode() else self.prefill_backend

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        self.backend_for(forward_batch).init_forward_metadata(forward_batch)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        return self.backend_for(forward_batch).forward(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_mla(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        k_rope: torch.Tensor,
        layer: "MLAAttention",
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """MLA through the chosen side's own `forward_mla`, or its plain `forward` (absorbed MQA)."""
        backend = self.backend_for(forward_batch)
        forward_mla = getattr(backend, "forward_mla", None)
        if forward_mla is not None:
            return forward_mla(q_nope, q_rope, latent, k_rope, layer, forward_batch, save_kv_cache)
        return forward_mla_as_mqa(backend, q_nope, q_rope, latent, k_rope, layer, forward_batch, save_kv_cache)

    # ------------------------------------------------------------ CUDA graphs
    def init_cuda_graph_state(self, max_bs: int) -> None:
        self.decode_backend.init_cuda_graph_state(max_bs)

    def init_forward_metadata_capture_cuda_graph(
        self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor
    ) -> None:
        self.decode_backend.init_forward_metadata_capture_cuda_graph(bs, req_pool_indices, seq_lens)

    def init_forward_metadata_replay_cuda_graph(
        self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, seq_lens_cpu: list[int]
    ) -> None:
        self.decode_backend.init_forward_metadata_replay_cuda_graph(bs, req_pool_indices, seq_lens, seq_lens_cpu)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.decode_backend.get_cuda_graph_seq_len_fill_value()

    def init_extend_graph_state(self) -> None:
        self.prefill_backend.init_extend_graph_state()

    def init_forward_metadata_capture_extend_graph(self, num_tokens: int) -> None:
        self.prefill_backend.init_forward_metadata_capture_extend_graph(num_tokens)

    def init_forward_metadata_replay_extend_graph(
        self, num_tokens: int, req_pool_index: torch.Tensor, seq_len: torch.Tensor, seq_len_cpu: int,
        extend_len: int
    ) -> None:
        self.prefill_backend.init_forward_metadata_replay_extend_graph(
            num_tokens, req_pool_index, seq_len, seq_len_cpu, extend_len)
