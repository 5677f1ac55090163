"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hiserve.jit_kernel import cpu as cpu_kernels
from hiserve.layers import triton_ops


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """The torch form (CPU path, and the reference of the fused kernel)."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


class SiluAndMul(nn.Module):
    """[T, 2*I] (gate | up) -> silu(gate) * up, [T, I]; one Triton kernel on CUDA, one C++
    pass on the CPU (hiserve.jit_kernel.cpu.silu_and_mul) when it builds."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if triton_ops.use_triton(x):
            from hiserve.layers.triton_ops.activation import silu_and_mul

            return silu_and_mul(x)
        if x.dim() == 2 and x.stride(1) == 1 and cpu_kernels.use_cpu_kernels(x):
            return cpu_kernels.silu_and_mul(x)
        return silu_and_mul_reference(x)
