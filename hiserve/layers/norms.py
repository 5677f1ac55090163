"""RMSNorm, with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn

from hiserve.jit_kernel import cpu as cpu_kernels
from hiserve.layers import triton_ops


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch form (CPU path, and the reference of the fused kernel): normalize in
    float32, round to x's dtype, then multiply by the weight in the weight's dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32.

    `forward(x, residual)` first adds `residual` to `x` and returns the sum as
    the new residual stream, so a decoder layer needs no separate add.
    On CUDA both forms are one Triton kernel (hiserve.layers.triton_ops.rmsnorm), on the
    CPU one C++ pass (hiserve.jit_kernel.cpu.rmsnorm) when it builds, else the torch form.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if triton_ops.use_triton(x):
            from hiserve.layers.triton_ops import rmsnorm as k

            if residual is None:
                return k.rmsnorm(x, self.weight, self.eps)
            return k.fused_add_rmsnorm(x, residual, self.weight, self.eps)
        if x.dim() == 2 and cpu_kernels.use_cpu_kernels(x, self.weight) and (
                residual is None or residual.dtype == x.dtype):
            return cpu_kernels.rmsnorm(x, self.weight, self.eps, residual)
        if residual is None:
            return rmsnorm_reference(x, self.weight, self.eps)
        x = x + residual
        return rmsnorm_reference(x, self.weight, self.eps), x
