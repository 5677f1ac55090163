"""RMSNorm and residual-add + RMSNorm, one Triton kernel per call, one program per row.

Semantics follow `hiserve.layers.norms.rmsnorm_reference` step by step, including where
torch rounds: the residual sum is rounded to x's dtype (torch adds in that dtype) and is
what gets normalized; the normalized value is rounded to x's dtype before the weight
multiply, whose result has dtype promote(x, weight) as in torch. The one difference is
the order of the fp32 sum of squares (a tree in the kernel), i.e. fp32 rounding noise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_HIDDEN = 65536  # one row must fit in one program's registers


@triton.jit
def _rmsnorm_kernel(X, R, W, Out, ResOut, x_stride, r_stride, out_stride, res_stride, H, eps,
                    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(X + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(R + row * r_stride + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(ResOut.dtype.element_ty)  # torch rounds the sum to x's dtype
        tl.store(ResOut + row * res_stride + cols, s, mask=mask)
        x = s.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    normed = (x * rstd).to(X.dtype.element_ty).to(tl.float32)  # torch casts before the weight
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * out_stride + cols, (normed * w).to(Out.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor, h: int) -> torch.Tensor:
    """[..., H] -> [N, H] with unit column stride (a view where possible)."""
    x2 = x.reshape(-1, h)
    return x2 if x2.stride(1) == 1 else x2.contiguous()


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    if x.dim() < 1 or not x.is_floating_point():
        raise ValueError(f"x must be a floating tensor [..., H], got {tuple(x.shape)} {x.dtype}")
    h = x.shape[-1]
    if weight.shape != (h,):
        raise ValueError(f"weight must be [{h}], got {tuple(weight.shape)}")
    if not 0 < h <= MAX_HIDDEN:
        raise ValueError(f"hidden size {h} outside (0, {MAX_HIDDEN}]")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must match x: {tuple(residual.shape)} {residual.dtype} vs "
                         f"{tuple(x.shape)} {x.dtype}")
    if x.device != weight.device or (residual is not None and residual.device != x.device):
        raise ValueError("x, residual and weight must be on one device")
    x2 = _rows(x, h)
    r2 = _rows(residual, h) if residual is not None else x2
    w = weight if weight.stride(0) == 1 else weight.contiguous()
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res_out = torch.empty_like(x2) if residual is not None else out
    block = triton.next_power_of_2(h)
    if x2.shape[0] > 0:
        _rmsnorm_kernel[(x2.shape[0],)](
            x2, r2, w, out, res_out, x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0), h,
            float(eps), HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return out.view(x.shape), res_out.view(x.shape)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] (fp32/fp16/bf16), weight [H] -> weight * norm(x), dtype promote(x, weight)."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., H] (same dtype), weight [H] -> (weight * norm(x + residual), x + residual).

    Both outputs are new tensors; the sum has x's dtype, the normed output promote(x, weight).
    """
    if residual is None:
        raise ValueError("residual is required (use rmsnorm without one)")
    return _launch(x, residual, weight, eps)
