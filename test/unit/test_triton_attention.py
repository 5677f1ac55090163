"""Triton attention backend against the torch_native oracle, with real pools.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1
is set by triton_interpret.py, imported before any kernel module); on a CUDA machine the same tests
compile the kernels and run in float32 on the GPU, and the `cuda`-marked tests add bf16
runs at model shapes (Llama-3-8B, DeepSeek MLA 512 + 64) and a real CUDA-graph
capture/replay.

Covered: MHA, GQA (incl. a group wider than one 16-head block), non-power-of-two head
dims, page sizes 1 and 16 with shuffled pages, prefill, chunked prefill after a prefix,
decode with ragged lengths incl. 1, MLA absorbed through `forward_mla_as_mqa`, the
CUDA-graph metadata path with a padded batch, and argument checks.
"""

from __future__ import annotations

import pytest
import torch
from triton_interpret import DEVICE, INTERPRET  # sets TRITON_INTERPRET before triton loads

from hiserve.layers.attention import torch_native_mla
from hiserve.layers.attention.base import RadixAttention
from hiserve.layers.attention.mla import MLAAttention
from hiserve.layers.attention.torch_native import TorchNativeAttnBackend
from hiserve.layers.forward_batch import ForwardBatch, ForwardMode
from hiserve.mem_cache.allocator import ReqToTokenPool
from hiserve.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from hiserve.layers.attention.triton_backend import TritonAttnBackend, can_use_triton
from hiserve.layers.attention.triton_ops import (
    alloc_decode_scratch,
    decode_attention_fwd,
    extend_attention_fwd,
)
from hiserve.layers.attention.triton_ops import decode_attention, extend_attention

FP32_TOL = dict(atol=2e-5, rtol=2e-5)
BF16_REL_ERR = 1.5e-2  # ||got - want|| / ||want|| against a float32 oracle over the same bf16 pool
EXTEND, DECODE = ForwardMode.EXTEND, ForwardMode.DECODE


# ------------------------------------------------------------------ harness
class _Runner:
    """What TritonAttnBackend reads from a model runner."""

    def __init__(self, device, num_attention_heads, head_dim, kv_lora_rank=None):
        self.device = torch.device(device)
        self.model_config = type("Cfg", (), dict(num_attention_heads=num_attention_heads, head_dim=head_dim,
                                                 kv_lora_rank=kv_lora_rank))()


