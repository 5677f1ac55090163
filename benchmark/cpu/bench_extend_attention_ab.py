"""EXTEND attention on the CPU: the paged kernel vs SDPA.

The routing of EXTEND requests in hiserve/layers/attention/cpu_backend.py (`extend_routing`)
rests on this A/B: for B requests with `prefix` cached tokens and n new tokens each (SmolLM2-135M
head shapes: 9 query heads, 3 KV heads, head_dim 64; bf16; slots scattered in a 40000-slot
pool), time `jit_kernel.cpu.paged_attention` against what the backend does without it: over a
cached prefix, per request an index_select of the context's K/V rows, then
`F.scaled_dot_product_attention` with the causal mask; for a fresh prompt (prefix 0), SDPA with
is_causal on the new k/v directly. Interleaved, medians of `--repeats`. Outputs are checked
equal (bf16 tolerance) first.

    python benchmark/cpu/bench_extend_attention_ab.py --threads 1 --clock cpu   # a shared machine

Prints one line per case and writes JSON (CPU from lscpu, threads, clock, medians) to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from hiserve.hardware import detect_cpu
from hiserve.jit_kernel import cpu as cpu_kernels
from hiserve.layers.attention.cpu_backend import CpuPagedAttnBackend

HQ, HKV, D, SLOTS = 9, 3, 64, 40000
_LAYER = SimpleNamespace(num_heads=HQ, num_kv_heads=HKV, head_dim=D, v_head_dim=D, scaling=D**-0.5)

CASES = [(1, 1, 1000), (8, 1, 1000), (1, 2, 1000), (1, 4, 1000), (1, 8, 1000), (8, 8, 1000), (1, 16, 1000),
         (1, 50, 1000), (8, 50, 1000), (1, 128, 1000), (1, 32, 2048), (1, 128, 2048), (1, 8, 200), (1, 50, 200),
         (1, 200, 0), (1, 300, 0), (16, 300, 0), (1, 1000, 0), (1, 2048, 0)]


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
        if prefix == 0:  # the backend's fresh-prompt path: no gather, is_causal on the new k/v
            return torch.cat([CpuPagedAttnBackend._attend(q[r * n:(r + 1) * n], kq.flatten(1), kq.flatten(1),
                                                          _LAYER, None) for r in range(b)])
        outs = []
        for r in range(b):
            slots = req_to_token[r, :total].long()
            k, v = k_buf.index_select(0, slots), v_buf.index_select(0, slots)
            qr = q[r * n:(r + 1) * n].view(n, HQ, D).transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qr, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                                               attn_mask=mask, scale=D**-0.5, enable_gqa=True)
            outs.append(o[0].transpose(0, 1).reshape(n, HQ * D))
        return torch.cat(outs)

    if prefix == 0:  # every request reads request 0's rows, which stand in for the layer's new k (= v)
        req_to_token[:, :total] = req_to_token[0, :total].clone()
        v_buf.copy_(k_buf)
        kq = k_buf.index_select(0, req_to_token[0, :n].long())
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
            "kernel_speedup": med["gather_sdpa"] / med["kernel"]}


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
                  f"SDPA {r['median_ms']['gather_sdpa']:8.2f} ms, kernel speedup {r['kernel_speedup']:.2f}x",
                  flush=True)
    command = "python benchmark/cpu/bench_extend_attention_ab.py " + " ".join(sys.argv[1:])
    Path(args.out).write_text(json.dumps({"benchmark": "cpu_extend_attention_ab", "command": command,
                                          "date": datetime.now(timezone.utc).isoformat(),
                                          "isa": detect_cpu().isa, "cpu": lscpu(),
                                          "threads": args.threads, "clock": args.clock, "torch": torch.__version__,
                                          "cases": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
