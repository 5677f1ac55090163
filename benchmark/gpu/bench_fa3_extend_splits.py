"""FA3 attention of a prefix hit's extend as the extend CUDA graph runs it, by context and split count.

A device hit of an L-token prefix with t new tokens runs one EXTEND pass; under the extend graph
(`engine/extend_graph_runner.py`) FA3 sees two requests: the hit (t query rows over L + t keys)
and a padding request (bucket - t rows over as many keys, on page 0), varlen `cu_seqlens_q`,
paged KV, `page_table` [2, max pages]. With few query rows per request (one 64-row tile per
head) FA3's grid is num_heads x 1 CTAs unless the key range is split (`num_splits`), so the
attention time grows with L at low occupancy. This times one layer's call, per L and per
`num_splits` (0 = FA3's own heuristic), with CUDA events over many calls, so the choice of a
split count for these passes rests on measurement. Each case is timed two ways: eager calls
(what a pass without graphs pays: Python and launch included) and replays of a CUDA graph that
holds `--graph-calls` calls (the kernel time a graph replay pays).

    python benchmark/gpu/bench_fa3_extend_splits.py [--contexts 2048 6144 8192] [--out-dir DIR]

Prints a table; writes JSON (command, machine, GPU, figures) under benchmark/results/.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import base_record, write_record  # noqa: E402

from hiserve.layers.attention.fa3_probe import fa3_module  # noqa: E402


def time_call(fn, iters: int) -> float:
    """Mean ms of `fn()` over `iters` calls, after a warm-up."""
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def time_graph(fn, calls: int, replays: int) -> float:
    """Mean ms of one `fn()` inside a CUDA graph of `calls` calls, over `replays` replays."""
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()  # warm-up outside the graph (FA3's first call sets up its state)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return time_call(graph.replay, replays) / calls


def case(fa3, ctx: int, t: int, bucket: int, splits: int, args: argparse.Namespace) -> tuple[float, float]:
    """(eager ms, graph ms) of one layer's FA3 call: hit (t rows, ctx + t keys) + padding
    (bucket - t rows)."""
    dev, p, hq, hkv, d = torch.device("cuda"), args.page_size, args.q_heads, args.kv_heads, args.head_dim
    max_pages = args.max_context // p
    pages = 2 * max_pages + 1
    k = torch.randn(pages, p, hkv, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    rows = bucket + 1
    q = torch.randn(rows, hq, d, device=dev, dtype=torch.bfloat16)
    table = torch.zeros(2, max_pages, dtype=torch.int32, device=dev)
    table[0] = torch.randperm(pages - 1, device=dev)[:max_pages].to(torch.int32) + 1
    seqlens = torch.tensor([ctx + t, rows - t], dtype=torch.int32, device=dev)
    cu = torch.tensor([0, t, rows], dtype=torch.int32, device=dev)

    def call() -> None:
        fa3.flash_attn_with_kvcache(q=q, k_cache=k, v_cache=v, cache_seqlens=seqlens, page_table=table,
                                    cu_seqlens_q=cu, max_seqlen_q=max(t, rows - t), softmax_scale=d**-0.5,
                                    causal=True, num_splits=splits)

    return time_call(call, args.iters), time_graph(call, args.graph_calls, args.replays)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 6144, 8064])
    ap.add_argument("--new-tokens", type=int, nargs="+", default=[64, 120])
    ap.add_argument("--splits", type=int, nargs="+", default=[0, 1, 2, 4, 8, 16])
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--max-context", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=32, help="to scale one call to a pass")
    ap.add_argument("--iters", type=int, default=200, help="eager calls timed")
    ap.add_argument("--graph-calls", type=int, default=32, help="calls captured in one graph (a pass's layers)")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--out-dir", default="benchmark/results")
    ap.add_argument("--name", default="h200_fa3_extend_splits")
    args = ap.parse_args(argv)
    fa3 = fa3_module()
    rows = []
    print(f"{'ctx':>6} {'new':>4} {'timing':>6} " + " ".join(f"{'s=' + str(s):>8}" for s in args.splits)
          + "   (ms per layer call; s=0: FA3's heuristic)")
    for ctx in args.contexts:
        for t in args.new_tokens:
            bucket = 1 << (t - 1).bit_length()
            both = {s: case(fa3, ctx, t, bucket, s, args) for s in args.splits}
            eager = {s: e for s, (e, _) in both.items()}
            graph = {s: g for s, (_, g) in both.items()}
            rows.append({"context": ctx, "new_tokens": t, "bucket": bucket, "eager_ms_per_call": eager,
                         "graph_ms_per_call": graph,
                         "graph_ms_per_pass": {s: v * args.layers for s, v in graph.items()}})
            for name, ms in (("eager", eager), ("graph", graph)):
                print(f"{ctx:6d} {t:4d} {name:>6} " + " ".join(f"{ms[s]:8.4f}" for s in args.splits), flush=True)
    record = base_record(torch.device("cuda"), args)
    record["rows"] = rows
    write_record(record, args.out_dir, args.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
