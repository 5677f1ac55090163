"""Helpers of `run_scaleout_ab.sh`: per-replica figures and the summary of the A/B.

    scaleout_replicas.py --output-file RUN.json URL...   add each replica's request count,
        cached tokens by source, storage counters and failures (its /metrics and
        /get_server_info) to a bench_multiturn result, as "replicas"
    scaleout_replicas.py --summarize AB.json --commands FILE --pool-tokens N [--note TEXT]
        add to bench_multiturn's --compare output: the commands run, lscpu's CPU model, the
        working set against one replica's device + host pools, the replicas' figures of both
        runs, the target (mean TTFT ratio <= 0.5) and whether it was met; print a summary
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path
from typing import Any

import httpx

TTFT_RATIO_TARGET = 0.5


def metric_samples(text: str, name: str) -> dict[str, float]:
    """Samples of one Prometheus metric keyed by their label text ("" when unlabelled)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            labels, value = line[len(name):].rsplit(" ", 1)
            out[labels.strip()] = out.get(labels.strip(), 0.0) + float(value)
    return out


def replica_figures(url: str) -> dict[str, Any]:
    """One replica's counters since start (it served exactly one bench run)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    cached = metric_samples(text, "sglang:cached_tokens_total")
    info = httpx.get(url + "/get_server_info", timeout=30).json()
    storage = (info.get("internal_states") or [{}])[0].get("storage")
    return {"url": url,
            "requests": sum(metric_samples(text, "sglang:num_requests_total").values()),
            "cached_tokens": {src: sum(v for k, v in cached.items() if f'cache_source="{src}"' in k)
                              for src in ("device", "host", "storage")},
            "storage_failures": metric_samples(text, "sglang:storage_failures_total"),
            "storage": storage and {k: storage.get(k) for k in (
                "backend", "connected", "prefetch_policy", "prefetched_tokens_total",
                "backuped_tokens_total", "pages_read", "pages_written", "pages_skipped", "failures")}}


def working_set(run: dict) -> int:
    """Tokens of every conversation's full context at its end (last prompt + its output)."""
    last: dict[int, dict] = {}
    for r in run["requests"]:
        if r["success"] and r["round"] >= last.get(r["client"], {"round": -1})["round"]:
            last[r["client"]] = r
    return sum(r["prompt_tokens"] + r["output_tokens"] for r in last.values())


def cpu_model() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return next((line.split(":", 1)[1].strip() for line in text.splitlines()
                 if line.startswith("Model name")), "unknown")


def summarize(path: Path, commands: Path, pool_tokens: int, note: str) -> dict[str, Any]:
    ab = json.loads(path.read_text())
    runs = {k: json.loads(Path(ab[k]["file"]).read_text()) for k in ("a", "b")}
    ws = working_set(runs["a"])
    ratio = ab["ttft_ratio_b_over_a"]
    ab.update({
        "benchmark": "bench_multiturn --api-format native through sglang-router (cache_aware) to two "
                     "hiserve replicas; a = without a storage tier, b = with one shared Mooncake Store",
        "commands": commands.read_text().splitlines() + [ab.get("command", "")],
        "cpu_model": cpu_model(),
        "replica_pool_tokens": pool_tokens,
        "working_set_tokens": ws,
        "working_set_over_replica_pools": ws / pool_tokens,
        "replicas": {k: runs[k].get("replicas") for k in ("a", "b")},
        "ttft_ratio_target": TTFT_RATIO_TARGET,
        "ttft_ratio_target_met": ratio is not None and ratio <= TTFT_RATIO_TARGET,
        "note": note,
    })
    path.write_text(json.dumps(ab, indent=1, default=str) + "\n")
    return ab


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("urls", nargs="*")
    p.add_argument("--output-file")
    p.add_argument("--summarize")
    p.add_argument("--commands")
    p.add_argument("--pool-tokens", type=int, default=0)
    p.add_argument("--note", default="")
    a = p.parse_args()
    if a.summarize:
        ab = summarize(Path(a.summarize), Path(a.commands), a.pool_tokens, a.note)
        print(f"CPU: {ab['cpu_model']}")
        print(f"working set {ab['working_set_tokens']} tokens = {ab['working_set_over_replica_pools']:.2f}x "
              f"one replica's device+host pools ({ab['replica_pool_tokens']})")
        for k in ("a", "b"):
            for r in ab["replicas"][k] or []:
                print(f"  {ab[k]['label']}: {r['url']} requests={r['requests']:.0f} cached={r['cached_tokens']}")
        print(f"mean TTFT ratio with/without store: {ab['ttft_ratio_b_over_a']:.3f} "
              f"(target <= {TTFT_RATIO_TARGET}: {'met' if ab['ttft_ratio_target_met'] else 'NOT met'})")
        return
    path = Path(a.output_file)
    run = json.loads(path.read_text())
    run["replicas"] = [replica_figures(u) for u in a.urls]
    path.write_text(json.dumps(run, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
