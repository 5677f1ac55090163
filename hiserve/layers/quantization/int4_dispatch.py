"""Which GEMM a GGUF int4 layer runs, by the number of rows of the call, calibrated at start.

`GGUFInt4Linear` keeps two forms of the same GGUF weights: int4 codes for PyTorch's int4
weight-only kernel and a dense copy in the model dtype (bf16: prepacked for the AMX tile GEMM
or oneDNN, `linear.prepack_linear`; float32 on CPUs without native bf16). The int4 kernel reads
4x fewer weight bytes, so it wins while a GEMM is bound by reading the weight (one or a few
rows: single-stream decode); the dense GEMM wins once the multiply is compute-bound (prefill,
batched decode), because the int4 kernel re-dequantizes each group for every block of rows
and has no AMX/VNNI-tiled inner loop like the dense GEMMs'.

Why a start-up calibration and not a table from CPU features: where the two cross depends on
the CPU's bf16 tier (AMX tiles move the dense side by several times; AVX512-BF16 less; an
AVX2-only CPU computes bf16 without native dot products), on the core count, the memory
bandwidth and the layer's shape, and on the PyTorch build's kernels. A table from features would
encode one machine per tier (the thing issue 9 forbids); timing both kernels on the model's own
layer shapes measures exactly the quantity the choice depends on, on this process's threads, and
costs a few tens of ms for a small model (bounded by `budget_s` for large ones).

The rule, per distinct (N, K): rows M in CALIBRATION_ROWS (1, 2, 4, ..., 1024), ascending; at each M, both
kernels timed interleaved (`reps` samples of `inner` calls, medians, after a warm-up call); the
crossover is the first M at which the dense GEMM is faster at M and at the next M as well (two
in a row, so one noisy sample cannot move it down), and the search stops there. No crossover
up to the last row count (64; 1024 for shapes with AMX weights): the few-row kernel always, and the dense copy is freed. If the time budget runs out
first (a loaded machine: one start took 2.6 s), the rows not yet tried take the dense copy:
int4 was measured better only up to the last M tried, and at prefill sizes the dense GEMM won on
every CPU measured (2.7x at 256 rows on the EPYC), so giving it up unmeasured would cost far more.
HISERVE_GGUF_DENSE_COPY=0 keeps no dense copy at all (int4 only; saves N*K*2 bytes a layer).

Which few-row kernel: where the JIT CPU kernels build, a layer can also run the JIT block
kernel on the file's own blocks (`cpu_kernels.gguf_gemm`, float32 math) instead of PyTorch's
int4 kernel (bf16 math, x cast in and out in a float32 model). Per shape both are timed at one
row (decode) and the faster one kept, the other's copy freed: on an AVX2-only EPYC the block
kernel took 56-196 us against 73-218 us for the four SmolLM2 shapes (one server start). Where
the block kernel cannot run (CPU kernels unavailable, mixed shard types, float16) the blocks are
freed. Without a dense copy (HISERVE_GGUF_DENSE_COPY=0) the kernel chosen at one row takes
every call, prefill included: that choice is not timed at prefill sizes. The LM head (`GGUFBlockLinear`, Q8_0 blocks of the tied embedding) gets the same
crossover search against its dense weight (one row: 3.0 ms against 14.7 ms for float32 on that
CPU), first and on its own budget so that a slow start cannot leave it untimed; row counts past
the last one timed take the dense weight, and a head whose dense weight wins at one row frees
its blocks.

Where the AMX GEMM runs (an AMX CPU, a bf16 model: `cpu_kernels.gguf_amx_gemm`, which pays the
dequantization once per call and multiplies on AMX tiles), a third kernel sits between the two:
after the few-row kernel is chosen, the same search times it against AMX (`amx_from_rows`), then
the pair against the dense copy. On a 2-core Xeon with AMX: AMX from 4-8 rows (0.28 against
1.2 ms int4 and 0.6 ms dense a SmolLM2 layer at 16 rows), dense from 128-1024 rows (noisy host);
the LM head likewise (Q8_0 records), AMX from 2-4 rows. The AMX records are packed per shape at
calibration, before the few-row choice frees the file's blocks; a shape where AMX never wins, or
where the dense copy wins before AMX would start, frees them. When the budget runs out, untried
rows take AMX in its search and stay with it in the dense search (it beat the dense copy up to
hundreds of rows), unless dense already won twice.

Timing a layer's own weights call after call would measure them hot in the cache, which a
decode step never sees (it streams every layer's weights once: 100+ MB for SmolLM2). So each
sample calls the layers of one shape in turn (30 of each shape in SmolLM2), and a weight is
read again only after the shape's other layers were: a dense float32 copy measured hot took
83 us a row where cold it took 294 us, and picked dense from 1 row where it lost up to 16.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

from hiserve.jit_kernel import cpu as cpu_kernels
from hiserve.layers.quantization.gguf import GGUFBlockLinear, GGUFInt4Linear

logger = logging.getLogger(__name__)

CALIBRATION_ROWS = (1, 2, 4, 8, 16, 32, 64)
# Shapes with AMX weights, up to a prefill chunk's size: the AMX GEMM also beats the dense copy
# at 64-256 rows and loses to oneDNN's from a few hundred (a 2-core Xeon).
AMX_CALIBRATION_ROWS = CALIBRATION_ROWS + (128, 256, 512, 1024)


def dense_copy_enabled() -> bool:
    """Whether GGUF int4 layers also keep a dense copy (HISERVE_GGUF_DENSE_COPY, default on)."""
    return os.environ.get("HISERVE_GGUF_DENSE_COPY", "1") != "0"


@dataclass
class DispatchReport:
    """What `setup_int4_dispatch` chose.

    Attributes:
        crossover: (N, K) -> first row count that takes the dense GEMM, or None (the few-row
            kernel always).
        timings_us: (N, K) -> [(M, few-row kernel median us, dense median us)] as measured.
        block_kernel: (N, K) -> (block kernel chosen, its us, PyTorch int4 us) at one row, for
            the shapes where both could run.
        amx: (N, K) -> (first row count that takes the AMX GEMM or None, [(M, few-row us,
            AMX us)]) for the shapes with AMX weights (AMX CPU, bf16).
        head: (crossover, timings) of the LM head's `GGUFBlockLinear`, or None.
        head_amx: (AMX crossover, timings) of the head's block kernel against its AMX records,
            or None (no AMX records).
        layers: GGUF int4 layers seen.
        dense_bytes: bytes of the dense copies kept.
        int4_bytes: bytes of the 4-bit weights kept (int4 codes with scales and zeros, or the
            GGUF blocks).
        seconds: wall time of the calibration.
    """

    crossover: dict[tuple[int, int], int | None] = field(default_factory=dict)
    timings_us: dict[tuple[int, int], list[tuple[int, float, float]]] = field(default_factory=dict)
    block_kernel: dict[tuple[int, int], tuple[bool, float, float]] = field(default_factory=dict)
    amx: dict[tuple[int, int], tuple[int | None, list[tuple[int, float, float]]]] = field(default_factory=dict)
    head: tuple[int | None, list[tuple[int, float, float]]] | None = None
    head_amx: tuple[int | None, list[tuple[int, float, float]]] | None = None
    layers: int = 0
    dense_bytes: int = 0
    int4_bytes: int = 0
    seconds: float = 0.0

    def describe(self) -> str:
        """One log line."""
        def few(shape: tuple[int, int]) -> str:
            chosen = self.block_kernel.get(shape)
            if chosen is None:
                return "int4 kernel"
            return (f"{'block' if chosen[0] else 'int4'} kernel (1 row: block {chosen[1]:.0f} us, "
                    f"int4 {chosen[2]:.0f} us)")

        def amx(shape: tuple[int, int]) -> str:
            if shape not in self.amx:
                return ""
            m = self.amx[shape][0]
            return ", AMX never" if m is None else f", AMX from {m} rows"

        shapes = "; ".join(f"{n}x{k}: {few((n, k))}{amx((n, k))}" + (f", dense from {m} rows" if m else "")
                           for (n, k), m in sorted(self.crossover.items()))
        head = ""
        if self.head is not None:
            m = self.head[0]
            amx = "" if self.head_amx is None else (
                ", AMX never" if self.head_amx[0] is None else f", AMX from {self.head_amx[0]} rows")
            head = ("; LM head: dense" if m == 1 else "; LM head: block kernel" + amx
                    + (f", dense from {m} rows" if m else f", dense from {CALIBRATION_ROWS[-1] + 1} rows (untimed)"))
        return (f"GGUF GEMM dispatch over {self.layers} layers, calibrated in {self.seconds * 1e3:.0f} ms "
                f"on {torch.get_num_threads()} threads: {shapes or 'no 4-bit layers'}{head}; weights 4-bit "
                f"{self.int4_bytes / 2**20:.0f} MiB + dense {self.dense_bytes / 2**20:.0f} MiB")


class _Rotation:
    """Calls one kernel on each of a shape's layers in turn, so a weight is cold when read."""

    def __init__(self, layers: Sequence[nn.Module]):
        self.layers, self.next = list(layers), 0

    def call(self, kernel: str, x: torch.Tensor) -> None:
        layer = self.layers[self.next % len(self.layers)]
        self.next += 1
        getattr(layer, kernel)(x)

    def samples_us(self, kernel: str, x: torch.Tensor, inner: int) -> float:
        start = time.perf_counter()
        for _ in range(inner):
            self.call(kernel, x)
        return (time.perf_counter() - start) / inner * 1e6


