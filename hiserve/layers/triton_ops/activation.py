"""silu(gate) * up over a [T, 2*I] (gate | up) tensor in one Triton kernel.

Rounds like `hiserve.layers.activations.silu_and_mul_reference` in torch: silu(gate) is
computed in fp32 and rounded to x's dtype, then multiplied by up in fp32 and rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(X, Out, x_stride, out_stride, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(X + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * x_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(X.dtype.element_ty).to(tl.float32)
    tl.store(Out + row * out_stride + cols, (act * up).to(Out.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2*I] (fp32/fp16/bf16) -> silu(x[..., :I]) * x[..., I:], [..., I], x's dtype."""
    if x.dim() < 1 or not x.is_floating_point() or x.shape[-1] % 2:
        raise ValueError(f"x must be a floating [..., 2*I] tensor, got {tuple(x.shape)} {x.dtype}")
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inter)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0 and inter > 0:
        grid = (x2.shape[0], triton.cdiv(inter, BLOCK))
        _silu_and_mul_kernel[grid](x2, out, x2.stride(0), out.stride(0), inter, BLOCK=BLOCK, num_warps=4)
    return out.view(*x.shape[:-1], inter)
