"""Single-stream decode of `make serve` defaults alone and next to another OpenMP program on the
same cores, under each OpenMP wait policy; with --steps / --served, what a short spin costs alone.

OpenMP threads spin at a barrier before they sleep (libgomp: `GOMP_SPINCOUNT`, 300 000 spins by
default, which hiserve keeps). On cores another busy OpenMP program also spins on, each program's
threads wait for threads the kernel has parked behind the other's spinners, and both can slow by
10-100x. This measures, per policy (libgomp's default, `OMP_WAIT_POLICY=passive`,
`GOMP_SPINCOUNT=10000`), the server's time per output token (32 tokens, greedy, ignore_eos; median of 3 requests) alone and
while a torch process multiplies 256 x 256 matrices in a loop on the same cores (its own
defaults), in --trials separate starts of that process: the outcome is bistable (on the 2-core
AMX Xeon libgomp's default took ~20 ms a token in some starts and ~720 ms in others). The server
is started as the same-run comparison starts it (`engines.hiserve_spec`, `engines.RunningEngine`).

--steps: `bench_scheduler_steps.py` (in process, no HTTP, no other program) in fresh processes
under GOMP_SPINCOUNT=300000 and 10000, alternating for --rounds: decode steps at batch 1 and 16,
a 200-token prefill and scenario (c)'s mean TTFT; medians and their ratio.
--served: the same-run comparison's scenario (a) and (b) at concurrency 16 (`compare.py`'s
levels and client) against the server under each spin count, alternating for --rounds.
--no-sharing skips the measurement beside the other program.

    python benchmark/cpu/bench_core_sharing.py [--steps] [--served] [--no-sharing] [--out FILE.json]

Prints a table; the JSON holds the command, CPU (lscpu: model, flags), the server's command and
version, date and every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_linear import lscpu  # noqa: E402
from engines import RunningEngine, hiserve_spec  # noqa: E402

LIBGOMP_DEFAULT = "libgomp default (GOMP_SPINCOUNT=300000)"
POLICIES = {LIBGOMP_DEFAULT: {"GOMP_SPINCOUNT": "300000"}, "OMP_WAIT_POLICY=passive": {"OMP_WAIT_POLICY": "passive"},
            "GOMP_SPINCOUNT=10000": {"GOMP_SPINCOUNT": "10000"}}
HOG = "import torch\nwhile True:\n    torch.mm(torch.randn(256, 256), torch.randn(256, 256))\n    torch.randn(64).sum()\n"


def _ms_per_token(base_url: str, n: int = 3) -> float:
    """Median wall ms per output token of n sequential 32-token completions."""
    body = {"model": "default", "prompt": "Tell me a long story about a dragon and a knight.",
            "max_tokens": 32, "temperature": 0, "ignore_eos": True}
    out = []
    for _ in range(n):
        start = time.perf_counter()
        r = httpx.post(base_url + "/v1/completions", json=body, timeout=600)
        r.raise_for_status()
        out.append((time.perf_counter() - start) * 1e3 / r.json()["usage"]["completion_tokens"])
    return statistics.median(out)


def run_policy(env_extra: dict[str, str], port: int, log: Path, trials: int) -> dict:
    """Start the server with env_extra, measure alone, then next to `trials` starts of the torch
    process (each trial's median ms per token)."""
    spec = hiserve_spec(port)
    spec.env.update(env_extra)
    with RunningEngine(spec, log) as engine:
        _ms_per_token(engine.base_url, 1)  # warm-up
        alone, shared = _ms_per_token(engine.base_url), []
        for _ in range(trials):
            hog = subprocess.Popen([sys.executable, "-c", HOG])
            try:
                time.sleep(2)
                shared.append(_ms_per_token(engine.base_url))
            finally:
                hog.kill()
                hog.wait()
    return {"server": spec.shell_command(), "alone_ms_per_token": alone, "shared_trials_ms_per_token": shared,
            "shared_best": min(shared), "shared_worst": max(shared)}


def steps(rounds: int) -> dict:
    """In-process scheduler timings under libgomp's spin and hiserve's, alternating (ABBA)."""
    script = Path(__file__).resolve().parent / "bench_scheduler_steps.py"
    spins = ("300000", "10000")
    figures: dict[str, dict[str, list[float]]] = {spin: {} for spin in spins}
    for r in range(rounds):
        for spin in spins if r % 2 == 0 else spins[::-1]:
            path = Path(f"/tmp/bench_core_sharing_steps_{spin}.json")
            env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | {"GOMP_SPINCOUNT": spin}
            subprocess.run([sys.executable, str(script), "--clock", "wall", "--batch", "16", "--out", str(path)],
                           env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            d = json.loads(path.read_text())
            for key, value in (("decode_step_b1_ms", d["single"]["decode_step_ms"]),
                               ("decode_step_b16_ms", d["batched"]["decode_step_ms"]),
                               ("prefill_200_ms", d["single"]["prefill_200_ms"]),
                               ("scenario_c_ttft_mean_ms", d["shared_prefix"]["ttft_mean_ms"])):
                figures[spin].setdefault(key, []).append(value)
    med = {spin: {k: statistics.median(v) for k, v in f.items()} for spin, f in figures.items()}
    return {"rounds": rounds, "samples": figures, "medians": med,
            "ratio_10000_over_300000": {k: med["10000"][k] / med["300000"][k] for k in med["10000"]}}


def served(rounds: int) -> dict:
    """compare.py's (a) and (b) c=16 levels against the server under each spin count (ABBA)."""
    import compare  # the comparison's harness: its client, levels and engine start
    import scenarios

    from hiserve.models.loader import default_model_path

    gguf, spins = default_model_path(), ("300000", "10000")
    levels = [lv for lv in scenarios.levels(False) if (lv.scenario, lv.concurrency) in (("a", 1), ("b", 16))]
    figures: dict[str, dict[str, list[float]]] = {spin: {} for spin in spins}
    for r in range(rounds):
        for spin in spins if r % 2 == 0 else spins[::-1]:
            spec = hiserve_spec()
            spec.env["GOMP_SPINCOUNT"] = spin
            out = compare.measure_engine(spec, gguf, levels, 0, Path("/tmp/bench_core_sharing_served"), None, None, 0)
            a, b16 = out["levels"]["a_c1"], out["levels"]["b_c16"]
            for key, value in (("a_tpot_median_ms", a["median_tpot_ms"]), ("a_ttft_mean_ms", a["mean_ttft_ms"]),
                               ("b_c16_output_tok_s", b16["output_throughput"])):
                figures[spin].setdefault(key, []).append(value)
    med = {spin: {k: statistics.median(v) for k, v in f.items()} for spin, f in figures.items()}
    return {"rounds": rounds, "samples": figures, "medians": med,
            "ratio_10000_over_300000": {k: med["10000"][k] / med["300000"][k] for k in med["10000"]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=30017)
    ap.add_argument("--out", default=None)
    ap.add_argument("--log-dir", default="/tmp")
    ap.add_argument("--trials", type=int, default=8, help="starts of the other program per policy")
    ap.add_argument("--steps", action="store_true", help="also in-process scheduler timings per spin count")
    ap.add_argument("--served", action="store_true", help="also served (a) and (b) c=16 per spin count")
    ap.add_argument("--no-sharing", action="store_true", help="skip the runs beside the other program")
    ap.add_argument("--rounds", type=int, default=6, help="for --steps / --served: runs per spin count")
    args = ap.parse_args()
    rows = {}
    for name, extra in ({} if args.no_sharing else POLICIES).items():
        rows[name] = run_policy(extra, args.port, Path(args.log_dir) / f"core_sharing_{len(rows)}.log",
                                args.trials)
    base = rows[LIBGOMP_DEFAULT]["alone_ms_per_token"] if rows else 1.0
    print(f"{'policy':<40} {'alone ms/tok':>13} {'shared best':>12} {'shared worst':>13} {'alone / libgomp':>16}")
    for name, r in rows.items():
        r["alone_over_libgomp_default_alone"] = r["alone_ms_per_token"] / base
        print(f"{name:<40} {r['alone_ms_per_token']:>13.1f} {r['shared_best']:>12.1f} {r['shared_worst']:>13.1f} "
              f"{r['alone_over_libgomp_default_alone']:>16.2f}")
    step = steps(args.rounds) if args.steps else None
    if step:
        print("in process, medians of", args.rounds, "runs each:")
        for key, ratio in step["ratio_10000_over_300000"].items():
            print(f"  {key:<26} spin 300000 {step['medians']['300000'][key]:>8.2f}  spin 10000 "
                  f"{step['medians']['10000'][key]:>8.2f}  ratio {ratio:.3f}")
    serve = served(args.rounds) if args.served else None
    if serve:
        print("served, medians of", args.rounds, "starts each:")
        for key, ratio in serve["ratio_10000_over_300000"].items():
            print(f"  {key:<26} spin 300000 {serve['medians']['300000'][key]:>8.2f}  spin 10000 "
                  f"{serve['medians']['10000'][key]:>8.2f}  ratio {ratio:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "benchmark": "cpu_core_sharing", "command": " ".join(["python"] + sys.argv),
            "date": datetime.now(timezone.utc).isoformat(), "cpu": lscpu(), "hiserve": hiserve_spec(args.port).version,
            "trials": args.trials, "other_program": HOG, "policies": rows, "steps": step, "served": serve}, indent=1))


if __name__ == "__main__":
    main()
