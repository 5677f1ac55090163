"""Weight quantization methods (`--quantization`), named as SGLang names them.

- `gguf`: a GGUF checkpoint served in its own format on the CPU: every Linear whose GGUF
  tensors are all Q4_0/Q4_1 is a `gguf.GGUFInt4Linear`, whose few-row calls (decode) run
  either PyTorch's int4 weight-only GEMM or the JIT block kernel on the file's own blocks
  (`cpu_kernels.gguf_gemm`), whichever was faster at start for that shape. Tensors of other
  GGUF types (Q8_0/Q6_K/F16 embeddings, heads, or a mixed fused layer) are dequantized to the
  model dtype; an LM head (or tied embedding) in Q4_0/Q4_1/Q8_0 also keeps its blocks for the
  block kernel's few-row calls (`gguf.GGUFBlockLinear`).
  Each such layer also keeps a dense copy of the same dequantized weights for calls with many
  rows (prefill, batched decode), where that GEMM is faster; the row count where it takes
  over is calibrated at start (`int4_dispatch`).
- `none`: every tensor dequantized to `--dtype` (the reference path).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from hiserve.layers.quantization.gguf import (BLOCK_KERNEL_TYPES, GROUP_SIZE, INT4_TYPES, GGUFBlockLinear,
                                             GGUFInt4Linear, GGUFQuantizedTensor)
from hiserve.layers.quantization.int4_dispatch import dense_copy_enabled, setup_int4_dispatch

QUANTIZATION_METHODS = ("gguf", "none")

__all__ = ["BLOCK_KERNEL_TYPES", "QUANTIZATION_METHODS", "GGUFBlockLinear", "GGUFInt4Config", "GGUFInt4Linear",
           "GGUFQuantizedTensor",
           "make_linear", "setup_int4_dispatch"]


@dataclass
class GGUFInt4Config:
    """Which checkpoint tensors stay in 4-bit blocks.

    Attributes:
        tensor_types: HF parameter name -> GGUF type name, for every tensor of the file.
        int4_names: filled while the model is built: the names whose blocks a
            `GGUFInt4Linear` takes (the loader yields those as `GGUFQuantizedTensor`).
        head_name: set after loading when the LM head's few-row calls read this tensor's
            blocks (`GGUFBlockLinear`; the embedding's when the head is tied).
    """

    tensor_types: dict[str, str]
    int4_names: set[str] = field(default_factory=set)
    head_name: str | None = None

    def takes(self, names: Sequence[str]) -> bool:
        """True when every shard of one (possibly fused) Linear is Q4_0/Q4_1."""
        return all(self.tensor_types.get(n) in INT4_TYPES for n in names)

    def describe(self) -> str:
        """One line: which GGUF types go where."""
        kept = sorted({self.tensor_types[n] for n in self.int4_names})
        dense = sorted({t for n, t in self.tensor_types.items() if n not in self.int4_names and
                        n.endswith(".weight") and not n.endswith("norm.weight")})
        head = (f"; LM head few-row calls on {self.head_name}'s {self.tensor_types[self.head_name]} blocks"
                if self.head_name else "")
        return (f"{len(self.int4_names)} tensors ({', '.join(kept) or '-'}) as 4-bit weight-only GEMM "
                f"(int4 or block kernel, chosen at start); dequantized: {', '.join(dense) or '-'}{head}")


def make_linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                quant_config: GGUFInt4Config | None, names: Sequence[str]) -> nn.Module:
    """A `GGUFInt4Linear` when `quant_config` takes all of `names` (the checkpoint tensors
    stacked into this layer, in row order) and the kernel's shape rules (K % 32, N % 16), else a
    dense `nn.Linear`."""
    fits = in_features % GROUP_SIZE == 0 and out_features % 16 == 0
    if quant_config is not None and fits and quant_config.takes(names):
        quant_config.int4_names.update(names)
        return GGUFInt4Linear(in_features, out_features, bias, dtype, dense_copy=dense_copy_enabled())
    return nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
