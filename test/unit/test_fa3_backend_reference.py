"""The fa3 backend's own work on CPU: page tables, per-batch and CUDA-graph metadata, the K/V
writes, the pool seen as pages and the MLA views, with FA3's kernel replaced by its torch
reference (`fa3_reference`), against torch_native on the same pools (bf16).

test/jit/test_fa3_backend.py runs the same cases with the real FA3 on a Hopper GPU.
"""

from __future__ import annotations

import pytest
import torch
from paged_pools import Pools, assert_close_rel

from hiserve.layers.attention.base import RadixAttention
from hiserve.layers.attention.fa3_reference import flash_attn_with_kvcache_reference
from hiserve.layers.attention.flashattention_backend import FlashAttentionBackend, can_use_fa3
from hiserve.layers.attention.mla import MLAAttention
from hiserve.layers.attention.torch_native import TorchNativeAttnBackend
from hiserve.layers.forward_batch import ForwardMode
from hiserve.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

DTYPE = torch.bfloat16
EXTEND_NO_PREFIX = {"a": 37, "b": 1, "c": 130, "d": 16}
EXTEND_ON_PREFIX = {"a": 20, "b": 64, "c": 3, "d": 16, "e": 9}  # prefixes 37, 1, 130, 16 and 0


def backend(pools: Pools) -> FlashAttentionBackend:
    return FlashAttentionBackend(pools, kernel=flash_attn_with_kvcache_reference)


def mha_pools(hkv: int, d: int, page_size: int) -> Pools:
    return Pools(MHATokenToKVPool(2048, page_size, DTYPE, hkv, d, 2, "cpu"))


def test_page_table_lists_each_requests_pages_in_order():
    pools = mha_pools(2, 64, 4)
    fa3 = backend(pools)
    fb = pools.batch(ForwardMode.EXTEND, {"a": 9, "b": 4, "c": 1}, fa3)
    table = fa3._page_table(fb.req_pool_indices, 3)
    assert table.dtype == torch.int32 and table.shape == (3, 3)
    for i, name in enumerate("abc"):
        n = len(pools.pages[name])
        assert table[i, :n].tolist() == pools.pages[name]
    fa3.init_forward_metadata(fb)
    assert fa3._meta.cu_seqlens_q.tolist() == [0, 9, 13, 14] and fa3._meta.max_seqlen_q == 9
    assert fa3._meta.cache_seqlens.dtype == torch.int32 and fa3._meta.cache_seqlens.tolist() == [9, 4, 1]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("hq, hkv, d", [(32, 8, 128), (4, 2, 64), (6, 6, 32)])
def test_mha_extend_and_decode_match_torch_native(hq, hkv, d, page_size):
    torch.manual_seed(0)
    pools = mha_pools(hkv, d, page_size)
    fa3, ref = backend(pools), TorchNativeAttnBackend()
    layer = RadixAttention(hq, d, d**-0.5, hkv, layer_id=1)

    def step(mode: ForwardMode, new_lens: dict[str, int]) -> None:
        fb = pools.batch(mode, new_lens, fa3)
        t = fb.num_tokens
        q, k, v = torch.randn(t, hq * d).to(DTYPE), torch.randn(t, hkv * d).to(DTYPE), torch.randn(t, hkv * d).to(DTYPE)
        fa3.init_forward_metadata(fb)
        out = fa3.forward(q, k, v, layer, fb)  # writes the new K/V
        assert torch.equal(pools.token_to_kv_pool.v_buffer[1][fb.out_cache_loc], v.view(t, hkv, d))
        ref.init_forward_metadata(fb)
        assert_close_rel(out, ref.forward(q, k, v, layer, fb, save_kv_cache=False))

    step(ForwardMode.EXTEND, EXTEND_NO_PREFIX)
    step(ForwardMode.EXTEND, EXTEND_ON_PREFIX)
    for _ in range(3):  # ragged decode, some crossing a page boundary
        step(ForwardMode.DECODE, {n: 1 for n in "abcde"})
    step(ForwardMode.DECODE, {"c": 1})