def _medians_us(rot: _Rotation, kernels: tuple[str, str], x: torch.Tensor, reps: int,
                inner: int) -> tuple[float, float]:
    """Median us per call of two kernels, timed interleaved (load on the machine hits both
    alike) after one warm-up call each (oneDNN builds its primitive there)."""
    for k in kernels:
        rot.call(k, x)
    a_s: list[float] = []
    b_s: list[float] = []
    for _ in range(reps):
        a_s.append(rot.samples_us(kernels[0], x, inner))
        b_s.append(rot.samples_us(kernels[1], x, inner))
    return statistics.median(a_s), statistics.median(b_s)


@torch.inference_mode()
def calibrate_crossover(layer: nn.Module | Sequence[nn.Module], rows: tuple[int, ...] = CALIBRATION_ROWS,
                        reps: int = 5, inner: int = 3, deadline: float | None = None,
                        kernels: tuple[str, str] = ("_matmul", "_dense_matmul"), untried_to_second: bool = True,
                        ) -> tuple[int | None, list[tuple[int, float, float]]]:
    """Time a layer's few-row kernel (`_matmul`) against its dense weight at growing row counts
    (or any two of its kernels, `kernels`: the second is the one for many rows).

    Args:
        layer: a finalized `GGUFInt4Linear` / `GGUFBlockLinear` with a dense weight, or several
            of one shape (each call then takes the next in turn, so weights are read cold).
        rows: row counts M to try, ascending.
        reps, inner: samples per kernel and M, calls per sample (medians over samples).
        deadline: `time.perf_counter()` value after which no further M is tried.
        kernels: the few-row and the many-row method names timed.
        untried_to_second: where `deadline` stops the search, the rows not tried take the second
            kernel (True) or stay with the first unless it was already beaten (False: the
            dense copy after an AMX GEMM, which beat it up to hundreds of rows).
    Returns:
        (the first M where dense is faster at M and the next M, or the last M tried if dense
        is faster there; the next untried M when `deadline` stopped the search first; None when
        the few-row kernel is never beaten twice in a row), [(M, few-row us, dense us)].
    Raises:
        ValueError: a layer without a dense weight (when the dense GEMM is timed).
    """
    layers = [layer] if isinstance(layer, nn.Module) else list(layer)
    if "_dense_matmul" in kernels and any(getattr(m, "dense_weight", None) is None for m in layers):
        raise ValueError("calibrate_crossover needs layers with a dense copy")
    rot = _Rotation(layers)
    timings: list[tuple[int, float, float]] = []
    gen = torch.Generator().manual_seed(0)
    candidate: int | None = None
    for i, m in enumerate(rows):
        x = torch.randn(m, layers[0].in_features, generator=gen).to(layers[0].dtype)
        a, b = _medians_us(rot, kernels, x, reps, inner)
        timings.append((m, a, b))
        if b < a:
            if candidate is not None:
                return candidate, timings
            candidate = m
        else:
            candidate = None
        if deadline is not None and time.perf_counter() > deadline and i + 1 < len(rows):
            return (candidate if candidate is not None or not untried_to_second else rows[i + 1]), timings
    return candidate, timings


