"""The AMX prefill attention kernel (`cpu_amx.amx_flash_attention`, csrc/cpu/amx_attention.h)
against a float32 reference on the same bf16 inputs, on an AMX CPU (skipped elsewhere: the kernel
is AMX instructions only).

Covered: causal (bottom-right aligned) and not; GQA ratios 1, 3, 8; head dims 32, 64 (its own
path, output kept in tiles), 128, 256; query and key counts at the tile edges (1, 15-17, 31-33,
several blocks); keys read through slots in any order; varlen batches (sequences of different
lengths, an empty one); the log-sum-exp; a strided output view; scores whose row maximum jumps
between key blocks by far more than the lazy-rescaling threshold (and masked lanes at -inf); bad
arguments (ValueError from Python, RuntimeError from the C++ checks). The serving paths that call
it (fresh prompts, chunks over a cached prefix, shared-prefix groups) are compared with
torch_native in test_cpu_attention.py and test_cpu_prefix_split.py.
"""

from __future__ import annotations

import pytest
import torch

from hiserve.jit_kernel.cpu_amx import amx_flash_attention


def _reference(q, k, v, scale, causal, cu_q=None, cu_k=None):
    """float32 softmax(q k^T * scale [+ mask]) v per sequence: (out [Tq, Hq, D], lse [Hq, Tq])."""
    tq, hq, d = q.shape
    g = hq // k.shape[1]
    cu_q = [0, tq] if cu_q is None else cu_q.tolist()
    cu_k = [0, k.shape[0]] if cu_k is None else cu_k.tolist()
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        qs, ks, vs = (x.float().transpose(0, 1) for x in (q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]],
                                                            v[cu_k[b]:cu_k[b + 1]]))
        n, s = qs.shape[1], ks.shape[1]
        sc = qs @ ks.repeat_interleave(g, 0).transpose(1, 2) * scale
        if causal:
            sc = sc.masked_fill(torch.arange(s)[None, :] > torch.arange(n)[:, None] + (s - n), float("-inf"))
        lses.append(torch.logsumexp(sc, -1))
        outs.append((sc.softmax(-1) @ vs.repeat_interleave(g, 0)).transpose(0, 1))
    return torch.cat(outs), torch.cat(lses, 1)


def _check(got, lse, want, want_lse, v):
    # P is rounded to bf16 (as FlashAttention-2/3 do), then the output once
    torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=0.006 * float(v.abs().max()))
    if lse is not None:
        torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-4)


def _qkv(n, s, hq, hkv, d, seed, rows=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, hq, d, generator=g).bfloat16()
    k = torch.randn(rows or s, hkv, d, generator=g).bfloat16()
    v = torch.randn(rows or s, hkv, d, generator=g).bfloat16()
    return q, k, v


