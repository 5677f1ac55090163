"""RMSNorm (+ residual), SiLU-and-mul and rotary kernels of every ISA tier this CPU runs, same process.

Each tier's build of the CPU kernels (`hiserve.jit_kernel.cpu.load_cpu_module(isa)`) is called
directly (no Python wrapper: the kernel and its tvm-ffi call) on SmolLM2's widths, bf16, at 1,
16 (a batched decode step) and 230 rows (scenario (a)'s prefill), the tiers interleaved within
each repeat; medians. The baseline tier (no ISA flags: SSE2) runs the plain scalar loops, whose
arithmetic no checkout has changed (RMSNorm's moved into a function, not altered), so the ratio
of each tier to it, measured in the same run, compares checkouts across runs on a noisy machine;
`--runs` repeats the whole measurement and reports the median ratio (single runs moved by up to
~10% on the AMX Xeon).

    PYTHONPATH=$PWD python benchmark/cpu/bench_small_ops.py [--out benchmark/results/cpu_small_ops.json]

Prints a table; writes JSON (command, CPU, date, git commit, every median and ratio).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scheduler_steps import _cpu_model  # noqa: E402

from hiserve.jit_kernel import cpu as cpu_kernels  # noqa: E402


def cases(rows: int, hidden: int, inter: int):
    """[(name, fn(module))] of the three kernels at `rows`, on fixed random bf16 inputs."""
    gen = torch.Generator().manual_seed(rows)
    x, r = torch.randn(rows, hidden, generator=gen).bfloat16(), torch.randn(rows, hidden, generator=gen).bfloat16()
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).bfloat16()
    out, res = torch.empty_like(x), torch.empty_like(x)
    g = (3 * torch.randn(rows, 2 * inter, generator=gen)).bfloat16()
    s = torch.empty(rows, inter, dtype=torch.bfloat16)
    qk = torch.randn(rows, 12, 64, generator=gen).bfloat16()  # SmolLM2's 9 q + 3 k heads, rotated in one call
    cos, sin = torch.rand(rows, 32, generator=gen), torch.rand(rows, 32, generator=gen)
    rot = torch.empty_like(qk)
    threads = torch.get_num_threads()  # the kernels run single-threaded below their grain size
    return [("rmsnorm+residual", lambda m: m.rmsnorm(x, r, w, out, res, True, 1e-5, threads)),
            ("silu_and_mul", lambda m: m.silu_and_mul(g, s, threads)),
            ("rotary (neox)", lambda m: m.rotary(qk, cos, sin, rot, 64, True, threads))]


def measure(mods: dict, rows_list: list[int], reps: int) -> list[dict]:
    """One run: every kernel at every row count, the tiers interleaved; median us per tier and
    its ratio to the baseline tier."""
    results = []
    for rows in rows_list:
        for name, call in cases(rows, 576, 1536):
            samples = {t: [] for t in mods}
            for m in mods.values():
                for _ in range(50):
                    call(m)
            for _ in range(reps):
                for t, m in mods.items():
                    start = time.perf_counter()
                    call(m)
                    samples[t].append((time.perf_counter() - start) * 1e6)
            us = {t: statistics.median(v) for t, v in samples.items()}
            results.append({"op": name, "rows": rows, "us": us,
                            "ratio_to_baseline": {t: v / us["baseline"] for t, v in us.items()}})
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 230])
    ap.add_argument("--reps", type=int, default=400)
    ap.add_argument("--runs", type=int, default=3, help="whole measurements; the table shows median ratios")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "cpu_small_ops.json"))
    args = ap.parse_args()
    tiers = list(cpu_kernels.runnable_isas())
    mods = {t: cpu_kernels.load_cpu_module(t) for t in tiers}
    runs = [measure(mods, args.rows, args.reps) for _ in range(args.runs)]
    table = [{"op": r["op"], "rows": r["rows"],
              "median_ratio_to_baseline": {t: statistics.median(run[i]["ratio_to_baseline"][t] for run in runs)
                                           for t in tiers}}
             for i, r in enumerate(runs[0])]
    print(f"{'op':<18}{'rows':>5}   median ratio to baseline over {args.runs} runs: " + " ".join(tiers))
    for r in table:
        print(f"{r['op']:<18}{r['rows']:>5}   " + " ".join(f"{r['median_ratio_to_baseline'][t]:.2f}" for t in tiers))
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent).stdout.strip()
    record = {"benchmark": "cpu_small_ops", "command": " ".join(["benchmark/cpu/bench_small_ops.py", *sys.argv[1:]]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "cpu": _cpu_model(), "git_commit": commit, "threads": torch.get_num_threads(),
              "torch": torch.__version__, "tiers": tiers, "table": table, "runs": runs}
    Path(args.out).write_text(json.dumps(record, indent=1))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
