"""Where a decode step of `make serve` defaults goes, by operator, at a given batch size.

Builds the scheduler as the server does (`bench_scheduler_steps.Driver`), runs `--batch`
requests of `--prompt` tokens into steady decode, times `--steps` decode steps (wall clock), then
runs as many again under `torch.profiler` and prints its operator table (self CPU time, so a
oneDNN GEMM and the Python around it are told apart) plus the share of the step each operator
takes, then as many again under `cProfile`: hiserve's own C++ kernels (attention, AMX and block
GEMMs, norms) are called through tvm-ffi, not as torch operators, so only the Python profile
sees them (by the wrapper in `hiserve/jit_kernel/cpu.py` that calls each, or, in the CPU decode
loop, as the tvm-ffi functions themselves). Run it on a quiet
machine: under CPU contention an OpenMP team's barriers stretch every parallel operator.

    PYTHONPATH=$PWD python benchmark/cpu/profile_decode_step.py --batch 16 [--out x.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scheduler_steps import Driver, _cpu_model, shared_prefix  # noqa: E402


def steady_decode(d: Driver, batch: int, prompt: int, out: int) -> None:
    """Submit `batch` requests and step until all of them decode (prefills done)."""
    for i in range(batch):
        d.submit([1000 + (i * 7 + j) % 20000 for j in range(prompt)], out)
    s = d.sched
    while len(s.running) < batch or s.waiting_queue or s.chunked_req:
        d.step()


def profile_steps(d: Driver, steps: int, rows: int) -> tuple[str, list[dict], float]:
    """(printed table, top operators as dicts, profiled total ms) over `steps` decode steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            d.step()
    avg = prof.key_averages()
    total_us = sum(e.self_cpu_time_total for e in avg)
    top = sorted(avg, key=lambda e: e.self_cpu_time_total, reverse=True)[:rows]
    ops = [{"op": e.key, "calls_per_step": e.count / steps, "self_ms_per_step": e.self_cpu_time_total / steps / 1e3,
            "share": e.self_cpu_time_total / total_us} for e in top]
    return avg.table(sort_by="self_cpu_time_total", row_limit=rows), ops, total_us / steps / 1e3


# Kernel entry points: (module path, attribute). Each is called through its module attribute on
# the hot path (`cpu_kernels.gguf_gemm(...)`, `_INT4_MM(...)`, `self._dense_call(...)` inside
# `_dense_matmul`), so replacing the attribute times every call.
_KERNELS = [("hiserve.jit_kernel.cpu", name) for name in ("argmax", "gguf_gemm", "gguf_amx_gemm")]
_KERNELS += [("hiserve.layers.quantization.gguf", "_INT4_MM"),
             ("hiserve.layers.quantization.gguf:GGUFInt4Linear", "_dense_matmul"),
             ("hiserve.layers.quantization.gguf:GGUFBlockLinear", "_dense_matmul")]
# These four the CPU decode loop (hiserve/models/cpu_decode_loop.py) calls on the C++ module
# itself, not through the wrappers: they are timed there (`_TimedModule`), for either path, so
# their figures leave out the wrappers' Python checks.
_RAW_KERNELS = ("paged_attention", "rmsnorm", "rotary", "silu_and_mul")


class _TimedModule:
    """The JIT CPU module with `_RAW_KERNELS` timed into `spent`."""

    def __init__(self, module: Any, spent: dict[str, list[float]]) -> None:
        self._module, self._spent = module, spent

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._module, name)
        if name not in _RAW_KERNELS:
            return fn
        return _timed(fn, self._spent.setdefault(f"{name} (C++)", [0.0, 0]))


def _timed(fn: Any, acc: list[float]) -> Any:
    """`fn`, adding each call's wall seconds to acc[0] and counting calls in acc[1]."""
    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[0] += time.perf_counter() - t
            acc[1] += 1
    return timed


