"""Streaming load generator for any OpenAI-compatible server (hiserve, SGLang, vLLM).

Sends `--num-prompts` streamed requests at each `--concurrency` level and reports
throughput and latency (TTFT, ITL, TPOT, end-to-end), plus prefix-cache hits read from
`usage.prompt_tokens_details.cached_tokens`.

    python benchmark/bench_serving.py --base-url http://127.0.0.1:30000 \\
        --scenario random --num-prompts 64 --random-input-len 512 --random-output-len 64 \\
        --concurrency 1 4 16 --ignore-eos

Metrics (as SGLang's bench_serving defines them): TTFT = time to the first chunk with
non-empty text; ITL = gaps between content chunks, a gap spread evenly over the tokens
its chunk carried; TPOT = (latency - TTFT) / (output_tokens - 1); output tokens come from
the server's `usage.completion_tokens` when present, else from re-tokenizing the text.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

import httpx
import numpy as np
from tqdm.asyncio import tqdm

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

# ------------------------------------------------------------------ per-request measurement


@dataclass
class RequestOutput:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0                              # seconds
    latency: float = 0.0                           # seconds, send to end of stream
    itls: list[float] = field(default_factory=list)  # seconds
    cached_tokens: Optional[int] = None
    generated_text: str = ""

    @property
    def tpot(self) -> Optional[float]:
        return tpot(self.latency, self.ttft, self.output_len)


def tpot(latency: float, ttft: float, output_len: int) -> Optional[float]:
    """Time per output token after the first; None when fewer than two tokens."""
    if output_len < 2:
        return None
    return (latency - ttft) / (output_len - 1)


def spread_itls(chunk_times: list[float], chunk_tokens: list[int]) -> list[float]:
    """Inter-token latencies: the gap before chunk k (k >= 1) split evenly over its tokens.

    The first chunk's tokens arrive at TTFT and contribute no ITL.
    """
    itls: list[float] = []
    for k in range(1, len(chunk_times)):
        n = max(1, chunk_tokens[k])
        itls.extend([(chunk_times[k] - chunk_times[k - 1]) / n] * n)
    return itls


def chunk_text(chunk: dict, backend: str) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if backend == "openai":
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


class StreamTracker:
    """Collects one streamed response's timing; `feed` each decoded chunk, then `finish`."""

    def __init__(self, backend: str, start: float):
        self.backend = backend
        self.start = start
        self.ttft: Optional[float] = None
        self.chunk_times: list[float] = []
        self.chunk_texts: list[str] = []
        self.chunk_tokens: list[Optional[int]] = []  # from running usage, when reported
        self.usage: Optional[dict] = None
        self._running_tokens = 0

    def feed(self, t: float, chunk: dict) -> None:
        if chunk.get("error"):
            err = chunk["error"]
            raise RuntimeError(err.get("message", str(err)) if isinstance(err, dict) else str(err))
        usage = chunk.get("usage")
        running = usage.get("completion_tokens") if isinstance(usage, dict) else None
        text = chunk_text(chunk, self.backend)
        if text:
            if self.ttft is None:
                self.ttft = t - self.start
            self.chunk_times.append(t)
            self.chunk_texts.append(text)
            self.chunk_tokens.append(None if running is None else running - self._running_tokens)
        if running is not None:
            self._running_tokens = running
        if isinstance(usage, dict):
            self.usage = usage

    def finish(self, t_end: float, prompt_len: int,
               count_tokens: Callable[[str], int]) -> RequestOutput:
        text = "".join(self.chunk_texts)
        out = RequestOutput(generated_text=text, latency=t_end - self.start, prompt_len=prompt_len)
        if self.ttft is None:
            out.error = "no content in the stream"
            return out
        out.success = True
        out.ttft = self.ttft
        usage = self.usage or {}
        out.output_len = usage.get("completion_tokens") or count_tokens(text)
        out.prompt_len = usage.get("prompt_tokens") or prompt_len
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and details.get("cached_tokens") is not None:
            out.cached_tokens = int(details["cached_tokens"])
        if all(n is not None for n in self.chunk_tokens):
            tokens = [int(n) for n in self.chunk_tokens]
        elif len(self.chunk_texts) == out.output_len:
            tokens = [1] * len(self.chunk_texts)
        else:  # chunks carried several tokens and the server did not say how many
            tokens = [max(1, count_tokens(s)) for s in self.chunk_texts]
        out.itls = spread_itls(self.chunk_times, tokens)
        return out


# ------------------------------------------------------------------ aggregate figures


