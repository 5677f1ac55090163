"""The API process's footprint at start: resident memory, CPU time, time to /health, torch mapped.

Launches `python -m hiserve.launch_server --dtype float32` (the default GGUF model) from each
checkout given, alternating between them for `--rounds` rounds, waits for /health 200 (after
the warm-up request), then reads the API process's (the launched one's) VmRSS, VmHWM and
CPU time (user + system) from /proc, the scheduler process's VmRSS, and whether the API
process maps libtorch (an outside view of `import torch`), and stops the server. Prints
medians per checkout and writes benchmark/results/api_process_startup.json.

    python benchmark/api_process_startup.py --checkout before=/path/to/old --checkout after=. --rounds 5

Each checkout runs with its own `hiserve` (cwd and PYTHONPATH) and this interpreter.
Wall-clock figures on a shared machine are noisy: compare medians of alternating rounds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmark" / "results" / "api_process_startup.json"
_PAGE_KIB = os.sysconf("SC_PAGE_SIZE") / 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status_mib(pid: int, key: str) -> float:
    """A /proc/<pid>/status memory field (VmRSS, VmHWM) in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of `pid` (fields 14 and 15 of /proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


def measure_once(checkout: Path, timeout_s: float = 600.0) -> dict:
    """Start a server from `checkout`, wait for /health 200, read the figures, stop it.

    Returns:
        health_s (s from launch to /health 200), api_rss_mib, api_hwm_mib, api_cpu_s,
        api_maps_torch (bool), scheduler_rss_mib (the API process's children, summed).
    Raises:
        RuntimeError: the server exited or was not healthy within `timeout_s`.
    """
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    log = tempfile.NamedTemporaryFile(prefix="api_startup_", suffix=".log", delete=False)
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "hiserve.launch_server", "--dtype", "float32",
                             "--port", str(port)], cwd=checkout, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while True:
            if proc.poll() is not None or time.monotonic() - start > timeout_s:
                raise RuntimeError(f"server from {checkout} not healthy; log: {log.name}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        health_s = time.monotonic() - start
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        return {"health_s": round(health_s, 2), "api_rss_mib": round(_status_mib(proc.pid, "VmRSS"), 1),
                "api_hwm_mib": round(_status_mib(proc.pid, "VmHWM"), 1),
                "api_cpu_s": round(_cpu_s(proc.pid), 2), "api_maps_torch": "libtorch" in maps,
                "scheduler_rss_mib": round(sum(_status_mib(c, "VmRSS") for c in _children(proc.pid)), 1)}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
        os.unlink(log.name)


def _git_head(checkout: Path) -> str:
    out = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkout", action="append", default=None,
                    help="NAME=PATH of a hiserve checkout (repeatable); default: this one")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    checkouts = dict(c.split("=", 1) for c in (args.checkout or [f"this={REPO}"]))
    runs: dict[str, list[dict]] = {name: [] for name in checkouts}
    for _ in range(args.rounds):
        for name, path in checkouts.items():
            runs[name].append(measure_once(Path(path).resolve()))
    keys = ["health_s", "api_rss_mib", "api_hwm_mib", "api_cpu_s", "scheduler_rss_mib"]
    print(f"{'checkout':<10}" + "".join(f"{k:>18}" for k in keys) + f"{'api_maps_torch':>16}")
    medians = {}
    for name, rows in runs.items():
        medians[name] = {k: statistics.median(r[k] for r in rows) for k in keys}
        medians[name]["api_maps_torch"] = any(r["api_maps_torch"] for r in rows)
        print(f"{name:<10}" + "".join(f"{medians[name][k]:>18}" for k in keys)
              + f"{str(medians[name]['api_maps_torch']):>16}")
    result = {"command": " ".join(["python", *sys.argv]), "date": datetime.datetime.now(datetime.timezone.utc)
              .isoformat(timespec="seconds"), "cpu": _cpu_model(), "load_average": os.getloadavg(),
              "commits": {n: _git_head(Path(p)) for n, p in checkouts.items()}, "medians": medians, "runs": runs,
              "note": "shared machine: wall-clock figures (health_s) are noisy; re-measure on a quiet one"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
