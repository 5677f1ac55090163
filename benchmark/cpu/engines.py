"""The three engines of the CPU comparison: how each is started, found healthy, versioned and stopped.

Every engine is started in its own session (process group) so that stopping it ends its worker
processes too, and its peak resident memory is read from /proc/<pid>/status (VmHWM) of every
process of the group just before it is stopped.

Peers live outside the repo, in $BENCH_HOME (default ~/.cache/hiserve-bench), installed by
benchmark/cpu/install_peers.sh: vLLM's CPU build in vllm-venv/ (serving a bf16 folder dequantized
from the same GGUF, vllm-model/), llama.cpp's llama-server in llamacpp/bin/.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCH_HOME = Path(os.environ.get("BENCH_HOME", Path.home() / ".cache" / "hiserve-bench"))
# Variables the harness sets for its own (client) process only; engines start without them.
CLIENT_ONLY_ENV: set[str] = set()
TCMALLOC_CANDIDATES = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                       "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4")


def cpu_list() -> str:
    """The cores this process may run on, as a list such as '0-1' or '0,2,4' (for OMP binding)."""
    cores = sorted(os.sched_getaffinity(0))
    if cores == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


@dataclass
class EngineSpec:
    """One engine: its start command and environment, its port, and how to ask its version."""

    name: str
    argv: list[str]
    port: int
    env: dict[str, str] = field(default_factory=dict)  # added to os.environ
    version: str = ""
    health_path: str = "/health"
    # vLLM compiles its model at start: minutes on a quiet 2-core machine, far more on a busy one.
    start_timeout_s: float = float(os.environ.get("BENCH_START_TIMEOUT_S", "1800"))
    cwd: Optional[str] = None
    notes: str = ""

    def shell_command(self) -> str:
        """The start command as one could paste it into a shell (env assignments first)."""
        env = " ".join(f"{k}={v}" for k, v in sorted(self.env.items()))
        return (env + " " if env else "") + " ".join(self.argv)


def _pkg_version(python: str, dist: str) -> str:
    code = f"import importlib.metadata as m; print(m.version({dist!r}))"
    r = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return r.stdout.strip() or f"unknown ({r.stderr.strip()[-200:]})"


def hiserve_spec(port: int = 30000) -> EngineSpec:
    """`make serve` defaults: `python -m hiserve.launch_server` plus `--enable-cache-report` (port
    30000). That flag only adds `usage.prompt_tokens_details` (the cache-hit column), as in SGLang."""
    python = os.environ.get("HISERVE_PYTHON", str(REPO_ROOT / ".venv" / "bin" / "python"))
    git = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--", "hiserve"],
                           capture_output=True, text=True).stdout.strip()
    argv = [python, "-m", "hiserve.launch_server", "--enable-cache-report"]
    if port != 30000:
        argv += ["--port", str(port)]
    return EngineSpec("hiserve", argv, port, env={"PYTHONPATH": str(REPO_ROOT)},
                      version=f"git {git}{' (hiserve/ modified)' if dirty else ''}", cwd=str(REPO_ROOT),
                      notes="`make serve` defaults + --enable-cache-report (usage reporting only)")


def _find_iomp(venv: Path) -> str:
    for p in [venv / "lib" / "libiomp5.so", *venv.rglob("libiomp5.so")]:
        if p.exists():
            return str(p)
    raise FileNotFoundError(f"libiomp5.so not in {venv}: run benchmark/cpu/install_peers.sh vllm")


def vllm_spec(port: int = 8000) -> EngineSpec:
    """vLLM-CPU tuned as its CPU install docs advise: TCMalloc + Intel OpenMP preloaded, OpenMP
    threads bound to this process's cores, an explicit KV cache space, bf16."""
    venv = BENCH_HOME / "vllm-venv"
    model = BENCH_HOME / "vllm-model"
    if not (model / "config.json").exists():
        raise FileNotFoundError(f"{model} missing: run benchmark/cpu/install_peers.sh vllm")
    tcmalloc = next((p for p in TCMALLOC_CANDIDATES if os.path.exists(p)), None)
    if tcmalloc is None:
        raise FileNotFoundError("libtcmalloc_minimal.so.4 missing: apt-get install libtcmalloc-minimal4")
    env = {"LD_PRELOAD": f"{tcmalloc}:{_find_iomp(venv)}",
           "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", cpu_list()),
           # 1 GiB holds ~45k bf16 tokens of this model, >20x the scenarios' peak; vLLM's default
           # of 4 GiB got its worker OOM-killed on a 24 GiB machine shared with other work.
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1"}
    argv = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--tokenizer", str(model), "--dtype", "bfloat16",
            "--host", "127.0.0.1", "--port", str(port), "--disable-log-stats"]
    return EngineSpec("vllm-cpu", argv, port, env=env,
                      version="vllm-cpu " + _pkg_version(str(venv / "bin" / "python"), "vllm-cpu"),
                      notes="vLLM 0.32 has no GGUF quantization method, so it serves the same GGUF "
                            "dequantized to a bf16 HF folder (benchmark/cpu/gguf_to_hf.py)")