@torch.inference_mode()
def choose_few_row_kernel(layers: Sequence[GGUFInt4Linear], reps: int = 5, inner: int = 4
                          ) -> tuple[bool, float, float]:
    """Time the JIT block kernel against PyTorch's int4 kernel at one row over `layers` and
    switch every layer to the faster, freeing the other's weights.

    Args:
        layers: finalized layers of one shape [N, K] with GGUF blocks, float32 or bfloat16;
            each call takes the next one (weights read cold).
        reps, inner: samples per kernel, calls per sample (medians over samples).
    Returns:
        (block kernel chosen, its median us per call, int4's), for x [1, K].
    Raises:
        ValueError: a layer without GGUF blocks.
    """
    rot = _Rotation(layers)
    x = torch.randn(1, layers[0].in_features, generator=torch.Generator().manual_seed(0)).to(layers[0].dtype)
    block_us, int4_us = _medians_us(rot, ("_block_matmul", "_int4_matmul"), x, reps, inner)
    for layer in layers:
        layer.use_block_kernel(block_us <= int4_us)
    return block_us <= int4_us, block_us, int4_us


def _bytes(t: torch.Tensor | nn.Module | None) -> int:
    if t is None:
        return 0
    if isinstance(t, nn.Module):
        return sum(b.numel() * b.element_size() for b in t.buffers() if b is not None)
    return t.numel() * t.element_size()


