"""Peak resident memory (VmHWM) of the server's processes: GGUF-native int4 vs dequantized bf16.

Starts the server (test/e2e/server.py's launcher: `python -m hiserve.launch_server`) with
`--dtype bfloat16` for `--quantization none`, `gguf` (int4 + the dense copy for many rows, the
default) and `gguf` with HISERVE_GGUF_DENSE_COPY=0 (int4 only), waits for /health (after warm-up), runs a few
chat requests, then reads VmHWM and VmRSS of every process in the server's session from
/proc and stops it. The scheduler process holds the weights and the KV pool.

    python benchmark/cpu/bench_linear_rss.py [--extra-args "--max-total-tokens 16384"]

Writes benchmark/results/cpu_bench_linear_rss.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "test" / "e2e"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from server import kill, popen_launch_server  # noqa: E402


def session_memory(sid: int) -> list[dict]:
    """VmHWM/VmRSS (MiB) and command of every process whose session id is `sid`."""
    rows = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[3]) != sid:  # field 6: session
                continue
            status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
        except (OSError, ValueError, IndexError):
            continue
        mib = lambda k: int(status.get(k, "0 kB").split()[0]) / 1024  # noqa: E731
        rows.append({"pid": int(pid), "name": status["Name"].strip(), "cmd": cmd,
                     "vm_hwm_mib": mib("VmHWM"), "vm_rss_mib": mib("VmRSS")})
    return rows


def measure(quantization: str, extra: list[str], dense_copy: bool = True) -> dict:
    """Peak memory of one server; `dense_copy` False sets HISERVE_GGUF_DENSE_COPY=0 (int4 only)."""
    env = None if dense_copy else {"HISERVE_GGUF_DENSE_COPY": "0"}
    proc, url = popen_launch_server(["--dtype", "bfloat16", "--quantization", quantization, *extra], env=env)
    try:
        for q in ("What is the capital of France?", "Write a haiku about autumn leaves."):
            r = httpx.post(url + "/v1/chat/completions", timeout=300, json={
                "messages": [{"role": "user", "content": q}], "max_tokens": 32, "temperature": 0})
            r.raise_for_status()
        procs = session_memory(proc.pid)
    finally:
        kill(proc)
    return {"quantization": quantization, "dense_copy": dense_copy, "processes": procs,
            "max_vm_hwm_mib": max(p["vm_hwm_mib"] for p in procs),
            "sum_vm_hwm_mib": sum(p["vm_hwm_mib"] for p in procs)}


def main() -> None:
    from bench_linear import lscpu

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--extra-args", default="", help="more server flags, one string")
    ap.add_argument("--out", default=str(REPO / "benchmark" / "results" / "cpu_bench_linear_rss.json"))
    args = ap.parse_args()
    extra = shlex.split(args.extra_args)
    runs = [measure("none", extra), measure("gguf", extra), measure("gguf", extra, dense_copy=False)]
    print(f"{'quantization':>22} {'process':>10} {'VmHWM MiB':>10} {'VmRSS MiB':>10}")
    for run in runs:
        name = run["quantization"] + ("" if run["quantization"] == "none" or run["dense_copy"] else " (int4 only)")
        for p in sorted(run["processes"], key=lambda p: -p["vm_hwm_mib"]):
            print(f"{name:>22} {p['pid']:>10} {p['vm_hwm_mib']:>10.0f} {p['vm_rss_mib']:>10.0f}  {p['cmd'][:60]}")
    result = {"benchmark": "cpu_bench_linear_rss", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "command": " ".join([os.path.basename(sys.executable), *sys.argv]), "cpu": lscpu(), "runs": runs}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
