"""Put two runs of benchmark/cpu_scenarios.sh side by side and check the serving-core targets.

    python benchmark/compare_cpu.py --ours hiserve --baseline vllm_cpu

Reads benchmark/results/<label>_{A,B,C}.json, prints a table of the target figures as
ratios ours / baseline (both measured in the same session on the same machine), and
writes benchmark/results/cpu_comparison.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime, timezone

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# (name, scenario, concurrency, metric, target ratio, direction): "max" = ours/baseline must
# stay at or below the target, "min" = at or above it.
TARGETS = [
    ("single-stream TPOT (ms, median)", "A", 1, "median_tpot_ms", 0.8, "max"),
    ("concurrency-16 output throughput (tok/s)", "B", 16, "output_throughput", 1.5, "min"),
    ("shared-prefix mean TTFT (ms)", "C", 8, "mean_ttft_ms", 0.5, "max"),
]
REPORTED = [
    ("A", 1, "mean_ttft_ms"), ("A", 1, "median_tpot_ms"),
    ("B", 1, "output_throughput"), ("B", 1, "median_tpot_ms"),
    ("B", 4, "output_throughput"), ("B", 4, "median_tpot_ms"),
    ("B", 16, "output_throughput"), ("B", 16, "median_tpot_ms"), ("B", 16, "mean_ttft_ms"),
    ("C", 8, "mean_ttft_ms"), ("C", 8, "output_throughput"), ("C", 8, "cache_hit_rate"),
]


def load_level(label: str, scenario: str, concurrency: int) -> dict:
    path = os.path.join(RESULTS, f"{label}_{scenario}.json")
    with open(path) as f:
        doc = json.load(f)
    for level in doc["results"]:
        if level["concurrency"] == concurrency:
            if level["failed"]:
                raise SystemExit(f"{path}: {level['failed']} failed requests at concurrency {concurrency}")
            return level
    raise SystemExit(f"{path}: no concurrency {concurrency}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ours", default="hiserve")
    p.add_argument("--baseline", default="vllm_cpu")
    p.add_argument("--output-file", default=os.path.join(RESULTS, "cpu_comparison.json"))
    args = p.parse_args(argv)

    rows = []
    print(f"{'scenario':<9}{'conc':>5}  {'metric':<22}{args.ours:>12}{args.baseline:>12}{'ratio':>8}")
    for scen, conc, metric in REPORTED:
        # A figure a server does not report (e.g. cached tokens without usage details) is NaN.
        a = load_level(args.ours, scen, conc).get(metric)
        b = load_level(args.baseline, scen, conc).get(metric)
        a, b = (float("nan") if x is None else x for x in (a, b))
        ratio = a / b if b else float("nan")
        rows.append({"scenario": scen, "concurrency": conc, "metric": metric,
                     args.ours: a, args.baseline: b, "ratio": ratio})
        print(f"{scen:<9}{conc:>5}  {metric:<22}{a:>12.2f}{b:>12.2f}{ratio:>8.2f}")

    print("\nTargets (ratio ours / baseline, same machine, same session):")
    verdicts = []
    for name, scen, conc, metric, target, direction in TARGETS:
        ratio = load_level(args.ours, scen, conc)[metric] / load_level(args.baseline, scen, conc)[metric]
        met = ratio <= target if direction == "max" else ratio >= target
        sign = "<=" if direction == "max" else ">="
        verdicts.append({"target": name, "ratio": ratio, "goal": f"{sign} {target}", "met": met})
        print(f"  {name:<42} {ratio:6.2f}  (goal {sign} {target})  {'MET' if met else 'NOT MET'}")

    with open(os.path.join(RESULTS, f"{args.ours}_A.json")) as f:
        machine = json.load(f).get("machine")
    doc = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]),
           "date": datetime.now(timezone.utc).isoformat(), "machine": machine,
           "rows": rows, "targets": verdicts}
    with open(args.output_file, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"\nwrote {args.output_file}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
