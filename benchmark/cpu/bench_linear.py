"""Decode step and prefill time of the Llama forward: GGUF int4 (with and without the row-count
dispatch to a dense copy) vs dequantized bf16 vs float32.

Same-process A/B: the variants of the default model (SmolLM2-135M Q4_1) are loaded side by
side (`--quantization gguf` in bf16 with the int4/dense dispatch calibrated as the server does
it, `gguf` int4 only (HISERVE_GGUF_DENSE_COPY=0), `none` in bf16 with the oneDNN prepacked
linears, `none` in float32) and timed interleaved, variant after variant within each repeat,
so machine noise hits all alike; the tables show medians over repeats. Prefill: one request of
`--prefill-tokens` prompt tokens. A last table times each projection GEMM alone (the fused qkv
and gate/up, o, down and the tied LM head) at `--gemm-rows`.

    python benchmark/cpu/bench_linear.py [--batch-sizes 1 16] [--context 128] [--repeats 7]
        [--variants "int4+dense (gguf)" "bf16 (dequant)"]

Prints both tables and writes JSON (CPU model and flags from lscpu, date, command, torch
version, threads, every median) to benchmark/results/cpu_bench_linear.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from hiserve.layers.attention.torch_native import TorchNativeAttnBackend
from hiserve.layers.forward_batch import ForwardBatch, ForwardMode
from hiserve.layers.quantization import setup_int4_dispatch
from hiserve.mem_cache.allocator import ReqToTokenPool, TokenToKVPoolAllocator
from hiserve.mem_cache.memory_pool import MHATokenToKVPool
from hiserve.models import loader

# The timer: wall time, or with --clock cpu this process's CPU time (on a loaded machine with
# --threads 1, CPU time excludes the time other processes hold the core).
CLOCK = [time.perf_counter]
VARIANTS = {  # name -> (activation dtype, --quantization, dense copy + dispatch)
    "int4+dense (gguf)": (torch.bfloat16, "gguf", True),
    "int4 (gguf)": (torch.bfloat16, "gguf", False),
    "bf16 (dequant)": (torch.bfloat16, "none", False),
    "fp32 (dequant)": (torch.float32, "none", False),
}


class DecodeHarness:
    """Pools, backend and batches for B requests of one model, decode one token a step."""

    def __init__(self, model, config, dtype: torch.dtype, prompts: list[list[int]], pool: int):
        """Prefills `prompts` (one request each) into fresh pools of `pool` KV slots."""
        batch = len(prompts)
        self.model, self.batch = model, batch
        self.req_to_token_pool = ReqToTokenPool(batch, pool // batch, "cpu")
        self.kv_pool = MHATokenToKVPool(pool, 1, dtype, config.num_key_value_heads, config.head_dim,
                                        config.num_hidden_layers, "cpu")
        self.allocator = TokenToKVPoolAllocator(pool, 1, "cpu", self.kv_pool)
        self.backend = TorchNativeAttnBackend()
        self.rows = list(range(batch))
        self.lens = [0] * batch
        start = CLOCK[0]()
        self.first_logits = self.step(ForwardMode.EXTEND, prompts)
        self.prefill_ms = (CLOCK[0]() - start) * 1e3

    def step(self, mode: ForwardMode, tokens: list[list[int]]) -> torch.Tensor:
        ext = [len(t) for t in tokens]
        prefix = list(self.lens)
        loc = self.allocator.alloc(sum(ext))
        off = 0
        for i, (p, e) in enumerate(zip(prefix, ext)):
            self.req_to_token_pool.req_to_token[self.rows[i], p:p + e] = loc[off:off + e].int()
            self.lens[i] = p + e
            off += e
        fb = ForwardBatch(
            forward_mode=mode, batch_size=self.batch,
            input_ids=torch.tensor([t for ts in tokens for t in ts], dtype=torch.long),
            positions=torch.cat([torch.arange(p, p + e) for p, e in zip(prefix, ext)]),
            out_cache_loc=loc, req_pool_indices=torch.tensor(self.rows, dtype=torch.long),
            seq_lens=torch.tensor(self.lens, dtype=torch.long), seq_lens_cpu=list(self.lens),
            extend_seq_lens_cpu=ext, extend_prefix_lens_cpu=prefix,
            req_to_token_pool=self.req_to_token_pool, token_to_kv_pool=self.kv_pool,
            attn_backend=self.backend)
        self.backend.init_forward_metadata(fb)
        return self.model(fb)

    def decode_ms(self, steps: int) -> float:
        """Mean milliseconds of one decode step (B tokens) over `steps` greedy steps."""
        logits = self.step(ForwardMode.DECODE, [[1]] * self.batch)
        start = CLOCK[0]()
        for _ in range(steps):
            nxt = logits.argmax(-1).tolist()
            logits = self.step(ForwardMode.DECODE, [[t] for t in nxt])
        return (CLOCK[0]() - start) / steps * 1e3


def load_variants(path: str, names: list[str]) -> dict:
    """Load each named variant as the server would (pack, then the int4/dense dispatch)."""
    models = {}
    for name in names:
        dtype, quant, dense = VARIANTS[name]
        os.environ["HISERVE_GGUF_DENSE_COPY"] = "1" if dense else "0"
        model, config = loader.load_model(path, dtype, "cpu", quantization=quant)
        model.pack_for_cpu()
        report = setup_int4_dispatch(model)
        if report is not None:
            print(f"{name}: {report.describe()}", flush=True)
        models[name] = (model, config, dtype)
    os.environ.pop("HISERVE_GGUF_DENSE_COPY")
    return models


def bench_prefill(models: dict, tokens: int, repeats: int) -> list[dict]:
    """One request's prefill of `tokens` prompt tokens, interleaved across variants."""
    vocab = next(iter(models.values()))[1].vocab_size
    prompt = torch.randint(100, vocab, (1, tokens), generator=torch.Generator().manual_seed(1)).tolist()
    times: dict[str, list[float]] = {n: [] for n in models}
    with torch.inference_mode():
        for _ in range(repeats):
            for n, (m, c, d) in models.items():
                times[n].append(DecodeHarness(m, c, d, prompt, tokens + 8).prefill_ms)
    rows = []
    for n, ts in times.items():
        rows.append({"variant": n, "tokens": tokens, "median_ms": statistics.median(ts), "samples_ms": ts})
        print(f"prefill {tokens} tokens {n}: median {rows[-1]['median_ms']:.1f} ms", flush=True)
    return rows


