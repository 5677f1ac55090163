"""Paged decode attention (one new token per request) with split-KV (flash-decoding).

A request's context is cut into `num_kv_splits` equal ranges; stage 1 runs one
program per (request, block of q heads sharing a kv head, split), reading slots
straight from `req_to_token`, and writes each split's normalized partial output and
log-sum-exp into fp32 scratch; stage 2 merges the splits. Both grids depend only on
the batch size, the head counts and the fixed `num_kv_splits`, never on lengths, so
a CUDA graph captured once replays correctly for any seq_lens: the lengths are read
inside the kernels, and the scratch is allocated once (`alloc_decode_scratch`).

GQA/MQA: a stage-1 program loads each K/V tile once for up to BLOCK_H q heads of
the same kv head (tl.dot over [BLOCK_H, D] x [D, BLOCK_N]). MLA's absorbed form is
the MQA case Hkv = 1, Dk = kv_lora_rank + qk_rope_head_dim, Dv = kv_lora_rank, with
`v_buf` a strided view of the first Dv columns of `k_buf`.

Log-sum-exps are kept in base 2 (scores are pre-multiplied by log2(e)) so the
kernels use exp2; they never leave the scratch.
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
_BLOCK_H = 16  # q heads per stage-1 program (tl.dot needs >= 16 rows; extra rows are masked)


@triton.jit
def _decode_split_kernel(
    Q, K, V, ReqToToken, ReqPoolIndices, SeqLens, PartialOut, PartialLse,
    qk_scale_log2, max_context,
    stride_qb, stride_qh,
    stride_k_slot, stride_k_head,
    stride_v_slot, stride_v_head,
    stride_r2t,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    GROUP: tl.constexpr,  # q heads per kv head
    HEAD_BLOCKS: tl.constexpr,  # cdiv(GROUP, BLOCK_H)
    DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DPE: tl.constexpr, BLOCK_DV: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_BLOCKS
    head_block = tl.program_id(1) % HEAD_BLOCKS
    split = tl.program_id(2)

    offs_g = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_g < GROUP
    q_heads = kv_head * GROUP + offs_g

    # Never read past the table's row, whatever a (padded) request claims.
    seq_len = tl.minimum(tl.load(SeqLens + b).to(tl.int32), max_context)
    row = tl.load(ReqPoolIndices + b).to(tl.int64)
    split_len = tl.cdiv(seq_len, NUM_KV_SPLITS)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    kv_ty = K.dtype.element_ty
    offs_d = tl.arange(0, BLOCK_D)
    q_ptrs = Q + b * stride_qb + q_heads[:, None] * stride_qh
    q = tl.load(q_ptrs + offs_d[None, :], mask=mask_h[:, None], other=0.0).to(kv_ty)
    if BLOCK_DPE > 0:
        offs_dpe = BLOCK_D + tl.arange(0, BLOCK_DPE)
        mask_dpe = offs_dpe < DK
        q_pe = tl.load(q_ptrs + offs_dpe[None, :], mask=mask_h[:, None] & mask_dpe[None, :], other=0.0).to(kv_ty)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < DV

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slots = tl.load(ReqToToken + row * stride_r2t + offs_n, mask=mask_n, other=0).to(tl.int64)
        k_ptrs = K + slots[None, :] * stride_k_slot + kv_head * stride_k_head
        k = tl.load(k_ptrs + offs_d[:, None], mask=mask_n[None, :], other=0.0)  # [BLOCK_D, BLOCK_N]
        s = tl.dot(q, k, input_precision=DOT_PRECISION)
        if BLOCK_DPE > 0:
            k_pe = tl.load(k_ptrs + offs_dpe[:, None], mask=mask_n[None, :] & mask_dpe[:, None], other=0.0)
            s += tl.dot(q_pe, k_pe, input_precision=DOT_PRECISION)
        s = tl.where(mask_n[None, :], s * qk_scale_log2, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = V + slots[:, None] * stride_v_slot + kv_head * stride_v_head + offs_dv[None, :]
        v = tl.load(v_ptrs, mask=mask_n[:, None] & mask_dv[None, :], other=0.0)  # [BLOCK_N, BLOCK_DV]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # An empty split (short context) stores nothing; stage 2 skips it by the same arithmetic.
    has_keys = end > start
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    po_ptrs = PartialOut + b * stride_pb + q_heads[:, None] * stride_ph + split * stride_ps + offs_dv[None, :]
    tl.store(po_ptrs, acc / l_safe[:, None], mask=has_keys & mask_h[:, None] & mask_dv[None, :])
    tl.store(PartialLse + b * stride_lb + q_heads * stride_lh + split, m_i + tl.log2(l_safe),
             mask=has_keys & mask_h)


@triton.jit
def _decode_merge_kernel(
    PartialOut, PartialLse, SeqLens, Out,
    max_context,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, NUM_KV_SPLITS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.minimum(tl.load(SeqLens + b).to(tl.int32), max_context)
    split_len = tl.cdiv(seq_len, NUM_KV_SPLITS)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < DV

    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for split in tl.static_range(NUM_KV_SPLITS):
        has_keys = split * split_len < seq_len
        lse = tl.load(PartialLse + b * stride_lb + h * stride_lh + split, mask=has_keys, other=float("-inf"))
        part = tl.load(PartialOut + b * stride_pb + h * stride_ph + split * stride_ps + offs_dv,
                       mask=has_keys & mask_dv, other=0.0)
        # Split 0 is never empty for seq_len >= 1, so m_i is finite from then on.
        m_new = tl.maximum(m_i, lse)
        alpha = tl.exp2(m_i - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * alpha + w * part
        l_i = l_i * alpha + w
        m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_dv, (acc / l_safe).to(Out.dtype.element_ty), mask=mask_dv)


def alloc_decode_scratch(
    max_bs: int, num_q_heads: int, v_head_dim: int, num_kv_splits: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate the split-KV scratch once (e.g. for CUDA-graph capture at `max_bs`).

    Returns:
        (partial_out, partial_lse): fp32 `[max_bs, num_q_heads, num_kv_splits, v_head_dim]`
        and fp32 `[max_bs, num_q_heads, num_kv_splits]`; `decode_attention_fwd` uses
        their first B rows. Size in bytes: `4 * max_bs * num_q_heads * num_kv_splits * (v_head_dim + 1)`.
    Raises:
        ValueError: if a size is not positive.
    """
    for name, n in (("max_bs", max_bs), ("num_q_heads", num_q_heads), ("v_head_dim", v_head_dim),
                    ("num_kv_splits", num_kv_splits)):
        if n <= 0:
            raise ValueError(f"{name} must be > 0, got {n}")
    partial_out = torch.empty((max_bs, num_q_heads, num_kv_splits, v_head_dim), dtype=torch.float32, device=device)
    partial_lse = torch.empty((max_bs, num_q_heads, num_kv_splits), dtype=torch.float32, device=device)
    return partial_out, partial_lse


