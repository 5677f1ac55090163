"""Linear layers with weights prepacked for oneDNN's CPU GEMM.

A plain `F.linear` in bfloat16 on the CPU hands oneDNN a row-major weight that it
re-blocks on every call; decode runs each weight once per step with a handful of rows,
so that reorder costs as much as the multiply. Packing once at load time (the same
oneDNN entry points PyTorch's Inductor uses when it freezes a CPU graph) measured 1.4-2.8x
faster per projection on this project's 2-core AVX512-BF16 machine (see
benchmark/results/). Float32 keeps the plain path: it is the reference dtype whose greedy
outputs must equal transformers', and packing changes its rounding order.

On a CPU with AMX (and the JIT CPU kernels built), `prepack_linear` packs for the project's
own AMX tile GEMM instead (`AmxLinear`, csrc/cpu/amx_bf16_gemm.h): a layer of SmolLM2's four
projections took 0.70-0.80x oneDNN's time from 1 to 392 rows, 1.02x at 1000 and 1.07x at 2048
(oneDNN's large-M blocking is better there) on a 2-core Xeon
(benchmark/results/cpu_amx_dense_gemm.json). The choice is made from the CPU's features at start
and logged once; HISERVE_AMX_DENSE=0 keeps oneDNN.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from hiserve.jit_kernel.cpu import amx_gemm_available
from hiserve.jit_kernel.cpu_amx import amx_bf16_gemm, amx_bf16_gemm_silu, amx_bf16_pack, amx_bf16_packable

logger = logging.getLogger(__name__)


def can_pack_for_cpu(device: torch.device, dtype: torch.dtype) -> bool:
    """True where prepacked oneDNN linear is available and used: CPU, bfloat16, and a CPU
    whose oneDNN bf16 path runs (AVX512BW/VL/DQ or AVX-NE-CONVERT: on an AVX2-only CPU the
    pack raises, so bf16 there takes the plain `F.linear`)."""
    mkldnn = torch.ops.mkldnn
    return (torch.device(device).type == "cpu" and dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available()
            and hasattr(mkldnn, "_reorder_linear_weight") and hasattr(mkldnn, "_linear_pointwise")
            and hasattr(mkldnn, "_is_mkldnn_bf16_supported") and bool(mkldnn._is_mkldnn_bf16_supported()))


class PackedLinear(nn.Module):
    """y = x @ W^T + b with W prepacked once for a GEMM kernel: oneDNN's here, the AMX tile
    GEMM's in `AmxLinear`.

    Args:
        weight: [out_features, in_features], bfloat16, on the CPU.
        bias: [out_features] or None.
    Forward: x [T, in_features] -> [T, out_features], same dtype.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("packed_weight", self._pack(weight.detach()), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().clone(), persistent=False)

    @staticmethod
    def _pack(weight: torch.Tensor) -> torch.Tensor:
        # Batch-size hint 1: decode is the step whose speed the pack is for.
        return torch.ops.mkldnn._reorder_linear_weight(weight, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed_weight, self.bias,
                                                  "none", [], "")


class AmxLinear(PackedLinear):
    """`PackedLinear` on the project's AMX tile GEMM (`cpu_amx.amx_bf16_gemm`): W in its
    32-feature tile strips (the same bytes as W), the bias kept in float32 and added before the
    one rounding to bf16 (as oneDNN does). Needs `amx_dense_usable(weight)`.

    Forward: x [..., in_features] bf16 -> [..., out_features] bf16. Raises ValueError for
    another dtype or width (`amx_bf16_gemm`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(weight, None if bias is None else bias.float())

    @staticmethod
    def _pack(weight: torch.Tensor) -> torch.Tensor:
        return amx_bf16_pack(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
        y = amx_bf16_gemm(x2 if x2.stride(-1) == 1 else x2.contiguous(), self.packed_weight, self.bias)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """For a stacked [gate; up] layer: silu(gate) * up in the GEMM's epilogue
        (`cpu_amx.amx_bf16_gemm_silu`), x [T, in_features] bf16 -> [T, out_features / 2] bf16.
        None where that does not apply (a bias, input not 2-D with contiguous rows, out_features
        not a multiple of 64): the caller then runs `forward` and the activation."""
        if self.bias is not None or x.dim() != 2 or x.stride(1) != 1 or self.out_features % 64:
            return None
        return amx_bf16_gemm_silu(x, self.packed_weight)


@functools.lru_cache(maxsize=None)
def _amx_dense_on() -> bool:
    """AMX tier with the kernels built and tile state granted, unless HISERVE_AMX_DENSE=0; logged once."""
    if os.environ.get("HISERVE_AMX_DENSE", "1") == "0":
        logger.info("dense bf16 linears: oneDNN prepacked (HISERVE_AMX_DENSE=0)")
        return False
    on = amx_gemm_available()
    logger.info("dense bf16 linears: %s", "AMX tile GEMM (csrc/cpu/amx_bf16_gemm.h)" if on
                else "oneDNN prepacked (no AMX on this CPU or no AMX build of the CPU kernels)")
    return on


def amx_dense_usable(weight: torch.Tensor) -> bool:
    """Whether `prepack_linear` gives this weight an `AmxLinear`: an AMX CPU (see `_amx_dense_on`)
    and a bf16 [N, K] weight with N and K multiples of 32."""
    return amx_bf16_packable(weight) and _amx_dense_on()


def prepack_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> PackedLinear:
    """The fastest prepacked form of a bf16 CPU linear here: `AmxLinear` where
    `amx_dense_usable`, else oneDNN's `PackedLinear` (call only where `can_pack_for_cpu`)."""
    return AmxLinear(weight, bias) if amx_dense_usable(weight) else PackedLinear(weight, bias)


def pack_linear_layers(module: nn.Module) -> int:
    """Replace every `nn.Linear` under `module` by a `PackedLinear` (`prepack_linear`'s choice);
    returns how many.

    Call after the weights are loaded: the packed copy does not follow later writes.
    """
    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, prepack_linear(child.weight, child.bias))
                count += 1
    return count


def linear(x: torch.Tensor, weight: torch.Tensor | nn.Module) -> torch.Tensor:
    """`F.linear(x, weight)` for a plain weight, or the forward of a module holding the weight
    in another form (`PackedLinear`, a GGUF block layer)."""
    return weight(x) if isinstance(weight, nn.Module) else F.linear(x, weight)
