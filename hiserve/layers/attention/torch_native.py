"""Attention in plain PyTorch: the CPU path and the oracle for GPU backends.

Every layer first writes the new tokens' K/V into the device pool, then reads each
request's whole context back through `req_to_token`, so a cached prefix and the
new tokens are handled the same way.

- DECODE: one batched computation for all requests. The context slots of every
  request are gathered into a padded [B, max_len] index once per batch; padding
  points at slot 0 (the reserved padding page) and is masked out.
- EXTEND: a loop over requests; the new tokens of a request are the last
  `extend_seq_len` positions of its context, and query j (absolute position
  prefix_len + j) sees keys at positions <= prefix_len + j.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hiserve.layers.attention import torch_native_mla
from hiserve.layers.attention.base import AttentionBackend, RadixAttention
from hiserve.layers.forward_batch import ForwardBatch


@dataclass
class _DecodeMetadata:
    kv_indices: torch.Tensor  # [B, max_len] int64 slots, padding -> 0
    valid: torch.Tensor  # [B, 1, 1, max_len] bool
    max_len: int
    bias: dict  # dtype -> additive mask [B, 1, 1, max_len] (0 / -inf), built on first use
    head_rows: dict  # num_kv_heads -> [B * Hkv * max_len] rows of the pool viewed [slots * Hkv, D]

    def rows_for(self, num_kv_heads: int) -> torch.Tensor:
        """Gather index that reads the pool straight into [B, Hkv, max_len, D] order."""
        rows = self.head_rows.get(num_kv_heads)
        if rows is None:
            heads = torch.arange(num_kv_heads, device=self.kv_indices.device).view(1, -1, 1)
            rows = (self.kv_indices.unsqueeze(1) * num_kv_heads + heads).reshape(-1)
            self.head_rows[num_kv_heads] = rows
        return rows


@dataclass
class _ExtendRequest:
    q_start: int
    q_end: int
    kv_indices: torch.Tensor  # [seq_len] int64 slots of the whole context
    mask: torch.Tensor | None  # [extend_len, seq_len] bool, None when there is no prefix


def _gather_rows(buf: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`buf.reshape(-1, D).index_select(0, rows)`, moving each row as int64 words when it can:
    index_select copies 16-bit elements one at a time, 8-byte words 2-4x faster on the CPU."""
    flat = buf.reshape(-1, buf.shape[-1])
    if (flat.shape[-1] * flat.element_size()) % 8 == 0 and flat.element_size() < 8:
        return flat.view(torch.int64).index_select(0, rows).view(flat.dtype)
    return flat.index_select(0, rows)


