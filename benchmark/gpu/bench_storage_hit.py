"""A storage hit on the GPU (issue 11, 9(c)): L3 -> host -> device for an 8K-token prefix of
a Llama-3-8B-shaped model (dummy weights, bf16, page 64), in one process and one call.

1. TTFT (in process: the scheduler's own steps, no HTTP; max_new_tokens 1) per repetition,
   each with a fresh random prefix of --prefix-len tokens plus --new-tokens new ones:
     recompute    empty device, host and storage: the whole prompt is prefilled
     storage hit  after the recompute run wrote the prefix through to storage
                  (`write_through`: device -> host -> `file` backend) and every tier but
                  storage was flushed: the prefix comes L3 -> host (prefetch at queue entry,
                  `wait_complete`) -> device (layer-wise load-back); only the new tokens
                  are computed
     host hit     the same prompt again after its device copy was evicted (host -> device)
     device hit   the same prompt again (nothing moves)
   Each case is checked: the storage hit read the whole page-aligned prefix from storage,
   the host hit loaded it back from the host, the device hit moved nothing. The storage
   files were just written, so the OS page cache serves them: this is L3 from RAM, the best
   case for a local disk (a cold read would add the disk's time).
2. Each hop alone on the same pools and backend, as a ratio to a copy of the same bytes
   measured in the same run (ratio = copy time / hop time; 1.0 = as fast as the copy):
     L3 -> host   one `backend.batch_get_into` of all the prefix's pages into free host
                  pages (a prefetch reads in calls of 16 pages, `DEFAULT_BATCH_PAGES`);
                  copy: one `Tensor.copy_` of the same bytes between two host buffers with
                  as many threads as the backend reads with (`file_io_threads`). A file
                  just written is served from the OS page cache: this is the backend's
                  cost above RAM.
     host -> device  the controller's layer-wise load-back (`load` + `start_loading`) of
                  those host pages into free device slots, CUDA events on its stream;
                  copy: one contiguous pinned host -> device copy of the same bytes.
Bytes are payload (every layer, K and V); GB/s are 10**9 bytes per second; medians of --reps.

    python benchmark/gpu/bench_storage_hit.py                      # H200: about 2 minutes
    python benchmark/gpu/bench_storage_hit.py --tiny --device cpu  # harness check (figures mean nothing)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import base_record, make_server_args, write_record  # noqa: E402

from hiserve.engine.io_struct import TokenizedGenerateReqInput  # noqa: E402
from hiserve.engine.sampling_params import SamplingParams  # noqa: E402
from hiserve.engine.scheduler import Scheduler  # noqa: E402
from hiserve.mem_cache.storage.keys import page_keys  # noqa: E402
from hiserve.testing.dummy_model import write_dummy_model  # noqa: E402


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--prefix-len", type=int, default=8064, help="8K context: 126 pages of 64 + 64 new tokens")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="tiny-llama, 512-token prefix (harness check)")
    p.add_argument("--storage-dir", default=None, help="file backend directory (default: a temp dir)")
    p.add_argument("--io-threads", type=int, default=None, help="file_io_threads (default: the backend's)")
    p.add_argument("--out-dir", default="benchmark/results")
    p.add_argument("--name", default=None)
    args = p.parse_args(argv)
    if args.io_threads is not None and args.io_threads < 1:
        p.error("--io-threads must be at least 1")
    if args.tiny:
        args.shape, args.prefix_len, args.new_tokens, args.page_size, args.dtype = "tiny-llama", 512, 16, 16, "float32"
    machine = "h200" if args.device == "cuda" else "cpu"
    args.name = args.name or f"{machine}_storage_hit" + ("_tiny" if args.tiny else "")
    return args


def build_scheduler(args: argparse.Namespace, model_dir: str, storage_dir: str) -> tuple[Scheduler, list[str]]:
    prompt = args.prefix_len + args.new_tokens
    pool = 3 * (prompt + 2 * args.page_size)
    fields = dict(model_path=model_dir, load_format="dummy", dtype=args.dtype, device=args.device,
                  page_size=args.page_size, random_seed=1, max_total_tokens=pool, max_running_requests=8,
                  chunked_prefill_size=-1, max_prefill_tokens=prompt + args.page_size,
                  enable_hierarchical_cache=True, hicache_ratio=3.0,
                  hicache_write_policy="write_through", hicache_storage_backend="file",
                  hicache_storage_prefetch_policy="wait_complete",
                  hicache_storage_backend_extra_config=json.dumps(
                      {"file_storage_path": storage_dir,
                       **({"file_io_threads": args.io_threads} if args.io_threads else {})}))
    server_args, missing = make_server_args(**fields)
    return Scheduler(server_args, None), missing


def sync(sched: Scheduler) -> None:
    if sched.device.type == "cuda":
        torch.cuda.synchronize()


def run_prompt(sched: Scheduler, ids: list[int]) -> float:
    """Milliseconds from submitting `ids` (max_new_tokens 1) to its token on the host."""
    sp = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    sched.add_request(TokenizedGenerateReqInput(rid=f"r{random.random()}", input_ids=ids, sampling_params=sp))
    while sched.has_work():
        sched.step()
    sync(sched)
    ms = (time.perf_counter() - t0) * 1e3
    sched.outbox.clear()
    return ms


def settle_storage(sched: Scheduler, want_tokens: int, timeout_s: float = 120.0) -> None:
    """Step until the storage tier holds `want_tokens` more backed-up tokens (write-through
    after the host ack) and nothing is in flight."""
    cache = sched.kv.prefix_cache
    deadline = time.monotonic() + timeout_s
    while cache.storage_stats.backuped_tokens_total < want_tokens or sched.kv.h.storage.in_flight():
        if time.monotonic() > deadline:
            raise RuntimeError(f"storage write-through did not finish: {cache.storage_stats.backuped_tokens_total} "
                               f"of {want_tokens} tokens")
        sched.check_cache_events()
        time.sleep(0.002)


def ttft_round(sched: Scheduler, rng: random.Random, args: argparse.Namespace, vocab: int) -> dict[str, float]:
    """One repetition of the four TTFT cases, each checked to have moved the KV it should."""
    cache = sched.kv.prefix_cache
    prefix = [rng.randrange(10, vocab) for _ in range(args.prefix_len)]
    new = lambda: [rng.randrange(10, vocab) for _ in range(args.new_tokens)]  # noqa: E731
    aligned = args.prefix_len // args.page_size * args.page_size
    row = {"recompute": run_prompt(sched, prefix + new())}
    settle_storage(sched, cache.storage_stats.backuped_tokens_total + aligned)
    assert sched.flush_cache(), "flush refused: requests still hold KV"

    def moved() -> tuple[int, int]:  # (tokens read from storage, tokens loaded back from the host)
        return cache.storage_stats.prefetched_tokens_total, sched.kv.stats().loaded_back_tokens_total
    before = moved()
    row["storage_hit"] = run_prompt(sched, prefix + new())
    got = moved()[0] - before[0]
    if got != aligned:
        raise RuntimeError(f"the storage hit read {got} tokens from storage, expected {aligned}")
    before = moved()
    row["device_hit"] = run_prompt(sched, prefix + new())
    if moved() != before:
        raise RuntimeError("the device hit read from storage or loaded back from the host")
    sched.kv.evict(sched.kv.stats().evictable)  # device copy out; the host copy stays
    before = moved()
    row["host_hit"] = run_prompt(sched, prefix + new())
    if moved()[1] - before[1] < aligned or moved()[0] != before[0]:
        raise RuntimeError(f"the host hit loaded back {moved()[1] - before[1]} tokens, expected {aligned}")
    sched.kv.check_integrity()
    assert sched.flush_cache()
    return row


def time_ms(fn: Callable[[], None], device: torch.device, stream: Any = None) -> float:
    """Milliseconds of `fn` (CUDA: events on `stream`, or the current stream)."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    s = stream or torch.cuda.current_stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(s)
    fn()
    end.record(s)
    end.synchronize()
    return start.elapsed_time(end)


