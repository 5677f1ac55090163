"""The gate/up GEMM with silu(gate) * up in its epilogue (`cpu_amx.amx_bf16_gemm_silu`,
csrc/cpu/amx_bf16_gemm_silu.h), on an AMX CPU (skipped elsewhere: AMX instructions only).

Against float32 silu(x Wg^T) * (x Wu^T) on the same bf16 inputs, within one bf16 rounding of the
result: rows at the tile edges (1, 16, 17, 31-33), a tail after full blocks, several row chunks
(K = 1536: 160 rows a chunk), one strip pair or many, every thread count; strided rows; every
output element written; the fused path of `AmxLinear` and of a Llama MLP (the unfused GEMM +
SiluAndMul agree to bf16 rounding); bad input.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hiserve.jit_kernel.cpu_amx import amx_bf16_gemm_silu, amx_bf16_pack
from hiserve.layers.activations import SiluAndMul
from hiserve.layers.linear import AmxLinear


def _want(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = x.float() @ w.float().t()
    i = w.shape[0] // 2
    return F.silu(y[:, :i]) * y[:, i:]


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=1e-3)


@pytest.mark.parametrize("rows", [1, 16, 17, 31, 32, 33, 100, 257, 700])
@pytest.mark.parametrize("ik", [(32, 32), (64, 96), (1536, 576), (96, 1536)])
def test_matches_reference(amx, rows, ik):
    i, k = ik
    gen = torch.Generator().manual_seed(rows + i + k)
    w = (torch.randn(2 * i, k, generator=gen) / k ** 0.5).bfloat16()
    x = torch.randn(rows, k, generator=gen).bfloat16()
    _close(amx_bf16_gemm_silu(x, amx_bf16_pack(w)), _want(x, w))


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_threads_strided_rows_every_element(amx, threads):
    gen = torch.Generator().manual_seed(threads)
    w = (torch.randn(2 * 96, 576, generator=gen) / 24).bfloat16()
    base = torch.randn(75, 700, generator=gen).bfloat16()
    x = base[:, 60:636]  # rows 700 apart
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = amx_bf16_gemm_silu(x, amx_bf16_pack(w))
    finally:
        torch.set_num_threads(before)
    assert torch.isfinite(got.float()).all()
    _close(got, _want(x, w))


def test_amx_linear_fused_and_unfused_agree(amx):
    gen = torch.Generator().manual_seed(7)
    w = (torch.randn(2 * 64, 96, generator=gen) / 10).bfloat16()
    x = torch.randn(40, 96, generator=gen).bfloat16()
    lin = AmxLinear(w, None)
    fused = lin.silu_mul(x)
    unfused = SiluAndMul()(lin(x))  # gate and up rounded to bf16 first
    torch.testing.assert_close(fused.float(), unfused.float(), rtol=2 ** -6, atol=2e-3)
    assert AmxLinear(w, torch.zeros(128)).silu_mul(x) is None  # a bias: not fused
    assert AmxLinear(w[:96], None).silu_mul(x) is None  # out_features 96: no whole strip pairs
    assert lin.silu_mul(x.view(4, 10, 96)) is None  # N-D input: the caller's unfused path


def test_bad_input(amx):
    w = amx_bf16_pack(torch.randn(128, 64).bfloat16())
    with pytest.raises(ValueError, match="bfloat16"):
        amx_bf16_gemm_silu(torch.randn(3, 64), w)
    with pytest.raises(ValueError, match="K = 96"):
        amx_bf16_gemm_silu(torch.randn(3, 96).bfloat16(), w)
    with pytest.raises(ValueError, match="packed"):
        amx_bf16_gemm_silu(torch.randn(3, 64).bfloat16(), w[:3])