def decode_attention_fwd(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scaling: float,
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
) -> torch.Tensor:
    """Attention of one new token per request over its paged context; writes `out`.

    Args:
        q: `[B, Hq, Dk]` bf16/fp16/fp32, the new tokens' queries.
        k_buf: `[slots, Hkv, Dk]`, one layer of the device pool's keys (slot-indexed).
        v_buf: `[slots, Hkv, Dv]`, same dtype as `k_buf`; may be a strided view (MLA's latent
            columns of `k_buf`). Last dims of q, k_buf, v_buf and out must be contiguous.
        out: `[B, Hq, Dv]`, any of the three dtypes.
        req_to_token: int32 `[rows, max_context]`, slot of each position of each request row.
        req_pool_indices: int32/int64 `[B]`, row of each request in `req_to_token`.
        seq_lens: int32/int64 `[B]`, context length incl. the new token (its K/V is already in
            the pool); lengths past `max_context` are clipped, so nothing is read out of bounds.
        scaling: softmax scale applied to q.k.
        partial_out, partial_lse: scratch from `alloc_decode_scratch` with >= B rows, >= Hq
            heads and >= Dv columns (one allocation can serve several layer shapes); its
            split count is `num_kv_splits`.
    Returns:
        `out`.
    Raises:
        ValueError: naming the argument whose shape, dtype or device does not fit.
    """
    b = q.shape[0]
    hq, hkv, dk, dv = check_attention_args(q, k_buf, v_buf, out, req_to_token, req_pool_indices, seq_lens, b, b)
    if (partial_out.dim() != 4 or partial_out.dtype != torch.float32 or partial_out.shape[0] < b
            or partial_out.shape[1] < hq or partial_out.shape[3] < dv or partial_out.stride(-1) != 1):
        raise ValueError(f"partial_out must be fp32 [>={b}, >={hq}, num_kv_splits, >={dv}], "
                         f"got {partial_out.dtype} {tuple(partial_out.shape)}")
    num_kv_splits = partial_out.shape[2]
    if (partial_lse.dim() != 3 or partial_lse.dtype != torch.float32 or partial_lse.shape[0] < b
            or partial_lse.shape[1] < hq or partial_lse.shape[2] != num_kv_splits or partial_lse.stride(-1) != 1):
        raise ValueError(f"partial_lse must be fp32 [>={b}, >={hq}, {num_kv_splits}], "
                         f"got {partial_lse.dtype} {tuple(partial_lse.shape)}")
    for name, t in (("partial_out", partial_out), ("partial_lse", partial_lse)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if b == 0:
        return out

    group = hq // hkv
    head_blocks = triton.cdiv(group, _BLOCK_H)
    block_d, block_dpe = split_key_dim(dk)
    block_dv = value_block(dv)
    big = dk > 256
    _decode_split_kernel[(b, hkv * head_blocks, num_kv_splits)](
        q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, partial_out, partial_lse,
        scaling * _LOG2E, req_to_token.shape[1],
        q.stride(0), q.stride(1),
        k_buf.stride(0), k_buf.stride(1),
        v_buf.stride(0), v_buf.stride(1),
        req_to_token.stride(0),
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        GROUP=group, HEAD_BLOCKS=head_blocks, DK=dk, DV=dv,
        BLOCK_H=_BLOCK_H, BLOCK_N=32 if big else 64,
        BLOCK_D=block_d, BLOCK_DPE=block_dpe, BLOCK_DV=block_dv,
        NUM_KV_SPLITS=num_kv_splits, DOT_PRECISION=dot_precision(k_buf.dtype),
        num_warps=8 if big else 4, num_stages=2,
    )
    _decode_merge_kernel[(b, hq)](
        partial_out, partial_lse, seq_lens, out,
        req_to_token.shape[1],
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        out.stride(0), out.stride(1),
        DV=dv, BLOCK_DV=block_dv, NUM_KV_SPLITS=num_kv_splits,
        num_warps=4 if block_dv >= 256 else 2,
    )
    return out
