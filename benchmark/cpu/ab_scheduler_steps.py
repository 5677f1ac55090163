"""A/B of two checkouts with `bench_scheduler_steps.py`, interleaved, in one sitting.

Runs the scheduler-level benchmark (`make serve` defaults, in process, no HTTP) with PYTHONPATH at
each checkout in turn, `--rounds` times, the order swapped every round (so a noisy host hits both
alike), and reports the median over rounds of each figure and after / before.

    python benchmark/cpu/ab_scheduler_steps.py --before /tmp/base --after . --rounds 3 \
        --out benchmark/results/x.json

Prints a table; the JSON holds every round's figures, both commits, the command, CPU and date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scheduler_steps import _cpu_model  # noqa: E402

FIGURES = {  # name -> path in bench_scheduler_steps' JSON
    "single-stream decode step ms": ("single", "decode_step_ms"),
    "prefill of 200 tokens ms": ("single", "prefill_200_ms"),
    "(c) shared-prefix TTFT mean ms": ("shared_prefix", "ttft_mean_ms"),
    "decode step at 16 requests ms": ("batched", "decode_step_ms"),
}


def run_once(tree: Path, python: str, args: list[str]) -> dict:
    """One bench_scheduler_steps run with PYTHONPATH at `tree`; its JSON."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [python, str(tree / "benchmark/cpu/bench_scheduler_steps.py"), *args, "--out", out.name]
        subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": str(tree)}, stdout=subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text())


def cpu_flags() -> list[str]:
    """The lscpu flags that change hiserve's CPU kernel choices."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    flags = next((ln.split(":", 1)[1].split() for ln in out.splitlines() if ln.startswith("Flags")), [])
    return [f for f in flags if f.startswith(("amx", "avx512", "avx2", "fma", "f16c"))]


def commit_of(tree: Path) -> str:
    return subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, type=Path)
    ap.add_argument("--after", required=True, type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bench-args", default="--clock wall --repeats 3 --batch 16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for i in range(args.rounds):
        for side in (("before", "after") if i % 2 == 0 else ("after", "before")):  # no order bias
            runs[side].append(run_once(getattr(args, side).resolve(), sys.executable, args.bench_args.split()))
    table = {}
    print(f"{'figure':<34} {'before':>9} {'after':>9} {'after/before':>13}")
    for name, (part, key) in FIGURES.items():
        b = statistics.median(r[part][key] for r in runs["before"])
        a = statistics.median(r[part][key] for r in runs["after"])
        table[name] = {"before": b, "after": a, "ratio": a / b}
        print(f"{name:<34} {b:9.1f} {a:9.1f} {a / b:13.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "benchmark": "cpu_scheduler_steps A/B (ab_scheduler_steps.py)", "command": " ".join(sys.argv),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu": _cpu_model(), "cpu_flags": cpu_flags(), "cores": os.cpu_count(),
            "before_commit": commit_of(args.before), "after_commit": commit_of(args.after),
            "bench_args": args.bench_args, "medians_over_rounds": table, "rounds": runs}, indent=1))


if __name__ == "__main__":
    main()
