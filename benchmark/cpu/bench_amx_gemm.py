"""Dense bf16 GEMMs on an AMX CPU: the project's AMX tile GEMM (`AmxLinear`,
csrc/cpu/amx_bf16_gemm.h) against oneDNN's prepacked linear (`PackedLinear`), same process,
interleaved, and whole prefill / decode steps of `make serve` defaults with each.

Part 1, GEMMs: SmolLM2-135M's four projection shapes (N x K: qkv 960x576, o 576x576, gate_up
3072x576, down 576x1536), at 1 to 2048 rows. Each sample calls 30 layers of one shape in turn
(the model's count), so weights are read cold as in a forward pass; both kernels alternate
sample by sample, in ABBA order; medians of --reps. Outputs are checked to agree first (to
bf16 rounding of the result).

Part 2, steps (--steps): `bench_scheduler_steps.py` run twice in fresh processes, with
HISERVE_AMX_DENSE=1 then 0 (the GGUF dense copy, the dense bf16 LM head and, with
--quantization none, every projection take the chosen kernel; the int4 dispatch is recalibrated
in each process against it), giving the 200-token prefill, the single-stream decode step and
scenario (c)'s in-process TTFT under each.

    python benchmark/cpu/bench_amx_gemm.py [--steps] [--out benchmark/results/cpu_amx_dense_gemm.json]

Prints a table; the JSON holds the command, CPU (lscpu), threads, date and every median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scheduler_steps import _cpu_model  # noqa: E402

from hiserve.jit_kernel import cpu as cpu_kernels  # noqa: E402
from hiserve.layers.linear import AmxLinear, PackedLinear  # noqa: E402

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
ROWS = (1, 4, 16, 64, 128, 200, 392, 1000, 2048)  # 2048: the server's default CPU chunk
LAYERS = 30


def _sample_us(layers: list, x: torch.Tensor) -> float:
    start = time.perf_counter()
    for layer in layers:
        layer(x)
    return (time.perf_counter() - start) / len(layers) * 1e6


@torch.inference_mode()
def gemm_table(reps: int) -> list[dict]:
    """Median us per call of both kernels per (shape, rows), interleaved sample by sample."""
    gen = torch.Generator().manual_seed(0)
    cases = []
    for n, k in SHAPES:
        weights = [torch.randn(n, k, generator=gen).bfloat16() for _ in range(LAYERS)]
        onednn = [PackedLinear(w, None) for w in weights]
        amx = [AmxLinear(w, None) for w in weights]
        for m in ROWS:
            x = torch.randn(m, k, generator=gen).bfloat16()
            torch.testing.assert_close(amx[0](x).float(), onednn[0](x).float(), rtol=2 ** -6, atol=2e-3 * k ** 0.5)
            a_s, b_s = [], []
            for rep in range(reps):
                first, second = (onednn, amx) if rep % 2 == 0 else (amx, onednn)
                t1, t2 = _sample_us(first, x), _sample_us(second, x)
                a_s.append(t1 if first is onednn else t2)
                b_s.append(t2 if first is onednn else t1)
            a, b = statistics.median(a_s), statistics.median(b_s)
            cases.append({"n": n, "k": k, "rows": m, "onednn_us": a, "amx_us": b, "amx_over_onednn": b / a,
                          "amx_tflops": 2 * m * n * k / b / 1e6})
    return cases


def steps(quantization: str | None) -> dict:
    """bench_scheduler_steps.py in fresh processes with the AMX dense GEMM on, then off."""
    script = Path(__file__).resolve().parent / "bench_scheduler_steps.py"
    out = {}
    for label, flag in (("amx", "1"), ("onednn", "0")):
        path = Path(f"/tmp/bench_amx_gemm_steps_{label}.json")
        cmd = [sys.executable, str(script), "--clock", "wall", "--out", str(path)]
        if quantization:
            cmd += ["--quantization", quantization]
        env = {**os.environ, "HISERVE_AMX_DENSE": flag}
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        out[label] = json.loads(path.read_text())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--steps", action="store_true", help="also whole scheduler steps with each kernel")
    ap.add_argument("--quantization", default=None, help="for --steps: as the server's flag")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not cpu_kernels.amx_gemm_available():
        sys.exit(f"no AMX GEMM here (kernel ISA {cpu_kernels.detect_cpu().isa}): nothing to compare")
    cases = gemm_table(args.reps)
    print(f"{'N x K':>10} {'rows':>5} {'oneDNN us':>10} {'AMX us':>8} {'AMX/oneDNN':>11} {'AMX TFLOP/s':>12}")
    for c in cases:
        print(f"{c['n']:>5}x{c['k']:<4} {c['rows']:>5} {c['onednn_us']:>10.1f} {c['amx_us']:>8.1f} "
              f"{c['amx_over_onednn']:>11.2f} {c['amx_tflops']:>12.2f}")
    per_layer = {}
    for m in ROWS:
        rows = [c for c in cases if c["rows"] == m]
        per_layer[m] = sum(c["amx_us"] for c in rows) / sum(c["onednn_us"] for c in rows)
    print("a layer's four GEMMs, AMX / oneDNN:", {m: round(r, 2) for m, r in per_layer.items()})
    step = steps(args.quantization) if args.steps else None
    if step:
        for label, d in step.items():
            print(f"{label}: prefill 200 {d['single']['prefill_200_ms']:.1f} ms, decode step "
                  f"{d['single']['decode_step_ms']:.2f} ms, scenario (c) TTFT mean {d['shared_prefix']['ttft_mean_ms']:.0f} ms")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "benchmark": "cpu_amx_dense_gemm", "command": " ".join(["python"] + sys.argv),
            "date": datetime.now(timezone.utc).isoformat(), "cpu": _cpu_model(),
            "isa": cpu_kernels.detect_cpu().isa, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "layers_per_sample": LAYERS, "reps": args.reps, "cases": cases,
            "layer_ratio_amx_over_onednn": per_layer, "steps": step}, indent=1))


if __name__ == "__main__":
    main()