def bench_decode(models: dict, batch_sizes: list[int], context: int, steps: int, repeats: int) -> list[dict]:
    rows = []
    for b in batch_sizes:
        pool = b * (context + (repeats + 1) * (steps + 1) + 8)
        gen = torch.Generator().manual_seed(0)
        prompts = torch.randint(100, next(iter(models.values()))[1].vocab_size, (b, context), generator=gen).tolist()
        harness = {n: DecodeHarness(m, c, d, prompts, pool) for n, (m, c, d) in models.items()}
        times: dict[str, list[float]] = {n: [] for n in models}
        with torch.inference_mode():
            for _ in range(repeats):
                for n, h in harness.items():
                    times[n].append(h.decode_ms(steps))
        for n, ts in times.items():
            rows.append({"variant": n, "batch": b, "context": context, "median_ms_per_step": statistics.median(ts),
                         "min_ms_per_step": min(ts), "samples_ms": ts})
            print(f"decode batch {b} {n}: median {rows[-1]['median_ms_per_step']:.2f} ms/step", flush=True)
    return rows


def _timeit_us(fn, reps: int, inner: int = 20) -> float:
    fn()
    samples = []
    for _ in range(reps):
        start = CLOCK[0]()
        for _ in range(inner):
            fn()
        samples.append((CLOCK[0]() - start) / inner * 1e6)
    return statistics.median(samples)