def _calibrate_shape(layers: list[GGUFInt4Linear], report: DispatchReport, deadline: float) -> None:
    """Few-row kernel, then its crossover with the dense copy, for the layers of one shape."""
    shape = (layers[0].out_features, layers[0].in_features)
    amx_ready = all(m.prepare_amx() for m in layers)  # packed from the blocks before a choice frees them
    if (all(m.gguf_blocks is not None for m in layers) and layers[0].dtype in (torch.float32, torch.bfloat16)
            and cpu_kernels.can_use_cpu_kernels()):
        report.block_kernel[shape] = choose_few_row_kernel(layers)
    else:  # the int4 kernel for all of the shape: free any blocks staged
        for layer in layers:
            if layer.gguf_blocks is not None:
                layer.use_block_kernel(False)
    amx = _calibrate_amx(layers, report, shape, deadline, amx_ready)
    crossover = None
    if all(m.dense_weight is not None for m in layers):
        crossover, report.timings_us[shape] = calibrate_crossover(
            layers, AMX_CALIBRATION_ROWS if amx else CALIBRATION_ROWS, deadline=deadline, untried_to_second=not amx)
    report.crossover[shape] = crossover
    for layer in layers:
        if crossover is None:
            layer.drop_dense_copy()
        else:
            layer.dense_from_rows = crossover
            if amx and 1 <= crossover <= layer.amx_from_rows:
                layer.use_amx_from(None)  # the dense copy takes every row count AMX would
        report.dense_bytes += _bytes(layer.dense_weight)
        report.int4_bytes += (_bytes(layer.packed_weight) + _bytes(layer.scales_and_zeros) + _bytes(layer.gguf_blocks)
                              + _bytes(layer.amx_weight))


