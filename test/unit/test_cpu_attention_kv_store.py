"""The K/V store fused into the cpu_paged kernel call: `CpuPagedAttnBackend.forward` with the
store in the kernel must leave the pool bit-identical to `set_kv_buffer` + kernel and give the
same attention, on DECODE batches (ragged contexts, GQA ratios, float32/bfloat16, k/v as
strided views of a fused QKV output); the store must land in exactly the new tokens' slots
before attention reads them; and every case outside the fused one keeps `set_kv_buffer`."""

from __future__ import annotations

import pytest
import torch
from paged_pools import Pools, assert_close_rel

from hiserve.jit_kernel import cpu as cpu_kernels
from hiserve.layers.attention.base import RadixAttention
from hiserve.layers.attention.cpu_backend import CpuPagedAttnBackend
from hiserve.layers.attention.torch_native import TorchNativeAttnBackend
from hiserve.layers.forward_batch import ForwardMode
from hiserve.mem_cache.memory_pool import MHATokenToKVPool

pytestmark = pytest.mark.skipif(not cpu_kernels.can_use_cpu_kernels(), reason="CPU kernels cannot be built here")
EXTEND, DECODE = ForwardMode.EXTEND, ForwardMode.DECODE
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
D = 64


class CountingPool(MHATokenToKVPool):
    """A subclass (as a pool with its own store would be): the backend must call its store."""

    calls = 0

    def set_kv_buffer(self, layer_id, loc, cache_k, cache_v):
        type(self).calls += 1
        super().set_kv_buffer(layer_id, loc, cache_k, cache_v)


def make(dtype, group, page_size=1, hkv=3, pool_cls=MHATokenToKVPool):
    """A pool filled with random K/V, requests with ragged cached contexts, and a backend."""
    torch.manual_seed(group * 10 + page_size)
    pool = pool_cls(2048, page_size, dtype, hkv, D, 1, "cpu")
    pool.k_buffer[0].copy_(torch.randn_like(pool.k_buffer[0], dtype=torch.float32))
    pool.v_buffer[0].copy_(torch.randn_like(pool.v_buffer[0], dtype=torch.float32))
    pools = Pools(pool, max_reqs=8, max_context=1024)
    layer = RadixAttention(hkv * group, D, D ** -0.5, hkv, layer_id=0)
    backend = CpuPagedAttnBackend(pools)
    backend.extend_route = "sdpa"  # tests that want the other EXTEND routing set it
    backend.init_forward_metadata(pools.batch(EXTEND, {"a": 1, "b": 17, "c": 64, "d": 300}, backend))
    return pools, layer, backend


def fused_qkv(t, layer, dtype, qkv_dtype=None):
    """q, k, v as the Llama attention hands them in: views of one [T, (Hq + 2 Hkv) D] output."""
    hq, hkv = layer.num_heads, layer.num_kv_heads
    qkv = torch.randn(t, (hq + 2 * hkv) * D).to(qkv_dtype or dtype)
    q, k, v = qkv[:, : hq * D], qkv[:, hq * D: (hq + hkv) * D], qkv[:, (hq + hkv) * D:]
    assert k.stride(0) == qkv.shape[1] and not k.is_contiguous()
    return q, k, v


def run(backend, fused: bool, q, k, v, layer, fb):
    backend.fuse_kv_store = fused
    backend.init_forward_metadata(fb)
    return backend.forward(q, k, v, layer, fb)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("page_size", [1, 16])
