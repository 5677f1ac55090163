"""Decode step time at TP=2 against TP=1, in process (ModelRunner per rank, no HTTP, no sampling).

For each TP size (default 1 and 2) one process per rank is spawned; ranks join through
torch.distributed (NCCL on CUDA, gloo on the CPU) as the server's scheduler processes do,
build a dummy model (`--load-format dummy`: every rank's weights are slices of TP=1's),
fill the KV pool with random values, and for each batch size (default 1, 16, 64) time a
DECODE batch of `--context-len`-token requests (`ModelRunner.forward`: metadata + model +
logits, all-reduces and the vocabulary all-gather included) with CUDA events on rank 0,
median of `--reps`, with decode CUDA graphs (the NCCL all-reduces captured in them) and
eagerly. Reported: TP=2 step / TP=1 step per batch size (an 8B model on one H200 is
bandwidth-bound: half the weight bytes per GPU should bring the ratio towards 0.5 plus the
all-reduce latency of 2 x layers collectives per step).

    python benchmark/gpu/bench_tp_decode.py                        # 2 GPUs: a few minutes
    python benchmark/gpu/bench_tp_decode.py --tiny --device cpu    # harness check on the CPU (gloo)

Writes <out-dir>/<name>.json (command, machine, date, settings, every figure).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    base_record,
    fill_kv_pool,
    make_decode_batch,
    make_server_args,
    release_decode_batch,
    time_ms,
    write_record,
)


def _free_addr() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _rank_main(rank: int, tp: int, addr: str, args: argparse.Namespace, model_path: str, cuda_graph: bool,
               results: Any) -> None:
    """One rank: join, build, time every batch size; rank 0 reports rows (or the error)."""
    try:
        from hiserve.distributed import destroy_tp_group, init_tp_group
        from hiserve.engine.model_runner import ModelRunner

        device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
        if args.device == "cpu":
            torch.set_num_threads(max(1, args.cpu_threads // tp))
        init_tp_group(tp, rank, addr, device, timeout_s=600)
        max_bs = max(args.batch_sizes)
        fields = dict(model_path=model_path, load_format="dummy", dtype=args.dtype, device=args.device,
                      attention_backend=args.attention_backend, page_size=args.page_size, tp_size=tp,
                      max_total_tokens=max_bs * args.context_len + args.page_size,
                      max_running_requests=max(max_bs, 8), random_seed=1)
        if args.device == "cuda":
            fields.update(disable_cuda_graph=not cuda_graph, cuda_graph_max_bs=max_bs)
        server_args, _ = make_server_args(**fields)
        runner = ModelRunner(server_args)
        fill_kv_pool(runner)
        rows = []
        for bs in args.batch_sizes:
            db = make_decode_batch(runner, bs, args.context_len)
            times = time_ms(lambda: runner.forward(db.batch), runner.device, args.reps, warmup=args.warmup)
            release_decode_batch(runner, db)
            rows.append(dict(tp_size=tp, mode="cuda_graph" if cuda_graph else "eager", batch_size=bs,
                             context_len=args.context_len, step_ms=statistics.median(times),
                             step_ms_min=min(times), step_ms_max=max(times),
                             cuda_graph_runner=runner.cuda_graph_runner is not None))
        if rank == 0:
            results.put(("rows", rows))
        destroy_tp_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put(("error", f"rank {rank}: {traceback.format_exc()}"))


def run_tp(args: argparse.Namespace, model_path: str, tp: int, cuda_graph: bool) -> list[dict]:
    """Spawn `tp` ranks, wait for them; rank 0's rows. Raises RuntimeError on a rank's error."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    addr = _free_addr()
    procs = [ctx.Process(target=_rank_main, args=(r, tp, addr, args, model_path, cuda_graph, results))
             for r in range(tp)]
    for p in procs:
        p.start()
    kind, value = results.get(timeout=args.timeout)
    for p in procs:
        p.join(60)
        if p.is_alive():
            p.kill()
    if kind == "error":
        raise RuntimeError(value)
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama3-8b", help="dummy shape (llama3-8b, deepseek-mla, ...)")
    p.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--context-len", type=int, default=1024)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--attention-backend", default=None, help="default: the server's default for the device")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-eager", dest="eager", action="store_false", help="skip the eager runs (CUDA)")
    p.add_argument("--cpu-threads", type=int, default=2, help="CPU threads shared by the ranks (--device cpu)")
    p.add_argument("--timeout", type=float, default=900, help="seconds to wait for one TP size's ranks")
    p.add_argument("--tiny", action="store_true", help="tiny-llama, context 64, batch sizes 1 and 4 (harness check)")
    p.add_argument("--out-dir", default="benchmark/results")
    p.add_argument("--name", default=None, help="JSON name (default: h200x2_tp_decode_<shape> or cpu_tp_decode_tiny)")
    args = p.parse_args(argv)
    if args.tiny:
        args.shape, args.context_len, args.batch_sizes, args.reps = "tiny-llama", 64, [1, 4], min(args.reps, 5)
        if args.device == "cpu":
            args.dtype = "float32"
    if args.device == "cuda" and torch.cuda.device_count() < max(args.tp_sizes):
        print(f"cannot run: TP {max(args.tp_sizes)} needs as many CUDA devices, {torch.cuda.device_count()} visible "
              f"(use --device cpu --tiny for a harness check)")
        return 1
    name = args.name or (f"h200x2_tp_decode_{args.shape}" if args.device == "cuda" and not args.tiny
                         else f"{args.device}_tp_decode_tiny")
    from hiserve.testing.dummy_model import write_dummy_model

    record: dict[str, Any] = base_record(torch.device(args.device), args)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="hiserve_bench_tp_") as folder:
        model_path = write_dummy_model(folder, args.shape)
        modes = [True, False] if args.device == "cuda" and args.eager else [args.device == "cuda"]
        for cuda_graph in modes:
            for tp in args.tp_sizes:
                print(f"# TP={tp} {'CUDA graphs' if cuda_graph else 'eager'}", flush=True)
                rows += run_tp(args, model_path, tp, cuda_graph)
    record["rows"] = rows
    base = {(r["mode"], r["batch_size"]): r["step_ms"] for r in rows if r["tp_size"] == min(args.tp_sizes)}
    print(f"\n| mode | batch | context | TP | step ms | / TP={min(args.tp_sizes)} |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        r["ratio_to_smallest_tp"] = r["step_ms"] / base[(r["mode"], r["batch_size"])]
        print(f"| {r['mode']} | {r['batch_size']} | {r['context_len']} | {r['tp_size']} | {r['step_ms']:.3f} | "
              f"{r['ratio_to_smallest_tp']:.3f} |")
    write_record(record, args.out_dir, name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
