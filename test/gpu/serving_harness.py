"""Multi-turn serving runs against real servers, and the comparisons the GPU tests make.

Workload: `num_conversations` conversations of `num_turns` turns. Turn t's prompt is the
whole conversation so far: the first question, then per earlier turn a stand-in reply and
the next question, all seeded random word ids. The stand-in replies are fixed tokens, not
the model's outputs, so every prompt is known in advance and identical across runs: two
servers are compared on exactly the same inputs even after their outputs differ, and every
request's first generated token is a teacher-forced comparison. Consecutive turns still
share the previous prompt as a cached prefix, which is what the hierarchical cache serves.

Requests go to the native `/generate` with `input_ids` (greedy, `ignore_eos`, a fixed
`max_new_tokens`); each result keeps `output_ids` and `meta_info`.

Comparisons (bf16 makes exact equality meaningful only for identical computations):
- `identical(a, b)`: equal output ids request by request (same server code path, one request
  at a time: the KV values reaching attention are the same bits with or without hicache);
- `agreement(ref, other)`: against another attention backend, the fraction of requests
  whose first generated token is equal, and the mean fraction of output tokens before the
  first difference. A correct backend differs from the reference only at near-ties of the
  bf16 logits; a broken one (wrong pages, mask or scale) changes what attention sees, which
  this model (see `models/dummy_weights.py`) turns into different tokens almost always.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from hiserve.testing.dummy_model import SPECIAL_TOKENS

Key = tuple[int, int]  # (conversation, turn)


@dataclass(frozen=True)
class Workload:
    """Sizes in tokens; `vocab_size` bounds the random word ids."""

    num_conversations: int
    num_turns: int
    first_question_tokens: int
    question_tokens: int
    reply_tokens: int
    output_tokens: int
    vocab_size: int
    seed: int = 0

    def _words(self, conv: int, turn: int, part: int, n: int) -> list[int]:
        rng = np.random.default_rng([self.seed, conv, turn, part])
        return rng.integers(len(SPECIAL_TOKENS), self.vocab_size, size=n).tolist()

    def prompt(self, conv: int, turn: int) -> list[int]:
        """Input ids of turn `turn` (0-based) of conversation `conv`."""
        ids = self._words(conv, 0, 0, self.first_question_tokens)
        for t in range(1, turn + 1):
            ids += self._words(conv, t, 1, self.reply_tokens) + self._words(conv, t, 0, self.question_tokens)
        return ids

    def prompt_tokens(self, turn: int) -> int:
        return self.first_question_tokens + turn * (self.reply_tokens + self.question_tokens)

    def working_set_tokens(self) -> int:
        """Tokens the radix tree holds once every conversation has finished."""
        return self.num_conversations * (self.prompt_tokens(self.num_turns - 1) + self.output_tokens)

    @property
    def num_requests(self) -> int:
        return self.num_conversations * self.num_turns


@dataclass
class Result:
    ok: bool
    output_ids: list[int]
    meta_info: dict[str, Any]
    error: str = ""
    latency_s: float = 0.0


def _body(w: Workload, conv: int, turn: int) -> dict[str, Any]:
    return {"input_ids": w.prompt(conv, turn),
            "sampling_params": {"max_new_tokens": w.output_tokens, "temperature": 0, "ignore_eos": True}}


def _parse(r: httpx.Response, w: Workload, t0: float) -> Result:
    latency = time.perf_counter() - t0
    if r.status_code != 200:
        return Result(False, [], {}, f"HTTP {r.status_code}: {r.text[:300]}", latency)
    out = r.json()
    ids = list(out.get("output_ids") or [])
    if len(ids) != w.output_tokens:
        return Result(False, ids, out.get("meta_info") or {}, f"{len(ids)} output ids, expected {w.output_tokens}",
                      latency)
    return Result(True, ids, out.get("meta_info") or {}, "", latency)


def run_sequential(base_url: str, w: Workload, timeout_s: float = 600.0) -> dict[Key, Result]:
    """Turn by turn, conversations round-robin, one request at a time: each request runs alone
    in its batches, and by the later turns a conversation's context has been pushed out of a
    small device pool by the others."""
    results: dict[Key, Result] = {}
    with httpx.Client(base_url=base_url, timeout=timeout_s) as client:
        for turn in range(w.num_turns):
            for conv in range(w.num_conversations):
                t0 = time.perf_counter()
                try:
                    results[(conv, turn)] = _parse(client.post("/generate", json=_body(w, conv, turn)), w, t0)
                except httpx.HTTPError as e:
                    results[(conv, turn)] = Result(False, [], {}, f"{type(e).__name__}: {e}")
    return results


def decode_vs_extend(base_url: str, w: Workload, decoded: dict[Key, Result], keys: list[Key],
                     timeout_s: float = 600.0) -> dict[str, Any]:
    """Teacher-forced check of the decode path against the extend path of the same server.

    For each key, the prompt plus all but the last decoded token is sent again with
    max_new_tokens 1: the extend kernels now compute the position the decode kernels
    produced last, over the same context, so the token must come back unless the two paths
    round to a near tie differently. A broken decode step (e.g. past a page boundary) makes
    them disagree on most requests.
    """
    same, total, errors = 0, 0, []
    with httpx.Client(base_url=base_url, timeout=timeout_s) as client:
        for key in keys:
            r = decoded.get(key)
            if r is None or not r.ok:
                continue
            body = {"input_ids": w.prompt(*key) + r.output_ids[:-1],
                    "sampling_params": {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}}
            resp = client.post("/generate", json=body)
            total += 1
            if resp.status_code != 200:
                errors.append(f"{key}: HTTP {resp.status_code}")
                continue
            same += list(resp.json().get("output_ids") or [None])[-1:] == r.output_ids[-1:]
    return {"requests": total, "agreement": same / total if total else 0.0, "errors": errors[:5]}


def run_concurrent(base_url: str, w: Workload, concurrency: int, timeout_s: float = 600.0) -> dict[Key, Result]:
    """Every conversation runs its turns in order (closed loop), at most `concurrency`
    requests in flight over all conversations. A failed turn does not stop its conversation
    (prompts do not depend on outputs)."""

    async def main() -> dict[Key, Result]:
        results: dict[Key, Result] = {}
        gate = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=concurrency + 4)
        async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:
            async def conversation(conv: int) -> None:
                for turn in range(w.num_turns):
                    async with gate:
                        t0 = time.perf_counter()
                        try:
                            r = await client.post("/generate", json=_body(w, conv, turn))
                            results[(conv, turn)] = _parse(r, w, t0)
                        except httpx.HTTPError as e:
                            results[(conv, turn)] = Result(False, [], {}, f"{type(e).__name__}: {e}")

            await asyncio.gather(*(conversation(c) for c in range(w.num_conversations)))
        return results

    return asyncio.run(main())


# ------------------------------------------------------------------ comparisons


def identical(a: dict[Key, Result], b: dict[Key, Result]) -> dict[str, Any]:
    """Requests whose output ids are equal in both runs (both successful)."""
    keys = sorted(set(a) | set(b))
    same = [k for k in keys if k in a and k in b and a[k].ok and b[k].ok and a[k].output_ids == b[k].output_ids]
    diff = [list(k) for k in keys if k not in set(same)]
    return {"requests": len(keys), "identical": len(same), "first_differences": diff[:10]}


def agreement(ref: dict[Key, Result], other: dict[Key, Result]) -> dict[str, Any]:
    """First-token agreement and mean fraction of tokens before the first difference."""
    first, prefix = [], []
    for k, r in ref.items():
        o = other.get(k)
        if not (r.ok and o is not None and o.ok):
            first.append(0.0)
            prefix.append(0.0)
            continue
        n = 0
        while n < len(r.output_ids) and n < len(o.output_ids) and r.output_ids[n] == o.output_ids[n]:
            n += 1
        first.append(float(n > 0))
        prefix.append(n / max(1, len(r.output_ids)))
    return {"requests": len(first), "first_token_agreement": float(np.mean(first)) if first else 0.0,
            "mean_prefix_fraction": float(np.mean(prefix)) if prefix else 0.0}


def summarize(results: dict[Key, Result]) -> dict[str, Any]:
    """Counts over one run: requests, failures, tokens, cached tokens by tier."""
    ok = [r for r in results.values() if r.ok]
    details = [r.meta_info.get("cached_tokens_details") or {} for r in ok]
    return {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results.values() if not r.ok})[:5],
        "prompt_tokens": sum(int(r.meta_info.get("prompt_tokens", 0)) for r in ok),
        "output_tokens": sum(len(r.output_ids) for r in ok),
        "cached_tokens": sum(int(r.meta_info.get("cached_tokens", 0)) for r in ok),
        "cached_tokens_host": sum(int(d.get("host", 0)) for d in details),
        "requests_with_host_hits": sum(1 for d in details if d.get("host", 0) > 0),
        "max_latency_s": max((r.latency_s for r in ok), default=0.0),
    }


# ------------------------------------------------------------------ server state


def server_state(base_url: str) -> dict[str, Any]:
    return httpx.get(base_url + "/get_server_info", timeout=60).json()["internal_states"][0]


_SETTINGS = ("attention_backend", "prefill_attention_backend", "decode_attention_backend", "disable_cuda_graph",
             "cuda_graph_max_bs", "enable_hierarchical_cache", "hicache_mem_layout", "hicache_io_backend",
             "hicache_ratio", "page_size", "dtype", "device", "load_format", "max_total_num_tokens", "tp_size")


def server_settings(base_url: str) -> dict[str, Any]:
    """The resolved flags that matter here (what the server really runs, after its defaults)."""
    info = httpx.get(base_url + "/get_server_info", timeout=60).json()
    return {k: info.get(k) for k in _SETTINGS}


def metric(base_url: str, name: str) -> float | None:
    """Sum of a Prometheus metric's samples, or None when not exported."""
    total, seen = 0.0, False
    for line in httpx.get(base_url + "/metrics", timeout=60).text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    return total if seen else None


