"""FlashAttention-3 backend against torch_native on the same device pools (bf16, tolerance).

First the FA3 call patterns the backend relies on, against the torch reference
(`fa3_reference`): varlen EXTEND, batched DECODE, column views as k/v, and `qv`. Then the
backend: MHA/GQA at Llama-3-8B's attention shape (Hq 32, Hkv 8, D 128) and a small one (Hq 4, Hkv 2,
D 64), page sizes 1 and 16, request pages scattered over the pool: EXTEND without and with a
cached prefix (prefixes that end inside a page too), then ragged DECODE steps; DECODE again
through the backend's CUDA-graph metadata (captured once, replayed as lengths change, with
padding rows). MLA (DeepSeek shapes) against torch_native where this FA3 build has the
kernel; otherwise constructing the backend for an MLA pool must raise a clear ValueError.

Skipped without CUDA or without an importable FA3 on a Hopper GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))  # the shared harness

from paged_pools import Pools, assert_close_rel  # noqa: E402

from hiserve.layers.attention.base import RadixAttention  # noqa: E402
from hiserve.layers.attention.fa3_reference import flash_attn_with_kvcache_reference  # noqa: E402
from hiserve.layers.attention.flashattention_backend import (  # noqa: E402
    FlashAttentionBackend,
    can_use_fa3,
    fa3_supports_mla,
    fa3_unavailable_reason,
)
from hiserve.layers.attention.mla import MLAAttention  # noqa: E402
from hiserve.layers.attention.torch_native import TorchNativeAttnBackend  # noqa: E402
from hiserve.layers.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from hiserve.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _fa3():
    if not can_use_fa3():
        pytest.skip(f"FlashAttention-3 unavailable: {fa3_unavailable_reason()}")


DEV, DTYPE = torch.device("cuda"), torch.bfloat16
MHA_SHAPES = [(32, 8, 128), (4, 2, 64)]  # (Hq, Hkv, D)
PAGE_SIZES = [1, 16]
MLA_RANK, MLA_ROPE, MLA_NOPE, MLA_V, MLA_HEADS = 512, 64, 128, 128, 16


def mha_pools(hkv: int, d: int, page_size: int, size: int = 8192) -> Pools:
    return Pools(MHATokenToKVPool(size, page_size, DTYPE, hkv, d, 2, DEV))


# ------------------------------------------------------------------ FA3 itself vs the reference
def random_paged_call(b: int, hq: int, hkv: int, d: int, dv: int, page_size: int, q_lens: list[int],
                      varlen: bool, gen: torch.Generator):
    """Arguments of one paged call: scattered distinct pages, ragged context lengths >= q_lens."""
    seq_lens = [q + int(torch.randint(0, 90, (1,), generator=gen)) for q in q_lens]
    pages_per_req = [-(-s // page_size) for s in seq_lens]
    num_pages = sum(pages_per_req) + 3
    order = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    table = torch.zeros((b, max(pages_per_req) + 2), dtype=torch.int32)
    for i, n in enumerate(pages_per_req):
        table[i, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(DEV, DTYPE)

    total = sum(q_lens)
    args = dict(k_cache=rnd(num_pages, page_size, hkv, d), v_cache=rnd(num_pages, page_size, hkv, dv),
                cache_seqlens=torch.tensor(seq_lens, dtype=torch.int32, device=DEV), page_table=table.to(DEV),
                softmax_scale=d**-0.5, causal=True)
    if varlen:
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
        args.update(q=rnd(total, hq, d), cu_seqlens_q=cu, max_seqlen_q=max(q_lens))
    else:
        args.update(q=rnd(b, q_lens[0], hq, d))
    return args


def fa3_call(**args) -> torch.Tensor:
    from flash_attn_interface import flash_attn_with_kvcache

    out = flash_attn_with_kvcache(**args)
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("hq, hkv, d", MHA_SHAPES)
@pytest.mark.parametrize("varlen", [True, False])
def test_fa3_paged_call_matches_reference(hq, hkv, d, page_size, varlen):
    """The call patterns the backend relies on: varlen EXTEND (cu_seqlens_q, bottom-right causal)
    and batched DECODE (q [B, 1, H, D]) over a page table."""
    gen = torch.Generator().manual_seed(page_size + d)
    q_lens = [7, 1, 33, 16] if varlen else [1] * 5
    args = random_paged_call(len(q_lens), hq, hkv, d, d, page_size, q_lens, varlen, gen)
    assert_close_rel(fa3_call(**args), flash_attn_with_kvcache_reference(**args))


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_fa3_accepts_column_views_of_one_buffer_as_k_and_v(page_size):
    """MLA hands FA3 k and v as column slices of one row buffer (strided pages, contiguous last dim)."""
    gen = torch.Generator().manual_seed(3)
    args = random_paged_call(3, 8, 1, 64, 64, page_size, [5, 1, 12], True, gen)
    rows = torch.randn(*args["k_cache"].shape[:3], 128, generator=gen).to(DEV, DTYPE)
    args.update(k_cache=rows[..., 64:], v_cache=rows[..., :64])
    assert_close_rel(fa3_call(**args), flash_attn_with_kvcache_reference(**args))


NO_FA3_MLA = "FA3 MLA unavailable: no Hopper GPU, FA3 not importable, or its MLA trial failed"


@pytest.mark.skipif(not fa3_supports_mla(MLA_ROPE, MLA_RANK), reason=NO_FA3_MLA)
@pytest.mark.parametrize("varlen", [True, False])
def test_fa3_qv_call_matches_reference(varlen):
    gen = torch.Generator().manual_seed(4)
    q_lens = [9, 1, 20] if varlen else [1] * 4
    args = random_paged_call(len(q_lens), MLA_HEADS, 1, MLA_ROPE, MLA_RANK, 16, q_lens, varlen, gen)
    args["qv"] = torch.randn(*args["q"].shape[:-1], MLA_RANK, generator=gen).to(DEV, DTYPE)
    args["softmax_scale"] = (MLA_NOPE + MLA_ROPE) ** -0.5
    assert_close_rel(fa3_call(**args), flash_attn_with_kvcache_reference(**args), tol=2e-2)


# ------------------------------------------------------------------ MHA / GQA
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("hq, hkv, d", MHA_SHAPES)
def test_mha_extend_and_decode_match_torch_native(hq, hkv, d, page_size):
    torch.manual_seed(0)
    pools = mha_pools(hkv, d, page_size)
    fa3, ref = FlashAttentionBackend(pools), TorchNativeAttnBackend()
    layer = RadixAttention(hq, d, d**-0.5, hkv, layer_id=1)

    def step(mode: ForwardMode, new_lens: dict[str, int]) -> None:
        fb = pools.batch(mode, new_lens, fa3)
        t = fb.num_tokens
        q = torch.randn(t, hq * d, device=DEV, dtype=DTYPE)
        k = torch.randn(t, hkv * d, device=DEV, dtype=DTYPE)
        v = torch.randn(t, hkv * d, device=DEV, dtype=DTYPE)
        fa3.init_forward_metadata(fb)
        out = fa3.forward(q, k, v, layer, fb)  # writes the new K/V
        torch.testing.assert_close(pools.token_to_kv_pool.k_buffer[1][fb.out_cache_loc], k.view(t, hkv, d),
                                   rtol=0, atol=0)
        ref.init_forward_metadata(fb)
        assert_close_rel(out, ref.forward(q, k, v, layer, fb, save_kv_cache=False))

    step(ForwardMode.EXTEND, {"a": 37, "b": 1, "c": 130, "d": 16})  # no prefix
    step(ForwardMode.EXTEND, {"a": 20, "b": 64, "c": 3, "d": 16, "e": 9})  # prefixes 37, 1, 130, 16, 0
    for _ in range(3):  # ragged decode, some crossing a page boundary
        step(ForwardMode.DECODE, {n: 1 for n in "abcde"})
    step(ForwardMode.DECODE, {"c": 1})


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_decode_under_cuda_graph_matches_torch_native(page_size):
    """The captured attention call replays correctly as lengths, batch rows and padding change."""
    torch.manual_seed(1)
    hq, hkv, d, max_bs, graph_bs = 8, 2, 128, 8, 4
    pools = mha_pools(hkv, d, page_size)
    fa3, ref = FlashAttentionBackend(pools), TorchNativeAttnBackend()
    layer = RadixAttention(hq, d, d**-0.5, hkv, layer_id=0)
    names = list("abcdef")
    fb = pools.batch(ForwardMode.EXTEND, dict(zip(names, [3, 1, 17, 5, 40, 2])), fa3)
    t = fb.num_tokens
    fa3.init_forward_metadata(fb)
    fa3.forward(torch.randn(t, hq * d, device=DEV, dtype=DTYPE), torch.randn(t, hkv * d, device=DEV, dtype=DTYPE),
                torch.randn(t, hkv * d, device=DEV, dtype=DTYPE), layer, fb)

    pad_row, fill = pools.req_to_token_pool.padding_row, fa3.get_cuda_graph_seq_len_fill_value()
    static = {
        "q": torch.zeros(max_bs, hq * d, device=DEV, dtype=DTYPE),
        "k": torch.zeros(max_bs, hkv * d, device=DEV, dtype=DTYPE),
        "v": torch.zeros(max_bs, hkv * d, device=DEV, dtype=DTYPE),
        "loc": torch.zeros(max_bs, dtype=torch.int64, device=DEV),
        "rows": torch.full((max_bs,), pad_row, dtype=torch.int64, device=DEV),
        "lens": torch.full((max_bs,), fill, dtype=torch.int64, device=DEV),
    }
    fa3.init_cuda_graph_state(max_bs)
    fa3.init_forward_metadata_capture_cuda_graph(graph_bs, static["rows"][:graph_bs], static["lens"][:graph_bs])
    capture_fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=graph_bs, input_ids=static["loc"][:graph_bs],
        positions=static["loc"][:graph_bs], out_cache_loc=static["loc"][:graph_bs],
        req_pool_indices=static["rows"][:graph_bs], seq_lens=static["lens"][:graph_bs],
        seq_lens_cpu=[fill] * graph_bs, extend_seq_lens_cpu=[1] * graph_bs,
        extend_prefix_lens_cpu=[fill - 1] * graph_bs, req_to_token_pool=pools.req_to_token_pool,
        token_to_kv_pool=pools.token_to_kv_pool, attn_backend=fa3)

    def run() -> torch.Tensor:
        return fa3.forward(static["q"][:graph_bs], static["k"][:graph_bs], static["v"][:graph_bs], layer,
                           capture_fb)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out_static = run()

    for step_names in [names[:4], names[:3], names[2:6], ["e"], names[1:5]]:
        fb = pools.batch(ForwardMode.DECODE, {n: 1 for n in step_names}, ref)
        bs = fb.batch_size
        q = torch.randn(bs, hq * d, device=DEV, dtype=DTYPE)
        k = torch.randn(bs, hkv * d, device=DEV, dtype=DTYPE)
        v = torch.randn(bs, hkv * d, device=DEV, dtype=DTYPE)
        for key, value in (("q", q), ("k", k), ("v", v), ("loc", fb.out_cache_loc), ("rows", fb.req_pool_indices),
                           ("lens", fb.seq_lens)):
            static[key][:bs].copy_(value)
        static["loc"][bs:graph_bs].zero_()
        static["rows"][bs:graph_bs].fill_(pad_row)
        static["lens"][bs:graph_bs].fill_(fill)
        fa3.init_forward_metadata_replay_cuda_graph(graph_bs, static["rows"][:graph_bs], static["lens"][:graph_bs],
                                                    fb.seq_lens_cpu + [fill] * (graph_bs - bs))
        graph.replay()
        ref.init_forward_metadata(fb)
        expected = ref.forward(q, k, v, layer, fb, save_kv_cache=False)  # reads what the replay wrote
        assert_close_rel(out_static[:bs], expected)


# ------------------------------------------------------------------ MLA
def mla_pools(page_size: int) -> Pools:
    return Pools(MLATokenToKVPool(4096, page_size, DTYPE, MLA_RANK, MLA_ROPE, 2, DEV))


@pytest.mark.skipif(not fa3_supports_mla(MLA_ROPE, MLA_RANK), reason=NO_FA3_MLA)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_mla_extend_and_decode_match_torch_native(page_size):
    torch.manual_seed(0)
    pools = mla_pools(page_size)
    fa3, ref = FlashAttentionBackend(pools), TorchNativeAttnBackend()
    kv_b = torch.nn.Linear(MLA_RANK, MLA_HEADS * (MLA_NOPE + MLA_V), bias=False, device=DEV, dtype=DTYPE)
    scaling = (MLA_NOPE + MLA_ROPE) ** -0.5
    layer = MLAAttention(MLA_HEADS, MLA_NOPE, MLA_ROPE, MLA_V, MLA_RANK, scaling, layer_id=1, kv_b_proj=kv_b)

    def step(mode: ForwardMode, new_lens: dict[str, int]) -> None:
        fb = pools.batch(mode, new_lens, fa3)
        t = fb.num_tokens
        q_nope = torch.randn(t, MLA_HEADS, MLA_NOPE, device=DEV, dtype=DTYPE)
        q_rope = torch.randn(t, MLA_HEADS, MLA_ROPE, device=DEV, dtype=DTYPE)
        latent = torch.randn(t, MLA_RANK, device=DEV, dtype=DTYPE)
        k_rope = torch.randn(t, MLA_ROPE, device=DEV, dtype=DTYPE)
        fa3.init_forward_metadata(fb)
        out = fa3.forward_mla(q_nope, q_rope, latent, k_rope, layer, fb)
        ref.init_forward_metadata(fb)
        expected = ref.forward_mla(q_nope, q_rope, latent, k_rope, layer, fb, save_kv_cache=False)
        assert_close_rel(out, expected, tol=2e-2)

    step(ForwardMode.EXTEND, {"a": 33, "b": 1, "c": 70})
    step(ForwardMode.EXTEND, {"a": 5, "b": 40, "d": 12})
    for _ in range(3):
        step(ForwardMode.DECODE, {n: 1 for n in "abcd"})


@pytest.mark.skipif(fa3_supports_mla(MLA_ROPE, MLA_RANK), reason="FA3 passes its MLA trial here")
def test_mla_without_the_kernel_is_refused_clearly():
    pools = mla_pools(1)
    with pytest.raises(ValueError, match=r"--attention-backend.*triton"):
        FlashAttentionBackend(SimpleNamespace(req_to_token_pool=pools.req_to_token_pool,
                                              token_to_kv_pool=pools.token_to_kv_pool))


def test_float32_pool_is_refused():
    pools = Pools(MHATokenToKVPool(256, 1, torch.float32, 2, 64, 1, DEV))
    with pytest.raises(ValueError, match="bfloat16"):
        FlashAttentionBackend(pools)
