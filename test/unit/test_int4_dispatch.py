"""GGUF int4 layers pick the int4 kernel or their dense copy by the rows of each call.

- Below `dense_from_rows` the int4 kernel runs, from it the dense copy; both outputs equal
  x @ W^T with W the GGUF weights rounded to bf16, within bf16 GEMM tolerance.
- The calibration rule on controlled kernel costs: the first row count where dense wins at it
  and the next one; none when int4 is never beaten twice in a row (the copy is then freed).
- `setup_int4_dispatch` on real kernels: one log line, every layer's threshold is its shape's
  measured crossover, one calibration per shape; HISERVE_GGUF_DENSE_COPY=0 keeps no copy.
"""

from __future__ import annotations

import logging
import types

import numpy as np
import pytest
import torch
from torch import nn

from hiserve.layers.quantization import GGUFInt4Config, GGUFQuantizedTensor, make_linear, setup_int4_dispatch
from hiserve.layers.quantization import int4_dispatch
from hiserve.layers.quantization.gguf import GGUFInt4Linear, dequantize_q4

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import quantize  # noqa: E402


def _layer(n: int = 128, k: int = 96, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
           dense_copy: bool = True) -> tuple[GGUFInt4Linear, torch.Tensor]:
    """A Q4_1 layer from random weights, and gguf's dequantized weight (float32 [n, k])."""
    w = np.random.default_rng(seed).normal(size=(n, k)).astype(np.float32)
    data = quantize(w, GGMLQuantizationType.Q4_1).reshape(n, -1)
    layer = GGUFInt4Linear(k, n, bias=False, dtype=dtype, dense_copy=dense_copy)
    layer.load_rows(0, GGUFQuantizedTensor("Q4_1", data, (n, k)))
    layer.finalize()
    return layer, dequantize_q4("Q4_1", data)


def test_rows_pick_the_kernel_and_both_match_the_reference(monkeypatch):
    layer, w = _layer()
    layer.dense_from_rows = 8
    used: list[str] = []
    int4, dense = layer._matmul, layer._dense_matmul
    monkeypatch.setattr(layer, "_matmul", lambda x: used.append("int4") or int4(x))
    monkeypatch.setattr(layer, "_dense_matmul", lambda x: used.append("dense") or dense(x))
    ref_w = w.to(torch.bfloat16).float()
    for rows, kernel in ((1, "int4"), (7, "int4"), (8, "dense"), (64, "dense")):
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        used.clear()
        y = layer(x)
        assert used == [kernel], rows
        assert y.dtype == torch.bfloat16 and y.shape == (rows, 128)
        # bf16 output rounding (and the int4 path's bf16 scale/zero) on values of size ~sqrt(K)
        torch.testing.assert_close(y.float(), x.float() @ ref_w.t(), rtol=2e-2, atol=0.15)
    layer.drop_dense_copy()
    used.clear()
    layer(torch.randn(64, 96).to(torch.bfloat16))
    assert used == ["int4"]
    with pytest.raises(ValueError, match="no dense copy"):
        layer.effective_dense_weight()