def hops(sched: Scheduler, rng: random.Random, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """Each hop of a storage hit alone, against a plain copy of the same bytes."""
    cache, h = sched.kv.prefix_cache, sched.kv.h
    P, n = args.page_size, args.prefix_len // args.page_size
    ids = [rng.randrange(10, vocab) for _ in range(args.prefix_len + args.new_tokens)]
    run_prompt(sched, ids)
    settle_storage(sched, cache.storage_stats.backuped_tokens_total + n * P)
    assert sched.flush_cache()
    keys = page_keys(ids[:n * P], P, cache.storage_namespace)
    nbytes = n * cache._page_bytes_all_kinds()
    host_slots = h.host_pool.alloc(n * P)
    dev_slots = h.allocator.alloc(n * P)
    assert host_slots is not None and dev_slots is not None, "pools too small for the hop measurement"
    try:
        rows = _time_hops(sched, keys, host_slots, dev_slots, nbytes, args.reps)
    finally:
        h.host_pool.free(host_slots)
        h.allocator.free(dev_slots)
    sched.kv.check_integrity()
    med = {k: statistics.median(v[1:]) for k, v in rows.items()}
    gb = lambda ms: nbytes / ms / 1e6  # noqa: E731  (GB/s from bytes and ms)
    return {"pages": n, "bytes": nbytes, "read_threads": getattr(h.storage.backend, "io_threads", 1),
            "samples_ms": rows, "median_ms": med,
            "l3_to_host_GBps": gb(med["l3_to_host"]), "host_memcpy_GBps": gb(med["host_memcpy"]),
            "l3_to_host_ratio": med["host_memcpy"] / med["l3_to_host"],
            "host_to_device_GBps": gb(med["host_to_device"]), "h2d_copy_GBps": gb(med["h2d_copy"]),
            "host_to_device_ratio": med["h2d_copy"] / med["host_to_device"]}


def _time_hops(sched: Scheduler, keys: list[str], host_slots: torch.Tensor, dev_slots: torch.Tensor,
               nbytes: int, reps: int) -> dict[str, list[float]]:
    """ms of each hop and its reference copy, `reps` + 1 times (the first warms up)."""
    h, P = sched.kv.h, sched.kv.h.host_pool.page_size
    n = len(keys)
    host_pages = (host_slots[::P] // P).tolist()
    device = sched.device
    rows: dict[str, list[float]] = {"l3_to_host": [], "host_memcpy": [], "host_to_device": [], "h2d_copy": []}
    src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    src.random_(0, 255)
    dst.fill_(1)
    pinned = src.pin_memory() if device.type == "cuda" else src
    gpu_buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    threads = torch.get_num_threads()
    readers = getattr(h.storage.backend, "io_threads", 1)  # the copy gets as many threads as the reads
    for _ in range(reps + 1):
        got = [0]

        def l3_read() -> None:
            got[0] = h.storage.backend.batch_get_into(keys, host_pages)
        rows["l3_to_host"].append(time_ms(l3_read, torch.device("cpu")))
        assert got[0] == n, f"batch_get_into delivered {got[0]} of {n} pages"
        torch.set_num_threads(readers)
        rows["host_memcpy"].append(time_ms(lambda: dst.copy_(src), torch.device("cpu")))
        torch.set_num_threads(threads)
        ctrl = h.controller

        def load_back() -> None:
            ctrl.load(host_slots, dev_slots, node_id=-1)
            ctrl.start_loading()
        rows["host_to_device"].append(time_ms(load_back, device, ctrl.load_stream))
        ctrl.synchronize()
        ctrl.poll_load_acks()
        rows["h2d_copy"].append(time_ms(lambda: gpu_buf.copy_(pinned, non_blocking=True), device))
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    rng = random.Random(7)
    record: dict[str, Any] = base_record(torch.device(args.device), args)
    with tempfile.TemporaryDirectory(prefix="hiserve_bench_storage_hit_") as folder:
        storage_dir = args.storage_dir or str(Path(folder) / "l3")
        sched, missing = build_scheduler(args, write_dummy_model(folder, args.shape), storage_dir)
        sched.kv.h.storage.backend.clear()  # a reused --storage-dir would turn "recompute" into a hit
        vocab = sched.model_runner.vocab_size
        run_prompt(sched, [rng.randrange(10, vocab) for _ in range(args.new_tokens)])  # warm-up
        rounds = [ttft_round(sched, rng, args, vocab) for _ in range(args.reps + 1)][1:]
        ttft = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        record.update(server_args_missing=missing, storage_dir=storage_dir, ttft_samples_ms=rounds,
                      ttft_median_ms=ttft, storage_hit_over_recompute=ttft["storage_hit"] / ttft["recompute"],
                      hops=hops(sched, rng, args, vocab))
        sched.kv.h.close()
    hp = record["hops"]
    print(f"{args.shape}, prefix {args.prefix_len} tokens + {args.new_tokens} new, page {args.page_size}, "
          f"{hp['bytes'] / 1e9:.2f} GB of KV")
    print("TTFT median ms: " + ", ".join(f"{k} {v:.1f}" for k, v in ttft.items())
          + f"; storage hit / recompute {record['storage_hit_over_recompute']:.3f}")
    print(f"{'hop':<16}{'GB/s':>9}{'copy GB/s':>11}{'ratio':>8}")
    print(f"{'L3 -> host':<16}{hp['l3_to_host_GBps']:>9.2f}{hp['host_memcpy_GBps']:>11.2f}"
          f"{hp['l3_to_host_ratio']:>8.3f}")
    print(f"{'host -> device':<16}{hp['host_to_device_GBps']:>9.2f}{hp['h2d_copy_GBps']:>11.2f}"
          f"{hp['host_to_device_ratio']:>8.3f}")
    write_record(record, args.out_dir, args.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
