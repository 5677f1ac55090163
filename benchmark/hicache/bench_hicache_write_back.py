"""Write-back (device -> host) and per-layer load-back (host -> device) throughput of the
hicache transfer paths, each as a ratio to the contiguous pinned copy of the same bytes
measured in the same run (ratio = limit time / path time).

Section 1, write-back of every layer of `pages` random device pages into a `page_first`
host buffer (host pages one contiguous run in order, or the same pages shuffled):
  * limit      contiguous pinned D2H copy of the same bytes (one cudaMemcpyAsync)
  * staged     the default staged path (host-page order, pipelined staging halves beyond one
               staging buffer, one cudaMemcpyBatchAsync per chunk); `per_page`: the same
               with one cudaMemcpyAsync per copy; `plain`: batched, one stream, pages in the
               given order (the un-optimised staged path)
  * per_token  SM kernel storing each token's rows into mapped host memory (block quota 8)
  * reference  torch index copies (the CPU / `direct` path), only up to --reference-max-bytes
Host enqueue time is the wall time of the call (it never waits for the device), reported
per 64 pages (one staging buffer). Each figure is the median of --reps timed runs after one
warm-up, CUDA events around a single call on an otherwise idle GPU, so a small operation
also pays its own enqueue latency.

Section 2, load-back of one layer from each host layout vs the contiguous pinned H2D copy
of the same bytes, for several block quotas of the per-layer kernel; and, at the default
quota, every layer back to back (as a whole-prefix load-back runs) vs one contiguous copy of
all of it.

Shapes: MHA Llama-3-8B (32 layers, 8 KV heads x 128, bf16: 2 KiB per token, layer and
kind, K and V) and MLA DeepSeek-V3 (61 layers, 576 bf16); page sizes 1, 16, 64; 64 ..
4096 pages. Trimmed to one ~1-minute run: operations above --max-bytes (2 GiB; e.g. 4096
pages of 64 tokens would be 32 GiB) are not run and reported as NaN.

Usage: python benchmark/hicache/bench_hicache_write_back.py [--out-dir benchmark/results]
Writes <out-dir>/h200_hicache_write_back.json (command, machine, date, every figure).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hiserve.jit_kernel import hicache, reference, utils  # noqa: E402

MODELS = {
    # name: (layers, item shape per kind, kinds)
    "llama3_8b_mha": (32, (8, 128), 2),
    "deepseek_v3_mla": (61, (1, 576), 1),
}
PAGE_SIZES = [1, 16, 64]
PAGE_COUNTS = [64, 256, 1024, 4096]
HOST_ORDERS = ["contiguous", "shuffled"]
STAGING_PAGES = 64
DTYPE = torch.bfloat16
NAN = float("nan")


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9 if ms and ms > 0 else NAN


def time_ms(fn, reps: int, warmup: int = 1, stream=None) -> tuple[float, list[float]]:
    """Median device time (ms) of `fn` over `reps` runs on `stream` (CUDA events), and the
    host wall time (ms) of each call (enqueue; the functions never wait for the device)."""
    stream = stream or torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
        stream.synchronize()
        times, walls = [], []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            t0 = time.perf_counter()
            fn()
            walls.append((time.perf_counter() - t0) * 1e3)
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end))
    return statistics.median(times), walls


class Arena:
    """One pinned host buffer and one device scratch buffer, reused by every configuration."""

    def __init__(self, max_bytes: int):
        self.host = torch.empty(max_bytes, dtype=torch.uint8, pin_memory=True)
        self.device = torch.empty(max_bytes, dtype=torch.uint8, device="cuda")
        self.device.random_()

    def host_kinds(self, kinds: int, shape: tuple, dtype=DTYPE) -> list[torch.Tensor]:
        n = math.prod(shape) * dtype.itemsize
        return [self.host[i * n:(i + 1) * n].view(dtype).view(shape) for i in range(kinds)]


def random_layers(num_layers: int, slots: int, item: tuple) -> list[torch.Tensor]:
    layers = []
    for _ in range(num_layers):
        t = torch.empty((slots, *item), dtype=DTYPE, device="cuda")
        t.view(torch.int16).random_(-30000, 30000)
        layers.append(t)
    return layers


def write_back_section(args, arena, results, stream):
    rows = []
    for model, (num_layers, item, num_kinds) in MODELS.items():
        item_bytes = math.prod(item) * DTYPE.itemsize
        for page_size in PAGE_SIZES:
            page_bytes = page_size * num_layers * item_bytes  # one kind
            runnable = [n for n in PAGE_COUNTS if n * page_bytes * num_kinds <= args.max_bytes]
            if not runnable:
                continue
            pool_pages = max(runnable) + 1
            kinds = [random_layers(num_layers, pool_pages * page_size, item) for _ in range(num_kinds)]
            stagings = [torch.empty((STAGING_PAGES, page_size, num_layers, *item), dtype=DTYPE, device="cuda")
                        for _ in range(num_kinds)]
            staging_bytes = sum(s.numel() * s.element_size() for s in stagings)
            for num_pages in PAGE_COUNTS:
                for order in HOST_ORDERS:
                    row = dict(model=model, page_size=page_size, pages=num_pages, host_order=order,
                               page_bytes=page_bytes, staging_bytes=staging_bytes,
                               bytes=num_pages * page_bytes * num_kinds)
                    rows.append(row)
                    if num_pages not in runnable:
                        row["skipped"] = f"over --max-bytes {args.max_bytes}"
                        continue
                    run_write_back(args, arena, row, kinds, stagings, num_layers, item, page_size, num_pages, order,
                                   stream)
                    print(f"  {model:16s} P={page_size:<3d} pages={num_pages:<5d} {order:10s} "
                          f"limit {row['limit_gbps']:6.1f} GB/s  staged {row['staged_batch_ratio']:.3f}/"
                          f"{row['staged_per_page_ratio']:.3f}/{row['staged_plain_ratio']:.3f}  "
                          f"per_token {row['per_token_ratio']:.3f}  "
                          f"enqueue/64 pages {row['staged_batch_enqueue_ms_per_64_pages']:.3f} ms", flush=True)
            del kinds, stagings
            torch.cuda.empty_cache()
    results["write_back"] = rows


def run_write_back(args, arena, row, kinds, stagings, num_layers, item, page_size, num_pages, order, stream):
    num_kinds = len(kinds)
    pool_pages = kinds[0][0].shape[0] // page_size
    gen = torch.Generator().manual_seed(num_pages * 31 + page_size)
    dev_pages = torch.randperm(pool_pages, generator=gen)[:num_pages]
    host_pages = torch.arange(num_pages) if order == "contiguous" else torch.randperm(num_pages, generator=gen)
    offsets = torch.arange(page_size)
    dev_idx = (dev_pages[:, None] * page_size + offsets).reshape(-1).cuda()
    host_idx = (host_pages[:, None] * page_size + offsets).reshape(-1)
    hosts = arena.host_kinds(num_kinds, (num_pages * page_size, num_layers, *item))
    nbytes = row["bytes"]

    src, dst = arena.device[:nbytes], arena.host[:nbytes]
    ms, walls = time_ms(lambda: dst.copy_(src, non_blocking=True), args.reps, stream=stream)
    row["limit_ms"], row["limit_gbps"] = ms, gbps(nbytes, ms)
    row["limit_enqueue_ms"] = statistics.median(walls)  # the driver's own submission cost for these bytes

    # staged_batch: the default (host-page order, pipelined halves beyond one staging buffer, one
    # cudaMemcpyBatchAsync per chunk);
    # staged_per_page: the same with one cudaMemcpyAsync per copy; staged_plain: batched, one
    # stream, whole-capacity chunks, pages in the given order (the un-optimised staged path).
    variants = {
        "batch": dict(copy_mode="batch"),
        "per_page": dict(copy_mode="per_page"),
        "plain": dict(copy_mode="batch", pipeline=False, sort_pages=False),
    }
    for name, opts in variants.items():
        def staged():
            return hicache.transfer_hicache_all_layer_staged_lf_pf(
                kinds, hosts, stagings, device_indices=dev_idx, host_indices=host_idx, page_size=page_size, **opts)
        ms, walls = time_ms(staged, args.reps, stream=stream)
        with torch.cuda.stream(stream):
            stats = staged()
        stream.synchronize()
        row[f"staged_{name}_ms"], row[f"staged_{name}_gbps"] = ms, gbps(nbytes, ms)
        row[f"staged_{name}_ratio"] = row["limit_ms"] / ms
        row[f"staged_{name}_enqueue_ms_per_call"] = statistics.median(walls)
        # Per 64 pages: the staging capacity, whether moved as one chunk or two pipelined halves.
        row[f"staged_{name}_enqueue_ms_per_64_pages"] = statistics.median(walls) / (num_pages / STAGING_PAGES)
        row[f"staged_{name}_chunks"] = stats.chunks
        row[f"staged_{name}_copies"] = stats.copies
        row[f"staged_{name}_batched_chunks"] = stats.batched_chunks
    if args.validate and num_pages == 64:
        check = [h.clone() for h in hosts]
        for h in hosts:
            h.view(torch.int16).fill_(-1)
        host_on_device = host_idx.cuda()
        with torch.cuda.stream(stream):
            hicache.transfer_hicache_all_layer(kinds, hosts, "page_first", device_indices=dev_idx,
                                               host_indices=host_on_device, page_size=page_size)
        stream.synchronize()
        row["validated_staged_equals_per_token"] = all(
            torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(hosts, check))

    host_on_device = host_idx.cuda()
    for quota in args.write_quotas:
        ms, _ = time_ms(lambda: hicache.transfer_hicache_all_layer(
            kinds, hosts, "page_first", device_indices=dev_idx, host_indices=host_on_device, page_size=page_size,
            block_quota=quota), args.reps, stream=stream)
        key = "per_token" if quota == args.write_quotas[0] else f"per_token_q{quota}"
        row[f"{key}_ms"], row[f"{key}_gbps"], row[f"{key}_ratio"] = ms, gbps(nbytes, ms), row["limit_ms"] / ms
    row["per_token_block_quota"] = args.write_quotas[0]

    if nbytes <= args.reference_max_bytes:
        def ref():
            reference.write_back_all_layer_ref(list(zip(kinds, hosts)), "page_first", device_indices=dev_idx,
                                               host_indices=host_idx, page_size=page_size)
        ms, _ = time_ms(ref, 1, warmup=0, stream=stream)
        row["reference_ms"], row["reference_gbps"], row["reference_ratio"] = ms, gbps(nbytes, ms), row["limit_ms"] / ms
    else:
        row["reference_ratio"] = row["reference_gbps"] = NAN


def load_back_section(args, arena, results, stream):
    """One layer alone (its enqueue latency shows, nothing else is queued), and every layer
    back to back as a load-back of a whole prefix runs (vs one contiguous copy of all of it)."""
    rows = []
    for model, (num_layers, item, num_kinds) in MODELS.items():
        item_bytes = math.prod(item) * DTYPE.itemsize
        for page_size in PAGE_SIZES:
            for tokens in args.load_tokens:
                num_pages = tokens // page_size
                host_slots = num_pages * page_size
                gen = torch.Generator().manual_seed(tokens + page_size)
                offsets = torch.arange(page_size)
                host_idx = (torch.randperm(num_pages, generator=gen)[:, None] * page_size + offsets).reshape(-1)
                host_idx_dev = host_idx.cuda()
                dev_idx = (torch.randperm(num_pages, generator=gen)[:, None] * page_size + offsets).reshape(-1).cuda()
                layers = [torch.empty((host_slots, *item), dtype=DTYPE, device="cuda") for _ in range(num_kinds)]
                nbytes = tokens * item_bytes * num_kinds
                limit_ms, _ = time_ms(lambda: arena.device[:nbytes].copy_(arena.host[:nbytes], non_blocking=True),
                                      args.reps, stream=stream)
                all_bytes = nbytes * num_layers
                all_limit_ms = NAN
                if all_bytes <= arena.host.numel():
                    all_limit_ms, _ = time_ms(
                        lambda: arena.device[:all_bytes].copy_(arena.host[:all_bytes], non_blocking=True),
                        args.reps, stream=stream)
                for layout in reference.LAYOUTS:
                    shape = reference.host_kind_shape(layout, host_slots, num_layers, page_size, item)
                    if math.prod(shape) * DTYPE.itemsize * num_kinds > arena.host.numel():
                        continue
                    hosts = arena.host_kinds(num_kinds, shape)
                    quotas = args.load_quotas if layout == "page_first" else args.load_quotas[:1]

                    def load(layer_id, quota, indices):
                        hicache.transfer_hicache_one_layer(
                            hosts, layers, layout, layer_id, host_indices=indices, device_indices=dev_idx,
                            page_size=page_size, block_quota=quota)

                    for quota in quotas:
                        ms, walls = time_ms(lambda: load(num_layers // 2, quota, host_idx_dev), args.reps,
                                            stream=stream)
                        row = dict(model=model, page_size=page_size, tokens=tokens, layout=layout, block_quota=quota,
                                   bytes=nbytes, limit_ms=limit_ms, limit_gbps=gbps(nbytes, limit_ms), ms=ms,
                                   gbps=gbps(nbytes, ms), ratio=limit_ms / ms, enqueue_ms=statistics.median(walls))
                        if quota == args.load_quotas[0] and not math.isnan(all_limit_ms):
                            # All layers back to back, host indices given on the CPU as the pools do.
                            def all_layers():
                                for layer_id in range(num_layers):
                                    load(layer_id, quota, host_idx)
                            ms_all, walls_all = time_ms(all_layers, args.reps, stream=stream)
                            row.update(all_layers_ms=ms_all, all_layers_gbps=gbps(all_bytes, ms_all),
                                       all_layers_limit_gbps=gbps(all_bytes, all_limit_ms),
                                       all_layers_ratio=all_limit_ms / ms_all,
                                       all_layers_enqueue_ms_per_layer=statistics.median(walls_all) / num_layers)
                        rows.append(row)
                        extra = (f"  all layers {row['all_layers_ratio']:.3f}" if "all_layers_ratio" in row else "")
                        print(f"  {model:16s} P={page_size:<3d} tokens={tokens:<6d} {layout:17s} q={quota:<3d} "
                              f"{row['gbps']:6.1f} GB/s  H2D limit {row['limit_gbps']:6.1f}  ratio {row['ratio']:.3f}"
                              f"{extra}", flush=True)
    results["load_back"] = rows


def fmt(x, spec=".2f"):
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def print_tables(results):
    wb = results["write_back"]
    print("\n## Write-back, all layers, device layer_first -> host page_first (ratio = GB/s / contiguous D2H GB/s)")
    print("| model | P | page KiB | pages | host | limit GB/s | staged (default) | staged per-page | staged plain | "
          "per-token | reference | enqueue ms / 64 pages (default, per-page) | limit copy enqueue ms | "
          "copies (default, plain) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in wb:
        if "skipped" in r:
            print(f"| {r['model']} | {r['page_size']} | {r['page_bytes'] / 1024:.0f} | {r['pages']} | "
                  f"{r['host_order']} | nan | nan | nan | nan | nan | nan | not run ({r['skipped']}) | | |")
            continue
        print(f"| {r['model']} | {r['page_size']} | {r['page_bytes'] / 1024:.0f} | {r['pages']} | {r['host_order']} | "
              f"{fmt(r['limit_gbps'], '.1f')} | {fmt(r['staged_batch_ratio'], '.3f')} | "
              f"{fmt(r['staged_per_page_ratio'], '.3f')} | {fmt(r['staged_plain_ratio'], '.3f')} | "
              f"{fmt(r['per_token_ratio'], '.3f')} | {fmt(r.get('reference_ratio'), '.3f')} | "
              f"{fmt(r['staged_batch_enqueue_ms_per_64_pages'], '.3f')}, "
              f"{fmt(r['staged_per_page_enqueue_ms_per_64_pages'], '.3f')} | {fmt(r['limit_enqueue_ms'], '.3f')} | "
              f"{r['staged_batch_copies']}, {r['staged_plain_copies']} |")
    print("\n## Load-back, one layer, host layout -> device layer_first (ratio = GB/s / contiguous H2D GB/s)")
    print("| model | P | tokens | layout | block quota | GB/s | H2D limit GB/s | ratio | enqueue ms | "
          "all layers back to back: ratio (GB/s, limit GB/s, enqueue ms/layer) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results["load_back"]:
        all_layers = (f"{r['all_layers_ratio']:.3f} ({r['all_layers_gbps']:.1f}, {r['all_layers_limit_gbps']:.1f}, "
                      f"{r['all_layers_enqueue_ms_per_layer']:.3f})" if "all_layers_ratio" in r else "")
        print(f"| {r['model']} | {r['page_size']} | {r['tokens']} | {r['layout']} | {r['block_quota']} | "
              f"{r['gbps']:.1f} | {r['limit_gbps']:.1f} | {r['ratio']:.3f} | {r['enqueue_ms']:.3f} | {all_layers} |")


def targets(results, args):
    wb = [r for r in results["write_back"] if "skipped" not in r]
    big = [r for r in wb if r["page_bytes"] >= 256 * 1024]
    small = [r for r in wb if r["page_size"] in (1, 16) and r["host_order"] == "contiguous"]
    full = [r for r in wb if r["pages"] >= STAGING_PAGES]
    lb = results["load_back"]
    default_q = [r for r in lb if r["block_quota"] == args.load_quotas[0]]
    all_layers = [r for r in default_q if "all_layers_ratio" in r]
    nan_min = lambda xs: min(xs, default=NAN)  # noqa: E731
    t = {
        "staged_ratio_min_page_ge_256KiB": nan_min(r["staged_batch_ratio"] for r in big),
        "staged_ratio_min_P1_P16_contiguous": nan_min(r["staged_batch_ratio"] for r in small),
        "staged_ratio_min_P1_P16_contiguous_by_pages": {
            n: nan_min(r["staged_batch_ratio"] for r in small if r["pages"] == n) for n in PAGE_COUNTS},
        "staged_enqueue_ms_per_64_pages_max": max((r["staged_batch_enqueue_ms_per_64_pages"] for r in full),
                                                  default=NAN),
        "staged_enqueue_ms_per_64_pages_max_contiguous": max(
            (r["staged_batch_enqueue_ms_per_64_pages"] for r in full if r["host_order"] == "contiguous"), default=NAN),
        "load_back_one_layer_ratio_min_default_quota": nan_min(r["ratio"] for r in default_q),
        "load_back_all_layers_ratio_min_default_quota": nan_min(r["all_layers_ratio"] for r in all_layers),
        "staging_bytes": {f"{r['model']}_P{r['page_size']}": r["staging_bytes"] for r in wb},
    }
    t["met"] = {
        "staged >= 0.93 x limit at page >= 256 KiB": t["staged_ratio_min_page_ge_256KiB"] >= 0.93,
        "staged >= 0.85 x limit at P 1 and 16, contiguous host": t["staged_ratio_min_P1_P16_contiguous"] >= 0.85,
        "enqueue <= 0.2 ms per 64-page chunk": t["staged_enqueue_ms_per_64_pages_max"] <= 0.2,
        "load-back >= 0.8 x H2D limit (one layer alone)": t["load_back_one_layer_ratio_min_default_quota"] >= 0.8,
        "load-back >= 0.8 x H2D limit (all layers back to back)": t["load_back_all_layers_ratio_min_default_quota"]
        >= 0.8,
    }
    return t


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default="benchmark/results")
    parser.add_argument("--max-bytes", type=int, default=2 << 30, help="largest operation run (bytes, all kinds)")
    parser.add_argument("--reference-max-bytes", type=int, default=256 << 20)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--write-quotas", type=int, nargs="+", default=[hicache.DEFAULT_BLOCK_QUOTA, 32],
                        help="block quotas of the per-token SM write-back (first = the reported one)")
    parser.add_argument("--load-quotas", type=int, nargs="+", default=[hicache.DEFAULT_BLOCK_QUOTA, 2, 4, 16, 32],
                        help="block quotas of the per-layer load-back (first = the default, also run over all layers)")
    parser.add_argument("--load-tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--no-validate", dest="validate", action="store_false")
    args = parser.parse_args()

    if not utils.can_use_jit_kernels():
        print(f"cannot run: {utils.jit_unavailable_reason()}")
        return 1
    utils.load_kvcacheio_module()
    stream = torch.cuda.Stream()  # batched copies refuse the legacy default stream
    results = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "gpu": torch.cuda.get_device_name(),
            "host": platform.node(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "torch_cuda": torch.version.cuda,
            "cuda": utils.batch_copy_info(),
        },
        "settings": {k: v for k, v in vars(args).items()},
        "staging_pages": STAGING_PAGES,
        "copy_mode_policy": hicache.COPY_MODE_NOTE,
    }
    arena = Arena(args.max_bytes)
    t0 = time.time()
    print("# write-back", flush=True)
    write_back_section(args, arena, results, stream)
    print(f"# load-back ({time.time() - t0:.0f} s so far)", flush=True)
    load_back_section(args, arena, results, stream)
    results["targets"] = targets(results, args)
    results["elapsed_s"] = time.time() - t0
    print_tables(results)
    print("\n## Targets (reported, not asserted)")
    print(json.dumps(results["targets"], indent=1))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "h200_hicache_write_back.json"
    path.write_text(json.dumps(results, indent=1, default=str))
    print(f"wrote {path} ({results['elapsed_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
