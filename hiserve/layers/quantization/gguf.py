"""GGUF-native weights on the CPU: llama.cpp's 4-bit block types served as 4-bit weight-only GEMM.

llama.cpp's Q4_0 and Q4_1 store a weight matrix row by row in blocks of 32 values along
the input dimension (ggml-common.h / gguf-py `gguf/quants.py`):
- Q4_1, 20 bytes: scale `d` (fp16), minimum `m` (fp16), 16 bytes of 4-bit codes `q`
  (byte j holds value j in its low nibble and value j+16 in its high nibble); w = d*q + m.
- Q4_0, 18 bytes: `d` (fp16) and the same 16 code bytes; w = d*(q - 8).

PyTorch's CPU int4 weight-only kernel (`aten::_weight_int4pack_mm_for_cpu`, the kernel that
torchao's `Int4CPULayout` also calls) takes codes 0..15 packed by
`aten::_convert_weight_to_int4pack_for_cpu`, a group size (32 here: one GGUF block) and
`scales_and_zeros[K/group, N, 2]` in its input dtype (bf16 here, see below), and computes with
w = (q - 8) * scale + zero (checked by experiment against an identity matrix, see
test/unit/test_gguf_quant.py). So the GGUF block maps exactly: scale = d and
zero = m + 8*d (Q4_1), zero = 0 (Q4_0). The kernel's effective weight is the GGUF's up to
the bf16 rounding of d and m + 8d: it always runs on bfloat16 activations and scales, also in
a float32 model (which casts x in and y out), because its float32 instantiation is scalar
code: 1.2 ms against 0.10 ms in bf16 for one row of a 576 -> 1536 layer, 26x slower at 200
rows, on an AVX2 EPYC (the fast tiles are written for bf16/fp16 inputs).

Where the JIT CPU kernels build, a layer also keeps the file's blocks as they are (5 bits a
weight for Q4_1) for `cpu_kernels.gguf_gemm`, which forms each weight exactly as gguf's
dequantizer does and sums in float32 for either activation dtype; `int4_dispatch` times it
against PyTorch's int4 kernel per shape at start and frees the loser's copy
(`use_block_kernel`). On a CPU with AMX and a bf16 model a layer also packs its blocks for
`cpu_kernels.gguf_amx_gemm` (AMX tiles, one dequantization per call whatever the rows), which
the same set-up times against the few-row kernel and the dense copy (`use_amx_from`).
`GGUFBlockLinear` runs the same kernel for the LM head's few-row calls
on its Q4/Q8_0 blocks (for SmolLM2, the tied Q8_0 embedding).

The layer's optional dense copy (for calls with many rows, see `int4_dispatch.py`) is gguf's
own dequantization (`dequantize_q4`, bit-equal to gguf-py's) rounded once to the model dtype
(2 bytes a weight in bf16, prepacked by `linear.prepack_linear` for the AMX tile GEMM or oneDNN;
4 in float32): the
same values the dequantized path (`--quantization none`) serves.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import nn

from hiserve.jit_kernel import cpu as cpu_kernels
from hiserve.layers.linear import AmxLinear, PackedLinear, can_pack_for_cpu, prepack_linear
from hiserve.layers.linear import linear as dense_linear

GROUP_SIZE = 32  # values per llama.cpp block, and the kernel's group size
INT4_TYPES = {"Q4_0": 18, "Q4_1": 20}  # GGUF type name -> bytes per 32-value block
BLOCK_KERNEL_TYPES = {name: size for name, (_, size) in cpu_kernels.GGUF_BLOCK_TYPES.items()}  # gguf_gemm reads
_INT4_MM = getattr(getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None), "default", None)


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


def _q4_fields(qtype: str, data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """codes uint8 [rows, K] (0..15), d float32 [rows, K/32], m float32 [rows, K/32] (Q4_1; None for Q4_0)."""
    if qtype not in INT4_TYPES:
        raise ValueError(f"not a 4-bit GGUF block type: {qtype}")
    block_bytes = INT4_TYPES[qtype]
    rows = data.shape[0]
    blocks = torch.from_numpy(np.ascontiguousarray(data)).reshape(-1, block_bytes)
    d = blocks[:, 0:2].contiguous().view(torch.float16).float().reshape(rows, -1)
    packed = blocks[:, block_bytes - 16:]
    codes = torch.cat([packed & 0x0F, packed >> 4], dim=1).reshape(rows, -1)  # low nibbles first
    m = blocks[:, 2:4].contiguous().view(torch.float16).float().reshape(rows, -1) if qtype == "Q4_1" else None
    return codes, d, m


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
    codes, d, m = _q4_fields(qtype, data)
    zero = torch.zeros_like(d) if m is None else m + 8.0 * d
    return codes, d, zero


def dequantize_q4(qtype: str, data: np.ndarray) -> torch.Tensor:
    """gguf's own dequantization of Q4_0/Q4_1 rows, same float32 operations (gguf-py
    `quants.py`: Q4_1 w = d*q + m, Q4_0 w = d*(q - 8)), so bit-equal to it.

    Args: as `split_q4_blocks`. Returns: float32 [rows, K]. Raises: ValueError: another type.
    """
    return _dequantize_fields(*_q4_fields(qtype, data))


def _dequantize_fields(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    rows = codes.shape[0]
    q = codes.float().reshape(rows, -1, GROUP_SIZE)
    w = d[..., None] * (q - 8.0) if m is None else d[..., None] * q + m[..., None]
    return w.reshape(rows, -1)


def _amx_records(blocks: torch.Tensor | None, qtype: str | None, dtype: torch.dtype,
                 out_features: int) -> torch.Tensor | None:
    """`blocks` repacked for the AMX GEMM where it runs (AMX CPU, bf16, N % 16 == 0), else None."""
    if blocks is None or dtype != torch.bfloat16 or out_features % 16 or not cpu_kernels.amx_gemm_available():
        return None
    try:
        return cpu_kernels.gguf_amx_pack(blocks, qtype)
    except RuntimeError:  # a Q4_0 scale the fp16 offset cannot hold: the other kernels serve it
        return None


class GGUFInt4Linear(nn.Module):
    """y = x @ W^T + b with W held as int4 codes and per-32 scale/zero (PyTorch's CPU int4 GEMM),
    and optionally a dense copy of the same dequantized W for calls with many rows.

    PyTorch's int4 kernel beats a dense GEMM when it is bound by reading the weight (a few
    rows: decode) and loses when it is compute-bound (prefill, batched decode: it dequantizes
    every group again for each row block). So with `dense_copy` the layer also keeps W as
    gguf's dequantizer gives it, rounded once to `dtype` (in bfloat16 prepacked as the
    dequantized path's GEMM: `linear.prepack_linear`, AMX tiles or oneDNN), and `forward` takes it when x has
    at least `dense_from_rows` rows. That threshold is set per machine after loading
    (`int4_dispatch.setup_int4_dispatch`); until then every call takes the int4 kernel.
    The layer also keeps the file's blocks (`gguf_blocks`, while all shards share one type)
    until the same set-up picks the few-row kernel: `use_block_kernel(True)` then runs
    `cpu_kernels.gguf_gemm` on them and frees the int4 copy, `False` frees the blocks. On an
    AMX CPU in bf16 it also keeps `amx_weight` (the blocks repacked for AMX tiles), which calls
    of at least `amx_from_rows` rows (and fewer than `dense_from_rows`) take (`use_amx_from`).

    Filled shard by shard (`load_rows`, e.g. q, k and v into one fused qkv_proj), then
    `finalize()` packs once; nothing is re-created per call.

    Args:
        in_features: K, a multiple of 32.
        out_features: N, a multiple of 16 (the CPU packing's rule).
        bias: whether a dense bias [N] (float, from the checkpoint) is added.
        dtype: activation dtype (bfloat16 or float32); the int4 kernel computes in bfloat16
            (its scales and zeros are bf16; float32 x is cast in and y out).
        dense_copy: also keep the dense copy (N*K values in `dtype`).
    Forward: x [T, K] in `dtype` -> [T, N] in `dtype`.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 dense_copy: bool = False):
        super().__init__()
        if in_features % GROUP_SIZE:
            raise ValueError(f"in_features {in_features} is not a multiple of {GROUP_SIZE}")
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        self.register_buffer("packed_weight", None, persistent=False)
        self.register_buffer("scales_and_zeros", None, persistent=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.dense_weight: torch.Tensor | PackedLinear | None = None
        self.dense_from_rows = sys.maxsize  # rows from which `forward` takes the dense copy
        self.amx_from_rows = sys.maxsize  # rows from which the AMX GEMM takes the few-row calls
        self.amx_weight: torch.Tensor | None = None
        # Plain-attribute aliases for `forward` (runs ~120 times a decode step): nn.Module's
        # __getattr__ for buffers, parameters and submodules costs more than the int4 call.
        object.__setattr__(self, "_bias", self.bias)
        self._w4: torch.Tensor | None = None
        self._sz: torch.Tensor | None = None
        self._dense_call: Callable[[torch.Tensor], torch.Tensor] | None = None
        groups = in_features // GROUP_SIZE
        # Load-time staging, freed by finalize(): codes 1 byte a value, scale/zero fp32 per group.
        self._codes: torch.Tensor | None = torch.empty(out_features, in_features, dtype=torch.uint8)
        self._scale: torch.Tensor | None = torch.empty(out_features, groups)
        self._zero: torch.Tensor | None = torch.empty(out_features, groups)
        self._dense: torch.Tensor | None = (torch.empty(out_features, in_features, dtype=dtype)
                                            if dense_copy else None)
        # The file's own blocks for the JIT block kernel: staged only where the kernels build,
        # kept while every shard is one type, until `use_block_kernel` keeps one kernel's copy.
        self._stage = cpu_kernels.can_use_cpu_kernels()
        self._blocks: torch.Tensor | None = None
        self.gguf_blocks: torch.Tensor | None = None
        self.qtype: str | None = None
        self._use_blocks = False  # a flag, not a bound method in an attribute (no self-cycle)
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
        codes, d, m = _q4_fields(tensor.qtype, tensor.data)
        self._stage_blocks(start, tensor)
        self._codes[start:start + rows] = codes
        self._scale[start:start + rows] = d
        self._zero[start:start + rows] = 0.0 if m is None else m + 8.0 * d  # as split_q4_blocks
        if self._dense is not None:
            self._dense[start:start + rows] = _dequantize_fields(codes, d, m)
        self._rows_loaded += rows

    def _stage_blocks(self, start: int, tensor: GGUFQuantizedTensor) -> None:
        if not self._stage:
            return
        if self._rows_loaded == 0:
            self.qtype = tensor.qtype
            row_bytes = self.in_features // GROUP_SIZE * INT4_TYPES[tensor.qtype]
            self._blocks = torch.empty(self.out_features, row_bytes, dtype=torch.uint8)
        if tensor.qtype != self.qtype:  # a fused layer of mixed 4-bit types: int4 kernel only
            self._blocks, self.qtype = None, None
        if self._blocks is not None:
            self._blocks[start:start + tensor.shape[0]] = torch.from_numpy(np.ascontiguousarray(tensor.data))

    @property
    def rows_loaded(self) -> int:
        return self.out_features if self._codes is None else self._rows_loaded

    def finalize(self) -> None:
        """Pack the loaded codes for the kernel (and the dense copy, prepacked in bfloat16),
        then drop the staging copies."""
        if self._codes is None:
            return
        # innerKTiles is a CUDA tinygemm layout knob; the CPU packing ignores it.
        self.packed_weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(self._codes.to(torch.int32), 1)
        self.scales_and_zeros = torch.stack([self._scale, self._zero], dim=-1).transpose(0, 1).contiguous().to(
            torch.bfloat16)  # [K/32, N, 2]
        self._w4, self._sz = self.packed_weight, self.scales_and_zeros
        if self._dense is not None:
            dense = self._dense
            if can_pack_for_cpu(dense.device, dense.dtype):
                self.dense_weight = prepack_linear(dense, None)
                self._dense_call = self.dense_weight.forward
            else:
                self.dense_weight = dense
                self._dense_call = functools.partial(dense_linear, weight=dense)
        self.gguf_blocks = self._blocks
        self._codes = self._scale = self._zero = self._dense = self._blocks = None

    def prepare_amx(self) -> bool:
        """Repack the blocks for the AMX GEMM where it runs (AMX CPU, bf16, N % 16 == 0, blocks
        kept: call before `use_block_kernel(False)` frees them); True when the layer has AMX
        weights. `int4_dispatch` calls it at start, before choosing the few-row kernel.

        Raises:
            ValueError: before `finalize()`.
        """
        if self._codes is not None:
            raise ValueError("prepare_amx before finalize()")
        if self.amx_weight is None:
            self.amx_weight = _amx_records(self.gguf_blocks, self.qtype, self.dtype, self.out_features)
        return self.amx_weight is not None

    def use_amx_from(self, rows: int | None) -> None:
        """Calls of at least `rows` rows (below `dense_from_rows`) take the AMX GEMM; None frees
        its weights, 1 frees the few-row kernel's (every call below the dense copy is AMX).

        Raises:
            ValueError: before `finalize()`; `rows` for a layer without AMX weights; None once
                1 freed the few-row kernel's weights.
        """
        if self._codes is not None:
            raise ValueError("use_amx_from before finalize()")
        if rows is None:
            if self.amx_from_rows == 0:
                raise ValueError("the few-row kernel's weights were freed (use_amx_from(1)): AMX must stay")
            self.amx_weight, self.amx_from_rows = None, sys.maxsize
            return
        if self.amx_weight is None:
            raise ValueError("this layer keeps no AMX weights (no AMX, not bf16, or N % 16 != 0)")
        self.amx_from_rows = rows if rows > 1 else 0  # 0: empty calls too, the few-row copy is gone
        if rows <= 1:
            self.packed_weight = self.scales_and_zeros = self._w4 = self._sz = self.gguf_blocks = None

    def use_block_kernel(self, on: bool) -> None:
        """Take the JIT block kernel (`on`) or PyTorch's int4 kernel for calls below
        `dense_from_rows`, and free the other's copy of the weights.

        Raises:
            ValueError: before `finalize()`; `on` for a layer without GGUF blocks (CPU kernels
                unavailable, or shards of mixed types); `off` once the int4 copy was freed.
        """
        if self._codes is not None:
            raise ValueError("use_block_kernel before finalize()")
        if on:
            if self.gguf_blocks is None:
                raise ValueError("this layer keeps no GGUF blocks (CPU kernels unavailable or shards of mixed types)")
            self.packed_weight = self.scales_and_zeros = self._w4 = self._sz = None
        elif self._w4 is None:
            raise ValueError("the int4 copy was freed when the block kernel was chosen")
        else:
            self.gguf_blocks = None
        self._use_blocks = on

    def drop_dense_copy(self) -> None:
        """Free the dense copy; every call then takes the few-row kernel."""
        self.dense_weight, self._dense_call, self.dense_from_rows = None, None, sys.maxsize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # dense_from_rows is sys.maxsize while there is no dense copy (amx_from_rows likewise)
        y = self._dense_matmul(x) if x.shape[0] >= self.dense_from_rows else self._matmul(x)
        return y if self._bias is None else y + self._bias

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """For a stacked gate|up layer: silu(gate) * up fused into the dense copy's GEMM
        (`AmxLinear.silu_mul`) where this call takes that copy and it runs on AMX; else None
        (the caller runs `forward` and the activation)."""
        if x.shape[0] >= self.dense_from_rows and self._bias is None and isinstance(self.dense_weight, AmxLinear):
            return self.dense_weight.silu_mul(x)
        return None

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        """Every call below the dense copy: AMX from `amx_from_rows`, else the few-row kernel."""
        return self._amx_matmul(x) if x.shape[0] >= self.amx_from_rows else self._few_row_matmul(x)

    def _few_row_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """The few-row kernel chosen (`use_block_kernel`; PyTorch's int4 kernel until then)."""
        return self._block_matmul(x) if self._use_blocks else self._int4_matmul(x)

    def _amx_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.gguf_amx_gemm(x, self.amx_weight)

    def _block_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.gguf_gemm(x, self.gguf_blocks, self.qtype)

    def _int4_matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16:
            return _INT4_MM(x.contiguous(), self._w4, GROUP_SIZE, self._sz)
        return _INT4_MM(x.to(torch.bfloat16).contiguous(), self._w4, GROUP_SIZE, self._sz).to(x.dtype)

    def _dense_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self._dense_call(x)

    @torch.no_grad()
    def effective_weight(self) -> torch.Tensor:
        """The weight [N, K] the kernels below the dense copy multiply by (an identity of K rows
        through `_matmul`: the AMX GEMM where it takes K rows, else the few-row kernel), in `dtype`."""
        eye = torch.eye(self.in_features, dtype=self.dtype)
        return self._matmul(eye).t().contiguous()

    @torch.no_grad()
    def effective_dense_weight(self) -> torch.Tensor:
        """The weight [N, K] the dense copy's GEMM multiplies by (identity in, exact), in `dtype`.

        Raises:
            ValueError: the layer keeps no dense copy.
        """
        if self.dense_weight is None:
            raise ValueError("GGUFInt4Linear has no dense copy")
        eye = torch.eye(self.in_features, dtype=self.dtype)
        return self._dense_matmul(eye).t().contiguous()

    def extra_repr(self) -> str:
        dense = "" if self.dense_weight is None else f", dense_from_rows={self.dense_from_rows}"
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={GROUP_SIZE}{dense}"


class GGUFBlockLinear(nn.Module):
    """y = x @ W^T (no bias) for a weight the GGUF stores in Q4_0/Q4_1/Q8_0 blocks and the model
    also holds dense: the LM head, whose dense form (for a tied head, the embedding table) the
    embedding lookup and many-row calls keep using.

    Calls with fewer than `dense_from_rows` rows run the JIT block kernel on the file's blocks
    (a few rows: the logits of a decode step read 4x fewer bytes from Q8_0 than from float32);
    the rest the dense weight. The threshold is calibrated at start
    (`int4_dispatch.setup_int4_dispatch`); until then every call takes the block kernel. On an
    AMX CPU in bf16 the head also keeps its blocks repacked for `cpu_kernels.gguf_amx_gemm`
    (`amx_weight`), which calls of `amx_from_rows` rows up to the dense threshold take.

    Args:
        tensor: the weight's blocks, [N, K] logical, K % 32 == 0.
        dense: the same weight [N, K] in the model dtype (or its prepacked form, a `PackedLinear`).
    Forward: x [M, K] float32/bfloat16 -> [M, N] in x's dtype.
    Raises:
        ValueError: a type the block kernel does not read, or shapes that disagree.
    """

    def __init__(self, tensor: GGUFQuantizedTensor, dense: torch.Tensor | PackedLinear):
        super().__init__()
        if tensor.qtype not in BLOCK_KERNEL_TYPES:
            raise ValueError(f"the block kernel reads {sorted(BLOCK_KERNEL_TYPES)}, not {tensor.qtype}")
        self.out_features, self.in_features = tensor.shape
        self.qtype = tensor.qtype
        self.register_buffer("gguf_blocks", torch.from_numpy(np.ascontiguousarray(tensor.data)), persistent=False)
        self.dense_weight: torch.Tensor | PackedLinear
        self.set_dense_weight(dense)
        self.dense_from_rows = sys.maxsize
        # On an AMX CPU in bf16: the blocks repacked for the AMX GEMM, which calls of at least
        # `amx_from_rows` rows take (set at start with the dense crossover; `use_amx_from`).
        self.amx_from_rows = sys.maxsize
        self.amx_weight: torch.Tensor | None = None

    def set_dense_weight(self, dense: torch.Tensor | PackedLinear) -> None:
        """Point the many-row calls at `dense`, [N, K] in the model dtype or its prepacked
        form (`LlamaForCausalLM.pack_for_cpu` swaps the packed head in after loading).

        Raises:
            ValueError: `dense` is not [out_features, in_features].
        """
        shape = (dense.out_features, dense.in_features) if isinstance(dense, PackedLinear) else tuple(dense.shape)
        if shape != (self.out_features, self.in_features):
            raise ValueError(f"blocks {(self.out_features, self.in_features)} and dense weight {shape} disagree")
        self.dtype = dense.packed_weight.dtype if isinstance(dense, PackedLinear) else dense.dtype
        # A plain attribute, never registered: the weight belongs to the model (the tied
        # embedding, a Parameter, or the packed head, a module), and nn.Module refuses to
        # replace a registered Parameter by a module.
        object.__setattr__(self, "dense_weight", dense)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._dense_matmul(x) if x.shape[0] >= self.dense_from_rows else self._matmul(x)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self._amx_matmul(x) if x.shape[0] >= self.amx_from_rows else self._few_row_matmul(x)

    def _few_row_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.gguf_gemm(x, self.gguf_blocks, self.qtype)

    def _amx_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.gguf_amx_gemm(x, self.amx_weight)

    def prepare_amx(self) -> bool:
        """Repack the blocks for the AMX GEMM where it runs (AMX CPU, bf16, N % 16 == 0); True
        when the head has AMX records. `int4_dispatch` calls it at start."""
        if self.amx_weight is None:
            self.amx_weight = _amx_records(self.gguf_blocks, self.qtype, self.dtype, self.out_features)
        return self.amx_weight is not None

    def use_amx_from(self, rows: int | None) -> None:
        """Calls of at least `rows` rows (below `dense_from_rows`) take the AMX GEMM; None frees
        its records, 1 frees the blocks (every call below the dense weight is AMX).

        Raises:
            ValueError: `rows` for a head without AMX records; None once 1 freed the blocks.
        """
        if rows is None and self.amx_from_rows == 0 and self.dense_from_rows > 0:
            raise ValueError("the head's blocks were freed (use_amx_from(1)): AMX must stay")
        if rows is None:
            self.amx_weight, self.amx_from_rows = None, sys.maxsize
        elif self.amx_weight is None:
            raise ValueError("this head keeps no AMX records (no AMX, not bf16, or N % 16 != 0)")
        elif rows <= 1:
            self.amx_from_rows, self.gguf_blocks = 0, None
        else:
            self.amx_from_rows = rows

    def _dense_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x, self.dense_weight)

    def drop_dense_copy(self) -> None:
        """The dense weight is the model's own (shared): only stop calling it."""
        self.dense_from_rows = sys.maxsize

    def drop_blocks(self) -> None:
        """Free the blocks (and AMX records); every call then takes the dense weight (where it
        won at one row)."""
        self.gguf_blocks, self.amx_weight, self.dense_from_rows = None, None, 0

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, qtype={self.qtype}"
