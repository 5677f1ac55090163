"""Shared pieces of the Triton attention ops: head-dim tiling and argument checks.

A head dim need not be a power of two (Llama-style 80/96, MLA's 576 = 512 + 64), but
`tl.arange` and `tl.dot` need power-of-two tiles of at least 16. The key dim Dk is
therefore read as a power-of-two main tile plus a masked remainder tile, so MLA's
576 costs 512 + 64 lanes instead of 1024; the value dim Dv is one masked tile.
"""

from __future__ import annotations

import torch
import triton

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MIN_DOT = 16  # smallest tl.dot operand side


def split_key_dim(dk: int) -> tuple[int, int]:
    """Dk -> (BLOCK_D, BLOCK_DPE): a power-of-two main tile (exact, unmasked) and a
    remainder tile (0 when Dk is a power of two; else >= 16, masked past Dk)."""
    block_d = 1 << (dk.bit_length() - 1)
    rem = dk - block_d
    return block_d, (max(_MIN_DOT, triton.next_power_of_2(rem)) if rem else 0)


def value_block(dv: int) -> int:
    """Dv -> BLOCK_DV, a power-of-two tile (>= 16) masked past Dv."""
    return max(_MIN_DOT, triton.next_power_of_2(dv))


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 operands would otherwise go through TF32 on Ampere/Hopper (10-bit mantissa);
    # the fp32 path is the exact one, so keep it IEEE. 16-bit operands ignore the setting.
    return "ieee" if dtype == torch.float32 else "tf32"


def check_attention_args(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    num_reqs: int,
    num_tokens: int,
) -> tuple[int, int, int, int]:
    """Shape/dtype/device checks common to decode and extend; returns (Hq, Hkv, Dk, Dv).

    Raises:
        ValueError: naming the first argument that does not fit.
    """
    if q.dim() != 3 or q.shape[0] != num_tokens:
        raise ValueError(f"q must be [{num_tokens}, Hq, Dk], got {tuple(q.shape)}")
    _, hq, dk = q.shape
    if k_buf.dim() != 3 or k_buf.shape[2] != dk:
        raise ValueError(f"k_buf must be [slots, Hkv, {dk}] (Dk of q), got {tuple(k_buf.shape)}")
    slots, hkv, _ = k_buf.shape
    if v_buf.dim() != 3 or v_buf.shape[0] != slots or v_buf.shape[1] != hkv:
        raise ValueError(f"v_buf must be [{slots}, {hkv}, Dv] (slots and Hkv of k_buf), got {tuple(v_buf.shape)}")
    dv = v_buf.shape[2]
    if hq % hkv != 0:
        raise ValueError(f"q's {hq} heads are not a multiple of k_buf's {hkv} kv heads")
    if dk < _MIN_DOT or dv < _MIN_DOT:
        raise ValueError(f"head dims must be >= {_MIN_DOT}, got Dk={dk}, Dv={dv}")
    if tuple(out.shape) != (num_tokens, hq, dv):
        raise ValueError(f"out must be [{num_tokens}, {hq}, {dv}], got {tuple(out.shape)}")
    for name, t in (("q", q), ("k_buf", k_buf), ("v_buf", v_buf), ("out", out)):
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name} dtype must be one of {_DTYPES}, got {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if v_buf.dtype != k_buf.dtype:
        raise ValueError(f"v_buf dtype {v_buf.dtype} != k_buf dtype {k_buf.dtype}")
    if req_to_token.dim() != 2 or req_to_token.dtype != torch.int32 or req_to_token.stride(-1) != 1:
        raise ValueError(f"req_to_token must be a row-contiguous int32 [rows, max_context] table, "
                         f"got {req_to_token.dtype} {tuple(req_to_token.shape)}")
    for name, t in (("req_to_token", req_to_token), ("req_pool_indices", req_pool_indices),
                    ("seq_lens", seq_lens)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    for name, t in (("req_pool_indices", req_pool_indices), ("seq_lens", seq_lens)):
        if t.dim() != 1 or t.shape[0] != num_reqs or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32/int64 [{num_reqs}], got {t.dtype} {tuple(t.shape)}")
    return hq, hkv, dk, dv
