"""EXTEND (several new tokens per request) through the paged CPU kernel against a float64
reference, at every ISA tier this CPU runs: on avx512_bf16 a bf16 pool takes the dpbf16 tiles
(csrc/cpu/extend_avx512bf16.h), other tiers and float32 the portable loops. Cases sit at the
tiles' edges (64-key tiles, 4-row blocks, 16-query blocks), cover fresh prompts (no prefix) and
chunks over a cached prefix, GQA ratios 1/3/8/40 (40: more query rows per item than the decode
path's groups), head dims with and without the tile layout, one and two threads, and a lone long
request whose keys two threads split and merge. Also the backend's EXTEND routing
(`extend_routing`) and its override."""

from __future__ import annotations

import pytest
import torch
from paged_pools import assert_close_per_row, extend_inputs, extend_reference

from hiserve.jit_kernel import cpu as cpu_kernels
from hiserve.layers.attention import cpu_backend

pytestmark = pytest.mark.skipif(not cpu_kernels.can_use_cpu_kernels(), reason="CPU kernels cannot be built here")
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
# (prefix, new tokens): fresh prompts and chunks over a prefix, at the 64-key tile and the
# 16-query block edges; row counts (new x group) leave every remainder of the 4-row block.
REQUESTS = [(0, 2), (0, 17), (1, 5), (63, 3), (64, 16), (65, 50), (0, 130), (300, 7), (1000, 33)]


@pytest.mark.parametrize("isa", cpu_kernels.runnable_isas())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group, head_dim", [(1, 64), (3, 64), (8, 64), (3, 32), (2, 128), (1, 256), (3, 80),
                                             (40, 64)])
def test_extend_kernel_every_isa_tier(isa, dtype, group, head_dim):
    """Head dim 80 is not a multiple of 32: the portable loops even on avx512_bf16. This batch
    has enough work items for two threads, so its keys are not split (the next test splits)."""
    mod = cpu_kernels.load_cpu_module(isa)
    requests = REQUESTS if group < 40 else REQUESTS[:4]  # 80 query heads: a shorter batch
    q, k, v, r2t, idx, lens, starts, hq = extend_inputs(dtype, group=group, head_dim=head_dim, requests=requests,
                                                        seed=group * 1000 + head_dim)
    scale = head_dim ** -0.5
    want = extend_reference(q, k, v, r2t, lens, starts, hq, scale)
    for threads in (1, 2):
        out = torch.empty_like(q)
        mod.paged_attention(q, k, v, out, r2t, idx, lens, starts, starts, starts, starts, False, hq,
                            k.shape[1], scale, threads)
        assert_close_per_row(out, want, TOL[dtype])


@pytest.mark.parametrize("isa", cpu_kernels.runnable_isas())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_lone_long_request_splits(isa, dtype):
    """One request on one KV head, 40 queries over 3000 keys, two threads: 3 work items for 8
    wanted, so each item's keys are split (>= 256 keys a split) and the partial states merged."""
    q, k, v, r2t, idx, lens, starts, hq = extend_inputs(dtype, group=3, head_dim=64, requests=[(3000, 40)], hkv=1)
    want = extend_reference(q, k, v, r2t, lens, starts, hq, 0.125)
    out = torch.empty_like(q)
    cpu_kernels.load_cpu_module(isa).paged_attention(q, k, v, out, r2t, idx, lens, starts, starts, starts, starts,
                                                     False, hq, 1, 0.125, 2)
    assert_close_per_row(out, want, TOL[dtype])


def test_extend_tile_outliers_stay_finite():
    """Large score spreads (a row's max changes tile to tile, masked lanes at -inf): the online
    softmax must not produce NaN/inf and must match the reference."""
    q, k, v, r2t, idx, lens, starts, hq = extend_inputs(torch.bfloat16, group=3, head_dim=64,
                                                        requests=[(200, 20), (0, 70)], seed=7)
    k[::37] *= 40  # a few keys with huge scores, scattered across tiles
    want = extend_reference(q, k, v, r2t, lens, starts, hq, 0.125)
    got = cpu_kernels.paged_attention(q, k, v, r2t, idx, lens, starts, hq, 0.125)
    assert torch.isfinite(got.float()).all()
    assert_close_per_row(got, want, TOL[torch.bfloat16])


def test_extend_routing_choice_and_override(monkeypatch):
    monkeypatch.delenv("HISERVE_CPU_EXTEND_ATTENTION", raising=False)
    assert cpu_backend.extend_routing(torch.float32, 64)[0] == "sdpa"  # the tiles read bf16
    assert cpu_backend.extend_routing(torch.bfloat16, 80)[0] == "sdpa"
    route, why = cpu_backend.extend_routing(torch.bfloat16, 64)
    cpu = cpu_backend.detect_cpu()
    amx = cpu_backend.cpu_kernels.amx_gemm_available()
    if "amx_bf16" in cpu.features:
        assert route == ("amx" if amx else "sdpa"), why
    else:
        assert route == ("kernel" if cpu.isa == "avx512_bf16" else "sdpa"), why
    for choice in ("kernel", "sdpa"):
        monkeypatch.setenv("HISERVE_CPU_EXTEND_ATTENTION", choice)
        assert cpu_backend.extend_routing(torch.float32, 64)[0] == choice
    monkeypatch.setenv("HISERVE_CPU_EXTEND_ATTENTION", "amx")
    with pytest.raises(ValueError, match="bfloat16 pool and the AMX kernels"):
        cpu_backend.extend_routing(torch.float32, 64)
    if amx:
        assert cpu_backend.extend_routing(torch.bfloat16, 64)[0] == "amx"
    else:
        with pytest.raises(ValueError, match="AMX kernels"):
            cpu_backend.extend_routing(torch.bfloat16, 64)
    monkeypatch.setenv("HISERVE_CPU_EXTEND_ATTENTION", "fast")
    with pytest.raises(ValueError, match="HISERVE_CPU_EXTEND_ATTENTION"):
        cpu_backend.extend_routing(torch.bfloat16, 64)
    with pytest.raises(ValueError, match="HISERVE_CPU_EXTEND_ATTENTION"):
        cpu_backend.CpuPagedAttnBackend()  # at start, not at the first EXTEND batch
