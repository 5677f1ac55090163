"""Decode step time against the HBM roofline, in process (ModelRunner, no HTTP, no sampling).

A Llama-3-8B-shaped dummy model (`--load-format dummy`, bf16); for each batch size
(default 1, 16, 64) a DECODE batch of requests with `--context-len` tokens each (1024)
over a KV pool filled with random values; the step (`ModelRunner.forward`: metadata +
model + logits) is timed with CUDA events, median of `--reps`, with decode CUDA graphs and
then eagerly (`--disable-cuda-graph`) in a second runner.

Roofline: a decode step must at least read every weight once (all parameters except the
embedding table, of which it reads one row per request) and every KV byte of the batch's
context. Its time limit is those bytes divided by the HBM bandwidth of a large
device-to-device `copy_` measured in the same run (read + write bytes per second). Reported
ratio = roofline time / measured time (1.0 = at the copy bandwidth). Target: batch 1 with
CUDA graphs >= 0.6.

    python benchmark/gpu/bench_decode.py                       # H200: about 1-2 minutes
    python benchmark/gpu/bench_decode.py --tiny --device cpu   # harness check on the CPU

Writes <out-dir>/<name>.json (command, machine, date, settings, every figure).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    base_record,
    copy_bandwidth_bytes_per_s,
    fill_kv_pool,
    graph_runner_of,
    make_decode_batch,
    make_server_args,
    release_decode_batch,
    time_ms,
    write_record,
)

from hiserve.engine.model_runner import ModelRunner  # noqa: E402
from hiserve.testing.dummy_model import write_dummy_model  # noqa: E402

TARGET_BATCH1_RATIO = 0.6


def weight_bytes_read_per_step(model: torch.nn.Module, batch_size: int) -> int:
    """Bytes of parameters one decode step reads: all of them, except that only `batch_size`
    rows of the input embedding table are read (the whole table when it is also the LM head).
    Routed experts count in full (an upper bound for sparse routing at small batches)."""
    embed = model.model.embed_tokens.weight
    tied = getattr(model, "lm_head", None) is None
    total = 0
    for p in model.parameters():
        if p is embed and not tied:
            total += batch_size * p.shape[1] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    return total


def kv_bytes_read_per_step(runner: ModelRunner, batch_size: int, context_len: int) -> int:
    """KV bytes of `batch_size` x `context_len` tokens across all layers (K and V for MHA,
    the latent + rope row for MLA)."""
    return batch_size * context_len * runner._cell_size_bytes()


def run_mode(args, model_path: str, cuda_graph: bool, limit: dict[str, float] | None) -> tuple[list[dict], dict]:
    max_bs = max(args.batch_sizes)
    fields = dict(model_path=model_path, load_format="dummy", dtype=args.dtype, device=args.device,
                  attention_backend=args.attention_backend, page_size=args.page_size,
                  max_total_tokens=max_bs * args.context_len + args.page_size,
                  max_running_requests=max(max_bs, 8), random_seed=1)
    if args.device == "cuda":
        fields.update(disable_cuda_graph=not cuda_graph, cuda_graph_max_bs=max_bs)
    server_args, missing = make_server_args(**fields)
    runner = ModelRunner(server_args)
    fill_kv_pool(runner)
    info = {"cuda_graph_requested": cuda_graph, "cuda_graph_runner_found": graph_runner_of(runner) is not None,
            "server_args_missing": missing, "attention_backend": server_args.attention_backend}
    if limit is None:
        weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        limit = copy_bandwidth_bytes_per_s(runner.device, min(weights, args.copy_bytes))
    rows = []
    for bs in args.batch_sizes:
        db = make_decode_batch(runner, bs, args.context_len)
        times = time_ms(lambda: runner.forward(db.batch), runner.device, args.reps, warmup=args.warmup)
        release_decode_batch(runner, db)
        step_ms = statistics.median(times)
        w_bytes = weight_bytes_read_per_step(runner.model, bs)
        kv_bytes = kv_bytes_read_per_step(runner, bs, args.context_len)
        roofline_ms = (w_bytes + kv_bytes) / limit["hbm_bytes_per_s"] * 1e3
        rows.append(dict(mode="cuda_graph" if cuda_graph else "eager", batch_size=bs, context_len=args.context_len,
                         step_ms=step_ms, step_ms_min=min(times), step_ms_max=max(times),
                         tokens_per_s=bs / (step_ms * 1e-3), weight_bytes=w_bytes, kv_bytes=kv_bytes,
                         roofline_ms=roofline_ms, roofline_ratio=roofline_ms / step_ms))
        print(f"  {rows[-1]['mode']:10s} bs={bs:<3d} step {step_ms:8.3f} ms  roofline {roofline_ms:7.3f} ms  "
              f"ratio {rows[-1]['roofline_ratio']:.3f}  ({rows[-1]['tokens_per_s']:.0f} tok/s)", flush=True)
    del runner
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return rows, {**info, "limit": limit}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--context-len", type=int, default=1024, help="tokens per request (multiple of --page-size)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--attention-backend", default=None, help="default: the server's default for the device")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--copy-bytes", type=int, default=4 << 30, help="bytes of the bandwidth-limit copy (at most)")
    p.add_argument("--no-eager", dest="eager", action="store_false", help="skip the eager comparison")
    p.add_argument("--tiny", action="store_true", help="tiny-llama, context 64, batch sizes 1 and 4 (harness check)")
    p.add_argument("--out-dir", default="benchmark/results")
    p.add_argument("--name", default=None, help="JSON file name (default: h200_decode, or cpu_decode_tiny)")
    args = p.parse_args(argv)
    if args.tiny:
        args.shape, args.context_len, args.batch_sizes, args.reps = "tiny-llama", 64, [1, 4], min(args.reps, 5)
        args.copy_bytes = min(args.copy_bytes, 64 << 20)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("cannot run: --device cuda without a CUDA device (use --device cpu --tiny for a harness check)")
        return 1
    name = args.name or ("h200_decode" if args.device == "cuda" and not args.tiny else f"{args.device}_decode_tiny")

    record: dict[str, Any] = base_record(torch.device(args.device), args)
    with tempfile.TemporaryDirectory(prefix="hiserve_bench_decode_") as folder:
        model_path = write_dummy_model(folder, args.shape)
        modes = [True, False] if args.device == "cuda" and args.eager else [args.device == "cuda"]
        rows, runs, limit = [], [], None
        for cuda_graph in modes:
            print(f"# {'CUDA graphs' if cuda_graph else 'eager'}", flush=True)
            mode_rows, info = run_mode(args, model_path, cuda_graph, limit)
            limit = info["limit"]
            rows += mode_rows
            runs.append(info)
    record.update(rows=rows, runs=runs, copy_limit=limit)
    batch1 = [r for r in rows if r["batch_size"] == 1 and r["mode"] == ("cuda_graph" if args.device == "cuda"
                                                                          else "eager")]
    ratio = batch1[0]["roofline_ratio"] if batch1 else float("nan")
    record["targets"] = {"batch1_roofline_ratio": ratio, "target": TARGET_BATCH1_RATIO,
                         "met": bool(ratio >= TARGET_BATCH1_RATIO)}
    print("\n| mode | batch | context | step ms | tok/s | weight GB | KV GB | roofline ms | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['batch_size']} | {r['context_len']} | {r['step_ms']:.3f} | {r['tokens_per_s']:.0f} | "
              f"{r['weight_bytes'] / 1e9:.2f} | {r['kv_bytes'] / 1e9:.3f} | {r['roofline_ms']:.3f} | "
              f"{r['roofline_ratio']:.3f} |")
    print(f"copy limit: {limit['hbm_bytes_per_s'] / 1e12:.3f} TB/s (read + write) over {limit['copy_bytes']} bytes")
    print(f"target batch-1 ratio >= {TARGET_BATCH1_RATIO}: {ratio:.3f} "
          f"({'met' if record['targets']['met'] else 'NOT met'})")
    write_record(record, args.out_dir, name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
