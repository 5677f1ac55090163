"""Which GEMM a GGUF int4 layer runs, by the number of rows of the call, calibrated at start.

`GGUFInt4Linear` keeps two forms of the same GGUF weights: int4 codes for PyTorch's int4
weight-only kernel and a dense copy in the model dtype (bf16: oneDNN-prepacked where oneDNN
has a bf16 path; float32 on CPUs without native bf16). The int4 kernel reads
4x fewer weight bytes, so it wins while a GEMM is bound by reading the weight (one or a few
rows: single-stream decode); the dense GEMM wins once the multiply is compute-bound (prefill,
batched decode), because the int4 kernel re-dequantizes each group for every block of rows
and has no AMX/VNNI-tiled inner loop like oneDNN's.

Why a start-up calibration and not a table from CPU features: where the two cross depends on
the CPU's bf16 tier (AMX tiles move the dense side by several times; AVX512-BF16 less; an
AVX2-only CPU computes bf16 without native dot products), on the core count, the memory
bandwidth and the layer's shape, and on the PyTorch build's kernels. A table from features would
encode one machine per tier (the thing issue 9 forbids); timing both kernels on the model's own
layer shapes measures exactly the quantity the choice depends on, on this process's threads, and
costs a few tens of ms for a small model (bounded by `budget_s` for large ones).

The rule, per distinct (N, K): rows M in (1, 2, 4, 8, 16, 32, 64), ascending; at each M, both
kernels timed interleaved (`reps` samples of `inner` calls, medians, after a warm-up call); the
crossover is the first M at which the dense GEMM is faster at M and at the next M as well (two
in a row, so one noisy sample cannot move it down), and the search stops there. No crossover
up to 64 rows: the int4 kernel always, and the dense copy is freed. If the time budget runs out
first (a loaded machine: one start took 2.6 s), the rows not yet tried take the dense copy:
int4 was measured better only up to the last M tried, and at prefill sizes the dense GEMM won on
every CPU measured (2.7x at 256 rows on the EPYC), so giving it up unmeasured would cost far more.
HISERVE_GGUF_DENSE_COPY=0 keeps no dense copy at all (int4 only; saves N*K*2 bytes a layer).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from hiserve.layers.quantization.gguf import GGUFInt4Linear

logger = logging.getLogger(__name__)

CALIBRATION_ROWS = (1, 2, 4, 8, 16, 32, 64)


def dense_copy_enabled() -> bool:
    """Whether GGUF int4 layers also keep a dense copy (HISERVE_GGUF_DENSE_COPY, default on)."""
    return os.environ.get("HISERVE_GGUF_DENSE_COPY", "1") != "0"


@dataclass
class DispatchReport:
    """What `setup_int4_dispatch` chose.

    Attributes:
        crossover: (N, K) -> first row count that takes the dense GEMM, or None (int4 always).
        timings_us: (N, K) -> [(M, int4 median us, dense median us)] as measured.
        layers: GGUF int4 layers seen.
        dense_bytes: bytes of the dense copies kept.
        int4_bytes: bytes of the int4 codes plus scales and zeros.
        seconds: wall time of the calibration.
    """

    crossover: dict[tuple[int, int], int | None] = field(default_factory=dict)
    timings_us: dict[tuple[int, int], list[tuple[int, float, float]]] = field(default_factory=dict)
    layers: int = 0
    dense_bytes: int = 0
    int4_bytes: int = 0
    seconds: float = 0.0

    def describe(self) -> str:
        """One log line."""
        shapes = ", ".join(f"{n}x{k}: " + (f"dense from {m} rows" if m else "int4 always")
                           for (n, k), m in sorted(self.crossover.items()))
        return (f"GGUF int4 GEMM dispatch over {self.layers} layers, calibrated in {self.seconds * 1e3:.0f} ms "
                f"on {torch.get_num_threads()} threads: {shapes or 'no dense copies'}; weights int4 "
                f"{self.int4_bytes / 2**20:.0f} MiB + dense {self.dense_bytes / 2**20:.0f} MiB")


def _samples_us(fn: Callable[[], object], reps: int, inner: int) -> list[float]:
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - start) / inner * 1e6)
    return samples


@torch.inference_mode()
def calibrate_crossover(layer: GGUFInt4Linear, rows: tuple[int, ...] = CALIBRATION_ROWS, reps: int = 5,
                        inner: int = 3, deadline: float | None = None
                        ) -> tuple[int | None, list[tuple[int, float, float]]]:
    """Time the int4 kernel against the dense copy of `layer` at growing row counts.

    Args:
        layer: a finalized `GGUFInt4Linear` with a dense copy.
        rows: row counts M to try, ascending.
        reps, inner: samples per kernel and M, calls per sample (medians over samples).
        deadline: `time.perf_counter()` value after which no further M is tried.
    Returns:
        (the first M where dense is faster at M and the next M, or the last M tried if dense
        is faster there; the next untried M when `deadline` stopped the search first; None when
        int4 is never beaten twice in a row), [(M, int4 us, dense us)].
    Raises:
        ValueError: the layer has no dense copy.
    """
    if layer.dense_weight is None:
        raise ValueError("calibrate_crossover needs a layer with a dense copy")
    timings: list[tuple[int, float, float]] = []
    gen = torch.Generator().manual_seed(0)
    candidate: int | None = None
    for i, m in enumerate(rows):
        x = torch.randn(m, layer.in_features, generator=gen).to(layer.dtype)
        layer._matmul(x), layer._dense_matmul(x)  # warm-up: oneDNN builds its primitive here
        a_s: list[float] = []
        b_s: list[float] = []
        for _ in range(reps):  # interleaved, so load on the machine hits both alike
            a_s += _samples_us(lambda: layer._matmul(x), 1, inner)
            b_s += _samples_us(lambda: layer._dense_matmul(x), 1, inner)
        a, b = statistics.median(a_s), statistics.median(b_s)
        timings.append((m, a, b))
        if b < a:
            if candidate is not None:
                return candidate, timings
            candidate = m
        else:
            candidate = None
        if deadline is not None and time.perf_counter() > deadline and i + 1 < len(rows):
            return (candidate if candidate is not None else rows[i + 1]), timings
    return candidate, timings


def _bytes(t: torch.Tensor | nn.Module | None) -> int:
    if t is None:
        return 0
    if isinstance(t, nn.Module):
        return sum(b.numel() * b.element_size() for b in t.buffers() if b is not None)
    return t.numel() * t.element_size()


def setup_int4_dispatch(model: nn.Module, budget_s: float = 2.0) -> DispatchReport | None:
    """Calibrate the int4/dense crossover once per distinct layer shape of `model`, set
    `dense_from_rows` on every `GGUFInt4Linear`, free dense copies never used, log once.

    Args:
        model: a loaded model (its GGUF int4 layers finalized).
        budget_s: wall-time bound on the whole calibration (large models: the last shapes
            then search fewer row counts).
    Returns:
        The report, or None when the model has no GGUF int4 layer.
    """
    layers = [m for m in model.modules() if isinstance(m, GGUFInt4Linear)]
    if not layers:
        return None
    report = DispatchReport(layers=len(layers))
    start = time.perf_counter()
    deadline = start + budget_s
    for layer in layers:
        shape = (layer.out_features, layer.in_features)
        if layer.dense_weight is not None and shape not in report.crossover:
            report.crossover[shape], report.timings_us[shape] = calibrate_crossover(layer, deadline=deadline)
        m = report.crossover.get(shape)
        if m is None:
            layer.drop_dense_copy()
        else:
            layer.dense_from_rows = m
        report.dense_bytes += _bytes(layer.dense_weight)
        report.int4_bytes += _bytes(layer.packed_weight) + _bytes(layer.scales_and_zeros)
    report.seconds = time.perf_counter() - start
    logger.info("%s", report.describe())
    return report
