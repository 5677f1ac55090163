"""Paged extend attention: prefill, or a chunk of new tokens after a cached prefix.

Request i's new tokens are rows `extend_start_loc[i] .. + extend_seq_lens[i]` of q;
their K/V are already in the pool, so the whole context (cached prefix + new tokens)
is read the same way, through `req_to_token`. Query j of request i sits at absolute
position `prefix_len_i + j` (prefix_len = seq_len - extend_seq_len) and attends to
positions `0 .. prefix_len_i + j`.

One program per (request, q head, block of BLOCK_M new tokens), flash-attention
style (online softmax, fp32 accumulators). The grid's last axis covers the longest
extend of the batch; programs past a request's extend run no iterations. Programs of
q heads sharing a kv head read the same K/V tiles, which then come from L2.
Dk is tiled as a power-of-two main part plus a masked remainder (see `common.py`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from hiserve.layers.attention.triton_ops.common import (
    check_attention_args,
    dot_precision,
    split_key_dim,
    value_block,
)

_LOG2E = 1.0 / math.log(2.0)


@triton.jit
def _extend_kernel(
    Q, K, V, Out, ReqToToken, ReqPoolIndices, SeqLens, ExtendSeqLens, ExtendStartLoc,
    qk_scale_log2,
    stride_qt, stride_qh,
    stride_k_slot, stride_k_head,
    stride_v_slot, stride_v_head,
    stride_ot, stride_oh,
    stride_r2t,
    GROUP: tl.constexpr,
    DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DPE: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    q_head = tl.program_id(1)
    m_start = tl.program_id(2) * BLOCK_M
    kv_head = q_head // GROUP

    ext_len = tl.load(ExtendSeqLens + req).to(tl.int32)
    seq_len = tl.load(SeqLens + req).to(tl.int32)
    prefix_len = seq_len - ext_len
    q_start = tl.load(ExtendStartLoc + req).to(tl.int64)
    row = tl.load(ReqPoolIndices + req).to(tl.int64)

    offs_m = m_start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < ext_len
    q_pos = prefix_len + offs_m  # absolute position of each query row
    # Causal: this block's last query sees up to position prefix_len + m_start + BLOCK_M - 1.
    kv_end = tl.where(m_start < ext_len, tl.minimum(seq_len, prefix_len + m_start + BLOCK_M), 0)

    kv_ty = K.dtype.element_ty
    offs_d = tl.arange(0, BLOCK_D)
    q_ptrs = Q + (q_start + offs_m[:, None]) * stride_qt + q_head * stride_qh
    q = tl.load(q_ptrs + offs_d[None, :], mask=mask_m[:, None], other=0.0).to(kv_ty)
    if BLOCK_DPE > 0:
        offs_dpe = BLOCK_D + tl.arange(0, BLOCK_DPE)
        mask_dpe = offs_dpe < DK
        q_pe = tl.load(q_ptrs + offs_dpe[None, :], mask=mask_m[:, None] & mask_dpe[None, :], other=0.0).to(kv_ty)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < DV

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for n0 in range(0, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_end
        slots = tl.load(ReqToToken + row * stride_r2t + offs_n, mask=mask_n, other=0).to(tl.int64)
        k_ptrs = K + slots[None, :] * stride_k_slot + kv_head * stride_k_head
        k = tl.load(k_ptrs + offs_d[:, None], mask=mask_n[None, :], other=0.0)  # [BLOCK_D, BLOCK_N]
        s = tl.dot(q, k, input_precision=DOT_PRECISION)
        if BLOCK_DPE > 0:
            k_pe = tl.load(k_ptrs + offs_dpe[:, None], mask=mask_n[None, :] & mask_dpe[:, None], other=0.0)
            s += tl.dot(q_pe, k_pe, input_precision=DOT_PRECISION)
        # Position 0 is visible to every row, so each row's max is finite after the first tile.
        visible = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(visible, s * qk_scale_log2, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = V + slots[:, None] * stride_v_slot + kv_head * stride_v_head + offs_dv[None, :]
        v = tl.load(v_ptrs, mask=mask_n[:, None] & mask_dv[None, :], other=0.0)  # [BLOCK_N, BLOCK_DV]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o_ptrs = Out + (q_start + offs_m[:, None]) * stride_ot + q_head * stride_oh + offs_dv[None, :]
    tl.store(o_ptrs, (acc / l_safe[:, None]).to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_dv[None, :])


def _tiles(dk: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) by key width: wide heads (MLA's 576) hold a
    [BLOCK_M, 512] fp32 accumulator, so they take smaller tiles and more warps."""
    if dk <= 128:
        return 64, 64, 4
    if dk <= 256:
        return 64, 32, 8
    return 32, 32, 8


