"""Overlap scheduling on vs off (issue 12): client TPOT against the model's decode step, in one call.

1. `bench_decode.py` step times (CUDA graphs) at the serving batch sizes (default 1, 16, 64,
   160) with `--context-len` tokens per request (1152 = 1024 prompt + half of 256 outputs).
2. For each mode (overlap on, then off with `--disable-overlap-schedule`): a server on a dummy
   Llama-3-8B (`--load-format dummy`, bf16), then `benchmark/bench_serving.py --backend openai
   --random-input-len 1024 --random-output-len 256 --ignore-eos` at concurrency 1, 16, 64, 160.
3. A table and `<out-dir>/<name>.json`: per concurrency and mode, mean/median TPOT, output
   throughput, TPOT / model step (target <= 1.05 at concurrency 1 and 16 with overlap), and
   the output throughput against the model-step limit (concurrency / step time).

    python benchmark/gpu/bench_overlap.py                  # H200: about 6-8 minutes
    python benchmark/gpu/bench_overlap.py --dry-run        # print the commands only (any machine)
    python benchmark/gpu/bench_overlap.py --tiny --device cpu --concurrency 1 2 --num-prompts 4
                                                           # harness check on the CPU (figures mean nothing)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

REPO_ROOT = Path(__file__).resolve().parents[2]
TARGET_TPOT_OVER_STEP = 1.05
TARGET_CONCURRENCY = (1, 16)
MODES = ("overlap", "no_overlap")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 160])
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests per level (default: max(16, 2 x concurrency), at most 320)")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--context-len", type=int, default=1152, help="bench_decode tokens per request")
    p.add_argument("--shape", default="llama3-8b", help="dummy model shape (hiserve.testing.dummy_model)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="tiny-llama, short prompts (harness check)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--server-extra", default="", help="extra launch_server flags for both modes")
    p.add_argument("--skip-decode", action="store_true", help="no bench_decode run (no step ratios)")
    p.add_argument("--launch-timeout", type=float, default=900.0)
    p.add_argument("--out-dir", default="benchmark/results")
    p.add_argument("--name", default=None, help="JSON name (default: h200_overlap, or cpu_overlap_tiny)")
    p.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    p.add_argument("--resummarize", default=None, metavar="JSON",
                   help="recompute the rows of a stored result from its raw data and exit")
    args = p.parse_args(argv)
    if min(args.concurrency) < 1:
        p.error("--concurrency values must be at least 1")
    if args.tiny:
        args.shape, args.input_len, args.output_len, args.context_len = "tiny-llama", 64, 32, 80
    if args.name is None:
        args.name = "cpu_overlap_tiny" if args.device == "cpu" else "h200_overlap"
    return args


def num_prompts(args: argparse.Namespace, concurrency: int) -> int:
    return args.num_prompts or min(320, max(16, 2 * concurrency))


def decode_command(args: argparse.Namespace, out_dir: str) -> list[str]:
    """bench_decode.py at the serving batch sizes (CUDA graphs; no eager comparison)."""
    cmd = [sys.executable, "benchmark/gpu/bench_decode.py", "--batch-sizes", *map(str, args.concurrency),
           "--context-len", str(args.context_len), "--dtype", args.dtype, "--device", args.device,
           "--no-eager", "--out-dir", out_dir, "--name", f"{args.name}_decode"]
    return cmd + (["--tiny"] if args.tiny else [])


def server_command(args: argparse.Namespace, model_dir: str, mode: str, port: int) -> list[str]:
    max_running = max(args.concurrency)
    cmd = [sys.executable, "-m", "hiserve.launch_server", "--model-path", model_dir, "--load-format", "dummy",
           "--dtype", args.dtype, "--device", args.device, "--host", "127.0.0.1", "--port", str(port),
           "--max-running-requests", str(max_running), "--context-length", str(args.input_len + args.output_len + 64)]
    if args.device == "cuda":
        cmd += ["--cuda-graph-max-bs", str(max_running)]
    cmd += ["--disable-overlap-schedule"] if mode == "no_overlap" else (
        ["--enable-overlap-schedule"] if args.device == "cpu" else [])
    return cmd + args.server_extra.split()


def serving_command(args: argparse.Namespace, port: int, concurrency: int, out_file: str) -> list[str]:
    return [sys.executable, "benchmark/bench_serving.py", "--base-url", f"http://127.0.0.1:{port}",
            "--backend", "openai", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--ignore-eos", "--concurrency", str(concurrency),
            "--num-prompts", str(num_prompts(args, concurrency)), "--flush-cache", "--output-file", out_file]


def summarize(decode_rows: list[dict[str, Any]], serving: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per (concurrency, mode): TPOT, throughput, and the ratios to the model step.

    Args:
        decode_rows: bench_decode.py's `rows` (`mode`, `batch_size`, `step_ms`); the
            cuda_graph rows are used (any mode when there are none: the CPU harness).
        serving: mode -> bench_serving.py's `results` (`concurrency`, `mean_tpot_ms`,
            `median_tpot_ms`, `output_throughput`, ...).
    """
    graph = [r for r in decode_rows if r.get("mode") == "cuda_graph"] or decode_rows
    step = {r["batch_size"]: r["step_ms"] for r in graph}
    rows = []
    for mode, results in serving.items():
        for res in results:
            c = res["concurrency"]
            step_ms = step.get(c)
            tpot = res.get("mean_tpot_ms")
            row = {"concurrency": c, "mode": mode, "mean_tpot_ms": tpot,
                   "median_tpot_ms": res.get("median_tpot_ms"), "output_throughput": res.get("output_throughput"),
                   "median_itl_ms": res.get("median_itl_ms"),
                   "completed": res.get("completed"), "failed": res.get("failed"), "model_step_ms": step_ms,
                   "tpot_over_step": None, "itl_over_step": None, "step_limit_throughput": None,
                   "throughput_over_limit": None}
            if step_ms:
                row["step_limit_throughput"] = c * 1000.0 / step_ms
                if tpot:
                    row["tpot_over_step"] = tpot / step_ms
                if row["median_itl_ms"]:  # typical token gap: a median is robust to the few prefill stalls
                    row["itl_over_step"] = row["median_itl_ms"] / step_ms
                if res.get("output_throughput"):
                    row["throughput_over_limit"] = res["output_throughput"] / row["step_limit_throughput"]
            rows.append(row)
    rows.sort(key=lambda r: (r["concurrency"], MODES.index(r["mode"]) if r["mode"] in MODES else 9))
    return rows


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 12's target: with overlap, TPOT / model step <= 1.05 at concurrency 1 and 16."""
    got = {r["concurrency"]: r["tpot_over_step"] for r in rows
           if r["mode"] == "overlap" and r["concurrency"] in TARGET_CONCURRENCY}
    met = bool(got) and all(v is not None and v <= TARGET_TPOT_OVER_STEP for v in got.values())
    return {"tpot_over_step": got, "target": TARGET_TPOT_OVER_STEP, "met": met}