def summarize(values: list[float], scale: float = 1.0) -> dict[str, Optional[float]]:
    """mean / median / std / p90 / p99 / max of `values` × scale (None for an empty list)."""
    if not values:
        return {k: None for k in ("mean", "median", "std", "p90", "p99", "max")}
    a = np.asarray(values, dtype=np.float64) * scale
    return {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std()),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99)),
            "max": float(a.max())}


def compute_metrics(outputs: list[RequestOutput], duration: float) -> dict[str, Any]:
    ok = [o for o in outputs if o.success]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_len for o in ok)
    cached = [o.cached_tokens for o in ok if o.cached_tokens is not None]
    metrics: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "input_throughput": total_in / duration if duration > 0 else 0.0,
        "output_throughput": total_out / duration if duration > 0 else 0.0,
        "total_throughput": (total_in + total_out) / duration if duration > 0 else 0.0,
        "achieved_concurrency": sum(o.latency for o in ok) / duration if duration > 0 else 0.0,
        "total_cached_tokens": sum(cached) if cached else None,
        "cache_hit_rate": (sum(cached) / total_in) if cached and total_in else None,
    }
    for name, values in (("e2e_latency", [o.latency for o in ok]),
                         ("ttft", [o.ttft for o in ok]),
                         ("itl", [x for o in ok for x in o.itls]),
                         ("tpot", [o.tpot for o in ok if o.tpot is not None])):
        for stat, v in summarize(values, 1000.0).items():
            metrics[f"{stat}_{name}_ms"] = v
    errors = sorted({o.error for o in outputs if not o.success})
    metrics["errors"] = errors[:10]
    return metrics


def format_result(concurrency: int, m: dict[str, Any]) -> str:
    def num(v, fmt="{:.2f}"):
        return "n/a" if v is None else fmt.format(v)

    rows = [
        ("Max request concurrency", str(concurrency)),
        ("Successful requests", str(m["completed"])),
        ("Failed requests", str(m["failed"])),
        ("Benchmark duration (s)", num(m["duration_s"])),
        ("Total input tokens", str(m["total_input_tokens"])),
        ("Total generated tokens", str(m["total_output_tokens"])),
        ("Request throughput (req/s)", num(m["request_throughput"])),
        ("Input token throughput (tok/s)", num(m["input_throughput"])),
        ("Output token throughput (tok/s)", num(m["output_throughput"])),
        ("Achieved concurrency", num(m["achieved_concurrency"])),
        ("Total cached tokens", num(m["total_cached_tokens"], "{}")),
        ("Cache hit rate", num(m["cache_hit_rate"], "{:.3f}")),
    ]
    for title, key, short in (("End-to-End Latency", "e2e_latency", "E2E Latency"),
                              ("Time to First Token", "ttft", "TTFT"),
                              ("Inter-Token Latency", "itl", "ITL"),
                              ("Time per Output Token (excl. 1st token)", "tpot", "TPOT")):
        rows.append((None, title))
        for stat in ("mean", "median", "p99"):
            rows.append((f"{stat.capitalize()} {short} (ms)", num(m[f"{stat}_{key}_ms"])))
    lines = ["{s:{c}^60}".format(s=f" Serving Benchmark Result (concurrency {concurrency}) ", c="=")]
    for label, value in rows:
        lines.append("{s:{c}^60}".format(s=f" {value} ", c="-") if label is None
                     else f"{label:<40}{value:>20}")
    if m["errors"]:
        lines.append(f"{'First errors':<40}")
        lines.extend(f"  {e[:200]}" for e in m["errors"])
    lines.append("=" * 60)
    return "\n".join(lines)


def format_sweep(results: list[dict[str, Any]]) -> str:
    cols = [("conc", "concurrency", "{:d}"), ("req/s", "request_throughput", "{:.2f}"),
            ("in tok/s", "input_throughput", "{:.1f}"), ("out tok/s", "output_throughput", "{:.1f}"),
            ("TTFT p50", "median_ttft_ms", "{:.1f}"), ("TTFT p99", "p99_ttft_ms", "{:.1f}"),
            ("ITL p50", "median_itl_ms", "{:.2f}"), ("TPOT p50", "median_tpot_ms", "{:.2f}"),
            ("cached", "total_cached_tokens", "{}")]
    lines = ["  ".join(f"{h:>10}" for h, _, _ in cols)]
    for r in results:
        lines.append("  ".join(f"{'n/a' if r.get(k) is None else f.format(r[k]):>10}"
                               for _, k, f in cols))
    return "\n".join(lines)


# ------------------------------------------------------------------ prompts