def test_fused_store_equals_set_kv_buffer_then_kernel(monkeypatch, dtype, group, page_size):
    pools, layer, backend = make(dtype, group, page_size)
    pool, oracle = pools.token_to_kv_pool, TorchNativeAttnBackend()
    # DECODE batches, then EXTEND ones on the "kernel" routing (every request paged: a chunk
    # over a cached prefix and a fresh prompt), where the kernel stores too
    for mode, new_lens in ((DECODE, {"a": 1, "b": 1, "c": 1, "d": 1}), (DECODE, {"d": 1, "a": 1}),
                           (DECODE, {"b": 1, "c": 1, "a": 1, "d": 1}), (EXTEND, {"a": 7, "e": 40}),
                           (EXTEND, {"b": 2, "c": 19, "f": 3})):
        backend.extend_route = "kernel"
        fb = pools.batch(mode, new_lens, backend)
        q, k, v = fused_qkv(fb.out_cache_loc.numel(), layer, dtype)
        before = pool.k_buffer[0].clone(), pool.v_buffer[0].clone()
        want = run(backend, False, q, k, v, layer, fb)
        want_pool = pool.k_buffer[0].clone(), pool.v_buffer[0].clone()
        pool.k_buffer[0].copy_(before[0])
        pool.v_buffer[0].copy_(before[1])
        with monkeypatch.context() as m:  # the fused path must not call the Python store
            m.setattr(pool, "set_kv_buffer", lambda *a: pytest.fail("set_kv_buffer called on the fused path"))
            got = run(backend, True, q, k, v, layer, fb)
        assert torch.equal(pool.k_buffer[0], want_pool[0]) and torch.equal(pool.v_buffer[0], want_pool[1])
        assert_close_rel(got, want, TOL[dtype])
        oracle.init_forward_metadata(fb)
        assert_close_rel(got, oracle.forward(q, k, v, layer, fb, save_kv_cache=False), TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("tokens", [5, 300])
def test_kernel_store_writes_only_the_new_slots_before_attention(dtype, threads, tokens):
    """A request per new token, its last context slot being that token's out_cache_loc, which
    holds stale values (large, so attending to them instead shows). 300 tokens x 2 heads x
    (64 + 64) is above kGrainSize: the parallel store on 2 threads."""
    gen = torch.Generator().manual_seed(tokens)
    hkv, hq, ctx, slots = 2, 6, 9, 4096
    k_buf = torch.randn(slots, hkv, D, generator=gen).to(dtype)
    v_buf = torch.randn(slots, hkv, D, generator=gen).to(dtype)
    perm = torch.randperm(slots, generator=gen)[: tokens * ctx].view(tokens, ctx)
    r2t, loc = perm.to(torch.int32), perm[:, -1].clone()
    k_buf[loc], v_buf[loc] = 50.0, 50.0  # stale rows
    q, k, v = fused_qkv(tokens, RadixAttention(hq, D, 0.125, hkv, layer_id=0), dtype)
    idx, lens = torch.arange(tokens), torch.full((tokens,), ctx)
    starts = torch.arange(tokens + 1)
    want_k, want_v = k_buf.clone(), v_buf.clone()
    want_k[loc], want_v[loc] = k.view(tokens, hkv, D), v.view(tokens, hkv, D)
    want = cpu_kernels.paged_attention(q, want_k, want_v, r2t, idx, lens, starts, hq, 0.125)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_kernels.paged_attention(q, k_buf, v_buf, r2t, idx, lens, starts, hq, 0.125, k, v, loc)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(k_buf, want_k) and torch.equal(v_buf, want_v)  # new rows at loc, others untouched
    assert_close_rel(got, want, TOL[dtype])


def test_kernel_store_rejects_bad_slots_and_shapes_before_writing():
    k_buf = torch.zeros(8, 2, D)
    r2t = torch.zeros(1, 8, dtype=torch.int32)
    one, starts = torch.ones(1, dtype=torch.int64), torch.tensor([0, 1])
    q, k = torch.zeros(1, 2 * D), torch.ones(1, 2 * D)
    with pytest.raises(Exception, match="out of the pool"):
        cpu_kernels.paged_attention(q, k_buf, k_buf, r2t, one - 1, one, starts, 2, 1.0, k, k, torch.tensor([8]))
    assert not k_buf.any()
    with pytest.raises(ValueError, match="pool dtype"):
        cpu_kernels.paged_attention(q, k_buf, k_buf, r2t, one - 1, one, starts, 2, 1.0, k.double(), k, one)
    with pytest.raises(ValueError, match="Hkv"):
        cpu_kernels.paged_attention(q, k_buf, k_buf, r2t, one - 1, one, starts, 2, 1.0, k[:, :D], k, one)
    with pytest.raises(ValueError, match="go together"):
        cpu_kernels.paged_attention(q, k_buf, k_buf, r2t, one - 1, one, starts, 2, 1.0, k, None, one)


@pytest.mark.parametrize("case", ["subclass", "dtype", "extend_mixed", "no_save"])
def test_other_cases_keep_the_python_store(case):
    """A pool subclass, k/v not in the pool dtype, a mixed EXTEND batch: set_kv_buffer runs
    (once); with save_kv_cache=False nothing is stored at all."""
    CountingPool.calls = 0
    pools, layer, backend = make(torch.bfloat16, 3, pool_cls=CountingPool)
    pool = pools.token_to_kv_pool
    if case != "subclass":
        pool.__class__ = MHATokenToKVPool  # same object, the exact type again
        pool.set_kv_buffer = lambda *a: (setattr(CountingPool, "calls", CountingPool.calls + 1),
                                         MHATokenToKVPool.set_kv_buffer(pool, *a))
    mode, lens = (EXTEND, {"a": 2, "e": 7}) if case == "extend_mixed" else (DECODE, {"a": 1, "b": 1})
    fb = pools.batch(mode, lens, backend)
    q, k, v = fused_qkv(fb.out_cache_loc.numel(), layer, torch.bfloat16,
                        torch.float32 if case == "dtype" else None)
    before = pool.k_buffer[0].clone()
    backend.init_forward_metadata(fb)
    backend.forward(q, k, v, layer, fb, save_kv_cache=case != "no_save")
    assert CountingPool.calls == (0 if case == "no_save" else 1)
    assert torch.equal(pool.k_buffer[0], before) == (case == "no_save")