def flush_and_state(base_url: str) -> dict[str, Any]:
    """POST /flush_cache (must succeed: the server is idle) and return the state after it."""
    r = httpx.post(base_url + "/flush_cache", timeout=120)
    if r.status_code != 200:
        raise RuntimeError(f"/flush_cache answered {r.status_code}: {r.text[:300]}")
    return server_state(base_url)


def pools_free(state: dict[str, Any]) -> bool:
    """Every device slot free, nothing held by the tree; every host slot free (when there is a host pool)."""
    device = (state["available_size"] == state["max_total_num_tokens"]
              and state["evictable_size"] == 0 and state["protected_size"] == 0)
    if "host_total_size" not in state:
        return device
    return device and state["host_available_size"] == state["host_total_size"] and state["host_used_size"] == 0


# A CUDA fault, a device-side assert, or any Python traceback in the server's log.
_LOG_ERRORS = re.compile(r"CUDA error|cudaError|illegal memory access|device-side assert|misaligned address|"
                         r"Traceback \(most recent call last\)|CUBLAS_STATUS|out of memory", re.IGNORECASE)


def log_errors(log_path: str, limit: int = 5) -> list[str]:
    """Lines of the server log that report a CUDA error or a traceback."""
    text = Path(log_path).read_text(errors="replace")
    return [line.strip()[:300] for line in text.splitlines() if _LOG_ERRORS.search(line)][:limit]


def write_results(name: str, payload: dict[str, Any]) -> str | None:
    """Write `payload` as JSON to $HISERVE_RESULTS_DIR/<name>.json when that variable is set."""
    folder = os.environ.get("HISERVE_RESULTS_DIR")
    if not folder:
        return None
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{name}.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o))
    return path
