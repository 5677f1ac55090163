"""Decode step time while device eviction writes pages back to the host (`write_back`).

The scheduler in-process (dummy weights, `--hicache-write-policy write_back`): first a set
of filler prefixes is prefilled and left in the radix tree, unlocked and not backed up;
then `batch_size` requests of `context_len` tokens decode. Idle phase: decode steps with
nothing else going on. Evicting phase: before each decode step the KV manager evicts one
filler prefix, which under `write_back` starts its all-layer write to the host on the write
stream; its device pages wait on the pending list for the write's ack, so the decode does
not wait for the write (before this design the compute stream waited for every write in
flight). Only steps that started while a write was still running count as busy. Each busy
step is paired with an idle step taken just before its eviction (after the previous write
finished), and the ratio is against those: the step time drifts slowly over a run (5.75 to
5.55 ms across 40 idle steps on the H200), which a separate idle phase would fold in.

Target: busy / idle decode forward <= 1.03.

    python benchmark/gpu/bench_decode_during_eviction.py                 # H200, dummy Llama-3-8B
    python benchmark/gpu/bench_decode_during_eviction.py --device cpu --tiny   # harness check
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from common import base_record, make_server_args, write_record

from hiserve.engine.io_struct import TokenizedGenerateReqInput
from hiserve.engine.sampling_params import SamplingParams
from hiserve.engine.scheduler import Scheduler
from hiserve.testing.dummy_model import write_dummy_model

TARGET_RATIO = 1.03


def run_until_running(sched: Scheduler, n: int) -> None:
    """Step until `n` requests decode and nothing waits."""
    while sched.waiting_queue or sched.chunked_req or len(sched.running) < n:
        sched.step()


def timed_decode_step(sched: Scheduler, write_ack: Any) -> tuple[float, float, float, bool]:
    """One decode step; returns (forward ms, whole-step ms (forward + sampling + result
    processing), wall ms, whether the write `write_ack` was still running when the step
    started). GPU times are CUDA events on the compute stream; wall clock on the CPU."""
    batch = sched.prepare_decode()
    cuda = sched.device.type == "cuda"
    busy = write_ack is not None and not write_ack.done()
    t0 = time.perf_counter()
    if cuda:
        start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        start.record()
    logits = sched.model_runner.forward(batch)
    if cuda:
        mid.record()
    t_mid = time.perf_counter()
    sched.process_decode_result(batch, logits)
    if cuda:
        end.record()
        end.synchronize()
    wall = (time.perf_counter() - t0) * 1e3
    sched.check_cache_events()
    if cuda:
        return start.elapsed_time(mid), start.elapsed_time(end), wall, busy
    return (t_mid - t0) * 1e3, wall, wall, busy


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--context-len", type=int, default=1024)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--filler-len", type=int, default=4096, help="tokens per evicted prefix")
    p.add_argument("--fillers", type=int, default=12)
    p.add_argument("--steps", type=int, default=40, help="decode steps per phase")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="tiny-llama, small sizes (harness check)")
    p.add_argument("--out-dir", default="benchmark/results")
    p.add_argument("--name", default=None)
    args = p.parse_args(argv)
    if args.tiny:
        args.shape, args.batch_size, args.context_len, args.page_size = "tiny-llama", 4, 64, 16
        args.filler_len, args.fillers, args.steps = 256, 6, 5
    args.name = args.name or f"{'h200' if args.device == 'cuda' else 'cpu'}_decode_during_eviction" + (
        "_tiny" if args.tiny else "")
    return args


def build(args: argparse.Namespace, folder: str) -> tuple[Scheduler, list[str]]:
    """The scheduler with the fillers cached (unlocked, not backed up) and the batch decoding."""
    decode_tokens = args.batch_size * (args.context_len + 3 * args.steps + 2 * args.page_size)
    fields = dict(model_path=write_dummy_model(folder, args.shape), load_format="dummy", dtype=args.dtype,
                  device=args.device, page_size=args.page_size, random_seed=1,
                  max_total_tokens=decode_tokens + args.fillers * args.filler_len + 4 * args.page_size,
                  max_running_requests=max(args.batch_size, 8), chunked_prefill_size=-1,
                  max_prefill_tokens=max(args.filler_len, args.context_len) * 2,
                  enable_hierarchical_cache=True, hicache_write_policy="write_back", hicache_ratio=2.0,
                  # Steps are driven one call at a time below (prepare, forward, process), which
                  # is the synchronous loop's API; the overlap worker thread would race them.
                  disable_overlap_schedule=True)
    server_args, missing = make_server_args(**fields)
    sched = Scheduler(server_args, None)
    vocab = sched.model_runner.vocab_size
    gen = torch.Generator().manual_seed(0)
    fill_sp = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
    for i in range(args.fillers):
        ids = torch.randint(10, vocab, (args.filler_len,), generator=gen).tolist()
        sched.add_request(TokenizedGenerateReqInput(rid=f"f{i}", input_ids=ids, sampling_params=fill_sp))
    run_until_running(sched, 0)
    sp = SamplingParams(max_new_tokens=1 << 20, temperature=0, ignore_eos=True)
    for i in range(args.batch_size):
        ids = torch.randint(10, vocab, (args.context_len,), generator=gen).tolist()
        sched.add_request(TokenizedGenerateReqInput(rid=f"d{i}", input_ids=ids, sampling_params=sp))
    run_until_running(sched, args.batch_size)
    return sched, missing


def measure(sched: Scheduler, args: argparse.Namespace) -> tuple[list, list, list]:
    """(idle steps, steps right after an eviction, the idle step taken just before each of
    those: pairs immune to the slow drift of the step time over a run)."""
    for _ in range(3):  # warm-up (CUDA graphs, allocator)
        timed_decode_step(sched, None)
    idle = [timed_decode_step(sched, None) for _ in range(args.steps)]
    controller = sched.kv.h.controller
    busy, paired = [], []
    for _ in range(args.steps):
        controller.synchronize()  # the previous eviction's write is done: the next step is idle
        sched.check_cache_events()
        paired.append(timed_decode_step(sched, None))
        before = len(controller.ack_write_queue)
        sched.kv.evict(args.filler_len)
        ack = controller.ack_write_queue[-1] if len(controller.ack_write_queue) > before else None
        busy.append(timed_decode_step(sched, ack))
        if sched.kv.prefix_cache.evictable_size() < args.filler_len:
            break
    controller.synchronize()
    sched.check_cache_events()
    sched.kv.check_integrity()
    return idle, busy, paired


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    record: dict[str, Any] = base_record(torch.device(args.device), args)
    with tempfile.TemporaryDirectory(prefix="hiserve_bench_evict_") as folder:
        sched, missing = build(args, folder)
        idle, busy, paired = measure(sched, args)
    med = statistics.median
    keep = [i for i, x in enumerate(busy) if x[3]]  # steps that started while the write ran
    busy_steps, pair_idle = [busy[i] for i in keep], [paired[i] for i in keep]
    nan = float("nan")
    fwd_idle, step_idle = med(x[0] for x in idle), med(x[1] for x in idle)
    fwd_busy = med(x[0] for x in busy_steps) if busy_steps else nan
    step_busy = med(x[1] for x in busy_steps) if busy_steps else nan
    fwd_pair = med(x[0] for x in pair_idle) if pair_idle else nan
    ratio = fwd_busy / fwd_pair  # against the idle step just before each eviction
    record.update(server_args_missing=missing, idle_forward_ms=fwd_idle, busy_forward_ms=fwd_busy,
                  paired_idle_forward_ms=fwd_pair, idle_step_ms=step_idle, busy_step_ms=step_busy,
                  busy_steps=len(busy_steps), evicting_steps=len(busy), forward_ratio=ratio,
                  forward_ratio_vs_idle_phase=fwd_busy / fwd_idle, step_ratio=step_busy / step_idle,
                  idle_wall_ms=med(x[2] for x in idle), evicting_wall_ms=med(x[2] for x in busy),
                  filler_bytes=args.filler_len * sched.model_runner._cell_size_bytes(),
                  target=TARGET_RATIO, met=bool(ratio <= TARGET_RATIO),
                  samples={"idle": idle, "evicting": busy, "paired_idle": paired})
    print(f"decode forward with an eviction write-back of {record['filler_bytes'] / 1e9:.2f} GB just issued "
          f"{fwd_busy:.3f} ms over {len(busy_steps)} steps, the idle step just before each {fwd_pair:.3f} ms: "
          f"ratio {ratio:.3f} (target <= {TARGET_RATIO}: {'met' if record['met'] else 'NOT met'}; against the "
          f"idle phase {fwd_idle:.3f} ms: {record['forward_ratio_vs_idle_phase']:.3f}); whole step (forward + "
          f"sampling + results) idle {step_idle:.3f} ms, busy {step_busy:.3f} ms, ratio {record['step_ratio']:.3f}")
    write_record(record, args.out_dir, args.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