def _calibrate_amx(layers: list[GGUFInt4Linear], report: DispatchReport, shape: tuple[int, int],
                   deadline: float, ready: bool) -> bool:
    """Time the shape's AMX weights (`ready`: every layer has them) against the few-row kernel;
    True when the shape keeps them. (Packed per shape at calibration, not at load, so that the
    file's blocks, the int4 copy and the AMX records coexist for one shape's layers at most.)"""
    if not ready:  # every layer of the shape, or none
        for layer in layers:
            layer.use_amx_from(None)
        return False
    report.amx[shape] = calibrate_crossover(layers, AMX_CALIBRATION_ROWS, deadline=deadline,
                                            kernels=("_few_row_matmul", "_amx_matmul"))
    for layer in layers:
        layer.use_amx_from(report.amx[shape][0])
    return report.amx[shape][0] is not None


def _calibrate_head(head: GGUFBlockLinear, report: DispatchReport, deadline: float) -> None:
    """The LM head's crossovers: its block kernel against its AMX records (where it has them),
    then that pair against the dense weight; row counts past the last timed take the dense
    weight; a head whose dense weight wins at one row frees its blocks."""
    if head.prepare_amx():
        report.head_amx = calibrate_crossover(head, reps=3, inner=1, deadline=deadline,
                                              kernels=("_few_row_matmul", "_amx_matmul"))
        head.use_amx_from(report.head_amx[0])
    report.head = calibrate_crossover(head, reps=3, inner=1, deadline=deadline,
                                      untried_to_second=head.amx_weight is None)
    crossover = report.head[0]
    if crossover == 1:
        head.drop_blocks()
    else:
        head.dense_from_rows = crossover if crossover is not None else CALIBRATION_ROWS[-1] + 1
        if head.amx_weight is not None and 1 <= head.dense_from_rows <= head.amx_from_rows:
            head.use_amx_from(None)  # the dense weight takes every row count AMX would


def setup_int4_dispatch(model: nn.Module, budget_s: float = 4.0) -> DispatchReport | None:
    """Per distinct shape of `model`'s GGUF int4 layers: pick the few-row kernel (block or
    int4), on AMX CPUs its crossover with the AMX GEMM, then the crossover with the dense
    copy; set the thresholds on every layer and free what is never used; the same for the LM
    head's block kernel. Logs once.

    Args:
        model: a loaded model (its GGUF int4 layers finalized).
        budget_s: wall-time bound on the whole calibration (large models: the last shapes
            then search fewer row counts).
    Returns:
        The report, or None when the model has no GGUF layer.
    Budget: a quarter of `budget_s` for the head, then `budget_s` for the 4-bit layers.
    """
    layers = [m for m in model.modules() if isinstance(m, GGUFInt4Linear)]
    heads = [m for m in model.modules() if isinstance(m, GGUFBlockLinear)]
    if not layers and not heads:
        return None
    report = DispatchReport(layers=len(layers))
    start = time.perf_counter()
    for head in heads:  # one weight, far larger than any cache: timed alone it is cold already
        _calibrate_head(head, report, time.perf_counter() + budget_s / 4)
    deadline = time.perf_counter() + budget_s
    shapes: dict[tuple[int, int], list[GGUFInt4Linear]] = {}
    for layer in layers:
        shapes.setdefault((layer.out_features, layer.in_features), []).append(layer)
    for group in shapes.values():
        _calibrate_shape(group, report, deadline)
    report.seconds = time.perf_counter() - start
    logger.info("%s", report.describe())
    return report
