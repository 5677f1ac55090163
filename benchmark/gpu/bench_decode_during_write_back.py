"""Decode step time while a large write-back runs, vs idle, for the two write-back paths.

In process on a Llama-3-8B-shaped dummy model (bf16, decode CUDA graphs): a DECODE batch
(`--batch-sizes`, default 16 and 64, `--context-len` 1024 tokens each) is timed idle, then
while `--write-pages` pages of other device slots are written back to a host pool through
the real `HiCacheController.write` (all layers, on the controller's write stream):

- `staged`: host layout `page_first` (relayout kernel into the device staging buffer, then
  copy-engine DMA of whole pages);
- `per_token_kernel`: host layout `layer_first` with `kernel` IO (an SM kernel storing each
  token's rows into mapped host memory).

Each busy repeat starts one write and immediately queues decode steps back to back (as
many as fit in the write's idle duration, plus two); a step counts as busy if it ended
before the write did (CUDA events on both streams). Ratio = median busy step / median idle
step. Target: staged <= 1.03. The write's own time and bandwidth, alone and under decode,
are reported too.

    python benchmark/gpu/bench_decode_during_write_back.py                      # H200: ~1-2 min
    python benchmark/gpu/bench_decode_during_write_back.py --tiny --device cpu  # harness check

On the CPU there is no second stream: writes run synchronously inside `write`, so the
"busy" figures there only prove the harness runs. Writes <out-dir>/<name>.json.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    base_record,
    fill_kv_pool,
    graph_runner_of,
    make_decode_batch,
    make_server_args,
    release_decode_batch,
    time_ms,
    write_record,
)

from hiserve.engine.model_runner import ModelRunner  # noqa: E402
from hiserve.mem_cache.cache_controller import HiCacheController  # noqa: E402
from hiserve.mem_cache.memory_pool_host import GB, MHATokenToKVPoolHost, MLATokenToKVPoolHost  # noqa: E402
from hiserve.testing.dummy_model import write_dummy_model  # noqa: E402

PATHS = {"staged": "page_first", "per_token_kernel": "layer_first"}
TARGET_STAGED_RATIO = 1.03


class Writer:
    """One host pool + controller; `start()` issues a write-back of `slots` and returns
    (host slots, an event recorded on the write stream after it; None on the CPU)."""

    def __init__(self, runner: ModelRunner, layout: str, slots: torch.Tensor):
        self.runner = runner
        self.slots = slots
        write_bytes = slots.numel() * runner._cell_size_bytes()
        host_gb = math.ceil(write_bytes / GB) + 1
        cls = MLATokenToKVPoolHost if runner.is_mla else MHATokenToKVPoolHost
        self.host_pool = cls(runner.token_to_kv_pool, 0, host_gb, runner.page_size, layout)
        self.controller = HiCacheController(runner.token_to_kv_pool, self.host_pool, "kernel")
        self.write_bytes = write_bytes

    def start(self) -> tuple[torch.Tensor, Any]:
        started = self.controller.write(self.slots, node_id=0)
        if started is None:
            raise RuntimeError("host pool too small for the write-back")
        host = started[0]
        end = None
        if self.controller.is_cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record(self.controller.write_stream)
        return host, end

    def finish(self, host: torch.Tensor) -> None:
        self.controller.synchronize()
        self.controller.poll_write_acks()
        self.host_pool.free(host)

    def alone_ms(self, reps: int) -> list[float]:
        """Write-back time with nothing else running (CUDA events; wall clock on the CPU)."""
        out = []
        for _ in range(reps):
            if not self.controller.is_cuda:
                t0 = time.perf_counter()
                host, _ = self.start()
                out.append((time.perf_counter() - t0) * 1e3)
                self.finish(host)
                continue
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            host, end = self.start()
            end.synchronize()
            out.append(start.elapsed_time(end))
            self.finish(host)
        return out

    def close(self) -> None:
        self.controller.reset()
        self.host_pool.close()


def busy_steps_ms(runner: ModelRunner, writer: Writer, batch, steps: int) -> tuple[list[float], float]:
    """Queue one write-back, then `steps` decode steps; returns the times of the steps that
    ended before the write did, and the write's duration (ms, from its start)."""
    dev = runner.device
    if dev.type != "cuda":
        t0 = time.perf_counter()
        host, _ = writer.start()
        write_ms = (time.perf_counter() - t0) * 1e3
        times = time_ms(lambda: runner.forward(batch), dev, steps, warmup=0)
        writer.finish(host)
        return times, write_ms
    torch.cuda.synchronize()
    t0 = torch.cuda.Event(enable_timing=True)
    t0.record()
    host, write_end = writer.start()
    events = []
    for _ in range(steps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        runner.forward(batch)
        e.record()
        events.append((s, e))
    torch.cuda.synchronize()
    write_ms = t0.elapsed_time(write_end)
    busy = [s.elapsed_time(e) for s, e in events if t0.elapsed_time(e) <= write_ms]
    writer.finish(host)
    return busy, write_ms


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 64])
    p.add_argument("--context-len", type=int, default=1024)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--write-pages", type=int, default=2048, help="pages per write-back (2048 x 16 tokens = 4.3 GB)")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--reps", type=int, default=30, help="idle decode steps timed")
    p.add_argument("--repeats", type=int, default=4, help="write-backs per path and batch size")
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    p.add_argument("--tiny", action="store_true", help="tiny-llama, context 64, batch 4, 32 pages (harness check)")
    p.add_argument("--out-dir", default="benchmark/results")
    p.add_argument("--name", default=None)
    args = p.parse_args(argv)
    if args.tiny:
        args.shape, args.context_len, args.batch_sizes = "tiny-llama", 64, [4]
        args.write_pages, args.reps, args.repeats = 32, 5, 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("cannot run: --device cuda without a CUDA device (use --device cpu --tiny for a harness check)")
        return 1
    name = args.name or ("h200_decode_during_write_back" if args.device == "cuda" and not args.tiny
                         else f"{args.device}_decode_during_write_back_tiny")
    record: dict[str, Any] = base_record(torch.device(args.device), args)

    with tempfile.TemporaryDirectory(prefix="hiserve_bench_wb_") as folder:
        model_path = write_dummy_model(folder, args.shape)
        max_bs = max(args.batch_sizes)
        write_tokens = args.write_pages * args.page_size
        fields = dict(model_path=model_path, load_format="dummy", dtype=args.dtype, device=args.device,
                      attention_backend=args.attention_backend, page_size=args.page_size,
                      max_total_tokens=max_bs * args.context_len + write_tokens + args.page_size,
                      max_running_requests=max(max_bs, 8), random_seed=1)
        if args.device == "cuda":
            fields.update(cuda_graph_max_bs=max_bs)
        server_args, missing = make_server_args(**fields)
        runner = ModelRunner(server_args)
        fill_kv_pool(runner)
        record["runner"] = {"cuda_graph_runner_found": graph_runner_of(runner) is not None,
                            "server_args_missing": missing, "attention_backend": server_args.attention_backend}
        write_slots = runner.token_to_kv_pool_allocator.alloc(write_tokens)
        rows = []
        for path in args.paths:
            writer = Writer(runner, PATHS[path], write_slots)
            alone = writer.alone_ms(2)
            alone_ms = statistics.median(alone)
            print(f"# {path} ({PATHS[path]}): write-back of {writer.write_bytes / 1e9:.2f} GB alone "
                  f"{alone_ms:.1f} ms ({writer.write_bytes / alone_ms / 1e6:.1f} GB/s)", flush=True)
            for bs in args.batch_sizes:
                db = make_decode_batch(runner, bs, args.context_len)
                idle = time_ms(lambda: runner.forward(db.batch), runner.device, args.reps)
                idle_ms = statistics.median(idle)
                steps = int(alone_ms / idle_ms) + 2
                busy, write_under_decode = [], []
                for _ in range(args.repeats):
                    times, wms = busy_steps_ms(runner, writer, db.batch, steps)
                    busy += times
                    write_under_decode.append(wms)
                release_decode_batch(runner, db)
                busy_ms = statistics.median(busy) if busy else float("nan")
                row = dict(path=path, layout=PATHS[path], batch_size=bs, context_len=args.context_len,
                           write_bytes=writer.write_bytes, write_alone_ms=alone_ms,
                           write_alone_gbps=writer.write_bytes / alone_ms / 1e6,
                           write_under_decode_ms=statistics.median(write_under_decode),
                           idle_step_ms=idle_ms, busy_step_ms=busy_ms, busy_samples=len(busy),
                           busy_over_idle=busy_ms / idle_ms)
                rows.append(row)
                print(f"  bs={bs:<3d} idle {idle_ms:8.3f} ms  during write-back {busy_ms:8.3f} ms "
                      f"({len(busy)} steps)  ratio {row['busy_over_idle']:.3f}  "
                      f"write under decode {row['write_under_decode_ms']:.1f} ms", flush=True)
            writer.close()
    record["rows"] = rows
    staged = [r["busy_over_idle"] for r in rows if r["path"] == "staged"]
    worst = max(staged) if staged else float("nan")
    record["targets"] = {"staged_busy_over_idle_max": worst, "target": TARGET_STAGED_RATIO,
                         "met": bool(worst <= TARGET_STAGED_RATIO)}
    print("\n| path | batch | idle step ms | busy step ms | busy/idle | busy samples | write alone ms (GB/s) | "
          "write under decode ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['path']} | {r['batch_size']} | {r['idle_step_ms']:.3f} | {r['busy_step_ms']:.3f} | "
              f"{r['busy_over_idle']:.3f} | {r['busy_samples']} | {r['write_alone_ms']:.1f} "
              f"({r['write_alone_gbps']:.1f}) | {r['write_under_decode_ms']:.1f} |")
    print(f"target staged busy/idle <= {TARGET_STAGED_RATIO}: worst {worst:.3f} "
          f"({'met' if record['targets']['met'] else 'NOT met'})")
    write_record(record, args.out_dir, name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
