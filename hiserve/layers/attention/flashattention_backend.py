"""FlashAttention-3 (Hopper) over the paged device KV pool (`--attention-backend fa3`).

Each layer first writes the new tokens' K/V into the pool (as torch_native does), then
makes one `flash_attn_with_kvcache` call over the pool seen as pages: a layer buffer
`[slots, H, D]` is `[slots / P, P, H, D]` (P = page_size), so page p holds slots
`p*P .. p*P + P-1`. The allocator's paging invariant (position j of a request lives at
slot `page*P + j % P`) makes a request's context the pages `req_to_token[row, 0::P] // P`,
in order; that `page_table` and `cache_seqlens` are built once per batch.

- EXTEND: q is the T new tokens `[T, H, D]`, split per request by `cu_seqlens_q`; FA3's
  causal mask is bottom-right aligned, so new token j of a request with prefix length L
  sees keys at positions <= L + j, the cached prefix included.
- DECODE: q `[B, 1, H, D]`, one new token per request.
- MLA (DeepSeek): the absorbed form (see `mla.py`). q = q_rope, k = the rope columns of
  the cached rows, v = their latent columns (both strided views of the MLA pool), and
  `qv` = q_nope folded through W_UK; the output is unfolded through W_UV. It needs FA3's
  (qk_rope_head_dim, kv_lora_rank) kernel, which some builds leave out: then the backend
  refuses an MLA model (`fa3_supports_mla`).

CUDA graphs: DECODE metadata lives in static buffers (`page_table [max_bs, max pages per
request]`, `cache_seqlens [max_bs]`), refilled from `req_to_token` before each replay. So
does the EXTEND metadata of one request plus a padding request (`page_table [2, max pages]`,
`cache_seqlens [2]`, `cu_seqlens_q [3]`; `max_seqlen_q` is the graph's row count, an upper
bound FA3 only sizes its grid by): the padding request's q length equals its context, its
page-table row is page 0 (the padding page), so its causal rows read only slot 0's page.

Relies on `flash_attn_interface.flash_attn_with_kvcache(q, k_cache, v_cache, qv=,
cache_seqlens=, page_table=, cu_seqlens_q=, max_seqlen_q=, softmax_scale=, causal=)`
returning `out` (`[B, S, H, Dv]`, or `[T, H, Dv]` with `cu_seqlens_q`).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Callable

import torch

from hiserve.layers.attention.base import AttentionBackend, RadixAttention
from hiserve.layers.attention.fa3_probe import (  # noqa: F401 - re-exported for callers
    can_use_fa3,
    fa3_module,
    fa3_supports_mla,
    fa3_unavailable_reason,
)
from hiserve.layers.attention.mla import MLAAttention, absorb_out, absorb_q, save_mla_kv
from hiserve.layers.forward_batch import ForwardBatch

_FLAGS = "--attention-backend / --prefill-attention-backend / --decode-attention-backend"
_FA3_DTYPES = (torch.bfloat16, torch.float16)
_FA3_MAX_HEAD_DIM = 256


@dataclass
class FA3Metadata:
    """Per-batch inputs of every layer's FA3 call.

    Attributes:
        page_table: int32 `[B, num_pages]`, page ids of each request's context in order
            (entries past a request's last page are stale but valid page ids, never read).
        cache_seqlens: int32 `[B]`, context length (prefix + new tokens) per request.
        cu_seqlens_q: int32 `[B + 1]`, offsets of each request's new tokens (EXTEND); None (DECODE).
        max_seqlen_q: most new tokens of one request (1 for DECODE).
    """

    page_table: torch.Tensor
    cache_seqlens: torch.Tensor
    cu_seqlens_q: torch.Tensor | None
    max_seqlen_q: int


class FlashAttentionBackend(AttentionBackend):
    """FA3 attention for MHA/GQA and (where the build allows) MLA models.

    Args:
        model_runner: anything with `req_to_token_pool` (`ReqToTokenPool`) and
            `token_to_kv_pool` (`MHATokenToKVPool` or `MLATokenToKVPool`), e.g. a ModelRunner.
        kernel: a function with `flash_attn_with_kvcache`'s signature; default: FA3's. Tests
            pass `fa3_reference.flash_attn_with_kvcache_reference` to run without a Hopper GPU.
    Raises:
        ValueError: FA3 cannot run here (no CUDA, not Hopper, not importable), the pool dtype
            is not bf16/fp16, the head dim is out of FA3's range, the pool size is not a
            whole number of pages, or the model is MLA and this FA3 build lacks its kernel.
    """

    supports_cuda_graph = True
    supports_extend_cuda_graph = True

    def __init__(self, model_runner: Any, kernel: Callable[..., torch.Tensor] | None = None) -> None:
        uses_fa3 = kernel is None
        if uses_fa3:
            reason = fa3_unavailable_reason()
            if reason is not None:
                raise ValueError(f"fa3 ({_FLAGS}) cannot run here: {reason}; use triton")
            kernel = fa3_module().flash_attn_with_kvcache
        self._kernel = kernel
        pool = model_runner.token_to_kv_pool
        self.req_to_token: torch.Tensor = model_runner.req_to_token_pool.req_to_token
        self.page_size: int = pool.page_size
        self.device = pool.device
        if pool.dtype not in _FA3_DTYPES:
            raise ValueError(f"fa3 ({_FLAGS}) needs a bfloat16 or float16 KV pool, got {pool.dtype}; "
                             "use --dtype bfloat16, or triton")
        slots = pool.buffers()[0].shape[0]  # size + page_size rows
        if slots % self.page_size:
            raise ValueError(f"KV pool rows {slots} are not a whole number of pages of {self.page_size}")
        self.is_mla = hasattr(pool, "set_mla_kv_buffer")
        if self.is_mla:
            rope, rank = pool.qk_rope_head_dim, pool.kv_lora_rank
            if uses_fa3 and not fa3_supports_mla(rope, rank):
                raise ValueError(
                    f"fa3 ({_FLAGS}) cannot run this MLA model: the installed FlashAttention-3 has no "
                    f"kernel for q/k head dim {rope} with v head dim {rank} (qv); "
                    f"use --attention-backend triton (or --decode-attention-backend triton)")
        else:
            head_dim = pool.head_dim
            if head_dim > _FA3_MAX_HEAD_DIM or head_dim % 8:
                raise ValueError(f"fa3 ({_FLAGS}) supports head dims that are multiples of 8 up to "
                                 f"{_FA3_MAX_HEAD_DIM}, got {head_dim}; use triton")
        self.max_pages_per_req = -(-self.req_to_token.shape[1] // self.page_size)
        self._meta: FA3Metadata | None = None
        self._graph_page_table: torch.Tensor | None = None
        self._graph_cache_seqlens: torch.Tensor | None = None
        self._extend_graph_meta: FA3Metadata | None = None

    # ---------------------------------------------------------------- metadata
    def _page_table(self, req_pool_indices: torch.Tensor, num_pages: int) -> torch.Tensor:
        """int32 `[B, num_pages]`: page of positions 0, P, 2P, ... of each request's row."""
        p = self.page_size
        first_slots = self.req_to_token[:, : num_pages * p : p]  # a strided view, no copy
        rows = first_slots.index_select(0, req_pool_indices.to(self.device))
        return rows if p == 1 else torch.div(rows, p, rounding_mode="floor")

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        num_pages = -(-max(forward_batch.seq_lens_cpu) // self.page_size)
        page_table = self._page_table(forward_batch.req_pool_indices, num_pages)
        cache_seqlens = forward_batch.seq_lens.to(self.device, torch.int32)
        if forward_batch.forward_mode.is_decode():
            self._meta = FA3Metadata(page_table, cache_seqlens, None, 1)
            return
        ext = forward_batch.extend_seq_lens_cpu
        cu_seqlens_q = torch.tensor([0, *accumulate(ext)], dtype=torch.int32, device=self.device)
        self._meta = FA3Metadata(page_table, cache_seqlens, cu_seqlens_q, max(ext))

    # ----------------------------------------------------------------- forward
    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                qv: torch.Tensor | None, scale: float, decode: bool) -> torch.Tensor:
        """q `[T, H, Dq]` (+ qv `[T, H, Dqv]`) over paged k/v `[pages, P, Hkv, D*]` -> `[T, H, Dv]`."""
        meta = self._meta
        assert meta is not None, "init_forward_metadata was not called for this batch"
        if decode:  # one query per request: the batch layout, no cu_seqlens
            out = self._kernel(q=q.unsqueeze(1), k_cache=k_cache, v_cache=v_cache,
                            qv=None if qv is None else qv.unsqueeze(1),
                            cache_seqlens=meta.cache_seqlens, page_table=meta.page_table,
                            softmax_scale=scale, causal=True)
        else:
            out = self._kernel(q=q, k_cache=k_cache, v_cache=v_cache, qv=qv,
                            cache_seqlens=meta.cache_seqlens, page_table=meta.page_table,
                            cu_seqlens_q=meta.cu_seqlens_q, max_seqlen_q=meta.max_seqlen_q,
                            softmax_scale=scale, causal=True)
        if isinstance(out, tuple):  # builds that always return (out, lse)
            out = out[0]
        return out.reshape(q.shape[0], q.shape[1], -1)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """q [T, Hq*D], k [T, Hkv*D], v [T, Hkv*Dv] -> [T, Hq*Dv] (the pool's dtype)."""
        t, p = q.shape[0], self.page_size
        pool = forward_batch.token_to_kv_pool
        if save_kv_cache:
            pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc,
                               k.view(t, layer.num_kv_heads, layer.head_dim),
                               v.view(t, layer.num_kv_heads, layer.v_head_dim))
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        k_cache = k_buf.view(-1, p, layer.num_kv_heads, layer.head_dim)
        v_cache = v_buf.view(-1, p, layer.num_kv_heads, layer.v_head_dim)
        q3 = q.view(t, layer.num_heads, layer.head_dim).to(k_cache.dtype)
        out = self._attend(q3, k_cache, v_cache, None, layer.scaling, forward_batch.forward_mode.is_decode())
        return out.reshape(t, layer.num_heads * layer.v_head_dim)

    def forward_mla(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        k_rope: torch.Tensor,
        layer: MLAAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Absorbed MLA, EXTEND and DECODE alike: q_nope [T, H, qk_nope], q_rope [T, H, rope],
        latent [T, r], k_rope [T, rope] -> [T, H * v_head_dim]."""
        if save_kv_cache:
            save_mla_kv(layer, forward_batch, latent, k_rope)
        r = layer.kv_lora_rank
        rows = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id)  # [slots, 1, r + rope]
        paged = rows.view(-1, self.page_size, 1, r + layer.qk_rope_head_dim)
        # Column slices keep the last dim contiguous, which is all FA3 asks of k/v.
        k_cache, v_cache = paged[..., r:], paged[..., :r]
        dtype = rows.dtype
        q_lat = absorb_q(q_nope.to(dtype), layer)  # [T, H, r]
        o_lat = self._attend(q_rope.to(dtype), k_cache, v_cache, q_lat, layer.scaling,
                             forward_batch.forward_mode.is_decode())  # [T, H, r]
        return absorb_out(o_lat, layer)

    # ------------------------------------------------------------ CUDA graphs
    def init_cuda_graph_state(self, max_bs: int) -> None:
        """Static `page_table` int32 [max_bs, max pages per request] and `cache_seqlens` int32 [max_bs]."""
        self._graph_page_table = torch.zeros((max_bs, self.max_pages_per_req), dtype=torch.int32,
                                             device=self.device)
        self._graph_cache_seqlens = torch.ones(max_bs, dtype=torch.int32, device=self.device)

    def init_forward_metadata_capture_cuda_graph(
        self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor
    ) -> None:
        if self._graph_page_table is None or self._graph_cache_seqlens is None:
            raise RuntimeError("init_cuda_graph_state must run before a capture")
        # Whole rows: the capture's own (padding) requests must read valid pages.
        self._graph_page_table[:bs].copy_(self._page_table(req_pool_indices, self.max_pages_per_req))
        self._graph_cache_seqlens[:bs].copy_(seq_lens)
        self._meta = FA3Metadata(self._graph_page_table[:bs], self._graph_cache_seqlens[:bs], None, 1)

    def init_forward_metadata_replay_cuda_graph(
        self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, seq_lens_cpu: list[int]
    ) -> None:
        if self._graph_page_table is None or self._graph_cache_seqlens is None:
            raise RuntimeError("init_cuda_graph_state must run before a replay")
        # Only the columns this batch reaches; later ones keep old (valid, unread) page ids.
        num_pages = -(-max(seq_lens_cpu) // self.page_size)
        self._graph_page_table[:bs, :num_pages].copy_(self._page_table(req_pool_indices, num_pages))
        self._graph_cache_seqlens[:bs].copy_(seq_lens)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    # ------------------------------------------------- CUDA graphs of EXTEND
    def init_extend_graph_state(self) -> None:
        """Static EXTEND metadata of row 0 (the request) and row 1 (padding, page 0 only)."""
        dev = self.device
        self._extend_graph_meta = FA3Metadata(
            page_table=torch.zeros((2, self.max_pages_per_req), dtype=torch.int32, device=dev),
            cache_seqlens=torch.ones(2, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.zeros(3, dtype=torch.int32, device=dev), max_seqlen_q=1)

    def _static_extend_meta(self) -> FA3Metadata:
        if self._extend_graph_meta is None:
            raise RuntimeError("init_extend_graph_state must run before an extend capture or replay")
        return self._extend_graph_meta

    def init_forward_metadata_capture_extend_graph(self, num_tokens: int) -> None:
        """Static metadata for capturing a graph of `num_tokens` rows (request: 1 token).

        Raises:
            RuntimeError: `init_extend_graph_state` has not run.
        """
        meta = self._static_extend_meta()
        # One token of the request over a one-token context, the padding request the rest.
        meta.cache_seqlens.copy_(torch.tensor([1, num_tokens - 1], dtype=torch.int32))
        meta.cu_seqlens_q.copy_(torch.tensor([0, 1, num_tokens], dtype=torch.int32))
        meta.page_table.zero_()
        self._meta = FA3Metadata(meta.page_table, meta.cache_seqlens, meta.cu_seqlens_q, num_tokens)

    def init_forward_metadata_replay_extend_graph(
        self, num_tokens: int, req_pool_index: torch.Tensor, seq_len: torch.Tensor, seq_len_cpu: int,
        extend_len: int
    ) -> None:
        """Refill the static metadata for one request (see the base class).

        Raises:
            ValueError: `extend_len` is not in [1, num_tokens - 1] (the padding request needs a row).
            RuntimeError: `init_extend_graph_state` has not run.
        """
        if not 0 < extend_len < num_tokens:
            raise ValueError(f"an extend of {extend_len} tokens does not fit a graph of {num_tokens} rows "
                             "(one row at least is the padding request's)")
        meta = self._static_extend_meta()
        num_pages = -(-seq_len_cpu // self.page_size)
        # Only the request's columns; later ones keep old (valid, unread) page ids. Scalar
        # fills are kernel arguments: nothing here waits for the device.
        meta.page_table[:1, :num_pages].copy_(self._page_table(req_pool_index, num_pages))
        meta.cache_seqlens[:1].copy_(seq_len)
        meta.cache_seqlens[1].fill_(num_tokens - extend_len)
        meta.cu_seqlens_q[1].fill_(extend_len)
        meta.cu_seqlens_q[2].fill_(num_tokens)
        self._meta = FA3Metadata(meta.page_table, meta.cache_seqlens, meta.cu_seqlens_q, num_tokens)
