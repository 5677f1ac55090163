"""Single-stream decode of `make serve` defaults alone and next to another OpenMP program on the
same cores, under each OpenMP wait policy.

OpenMP threads spin at a barrier before they sleep (libgomp: `GOMP_SPINCOUNT`, 300 000 spins by
default). On cores another busy OpenMP program also spins on, each program's threads wait for
threads the kernel has parked behind the other's spinners, and both can slow by 10-100x. This
measures, per policy (the default, `OMP_WAIT_POLICY=passive`, a short `GOMP_SPINCOUNT`), the
server's time per output token (32 tokens, greedy, ignore_eos; median of 3 requests) alone and
while a torch process multiplies 256 x 256 matrices in a loop on the same cores (its own
defaults), in --trials separate starts of that process: the outcome is bistable (on the 2-core
AMX Xeon the default took ~20 ms a token in some starts and ~720 ms in others). The server is
started as the same-run comparison starts it (`engines.hiserve_spec`, `engines.RunningEngine`).

    python benchmark/cpu/bench_core_sharing.py [--out benchmark/results/cpu_core_sharing.json]

Prints a table; the JSON holds the command, CPU (lscpu: model, flags), the server's command and
version, date and every figure.
"""

from __future__ import annotations

import argparse
import json
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

POLICIES = {"default": {}, "OMP_WAIT_POLICY=passive": {"OMP_WAIT_POLICY": "passive"},
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=30017)
    ap.add_argument("--out", default=None)
    ap.add_argument("--log-dir", default="/tmp")
    ap.add_argument("--trials", type=int, default=8, help="starts of the other program per policy")
    args = ap.parse_args()
    rows = {}
    for name, extra in POLICIES.items():
        rows[name] = run_policy(extra, args.port, Path(args.log_dir) / f"core_sharing_{len(rows)}.log",
                                args.trials)
    base = rows["default"]["alone_ms_per_token"]
    print(f"{'policy':<26} {'alone ms/tok':>13} {'shared best':>12} {'shared worst':>13} {'alone / default':>16}")
    for name, r in rows.items():
        r["alone_over_default_alone"] = r["alone_ms_per_token"] / base
        print(f"{name:<26} {r['alone_ms_per_token']:>13.1f} {r['shared_best']:>12.1f} {r['shared_worst']:>13.1f} "
              f"{r['alone_over_default_alone']:>16.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "benchmark": "cpu_core_sharing", "command": " ".join(["python"] + sys.argv),
            "date": datetime.now(timezone.utc).isoformat(), "cpu": lscpu(), "hiserve": hiserve_spec(args.port).version,
            "trials": args.trials, "other_program": HOG, "policies": rows}, indent=1))


if __name__ == "__main__":
    main()
