"""EXTEND attention over a cached prefix on the CPU's SDPA route: one masked SDPA call a request
over its gathered context (the path before `cpu_prefix_split`, and still a lone request's)
against the split prefix / own calls merged by log-sum-exp, with the prefix call shared by the
requests on the same slots; and, within the split, the members' own parts as one padded batched
call ("split+shared", whatever their padding factor) against one call each ("own each"): the
thresholds MIN_SHARED_TOKENS, MIN_SHARED_TO_OWN, MAX_OWN_PADDING and MAX_OWN_PADDED_PAIRS rest on
these cases.

Cases (SmolLM2-135M heads: 9 query heads, 3 KV heads, head dim 64, bf16; slots scattered in a
40000-slot pool): B requests of n new tokens over one shared cached prefix of L tokens, as in
scenario (c) (a ~1000-token system prompt, ~50-token questions), down to two requests. Both
paths run interleaved in one process; medians of --repeats; outputs checked equal (bf16
tolerance) first.

    python benchmark/cpu/bench_prefix_split.py [--out benchmark/results/x.json]

Prints a table; the JSON holds the command, CPU (lscpu), threads, date and per-case medians.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scheduler_steps import _cpu_model  # noqa: E402

from hiserve.layers.attention import cpu_prefix_split as prefix_split  # noqa: E402

HQ, HKV, D, POOL = 9, 3, 64, 40000
# (B, n, L): scenario (c)'s shapes, then the edges behind MIN_SHARED_TO_OWN
CASES = [(7, 56, 1008), (8, 50, 1008), (2, 56, 1008), (4, 128, 2048), (2, 60, 512), (2, 32, 512), (4, 32, 256),
         (2, 32, 256), (2, 16, 256), (2, 100, 400), (4, 50, 200), (8, 100, 300), (2, 200, 300), (2, 30, 120),
         # members of unequal size: own-part padding factors ~1.3, ~1.6, ~1.9 (MAX_OWN_PADDING)
         (4, (56, 50, 44, 40), 1008), (4, (56, 44, 36, 30), 1008), (4, (56, 40, 30, 30), 1008),
         (2, (200, 100), 1600), (3, (128, 96, 64), 2048)]


def _inputs(b: int, n: int | tuple[int, ...], prefix: int, gen: torch.Generator):
    """n: every request's new tokens, or each one's (a tuple of b)."""
    ns = n if isinstance(n, tuple) else (n,) * b
    kb = torch.randn(POOL, HKV, D, generator=gen).to(torch.bfloat16)
    vb = torch.randn(POOL, HKV, D, generator=gen).to(torch.bfloat16)
    perm = torch.randperm(POOL, generator=gen)
    starts = [sum(ns[:i]) for i in range(b + 1)]
    chunks = [(starts[i], starts[i + 1], prefix,
               torch.cat([perm[:prefix], perm[prefix + starts[i] : prefix + starts[i + 1]]])) for i in range(b)]
    q = torch.randn(starts[-1], HQ * D, generator=gen).to(torch.bfloat16)
    return q, kb, vb, chunks


def _gathered(q, kb, vb, chunks, out):
    """The former path: per request, its context gathered and one SDPA call with the causal mask."""
    for start, end, p, slots in chunks:
        n = end - start
        mask = torch.arange(p + n).view(1, -1) <= torch.arange(p, p + n).view(-1, 1)
        k = kb.index_select(0, slots).transpose(0, 1).unsqueeze(0)
        v = vb.index_select(0, slots).transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(q[start:end].view(n, HQ, D).transpose(0, 1).unsqueeze(0), k, v,
                                           attn_mask=mask, scale=D ** -0.5, enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1).reshape(n, HQ * D)


def _samples_ms(fn, repeats: int, inner: int = 5) -> list[float]:
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t) / inner * 1e3)
    return samples


def run_case(b: int, n: int | tuple[int, ...], prefix: int, repeats: int) -> dict:
    seed = b * 1000 + sum(n if isinstance(n, tuple) else (n,))
    q, kb, vb, chunks = _inputs(b, n, prefix, torch.Generator().manual_seed(seed))
    names = ("MIN_SHARED_TOKENS", "MIN_SHARED_TO_OWN", "MAX_OWN_PADDING", "MAX_OWN_PADDED_PAIRS")
    limits = [getattr(prefix_split, k) for k in names]
    # time the split (and the own parts batched) even where plan_groups would not choose it:
    # these cases are what its thresholds rest on
    for k, v in zip(names, (1, 0, float("inf"), float("inf"))):
        setattr(prefix_split, k, v)
    try:
        groups, _ = prefix_split.plan_groups(chunks)
    finally:
        for k, v in zip(names, limits):
            setattr(prefix_split, k, v)
    want, got = torch.empty_like(q), torch.empty_like(q)
    _gathered(q, kb, vb, chunks, want)
    for g in groups:
        prefix_split.attend_group(q, kb, vb, g, HQ, D ** -0.5, got)
    err = (got.float() - want.float()).abs().max().item()
    assert err <= 2e-2 * want.float().abs().max().item() + 1e-3, f"outputs differ by {err}"
    each = [copy.copy(g) for g in groups]
    for g in each:
        g.batched = None  # the own parts one call a member
    before, after, own_each = [], [], []
    for _ in range(repeats):  # interleaved: a noisy host hits all alike
        before += _samples_ms(lambda: _gathered(q, kb, vb, chunks, want), 1)
        after += _samples_ms(lambda: [prefix_split.attend_group(q, kb, vb, g, HQ, D ** -0.5, got) for g in groups], 1)
        own_each += _samples_ms(lambda: [prefix_split.attend_group(q, kb, vb, g, HQ, D ** -0.5, got) for g in each], 1)
    mb, ma, me = statistics.median(before), statistics.median(after), statistics.median(own_each)
    ns = [e - s for s, e, _, _ in chunks]
    pad = b * max(ns) ** 2 / sum(x * x for x in ns)  # own part = the new tokens here (no own cached)
    return {"requests": b, "new_tokens": n, "own_padding_factor": pad, "shared_prefix": prefix,
            "gathered_ms": mb, "split_shared_ms": ma,
            "ratio": ma / mb, "split_own_each_ms": me,
            "batched_to_each": ma / me, "max_abs_error": err}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not prefix_split.available():
        raise SystemExit("this torch lacks aten._scaled_dot_product_flash_attention_for_cpu")
    rows = [run_case(b, n, p, args.repeats) for b, n, p in CASES]
    print(f"CPU: {_cpu_model()}, {torch.get_num_threads()} threads, one layer, medians of {args.repeats}")
    print(f"{'requests x new over shared':>34} {'gathered ms':>12} {'split+shared ms':>16} {'ratio':>6} "
          f"{'own each ms':>12} {'padding':>8} {'batched/each':>13}")
    for r in rows:
        case = f"{r['requests']} x {r['new_tokens']} over {r['shared_prefix']}"
        print(f"{case:>34} {r['gathered_ms']:12.2f} {r['split_shared_ms']:16.2f} {r['ratio']:6.2f} "
              f"{r['split_own_each_ms']:12.2f} {r['own_padding_factor']:8.2f} {r['batched_to_each']:13.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "benchmark": "cpu_prefix_split", "command": " ".join([sys.executable] + sys.argv),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpu": _cpu_model(),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "thresholds": {"MIN_SHARED_TOKENS": prefix_split.MIN_SHARED_TOKENS,
                           "MIN_SHARED_TO_OWN": prefix_split.MIN_SHARED_TO_OWN,
                           "MAX_OWN_PADDING": prefix_split.MAX_OWN_PADDING,
                           "MAX_OWN_PADDED_PAIRS": prefix_split.MAX_OWN_PADDED_PAIRS}, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
