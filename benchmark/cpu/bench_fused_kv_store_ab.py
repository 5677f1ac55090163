"""CPU decode steps with the new K/V stored inside the cpu_paged kernel call (fused) against
`set_kv_buffer` + kernel (python), in one process, interleaved (medians), on the default model.

Both variants are the same `CpuPagedAttnBackend`, toggled through its `fuse_kv_store`
attribute; everything else (weights, pool, batch) is shared, so the difference is the store.
Two figures per (batch size, context): whole decode steps (`ModelRunner.forward`), and one
layer's `backend.forward` alone (30 calls a round), where the store's cost is not buried in
a step's noise.

    python benchmark/cpu/bench_fused_kv_store_ab.py --threads 1 --clock cpu
    python benchmark/cpu/bench_fused_kv_store_ab.py --batch-sizes 1 16 --contexts 256 1024 --reps 41

Writes benchmark/results/<name>.json (machine, settings, per-config medians and all samples).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cpu_attention import setup  # noqa: E402
from common import make_decode_batch, release_decode_batch, write_record  # noqa: E402

from hiserve.engine.model_runner import ModelRunner  # noqa: E402
from hiserve.jit_kernel import cpu as cpu_kernels  # noqa: E402
from hiserve.layers.attention.base import RadixAttention  # noqa: E402
from hiserve.layers.attention.cpu_backend import CpuPagedAttnBackend  # noqa: E402


def layer_call_us(runner: ModelRunner, db: Any, reps: int, clock: Callable[[], float]) -> dict[str, float]:
    """Median us of one `backend.forward` (layer 0's shapes; q/k/v views of one fused QKV
    output, as the model hands them in) per variant: the step's store cost without the rest
    of the step's noise. Rounds of 30 calls (a step's layers), alternating the variant first."""
    backend, fb = runner.attn_backend, runner.make_forward_batch(db.batch)
    layer = next(m for m in runner.model.modules() if isinstance(m, RadixAttention))
    hq, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    qkv = torch.randn(fb.out_cache_loc.numel(), (hq + 2 * hkv) * d).to(runner.token_to_kv_pool.dtype)
    q, k, v = qkv[:, : hq * d], qkv[:, hq * d: (hq + hkv) * d], qkv[:, (hq + hkv) * d:]
    samples: dict[str, list[float]] = {"python": [], "fused": []}
    with torch.inference_mode():
        for r in range(reps + 2):
            for name in (("python", "fused") if r % 2 == 0 else ("fused", "python")):
                backend.fuse_kv_store = name == "fused"
                backend.init_forward_metadata(fb)  # the backend reads the flag per batch
                t0 = clock()
                for _ in range(30):
                    backend.forward(q, k, v, layer, fb)
                if r >= 2:  # two warm-up rounds
                    samples[name].append((clock() - t0) / 30 * 1e6)
    backend.fuse_kv_store = True
    return {k: statistics.median(v) for k, v in samples.items()}


def ab_samples(runner: ModelRunner, bs: int, ctx: int, reps: int, clock: Callable[[], float]) -> dict[str, Any]:
    """Per-step ms of both variants on one DECODE batch; rounds alternate which runs first."""
    backend = runner.attn_backend
    assert isinstance(backend, CpuPagedAttnBackend), "needs --attention-backend cpu_paged"
    db = make_decode_batch(runner, bs, ctx)
    samples: dict[str, list[float]] = {"python": [], "fused": []}
    try:
        for fused in (False, True, False, True):  # warm-up
            backend.fuse_kv_store = fused
            runner.forward(db.batch)
        for r in range(reps):
            for name in (("python", "fused") if r % 2 == 0 else ("fused", "python")):
                backend.fuse_kv_store = name == "fused"
                t0 = clock()
                runner.forward(db.batch)
                samples[name].append((clock() - t0) * 1e3)
        layer_us = layer_call_us(runner, db, 10 * reps, clock)
    finally:
        backend.fuse_kv_store = True
        release_decode_batch(runner, db)
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {"batch_size": bs, "context": ctx, "step_ms_median": med,
            "fused_over_python": med["fused"] / med["python"], "layer_forward_us_median": layer_us,
            "samples_ms": samples}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=None, help="default: the installed SmolLM2-135M GGUF")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--reps", type=int, default=31)
    p.add_argument("--threads", type=int, default=None, help="default: hardware.usable_cpu_count()")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: this process's CPU time (robust on a shared machine; use with --threads 1)")
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parents[1] / "results"))
    p.add_argument("--name", default="cpu_attention_fused_kv_store_ab")
    args = p.parse_args(argv)
    if not cpu_kernels.can_use_cpu_kernels():
        print("the CPU kernels cannot be built here: nothing to compare", file=sys.stderr)
        return 1
    runner, record, clock = setup(args)
    for bs in args.batch_sizes:
        for ctx in args.contexts:
            r = ab_samples(runner, bs, ctx, args.reps, clock)
            m = r["step_ms_median"]
            print(f"bs {bs:3d} ctx {ctx:5d} | step ms: python store {m['python']:7.3f}"
                  f" fused store {m['fused']:7.3f} (fused/python {r['fused_over_python']:.3f})"
                  f" | one layer's forward us: python {r['layer_forward_us_median']['python']:7.2f}"
                  f" fused {r['layer_forward_us_median']['fused']:7.2f}", flush=True)
            record["results"].append(r)
            record["load_average"] = os.getloadavg()
            write_record(record, args.out_dir, args.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