def llamacpp_spec(gguf: str, port: int = 8080, threads: int = 2, slots: int = 16) -> EngineSpec:
    """llama.cpp's llama-server on the GGUF itself: `threads` threads, continuous batching over
    `slots` parallel slots, each slot with room for the longest scenario (2048 tokens)."""
    binary = BENCH_HOME / "llamacpp" / "bin" / "llama-server"
    if not binary.exists():
        raise FileNotFoundError(f"{binary} missing: run benchmark/cpu/install_peers.sh llamacpp")
    r = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
    version = " ".join((r.stdout + r.stderr).split("\n")[:2]).strip()
    flags_file = BENCH_HOME / "llamacpp" / "cmake_flags.txt"
    if flags_file.exists():
        version += f" [cmake: {flags_file.read_text().strip()}]"
    argv = [str(binary), "-m", gguf, "-t", str(threads), "-tb", str(threads),
            "-np", str(slots), "-c", str(2048 * slots), "--cont-batching",
            "--host", "127.0.0.1", "--port", str(port), "--no-webui"]
    return EngineSpec("llama.cpp", argv, port, version=version,
                      notes="the GGUF in its own Q4_1 format; built from source without AMX")


class RunningEngine:
    """A started engine; use as a context manager so it is always stopped."""

    def __init__(self, spec: EngineSpec, log_path: Path):
        self.spec = spec
        self.log_path = log_path
        self.proc: Optional[subprocess.Popen] = None
        self.startup_s: Optional[float] = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.spec.port}"

    def __enter__(self) -> "RunningEngine":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")
        env = {k: v for k, v in os.environ.items() if k not in CLIENT_ONLY_ENV}
        env.update(self.spec.env)
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.spec.argv, env=env, cwd=self.spec.cwd, stdout=log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        try:
            self._wait_healthy(t0)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - t0
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_healthy(self, t0: float) -> None:
        deadline = t0 + self.spec.start_timeout_s
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{self.spec.name} exited ({self.proc.returncode}) before "
                                   f"becoming healthy; log {self.log_path}:\n{tail}")
            try:
                r = httpx.get(self.base_url + self.spec.health_path, timeout=5)
                # llama-server answers 503 while loading; /v1/models confirms the API is up.
                if r.status_code == 200 and httpx.get(self.base_url + "/v1/models", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"{self.spec.name} not healthy after {self.spec.start_timeout_s}s; "
                           f"see {self.log_path}")

    def processes(self) -> list[int]:
        """Pids of the engine's process group (the engine and every worker it started)."""
        pids = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            # Fields after the parenthesised command name: state, ppid, pgrp, ...
            if int(stat.rsplit(")", 1)[1].split()[2]) == self.proc.pid:
                pids.append(int(d.name))
        return sorted(pids)

    def peak_rss(self) -> dict[str, object]:
        """Peak resident set (VmHWM, MiB) of each live process of the engine, and their sum."""
        per = []
        for pid in self.processes():
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                hwm_kb = int(next(l.split()[1] for l in status.splitlines() if l.startswith("VmHWM:")))
            except (OSError, StopIteration):
                continue
            per.append({"pid": pid, "cmdline": cmdline.strip()[:160], "peak_rss_mib": hwm_kb / 1024})
        return {"total_peak_rss_mib": sum(x["peak_rss_mib"] for x in per), "processes": per}

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = self.proc.pid  # start_new_session: the group id is the leader's pid
        for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # workers of the group may outlive the leader for a moment
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass

