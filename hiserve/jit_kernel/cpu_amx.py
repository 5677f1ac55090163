"""Python side of the dense bf16 AMX GEMM (csrc/cpu/amx_bf16_gemm.h): the weight packing and
the checked call. `amx_gemm_available()` (in `cpu`) says whether this process can run it."""

from __future__ import annotations

import torch

from hiserve.jit_kernel.cpu import _check, load_cpu_module


def amx_bf16_packable(weight: torch.Tensor) -> bool:
    """Whether `amx_bf16_pack` takes this weight: bf16 [N, K] on the CPU, N and K positive
    multiples of 32 (the kernel's 32-feature strips and 32-wide K steps)."""
    return (weight.dtype == torch.bfloat16 and weight.is_cpu and weight.dim() == 2
            and weight.shape[0] > 0 and weight.shape[1] > 0
            and weight.shape[0] % 32 == 0 and weight.shape[1] % 32 == 0)


def amx_bf16_pack(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] bf16 -> the kernel's tile layout, bf16 [N/32, K/32, 1024] (the same bytes as W).

    Element [s, kb, 512 h + 32 r + 2 f + p] = W[32 s + 16 h + f, 32 kb + 2 r + p]: per strip of
    32 features and K block of 32, two 16 x 32 B-tile images with K pairs interleaved, AMX's
    VNNI order for TDPBF16PS (Intel Optimization Reference Manual, ch. 20).
    Raises:
        ValueError: not bf16 [N, K] on the CPU with N and K multiples of 32.
    """
    _check(amx_bf16_packable(weight),
           f"amx_bf16_pack takes a bf16 CPU weight [N, K], N and K multiples of 32, got "
           f"{weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    w = weight.detach().reshape(n // 32, 2, 16, k // 32, 16, 2)  # (s, h, f, kb, r, p)
    return w.permute(0, 3, 1, 4, 2, 5).contiguous().reshape(n // 32, k // 32, 1024)


_NO_BIAS = torch.empty(0, dtype=torch.float32)


def amx_bf16_gemm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T (+ bias) on AMX tiles, W from `amx_bf16_pack`; float32 sums, the bias added
    in float32, one rounding to bf16.

    Args:
        x: [M, K] bfloat16 on the CPU, rows contiguous (strided rows allowed); any M.
        packed: bf16 [N/32, K/32, 1024] on the CPU, contiguous, from `amx_bf16_pack`.
        bias: float32 [N] on the CPU, contiguous, or None.
    Returns:
        [M, N] bfloat16, contiguous.
    Raises:
        ValueError: x not bf16 [M, K], a packed weight or bias not as above, or a K that
            disagrees with the packed weight; RuntimeError: no AMX here, or a check of the
            C++ side (memory safety) failed.
    """
    packed_ok = (packed.dtype == torch.bfloat16 and packed.is_cpu and packed.dim() == 3 and packed.is_contiguous()
                 and packed.shape[2] == 1024)
    bias_ok = bias is None or (bias.dtype == torch.float32 and bias.is_cpu and bias.is_contiguous()
                               and packed_ok and bias.shape == (packed.shape[0] * 32,))
    if not (x.dtype == torch.bfloat16 and x.is_cpu and x.dim() == 2 and x.stride(1) == 1 and packed_ok
            and x.shape[1] == packed.shape[1] * 32 and bias_ok):
        _check(x.dtype == torch.bfloat16 and x.is_cpu, f"amx_bf16_gemm takes bfloat16 CPU rows, got {x.dtype}")
        _check(x.dim() == 2 and x.stride(1) == 1, "x must be [M, K] with contiguous rows")
        _check(packed_ok, "packed must be a contiguous bf16 CPU tensor [N/32, K/32, 1024]")
        _check(x.shape[1] == packed.shape[1] * 32,
               f"x has K = {x.shape[1]}, the packed weight {packed.shape[1] * 32}")
        _check(bias_ok, "bias must be a contiguous float32 CPU tensor [N]")
    out = x.new_empty((x.shape[0], packed.shape[0] * 32))
    load_cpu_module().amx_bf16_gemm(x, packed, _NO_BIAS if bias is None else bias, out, torch.get_num_threads())
    return out