class TorchNativeAttnBackend(AttentionBackend):
    def __init__(self, *args, **kwargs):
        # Accepts (and ignores) construction arguments such as a model runner.
        self._decode: _DecodeMetadata | None = None
        self._extend: list[_ExtendRequest] | None = None

    # ---------------------------------------------------------------- metadata
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        req_to_token = forward_batch.req_to_token_pool.req_to_token
        device = req_to_token.device
        seq_lens = forward_batch.seq_lens_cpu
        if forward_batch.forward_mode.is_decode():
            max_len = max(seq_lens)
            rows = req_to_token.index_select(0, forward_batch.req_pool_indices.to(device))[:, :max_len]
            lens = forward_batch.seq_lens.to(device).view(-1, 1)
            valid = torch.arange(max_len, device=device).view(1, -1) < lens  # [B, max_len]
            kv_indices = torch.where(valid, rows.long(), torch.zeros((), dtype=torch.long, device=device))
            self._decode = _DecodeMetadata(
                kv_indices=kv_indices,
                valid=valid.view(len(seq_lens), 1, 1, max_len),
                max_len=max_len,
                bias={},
                head_rows={},
            )
            self._extend = None
            return

        reqs = []
        req_rows = forward_batch.req_pool_indices.tolist()
        q_start = 0
        for row, seq_len, ext_len in zip(req_rows, seq_lens, forward_batch.extend_seq_lens_cpu):
            prefix_len = seq_len - ext_len
            kv_indices = req_to_token[row, :seq_len].long()
            mask = None
            if prefix_len > 0:
                q_pos = torch.arange(prefix_len, seq_len, device=device).view(-1, 1)
                mask = torch.arange(seq_len, device=device).view(1, -1) <= q_pos
            reqs.append(_ExtendRequest(q_start, q_start + ext_len, kv_indices, mask))
            q_start += ext_len
        self._extend = reqs
        self._decode = None

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
        pool = forward_batch.token_to_kv_pool
        if save_kv_cache:
            pool.set_kv_buffer(
                layer.layer_id,
                forward_batch.out_cache_loc,
                k.view(t, layer.num_kv_heads, layer.head_dim),
                v.view(t, layer.num_kv_heads, layer.v_head_dim),
            )
        k_buf = pool.get_key_buffer(layer.layer_id)
        v_buf = pool.get_value_buffer(layer.layer_id)
        if forward_batch.forward_mode.is_decode():
            return self._forward_decode(q, k_buf, v_buf, layer)
        return self._forward_extend(q, k_buf, v_buf, layer)

    def forward_mla(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        k_rope: torch.Tensor,
        layer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """MLA (DeepSeek) over the latent pool: expanded EXTEND, absorbed DECODE.

        See `hiserve/layers/attention/mla.py` for the shapes and `torch_native_mla.py` for the math.
        """
        return torch_native_mla.forward_mla(
            self, q_nope, q_rope, latent, k_rope, layer, forward_batch, save_kv_cache
        )

    def _forward_decode(self, q, k_buf, v_buf, layer: RadixAttention) -> torch.Tensor:
        meta = self._decode
        assert meta is not None, "init_forward_metadata was not called for this DECODE batch"
        b, hq, hkv = q.shape[0], layer.num_heads, layer.num_kv_heads
        group = hq // hkv
        # One gather per buffer, landing contiguous in [B, Hkv, L, D] (no transpose copy).
        rows = meta.rows_for(hkv)
        keys = _gather_rows(k_buf, rows).view(b, hkv, meta.max_len, -1)
        values = _gather_rows(v_buf, rows).view(b, hkv, meta.max_len, -1)
        if keys.dtype != q.dtype:
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        q4 = q.view(b, hkv, group, layer.head_dim)  # q head h uses kv head h // group
        scores = torch.matmul(q4, keys.transpose(-1, -2)).mul_(layer.scaling)  # [B, Hkv, G, L]
        bias = meta.bias.get(scores.dtype)
        if bias is None:
            bias = torch.zeros(meta.valid.shape, dtype=scores.dtype, device=scores.device)
            bias.masked_fill_(~meta.valid, float("-inf"))
            meta.bias[scores.dtype] = bias
        scores.add_(bias)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
        out = torch.matmul(probs, values)  # [B, Hkv, G, Dv]
        return out.reshape(b, hq * layer.v_head_dim)

    def _forward_extend(self, q, k_buf, v_buf, layer: RadixAttention) -> torch.Tensor:
        assert self._extend is not None, "init_forward_metadata was not called for this EXTEND batch"
        hq, dv = layer.num_heads, layer.v_head_dim
        out = q.new_empty((q.shape[0], hq * dv))
        gqa = hq != layer.num_kv_heads
        for req in self._extend:
            n = req.q_end - req.q_start
            qi = q[req.q_start : req.q_end].view(n, hq, layer.head_dim).transpose(0, 1)  # [Hq, n, D]
            ki = k_buf.index_select(0, req.kv_indices).transpose(0, 1).to(q.dtype)  # [Hkv, S, D]
            vi = v_buf.index_select(0, req.kv_indices).transpose(0, 1).to(q.dtype)  # [Hkv, S, Dv]
            oi = F.scaled_dot_product_attention(
                qi.unsqueeze(0),
                ki.unsqueeze(0),
                vi.unsqueeze(0),
                attn_mask=req.mask,
                is_causal=req.mask is None,
                scale=layer.scaling,
                enable_gqa=gqa,
            )  # [1, Hq, n, Dv]
            out[req.q_start : req.q_end] = oi[0].transpose(0, 1).reshape(n, hq * dv)
        return out
