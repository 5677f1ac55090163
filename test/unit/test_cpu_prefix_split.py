"""EXTEND chunks over a cached prefix on the CPU's SDPA route, split into a prefix part and an
own part merged by log-sum-exp, with requests that share their leading pool slots (a radix hit
on one system prompt) grouped into one prefix call (`cpu_prefix_split`). Checked against the
torch_native oracle on real pools with shuffled pages, float32 and bf16, GQA 1/3/8, page sizes
1 and 16, and a mixed batch: several requests on one shared prompt, one of them with cached
tokens of its own past it, an unrelated request over its own prefix, a fresh prompt and a
request short enough for the paged kernel."""

from __future__ import annotations

import pytest
import torch
from paged_pools import Pools, assert_close_rel

from hiserve.jit_kernel import cpu as cpu_kernels
from hiserve.layers.attention import cpu_prefix_split as prefix_split
from hiserve.layers.attention.base import RadixAttention
from hiserve.layers.attention.cpu_backend import CpuPagedAttnBackend
from hiserve.layers.attention.torch_native import TorchNativeAttnBackend
from hiserve.layers.forward_batch import ForwardMode
from hiserve.mem_cache.memory_pool import MHATokenToKVPool

# The backend tests need the kernels (the paged rows) and the op (the split); the planning
# tests need neither, and the no-op test fakes a torch without the op.
needs_kernels = pytest.mark.skipif(not cpu_kernels.can_use_cpu_kernels(), reason="CPU kernels cannot be built here")
needs_op = pytest.mark.skipif(not prefix_split.available(), reason="this torch lacks the CPU flash op")
EXTEND = ForwardMode.EXTEND
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _bf16_case(pool_tokens: int, max_context: int):
    """(pools, backend on the sdpa route, oracle, layer): bf16, page 16, 6 query heads on 2 KV
    heads of dim 64; unpack into `_run`."""
    kv = MHATokenToKVPool(pool_tokens, 16, torch.bfloat16, 2, 64, 1, "cpu")
    pools = Pools(kv, max_reqs=6, max_context=max_context)
    backend = CpuPagedAttnBackend(pools)
    backend.extend_route = "sdpa"
    return pools, backend, TorchNativeAttnBackend(), RadixAttention(6, 64, 0.125, 2, layer_id=0)


def _run(pools, backend, oracle, layer, dtype, new_lens):
    fb = pools.batch(EXTEND, new_lens, backend)
    t, hq, hkv, d = fb.out_cache_loc.numel(), layer.num_heads, layer.num_kv_heads, layer.head_dim
    q, k, v = (torch.randn(t, h * d).to(dtype) for h in (hq, hkv, hkv))
    backend.init_forward_metadata(fb)
    got = backend.forward(q, k, v, layer, fb)
    oracle.init_forward_metadata(fb)
    assert_close_rel(got, oracle.forward(q, k, v, layer, fb, save_kv_cache=False), TOL[dtype])
    return backend._meta


