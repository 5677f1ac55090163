"""Prefill attention on an AMX CPU: the project's AMX flash-attention kernel
(`cpu_amx.amx_flash_attention`, csrc/cpu/amx_attention.h) against torch's SDPA (its CPU flash
attention, oneDNN's AMX tiles), same process, interleaved, and whole scheduler steps with the
"amx" EXTEND routing against "sdpa".

Part 1, one layer's attention with SmolLM2-135M's heads (9 query heads on 3 KV heads, D 64), the
shapes `make serve` meets: a fresh prompt of 200 / 1061 / 2048 tokens (causal), scenario (c)'s
shared part (7 x 56 questions over a 1008-token system prompt: 392 queries, no mask, with the
log-sum-exp, SDPA called as cpu_prefix_split does) and one question over its whole context
(56 over 1064, causal: SDPA with the mask tensor the "sdpa" routing builds). Both alternate
sample by sample in ABBA order; medians of --reps samples of 30 calls (a model's layers). Outputs
are checked to agree first.

Part 2, steps (--steps): `bench_scheduler_steps.py` in fresh processes with
HISERVE_CPU_EXTEND_ATTENTION=amx then sdpa: the 200-token prefill, the decode step and scenario
(c)'s in-process TTFT under each.

    python benchmark/cpu/bench_amx_attention.py [--steps] [--out benchmark/results/cpu_amx_attention.json]

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
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scheduler_steps import _cpu_model  # noqa: E402

from hiserve.jit_kernel import cpu as cpu_kernels  # noqa: E402
from hiserve.jit_kernel.cpu_amx import amx_flash_attention  # noqa: E402
from hiserve.layers.attention.cpu_prefix_split import _FLASH_CPU  # noqa: E402

HQ, HKV, D, SCALE, LAYERS = 9, 3, 64, 0.125, 30
# (label, queries, keys, causal)
CASES = (("fresh 200", 200, 200, True), ("fresh 1061", 1061, 1061, True), ("fresh 2048", 2048, 2048, True),
         ("shared 392 x 1008", 392, 1008, False), ("question 56 over 1064", 56, 1064, True))


def _pair(n: int, s: int, causal: bool):
    """(sdpa, amx) callables of one case, on the same bf16 q [n, 9, 64], k/v [s, 3, 64]."""
    gen = torch.Generator().manual_seed(n + s)
    q, k, v = (torch.randn(r, h, D, generator=gen).bfloat16() for r, h in ((n, HQ), (s, HKV), (s, HKV)))
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    if not causal:  # cpu_prefix_split: KV heads' query heads folded into rows, log-sum-exp out
        qf = q.view(n, HKV, HQ // HKV, D).permute(1, 2, 0, 3).reshape(1, HKV, HQ // HKV * n, D)
        sdpa = lambda: _FLASH_CPU(qf, ks, vs, 0.0, False, scale=SCALE)[0]  # noqa: E731
    elif n == s:
        sdpa = lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=SCALE, enable_gqa=True)  # noqa: E731
    else:
        mask = torch.arange(s).view(1, -1) <= torch.arange(s - n, s).view(-1, 1)
        sdpa = lambda: F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=SCALE, enable_gqa=True)  # noqa: E731
    amx = lambda: amx_flash_attention(q, k, v, SCALE, causal, with_lse=not causal)[0]  # noqa: E731
    if causal:  # agreement first (the unmasked SDPA output is in the folded layout)
        torch.testing.assert_close(amx().float(), sdpa()[0].transpose(0, 1).float(), rtol=2e-2, atol=2e-2)
    return sdpa, amx


def _sample_ms(fn) -> float:
    start = time.perf_counter()
    for _ in range(LAYERS):
        fn()
    return (time.perf_counter() - start) / LAYERS * 1e3


@torch.inference_mode()
def kernel_table(reps: int) -> list[dict]:
    rows = []
    for label, n, s, causal in CASES:
        sdpa, amx = _pair(n, s, causal)
        for fn in (sdpa, amx):
            fn()
        a, b = [], []
        for i in range(reps):  # ABBA
            first, second = (sdpa, amx) if i % 2 == 0 else (amx, sdpa)
            t1, t2 = _sample_ms(first), _sample_ms(second)
            a.append(t1 if first is sdpa else t2)
            b.append(t2 if first is sdpa else t1)
        pairs = n * s - (n * (n - 1) // 2 if causal else 0)
        sd, am = statistics.median(a), statistics.median(b)
        rows.append({"case": label, "queries": n, "keys": s, "causal": causal, "sdpa_ms": sd, "amx_ms": am,
                     "amx_over_sdpa": am / sd, "amx_tflops": pairs * HQ * D * 4 / am / 1e9})
    return rows


def steps() -> dict:
    """bench_scheduler_steps.py in fresh processes on the amx, then the sdpa routing."""
    script = Path(__file__).resolve().parent / "bench_scheduler_steps.py"
    out = {}
    for route in ("amx", "sdpa"):
        path = Path(f"/tmp/bench_amx_attention_steps_{route}.json")
        env = {**os.environ, "HISERVE_CPU_EXTEND_ATTENTION": route}
        subprocess.run([sys.executable, str(script), "--clock", "wall", "--out", str(path)], env=env, check=True,
                       stdout=subprocess.DEVNULL)
        out[route] = json.loads(path.read_text())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--steps", action="store_true", help="also whole scheduler steps on each routing")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not cpu_kernels.amx_gemm_available():
        sys.exit(f"no AMX kernels here (kernel ISA {cpu_kernels.detect_cpu().isa}): nothing to compare")
    rows = kernel_table(args.reps)
    print(f"{'case':>22} {'SDPA ms':>8} {'AMX ms':>8} {'AMX/SDPA':>9} {'AMX TFLOP/s':>12}")
    for r in rows:
        print(f"{r['case']:>22} {r['sdpa_ms']:>8.3f} {r['amx_ms']:>8.3f} {r['amx_over_sdpa']:>9.2f} {r['amx_tflops']:>12.2f}")
    step = steps() if args.steps else None
    if step:
        for route, d in step.items():
            print(f"{route}: prefill 200 {d['single']['prefill_200_ms']:.1f} ms, decode step "
                  f"{d['single']['decode_step_ms']:.2f} ms, scenario (c) TTFT mean "
                  f"{d['shared_prefix']['ttft_mean_ms']:.0f} ms")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "benchmark": "cpu_amx_attention", "command": " ".join(["python"] + sys.argv),
            "date": datetime.now(timezone.utc).isoformat(), "cpu": _cpu_model(),
            "isa": cpu_kernels.detect_cpu().isa, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "heads": {"q": HQ, "kv": HKV, "dim": D}, "calls_per_sample": LAYERS, "reps": args.reps,
            "cases": rows, "steps": step}, indent=1))


if __name__ == "__main__":
    main()
