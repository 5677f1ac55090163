"""The AMX GEMM on GGUF Q4 weights (`cpu_kernels.gguf_amx_pack` / `gguf_amx_gemm`).

- Every build tier answers `gguf_amx_ready`: 1 only for the amx tier on an AMX CPU.
- On an AMX CPU: the weight it applies (an identity through it) is gguf's dequantization rounded
  to bf16, bit for bit, for Q4_0, Q4_1 and Q8_0; products of 1..130 rows (its 16-row chunks, 64-row
  passes and every remainder), strided rows, agree with x @ W^T; bad input raises ValueError.
- `GGUFInt4Linear` routes calls of at least `amx_from_rows` rows to it, frees what it no longer
  needs (`use_amx_from`), and `setup_int4_dispatch` sets the crossover from timings.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from torch import nn

from hiserve.jit_kernel import cpu as cpu_kernels
from hiserve.layers.quantization import (GGUFBlockLinear, GGUFInt4Linear, GGUFQuantizedTensor, int4_dispatch,
                                         setup_int4_dispatch)

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402


@pytest.fixture
def amx():
    """In the test, not at collection (building the module at collection costs every run)."""
    if not cpu_kernels.can_use_cpu_kernels():
        pytest.skip("JIT CPU kernels do not build here")
    if not cpu_kernels.amx_gemm_available():
        pytest.skip(f"no AMX here (kernel ISA {cpu_kernels.detect_cpu().isa})")


def _tensor(qtype: str, n: int, k: int, seed: int = 0) -> tuple[GGUFQuantizedTensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    w = (rng.normal(size=(n, k)) * 0.1 + rng.normal(size=(n, 1)) * 0.05).astype(np.float32)
    data = quantize(w, GGMLQuantizationType[qtype]).reshape(n, -1)
    ref = torch.from_numpy(np.array(dequantize(data, GGMLQuantizationType[qtype]))).reshape(n, k)
    return GGUFQuantizedTensor(qtype, data, (n, k)), ref


def _blocks(t: GGUFQuantizedTensor) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(t.data)).view(torch.uint8).reshape(t.shape[0], -1)


def test_only_the_amx_tier_is_ready():
    if not cpu_kernels.can_use_cpu_kernels():
        pytest.skip("JIT CPU kernels do not build here")
    for isa in cpu_kernels.runnable_isas():
        assert cpu_kernels.load_cpu_module(isa).gguf_amx_ready() == (isa == "amx"), isa


@pytest.mark.parametrize("qtype", ("Q4_0", "Q4_1", "Q8_0"))
def test_applies_ggufs_weights_rounded_to_bf16_exactly(amx, qtype):
    t, ref = _tensor(qtype, 48, 160)
    packed = cpu_kernels.gguf_amx_pack(_blocks(t), qtype)
    assert packed.shape == (3, 5, 544 if qtype == "Q8_0" else 320)
    eye = torch.eye(160, dtype=torch.bfloat16)
    assert torch.equal(cpu_kernels.gguf_amx_gemm(eye, packed).t(), ref.to(torch.bfloat16))


@pytest.mark.parametrize("qtype", ("Q4_1", "Q8_0"))
@pytest.mark.parametrize("rows", (1, 5, 16, 17, 33, 64, 65, 130))
def test_products_of_any_row_count_and_strided_rows(amx, rows, qtype):
    t, ref = _tensor(qtype, 64, 96, seed=rows)
    packed = cpu_kernels.gguf_amx_pack(_blocks(t), qtype)
    wide = torch.randn(rows, 200).to(torch.bfloat16)
    x = wide[:, 50:146]  # strided rows
    got = cpu_kernels.gguf_amx_gemm(x, packed)
    want = x.float() @ ref.to(torch.bfloat16).float().t()
    # float32 sums of exact bf16 products; the output is rounded to bf16 once
    torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=8e-3 * want.abs().max().item())


def test_rejects_bad_input(amx):
    t, _ = _tensor("Q4_1", 32, 64)
    blocks = _blocks(t)
    packed = cpu_kernels.gguf_amx_pack(blocks, "Q4_1")
    with pytest.raises(ValueError, match="Q4_0, Q4_1 or Q8_0"):
        cpu_kernels.gguf_amx_pack(blocks, "Q5_0")
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu_kernels.gguf_amx_pack(blocks[:24].contiguous(), "Q4_1")
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_kernels.gguf_amx_gemm(torch.randn(2, 64), packed)
    with pytest.raises(ValueError, match="K = 96"):
        cpu_kernels.gguf_amx_gemm(torch.randn(2, 96).to(torch.bfloat16), packed)


def _bf16_layer(n: int = 64, k: int = 96, seed: int = 0) -> tuple[GGUFInt4Linear, torch.Tensor]:
    layer = GGUFInt4Linear(k, n, bias=False, dtype=torch.bfloat16, dense_copy=True)
    t, ref = _tensor("Q4_1", n, k, seed=seed)
    layer.load_rows(0, t)
    layer.finalize()
    return layer, ref


def test_layer_routes_by_rows_and_frees_what_it_no_longer_needs(amx):
    layer, ref = _bf16_layer()
    assert layer.amx_weight is not None
    w = ref.to(torch.bfloat16).float()
    layer.use_amx_from(4)
    for rows in (1, 3, 4, 20):
        x = torch.randn(rows, 96).to(torch.bfloat16)
        want = x.float() @ w.t()
        torch.testing.assert_close(layer(x).float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    layer.use_amx_from(1)  # AMX for every call: the few-row copies go
    assert layer.packed_weight is None and layer.gguf_blocks is None and layer.amx_from_rows == 0
    assert torch.equal(layer.effective_weight(), ref.to(torch.bfloat16))
    other, _ = _bf16_layer()
    other.use_amx_from(None)
    assert other.amx_weight is None and other.packed_weight is not None
    with pytest.raises(ValueError, match="no AMX weights"):
        other.use_amx_from(8)


@pytest.mark.parametrize("amx_wins_from", (None, 1, 8))
def test_setup_sets_the_amx_crossover_from_timings(amx, monkeypatch, amx_wins_from):
    """Forced timings: the few-row kernel vs AMX, then the dense copy always slower."""
    def medians(rot, kernels, x, reps, inner):
        if kernels == ("_few_row_matmul", "_amx_matmul"):
            amx_wins = amx_wins_from is not None and x.shape[0] >= amx_wins_from
            return (2.0, 1.0) if amx_wins else (1.0, 2.0)
        return (1.0, 2.0)  # block vs int4 (block wins) and the composite vs dense (dense loses)

    monkeypatch.setattr(int4_dispatch, "_medians_us", medians)
    layers = [_bf16_layer(seed=i)[0] for i in range(2)]
    report = setup_int4_dispatch(nn.ModuleList(layers))
    assert report.amx[(64, 96)][0] == amx_wins_from
    for layer in layers:
        assert (layer.amx_weight is None) == (amx_wins_from is None)
        assert layer.amx_from_rows == {None: sys.maxsize, 1: 0, 8: 8}[amx_wins_from]
        assert layer.dense_weight is None  # never beaten: the dense copy is freed
    assert ("AMX never" if amx_wins_from is None else f"AMX from {amx_wins_from} rows") in report.describe()


def test_head_takes_amx_between_its_block_kernel_and_dense_weight(amx, monkeypatch):
    t, ref = _tensor("Q8_0", 64, 96)
    head = GGUFBlockLinear(t, ref.to(torch.bfloat16))
    assert head.amx_weight is not None and head.amx_weight.shape == (4, 3, 544)
    head.use_amx_from(4)
    w = ref.to(torch.bfloat16).float()
    for rows in (1, 4, 9):
        x = torch.randn(rows, 96).to(torch.bfloat16)
        want = x.float() @ w.t()
        torch.testing.assert_close(head(x).float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    # Calibration: AMX wins from 8 rows, the dense weight never
    monkeypatch.setattr(int4_dispatch, "_medians_us", lambda rot, kernels, x, reps, inner: (
        (2.0, 1.0) if kernels == ("_few_row_matmul", "_amx_matmul") and x.shape[0] >= 8 else (1.0, 2.0)))
    report = setup_int4_dispatch(nn.ModuleList([head]))
    assert report.head_amx[0] == 8 and head.amx_from_rows == 8 and "LM head: block kernel, AMX from 8 rows" in report.describe()
    head.drop_blocks()
    assert head.amx_weight is None and head.gguf_blocks is None
