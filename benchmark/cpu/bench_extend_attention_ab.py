"""EXTEND attention over a cached prefix on the CPU: the paged kernel vs gather + SDPA.

The choice `PAGED_EXTEND_MAX_NEW_TOKENS` in hiserve/layers/attention/cpu_backend.py rests on
this A/B: for B requests with `prefix` cached tokens and n new tokens each (SmolLM2-135M head
shapes: 9 query heads, 3 KV heads, head_dim 64; bf16; slots scattered in a 40000-slot pool),
time `jit_kernel.cpu.paged_attention` against what the backend does above the limit (per
request: index_select of the context's K/V rows, then `F.scaled_dot_product_attention` with
the causal mask), interleaved, medians of `--repeats`. Outputs are checked equal (bf16
tolerance) first.

    python benchmark/cpu/bench_extend_attention_ab.py --threads 1 --clock cpu   # a shared machine

Prints one line per case and writes JSON (CPU from lscpu, threads, clock, medians) to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from hiserve.jit_kernel import cpu as cpu_kernels

HQ, HKV, D, SLOTS = 9, 3, 64, 40000
CASES = [(1, 1, 1000), (8, 1, 1000), (1, 2, 1000), (1, 4, 1000), (1, 8, 1000), (8, 8, 1000), (1, 16, 1000),
         (1, 50, 1000), (8, 50, 1000), (1, 128, 1000), (1, 32, 2048), (1, 128, 2048), (1, 8, 200), (1, 50, 200)]


def bench_case(b: int, n: int, prefix: int, repeats: int, clock) -> dict:
    """Median ms of both paths for B requests of `prefix` cached + n new tokens."""
    gen = torch.Generator().manual_seed(0)
    k_buf = torch.randn(SLOTS, HKV, D, generator=gen).to(torch.bfloat16)
    v_buf = torch.randn(SLOTS, HKV, D, generator=gen).to(torch.bfloat16)
    total = prefix + n
    req_to_token = torch.zeros(b, 4096, dtype=torch.int32)
    req_to_token[:, :total] = torch.randperm(SLOTS, generator=gen)[:b * total].view(b, total).int()
    q = torch.randn(b * n, HQ * D, generator=gen).to(torch.bfloat16)
    idx, lens, starts = torch.arange(b), torch.full((b,), total), torch.arange(b + 1) * n
    mask = torch.arange(total).view(1, -1) <= torch.arange(prefix, total).view(-1, 1)

    def kernel() -> torch.Tensor:
        return cpu_kernels.paged_attention(q, k_buf, v_buf, req_to_token, idx, lens, starts, HQ, D**-0.5)

    def gather_sdpa() -> torch.Tensor:
        outs = []
        for r in range(b):
            slots = req_to_token[r, :total].long()
            k, v = k_buf.index_select(0, slots), v_buf.index_select(0, slots)
            qr = q[r * n:(r + 1) * n].view(n, HQ, D).transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qr, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                                               attn_mask=mask, scale=D**-0.5, enable_gqa=True)
            outs.append(o[0].transpose(0, 1).reshape(n, HQ * D))
        return torch.cat(outs)

    err = (kernel().float() - gather_sdpa().float()).abs().max().item()
    assert err < 0.05, f"paths disagree by {err}"
    times: dict[str, list[float]] = {"kernel": [], "gather_sdpa": []}
    for _ in range(repeats):
        for name, fn in (("kernel", kernel), ("gather_sdpa", gather_sdpa)):
            start = clock()
            fn()
            times[name].append((clock() - start) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"batch": b, "new_tokens": n, "prefix": prefix, "median_ms": med,
            "sdpa_speedup": med["kernel"] / med["gather_sdpa"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="cpu")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" /
                                         "cpu_extend_attention_ab.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    from bench_linear import lscpu  # noqa: E402  (same folder)

    rows = []
    with torch.inference_mode():
        for b, n, prefix in CASES:
            r = bench_case(b, n, prefix, args.repeats, clock)
            rows.append(r)
            print(f"B={b:>2} new={n:>4} cached={prefix:>5}: kernel {r['median_ms']['kernel']:8.2f} ms, "
                  f"gather+SDPA {r['median_ms']['gather_sdpa']:8.2f} ms, SDPA speedup {r['sdpa_speedup']:.2f}x",
                  flush=True)
    Path(args.out).write_text(json.dumps({"benchmark": "cpu_extend_attention_ab", "cpu": lscpu(),
                                          "threads": args.threads, "clock": args.clock, "torch": torch.__version__,
                                          "cases": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
