"""One serving scenario for a model folder: three servers, three runs, every figure collected.

1. Server A, hierarchical cache on (`page_first`, `kernel` IO by default), a device pool
   small enough that the workloads evict continuously, the attention backend under test:
   - stress: the stress workload, `concurrency` requests in flight;
   - its log, /metrics and state; /flush_cache must leave device and host pools free;
   - identity: the identity workload one request at a time; flush and check again.
2. Server B, same backend, no hierarchical cache, a device pool that never evicts: identity,
   then the decode-vs-extend check on the reference workload's requests.
3. Server C, the reference backend (torch_native), same pool as B: the reference workload
   (the first conversations/turns of the identity workload; the reference backend is slow).

`run_scenario` never asserts: it returns everything (as JSON-ready values) and the tests
decide, so one failed aspect does not hide the others. Servers are started one at a time
and always killed.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))

from server import kill, popen_launch_server  # noqa: E402
from serving_harness import (  # noqa: E402
    Workload,
    agreement,
    decode_vs_extend,
    flush_and_state,
    identical,
    log_errors,
    metric,
    pools_free,
    run_concurrent,
    run_sequential,
    server_settings,
    server_state,
    summarize,
)


@dataclass
class Scenario:
    """Server flags and workloads of one scenario (token counts are KV slots / tokens)."""

    name: str
    model_path: str
    backend: str  # an --attention-backend value, or "auto": the server's own choice
    dtype: str
    page_size: int
    small_pool_tokens: int
    big_pool_tokens: int
    hicache_ratio: float
    stress: Workload
    identity: Workload
    concurrency: int
    reference: Workload | None = None  # server C's workload (same prompts); None: the identity one
    reference_backend: str = "torch_native"
    hicache_args: list[str] = field(default_factory=lambda: [
        "--hicache-mem-layout", "page_first", "--hicache-io-backend", "kernel"])
    extra_args: list[str] = field(default_factory=list)  # every server
    reference_extra_args: list[str] = field(default_factory=list)  # server C only

    def check_sizes(self) -> None:
        """The identity comparison needs A to evict on the device but never on the host (so A
        and B compute the same extends), and B never to evict.

        Raises:
            ValueError: a workload does not fit the pools as the comparison needs.
        """
        ws = self.identity.working_set_tokens()
        host = int(self.small_pool_tokens * self.hicache_ratio)
        if not self.small_pool_tokens < ws <= host // 2:
            raise ValueError(f"identity working set {ws} tokens must exceed the device pool "
                             f"{self.small_pool_tokens} and fit half the host pool {host}")
        if ws * 2 > self.big_pool_tokens:
            raise ValueError(f"identity working set {ws} must fit half the big pool {self.big_pool_tokens}")
        if self.stress.working_set_tokens() <= self.small_pool_tokens:
            raise ValueError("the stress working set must exceed the device pool")

    def backend_args(self) -> list[str]:
        return [] if self.backend == "auto" else ["--attention-backend", self.backend]

    def common_args(self) -> list[str]:
        return ["--model-path", self.model_path, "--load-format", "dummy", "--dtype", self.dtype,
                "--page-size", self.page_size, "--random-seed", 1, "--enable-metrics", *self.extra_args]


def _start(args: list[Any]) -> tuple[Any, str, float]:
    t0 = time.perf_counter()
    proc, url = popen_launch_server(args)
    return proc, url, time.perf_counter() - t0


def run_scenario(s: Scenario) -> dict[str, Any]:
    """Run the scenario; returns a dict of JSON-ready values (see the module docstring)."""
    s.check_sizes()
    out: dict[str, Any] = {"scenario": {k: v for k, v in asdict(s).items()}}
    t_all = time.perf_counter()

    # ---- A: hierarchical cache, small pool
    args_a = [*s.common_args(), *s.backend_args(), "--max-total-tokens", s.small_pool_tokens,
              "--enable-hierarchical-cache", "--hicache-ratio", s.hicache_ratio, *s.hicache_args]
    proc, url, start_s = _start(args_a)
    try:
        out["server_a_settings"] = server_settings(url)
        t0 = time.perf_counter()
        stress = run_concurrent(url, s.stress, s.concurrency)
        out["stress"] = {**summarize(stress), "wall_s": time.perf_counter() - t0, "server_start_s": start_s}
        out["stress_metrics"] = {name: metric(url, name) for name in (
            "sglang:cached_tokens_host_total", "sglang:hicache_backup_tokens_total",
            "sglang:load_back_tokens_total", "sglang:hicache_host_total_tokens")}
        out["stress_state_before_flush"] = server_state(url)
        state = flush_and_state(url)
        out["stress_state_after_flush"] = state
        out["stress_pools_free_after_flush"] = pools_free(state)

        t0 = time.perf_counter()
        ident_a = run_sequential(url, s.identity)
        out["identity_hicache"] = {**summarize(ident_a), "wall_s": time.perf_counter() - t0}
        state = flush_and_state(url)
        out["identity_pools_free_after_flush"] = pools_free(state)
    finally:
        kill(proc)
    out["server_a_log_errors"] = log_errors(proc.log_path)
    out["server_a_log"] = proc.log_path

    # ---- B: same backend, no hierarchical cache, a pool that never evicts
    args_b = [*s.common_args(), *s.backend_args(), "--max-total-tokens", s.big_pool_tokens]
    proc, url, start_s = _start(args_b)
    try:
        out["server_b_settings"] = server_settings(url)
        t0 = time.perf_counter()
        ident_b = run_sequential(url, s.identity)
        out["identity_no_hicache"] = {**summarize(ident_b), "wall_s": time.perf_counter() - t0,
                                      "server_start_s": start_s}
        ref = s.reference or s.identity
        keys = [(c, t) for t in range(ref.num_turns) for c in range(ref.num_conversations)]
        out["decode_vs_extend"] = decode_vs_extend(url, s.identity, ident_b, keys)
    finally:
        kill(proc)
    out["server_b_log_errors"] = log_errors(proc.log_path)

    # ---- C: the reference backend
    args_c = [*s.common_args(), "--attention-backend", s.reference_backend, "--max-total-tokens",
              s.big_pool_tokens, *s.reference_extra_args]
    proc, url, start_s = _start(args_c)
    try:
        out["server_c_settings"] = server_settings(url)
        t0 = time.perf_counter()
        ident_c = run_sequential(url, s.reference or s.identity)
        out["identity_reference"] = {**summarize(ident_c), "wall_s": time.perf_counter() - t0,
                                     "server_start_s": start_s}
    finally:
        kill(proc)
    out["server_c_log_errors"] = log_errors(proc.log_path)

    out["hicache_vs_no_hicache"] = identical(ident_a, ident_b)
    out["backend_vs_reference"] = agreement(ident_c, ident_b)
    out["wall_s"] = time.perf_counter() - t_all
    return out


def format_summary(r: dict[str, Any]) -> str:
    """A few lines for the test log."""
    st, ident, agr = r["stress"], r["hicache_vs_no_hicache"], r["backend_vs_reference"]
    sc = r["scenario"]
    a = r.get("server_a_settings", {})
    return (f"[{sc['name']}] backend={a.get('attention_backend')} (decode {a.get('decode_attention_backend')}, "
            f"cuda graphs {'off' if a.get('disable_cuda_graph') else 'on'}) wall {r['wall_s']:.0f} s\n"
            f"  stress: {st['requests']} requests ({st['failed']} failed), {st['prompt_tokens']} prompt + "
            f"{st['output_tokens']} output tokens, cached {st['cached_tokens']} (host {st['cached_tokens_host']}, "
            f"{st['requests_with_host_hits']} requests with host hits), {st['wall_s']:.1f} s; "
            f"metrics {r['stress_metrics']}\n"
            f"  identity: {ident['identical']}/{ident['requests']} identical with vs without hicache; "
            f"host-hit requests {r['identity_hicache']['requests_with_host_hits']}\n"
            f"  vs {sc['reference_backend']}: first-token agreement {agr['first_token_agreement']:.3f}, "
            f"mean prefix fraction {agr['mean_prefix_fraction']:.3f} over {agr['requests']} requests\n"
            f"  decode vs extend (teacher-forced last token): {r['decode_vs_extend']['agreement']:.3f} "
            f"over {r['decode_vs_extend']['requests']} requests\n"
            f"  log errors A/B/C: {len(r['server_a_log_errors'])}/{len(r['server_b_log_errors'])}/"
            f"{len(r['server_c_log_errors'])}")