class Harness:
    """Real request/KV pools, both backends, and page-granular shuffled slot assignment:
    position j of a request lives at slot `page * page_size + j % page_size` of one of its
    pages, pages drawn in random order (page 0 is the padding page, never handed out)."""

    def __init__(self, *, hq, page_size, dtype, device=DEVICE, hkv=1, head_dim=None, mla=None,
                 num_kv_splits=4, num_pages=64, seed=0):
        self.gen = torch.Generator().manual_seed(seed)
        self.device, self.dtype, self.page_size = torch.device(device), dtype, page_size
        size = num_pages * page_size
        self.req_to_token_pool = ReqToTokenPool(8, 1088, device)
        self.padding_row = self.req_to_token_pool.alloc(1)[0]  # all zeros: every position -> slot 0
        if mla is not None:
            r, rope = mla
            self.kv_pool = MLATokenToKVPool(size, page_size, dtype, r, rope, 2, device)
            runner = _Runner(device, hq, r + rope, kv_lora_rank=r)
        else:
            self.kv_pool = MHATokenToKVPool(size, page_size, dtype, hkv, head_dim, 2, device)
            runner = _Runner(device, hq, head_dim)
        self.native = TorchNativeAttnBackend()
        self.triton = TritonAttnBackend(runner, num_kv_splits=num_kv_splits)
        self.free_pages = (torch.randperm(num_pages, generator=self.gen) + 1).tolist()
        self.rows: dict[str, int] = {}
        self.pages: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def randn(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(self.device, self.dtype)

    def batch(self, mode: ForwardMode, names: list[str], new_lens: list[int]) -> ForwardBatch:
        locs = []
        for name, n in zip(names, new_lens):
            if name not in self.rows:
                self.rows[name], self.pages[name], self.lens[name] = self.req_to_token_pool.alloc(1)[0], [], 0
            for pos in range(self.lens[name], self.lens[name] + n):
                if pos % self.page_size == 0:
                    self.pages[name].append(self.free_pages.pop())
                slot = self.pages[name][pos // self.page_size] * self.page_size + pos % self.page_size
                self.req_to_token_pool.req_to_token[self.rows[name], pos] = slot
                locs.append(slot)
        prefix = [self.lens[n] for n in names]
        seq = [p + e for p, e in zip(prefix, new_lens)]
        for name, s in zip(names, seq):
            self.lens[name] = s
        dev = self.device
        return ForwardBatch(
            forward_mode=mode, batch_size=len(names),
            input_ids=torch.zeros(sum(new_lens), dtype=torch.long, device=dev),
            positions=torch.cat([torch.arange(p, s) for p, s in zip(prefix, seq)]).to(dev),
            out_cache_loc=torch.tensor(locs, dtype=torch.long, device=dev),
            req_pool_indices=torch.tensor([self.rows[n] for n in names], dtype=torch.long, device=dev),
            seq_lens=torch.tensor(seq, dtype=torch.long, device=dev), seq_lens_cpu=seq,
            extend_seq_lens_cpu=list(new_lens), extend_prefix_lens_cpu=prefix,
            req_to_token_pool=self.req_to_token_pool, token_to_kv_pool=self.kv_pool, attn_backend=self.triton,
        )


def assert_matches(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """float32: elementwise within FP32_TOL; bf16/fp16: relative error norm under BF16_REL_ERR."""
    assert got.shape == want.shape, what
    assert torch.isfinite(got).all(), f"{what}: non-finite output"
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, **FP32_TOL, msg=lambda m: f"{what}: {m}")
    else:
        rel = ((got.float() - want).norm() / want.norm()).item()
        assert rel < BF16_REL_ERR, f"{what}: relative error {rel:.3g}"


# --------------------------------------------------------------- MHA / GQA
def mha_step(h: Harness, layer: RadixAttention, mode, names, new_lens) -> None:
    """One forward through the triton backend (which stores K/V) vs torch_native reading the
    same pool; the oracle runs on float32 queries, so it is exact attention over the pool."""
    fb = h.batch(mode, names, new_lens)
    t, hq, hkv, d = sum(new_lens), layer.num_heads, layer.num_kv_heads, layer.head_dim
    q, k, v = h.randn(t, hq * d), h.randn(t, hkv * d), h.randn(t, hkv * d)
    h.triton.init_forward_metadata(fb)
    got = layer(q, k, v, fb)
    assert got.dtype == q.dtype and got.shape == (t, hq * d)
    assert torch.equal(h.kv_pool.get_key_buffer(layer.layer_id)[fb.out_cache_loc], k.view(t, hkv, d))
    assert torch.equal(h.kv_pool.get_value_buffer(layer.layer_id)[fb.out_cache_loc], v.view(t, hkv, d))
    h.native.init_forward_metadata(fb)
    want = h.native.forward(q.float(), k, v, layer, fb, save_kv_cache=False)
    assert_matches(got, want, f"{mode.name} {dict(zip(names, fb.seq_lens_cpu))}")


def run_mha_scenario(*, hq, hkv, d, page_size, dtype, device=DEVICE, long_len=70, num_kv_splits=4):
    h = Harness(hq=hq, hkv=hkv, head_dim=d, page_size=page_size, dtype=dtype, device=device,
                num_kv_splits=num_kv_splits, num_pages=(long_len + 60) // page_size + 8)
    layer = RadixAttention(hq, d, d**-0.5, hkv, layer_id=1)
    # Prefill (prefix 0); `c` spans several query and key tiles.
    mha_step(h, layer, EXTEND, ["a", "b", "c"], [5, 1, long_len])
    # Chunked prefill after cached prefixes, next to a fresh request `d`.
    mha_step(h, layer, EXTEND, ["a", "b", "c", "d"], [7, 3, 2, 17])
    # Decode with ragged lengths; `e` decodes at seq_len 1 (a single split holds keys).
    mha_step(h, layer, DECODE, ["a", "b", "c", "d", "e"], [1] * 5)
    mha_step(h, layer, DECODE, ["e", "c", "a"], [1] * 3)


@pytest.mark.parametrize(
    "hq,hkv,d,page_size",
    [
        (8, 2, 64, 1),  # GQA, page 1
        (4, 4, 64, 16),  # MHA, page 16
        (6, 2, 80, 16),  # non-power-of-two head dim: 64 + masked 16
        (32, 1, 32, 1),  # MQA whose group spans two 16-head blocks
    ],
)
def test_mha_matches_torch_native(hq, hkv, d, page_size):
    run_mha_scenario(hq=hq, hkv=hkv, d=d, page_size=page_size, dtype=torch.float32)


def test_decode_single_split():
    run_mha_scenario(hq=4, hkv=2, d=32, page_size=1, dtype=torch.float32, long_len=20, num_kv_splits=1)


# ----------------------------------------------------------------------- MLA
def run_mla_scenario(*, heads, r, rope, nope, v_dim, page_size, dtype, device=DEVICE, long_len=40):
    """MLA through `MLAAttention.forward` on the triton backend (it has no `forward_mla`, so
    the absorbed MQA form runs), against torch_native's `forward_mla` (expanded extend,
    absorbed decode) in float32 over the same pool."""
    h = Harness(hq=heads, page_size=page_size, dtype=dtype, device=device, mla=(r, rope),
                num_pages=(long_len + 60) // page_size + 8)
    assert not hasattr(h.triton, "forward_mla")
    kv_b = torch.nn.Linear(r, heads * (nope + v_dim), bias=False)
    torch.nn.init.normal_(kv_b.weight, std=r**-0.5, generator=h.gen)
    kv_b = kv_b.to(device, dtype)
    layer = MLAAttention(heads, nope, rope, v_dim, r, (nope + rope) ** -0.5, layer_id=1, kv_b_proj=kv_b)

    def step(mode, names, new_lens):
        fb = h.batch(mode, names, new_lens)
        t = sum(new_lens)
        q_nope, q_rope = h.randn(t, heads, nope), h.randn(t, heads, rope)
        latent, k_rope = h.randn(t, r), h.randn(t, rope)
        h.triton.init_forward_metadata(fb)
        got = layer(q_nope, q_rope, latent, k_rope, fb)
        rows = h.kv_pool.get_key_buffer(1)[fb.out_cache_loc, 0]
        assert torch.equal(rows, torch.cat([latent, k_rope], dim=-1))
        h.native.init_forward_metadata(fb)
        layer_fp32 = MLAAttention(heads, nope, rope, v_dim, r, layer.scaling, 1, kv_b.float())
        want = torch_native_mla.forward_mla(h.native, q_nope.float(), q_rope.float(), latent, k_rope,
                                            layer_fp32, fb, save_kv_cache=False)
        assert_matches(got, want, f"MLA {mode.name} {dict(zip(names, fb.seq_lens_cpu))}")

    step(EXTEND, ["a", "b", "c"], [6, 1, long_len])
    step(EXTEND, ["a", "b", "d"], [5, 9, 3])
    step(DECODE, ["a", "b", "c", "d", "e"], [1] * 5)
    step(DECODE, ["c", "e"], [1] * 2)


@pytest.mark.parametrize("page_size", [1, 16])
def test_mla_absorbed_matches_torch_native(page_size):
    # Dk = 64 + 32 = 96 (64 + a 32 remainder tile), Dv = 64, v read as a strided view of the rows.
    run_mla_scenario(heads=4, r=64, rope=32, nope=32, v_dim=32, page_size=page_size, dtype=torch.float32)


# --------------------------------------------------------- ops on raw tensors
def naive(q, k, v, slots, q_pos, scaling):
    """q [n, Hq, Dk] at absolute positions q_pos over keys/values at `slots`; float64."""
    hq, hkv = q.shape[1], k.shape[1]
    kk = k[slots].double().repeat_interleave(hq // hkv, 1)  # [S, Hq, Dk]
    vv = v[slots].double().repeat_interleave(hq // hkv, 1)
    s = torch.einsum("nhd,shd->nhs", q.double(), kk) * scaling
    s = s.masked_fill(torch.arange(len(slots)).view(1, 1, -1) > torch.tensor(q_pos).view(-1, 1, 1), float("-inf"))
    return torch.einsum("nhs,shd->nhd", s.softmax(-1), vv)


def test_ops_key_and_value_dims_differ():
    """Dk = 80 (64 + 16), Dv = 48 (masked 64), GQA 8/2, int32 lengths, rows in any order."""
    torch.manual_seed(1)
    hq, hkv, dk, dv, nslots = 8, 2, 80, 48, 300
    k, v = torch.randn(nslots, hkv, dk, device=DEVICE), torch.randn(nslots, hkv, dv, device=DEVICE)
    req_to_token = torch.zeros(5, 128, dtype=torch.int32, device=DEVICE)
    rows, lens, ext = [3, 0, 4], [1, 37, 100], [1, 12, 100]
    slots = (torch.randperm(nslots - 1) + 1)[: sum(lens)].to(DEVICE)
    ctx, off = [], 0
    for row, n in zip(rows, lens):
        req_to_token[row, :n] = slots[off : off + n].int()
        ctx.append(slots[off : off + n].long().cpu())
        off += n
    rows_t = torch.tensor(rows, device=DEVICE)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    scaling = 0.11

    q = torch.randn(3, hq, dk, device=DEVICE)
    out = torch.empty(3, hq, dv, device=DEVICE)
    decode_attention_fwd(q, k, v, out, req_to_token, rows_t, lens_t, scaling,
                         *alloc_decode_scratch(4, hq, dv, 3, DEVICE))
    for i, n in enumerate(lens):
        want = naive(q[i : i + 1].cpu(), k.cpu(), v.cpu(), ctx[i], [n - 1], scaling)
        torch.testing.assert_close(out[i : i + 1].cpu().double(), want, **FP32_TOL)

    q = torch.randn(sum(ext), hq, dk, device=DEVICE)
    out = torch.empty(sum(ext), hq, dv, device=DEVICE)
    starts = torch.tensor([0, 1, 13], device=DEVICE)
    extend_attention_fwd(q, k, v, out, req_to_token, rows_t, lens_t, torch.tensor(ext, device=DEVICE), starts,
                         max(ext), scaling)
    for i, (n, e) in enumerate(zip(lens, ext)):
        s = int(starts[i])
        want = naive(q[s : s + e].cpu(), k.cpu(), v.cpu(), ctx[i], list(range(n - e, n)), scaling)
        torch.testing.assert_close(out[s : s + e].cpu().double(), want, **FP32_TOL)


def test_ops_reject_bad_arguments():
    hq, hkv, d = 4, 2, 32
    k = torch.zeros(16, hkv, d, device=DEVICE)
    r2t = torch.zeros(2, 8, dtype=torch.int32, device=DEVICE)
    rows, lens = torch.zeros(2, dtype=torch.long, device=DEVICE), torch.ones(2, dtype=torch.long, device=DEVICE)
    q, out = torch.zeros(2, hq, d, device=DEVICE), torch.zeros(2, hq, d, device=DEVICE)
    scratch = alloc_decode_scratch(2, hq, d, 2, DEVICE)
    decode_attention_fwd(q, k, k, out, r2t, rows, lens, 1.0, *scratch)  # the baseline is accepted

    def rejects(match, **kw):
        args = dict(q=q, k_buf=k, v_buf=k, out=out, req_to_token=r2t, req_pool_indices=rows, seq_lens=lens,
                    scaling=1.0, partial_out=scratch[0], partial_lse=scratch[1])
        with pytest.raises(ValueError, match=match):
            decode_attention_fwd(**{**args, **kw})

    rejects("q's 3 heads", q=torch.zeros(2, 3, d, device=DEVICE))  # 3 heads over 2 kv heads
    rejects("k_buf must be", k_buf=torch.zeros(16, hkv, 16, device=DEVICE))
    rejects("req_to_token must be", req_to_token=r2t.long())
    rejects("seq_lens must be", seq_lens=lens[:1])
    rejects("out must be", out=torch.zeros(2, hq, 16, device=DEVICE))
    rejects("partial_out must be", partial_out=torch.zeros(1, hq, 2, d, device=DEVICE))
    rejects("partial_lse must be", partial_lse=torch.zeros(2, hq, 3, device=DEVICE))
    with pytest.raises(ValueError, match="extend_start_loc must be"):
        extend_attention_fwd(q, k, k, out, r2t, rows, lens, lens, lens[:1], 1, 1.0)
    with pytest.raises(ValueError, match="num_kv_splits"):
        alloc_decode_scratch(2, hq, d, 0, DEVICE)


def test_kernels_run_in_interpreter_without_gpu():
    assert can_use_triton()
    kinds = {type(decode_attention._decode_split_kernel), type(decode_attention._decode_merge_kernel),
             type(extend_attention._extend_kernel)}
    if DEVICE == "cpu":
        from triton.runtime.interpreter import InterpretedFunction

        assert kinds == {InterpretedFunction}
    else:
        from triton.runtime.jit import JITFunction

        assert kinds == {JITFunction}


# ------------------------------------------------------ CUDA-graph metadata
def test_cuda_graph_metadata_capture_then_replay_padded():
    """Capture against static buffers (padded fill values), then replay twice with other
    lengths and a padded request; outputs of the real requests match torch_native, and the
    split-KV scratch is the one allocated by init_cuda_graph_state."""
    hq, hkv, d, bs = 8, 2, 32, 4
    h = Harness(hq=hq, hkv=hkv, head_dim=d, page_size=16, dtype=torch.float32)
    layer = RadixAttention(hq, d, d**-0.5, hkv, layer_id=0)
    backend = h.triton
    mha_step(h, layer, EXTEND, ["a", "b", "c"], [30, 2, 9])

    backend.init_cuda_graph_state(max_bs=6)
    static_rows = torch.full((6,), h.padding_row, dtype=torch.long, device=DEVICE)
    static_lens = torch.full((6,), backend.get_cuda_graph_seq_len_fill_value(), dtype=torch.long, device=DEVICE)
    static_loc = torch.zeros(6, dtype=torch.long, device=DEVICE)  # padded tokens write the padding page
    backend.init_forward_metadata_capture_cuda_graph(bs, static_rows, static_lens)

    def static_batch(seq_lens_cpu):
        return ForwardBatch(
            forward_mode=DECODE, batch_size=bs, input_ids=torch.zeros(bs, dtype=torch.long, device=DEVICE),
            positions=static_lens[:bs] - 1, out_cache_loc=static_loc[:bs], req_pool_indices=static_rows[:bs],
            seq_lens=static_lens[:bs], seq_lens_cpu=seq_lens_cpu, extend_seq_lens_cpu=[1] * bs,
            extend_prefix_lens_cpu=[s - 1 for s in seq_lens_cpu], req_to_token_pool=h.req_to_token_pool,
            token_to_kv_pool=h.kv_pool, attn_backend=backend)

    # What a capture runs: the padded fill values only (every request at seq_len 1, slot 0).
    out = backend.forward(h.randn(bs, hq * d), h.randn(bs, hkv * d), h.randn(bs, hkv * d), layer,
                          static_batch([1] * bs))
    assert torch.isfinite(out).all()

    for names, same_buffers in ((["a", "b", "c"], True), (["c", "a"], False)):
        real = h.batch(DECODE, names, [1] * len(names))  # assigns slots, updates req_to_token
        n = len(names)
        rows = torch.cat([real.req_pool_indices, torch.full((bs - n,), h.padding_row, device=DEVICE)])
        lens = torch.cat([real.seq_lens, torch.ones(bs - n, dtype=torch.long, device=DEVICE)])
        static_loc[:n], static_loc[n:] = real.out_cache_loc, 0
        if same_buffers:  # the runner writes into the captured buffers itself
            static_rows[:bs], static_lens[:bs] = rows, lens
            backend.init_forward_metadata_replay_cuda_graph(bs, static_rows, static_lens, lens.tolist())
        else:  # fresh tensors: the backend copies them into the captured buffers
            backend.init_forward_metadata_replay_cuda_graph(bs, rows.int(), lens.int(), lens.tolist())
            assert torch.equal(static_rows[:bs], rows) and torch.equal(static_lens[:bs], lens)
        q, k, v = h.randn(bs, hq * d), h.randn(bs, hkv * d), h.randn(bs, hkv * d)
        got = backend.forward(q, k, v, layer, static_batch(lens.tolist()))
        h.native.init_forward_metadata(real)
        want = h.native.forward(q[:n], k[:n], v[:n], layer, real, save_kv_cache=False)
        assert_matches(got[:n], want, f"replay {names}")
    assert backend._scratch is None  # eager scratch never allocated: decode used the graph's

    with pytest.raises(ValueError, match="no graph was captured"):
        backend.init_forward_metadata_replay_cuda_graph(2, static_rows, static_lens, [1, 1])
    with pytest.raises(ValueError, match="bs 7"):
        backend.init_forward_metadata_capture_cuda_graph(7, static_rows, static_lens)


def test_cuda_graph_scratch_too_small_is_an_error():
    """A layer wider than the runner's config cannot get graph scratch (it is never reallocated)."""
    h = Harness(hq=4, hkv=2, head_dim=32, page_size=1, dtype=torch.float32)
    layer = RadixAttention(8, 32, 1.0, 2, layer_id=0)  # 8 q heads, config says 4
    h.triton.init_cuda_graph_state(max_bs=2)
    rows = torch.full((2,), h.padding_row, dtype=torch.long, device=DEVICE)
    lens = torch.ones(2, dtype=torch.long, device=DEVICE)
    h.triton.init_forward_metadata_capture_cuda_graph(2, rows, lens)
    fb = h.batch(DECODE, ["a", "b"], [1, 1])
    with pytest.raises(RuntimeError, match="graph decode needs scratch"):
        h.triton.forward(h.randn(2, 8 * 32), h.randn(2, 64), h.randn(2, 64), layer, fb)


# ----------------------------------------------------------------------- CUDA
cuda = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs an NVIDIA GPU (compiled Triton)")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize(
    "hq,hkv,d,page_size",
    [(32, 8, 128, 1), (32, 8, 128, 16), (8, 8, 64, 16), (14, 2, 64, 1), (16, 2, 96, 16)],
    ids=["llama3_8b_p1", "llama3_8b_p16", "mha_d64", "qwen_group7", "d96"],
)
def test_cuda_bf16_mha(hq, hkv, d, page_size):
    run_mha_scenario(hq=hq, hkv=hkv, d=d, page_size=page_size, dtype=torch.bfloat16, device="cuda",
                     long_len=300, num_kv_splits=8)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("page_size", [1, 16])
def test_cuda_bf16_mla_deepseek_shape(page_size):
    run_mla_scenario(heads=16, r=512, rope=64, nope=128, v_dim=128, page_size=page_size,
                     dtype=torch.bfloat16, device="cuda", long_len=200)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("mla", [False, True], ids=["llama3_8b", "deepseek_mla"])
def test_cuda_graph_capture_and_replay(mla):
    """A real torch.cuda.CUDAGraph of one decode layer, replayed with other lengths and a padded batch."""
    bs, dtype = 8, torch.bfloat16
    if mla:
        hq, hkv, dk, dv = 16, 1, 576, 512
        h = Harness(hq=hq, page_size=1, dtype=dtype, device="cuda", mla=(dv, dk - dv), num_pages=2048,
                    num_kv_splits=8)
        layer = RadixAttention(hq, dk, dk**-0.5, 1, layer_id=1, v_head_dim=dv)
    else:
        hq, hkv, dk = 32, 8, 128
        dv = dk
        h = Harness(hq=hq, hkv=hkv, head_dim=dk, page_size=16, dtype=dtype, device="cuda", num_pages=256,
                    num_kv_splits=8)
        layer = RadixAttention(hq, dk, dk**-0.5, hkv, layer_id=1)
    backend = h.triton
    names = [f"r{i}" for i in range(6)]
    fb = h.batch(EXTEND, names, [1, 17, 300, 64, 5, 999 if mla else 1000])
    backend.init_forward_metadata(fb)
    kv = h.randn(fb.num_tokens, hkv * dk)  # MLA: the row [latent | rope] is the key; v is ignored
    backend.forward(h.randn(fb.num_tokens, hq * dk), kv, kv[:, :dv] if mla else h.randn(fb.num_tokens, hkv * dv),
                    layer, fb)

    backend.init_cuda_graph_state(max_bs=bs)
    static_rows = torch.full((bs,), h.padding_row, dtype=torch.long, device="cuda")
    static_lens = torch.ones(bs, dtype=torch.long, device="cuda")
    static_loc = torch.zeros(bs, dtype=torch.long, device="cuda")
    static_q, static_k = torch.zeros(bs, hq * dk, dtype=dtype, device="cuda"), torch.zeros(bs, hkv * dk, dtype=dtype,
                                                                                           device="cuda")
    static_v = static_k[:, :dv] if mla else torch.zeros(bs, hkv * dv, dtype=dtype, device="cuda")
    sfb = ForwardBatch(
        forward_mode=DECODE, batch_size=bs, input_ids=torch.zeros(bs, dtype=torch.long, device="cuda"),
        positions=static_lens - 1, out_cache_loc=static_loc, req_pool_indices=static_rows, seq_lens=static_lens,
        seq_lens_cpu=[1] * bs, extend_seq_lens_cpu=[1] * bs, extend_prefix_lens_cpu=[0] * bs,
        req_to_token_pool=h.req_to_token_pool, token_to_kv_pool=h.kv_pool, attn_backend=backend)
    backend.init_forward_metadata_capture_cuda_graph(bs, static_rows, static_lens)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile the kernels outside the capture
        backend.forward(static_q, static_k, static_v, layer, sfb)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = backend.forward(static_q, static_k, static_v, layer, sfb)

    for chosen in (names, ["r5", "r0", "r2"]):
        real = h.batch(DECODE, chosen, [1] * len(chosen))
        n = len(chosen)
        static_rows.fill_(h.padding_row)
        static_lens.fill_(backend.get_cuda_graph_seq_len_fill_value())
        static_loc.zero_()
        static_rows[:n], static_lens[:n], static_loc[:n] = real.req_pool_indices, real.seq_lens, real.out_cache_loc
        static_q.copy_(h.randn(bs, hq * dk))
        static_k.copy_(h.randn(bs, hkv * dk))
        if not mla:
            static_v.copy_(h.randn(bs, hkv * dv))
        backend.init_forward_metadata_replay_cuda_graph(bs, static_rows, static_lens, static_lens.tolist())
        graph.replay()
        h.native.init_forward_metadata(real)
        want = h.native.forward(static_q[:n].float(), None, None, layer, real, save_kv_cache=False)
        assert_matches(static_out[:n], want, f"graph replay {dict(zip(chosen, real.seq_lens_cpu))}")
