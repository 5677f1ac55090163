"""The CPU's prefill batch budget (`--max-prefill-tokens`) against time-to-first-token and
throughput, in process (no HTTP), interleaved, on `make serve` defaults.

One scheduler per budget is built as the server builds it (`bench_scheduler_steps.Driver`) and
each round runs, for every budget in turn:

- (b) at concurrency 16: 32 requests of 300 random prompt tokens and 128 output tokens
  (ignore_eos), 16 in flight, a new one arriving when one finishes: output tokens per second
  of wall time, and the mean TTFT (arrival to the step that emits the first token);
- (c): scenario (c) of benchmark/cpu/scenarios.py in a closed loop (`shared_prefix`): 32 chat
  requests sharing a ~1000-token system prompt, 8 in flight; the mean TTFT.

Prints a table (per round, then the means and their ratios to the first budget) and writes JSON
(command, CPU model, date, every figure) under benchmark/results/. Run it on a quiet machine:
the rounds interleave the budgets so a slow minute hits all of them.

    PYTHONPATH=$PWD python benchmark/cpu/bench_prefill_budget.py --budgets 16384 256 --rounds 4
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scheduler_steps import Driver, _cpu_model, run_closed_loop, shared_prefix  # noqa: E402


def closed_loop(d: Driver, concurrency: int = 16, num: int = 32, prompt: int = 300, out: int = 128) -> dict:
    """Scenario (b) at one concurrency: output tok/s (wall) and mean TTFT in ms (`d` must time
    with the wall clock, as main() builds it)."""
    rng = random.Random(1)
    prompts = [[rng.randrange(1000, 20000) for _ in range(prompt)] for _ in range(num)]
    t0 = time.perf_counter()
    ttft, _ = run_closed_loop(d, prompts, concurrency, out)
    elapsed = time.perf_counter() - t0
    d.sched.flush_cache()
    return {"output_tok_s": num * out / elapsed, "ttft_mean_ms": statistics.mean(ttft)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", type=int, nargs="+", default=[16384, 256],
                    help="--max-prefill-tokens values; ratios are to the first")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parents[1] / "results"))
    ap.add_argument("--name", default="cpu_prefill_budget_ab")
    args = ap.parse_args()
    drivers = {b: Driver(time.perf_counter, max_prefill_tokens=b) for b in args.budgets}
    for d in drivers.values():  # warm-up: kernels built, allocator primed, both scenarios' shapes seen
        shared_prefix(d, num=8)
        closed_loop(d, num=16, out=8)
    rows = []
    for rnd in range(args.rounds):
        for b, d in drivers.items():
            b16 = closed_loop(d)
            c = shared_prefix(d)
            rows.append({"round": rnd, "max_prefill_tokens": b, "b_c16_output_tok_s": b16["output_tok_s"],
                         "b_c16_ttft_mean_ms": b16["ttft_mean_ms"], "c_ttft_mean_ms": c["ttft_mean_ms"]})
            print(f"round {rnd}  budget {b:6d}  (b) c=16 {b16['output_tok_s']:6.1f} tok/s, TTFT mean "
                  f"{b16['ttft_mean_ms']:6.0f} ms  |  (c) TTFT mean {c['ttft_mean_ms']:5.0f} ms", flush=True)
    keys = ("b_c16_output_tok_s", "b_c16_ttft_mean_ms", "c_ttft_mean_ms")
    means = {b: {k: statistics.mean(r[k] for r in rows if r["max_prefill_tokens"] == b) for k in keys}
             for b in args.budgets}
    base = means[args.budgets[0]]
    ratios = {b: {k: m[k] / base[k] for k in keys} for b, m in means.items()}
    print("\n| --max-prefill-tokens | (b) c=16 tok/s | (b) TTFT mean ms | (c) TTFT mean ms |")
    print("|---:|---:|---:|---:|")
    for b in args.budgets:
        m, r = means[b], ratios[b]
        print(f"| {b} | {m[keys[0]]:.1f} ({r[keys[0]]:.2f}x) | {m[keys[1]]:.0f} ({r[keys[1]]:.2f}x) | "
              f"{m[keys[2]]:.0f} ({r[keys[2]]:.2f}x) |")
    import torch

    record = {"command": "python " + " ".join(sys.argv), "date": datetime.datetime.now(datetime.timezone.utc)
              .isoformat(timespec="seconds"), "cpu": _cpu_model(), "threads": torch.get_num_threads(),
              "settings": vars(args), "rows": rows, "means": means, "ratios_to_first": ratios}
    path = Path(args.out_dir) / f"{args.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