@pytest.mark.parametrize("page_size", [1, 16])
def test_cuda_graph_metadata_replays_match_torch_native(page_size):
    """The static page table / seq lens, refilled per replay (rows reused, padding rows), give
    the same attention as fresh per-batch metadata. (No graph on CPU: the static views are
    what a captured graph would read.)"""
    torch.manual_seed(1)
    hq, hkv, d, max_bs, graph_bs = 8, 2, 64, 8, 4
    pools = mha_pools(hkv, d, page_size)
    fa3, ref = backend(pools), TorchNativeAttnBackend()
    layer = RadixAttention(hq, d, d**-0.5, hkv, layer_id=0)
    names = list("abcdef")
    fb = pools.batch(ForwardMode.EXTEND, dict(zip(names, [3, 1, 17, 5, 40, 2])), fa3)
    t = fb.num_tokens
    fa3.init_forward_metadata(fb)
    fa3.forward(torch.randn(t, hq * d).to(DTYPE), torch.randn(t, hkv * d).to(DTYPE),
                torch.randn(t, hkv * d).to(DTYPE), layer, fb)

    pad_row, fill = pools.req_to_token_pool.padding_row, fa3.get_cuda_graph_seq_len_fill_value()
    rows = torch.full((max_bs,), pad_row, dtype=torch.int64)
    lens = torch.full((max_bs,), fill, dtype=torch.int64)
    fa3.init_cuda_graph_state(max_bs)
    fa3.init_forward_metadata_capture_cuda_graph(graph_bs, rows[:graph_bs], lens[:graph_bs])
    static_meta = fa3._meta
    assert static_meta.page_table.shape == (graph_bs, fa3.max_pages_per_req)

    for step_names in [names[:4], names[:3], names[2:6], ["e"], names[1:5]]:
        fb = pools.batch(ForwardMode.DECODE, {n: 1 for n in step_names}, fa3)
        bs = fb.batch_size
        rows[:bs], lens[:bs] = fb.req_pool_indices, fb.seq_lens
        rows[bs:graph_bs], lens[bs:graph_bs] = pad_row, fill
        fa3.init_forward_metadata_replay_cuda_graph(graph_bs, rows[:graph_bs], lens[:graph_bs],
                                                    fb.seq_lens_cpu + [fill] * (graph_bs - bs))
        assert fa3._meta is static_meta  # a replay refills the buffers, never swaps them
        q = torch.zeros(graph_bs, hq * d, dtype=DTYPE)
        k, v = torch.zeros(graph_bs, hkv * d, dtype=DTYPE), torch.zeros(graph_bs, hkv * d, dtype=DTYPE)
        q[:bs], k[:bs], v[:bs] = (torch.randn(bs, n * d).to(DTYPE) for n in (hq, hkv, hkv))
        loc = torch.zeros(graph_bs, dtype=torch.int64)  # padding rows write slot 0
        loc[:bs] = fb.out_cache_loc
        padded = fb.__class__(**{**fb.__dict__, "batch_size": graph_bs, "out_cache_loc": loc})
        out = fa3.forward(q, k, v, layer, padded)
        ref.init_forward_metadata(fb)
        assert_close_rel(out[:bs], ref.forward(q[:bs], k[:bs], v[:bs], layer, fb, save_kv_cache=False))
        assert torch.isfinite(out[bs:].float()).all()


@pytest.mark.parametrize("page_size", [1, 16])
def test_mla_extend_and_decode_match_torch_native(page_size):
    torch.manual_seed(0)
    rank, rope, nope, v_dim, heads = 64, 16, 32, 32, 4
    pools = Pools(MLATokenToKVPool(1024, page_size, DTYPE, rank, rope, 2, "cpu"))
    fa3, ref = backend(pools), TorchNativeAttnBackend()
    kv_b = torch.nn.Linear(rank, heads * (nope + v_dim), bias=False, dtype=DTYPE)
    layer = MLAAttention(heads, nope, rope, v_dim, rank, (nope + rope) ** -0.5, layer_id=1, kv_b_proj=kv_b)

    def step(mode: ForwardMode, new_lens: dict[str, int]) -> None:
        fb = pools.batch(mode, new_lens, fa3)
        t = fb.num_tokens
        q_nope, q_rope = torch.randn(t, heads, nope).to(DTYPE), torch.randn(t, heads, rope).to(DTYPE)
        latent, k_rope = torch.randn(t, rank).to(DTYPE), torch.randn(t, rope).to(DTYPE)
        fa3.init_forward_metadata(fb)
        out = layer(q_nope, q_rope, latent, k_rope, fb)  # MLAAttention picks backend.forward_mla
        row = pools.token_to_kv_pool.kv_buffer[1][fb.out_cache_loc, 0]
        assert torch.equal(row, torch.cat([latent, k_rope], dim=-1))
        ref.init_forward_metadata(fb)
        expected = ref.forward_mla(q_nope, q_rope, latent, k_rope, layer, fb, save_kv_cache=False)
        assert_close_rel(out, expected, tol=2e-2)

    step(ForwardMode.EXTEND, {"a": 33, "b": 1, "c": 70})
    step(ForwardMode.EXTEND, {"a": 5, "b": 40, "d": 12})
    for _ in range(3):
        step(ForwardMode.DECODE, {n: 1 for n in "abcd"})


@pytest.mark.skipif(can_use_fa3(), reason="FA3 can run here")
def test_without_fa3_the_backend_says_why():
    with pytest.raises(ValueError, match=r"fa3 \(--attention-backend.*cannot run here.*use triton"):
        FlashAttentionBackend(mha_pools(2, 64, 1))


def test_float32_pool_is_refused():
    with pytest.raises(ValueError, match="bfloat16"):
        backend(Pools(MHATokenToKVPool(256, 1, torch.float32, 2, 64, 1, "cpu")))


def test_reference_rejects_what_fa3_rejects():
    k = torch.zeros(4, 1, 1, 8, dtype=DTYPE)
    q = torch.zeros(1, 1, 1, 8, dtype=DTYPE)
    lens = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="int32"):
        flash_attn_with_kvcache_reference(q, k, k, cache_seqlens=lens, page_table=torch.zeros(1, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="contiguous last"):
        flash_attn_with_kvcache_reference(q, k, k.transpose(-1, -2), cache_seqlens=lens,
                                          page_table=torch.zeros(1, 1, dtype=torch.int32))
