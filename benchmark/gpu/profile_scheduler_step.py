"""Where a decode step's host time goes, in process (no HTTP): the scheduler loop's phases with
overlap scheduling on and off (issue 12, item 4).

A Scheduler on a dummy model (`--load-format dummy`; Llama-3-8B bf16 on CUDA) gets
`--concurrency` requests of `--input-len` random tokens that decode `--output-len` tokens
(ignore_eos). Once every request is decoding, `--steps` iterations are timed: the wall time of
each `Scheduler.step()` and, inside it, each phase (time.perf_counter around the methods):

    synchronous  prep (get_next_batch_to_run) · forward (launch; a graph replay returns at once)
                 · sample (plan + device sampling + the blocking read-back: waits for the GPU)
                 · process (tokens into requests, stop checks, outputs) · poll (KV acks)
    overlap      prep · launch (sampling plan, hand-off) · wait (blocked on the previous batch's
                 result) · process · poll; and, on the worker thread, forward and sample (launch)

With overlap, host work hides behind the GPU when `wait` is large and the step time equals the
model step; what is left outside `wait` is the per-step host time on the critical path.

    python benchmark/gpu/profile_scheduler_step.py                     # H200: about 2 minutes
    python benchmark/gpu/profile_scheduler_step.py --tiny --device cpu # harness check (figures mean nothing)

Writes <out-dir>/<name>.json; `--trace DIR` also writes a torch.profiler trace of 5 steps per mode.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Optional

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

SYNC_PHASES = {"prep": "get_next_batch_to_run", "process": ("process_prefill_tokens", "process_decode_tokens"),
               "poll": "check_cache_events"}
OVERLAP_PHASES = {"launch": "_launch"}


class PhaseTimer:
    """Accumulates seconds per phase label for the current step; `end_step` files them."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []

    def wrap(self, obj: Any, attr: str, label: str) -> None:
        fn = getattr(obj, attr)

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.current[label] += time.perf_counter() - t0

        setattr(obj, attr, timed)

    def end_step(self, wall_s: float, keep: bool) -> None:
        if keep:
            self.steps.append({"step": wall_s, **self.current})
        self.current = defaultdict(float)


def medians_ms(steps: list[dict[str, float]]) -> dict[str, float]:
    """Median milliseconds of each phase over the timed steps (a missing phase counts 0)."""
    labels = sorted({k for s in steps for k in s})
    return {k: 1000.0 * statistics.median(s.get(k, 0.0) for s in steps) for k in labels}