def load_tokenizer(path: str):
    try:
        from hiserve.models.loader import get_tokenizer
    except ImportError:  # running outside a hiserve checkout
        from transformers import AutoTokenizer

        if path.endswith(".gguf"):
            return AutoTokenizer.from_pretrained(os.path.dirname(path) or ".",
                                                 gguf_file=os.path.basename(path))
        return AutoTokenizer.from_pretrained(path)
    return get_tokenizer(path)


class PromptMaker:
    """Random text whose re-encoding is `length` tokens (or very close)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.candidates = np.array([i for i in range(len(tokenizer)) if i not in special])

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def random_text(self, rng: np.random.Generator, length: int) -> tuple[str, int]:
        if length <= 0:
            return "", 0
        ids = rng.choice(self.candidates, size=length).tolist()
        text, n = "", 0
        for _ in range(8):
            text = self.tokenizer.decode(ids)
            ids = self.encode(text)
            n = len(ids)
            if n == length:
                break
            if n > length:
                ids = ids[:length]
            else:
                ids = ids + rng.choice(self.candidates, size=length - n).tolist()
        return text, n


@dataclass
class Prompt:
    system: Optional[str]
    user: str
    prompt_len: int  # our token count of the text (the server adds template tokens)


def make_prompts(maker: PromptMaker, args, seed: int, num: int) -> list[Prompt]:
    rng = np.random.default_rng(seed)
    if args.scenario == "random":
        prompts = []
        for _ in range(num):
            text, n = maker.random_text(rng, args.random_input_len)
            prompts.append(Prompt(None, text, n))
        return prompts
    prefix, n_prefix = maker.random_text(rng, args.shared_prefix_len)
    prompts = []
    for _ in range(num):
        text, n = maker.random_text(rng, args.question_len)
        prompts.append(Prompt(prefix, text, n_prefix + n))
    return prompts


# ------------------------------------------------------------------ requests


def build_payload(args, prompt: Prompt, max_tokens: int) -> tuple[str, dict]:
    body: dict[str, Any] = {"model": args.model, "max_tokens": max_tokens,
                            "temperature": args.temperature, "stream": True,
                            "stream_options": {"include_usage": True,
                                               "continuous_usage_stats": args.continuous_usage_stats}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.backend == "openai-chat":
        messages = []
        if prompt.system is not None:
            messages.append({"role": "system", "content": prompt.system})
        messages.append({"role": "user", "content": prompt.user})
        body["messages"] = messages
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt.user if prompt.system is None else prompt.system + "\n" + prompt.user
        path = "/v1/completions"
    body.update(args.extra_request_body)
    return path, body


async def send_request(client: httpx.AsyncClient, args, prompt: Prompt, max_tokens: int,
                       count_tokens: Callable[[str], int]) -> RequestOutput:
    path, body = build_payload(args, prompt, max_tokens)
    start = time.perf_counter()
    tracker = StreamTracker(args.backend, start)
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:300]
                return RequestOutput(error=f"HTTP {resp.status_code}: {detail}",
                                     prompt_len=prompt.prompt_len)
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                tracker.feed(time.perf_counter(), json.loads(data))
        return tracker.finish(time.perf_counter(), prompt.prompt_len, count_tokens)
    except Exception as e:  # one failed request must not end the run
        return RequestOutput(error=f"{type(e).__name__}: {e}", prompt_len=prompt.prompt_len,
                             latency=time.perf_counter() - start)


async def run_level(client, args, prompts: list[Prompt], concurrency: int,
                    count_tokens) -> tuple[list[RequestOutput], float]:
    sem = asyncio.Semaphore(concurrency)

    async def limited(p: Prompt) -> RequestOutput:
        async with sem:
            return await send_request(client, args, p, args.random_output_len, count_tokens)

    start = time.perf_counter()
    tasks = [asyncio.create_task(limited(p)) for p in prompts]
    outputs = await tqdm.gather(*tasks, desc=f"concurrency {concurrency}", leave=False)
    return list(outputs), time.perf_counter() - start


# ------------------------------------------------------------------ discovery and output


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "processor": platform.processor(),
                            "cpu_count": os.cpu_count(), "python": platform.python_version()}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["cuda_device"] = torch.cuda.get_device_name(0)
            info["cuda_device_count"] = torch.cuda.device_count()
    except ImportError:
        pass
    return info


def discover(args, headers: dict[str, str]) -> dict[str, Any]:
    """Fill in --model and --tokenizer from the server; return its /get_server_info (or {})."""
    with httpx.Client(base_url=args.base_url, headers=headers, timeout=30) as c:
        if args.model is None:
            r = c.get("/v1/models")
            r.raise_for_status()
            args.model = r.json()["data"][0]["id"]
        if args.tokenizer is None:
            try:
                r = c.get("/get_model_info")
                if r.status_code == 200:
                    info = r.json()
                    args.tokenizer = info.get("tokenizer_path") or info.get("model_path")
            except httpx.HTTPError:
                pass
            args.tokenizer = args.tokenizer or args.model
        try:
            r = c.get("/get_server_info")
            return r.json() if r.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            return {}


def default_output_file(label: str) -> Path:
    stamp = datetime.now().strftime("%Y%m%d_%H%M%S")
    name = f"bench_serving_{label}_{stamp}.json" if label else f"bench_serving_{stamp}.json"
    return REPO_ROOT / "benchmark" / "results" / name


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--model", default=None, help="model name to send (default: first id of /v1/models)")
    p.add_argument("--backend", choices=["openai-chat", "openai"], default="openai-chat",
                   help="openai-chat = /v1/chat/completions, openai = /v1/completions")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer path (default: /get_model_info's path, else --model)")
    p.add_argument("--scenario", choices=["random", "shared-prefix"], default="random")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per concurrency level")
    p.add_argument("--random-input-len", type=int, default=512, help="prompt tokens (random scenario)")
    p.add_argument("--random-output-len", type=int, default=128, help="max_tokens of every request")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16],
                   help="in-flight request limit; several values run a sweep")
    p.add_argument("--shared-prefix-len", type=int, default=1024, help="system prompt tokens (shared-prefix)")
    p.add_argument("--question-len", type=int, default=128, help="per-request question tokens (shared-prefix)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos=true (SGLang/vLLM extension)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-continuous-usage-stats", dest="continuous_usage_stats", action="store_false",
                   help="do not ask for running usage in every chunk (it gives exact tokens per chunk)")
    p.add_argument("--extra-request-body", type=json.loads, default={},
                   help="JSON object merged into every request body")
    p.add_argument("--warmup", type=int, default=1, help="untimed requests before the first level")
    p.add_argument("--flush-cache", action="store_true", help="POST /flush_cache before each level")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--request-timeout", type=float, default=3600.0)
    p.add_argument("--label", default="")
    p.add_argument("--output-file", default=None, help="JSON results (default: benchmark/results/...)")
    p.add_argument("--output-details", action="store_true", help="also store per-request figures")
    args = p.parse_args(argv)
    if not isinstance(args.extra_request_body, dict):
        p.error("--extra-request-body must be a JSON object")
    if min(args.concurrency) < 1:
        p.error("--concurrency values must be at least 1")
    return args


async def amain(args) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    server_info = discover(args, headers)
    print(f"model={args.model!r} tokenizer={args.tokenizer!r} backend={args.backend} "
          f"scenario={args.scenario}")
    tokenizer = load_tokenizer(args.tokenizer)
    maker = PromptMaker(tokenizer)

    def count_tokens(text: str) -> int:
        return len(maker.encode(text))

    limits = httpx.Limits(max_connections=max(args.concurrency) + 8, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    results = []
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, limits=limits,
                                 timeout=timeout) as client:
        if args.warmup > 0:
            warm = make_prompts(maker, args, args.seed + 999_983, args.warmup)
            outs = await asyncio.gather(*[send_request(client, args, p, min(16, args.random_output_len),
                                                       count_tokens) for p in warm])
            bad = [o.error for o in outs if not o.success]
            if bad:
                raise SystemExit(f"warmup failed: {bad[0]}")
        for level, concurrency in enumerate(args.concurrency):
            # Fresh prompts per level, so one level's cache hits do not flatter the next.
            prompts = make_prompts(maker, args, args.seed + 1000 * level, args.num_prompts)
            if args.flush_cache:
                r = await client.post("/flush_cache")
                if r.status_code != 200:
                    print(f"warning: /flush_cache answered {r.status_code}")
            outputs, duration = await run_level(client, args, prompts, concurrency, count_tokens)
            metrics = {"concurrency": concurrency, **compute_metrics(outputs, duration)}
            print(format_result(concurrency, metrics))
            if args.output_details:
                metrics["details"] = [{k: v for k, v in asdict(o).items() if k != "generated_text"}
                                      for o in outputs]
            results.append(metrics)
    if len(results) > 1:
        print(format_sweep(results))
    return {"label": args.label, "command": " ".join([sys.executable] + sys.argv),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": machine_info(),
            "args": {k: v for k, v in vars(args).items() if k != "api_key"},
            "server_info": server_info, "results": results}


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    record = asyncio.run(amain(args))
    out = Path(args.output_file) if args.output_file else default_output_file(args.label)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(f"results written to {out}")


if __name__ == "__main__":
    main()