def extend_attention_fwd(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    max_extend_len: int,
    scaling: float,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its paged context; writes `out`.

    Args:
        q: `[T, Hq, Dk]` bf16/fp16/fp32; request i's new tokens at rows
            `extend_start_loc[i] .. + extend_seq_lens[i]`.
        k_buf: `[slots, Hkv, Dk]`, one layer of the device pool's keys (slot-indexed), new
            tokens' K already stored.
        v_buf: `[slots, Hkv, Dv]`, same dtype as `k_buf`; may be a strided view (MLA latent).
        out: `[T, Hq, Dv]`.
        req_to_token: int32 `[rows, max_context]`.
        req_pool_indices: int32/int64 `[B]`, row of each request in `req_to_token`.
        seq_lens: int32/int64 `[B]`, prefix + new tokens of each request (<= max_context).
        extend_seq_lens: int32/int64 `[B]`, new tokens of each request.
        extend_start_loc: int32/int64 `[B]`, first q row of each request.
        max_extend_len: max of `extend_seq_lens` (a host int: it sizes the grid).
        scaling: softmax scale applied to q.k.
    Returns:
        `out`.
    Raises:
        ValueError: naming the argument whose shape, dtype or device does not fit.
    """
    if req_pool_indices.dim() != 1:
        raise ValueError(f"req_pool_indices must be [B], got {tuple(req_pool_indices.shape)}")
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, Dk], got {tuple(q.shape)}")
    b = req_pool_indices.shape[0]
    hq, hkv, dk, dv = check_attention_args(
        q, k_buf, v_buf, out, req_to_token, req_pool_indices, seq_lens, b, q.shape[0]
    )
    for name, t in (("extend_seq_lens", extend_seq_lens), ("extend_start_loc", extend_start_loc)):
        if t.dim() != 1 or t.shape[0] != b or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32/int64 [{b}], got {t.dtype} {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if max_extend_len < 0 or (max_extend_len == 0 and q.shape[0] > 0):
        raise ValueError(f"max_extend_len must be the longest extend (> 0 when T > 0), got {max_extend_len}")
    if b == 0 or q.shape[0] == 0:
        return out

    block_m, block_n, num_warps = _tiles(dk)
    block_d, block_dpe = split_key_dim(dk)
    _extend_kernel[(b, hq, triton.cdiv(max_extend_len, block_m))](
        q, k_buf, v_buf, out, req_to_token, req_pool_indices, seq_lens, extend_seq_lens, extend_start_loc,
        scaling * _LOG2E,
        q.stride(0), q.stride(1),
        k_buf.stride(0), k_buf.stride(1),
        v_buf.stride(0), v_buf.stride(1),
        out.stride(0), out.stride(1),
        req_to_token.stride(0),
        GROUP=hq // hkv, DK=dk, DV=dv,
        BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=block_d, BLOCK_DPE=block_dpe, BLOCK_DV=value_block(dv),
        DOT_PRECISION=dot_precision(k_buf.dtype),
        num_warps=num_warps, num_stages=2,
    )
    return out
