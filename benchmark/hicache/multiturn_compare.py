"""`bench_multiturn.py --compare A.json B.json`: mean TTFT ratio B/A, cached tokens per tier
(device, host, storage) and whether the two runs produced identical outputs."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any




def compare(path_a: str, path_b: str) -> dict[str, Any]:
    """A = baseline (e.g. without HiCache or without a storage tier), B = candidate: TTFT ratio and output identity."""
    a, b = (json.loads(Path(p).read_text()) for p in (path_a, path_b))
    ra = {(r["client"], r["round"]): r for r in a["requests"]}
    rb = {(r["client"], r["round"]): r for r in b["requests"]}
    keys = sorted(set(ra) | set(rb))
    out_key = "output_ids" if a["args"]["api_format"] == "native" else "output_text"
    same = [k for k in keys if k in ra and k in rb and ra[k]["success"] and rb[k]["success"]
            and ra[k][out_key] == rb[k][out_key]]
    diff = [k for k in keys if k not in same]
    first_div: dict[int, int] = {}
    for c, rnd in diff:
        first_div[c] = min(first_div.get(c, rnd), rnd)
    ma, mb = a["metrics"], b["metrics"]
    ratio = mb["mean_ttft_ms"] / ma["mean_ttft_ms"] if ma["mean_ttft_ms"] else None
    result = {
        "a": {"file": path_a, "label": a.get("label")}, "b": {"file": path_b, "label": b.get("label")},
        "mean_ttft_ms": {"a": ma["mean_ttft_ms"], "b": mb["mean_ttft_ms"]},
        "median_ttft_ms": {"a": ma["median_ttft_ms"], "b": mb["median_ttft_ms"]},
        "p90_ttft_ms": {"a": ma["p90_ttft_ms"], "b": mb["p90_ttft_ms"]},
        "mean_e2e_latency_ms": {"a": ma["mean_e2e_latency_ms"], "b": mb["mean_e2e_latency_ms"]},
        "duration_s": {"a": ma["duration_s"], "b": mb["duration_s"]},
        "request_throughput": {"a": ma["request_throughput"], "b": mb["request_throughput"]},
        "ttft_ratio_b_over_a": ratio,
        "cache_hit_rate": {"a": ma["cache_hit_rate"], "b": mb["cache_hit_rate"]},
        "cached_tokens_device": {"a": ma["cached_tokens_device"], "b": mb["cached_tokens_device"]},
        "cached_tokens_host": {"a": ma["cached_tokens_host"], "b": mb["cached_tokens_host"]},
        "cached_tokens_storage": {"a": ma.get("cached_tokens_storage"), "b": mb.get("cached_tokens_storage")},
        "per_round_mean_ttft_ms": [
            {"round": x["round"], "a": x["mean_ttft_ms"], "b": y["mean_ttft_ms"]}
            for x, y in zip(ma["per_round"], mb["per_round"])],
        "requests": len(keys),
        "identical_outputs": len(same),
        "all_outputs_identical": not diff,
        "first_divergent_round_per_client": {str(c): r + 1 for c, r in sorted(first_div.items())},
        "machine": a.get("machine"), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    return result


def format_compare(c: dict[str, Any]) -> str:
    def num(v, fmt="{:.1f}"):
        return "n/a" if v is None else fmt.format(v)

    la, lb = c["a"]["label"] or "A", c["b"]["label"] or "B"
    w = max(12, len(la), len(lb)) + 2
    lines = [f"{'':<34}{la:>{w}}{lb:>{w}}"]
    for title, key, fmt in (("mean TTFT (ms)", "mean_ttft_ms", "{:.1f}"),
                            ("median TTFT (ms)", "median_ttft_ms", "{:.1f}"),
                            ("p90 TTFT (ms)", "p90_ttft_ms", "{:.1f}"),
                            ("mean E2E latency (ms)", "mean_e2e_latency_ms", "{:.1f}"),
                            ("duration (s)", "duration_s", "{:.1f}"),
                            ("request throughput (req/s)", "request_throughput", "{:.3f}"),
                            ("cache hit rate", "cache_hit_rate", "{:.3f}"),
                            ("cached tokens device", "cached_tokens_device", "{}"),
                            ("cached tokens host", "cached_tokens_host", "{}"),
                            ("cached tokens storage", "cached_tokens_storage", "{}")):
        lines.append(f"{title:<34}{num(c[key]['a'], fmt):>{w}}{num(c[key]['b'], fmt):>{w}}")
    for r in c["per_round_mean_ttft_ms"]:
        lines.append(f"{'  round ' + str(r['round']) + ' mean TTFT (ms)':<34}"
                     f"{num(r['a']):>{w}}{num(r['b']):>{w}}")
    lines.append(f"{'TTFT ratio ' + lb + '/' + la:<34}{num(c['ttft_ratio_b_over_a'], '{:.3f}'):>{w}}")
    lines.append(f"{'identical outputs':<34}{str(c['identical_outputs']) + '/' + str(c['requests']):>{w}}"
                 f"  ({'all identical' if c['all_outputs_identical'] else 'NOT all identical'})")
    if c["first_divergent_round_per_client"]:
        lines.append(f"first divergent round per client: {c['first_divergent_round_per_client']}")
    return "\n".join(lines)
