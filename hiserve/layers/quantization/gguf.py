"""GGUF-native weights on the CPU: llama.cpp's 4-bit block types served as int4 weight-only GEMM.

llama.cpp's Q4_0 and Q4_1 store a weight matrix row by row in blocks of 32 values along
the input dimension (ggml-common.h / gguf-py `gguf/quants.py`):
- Q4_1, 20 bytes: scale `d` (fp16), minimum `m` (fp16), 16 bytes of 4-bit codes `q`
  (byte j holds value j in its low nibble and value j+16 in its high nibble); w = d*q + m.
- Q4_0, 18 bytes: `d` (fp16) and the same 16 code bytes; w = d*(q - 8).

PyTorch's CPU int4 weight-only kernel (`aten::_weight_int4pack_mm_for_cpu`, the kernel that
torchao's `Int4CPULayout` also calls) takes codes 0..15 packed by
`aten::_convert_weight_to_int4pack_for_cpu`, a group size (32 here: one GGUF block) and
`scales_and_zeros[K/group, N, 2]` in the activation dtype, and computes with
w = (q - 8) * scale + zero (checked by experiment against an identity matrix, see
test/unit/test_gguf_quant.py). So the GGUF block maps exactly: scale = d and
zero = m + 8*d (Q4_1), zero = 0 (Q4_0). In bfloat16 the kernel's effective weight is the
GGUF's up to the bf16 rounding of d and m + 8d; in float32 it is exact up to fp32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

GROUP_SIZE = 32  # values per llama.cpp block, and the kernel's group size
INT4_TYPES = {"Q4_0": 18, "Q4_1": 20}  # GGUF type name -> bytes per 32-value block


@dataclass
class GGUFQuantizedTensor:
    """One GGUF tensor kept in its stored blocks (not dequantized).

    Attributes:
        qtype: GGUF type name, e.g. "Q4_1".
        data: uint8 numpy array [rows, bytes_per_row] (rows = output features).
        shape: (rows, cols) of the logical weight, cols = input features.
    """

    qtype: str
    data: np.ndarray
    shape: tuple[int, int]


def int4_kernel_available() -> bool:
    """True where PyTorch has the CPU int4 weight-only GEMM and its packing op."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


def split_q4_blocks(qtype: str, data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode Q4_0/Q4_1 rows into codes and the kernel's per-group scale and zero.

    Args:
        qtype: "Q4_0" or "Q4_1".
        data: uint8 [rows, bytes_per_row]; bytes_per_row a multiple of the block size.
    Returns:
        codes uint8 [rows, K] in 0..15, scale float32 [rows, K/32], zero float32 [rows, K/32]
        with w = (codes - 8) * scale + zero.
    Raises:
        ValueError: another type.
    """
    if qtype not in INT4_TYPES:
        raise ValueError(f"not a 4-bit GGUF block type: {qtype}")
    block_bytes = INT4_TYPES[qtype]
    rows = data.shape[0]
    blocks = torch.from_numpy(np.ascontiguousarray(data)).reshape(-1, block_bytes)
    d = blocks[:, 0:2].contiguous().view(torch.float16).float().reshape(rows, -1)
    packed = blocks[:, block_bytes - 16:]
    codes = torch.cat([packed & 0x0F, packed >> 4], dim=1).reshape(rows, -1)  # low nibbles first
    if qtype == "Q4_1":
        m = blocks[:, 2:4].contiguous().view(torch.float16).float().reshape(rows, -1)
        zero = m + 8.0 * d
    else:
        zero = torch.zeros_like(d)
    return codes, d, zero


class GGUFInt4Linear(nn.Module):
    """y = x @ W^T + b with W held as int4 codes and per-32 scale/zero (PyTorch's CPU int4 GEMM).

    Filled shard by shard (`load_rows`, e.g. q, k and v into one fused qkv_proj), then
    `finalize()` packs once; nothing is re-created per call.

    Args:
        in_features: K, a multiple of 32.
        out_features: N, a multiple of 16 (the CPU packing's rule).
        bias: whether a dense bias [N] (float, from the checkpoint) is added.
        dtype: activation dtype (bfloat16 or float32); the scales and zeros are stored in it.
    Forward: x [T, K] in `dtype` -> [T, N] in `dtype`.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        if in_features % GROUP_SIZE:
            raise ValueError(f"in_features {in_features} is not a multiple of {GROUP_SIZE}")
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        self.register_buffer("packed_weight", None, persistent=False)
        self.register_buffer("scales_and_zeros", None, persistent=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        groups = in_features // GROUP_SIZE
        # Load-time staging, freed by finalize(): codes 1 byte a value, scale/zero fp32 per group.
        self._codes: torch.Tensor | None = torch.empty(out_features, in_features, dtype=torch.uint8)
        self._scale: torch.Tensor | None = torch.empty(out_features, groups)
        self._zero: torch.Tensor | None = torch.empty(out_features, groups)
        self._rows_loaded = 0

    def load_rows(self, start: int, tensor: GGUFQuantizedTensor) -> None:
        """Write a Q4_0/Q4_1 tensor's rows into output rows [start, start + rows).

        Raises:
            ValueError: wrong width, rows out of range, or called after finalize().
        """
        if self._codes is None:
            raise ValueError("GGUFInt4Linear.load_rows after finalize()")
        rows, cols = tensor.shape
        if cols != self.in_features or start < 0 or start + rows > self.out_features:
            raise ValueError(f"shard {tensor.shape} at row {start} does not fit [{self.out_features}, "
                             f"{self.in_features}]")
        codes, scale, zero = split_q4_blocks(tensor.qtype, tensor.data)
        self._codes[start:start + rows] = codes
        self._scale[start:start + rows] = scale
        self._zero[start:start + rows] = zero
        self._rows_loaded += rows

    @property
    def rows_loaded(self) -> int:
        return self.out_features if self._codes is None else self._rows_loaded

    def finalize(self) -> None:
        """Pack the loaded codes for the kernel and drop the staging copies."""
        if self._codes is None:
            return
        # innerKTiles is a CUDA tinygemm layout knob; the CPU packing ignores it.
        self.packed_weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(self._codes.to(torch.int32), 1)
        self.scales_and_zeros = torch.stack([self._scale, self._zero], dim=-1).transpose(0, 1).contiguous().to(
            self.dtype)  # [K/32, N, 2]
        self._codes = self._scale = self._zero = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x)
        return y if self.bias is None else y + self.bias

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed_weight, GROUP_SIZE,
                                                          self.scales_and_zeros)

    @torch.no_grad()
    def effective_weight(self) -> torch.Tensor:
        """The weight [N, K] the kernel multiplies by (the kernel applied to an identity), in `dtype`."""
        eye = torch.eye(self.in_features, dtype=self.dtype, device=self.packed_weight.device)
        return self._matmul(eye).t().contiguous()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={GROUP_SIZE}"
