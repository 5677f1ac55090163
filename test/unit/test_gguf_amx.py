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
        ready = cpu_kernels.load_cpu_module(isa).gguf_amx_ready()
        # the amx tier is ready where Linux grants AMX tile state (5.16+), as amx_gemm_available says
        assert ready == (isa == "amx" and cpu_kernels.amx_gemm_available()), isa


@pytest.mark.parametrize("qtype", ("Q4_0", "Q4_1", "Q8_0"))
def test_applies_ggufs_weights_rounded_to_bf16_exactly(amx, qtype):
    t, ref = _tensor(qtype, 48, 160)
    packed = cpu_kernels.gguf_amx_pack(_blocks(t), qtype)
    assert packed.shape == (3, 5, 544 if qtype == "Q8_0" else 320)
    eye = torch.eye(160, dtype=torch.bfloat16)
    assert torch.equal(cpu_kernels.gguf_amx_gemm(eye, packed).t(), ref.to(torch.bfloat16))  # 3 passes
    for r0 in range(0, 160, 48):  # one pass each
        rows = cpu_kernels.gguf_amx_gemm(eye[r0:r0 + 48], packed)
        assert torch.equal(rows.t(), ref[:, r0:r0 + 48].to(torch.bfloat16)), r0


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


def test_more_threads_than_columns(amx):
    t, ref = _tensor("Q4_1", 16, 64)  # one 16-feature column for 4 threads
    packed = cpu_kernels.gguf_amx_pack(_blocks(t), "Q4_1")
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        for rows in (3, 100):
            x = torch.eye(64, dtype=torch.bfloat16).repeat(2, 1)[:rows]
            assert torch.equal(cpu_kernels.gguf_amx_gemm(x, packed), x @ ref.to(torch.bfloat16).t()), rows
    finally:
        torch.set_num_threads(threads)


def test_torch_amx_kernels_around_it_keep_working(amx):
    """oneDNN / PyTorch AMX kernels (SDPA's flash attention, int4, bf16 GEMM) and this kernel
    interleaved on the same OpenMP threads: each keeps its tile state valid (no #UD) and results."""
    q = torch.randn(1, 4, 256, 64).to(torch.bfloat16)
    x = torch.randn(64, 576).to(torch.bfloat16)
    w = torch.randn(1152, 576).to(torch.bfloat16)
    t, ref = _tensor("Q4_1", 64, 576)
    packed = cpu_kernels.gguf_amx_pack(_blocks(t), "Q4_1")
    first = (torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True), x @ w.t(),
             cpu_kernels.gguf_amx_gemm(x, packed))
    for _ in range(3):
        again = (torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True), x @ w.t(),
                 cpu_kernels.gguf_amx_gemm(x, packed))
        for a, b in zip(first, again):
            assert torch.equal(a, b)


def test_q4_0_scale_past_fp16_offset_is_refused(amx):
    t, _ = _tensor("Q4_0", 16, 32)
    blocks = _blocks(t).clone()
    blocks[3, :2] = torch.tensor(np.array([10000.0], dtype=np.float16).view(np.uint8))  # d = 10000: -8 d overflows
    with pytest.raises(RuntimeError, match="too large"):
        cpu_kernels.gguf_amx_pack(blocks, "Q4_0")


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
    layer.prepare_amx()
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
    x = torch.randn(3, 96).to(torch.bfloat16)
    layers[0](x)  # a real call after the choice (freed copies must not be reached)
    assert report.amx[(64, 96)][0] == amx_wins_from
    for layer in layers:
        assert (layer.amx_weight is None) == (amx_wins_from is None)
        assert layer.amx_from_rows == {None: sys.maxsize, 1: 0, 8: 8}[amx_wins_from]
        assert layer.dense_weight is None  # never beaten: the dense copy is freed
    assert ("AMX never" if amx_wins_from is None else f"AMX from {amx_wins_from} rows") in report.describe()