def instrument(sched: Any, overlap: bool, timer: PhaseTimer) -> Callable[[], None]:
    """Wrap the phases; returns the undo of the one class-level patch (ForwardResult.wait)."""
    for label, attrs in SYNC_PHASES.items():
        for attr in (attrs if isinstance(attrs, tuple) else (attrs,)):
            timer.wrap(sched, attr, label)
    runner = sched.model_runner
    if overlap:
        timer.wrap(sched, "_launch", "launch")
        from hiserve.engine import tp_worker_overlap

        wait = tp_worker_overlap.ForwardResult.wait

        def timed_wait(self: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return wait(self)
            finally:
                timer.current["wait"] += time.perf_counter() - t0

        tp_worker_overlap.ForwardResult.wait = timed_wait
        # The worker thread's own launches (they overlap the scheduler's work; filed with
        # whichever step is current when they end).
        timer.wrap(runner, "forward", "worker_forward")
        timer.wrap(runner, "sample_on_device", "worker_sample")

        def undo() -> None:
            tp_worker_overlap.ForwardResult.wait = wait
        return undo
    timer.wrap(runner, "forward", "forward")
    timer.wrap(runner, "sample", "sample")
    return lambda: None


def profile_mode(args: argparse.Namespace, model_path: str, overlap: bool) -> dict[str, Any]:
    import torch

    from hiserve.engine.io_struct import TokenizedGenerateReqInput
    from hiserve.engine.sampling_params import SamplingParams
    from hiserve.engine.scheduler import Scheduler
    from hiserve.server_args import ServerArgs

    extra = {"enable_overlap_schedule": True} if overlap and args.device == "cpu" else {
        "disable_overlap_schedule": not overlap}
    context = args.input_len + args.output_len + 64
    rows = max(args.concurrency, 8)
    # A pool sized to the workload, not to free memory: both modes' schedulers live in this
    # process (the overlap worker thread keeps its model runner), so the second must fit too.
    sargs = ServerArgs(model_path=model_path, load_format="dummy", dtype=args.dtype, device=args.device,
                       max_running_requests=rows, random_seed=1, context_length=context,
                       max_total_tokens=rows * context + 1024, **extra).resolve()
    sched = Scheduler(sargs, None)
    gen = torch.Generator().manual_seed(1)
    vocab = sched.model_runner.vocab_size
    for i in range(args.concurrency):
        ids = torch.randint(10, vocab - 1, (args.input_len,), generator=gen).tolist()
        sp = SamplingParams(max_new_tokens=args.output_len, temperature=0, ignore_eos=True)
        sched.add_request(TokenizedGenerateReqInput(rid=f"p{i}", input_ids=ids, sampling_params=sp))
    timer = PhaseTimer()
    undo = instrument(sched, overlap, timer)
    try:
        _run_steps(args, sched, overlap, timer)
    finally:
        undo()
    if not timer.steps:
        raise RuntimeError("no steady decode steps were timed (raise --output-len)")
    result = {"overlap": overlap, "steps_timed": len(timer.steps), "median_ms": medians_ms(timer.steps),
              "num_overlapped_batches": sched.num_overlapped_batches}
    del sched
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return result


def _run_steps(args: argparse.Namespace, sched: Any, overlap: bool, timer: PhaseTimer) -> None:
    """Step until `--warmup` + `--steps` steady decode steps (all requests running) have run."""
    trace_steps = 5 if args.trace else 0
    timed = 0
    while sched.has_work() and timed < args.steps + args.warmup + trace_steps:
        steady = not sched.waiting_queue and sched.chunked_req is None and len(sched.running) == args.concurrency
        t0 = time.perf_counter()
        sched.step()
        keep = steady and args.warmup <= timed < args.warmup + args.steps
        timer.end_step(time.perf_counter() - t0, keep)
        sched.outbox.clear()
        timed += steady
        if steady and timed == args.warmup + args.steps and trace_steps:
            _trace(args, sched, overlap, trace_steps)
            break


def _trace(args: argparse.Namespace, sched: Any, overlap: bool, steps: int) -> None:
    import torch

    acts = [torch.profiler.ProfilerActivity.CPU]
    if args.device == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            sched.step()
    out = Path(args.trace) / f"{args.name}_{'overlap' if overlap else 'sync'}.trace.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(out))
    print(f"wrote {out}")


def format_table(results: list[dict[str, Any]]) -> str:
    labels = sorted({k for r in results for k in r["median_ms"]}, key=lambda k: (k != "step", k))
    lines = [f"{'phase (median ms)':<18}" + "".join(f"{('overlap' if r['overlap'] else 'sync'):>10}" for r in results)]
    for k in labels:
        lines.append(f"{k:<18}" + "".join(f"{r['median_ms'].get(k, 0.0):>10.3f}" for r in results))
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="tiny-llama, short prompts (harness check)")
    p.add_argument("--trace", default=None, help="directory for torch.profiler traces")
    p.add_argument("--out-dir", default="benchmark/results")
    p.add_argument("--name", default=None)
    args = p.parse_args(argv)
    if args.tiny:
        args.shape, args.input_len, args.output_len, args.steps, args.warmup = "tiny-llama", 32, 40, 20, 3
        args.dtype = "float32"
    args.name = args.name or ("cpu_scheduler_step_tiny" if args.device == "cpu" else "h200_scheduler_step")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    from hiserve.testing.dummy_model import write_dummy_model

    with tempfile.TemporaryDirectory(prefix="hiserve_profile_step_") as folder:
        model_path = write_dummy_model(folder, args.shape)
        results = [profile_mode(args, model_path, overlap) for overlap in (False, True)]
    print(format_table(results))
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import base_record  # benchmark/gpu, this script's folder

    record = {**base_record(torch.device(args.device), args), "results": results}
    path = Path(args.out_dir) / f"{args.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
