"""A/B in one process: DECODE steps through the CPU decode loop against the same steps through
the modules (`hiserve/models/cpu_decode_loop.py`), on `make serve` defaults.

Builds the scheduler as the server does (`bench_scheduler_steps.Driver`), brings `--batch`
requests of `--prompt` tokens into steady decode, then times whole scheduler steps (schedule +
forward + sample + output, wall clock) alternating the two forms step by step (ABBA), so noise
hits both alike. Each batch size gets its own requests. Also checks, on one extra step per
batch size, that both forms give bit-identical logits. Prints a table and writes JSON (command,
CPU model, date, tree, figures). Run it on a quiet machine:

    PYTHONPATH=$PWD python benchmark/cpu/ab_decode_loop.py [--batch 1 16] [--steps 60] \\
        [--out benchmark/results/cpu_decode_loop_ab.json]
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
from bench_scheduler_steps import Driver, _cpu_model  # noqa: E402
from profile_decode_step import steady_decode  # noqa: E402


def same_logits(d: Driver) -> bool:
    """One more decode batch's logits through both forms (the KV writes of the second
    run repeat the first's values in the same slots)."""
    s = d.sched
    runner, inner = s.model_runner, s.model_runner.model.model
    batch = s.get_next_batch_to_run()
    fb = runner.make_forward_batch(batch)
    loop = inner.decode_loop
    try:
        with_loop = runner.run_forward(fb).clone()
        inner.decode_loop = None
        with_modules = runner.run_forward(fb).clone()
    finally:
        inner.decode_loop = loop
    s.run_batch(batch)  # the step completes as usual
    s.outbox.clear()
    return bool(torch.equal(with_loop, with_modules))


def ab(d: Driver, batch: int, prompt: int, steps: int) -> dict:
    """Median step (ms) of each form over `steps` alternating steps at `batch` requests."""
    inner = d.sched.model_runner.model.model
    loop = inner.decode_loop
    steady_decode(d, batch, prompt, 2 * steps + 16)
    identical = same_logits(d)
    times = {"modules": [], "loop": []}
    try:
        for i in range(2 * steps):
            form = "loop" if i % 4 in (0, 3) else "modules"  # ABBA: neither form always goes first
            inner.decode_loop = loop if form == "loop" else None
            times[form].append(d.step()[1])
    finally:
        inner.decode_loop = loop
    while d.busy():  # finish these requests before the next batch size
        d.step()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"batch": batch, "prompt": prompt, "steps_each": steps, "modules_ms": med["modules"],
            "loop_ms": med["loop"], "ratio": med["loop"] / med["modules"], "identical_logits": identical}


def main() -> None:
    """Parse the flags, run the A/B per batch size, print the table, write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt", type=int, default=300)
    ap.add_argument("--steps", type=int, default=60, help="timed steps of each form per batch size")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    d = Driver(time.perf_counter)
    if d.sched.model_runner.model.model.decode_loop is None:
        sys.exit("the CPU decode loop is not attached here (see the server log line 'CPU decode loop: off')")
    rows = [ab(d, b, args.prompt, args.steps) for b in args.batch]
    print(f"{'batch':>5} {'modules ms':>11} {'loop ms':>8} {'loop/modules':>13} {'same logits':>12}")
    for r in rows:
        print(f"{r['batch']:>5} {r['modules_ms']:>11.2f} {r['loop_ms']:>8.2f} {r['ratio']:>13.3f} "
              f"{str(r['identical_logits']):>12}")
    tree = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent).stdout.strip()
    out = {"command": " ".join(sys.argv), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "cpu": _cpu_model(), "threads": torch.get_num_threads(), "tree": tree,
           "clock": "wall, whole scheduler steps, forms alternating step by step (ABBA)", "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
