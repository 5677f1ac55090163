"""Where a device hit's time goes, end to end over HTTP.

One server (dummy weights, hierarchical cache, write_through, the page size given) answers
`/generate` with `input_ids` = a cached prefix + 64 new tokens and `max_new_tokens` 1 (a
device hit, as bench_hit_latency.py times it). For each prefix length, N hits are timed
by the client and by the server (`meta_info.e2e_latency`: from the API process's receipt
of the parsed request to its last output), so

    client - server = HTTP both ways, uvicorn's and FastAPI's parsing, the response
                      (the client encodes the body before its clock starts);
    server          = tokenizer manager -> scheduler -> forward -> detokenizer -> back.

With py-spy installed, the hits at the longest length run again under
`py-spy record --subprocesses` (raw stacks), and the functions with the most samples
(inclusive, per process) are printed: what grows with the prefix length.

    python benchmark/hicache/profile_hit_path.py --lengths 2048 6144 --page-size 64
Prints a table and writes JSON under benchmark/results/.
"""

from __future__ import annotations

import argparse
import collections
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_hit_latency import NEW_TOKENS, REPO_ROOT, RawClient, timed_generate  # noqa: E402  (sets sys.path too)
from common import base_record, write_record  # noqa: E402
from server import kill, popen_launch_server  # noqa: E402

from hiserve.testing.dummy_model import SHAPES, write_dummy_model  # noqa: E402


def hit(client: RawClient, ids: list[int]) -> tuple[float, float]:
    """(client ms, server e2e ms) of one /generate (kept-alive connection, body encoded
    before the clock starts, as bench_hit_latency.py's default client)."""
    ms, meta = timed_generate(client, ids)
    return ms, meta["e2e_latency"] * 1e3


def summarize_stacks(raw: str, top: int) -> dict[str, list[tuple[str, int]]]:
    """py-spy raw output -> per process, the `top` functions by inclusive samples."""
    per_proc: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        # --subprocesses nests a child's stack under its parent's "process ..." frame
        starts = [i for i, f in enumerate(frames) if f.startswith("process ")]
        first = starts[-1] if starts else 0
        proc = frames[first][:90]
        seen = set()
        for f in frames[first + 1:]:
            f = re.sub(r":\d+\)$", ")", f)  # one entry per function, not per line
            if f not in seen:
                per_proc[proc][f] += int(n)
                seen.add(f)
    return {p: c.most_common(top) for p, c in per_proc.items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    cfg = SHAPES[args.shape]
    model_dir = write_dummy_model(tempfile.mkdtemp(prefix="hit_path_"), args.shape)
    longest = max(args.lengths)
    pool = 4 * (longest + NEW_TOKENS)
    proc, base = popen_launch_server([
        "--model-path", model_dir, "--load-format", "dummy", "--device", args.device, "--dtype", args.dtype,
        "--page-size", args.page_size, "--max-total-tokens", pool, "--enable-hierarchical-cache",
        "--hicache-ratio", 2, "--hicache-write-policy", "write_through", "--chunked-prefill-size", -1,
        "--max-prefill-tokens", longest + NEW_TOKENS + args.page_size, *args.server_args], timeout=900)
    rng = random.Random(0)
    new = lambda: [rng.randrange(10, cfg["vocab_size"]) for _ in range(NEW_TOKENS)]  # noqa: E731
    rows, stacks = [], None
    try:
        with RawClient(base) as client:
            for length in args.lengths:
                prefix = [rng.randrange(10, cfg["vocab_size"]) for _ in range(length)]
                hit(client, prefix + new())  # cold
                time.sleep(0.5)  # its write-through done
                samples = [hit(client, prefix + new()) for _ in range(args.hits)]
                c = statistics.median(s[0] for s in samples)
                s = statistics.median(s[1] for s in samples)
                rows.append({"prefix_tokens": length, "client_ms": c, "server_e2e_ms": s,
                             "client_minus_server_ms": c - s, "samples": samples})
                print(f"L {length:6d}  client {c:7.2f} ms  server e2e {s:7.2f} ms  outside the server {c - s:6.2f} ms",
                      flush=True)
            spy = shutil.which("py-spy")
            if spy is not None:
                raw = Path(tempfile.mkdtemp()) / "hits.raw"
                rec = subprocess.Popen([spy, "record", "--subprocesses", "-r", str(args.rate), "-f", "raw",
                                        "-o", str(raw), "--pid", str(proc.pid)], stdout=subprocess.DEVNULL)
                time.sleep(2.0)
                for _ in range(args.hits):
                    hit(client, prefix + new())
                rec.send_signal(signal.SIGINT)
                rec.wait(timeout=60)
                stacks = summarize_stacks(raw.read_text(), args.top) if raw.exists() else None
    finally:
        kill(proc)
    return {"rows": rows, "py_spy_top": stacks}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 6144])
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--hits", type=int, default=30)
    ap.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--server-args", nargs=argparse.REMAINDER, default=[])
    ap.add_argument("--out-dir", default=str(REPO_ROOT / "benchmark" / "results"))
    ap.add_argument("--name", default=None)
    args = ap.parse_args(argv)
    result = run(args)
    if result["py_spy_top"]:
        for p, top in result["py_spy_top"].items():
            print(f"\n{p}")
            for f, n in top:
                print(f"  {n:6d}  {f[:140]}")
    record = base_record(torch.device(args.device), args)
    record.update(result)
    write_record(record, args.out_dir, args.name or f"hit_path_{args.device}_{args.shape}_page{args.page_size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
