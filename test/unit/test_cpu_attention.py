"""The cpu_paged attention backend (C++ paged kernel over the pool) against the torch_native
oracle, on real pools with shuffled pages: page sizes 1/16/64, GQA ratios 1/3/8, ragged
batches, prefill, chunked prefill after a cached prefix (paged kernel, and gather + SDPA for
long chunks), mixed EXTEND batches, decode, and
contexts from 1 to 4096 tokens (the latter exercise the flash-decoding split), in float32
and bfloat16. Skipped (not failed) only where the kernels cannot be built, which the
backend then reports with one warning and covers with torch_native."""

from __future__ import annotations

import pytest
import torch
from paged_pools import Pools, assert_close_per_row, assert_close_rel, decode_inputs, extend_reference

from hiserve.jit_kernel import cpu as cpu_kernels
from hiserve.layers.attention.base import RadixAttention
from hiserve.layers.attention import cpu_backend
from hiserve.layers.attention.cpu_backend import CpuPagedAttnBackend
from hiserve.layers.attention.torch_native import TorchNativeAttnBackend
from hiserve.layers.forward_batch import ForwardMode
from hiserve.mem_cache.memory_pool import MHATokenToKVPool

pytestmark = pytest.mark.skipif(not cpu_kernels.can_use_cpu_kernels(), reason="CPU kernels cannot be built here")
EXTEND, DECODE = ForwardMode.EXTEND, ForwardMode.DECODE
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


class Case:
    """One pool, one layer, both backends; `step` runs both on the same batch and compares."""

    def __init__(self, *, page_size, group, dtype, hkv=2, head_dim=64, pool_tokens=4096, max_context=4608,
                 route="sdpa"):
        torch.manual_seed(page_size * 100 + group)
        self.dtype, self.hkv, self.hq, self.d = dtype, hkv, hkv * group, head_dim
        kv = MHATokenToKVPool(pool_tokens, page_size, dtype, hkv, head_dim, 1, "cpu")
        self.pools = Pools(kv, max_reqs=8, max_context=max_context)
        self.backend, self.oracle = CpuPagedAttnBackend(self.pools), TorchNativeAttnBackend()
        self.backend.extend_route = route  # EXTEND routing under test (the server decides it per CPU)
        self.layer = RadixAttention(self.hq, head_dim, head_dim ** -0.5, hkv, layer_id=0)

    def step(self, mode: ForwardMode, new_lens: dict[str, int]) -> None:
        fb = self.pools.batch(mode, new_lens, self.backend)
        t = fb.out_cache_loc.numel()
        q = torch.randn(t, self.hq * self.d).to(self.dtype)
        k = torch.randn(t, self.hkv * self.d).to(self.dtype)
        v = torch.randn(t, self.hkv * self.d).to(self.dtype)
        self.backend.init_forward_metadata(fb)
        assert self.backend._meta is not None, "the kernel path must run, not the fallback"
        got = self.backend.forward(q, k, v, self.layer, fb)
        self.oracle.init_forward_metadata(fb)
        want = self.oracle.forward(q, k, v, self.layer, fb, save_kv_cache=False)
        assert_close_rel(got, want, TOL[self.dtype])


def _long_chunk_contexts(meta) -> list[int]:
    """Context lengths of the long chunks over a cached prefix (split and merged, or gathered
    where this torch lacks the flash op), sorted."""
    split = [g.shared_slots.numel() + m.own_slots.numel() for g in meta.groups for m in g.members]
    return sorted(split + [len(m[2]) for m in meta.gathered])


