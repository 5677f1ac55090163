"""Closed-loop multi-turn chat benchmark (the workload HiCache is meant for).

`--num-clients` conversations of `--num-rounds` rounds each. Round 1 sends a random
question of `--request-length` tokens; every later round re-sends the whole conversation so
far (previous prompt + the model's answer) plus a new random question of the same length,
so each round's prompt extends the previous one and its prefix can come from the cache.
A client sends its next round only after the previous reply (closed loop); the clients'
rounds interleave, paced by `--request-rate` (Poisson arrivals, `inf` = back to back) and
capped by `--max-parallel` requests in flight. Greedy decoding, `ignore_eos`,
`max_new_tokens = --output-length`.

    python benchmark/hicache/bench_multiturn.py --base-url http://127.0.0.1:30000 \\
        --num-clients 12 --num-rounds 6 --request-length 200 --output-length 32 \\
        --max-parallel 4 --flush-cache --label with_hicache

    python benchmark/hicache/bench_multiturn.py --compare A.json B.json   # A = without, B = with

`--api-format native` (default) streams POST /generate with `input_ids` (the conversation's
token ids: previous prompt ids + output_ids + new question ids) and reads
`meta_info.prompt_tokens`, `cached_tokens` and `cached_tokens_details` {device, host, storage} from
the first chunk and the cumulative `output_ids` from the last one. `--api-format openai`
streams /v1/chat/completions with the conversation as messages (cached tokens from
`usage.prompt_tokens_details`, no device/host/storage split, the answer's text instead of ids).

TTFT = time to the first chunk carrying output tokens. Every request's output is stored in
the JSON, so `--compare` can tell whether two runs produced identical outputs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

import httpx
import numpy as np
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parents[2]
for p in (REPO_ROOT, REPO_ROOT / "benchmark"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from bench_serving import PromptMaker, load_tokenizer, machine_info, summarize  # noqa: E402
from hicache.multiturn_compare import compare, format_compare  # noqa: E402

RESULTS_DIR = REPO_ROOT / "benchmark" / "results"


# ------------------------------------------------------------------ conversations


@dataclass
class RequestRecord:
    client: int
    round: int
    success: bool = False
    error: str = ""
    send_time: float = 0.0          # seconds since the start of the run
    ttft: float = 0.0               # seconds
    latency: float = 0.0            # seconds
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    cached_device: Optional[int] = None
    cached_host: Optional[int] = None
    cached_storage: Optional[int] = None  # tokens read from the storage tier (L3)
    output_ids: Optional[list[int]] = None
    output_text: Optional[str] = None


class Conversation:
    """One client's history; its questions are fixed by (seed, client, round) alone, so two
    runs send identical conversations as long as the model answers identically."""

    def __init__(self, idx: int, args, maker: PromptMaker):
        self.idx = idx
        self.args = args
        self.maker = maker
        self.round = 0
        self.ids: list[int] = []                    # native: all tokens so far
        self.messages: list[dict[str, str]] = []    # openai: the chat so far

    @property
    def done(self) -> bool:
        return self.round >= self.args.num_rounds

    def question(self) -> tuple[str, list[int]]:
        rng = np.random.default_rng([self.args.seed, self.idx, self.round])
        text, _ = self.maker.random_text(rng, self.args.request_length)
        return text, self.maker.encode(text)

    def next_payload(self) -> tuple[str, dict]:
        text, qids = self.question()
        a = self.args
        if a.api_format == "native":
            self.pending_ids = self.ids + qids
            return "/generate", {
                "input_ids": self.pending_ids,
                "sampling_params": {"temperature": 0.0, "max_new_tokens": a.output_length,
                                    "ignore_eos": True},
                "stream": True,
            }
        self.pending_messages = self.messages + [{"role": "user", "content": text}]
        return "/v1/chat/completions", {
            "model": a.model, "messages": self.pending_messages, "max_tokens": a.output_length,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
        }

    def commit(self, rec: RequestRecord) -> None:
        """Append the reply; the next round continues from it."""
        if self.args.api_format == "native":
            self.ids = self.pending_ids + list(rec.output_ids or [])
        else:
            self.messages = self.pending_messages + [{"role": "assistant",
                                                      "content": rec.output_text or ""}]
        self.round += 1


async def send_round(client: httpx.AsyncClient, conv: Conversation, t0: float) -> RequestRecord:
    rec = RequestRecord(client=conv.idx, round=conv.round)
    path, body = conv.next_payload()
    start = time.perf_counter()
    rec.send_time = start - t0
    first_meta = last = None
    text_parts: list[str] = []
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                rec.latency = time.perf_counter() - start
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    raise RuntimeError(str(chunk["error"])[:300])
                now = time.perf_counter()
                if conv.args.api_format == "native":
                    if first_meta is None:
                        first_meta = chunk.get("meta_info") or {}
                    if chunk.get("output_ids") and not rec.ttft:
                        rec.ttft = now - start
                    last = chunk
                else:
                    choices = chunk.get("choices") or []
                    delta = (choices[0].get("delta") or {}) if choices else {}
                    piece = delta.get("content") or ""
                    if piece:
                        text_parts.append(piece)
                        if not rec.ttft:
                            rec.ttft = now - start
                    if chunk.get("usage"):
                        last = chunk
        rec.latency = time.perf_counter() - start
    except Exception as e:  # one failed request must not end the run
        rec.error = f"{type(e).__name__}: {e}"
        rec.latency = time.perf_counter() - start
        return rec
    if last is None or not rec.ttft:
        rec.error = "no output in the stream"
        return rec
    if conv.args.api_format == "native":
        meta = last.get("meta_info") or {}
        first_meta = first_meta or meta
        details = first_meta.get("cached_tokens_details") or meta.get("cached_tokens_details") or {}
        rec.output_ids = list(last["output_ids"])
        rec.output_tokens = meta.get("completion_tokens", len(rec.output_ids))
        rec.prompt_tokens = first_meta.get("prompt_tokens") or meta.get("prompt_tokens") or len(body["input_ids"])
        rec.cached_tokens = int(first_meta.get("cached_tokens", meta.get("cached_tokens", 0)) or 0)
        rec.cached_device = details.get("device")
        rec.cached_host = details.get("host")
        rec.cached_storage = details.get("storage")
    else:
        usage = last["usage"]
        rec.output_text = "".join(text_parts)
        rec.output_tokens = usage.get("completion_tokens", 0)
        rec.prompt_tokens = usage.get("prompt_tokens", 0)
        rec.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    rec.success = True
    return rec


async def run_clients(args, maker: PromptMaker, client: httpx.AsyncClient) -> tuple[list[RequestRecord], float]:
    """Closed loop: a ready queue of clients whose previous round has been answered; the
    dispatcher pops one per arrival (Poisson gaps at --request-rate), at most --max-parallel
    in flight."""
    convs = [Conversation(i, args, maker) for i in range(args.num_clients)]
    ready: deque[Conversation] = deque(convs)
    wake = asyncio.Event()
    in_flight = 0
    records: list[RequestRecord] = []
    total = args.num_clients * args.num_rounds
    rng = np.random.default_rng(args.seed + 7)
    bar = tqdm(total=total, desc="requests", disable=args.disable_tqdm)
    t0 = time.perf_counter()

    async def one(conv: Conversation) -> None:
        nonlocal in_flight
        rec = await send_round(client, conv, t0)
        records.append(rec)
        bar.update(1)
        if rec.success:
            conv.commit(rec)
            if not conv.done:
                ready.append(conv)
        # a failed round ends that conversation (its next prompt would be undefined)
        in_flight -= 1
        wake.set()

    tasks = []
    while True:
        while not ready or in_flight >= args.max_parallel:
            if not ready and in_flight == 0:
                break
            wake.clear()
            await wake.wait()
        if not ready and in_flight == 0:
            break
        conv = ready.popleft()
        in_flight += 1
        tasks.append(asyncio.create_task(one(conv)))
        if math.isfinite(args.request_rate):
            await asyncio.sleep(float(rng.exponential(1.0 / args.request_rate)))
    await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    bar.close()
    records.sort(key=lambda r: (r.client, r.round))
    return records, duration


# ------------------------------------------------------------------ figures


def compute_metrics(records: list[RequestRecord], duration: float, num_rounds: int) -> dict[str, Any]:
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    dev = [r.cached_device for r in ok if r.cached_device is not None]
    host = [r.cached_host for r in ok if r.cached_host is not None]
    storage = [r.cached_storage for r in ok if r.cached_storage is not None]
    m: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "input_token_throughput": total_in / duration if duration > 0 else 0.0,
        "output_token_throughput": total_out / duration if duration > 0 else 0.0,
        "total_prompt_tokens": total_in,
        "total_output_tokens": total_out,
        "total_cached_tokens": cached,
        "cached_tokens_device": sum(dev) if dev else None,
        "cached_tokens_host": sum(host) if host else None,
        "requests_with_host_hits": sum(1 for h in host if h > 0) if host else None,
        "cached_tokens_storage": sum(storage) if storage else None,
        "requests_with_storage_hits": sum(1 for s in storage if s > 0) if storage else None,
        "cache_hit_rate": cached / total_in if total_in else None,
    }
    for name, values in (("ttft", [r.ttft for r in ok]), ("e2e_latency", [r.latency for r in ok])):
        for stat, v in summarize(values, 1000.0).items():
            m[f"{stat}_{name}_ms"] = v
    per_round = []
    for rnd in range(num_rounds):
        rs = [r for r in ok if r.round == rnd]
        prompt = sum(r.prompt_tokens for r in rs)
        per_round.append({
            "round": rnd + 1, "requests": len(rs),
            "mean_ttft_ms": 1000.0 * float(np.mean([r.ttft for r in rs])) if rs else None,
            "mean_prompt_tokens": prompt / len(rs) if rs else None,
            "cache_hit_rate": sum(r.cached_tokens for r in rs) / prompt if prompt else None,
            "cached_host": sum(r.cached_host or 0 for r in rs),
            "cached_storage": sum(r.cached_storage or 0 for r in rs),
        })
    m["per_round"] = per_round
    m["errors"] = sorted({r.error for r in records if not r.success})[:10]
    return m


def format_result(m: dict[str, Any], label: str) -> str:
    def num(v, fmt="{:.2f}"):
        return "n/a" if v is None else fmt.format(v)

    rows = [
        ("Label", label or "-"),
        ("Successful requests", str(m["completed"])),
        ("Failed requests", str(m["failed"])),
        ("Benchmark duration (s)", num(m["duration_s"])),
        ("Request throughput (req/s)", num(m["request_throughput"], "{:.3f}")),
        ("Input token throughput (tok/s)", num(m["input_token_throughput"], "{:.1f}")),
        ("Output token throughput (tok/s)", num(m["output_token_throughput"], "{:.1f}")),
        ("Total prompt tokens", str(m["total_prompt_tokens"])),
        ("Total cached tokens", str(m["total_cached_tokens"])),
        ("  of which device", num(m["cached_tokens_device"], "{}")),
        ("  of which host", num(m["cached_tokens_host"], "{}")),
        ("  of which storage", num(m.get("cached_tokens_storage"), "{}")),
        ("Cache hit rate", num(m["cache_hit_rate"], "{:.3f}")),
        (None, "Time to First Token"),
        *[(f"{s.capitalize()} TTFT (ms)", num(m[f"{s}_ttft_ms"])) for s in ("mean", "median", "p90", "p99")],
        (None, "End-to-End Latency"),
        *[(f"{s.capitalize()} E2E Latency (ms)", num(m[f"{s}_e2e_latency_ms"]))
          for s in ("mean", "median", "p90", "p99")],
        (None, "Per round: mean TTFT (ms) / hit rate"),
        *[(f"Round {r['round']} ({r['requests']} req)",
           f"{num(r['mean_ttft_ms'], '{:.1f}')} / {num(r['cache_hit_rate'], '{:.2f}')}")
          for r in m["per_round"]],
    ]
    lines = ["{s:{c}^60}".format(s=" Multi-turn Benchmark Result ", c="=")]
    for k, v in rows:
        lines.append("{s:{c}^60}".format(s=f" {v} ", c="-") if k is None else f"{k:<40}{v:>20}")
    if m["errors"]:
        lines.append("First errors:")
        lines.extend(f"  {e[:200]}" for e in m["errors"])
    lines.append("=" * 60)
    return "\n".join(lines)


# ------------------------------------------------------------------ server helpers


def metric_values(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sum of the samples of each Prometheus metric in `names` (labels ignored)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            try:
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            except ValueError:
                pass
    return out


HICACHE_METRICS = ("sglang:cached_tokens_total", "sglang:cached_tokens_device_total",
                   "sglang:cached_tokens_host_total", "sglang:hicache_host_used_tokens",
                   "sglang:hicache_host_total_tokens")


def server_snapshot(c: httpx.Client) -> dict[str, Any]:
    snap: dict[str, Any] = {}
    try:
        r = c.get("/get_server_info")
        if r.status_code == 200:
            info = r.json()
            keys = ("model_path", "dtype", "device", "page_size", "max_total_num_tokens",
                    "chunked_prefill_size", "max_running_requests", "enable_hierarchical_cache",
                    "hicache_ratio", "hicache_size", "hicache_mem_layout", "hicache_write_policy",
                    "hicache_io_backend", "attention_backend", "version")
            snap["server_args"] = {k: info.get(k) for k in keys if k in info}
            snap["internal_state"] = (info.get("internal_states") or [{}])[0]
    except (httpx.HTTPError, ValueError):
        pass
    try:
        r = c.get("/metrics")
        if r.status_code == 200:
            snap["metrics"] = metric_values(r.text, HICACHE_METRICS)
    except httpx.HTTPError:
        pass
    return snap


# ------------------------------------------------------------------ main


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--num-clients", type=int, default=12, help="conversations")
    p.add_argument("--num-rounds", type=int, default=6, help="rounds (requests) per conversation")
    p.add_argument("--request-length", type=int, default=200, help="tokens of each new user question")
    p.add_argument("--output-length", type=int, default=32, help="max_new_tokens (with ignore_eos)")
    p.add_argument("--max-parallel", type=int, default=4, help="requests in flight at most")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="dispatch rate in requests/s (Poisson gaps); inf = as fast as allowed")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--api-format", choices=["native", "openai"], default="native")
    p.add_argument("--model", default=None, help="model name for --api-format openai (default: /v1/models)")
    p.add_argument("--tokenizer", default=None, help="default: /get_model_info's model_path")
    p.add_argument("--flush-cache", action="store_true", help="POST /flush_cache before the run")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed unrelated requests before the run (and before the flush)")
    p.add_argument("--request-timeout", type=float, default=3600.0)
    p.add_argument("--label", default="")
    p.add_argument("--output-file", default=None,
                   help="JSON results (default: benchmark/results/multiturn_<label>_<time>.json)")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), default=None,
                   help="compare two result files (A = baseline, B = candidate) instead of running")
    args = p.parse_args(argv)
    if args.compare is None:
        if min(args.num_clients, args.num_rounds, args.request_length, args.output_length,
               args.max_parallel) < 1:
            p.error("--num-clients, --num-rounds, --request-length, --output-length and "
                    "--max-parallel must be at least 1")
        if not args.request_rate > 0:
            p.error("--request-rate must be > 0 (inf for no pacing)")
    return args


async def amain(args) -> dict[str, Any]:
    with httpx.Client(base_url=args.base_url, timeout=60) as c:
        if args.tokenizer is None:
            info = c.get("/get_model_info").json()
            args.tokenizer = info.get("tokenizer_path") or info.get("model_path")
        if args.api_format == "openai" and args.model is None:
            args.model = c.get("/v1/models").json()["data"][0]["id"]
        maker = PromptMaker(load_tokenizer(args.tokenizer))
        limits = httpx.Limits(max_connections=args.max_parallel + 8, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=args.base_url, limits=limits,
                                     timeout=httpx.Timeout(args.request_timeout, connect=30.0)) as ac:
            for i in range(args.warmup):
                warm = Conversation(10_000_000 + i, args, maker)
                rec = await send_round(ac, warm, time.perf_counter())
                if not rec.success:
                    raise SystemExit(f"warm-up request failed: {rec.error}")
            if args.flush_cache:
                r = c.post("/flush_cache")
                if r.status_code != 200:
                    raise SystemExit(f"/flush_cache answered {r.status_code}: {r.text[:200]}")
            before = server_snapshot(c)
            print(f"tokenizer={args.tokenizer!r} api={args.api_format} clients={args.num_clients} "
                  f"rounds={args.num_rounds} question={args.request_length} output={args.output_length} "
                  f"max_parallel={args.max_parallel} rate={args.request_rate}")
            records, duration = await run_clients(args, maker, ac)
        after = server_snapshot(c)
    metrics = compute_metrics(records, duration, args.num_rounds)
    print(format_result(metrics, args.label))
    return {"label": args.label, "command": " ".join([sys.executable] + sys.argv),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": machine_info(),
            "args": {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v)
                     for k, v in vars(args).items()},
            "server_before": before, "server_after": after,
            "metrics": metrics, "requests": [asdict(r) for r in records]}


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, default=str) + "\n")
    print(f"results written to {path}")


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if args.compare:
        result = compare(*args.compare)
        result["command"] = " ".join([sys.executable] + sys.argv)
        print(format_compare(result))
        if args.output_file:
            write_json(Path(args.output_file), result)
        return
    record = asyncio.run(amain(args))
    if args.output_file:
        out = Path(args.output_file)
    else:
        stamp = datetime.now().strftime("%Y%m%d_%H%M%S")
        out = RESULTS_DIR / (f"multiturn_{args.label}_{stamp}.json" if args.label else f"multiturn_{stamp}.json")
    write_json(out, record)


if __name__ == "__main__":
    main()