def format_table(rows: list[dict[str, Any]]) -> str:
    def f(v: Any, fmt: str = "{:.2f}") -> str:
        return "n/a" if v is None else fmt.format(v)

    head = f"{'conc':>5} {'mode':>11} {'TPOT ms':>8} {'p50 ms':>7} {'step ms':>8} {'TPOT/step':>9} " \
           f"{'ITL p50/step':>12} {'out tok/s':>10} {'limit tok/s':>11} {'of limit':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['concurrency']:>5} {r['mode']:>11} {f(r['mean_tpot_ms']):>8} {f(r['median_tpot_ms']):>7} "
                     f"{f(r['model_step_ms']):>8} {f(r['tpot_over_step'], '{:.3f}'):>9} "
                     f"{f(r.get('itl_over_step'), '{:.3f}'):>12} {f(r['output_throughput'], '{:.0f}'):>10} "
                     f"{f(r['step_limit_throughput'], '{:.0f}'):>11} {f(r['throughput_over_limit'], '{:.2f}'):>8}")
    return "\n".join(lines)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(proc: subprocess.Popen, port: int, timeout: float, log: Path) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}); log tail:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise TimeoutError(f"server not healthy in {timeout:.0f} s; log tail:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def run_mode(args: argparse.Namespace, model_dir: str, mode: str, work: Path) -> list[dict[str, Any]]:
    """Serve in `mode` and run bench_serving at every concurrency; returns its results."""
    port = _free_port()
    log = work / f"server_{mode}.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(server_command(args, model_dir, mode, port), cwd=REPO_ROOT, stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_healthy(proc, port, args.launch_timeout, log)
        results = []
        for c in args.concurrency:
            out = work / f"serving_{mode}_c{c}.json"
            subprocess.run(serving_command(args, port, c, str(out)), cwd=REPO_ROOT, check=True)
            results += json.loads(out.read_text())["results"]
        return results
    finally:
        _stop(proc)


def resummarize(path: Path) -> int:
    """Recompute a stored record's rows and targets from its own raw data (`decode_rows`,
    `serving`), e.g. after a column was added; rewrites the file and prints the table."""
    record = json.loads(path.read_text())
    record["rows"] = summarize(record.get("decode_rows", []), record["serving"])
    record["targets"] = targets(record["rows"])
    record["resummarized"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    print(format_table(record["rows"]))
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(f"rewrote {path}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.resummarize:
        return resummarize(Path(args.resummarize))
    work = Path(tempfile.mkdtemp(prefix="bench_overlap_"))
    model_dir = str(work / args.shape)
    out_dir = str(Path(args.out_dir))
    if args.dry_run:
        for cmd in ([] if args.skip_decode else [decode_command(args, out_dir)]) + [
                server_command(args, model_dir, m, 0) for m in args.modes] + [
                serving_command(args, 0, c, "OUT.json") for c in args.concurrency]:
            print(" ".join(cmd))
        return 0
    sys.path.insert(0, str(REPO_ROOT))
    from hiserve.testing.dummy_model import write_dummy_model

    write_dummy_model(model_dir, args.shape)
    decode_rows: list[dict[str, Any]] = []
    if not args.skip_decode:
        subprocess.run(decode_command(args, out_dir), cwd=REPO_ROOT, check=True)
        decode_rows = json.loads((Path(out_dir) / f"{args.name}_decode.json").read_text())["rows"]
    serving = {mode: run_mode(args, model_dir, mode, work) for mode in args.modes}
    rows = summarize(decode_rows, serving)
    print(format_table(rows))
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import base_record  # benchmark/gpu, this script's folder (imports torch)

    record = {**base_record(torch.device(args.device), args),
              "rows": rows, "targets": targets(rows), "decode_rows": decode_rows, "serving": serving}
    print(f"target TPOT/step <= {TARGET_TPOT_OVER_STEP} at concurrency {TARGET_CONCURRENCY} with overlap: "
          f"{'met' if record['targets']['met'] else 'NOT met'} {record['targets']['tpot_over_step']}")
    path = Path(out_dir) / f"{args.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
