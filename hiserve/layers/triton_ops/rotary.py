"""Rotary position embedding over all heads of a token block in one Triton kernel.

Same semantics as `hiserve.layers.rotary.rotary_reference`: channel pairs (x1, x2) of the
first `rotary_dim` channels become (x1*cos - x2*sin, x2*cos + x1*sin) in fp32, the rest of
the head is copied, the result is rounded to x's dtype. Pairs are (i, i + rotary_dim/2) in
the NeoX (rotate-half) layout, (2i, 2i + 1) when interleaved (GPT-J / DeepSeek style).
The output is a new contiguous tensor, so a strided view (Llama's q|k columns of qkv) can
be passed as is. The kernel may contract a*b - c*d into an fma: fp32 rounding noise only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(X, Cos, Sin, Out, x_stride_t, x_stride_h, cos_stride_t, sin_stride_t, out_stride_t,
                   out_stride_h, num_heads, HALF: tl.constexpr, TAIL: tl.constexpr, INTERLEAVED: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    pairs = tl.arange(0, BLOCK_HALF)
    hmask = heads < num_heads
    pmask = pairs < HALF
    mask = hmask[:, None] & pmask[None, :]
    cos = tl.load(Cos + t * cos_stride_t + pairs, mask=pmask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(Sin + t * sin_stride_t + pairs, mask=pmask, other=0.0).to(tl.float32)[None, :]
    if INTERLEAVED:
        i1 = 2 * pairs
        i2 = 2 * pairs + 1
    else:
        i1 = pairs
        i2 = pairs + HALF
    src = X + t * x_stride_t + heads[:, None] * x_stride_h
    dst = Out + t * out_stride_t + heads[:, None] * out_stride_h
    x1 = tl.load(src + i1[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + i2[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(dst + i1[None, :], (x1 * cos - x2 * sin).to(Out.dtype.element_ty), mask=mask)
    tl.store(dst + i2[None, :], (x2 * cos + x1 * sin).to(Out.dtype.element_ty), mask=mask)
    if TAIL > 0:  # partial rotary: channels past rotary_dim pass through unchanged
        cols = 2 * HALF + tl.arange(0, BLOCK_TAIL)
        tmask = hmask[:, None] & (cols < 2 * HALF + TAIL)[None, :]
        tail = tl.load(src + cols[None, :], mask=tmask, other=0.0)
        tl.store(dst + cols[None, :], tail.to(Out.dtype.element_ty), mask=tmask)


def _table(c: torch.Tensor, name: str, t: int, half: int) -> torch.Tensor:
    """cos or sin, [T, 1, half] (as `get_cos_sin` returns it) or [T, half] -> a [T, half] view."""
    if c.dim() == 3 and c.shape[1] == 1:
        c = c[:, 0]
    if c.shape != (t, half):
        raise ValueError(f"{name} must be [{t}, 1, {half}] or [{t}, {half}], got {tuple(c.shape)}")
    return c if c.stride(1) == 1 else c.contiguous()


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
                     interleaved: bool = False) -> torch.Tensor:
    """x [T, heads, head_dim] (fp32/fp16/bf16, any strides with unit channel stride after a copy),
    cos/sin [T, 1, rotary_dim // 2] float32 -> rotated copy [T, heads, head_dim], x's dtype."""
    if x.dim() != 3 or not x.is_floating_point():
        raise ValueError(f"x must be a floating [T, heads, head_dim] tensor, got {tuple(x.shape)} {x.dtype}")
    t, heads, head_dim = x.shape
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim must be even and in (0, {head_dim}], got {rotary_dim}")
    half = rotary_dim // 2
    cos, sin = _table(cos, "cos", t, half), _table(sin, "sin", t, half)
    if not (x.device == cos.device == sin.device):
        raise ValueError("x, cos and sin must be on one device")
    if x.stride(2) != 1:
        x = x.contiguous()
    out = torch.empty((t, heads, head_dim), dtype=x.dtype, device=x.device)
    if t == 0 or heads == 0:
        return out
    block_half = triton.next_power_of_2(half)
    block_h = max(1, min(triton.next_power_of_2(heads), 2048 // block_half))
    tail = head_dim - rotary_dim
    grid = (t, triton.cdiv(heads, block_h))
    _rotary_kernel[grid](
        x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), out.stride(0), out.stride(1),
        heads, HALF=half, TAIL=tail, INTERLEAVED=interleaved, BLOCK_H=block_h, BLOCK_HALF=block_half,
        BLOCK_TAIL=triton.next_power_of_2(max(tail, 1)), num_warps=4)
    return out
