"""Fused Triton kernels for the per-layer elementwise ops (RMSNorm, RoPE, SiluAndMul).

At batch-1 decode these ops are launch-bound: the torch forms cost several tiny kernels
each, over every layer. Each kernel here is one launch, with a grid computed from shapes
only (no host sync), so it is safe under CUDA-graph capture.

Importing this package does not import triton; the kernel modules (`rmsnorm`, `rotary`,
`activation`) do. The layers call `use_triton(x)` and keep their torch code as the CPU
path and the reference. `HISERVE_FUSED_OPS=0` in the environment (or setting `ENABLED`
to False) forces the torch path on CUDA too, for A/B runs and tests.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

ENABLED: bool = os.environ.get("HISERVE_FUSED_OPS", "1") != "0"


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(x: torch.Tensor) -> bool:
    """True when `x` should go through the fused Triton kernels (CUDA, triton importable)."""
    return ENABLED and x.is_cuda and triton_available()