@pytest.mark.parametrize("route", ["sdpa", "kernel", "amx"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_prefill_chunked_prefill_and_decode_match_torch_native(page_size, group, dtype, route):
    """Every EXTEND routing (`extend_routing`), whichever this CPU picks by itself ("amx" only on
    an AMX CPU; a float32 pool there runs the sdpa paths on the amx routing's plan)."""
    if route == "amx" and not cpu_kernels.amx_gemm_available():
        pytest.skip("no AMX kernels here")
    c = Case(page_size=page_size, group=group, dtype=dtype, route=route)
    c.step(EXTEND, {"a": 1, "b": 37, "c": 130})  # fresh prompts (sdpa: SDPA on the new k/v)
    # sdpa: up to PAGED_EXTEND_MAX_NEW_TOKENS new tokens over a cached prefix through the paged
    # kernel (a: 3, c: 1), more through gather + SDPA (b: 21), mixed with a fresh prompt (d);
    # kernel: all four through the paged kernel
    c.step(EXTEND, {"b": 21, "d": 5, "c": 1, "a": 3})
    meta = c.backend._meta
    if route != "kernel":
        assert _long_chunk_contexts(meta) == [37 + 21] and len(meta.fresh) == 1
    else:
        assert not _long_chunk_contexts(meta) and not meta.fresh and meta.paged.q_rows is None
    for _ in range(3):
        c.step(DECODE, {"a": 1, "b": 1, "c": 1, "d": 1})
    c.step(DECODE, {"e": 1, "a": 1})  # a context of 1 beside a longer one


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size, mode", [(1, "gather"), (64, "paged_limit"), (16, "kernel")])
def test_long_contexts_split_and_merge(monkeypatch, page_size, mode, dtype):
    """Contexts 4096 / 1000 / 300: the decode kernel splits them over threads and merges.
    The 1095-token chunk over a 3000-token prefix goes through gather + SDPA on the "sdpa"
    routing (above PAGED_EXTEND_MAX_NEW_TOKENS), and through the paged kernel when that limit is
    lifted or on the "kernel" routing."""
    if mode == "paged_limit":
        monkeypatch.setattr(cpu_backend, "PAGED_EXTEND_MAX_NEW_TOKENS", 1 << 20)
    c = Case(page_size=page_size, group=3, dtype=dtype, pool_tokens=5632,
             route="kernel" if mode == "kernel" else "sdpa")
    c.step(EXTEND, {"long": 3000, "mid": 999, "short": 299})
    c.step(EXTEND, {"long": 1095, "mid": 1, "new": 40})  # long chunk, short chunk, fresh prompt
    assert (len(_long_chunk_contexts(c.backend._meta)) == 1) == (mode == "gather")
    c.step(DECODE, {"long": 1, "mid": 1, "short": 1, "new": 1})
    assert c.pools.lens["long"] == 4096
    c.step(DECODE, {"long": 1, "mid": 1, "short": 1})


def test_plan_splits_a_single_long_decode():
    """One request, one KV head, 4096 keys: more than one split, each >= 256 keys (the merge
    is then exercised), which the long-context test checks numerically."""
    c = Case(page_size=16, group=8, dtype=torch.float32, hkv=1, pool_tokens=4352)
    c.step(EXTEND, {"x": 4095})
    c.step(DECODE, {"x": 1})


def test_fallback_when_kernels_are_off(monkeypatch, caplog):
    """No kernels: every pass is torch_native's, with the same results."""
    monkeypatch.setattr(cpu_kernels, "can_use_cpu_kernels", lambda: False)
    c = Case(page_size=16, group=3, dtype=torch.float32)
    fb = c.pools.batch(EXTEND, {"a": 5}, c.backend)
    c.backend.init_forward_metadata(fb)
    assert c.backend._meta is None
    q, k, v = torch.randn(5, c.hq * 64), torch.randn(5, c.hkv * 64), torch.randn(5, c.hkv * 64)
    got = c.backend.forward(q, k, v, c.layer, fb)
    c.oracle.init_forward_metadata(fb)
    assert torch.equal(got, c.oracle.forward(q, k, v, c.layer, fb, save_kv_cache=False))


def test_kernel_rejects_bad_arguments():
    k = torch.zeros(8, 2, 64)
    r2t = torch.zeros(2, 8, dtype=torch.int32)
    one = torch.ones(1, dtype=torch.int64)
    starts = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_kernels.paged_attention(torch.zeros(1, 128, dtype=torch.float16), k, k, r2t, one, one, starts, 2, 1.0)
    with pytest.raises(ValueError, match="int32"):
        cpu_kernels.paged_attention(torch.zeros(1, 128), k, k, r2t.long(), one, one, starts, 2, 1.0)
    with pytest.raises(ValueError, match="num_q_heads"):
        cpu_kernels.paged_attention(torch.zeros(1, 128), k, k, r2t, one, one, starts, 3, 1.0)


def test_kernel_rejects_inconsistent_lengths():
    """Checked in C++ before any memory is read: a seq_len past req_to_token's width, fewer
    context tokens than new ones, a request row out of range, q_starts past q."""
    k = torch.zeros(8, 2, 64)
    r2t = torch.zeros(2, 8, dtype=torch.int32)
    q = torch.zeros(1, 128)
    row, starts = torch.zeros(1, dtype=torch.int64), torch.tensor([0, 1])
    for idx, lens, st in ((row, torch.tensor([9]), starts), (row, torch.tensor([0]), starts),
                          (torch.tensor([2]), torch.tensor([1]), starts), (row, torch.tensor([2]), torch.tensor([0, 2]))):
        with pytest.raises(Exception, match="new tokens|out of range|past q"):
            cpu_kernels.paged_attention(q, k, k, r2t, idx, lens, st, 2, 1.0)


# Key counts at the kernels' edges: one key, an 8-key (AVX2) and a 16-key (AVX-512) block +-1,
# a 64-key tile +-1, several tiles.
EDGE_CONTEXTS = [1, 7, 9, 15, 16, 17, 63, 64, 65, 300]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("head_dim", [16, 48, 64, 80, 128, 256])
def test_decode_kernel_head_dims_groups_and_tile_edges(dtype, group, head_dim):
    """This CPU's DECODE item (AVX-512 or AVX2) against a float64 reference: every group size
    it is instantiated for, head dims with a half unit of 32 (16, 48, 80: masked loads on
    AVX-512, a last 8-wide chunk on AVX2) and without, and contexts at the 8/16-key block and
    64-key tile edges."""
    q, k, v, r2t, idx, lens, starts, hq = decode_inputs(dtype, group=group, head_dim=head_dim,
                                                        contexts=EDGE_CONTEXTS)
    scale = head_dim ** -0.5
    got = cpu_kernels.paged_attention(q, k, v, r2t, idx, lens, starts, hq, scale)
    assert_close_per_row(got, extend_reference(q, k, v, r2t, lens, starts, hq, scale), TOL[dtype])


@pytest.mark.parametrize("isa", cpu_kernels.runnable_isas())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_every_isa_tier(isa, dtype):
    """Every tier this CPU runs has its own DECODE code: avx512_bf16 scores bf16 keys with
    _mm512_dpbf16_ps, avx512 with fp32 FMAs, avx2 with its 8-wide item (decode_avx2.h),
    baseline the portable loop. Each is built (cached after the first run) and checked
    against the float64 reference, per
    request, on one and two threads (two threads and a lone 4096-key request: the
    flash-decoding split and its merge)."""
    mod = cpu_kernels.load_cpu_module(isa)
    # The last case is one request on one KV head: too few work items for two threads, so its
    # 4096 keys are split and merged (with five requests on two heads they are not).
    for group, head_dim, contexts, hkv in ((3, 64, [1, 17, 65, 300, 4096], 2), (8, 80, [1, 17, 65, 300, 4096], 2),
                                           (3, 64, [4096], 1)):
        q, k, v, r2t, idx, lens, starts, hq = decode_inputs(dtype, group=group, head_dim=head_dim,
                                                            contexts=contexts, hkv=hkv, seed=group)
        scale = head_dim ** -0.5
        want = extend_reference(q, k, v, r2t, lens, starts, hq, scale)
        for threads in (1, 2):
            out = torch.empty_like(q)
            # starts x3, False: no K/V store (test_cpu_attention_kv_store.py covers it)
            mod.paged_attention(q, k, v, out, r2t, idx, lens, starts, starts, starts, starts, False, hq,
                                k.shape[1], scale, threads)
            assert_close_per_row(out, want, TOL[dtype])