@pytest.mark.parametrize("d", [32, 64, 128, 256])
@pytest.mark.parametrize("hq, hkv", [(2, 2), (9, 3), (8, 1)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n, s", [(1, 1), (1, 33), (15, 15), (16, 17), (17, 47), (31, 31), (33, 64), (100, 300)])
def test_matches_reference(amx, d, hq, hkv, causal, n, s):
    q, k, v = _qkv(n, s, hq, hkv, d, seed=n * 1000 + s + d)
    got, lse = amx_flash_attention(q, k, v, d ** -0.5, causal, with_lse=True)
    _check(got, lse, *_reference(q, k, v, d ** -0.5, causal), v)


@pytest.mark.parametrize("d", [64, 128])
def test_long_causal_prompt(amx, d):
    q, k, v = _qkv(700, 700, 6, 2, d, seed=3)
    got, _ = amx_flash_attention(q, k, v, 0.1, True)
    _check(got, None, *_reference(q, k, v, 0.1, True), v)


@pytest.mark.parametrize("d", [64, 128])
def test_slots_read_in_place(amx, d):
    """Keys at pool rows in any order (a request's slots) equal the gathered keys."""
    q, k, v = _qkv(40, 0, 6, 3, d, seed=5, rows=900)
    slots = torch.randperm(900, generator=torch.Generator().manual_seed(1))[:250]
    for causal in (True, False):
        got, lse = amx_flash_attention(q, k, v, 0.125, causal, slots=slots, with_lse=True)
        _check(got, lse, *_reference(q, k[slots], v[slots], 0.125, causal), v)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_batch(amx, d, causal):
    """Sequences of 1, 0, 56, 17 queries over 60, 5, 56, 300 keys (slots), one call."""
    ns, ss = [1, 0, 56, 17], [60, 5, 56, 300]
    q, k, v = _qkv(sum(ns), 0, 9, 3, d, seed=11, rows=1000)
    slots = torch.randperm(1000, generator=torch.Generator().manual_seed(2))[:sum(ss)].contiguous()
    cu_q = torch.tensor([0, 1, 1, 57, 74])
    cu_k = torch.tensor([0, 60, 65, 121, 421])
    got, lse = amx_flash_attention(q, k, v, 0.125, causal, slots=slots, cu_q=cu_q, cu_k=cu_k, with_lse=True)
    _check(got, lse, *_reference(q, k[slots], v[slots], 0.125, causal, cu_q, cu_k), v)


def test_strided_out_and_q_views(amx):
    """q and out as views of wider rows (the model's fused qkv, the layer's output)."""
    qkv = torch.randn(50, 15 * 64).bfloat16()
    q, k, v = qkv[:, :9 * 64].view(50, 9, 64), qkv[:, 9 * 64:12 * 64].view(50, 3, 64), qkv[:, 12 * 64:].view(50, 3, 64)
    buf = torch.full((50, 2, 9, 64), float("nan")).bfloat16()
    amx_flash_attention(q, k, v, 0.125, True, out=buf[:, 1])
    _check(buf[:, 1], None, *_reference(q, k, v, 0.125, True), v)
    assert torch.isnan(buf[:, 0].float()).all()  # nothing outside the view written


def test_score_jumps_rescale(amx):
    """A few keys with huge scores late in the context (a row's max jumps by far more than the
    lazy threshold), and masked lanes at -inf: finite and equal to the reference."""
    q, k, v = _qkv(64, 400, 4, 2, 64, seed=9)
    k[130::97] *= 30
    k[333] *= 60
    for causal in (True, False):
        got, lse = amx_flash_attention(q, k, v, 0.125, causal, with_lse=True)
        assert torch.isfinite(got.float()).all()
        _check(got, lse, *_reference(q, k, v, 0.125, causal), v)


def test_rejects_bad_arguments(amx):
    q, k, v = _qkv(8, 8, 4, 2, 64, seed=1)
    with pytest.raises(ValueError, match="bfloat16"):
        amx_flash_attention(q.float(), k, v, 0.1, True)
    with pytest.raises(ValueError, match="multiple of 32|shapes"):
        amx_flash_attention(*(x[..., :48].contiguous() for x in (q, k, v)), 0.1, True)
    with pytest.raises(ValueError, match="at least as many keys"):
        amx_flash_attention(q, k[:4], v[:4], 0.1, True)
    with pytest.raises(ValueError, match="both cu_q and cu_k"):
        amx_flash_attention(q, k, v, 0.1, True, cu_q=torch.tensor([0, 8]))
    with pytest.raises(RuntimeError, match="slot is out of range"):
        amx_flash_attention(q, k, v, 0.1, False, slots=torch.tensor([0, 8]))
    with pytest.raises(RuntimeError, match="cu_q must run"):
        amx_flash_attention(q, k, v, 0.1, False, cu_q=torch.tensor([0, 7]), cu_k=torch.tensor([0, 8]))
    with pytest.raises(RuntimeError, match="S >= n"):
        amx_flash_attention(q, k, v, 0.1, True, cu_q=torch.tensor([0, 6, 8]), cu_k=torch.tensor([0, 4, 8]))
