"""CPU decode: the cpu_paged attention kernel against torch_native, and whole-model decode
steps with each, in one process (A/B interleaved, medians), on the default model.

One ModelRunner holds the weights and a KV pool filled with random values; for each batch
size (default 1, 16) and context (256, 1024, 4096) a DECODE batch is built once and
timed with three variants, one call of each per round, so machine noise hits all alike:

* attention: `init_forward_metadata` + one `forward` per model layer, for each backend,
  reported per layer (ms), on the model's own shapes and pool;
* step: `ModelRunner.forward` (metadata + model + logits), with
    baseline   = torch_native attention and the torch forms of norm/rotary/SiLU-mul
                 (what the CPU ran before the kernels),
    torch_native + kernels = torch_native attention, C++ norm/rotary/SiLU-mul,
    cpu_paged  = the new default (C++ attention and small ops).

    python benchmark/cpu/bench_cpu_attention.py               # ~5 minutes on 2 cores
    python benchmark/cpu/bench_cpu_attention.py --dtype float32 --batch-sizes 1 --contexts 256
    python benchmark/cpu/bench_cpu_attention.py --threads 1 --clock cpu   # a machine shared with other jobs

Prints a table; writes benchmark/results/<name>.json (lscpu model and flags, date, command,
settings, every sample's median). Noisy machines: re-run on a quiet one before quoting.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))

from common import (  # noqa: E402
    base_record,
    fill_kv_pool,
    make_decode_batch,
    make_server_args,
    release_decode_batch,
    write_record,
)

from hiserve.engine.model_runner import ModelRunner  # noqa: E402
from hiserve.hardware import detect_cpu, usable_cpu_count  # noqa: E402
from hiserve.jit_kernel import cpu as cpu_kernels  # noqa: E402
from hiserve.layers.attention.base import RadixAttention  # noqa: E402
from hiserve.layers.attention.cpu_backend import CpuPagedAttnBackend  # noqa: E402
from hiserve.layers.attention.torch_native import TorchNativeAttnBackend  # noqa: E402


def lscpu() -> dict[str, str]:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {k.strip(): fields[k].strip() for k in fields if k.strip() in ("Model name", "Flags", "CPU(s)")}


def interleaved_medians(fns: dict[str, Callable[[], Any]], reps: int, clock: Callable[[], float],
                        warmup: int = 1) -> dict[str, float]:
    """Median ms per variant by `clock`; each round calls every variant once, in a rotating order."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(reps):
        for name in names[r % len(names):] + names[: r % len(names)]:
            t0 = clock()
            fns[name]()
            samples[name].append((clock() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in samples.items()}


def attention_layers(model: torch.nn.Module) -> list[RadixAttention]:
    return [m for m in model.modules() if isinstance(m, RadixAttention)]


def bench_config(runner: ModelRunner, bs: int, ctx: int, reps: int, clock: Callable[[], float]) -> dict[str, Any]:
    db = make_decode_batch(runner, bs, ctx)
    try:
        fb = runner.make_forward_batch(db.batch)
        layers = attention_layers(runner.model)
        l0 = layers[0]
        gen = torch.Generator().manual_seed(bs * 7 + ctx)
        dtype = runner.token_to_kv_pool.dtype
        q = torch.randn(bs, l0.num_heads * l0.head_dim, generator=gen).to(dtype)
        k = torch.randn(bs, l0.num_kv_heads * l0.head_dim, generator=gen).to(dtype)
        v = torch.randn(bs, l0.num_kv_heads * l0.v_head_dim, generator=gen).to(dtype)
        backends = {"cpu_paged": CpuPagedAttnBackend(runner), "torch_native": TorchNativeAttnBackend(runner)}

        def attn(backend) -> Callable[[], None]:
            def run() -> None:
                with torch.inference_mode():
                    backend.init_forward_metadata(fb)
                    for layer in layers:
                        backend.forward(q, k, v, layer, fb)
            return run

        attn_ms = interleaved_medians({n: attn(b) for n, b in backends.items()}, reps, clock)
        attn_ms = {n: ms / len(layers) for n, ms in attn_ms.items()}

        def step(backend, small_op_kernels: bool) -> Callable[[], None]:
            def run() -> None:
                runner.attn_backend = backend
                if small_op_kernels:
                    runner.forward(db.batch)
                else:
                    with mock.patch.object(cpu_kernels, "use_cpu_kernels", lambda *t: False):
                        runner.forward(db.batch)
            return run

        step_ms = interleaved_medians({"baseline": step(backends["torch_native"], False),
                                       "torch_native+kernels": step(backends["torch_native"], True),
                                       "cpu_paged": step(backends["cpu_paged"], True)}, reps, clock)
    finally:
        release_decode_batch(runner, db)
    return {"batch_size": bs, "context": ctx, "attention_ms_per_layer": attn_ms, "decode_step_ms": step_ms,
            "attention_speedup": attn_ms["torch_native"] / attn_ms["cpu_paged"],
            "step_speedup_vs_baseline": step_ms["baseline"] / step_ms["cpu_paged"]}


def setup(args: argparse.Namespace) -> tuple[ModelRunner, dict[str, Any], Callable[[], float]]:
    """The default model on `cpu_paged` with a pool for the largest batch x context (filled with
    random K/V), torch on `--threads`; the JSON record's header (lscpu, CPU, threads, model);
    the clock `--clock` names. Shared with bench_fused_kv_store_ab.py."""
    tokens = max(args.batch_sizes) * max(args.contexts) + 64
    server_args, _ = make_server_args(model_path=args.model_path, device="cpu", dtype=args.dtype,
                                      attention_backend="cpu_paged", max_total_tokens=tokens,
                                      max_running_requests=max(args.batch_sizes), page_size=1)
    runner = ModelRunner(server_args)
    torch.set_num_threads(args.threads or usable_cpu_count())  # after ModelRunner, which sets its own
    fill_kv_pool(runner)
    record = base_record(torch.device("cpu"), args)
    record.update(lscpu=lscpu(), cpu=detect_cpu().describe(), torch_threads=torch.get_num_threads(),
                  model=server_args.model_path, dtype=server_args.dtype, results=[])
    return runner, record, time.perf_counter if args.clock == "wall" else time.process_time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=None, help="default: the installed SmolLM2-135M GGUF")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=None,
                   help="torch/OpenMP threads (default: hardware.usable_cpu_count(), as the server uses); "
                        "1 on an oversubscribed machine, where a descheduled thread stalls every OpenMP barrier")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall: perf_counter; cpu: this process's CPU time (time.process_time), which "
                        "leaves out time spent descheduled on a machine shared with other jobs; use with --threads 1")
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parents[1] / "results"))
    p.add_argument("--name", default="cpu_attention")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads or usable_cpu_count())
    if not cpu_kernels.can_use_cpu_kernels():
        print("the CPU kernels cannot be built here: nothing to compare", file=sys.stderr)
        return 1
    runner, record, clock = setup(args)
    for bs in args.batch_sizes:
        for ctx in args.contexts:
            r = bench_config(runner, bs, ctx, args.reps, clock)
            print(f"bs {bs:3d} ctx {ctx:5d} | attention/layer ms: torch_native {r['attention_ms_per_layer']['torch_native']:7.3f}"
                  f" cpu_paged {r['attention_ms_per_layer']['cpu_paged']:7.3f} (x{r['attention_speedup']:.2f})"
                  f" | step ms: baseline {r['decode_step_ms']['baseline']:7.2f}"
                  f" torch_native+kernels {r['decode_step_ms']['torch_native+kernels']:7.2f}"
                  f" cpu_paged {r['decode_step_ms']['cpu_paged']:7.2f} (x{r['step_speedup_vs_baseline']:.2f})",
                  flush=True)
            record["results"].append(r)
            record["load_average"] = os.getloadavg()
            write_record(record, args.out_dir, args.name)  # after every row: a cut-short run keeps its rows
    return 0


if __name__ == "__main__":
    sys.exit(main())
