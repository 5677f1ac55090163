"""Attention with our Triton kernels: the portable GPU backend (`--attention-backend triton`).

Every layer first writes the new tokens' K/V into the device pool (as torch_native does),
then runs the extend or decode kernel of `triton_ops`, which read each request's slots
straight from `req_to_token`; the per-batch metadata is only a few small device tensors.

DECODE can run under a CUDA graph: the decode grid depends on the batch size, the head
counts and the fixed `num_kv_splits` only, the split-KV scratch is allocated once in
`init_cuda_graph_state`, and the kernels read `req_pool_indices` / `seq_lens` from the
static buffers given at capture, which a replay refills.

MLA models reach this backend through `mla.forward_mla_as_mqa` (it has no `forward_mla`):
the absorbed form is MQA over the MLA pool, with `v_buf` the latent columns of the rows.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch

from hiserve.layers.attention.base import AttentionBackend, RadixAttention
from hiserve.layers.forward_batch import ForwardBatch

DEFAULT_NUM_KV_SPLITS = 8


def can_use_triton() -> bool:
    """True when triton imports and its kernels can run: a CUDA device, or the
    interpreter (`TRITON_INTERPRET=1`, CPU tensors; slow, for tests)."""
    try:
        import triton
    except ImportError:
        return False
    knobs = getattr(triton, "knobs", None)  # triton < 3.4 has no knobs: read the variable itself
    interpret = knobs.runtime.interpret if knobs is not None else os.environ.get("TRITON_INTERPRET") == "1"
    return bool(interpret) or torch.cuda.is_available()


@dataclass
class _DecodeMetadata:
    req_pool_indices: torch.Tensor  # [B] rows of req_to_token
    seq_lens: torch.Tensor  # [B] context length incl. the new token
    in_graph: bool  # captured / replayed: scratch must be the preallocated graph scratch


@dataclass
class _ExtendMetadata:
    req_pool_indices: torch.Tensor  # [B]
    seq_lens: torch.Tensor  # [B] prefix + new tokens
    extend_seq_lens: torch.Tensor  # [B] int32 new tokens
    extend_start_loc: torch.Tensor  # [B] int32 first q row of each request
    max_extend_len: int


class TritonAttnBackend(AttentionBackend):
    """Paged extend/decode attention through Triton kernels; CUDA-graph capable for DECODE.

    Args:
        model_runner: read for `device` and `model_config` (`num_attention_heads`,
            `head_dim`, `kv_lora_rank`), which size the decode scratch of
            `init_cuda_graph_state` (MLA: v dim = kv_lora_rank; else head_dim).
        num_kv_splits: split-KV ranges per request in decode (fixed: it is part of the
            graph's grid). Scratch bytes: `4 * max_bs * Hq * num_kv_splits * (Dv + 1)`.
    Raises:
        ValueError: if num_kv_splits < 1.
        RuntimeError: if triton is not importable.
    """

    supports_cuda_graph = True

    def __init__(self, model_runner: Any, num_kv_splits: int = DEFAULT_NUM_KV_SPLITS):
        if num_kv_splits < 1:
            raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
        try:
            # Imported here, not at module level: triton is optional and can_use_triton()
            # must be callable without it.
            from hiserve.layers.attention import triton_ops
        except ImportError as e:
            raise RuntimeError("the triton attention backend needs the triton package") from e
        self._ops = triton_ops
        self.device = torch.device(model_runner.device)
        cfg = model_runner.model_config
        self.num_q_heads = int(cfg.num_attention_heads)
        kv_lora_rank = getattr(cfg, "kv_lora_rank", None)
        self.v_head_dim = int(kv_lora_rank) if kv_lora_rank else int(cfg.head_dim)
        self.num_kv_splits = num_kv_splits

        self._decode: _DecodeMetadata | None = None
        self._extend: _ExtendMetadata | None = None
        # Eager decode scratch, grown on demand; never used by a graph (a graph keeps the
        # addresses it was captured with, so its scratch is never reallocated).
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None
        self._graph_scratch: tuple[torch.Tensor, torch.Tensor] | None = None
        self._graph_max_bs = 0
        self._graph_inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    # ---------------------------------------------------------------- metadata
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        req_pool_indices = forward_batch.req_pool_indices.to(self.device)
        seq_lens = forward_batch.seq_lens.to(self.device)
        if forward_batch.forward_mode.is_decode():
            self._decode = _DecodeMetadata(req_pool_indices, seq_lens, in_graph=False)
            self._extend = None
            return
        ext = forward_batch.extend_seq_lens_cpu
        starts = [0, *accumulate(ext)][:-1]
        # One host -> device copy for both index vectors.
        both = torch.tensor([ext, starts], dtype=torch.int32).to(self.device)
        self._extend = _ExtendMetadata(req_pool_indices, seq_lens, both[0], both[1], max(ext, default=0))
        self._decode = None

    # ------------------------------------------------------------ CUDA graphs
    def init_cuda_graph_state(self, max_bs: int) -> None:
        if max_bs < 1:
            raise ValueError(f"max_bs must be >= 1, got {max_bs}")
        self._graph_scratch = self._ops.alloc_decode_scratch(
            max_bs, self.num_q_heads, self.v_head_dim, self.num_kv_splits, self.device
        )
        self._graph_max_bs = max_bs
        self._graph_inputs = {}

    def init_forward_metadata_capture_cuda_graph(
        self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor
    ) -> None:
        if self._graph_scratch is None:
            raise RuntimeError("init_cuda_graph_state must run before a capture")
        if not 1 <= bs <= self._graph_max_bs:
            raise ValueError(f"bs {bs} is outside 1..{self._graph_max_bs} (init_cuda_graph_state's max_bs)")
        for name, t in (("req_pool_indices", req_pool_indices), ("seq_lens", seq_lens)):
            if t.dim() != 1 or t.shape[0] < bs or t.device.type != self.device.type:
                raise ValueError(f"{name} must be a [>={bs}] buffer on {self.device}, "
                                 f"got {tuple(t.shape)} on {t.device}")
        inputs = (req_pool_indices[:bs], seq_lens[:bs])
        self._graph_inputs[bs] = inputs
        self._decode = _DecodeMetadata(*inputs, in_graph=True)
        self._extend = None

    def init_forward_metadata_replay_cuda_graph(
        self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, seq_lens_cpu: list[int]
    ) -> None:
        captured = self._graph_inputs.get(bs)
        if captured is None:
            raise ValueError(f"no graph was captured for bs {bs} (captured: {sorted(self._graph_inputs)})")
        # The graph reads the buffers it was captured with: refill them, unless the
        # caller already wrote into those very buffers.
        for dst, src in zip(captured, (req_pool_indices, seq_lens)):
            if src.data_ptr() != dst.data_ptr():
                dst.copy_(src[:bs])
        self._decode = _DecodeMetadata(*captured, in_graph=True)
        self._extend = None

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """Padded requests attend to one position, which their row maps to slot 0 (the padding page)."""
        return 1

    # ----------------------------------------------------------------- forward
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        t = q.shape[0]
        hq, hkv = layer.num_heads, layer.num_kv_heads
        pool = forward_batch.token_to_kv_pool
        if save_kv_cache:
            # reshape, not view: MLA's latent (the "v" here) may be a strided slice; the
            # MLA pool ignores it anyway (its value buffer is a view of the key rows).
            pool.set_kv_buffer(
                layer.layer_id,
                forward_batch.out_cache_loc,
                k.reshape(t, hkv, layer.head_dim),
                v.reshape(t, hkv, layer.v_head_dim),
            )
        k_buf = pool.get_key_buffer(layer.layer_id)
        v_buf = pool.get_value_buffer(layer.layer_id)
        q3 = q.reshape(t, hq, layer.head_dim)
        out = q.new_empty((t, hq, layer.v_head_dim))
        req_to_token = forward_batch.req_to_token_pool.req_to_token
        if forward_batch.forward_mode.is_decode():
            meta = self._decode
            if meta is None:
                raise RuntimeError("init_forward_metadata was not called for this DECODE batch")
            partial_out, partial_lse = self._decode_scratch(t, hq, layer.v_head_dim, meta.in_graph)
            self._ops.decode_attention_fwd(
                q3, k_buf, v_buf, out, req_to_token, meta.req_pool_indices, meta.seq_lens,
                layer.scaling, partial_out, partial_lse,
            )
        else:
            meta = self._extend
            if meta is None:
                raise RuntimeError("init_forward_metadata was not called for this EXTEND batch")
            self._ops.extend_attention_fwd(
                q3, k_buf, v_buf, out, req_to_token, meta.req_pool_indices, meta.seq_lens,
                meta.extend_seq_lens, meta.extend_start_loc, meta.max_extend_len, layer.scaling,
            )
        return out.view(t, hq * layer.v_head_dim)

    def _decode_scratch(self, bs: int, hq: int, dv: int, in_graph: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Split-KV scratch with >= bs rows, >= hq heads and >= dv columns."""

        def fits(s: tuple[torch.Tensor, torch.Tensor] | None) -> bool:
            return s is not None and s[0].shape[0] >= bs and s[0].shape[1] >= hq and s[0].shape[3] >= dv

        if fits(self._graph_scratch):
            return self._graph_scratch
        if in_graph:
            raise RuntimeError(
                f"graph decode needs scratch for bs={bs}, Hq={hq}, Dv={dv}; init_cuda_graph_state "
                f"allocated it for max_bs={self._graph_max_bs}, Hq={self.num_q_heads}, Dv={self.v_head_dim}"
            )
        if not fits(self._scratch):
            old = self._scratch[0].shape if self._scratch is not None else (0, 0, 0, 0)
            self._scratch = self._ops.alloc_decode_scratch(
                max(bs, old[0]), max(hq, old[1]), max(dv, old[3]), self.num_kv_splits, self.device
            )
        return self._scratch