def bench_gemms(models: dict, ms: list[int], repeats: int) -> list[dict]:
    """Each projection of layer 0 (and the LM head) alone, interleaved across variants."""
    rows = []
    layer_of = {n: m.model.layers[0] for n, (m, _, _) in models.items()}
    heads = {n: m.lm_head_weight for n, (m, _, _) in models.items()}
    for proj in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj", "lm_head"):
        for m in ms:
            res = {}
            with torch.inference_mode():
                for n, (_, _, dtype) in models.items():
                    mod = heads[n] if proj == "lm_head" else layer_of[n].get_submodule(proj)
                    k = mod.in_features if isinstance(mod, torch.nn.Module) else mod.shape[1]
                    x = torch.randn(m, k, dtype=dtype)
                    fn = (lambda mod=mod, x=x: mod(x)) if isinstance(mod, torch.nn.Module) else \
                        (lambda w=mod, x=x: torch.nn.functional.linear(x, w))
                    res[n] = _timeit_us(fn, repeats)
            rows.append({"proj": proj, "M": m, "kind": {n: type(_mod_of(layer_of[n], heads[n], proj)).__name__
                                                         for n in models}, "median_us": res})
            print(f"gemm {proj} M={m}: " + ", ".join(f"{n} {v:.0f} us" for n, v in res.items()), flush=True)
    return rows


def _mod_of(layer, head, proj):
    return head if proj == "lm_head" else layer.get_submodule(proj)


def lscpu() -> dict:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return {"model_name": fields.get("Model name", "").strip(), "flags": fields.get("Flags", "").strip().split(),
            "cpus": fields.get("CPU(s)", "").strip()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--context", type=int, default=128, help="prompt tokens per request before decode")
    ap.add_argument("--steps", type=int, default=8, help="decode steps per timed sample")
    ap.add_argument("--repeats", type=int, default=7, help="timed samples per variant (median reported)")
    ap.add_argument("--gemm-rows", type=int, nargs="*", default=[1, 4, 8, 16, 256])
    ap.add_argument("--prefill-tokens", type=int, default=256, help="prompt of the prefill timing (0: none)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: process CPU time (use with --threads 1 on a loaded machine)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "cpu_bench_linear.json"))
    args = ap.parse_args()
    path = loader.resolve_model_path(args.model_path)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        CLOCK[0] = time.process_time
    models = load_variants(path, args.variants)
    decode = bench_decode(models, args.batch_sizes, args.context, args.steps, args.repeats)
    prefill = bench_prefill(models, args.prefill_tokens, args.repeats) if args.prefill_tokens else []
    gemms = bench_gemms(models, args.gemm_rows, args.repeats) if args.gemm_rows else []
    print_tables(args, decode, prefill, gemms)
    result = {"benchmark": "cpu_bench_linear", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "command": " ".join([os.path.basename(sys.executable), *sys.argv]), "model": path,
              "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": lscpu(),
              "decode": decode, "prefill": prefill, "gemm": gemms,
              "clock": args.clock,
              "note": "same-process interleaved A/B; medians over repeats"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"\nwrote {args.out}")


def print_tables(args: argparse.Namespace, decode: list[dict], prefill: list[dict], gemms: list[dict]) -> None:
    """The three tables: decode step, prefill, one GEMM (medians; ratio against bf16 dequant)."""
    names = args.variants
    base = "bf16 (dequant)" if "bf16 (dequant)" in names else names[-1]
    print(f"\nDecode step (model forward, torch_native attention, context {args.context}); median ms per step")
    print(f"{'batch':>5} " + " ".join(f"{n:>18}" for n in names) + f"  {names[0]} / {base}")
    for b in args.batch_sizes:
        med = {r["variant"]: r["median_ms_per_step"] for r in decode if r["batch"] == b}
        print(f"{b:>5} " + " ".join(f"{med[n]:>18.2f}" for n in names) + f"  {med[names[0]] / med[base]:.2f}")
    if prefill:
        med = {r["variant"]: r["median_ms"] for r in prefill}
        print(f"\nPrefill of {args.prefill_tokens} tokens (one request); median ms")
        print(" ".join(f"{n:>18}" for n in names) + f"  {names[0]} / {base}")
        print(" ".join(f"{med[n]:>18.1f}" for n in names) + f"  {med[names[0]] / med[base]:.2f}")
    if gemms:
        print("\nOne GEMM (layer 0 / LM head); median us")
        print(f"{'proj':>20} {'M':>4} " + " ".join(f"{n:>18}" for n in names))
        for r in gemms:
            print(f"{r['proj']:>20} {r['M']:>4} " + " ".join(f"{r['median_us'][n]:>18.0f}" for n in names))


if __name__ == "__main__":
    main()
