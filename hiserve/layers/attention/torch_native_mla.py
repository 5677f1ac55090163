"""MLA attention in plain PyTorch: the CPU path and the oracle for GPU MLA backends.

`TorchNativeAttnBackend.forward_mla` lands here. Both forms of `mla.py` are here:
- EXTEND (prefill / prefix + new tokens): expanded by default. Per request, the
  cached rows of the whole context are read back through `req_to_token`, their
  latents up-projected through `kv_b_proj` into per-head k_nope and v, and the new
  tokens attend causally (query j at absolute position prefix_len + j sees keys at
  positions <= prefix_len + j), exactly as the MHA path does.
- DECODE: absorbed. One batched computation over a padded `[B, max_len]` gather of
  the cached rows (padding points at slot 0 and is masked), never materializing
  per-head K/V.
`extend_absorbed=True` runs EXTEND in the absorbed form too (tests check that both
forms agree; a GPU backend may prefer it when the new tokens are few against a long
cached prefix).

The per-batch index metadata is the torch-native backend's own
(`init_forward_metadata`): `_decode` (`kv_indices` [B, max_len] or flat, `valid`, `max_len`) and
`_extend` (per request `q_start`, `q_end`, `kv_indices`, `mask`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hiserve.layers.attention.mla import MLAAttention, absorb_out, absorb_q, save_mla_kv
from hiserve.layers.forward_batch import ForwardBatch


def forward_mla(
    backend,
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latent: torch.Tensor,
    k_rope: torch.Tensor,
    layer: MLAAttention,
    forward_batch: ForwardBatch,
    save_kv_cache: bool = True,
    extend_absorbed: bool = False,
) -> torch.Tensor:
    """q_nope [T, H, qk_nope], q_rope [T, H, rope], latent [T, r], k_rope [T, rope]
    -> [T, H * v_head_dim]. `backend` is a `TorchNativeAttnBackend` whose
    `init_forward_metadata` ran for this batch."""
    if save_kv_cache:
        save_mla_kv(layer, forward_batch, latent, k_rope)
    rows = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id)  # [slots, 1, r + rope]
    if forward_batch.forward_mode.is_decode():
        meta = backend._decode
        assert meta is not None, "init_forward_metadata was not called for this DECODE batch"
        kv_indices = meta.kv_indices.reshape(-1)  # [B * max_len]
        return mla_decode_absorbed(q_nope, q_rope, rows, kv_indices, meta.valid, meta.max_len, layer)
    reqs = backend._extend
    assert reqs is not None, "init_forward_metadata was not called for this EXTEND batch"
    if extend_absorbed:
        return mla_extend_absorbed(q_nope, q_rope, rows, reqs, layer)
    return mla_extend_expanded(q_nope, q_rope, rows, reqs, layer)


def mla_extend_expanded(q_nope, q_rope, rows, reqs, layer: MLAAttention) -> torch.Tensor:
    """Up-project each request's cached latents into per-head k_nope / v, then causal attention."""
    h, r, dv = layer.num_heads, layer.kv_lora_rank, layer.mla_v_head_dim
    dtype = q_nope.dtype
    w_kv = layer.w_kv.to(dtype)  # [H, qk_nope + v, r]
    out = q_nope.new_empty((q_nope.shape[0], h * dv))
    for req in reqs:
        n = req.q_end - req.q_start
        ctx = rows.index_select(0, req.kv_indices)[:, 0].to(dtype)  # [S, r + rope]
        s = ctx.shape[0]
        kv = torch.matmul(ctx[:, :r], w_kv.transpose(1, 2))  # [H, S, qk_nope + v]
        k_nope, v = kv.split([layer.qk_nope_head_dim, dv], dim=-1)
        k_rope = ctx[:, r:].unsqueeze(0).expand(h, s, layer.qk_rope_head_dim)
        k = torch.cat([k_nope, k_rope], dim=-1)  # [H, S, qk_nope + rope]
        q = torch.cat([q_nope[req.q_start : req.q_end], q_rope[req.q_start : req.q_end].to(dtype)], dim=-1)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),  # [1, H, n, qk_nope + rope]
            k.unsqueeze(0),
            v.unsqueeze(0),
            attn_mask=req.mask,
            is_causal=req.mask is None,
            scale=layer.scaling,
        )  # [1, H, n, v]
        out[req.q_start : req.q_end] = o[0].transpose(0, 1).reshape(n, h * dv)
    return out


def mla_extend_absorbed(q_nope, q_rope, rows, reqs, layer: MLAAttention) -> torch.Tensor:
    """EXTEND in the absorbed form: MQA of `[q_lat | q_rope]` over the cached rows."""
    h, r = layer.num_heads, layer.kv_lora_rank
    dtype = q_nope.dtype
    q_all = torch.cat([absorb_q(q_nope, layer), q_rope.to(dtype)], dim=-1)  # [T, H, r + rope]
    o_lat = q_nope.new_empty((q_nope.shape[0], h, r))
    for req in reqs:
        ctx = rows.index_select(0, req.kv_indices).transpose(0, 1).to(dtype)  # [1, S, r + rope]
        o = F.scaled_dot_product_attention(
            q_all[req.q_start : req.q_end].transpose(0, 1).unsqueeze(0),  # [1, H, n, r + rope]
            ctx.unsqueeze(0),
            ctx[..., :r].unsqueeze(0),
            attn_mask=req.mask,
            is_causal=req.mask is None,
            scale=layer.scaling,
            enable_gqa=True,
        )  # [1, H, n, r]
        o_lat[req.q_start : req.q_end] = o[0].transpose(0, 1)
    return absorb_out(o_lat, layer)


def mla_decode_absorbed(
    q_nope, q_rope, rows, kv_indices: torch.Tensor, valid: torch.Tensor, max_len: int, layer: MLAAttention
) -> torch.Tensor:
    """One new token per request; kv_indices [B * max_len] (padding -> slot 0), valid [B, ..., max_len]."""
    b, r = q_nope.shape[0], layer.kv_lora_rank
    dtype = q_nope.dtype
    ctx = rows.index_select(0, kv_indices).view(b, max_len, layer.head_dim).to(dtype)  # [B, L, r + rope]
    q = torch.cat([absorb_q(q_nope, layer), q_rope.to(dtype)], dim=-1)  # [B, H, r + rope]
    scores = torch.matmul(q, ctx.transpose(1, 2)).mul_(layer.scaling)  # [B, H, L]
    scores.masked_fill_(~valid.reshape(b, 1, max_len), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)
    o_lat = torch.matmul(probs, ctx[..., :r])  # [B, H, r]
    return absorb_out(o_lat, layer)