@needs_kernels
@needs_op
@pytest.mark.parametrize("route", ["sdpa", "amx"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("page_size", [1, 16])
def test_shared_prefix_groups_match_torch_native(page_size, group, dtype, route):
    """On both routings that split groups ("amx": the AMX kernel, on an AMX CPU)."""
    if route == "amx" and not cpu_kernels.amx_gemm_available():
        pytest.skip("no AMX kernels here")
    torch.manual_seed(page_size * 10 + group)
    hkv, d = 2, 64
    kv = MHATokenToKVPool(8192, page_size, dtype, hkv, d, 1, "cpu")
    pools = Pools(kv, max_reqs=12, max_context=2048)
    backend, oracle = CpuPagedAttnBackend(pools), TorchNativeAttnBackend()
    backend.extend_route = route
    layer = RadixAttention(hkv * group, d, d ** -0.5, hkv, layer_id=0)
    _run(pools, backend, oracle, layer, dtype, {"sys": 1000, "other": 300})  # fresh prompts
    # "tail" caches 64 tokens of its own past the shared prompt (cached in a first chunk)
    pools.share_prefix("tail", "sys", 992)
    _run(pools, backend, oracle, layer, dtype, {"tail": 64})
    for name in ("a", "b", "c"):
        pools.share_prefix(name, "sys", 992)
    pools.share_prefix("short", "other", 288)  # 3 new tokens: the paged kernel's
    meta = _run(pools, backend, oracle, layer, dtype,
                {"a": 50, "fresh": 40, "b": 7, "tail": 33, "other": 20, "short": 3, "c": 100})
    shapes = [(g.shared_slots.numel(), sorted(m.own_slots.numel() for m in g.members)) for g in meta.groups]
    # the shared prompt's group ("tail"'s own 64 cached tokens are in its own part); "other"
    # shares with no one: one masked call over its gathered context
    assert shapes == [(992, [7, 50, 64 + 33, 100])], shapes
    assert meta.groups[0].batched is None  # padding the own parts to 100 x 100 would cost 2.5x: one call each
    assert [len(m[2]) for m in meta.gathered] == [320]
    assert meta.fresh and meta.paged is not None  # "fresh" and "short" took the other paths
    meta = _run(pools, backend, oracle, layer, dtype, {"b": 2, "a": 9, "c": 5})  # the kernel's and a group's rows
    assert meta.paged.q_rows.tolist() == [0, 1] and meta.groups[0].rows.tolist() == list(range(2, 16))
    assert not meta.fresh and meta.groups[0].contiguous
    assert meta.groups[0].batched is not None  # 9 and 5 queries padded to 9: the own parts in one call


def test_plan_groups_thresholds():
    base = torch.arange(10_000, 13_000)
    near = torch.cat([base[: prefix_split.MIN_SHARED_TOKENS - 1], torch.arange(20_000, 22_000)])
    far = torch.cat([base[:1900], torch.arange(30_000, 30_200)])
    groups, alone = prefix_split.plan_groups([(0, 10, 1990, base[:2000]), (10, 20, 1500, near[:1510]),
                                              (20, 25, 2050, far[:2055])])
    # near shares one slot too few and stays alone; far joins and shrinks the shared part
    assert [g.shared_slots.numel() for g in groups] == [1900] and [c[:3] for c in alone] == [(10, 20, 1500)]
    assert [m.own_slots.numel() for m in groups[0].members] == [2000 - 1900, 2055 - 1900]
    assert groups[0].rows.tolist() == list(range(10)) + list(range(20, 25)) and not groups[0].contiguous
    own_mask = groups[0].members[1].mask  # far: 5 new tokens over 2050 - 1900 own cached keys
    assert own_mask.shape == (5, 155) and own_mask[0].sum() == 151 and own_mask[4].all()
    # 600 shared against 100 own (< MIN_SHARED_TO_OWN x): both alone, in batch order
    short = torch.cat([base[:600], torch.arange(40_000, 40_100)])
    groups, alone = prefix_split.plan_groups([(30, 90, 640, short[:700]), (0, 30, 600, base[:630])])
    assert not groups and [c[0] for c in alone] == [0, 30]


def test_a_weak_sharer_does_not_cancel_a_group():
    """Five requests on 1000 shared slots and one sharing only their first 600: the five stay a
    group on 1000 (cutting it to 600 would fail MIN_SHARED_TO_OWN for them), the sixth alone."""
    base = torch.arange(50_000, 51_000)
    chunks = [(10 * i, 10 * i + 10, 1000, torch.cat([base, torch.arange(60_000 + 10 * i, 60_010 + 10 * i)]))
              for i in range(5)]
    weak = torch.cat([base[:600], torch.arange(70_000, 70_560)])
    groups, alone = prefix_split.plan_groups(chunks[:2] + [(50, 60, 1150, weak)] + chunks[2:])
    assert [(g.shared_slots.numel(), len(g.members)) for g in groups] == [(1000, 5)]
    assert [c[0] for c in alone] == [50]


def test_planning_is_linear_in_unrelated_chunks():
    """Chunks that share nothing land in buckets of their own (by first slot): no comparisons."""
    chunks = [(i, i + 1, 600, torch.arange(1000 * i, 1000 * i + 601)) for i in range(200)]
    calls = []
    original = prefix_split._common_len
    try:
        prefix_split._common_len = lambda a, b: calls.append(1) or original(a, b)
        groups, alone = prefix_split.plan_groups(chunks)
    finally:
        prefix_split._common_len = original
    assert not groups and len(alone) == 200 and not calls


@needs_kernels
@needs_op
def test_group_whose_first_member_has_the_longest_prefix():
    """The shared part shrinks as members join (the first member caches 256 tokens more)."""
    torch.manual_seed(5)
    case = _bf16_case(8192, 4096)
    pools = case[0]
    _run(*case, torch.bfloat16, {"sys": 1600})
    pools.share_prefix("long", "sys", 1536 + 64)
    pools.share_prefix("b", "sys", 1536)
    pools.share_prefix("c", "sys", 1536)
    meta = _run(*case, torch.bfloat16, {"long": 40, "b": 30, "c": 20})
    assert [(g.shared_slots.numel(), [m.own_slots.numel() for m in g.members]) for g in meta.groups] == \
        [(1536, [64 + 40, 30, 20])]


@needs_kernels
def test_without_the_flash_op_long_chunks_run_gathered(monkeypatch):
    """A torch without `_scaled_dot_product_flash_attention_for_cpu`: one masked SDPA call a
    chunk over its gathered context (the path before the split), still equal to the oracle."""
    case = _bf16_case(4096, 2048)
    pools = case[0]
    _run(*case, torch.bfloat16, {"sys": 1000})
    pools.share_prefix("a", "sys", 992)
    chunks = {"a": 30, "sys": 9}  # with the op these two would be a group on 992 shared slots
    assert len(prefix_split.plan_groups([(0, 30, 992, torch.arange(1022)),
                                         (30, 39, 1000, torch.arange(1009))])[0]) == 1
    monkeypatch.setattr(prefix_split, "_FLASH_CPU", None)
    meta = _run(*case, torch.bfloat16, chunks)
    assert not meta.groups and sorted(len(m[2]) for m in meta.gathered) == [1009, 1022]


@needs_kernels
@needs_op
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
def test_own_parts_batched_into_one_call(group, dtype):
    """Members of similar size (scenario (c)'s questions on one system prompt) run their own parts
    as one padded call; one member also has cached tokens of its own. Equal to the oracle, and
    the padded query rows and keys leave no trace."""
    torch.manual_seed(40 + group)
    hkv, d = 2, 64
    kv = MHATokenToKVPool(8192, 1, dtype, hkv, d, 1, "cpu")
    pools = Pools(kv, max_reqs=8, max_context=2048)
    backend, oracle = CpuPagedAttnBackend(pools), TorchNativeAttnBackend()
    backend.extend_route = "sdpa"
    layer = RadixAttention(hkv * group, d, d ** -0.5, hkv, layer_id=0)
    _run(pools, backend, oracle, layer, dtype, {"sys": 1000})
    pools.share_prefix("tail", "sys", 992)
    _run(pools, backend, oracle, layer, dtype, {"tail": 8})
    for name in ("a", "b", "c", "e"):
        pools.share_prefix(name, "sys", 992)
    meta = _run(pools, backend, oracle, layer, dtype, {"a": 50, "b": 41, "tail": 37, "c": 56, "e": 47})
    (grp,) = meta.groups
    assert grp.batched is not None and (grp.batched.n_max, grp.batched.t_max) == (56, 56)
    assert sorted(m.own_slots.numel() for m in grp.members) == [41, 8 + 37, 47, 50, 56]