def _costed(layer: GGUFInt4Linear, monkeypatch, int4_us, dense_us) -> None:
    """Replace both kernels by fixed costs (us, a function of rows) on a fake clock, so the
    rule is tested deterministically on a loaded machine."""
    clock = [0.0]

    def kernel(cost):
        def run(x):
            clock[0] += cost(x.shape[0]) * 1e-6
        return run
    monkeypatch.setattr(int4_dispatch, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(layer, "_matmul", kernel(int4_us))
    monkeypatch.setattr(layer, "_dense_matmul", kernel(dense_us))


@pytest.mark.parametrize("int4_us, dense_us, want, tried", [
    (lambda m: 100 * m, lambda m: 600, 8, [1, 2, 4, 8, 16]),  # dense wins from 8 rows
    (lambda m: 50, lambda m: 400, None, list(int4_dispatch.CALIBRATION_ROWS)),  # int4 always
    # dense wins at 2 only (one noisy point), then from 16: the crossover is 16
    (lambda m: {2: 900, 16: 900, 32: 900, 64: 900}.get(m, 100), lambda m: 500, 16, [1, 2, 4, 8, 16, 32]),
])
def test_calibration_rule(monkeypatch, int4_us, dense_us, want, tried):
    layer, _ = _layer()
    _costed(layer, monkeypatch, int4_us, dense_us)
    got, timings = int4_dispatch.calibrate_crossover(layer, reps=3, inner=1)
    assert got == want
    assert [m for m, _, _ in timings] == tried


@pytest.mark.parametrize("int4_us, dense_us, want, tried", [
    (lambda m: 50, lambda m: 400, 4, [1, 2]),  # int4 ahead when time ran out: dense from the next M
    (lambda m: {2: 900}.get(m, 50), lambda m: 400, 2, [1, 2]),  # dense ahead once: that M
])
def test_calibration_out_of_time_keeps_the_dense_copy_for_untried_rows(monkeypatch, int4_us, dense_us, want, tried):
    """A loaded machine spends the budget early: rows never measured take the dense copy rather
    than "int4 always" (which would drop it and run prefill on int4)."""
    layer, _ = _layer()
    _costed(layer, monkeypatch, int4_us, dense_us)
    # the fake clock advances only by the kernels' costs: the deadline falls after M = 2
    got, timings = int4_dispatch.calibrate_crossover(layer, reps=3, inner=1, deadline=1e-6 * (3 * 50 + 3 * 400) * 2)
    assert got == want
    assert [m for m, _, _ in timings] == tried


def test_setup_logs_once_and_sets_every_layer(caplog):
    model = nn.Sequential(_layer(128, 96, seed=1)[0], _layer(128, 96, seed=2)[0], _layer(64, 128, seed=3)[0])
    with caplog.at_level(logging.INFO, logger=int4_dispatch.__name__):
        report = setup_int4_dispatch(model)
    lines = [r for r in caplog.records if r.name == int4_dispatch.__name__]
    assert len(lines) == 1 and "GGUF GEMM dispatch over 3 layers" in lines[0].getMessage()
    assert set(report.crossover) == {(128, 96), (64, 128)}  # one calibration per shape
    for layer in model:
        m = report.crossover[(layer.out_features, layer.in_features)]
        if m is None:
            assert layer.dense_weight is None
        else:
            assert layer.dense_weight is not None and layer.dense_from_rows == m
    assert report.int4_bytes > 0 and report.dense_bytes >= 0
    assert setup_int4_dispatch(nn.Linear(4, 4)) is None  # nothing to dispatch


def test_dense_copy_flag(monkeypatch):
    config = GGUFInt4Config({"w": "Q4_1"})
    monkeypatch.setenv("HISERVE_GGUF_DENSE_COPY", "0")
    layer = make_linear(96, 128, False, torch.bfloat16, config, ["w"])
    assert isinstance(layer, GGUFInt4Linear) and layer._dense is None
    monkeypatch.setenv("HISERVE_GGUF_DENSE_COPY", "1")
    assert make_linear(96, 128, False, torch.bfloat16, config, ["w"])._dense is not None


def test_dense_copy_without_onednn_bf16_is_a_plain_weight(monkeypatch):
    """A CPU whose oneDNN has no bf16 path (AVX2 only: its weight pack raises) keeps the
    dense copy as a plain bf16 weight for F.linear, with the same results."""
    from hiserve.layers.linear import PackedLinear, can_pack_for_cpu

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert not can_pack_for_cpu(torch.device("cpu"), torch.bfloat16)
    layer, w = _layer()
    assert isinstance(layer.dense_weight, torch.Tensor) and not isinstance(layer.dense_weight, PackedLinear)
    layer.dense_from_rows = 1
    x = torch.randn(16, 96, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    torch.testing.assert_close(layer(x).float(), x.float() @ w.to(torch.bfloat16).float().t(), rtol=2e-2, atol=0.15)