def kernel_split(d: Driver, steps: int) -> tuple[list[dict], float]:
    """Wall ms a step inside each kernel entry point (for `_KERNELS` their wrappers' checks and
    output allocation included, for `_RAW_KERNELS` the C++ call alone) over `steps` decode
    steps, and the step's median wall ms meanwhile; the rest of the step is Python and dispatch
    around the kernels."""
    import importlib

    from hiserve.jit_kernel import cpu as cpu_kernels

    spent: dict[str, list[float]] = {}
    load = cpu_kernels.load_cpu_module
    saved = [(cpu_kernels, "load_cpu_module", load)]
    cpu_kernels.load_cpu_module = lambda isa=None: _TimedModule(load(isa), spent)
    for path, name in _KERNELS:
        mod, _, cls = path.partition(":")
        owner = getattr(importlib.import_module(mod), cls) if cls else importlib.import_module(mod)
        fn = getattr(owner, name, None)
        if fn is None:
            continue
        saved.append((owner, name, fn))
        acc = spent.setdefault(name if name != "_dense_matmul" else f"{cls}._dense_matmul", [0.0, 0])
        setattr(owner, name, _timed(fn, acc))
    try:
        wall = [d.step()[1] for _ in range(steps)]
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
    rows = [{"kernel": k, "calls_per_step": n / steps, "ms_per_step": t / steps * 1e3}
            for k, (t, n) in spent.items() if n]
    return sorted(rows, key=lambda r: -r["ms_per_step"]), statistics.median(wall)


def python_profile(d: Driver, steps: int, rows: int) -> list[dict]:
    """cProfile's functions by own time over `steps` decode steps (ms a step)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        d.step()
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, prim calls, own s, cum s, callers)
    top = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:rows]
    return [{"function": f"{Path(f).name}:{ln}({name})", "calls_per_step": v[0] / steps,
             "own_ms_per_step": v[2] / steps * 1e3} for (f, ln, name), v in top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=300)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rows", type=int, default=25, help="operators shown")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    import torch

    d = Driver(time.perf_counter, dtype=args.dtype, quantization=args.quantization)
    shared_prefix(d, num=4)  # warm-up: kernels built, allocator primed
    steady_decode(d, args.batch, args.prompt, out=4 * args.steps + 8)
    wall = [d.step()[1] for _ in range(args.steps)]
    split, split_step_ms = kernel_split(d, args.steps)
    in_kernels = sum(r["ms_per_step"] for r in split)
    print(f"kernel split over {args.steps} steps (median step {split_step_ms:.2f} ms, mean inside kernels "
          f"{in_kernels:.2f} ms):")
    for r in split:
        print(f"  {r['kernel']:<34} {r['calls_per_step']:6.0f} calls {r['ms_per_step']:8.2f} ms")
    table, ops, prof_ms = profile_steps(d, args.steps, args.rows)
    print(table)
    step_ms = statistics.median(wall)
    print(f"decode step at batch {args.batch}: median {step_ms:.2f} ms wall (unprofiled); "
          f"profiled self CPU time {prof_ms:.2f} ms a step, all threads")
    for op in ops[:12]:
        print(f"  {op['op']:<40} {op['calls_per_step']:6.0f} calls {op['self_ms_per_step']:8.2f} ms "
              f"{100 * op['share']:5.1f} %")
    funcs = python_profile(d, args.steps, args.rows)
    print("Python profile (own time; C++ kernels under the wrapper that calls them):")
    for f in funcs[:15]:
        print(f"  {f['function']:<60} {f['calls_per_step']:6.0f} calls {f['own_ms_per_step']:8.2f} ms")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "benchmark": "cpu_profile_decode_step", "command": " ".join(sys.argv),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu": _cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "flags": {"dtype": d.sched.server_args.dtype, "quantization": d.sched.server_args.quantization},
            "batch": args.batch, "prompt": args.prompt, "step_ms_wall": wall, "step_ms_median": step_ms,
            "profiled_self_ms_per_step": prof_ms, "top_ops": ops, "python_profile": funcs,
            "kernel_split": {"step_ms_median": split_step_ms, "inside_kernels_ms_per_step": in_kernels,
                             "kernels": split}}, indent=1))


if __name__ == "__main__":
    main()