def test_head_takes_amx_between_its_block_kernel_and_dense_weight(amx, monkeypatch):
    t, ref = _tensor("Q8_0", 64, 96)
    head = GGUFBlockLinear(t, ref.to(torch.bfloat16))
    assert head.amx_weight is None and head.prepare_amx()  # packed on demand (at start-up calibration)
    assert head.amx_weight.shape == (4, 3, 544)
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
    assert report.head_amx[0] == 8 and head.amx_from_rows == 8
    assert "LM head: block kernel, AMX from 8 rows" in report.describe()
    head.drop_blocks()
    assert head.amx_weight is None and head.gguf_blocks is None


@pytest.fixture
def fake_amx(monkeypatch):
    """The AMX entry points replaced by a dense reference, so the routing and calibration run on
    any CPU (the real kernel's tests above need an AMX CPU). Records the rows of each call."""
    if not cpu_kernels.can_use_cpu_kernels():
        pytest.skip("JIT CPU kernels do not build here (layers keep no GGUF blocks)")
    calls: list[int] = []

    def pack(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
        n = blocks.shape[0]
        w = dequantize(blocks.numpy(), GGMLQuantizationType[qtype])
        return torch.from_numpy(np.array(w)).reshape(n, -1).to(torch.bfloat16)

    def gemm(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return (x.float() @ packed.float().t()).to(torch.bfloat16)

    monkeypatch.setattr(cpu_kernels, "amx_gemm_available", lambda: True)
    monkeypatch.setattr(cpu_kernels, "gguf_amx_pack", pack)
    monkeypatch.setattr(cpu_kernels, "gguf_amx_gemm", gemm)
    return calls


def test_routing_between_the_three_kernels_on_any_cpu(fake_amx, monkeypatch):
    layer, ref = _bf16_layer()
    layer.use_amx_from(4)
    layer.dense_from_rows = 32
    for rows, amx_called in ((1, False), (3, False), (4, True), (31, True), (32, False)):
        fake_amx.clear()
        x = torch.randn(rows, 96).to(torch.bfloat16)
        want = x.float() @ ref.to(torch.bfloat16).float().t()
        torch.testing.assert_close(layer(x).float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
        assert fake_amx == ([rows] if amx_called else []), rows
    layer.use_amx_from(1)
    with pytest.raises(ValueError, match="freed"):
        layer.use_amx_from(None)  # the few-row copy is gone: AMX must stay
    monkeypatch.setattr(cpu_kernels, "amx_gemm_available", lambda: False)
    fresh = GGUFInt4Linear(96, 64, bias=False, dtype=torch.bfloat16)
    fresh.load_rows(0, _tensor("Q4_1", 64, 96)[0])
    fresh.finalize()
    assert not fresh.prepare_amx() and fresh.amx_weight is None  # no AMX: nothing packed


@pytest.mark.parametrize("deadline_hits", (False, True))
def test_dense_copy_keeps_its_range_or_gives_amx_the_untried_rows(fake_amx, monkeypatch, deadline_hits):
    """AMX wins from 4 rows, dense from 256 (fake timings). With no time left after the first
    row count, the AMX search gives AMX the untried rows and the dense search keeps them there."""
    def medians(rot, kernels, x, reps, inner):
        m = x.shape[0]
        if kernels == ("_few_row_matmul", "_amx_matmul"):
            return (2.0, 1.0) if m >= 4 else (1.0, 2.0)
        if kernels == ("_matmul", "_dense_matmul"):
            return (2.0, 1.0) if m >= 256 else (1.0, 2.0)
        return (1.0, 2.0)

    monkeypatch.setattr(int4_dispatch, "_medians_us", medians)
    layers = [_bf16_layer(seed=i)[0] for i in range(2)]
    report = setup_int4_dispatch(nn.ModuleList(layers), budget_s=0.0 if deadline_hits else 60.0)
    want_amx, want_dense = (2, None) if deadline_hits else (4, 256)
    assert report.amx[(64, 96)][0] == want_amx and report.crossover[(64, 96)] == want_dense
    for layer in layers:
        assert layer.amx_from_rows == want_amx and layer.amx_weight is not None
        assert (layer.dense_weight is None) == (want_dense is None)
