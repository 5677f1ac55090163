"""Linear layers with weights prepacked for oneDNN's CPU GEMM.

A plain `F.linear` in bfloat16 on the CPU hands oneDNN a row-major weight that it
re-blocks on every call; decode runs each weight once per step with a handful of rows,
so that reorder costs as much as the multiply. Packing once at load time (the same
oneDNN entry points PyTorch's Inductor uses when it freezes a CPU graph) measured 1.4-2.8x
faster per projection on this project's 2-core AVX512-BF16 machine (see
benchmark/results/). Float32 keeps the plain path: it is the reference dtype whose greedy
outputs must equal transformers', and packing changes its rounding order.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

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
    """y = x @ W^T + b with W prepacked by oneDNN.

    Args:
        weight: [out_features, in_features], bfloat16, on the CPU.
        bias: [out_features] or None.
    Forward: x [T, in_features] -> [T, out_features], same dtype.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        # Batch-size hint 1: decode is the step whose speed the pack is for.
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1),
                             persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed_weight, self.bias,
                                                  "none", [], "")


def pack_linear_layers(module: nn.Module) -> int:
    """Replace every `nn.Linear` under `module` by a `PackedLinear`; returns how many.

    Call after the weights are loaded: the packed copy does not follow later writes.
    """
    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child.weight, child.bias))
                count += 1
    return count


def linear(x: torch.Tensor, weight: torch.Tensor | nn.Module) -> torch.Tensor:
    """`F.linear(x, weight)` for a plain weight, or the forward of a module holding the weight
    in another form (`PackedLinear`, a GGUF block layer)."""
    return weight(x) if isinstance(weight, nn.Module) else F.linear(x, weight)
