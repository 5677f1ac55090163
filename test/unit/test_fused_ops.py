"""Fused Triton RMSNorm / rotary / SiluAndMul against their torch references.

Without a GPU the kernels run in Triton's interpreter on CPU float32 tensors (see
triton_interpret.py); with one, the same tests run compiled on CUDA in float32, and the
`cuda`-marked tests add bf16 at Llama-3-8B shapes and the layers' dispatch. The model
tests run a small random Llama and DeepSeek-V2 (interleaved and NeoX rope) with the fused
ops and with the torch path and compare the logits; on CPU they force the dispatch into
the interpreter, so the layers' wiring is covered without a GPU too.
"""

from __future__ import annotations

import pytest
import torch
from triton_interpret import DEVICE, INTERPRET

from hiserve.layers import triton_ops
from hiserve.layers.activations import SiluAndMul, silu_and_mul_reference
from hiserve.layers.norms import RMSNorm, rmsnorm_reference
from hiserve.layers.rotary import RotaryEmbedding, rotary_reference
from hiserve.layers.triton_ops.activation import silu_and_mul
from hiserve.layers.triton_ops.rmsnorm import fused_add_rmsnorm, rmsnorm
from hiserve.layers.triton_ops.rotary import rotary_embedding

FP32_TOL = dict(atol=2e-5, rtol=2e-5)
BF16_TOL = dict(atol=2e-2, rtol=2e-2)  # a bf16 ulp or two: fp32 noise can flip a rounding; bugs are O(1)
cuda_only = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def randn(*shape, dtype=torch.float32, device=DEVICE, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


# ----------------------------------------------------------------------- rmsnorm
@pytest.mark.parametrize("t", [1, 3, 7])
@pytest.mark.parametrize("h", [64, 576, 1536])
def test_rmsnorm_matches_reference(t, h):
    x, res, w = randn(t, h, seed=1), randn(t, h, seed=2), 1 + 0.1 * randn(h, seed=3)
    torch.testing.assert_close(rmsnorm(x, w, 1e-6), rmsnorm_reference(x, w, 1e-6), **FP32_TOL)
    normed, new_res = fused_add_rmsnorm(x, res, w, 1e-5)
    torch.testing.assert_close(new_res, x + res, atol=0, rtol=0)
    torch.testing.assert_close(normed, rmsnorm_reference(x + res, w, 1e-5), **FP32_TOL)


def test_rmsnorm_strided_rows_and_leading_dims():
    # DeepSeek normalizes the latent columns of a wider projection: a row-strided view.
    wide, w = randn(5, 576 + 64), 1 + 0.1 * randn(576, seed=4)
    latent = wide[:, :576]
    torch.testing.assert_close(rmsnorm(latent, w, 1e-6), rmsnorm_reference(latent, w, 1e-6), **FP32_TOL)
    x3 = randn(2, 3, 96)
    torch.testing.assert_close(rmsnorm(x3, w[:96], 1e-6), rmsnorm_reference(x3, w[:96], 1e-6), **FP32_TOL)


def test_rmsnorm_bad_args():
    x, w = randn(2, 8), randn(8)
    with pytest.raises(ValueError):
        rmsnorm(x, randn(7), 1e-6)
    with pytest.raises(ValueError):
        fused_add_rmsnorm(x, randn(2, 9), w, 1e-6)
    with pytest.raises(ValueError):
        fused_add_rmsnorm(x, x.double(), w, 1e-6)
    with pytest.raises(ValueError):
        rmsnorm(torch.ones(2, 8, dtype=torch.int32, device=DEVICE), w, 1e-6)


# ------------------------------------------------------------------------ rotary
def qk_view(t, hq, hkv, d, seed=0):
    """Llama's layout: the q|k columns of a fused qkv output, seen as [T, Hq + Hkv, D]."""
    qkv = randn(t, (hq + 2 * hkv) * d, seed=seed)
    return qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d)


@pytest.mark.parametrize("t", [1, 5, 33])
def test_rotary_llama3_config(t):
    rope = RotaryEmbedding(128, 4096, 500000.0, LLAMA3_SCALING).to(DEVICE)
    positions = torch.randint(0, 4096, (t,), generator=torch.Generator().manual_seed(t)).to(DEVICE)
    cs = rope.get_cos_sin(positions)
    x = qk_view(t, 32, 8, 128)
    torch.testing.assert_close(rotary_embedding(x, cs[0], cs[1], 128), rotary_reference(x, cs, 128), **FP32_TOL)


@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 32), (96, 64), (80, 80), (48, 16)])
def test_rotary_partial_and_odd_dims(head_dim, rotary_dim):
    rope = RotaryEmbedding(head_dim, 64, 10000.0, rotary_dim=rotary_dim).to(DEVICE)
    cs = rope.get_cos_sin(torch.tensor([0, 3, 63], device=DEVICE))
    x = qk_view(3, 6, 3, head_dim)
    got = rotary_embedding(x, cs[0], cs[1], rotary_dim)
    torch.testing.assert_close(got, rotary_reference(x, cs, rotary_dim), **FP32_TOL)
    torch.testing.assert_close(got[..., rotary_dim:], x[..., rotary_dim:], atol=0, rtol=0)


def test_rotary_interleaved_matches_deepseek():
    from hiserve.models.deepseek_v2 import DeepseekRotaryEmbedding

    rope = DeepseekRotaryEmbedding(64, 256, 10000.0, None, interleaved=True).to(DEVICE)
    cs = rope.get_cos_sin(torch.tensor([1, 2, 200, 7], device=DEVICE))
    q = randn(4, 16, 128 + 64)[..., 128:]  # q_rope: the tail of each head
    with _dispatch(False):
        want = rope.apply(q, cs)
    torch.testing.assert_close(rotary_embedding(q, cs[0], cs[1], 64, interleaved=True), want, **FP32_TOL)


def test_rotary_bad_args():
    x = randn(2, 3, 16)
    cos = sin = randn(2, 1, 8)
    with pytest.raises(ValueError):
        rotary_embedding(x, cos, sin, 15)
    with pytest.raises(ValueError):
        rotary_embedding(x, cos, sin, 32)
    with pytest.raises(ValueError):
        rotary_embedding(x, randn(3, 1, 8), sin, 16)
    with pytest.raises(ValueError):
        rotary_embedding(x.view(2, 48), cos, sin, 16)


# ------------------------------------------------------------------ silu and mul
@pytest.mark.parametrize("t", [1, 4, 9])
@pytest.mark.parametrize("inter", [64, 1000, 1536])
def test_silu_and_mul_matches_reference(t, inter):
    x = 3 * randn(t, 2 * inter, seed=t)
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_reference(x), **FP32_TOL)


def test_silu_and_mul_bad_args():
    with pytest.raises(ValueError):
        silu_and_mul(randn(2, 7))
    with pytest.raises(ValueError):
        silu_and_mul(torch.ones(2, 8, dtype=torch.int64, device=DEVICE))


# -------------------------------------------------------------------- dispatch
class _dispatch:
    """Force the layers' choice: True -> fused kernels (on CPU: the interpreter), False -> torch."""

    def __init__(self, fused: bool):
        self.fused = fused

    def __enter__(self):
        self.saved = triton_ops.use_triton
        triton_ops.use_triton = lambda x: self.fused

    def __exit__(self, *exc):
        triton_ops.use_triton = self.saved


def test_cpu_tensors_take_the_torch_path(monkeypatch):
    assert not triton_ops.use_triton(torch.ones(1))
    monkeypatch.setattr(triton_ops, "ENABLED", False)
    assert not triton_ops.use_triton(torch.ones(1, device=DEVICE))


# --------------------------------------------------------- bf16 on CUDA, 8B shapes
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("t", [1, 17, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_layers_low_precision(t, dtype):
    """The layers on CUDA (dispatching to the kernels) against their torch references."""
    assert triton_ops.use_triton(torch.ones(1, device="cuda"))
    h, hq, hkv, d, inter = 4096, 32, 8, 128, 14336
    norm = RMSNorm(h, 1e-5, dtype).cuda()
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * randn(h, device="cuda"))
    x, res = randn(t, h, dtype=dtype, device="cuda", seed=1), randn(t, h, dtype=dtype, device="cuda", seed=2)
    normed, new_res = norm(x, res)
    torch.testing.assert_close(new_res, x + res, atol=0, rtol=0)  # same rounding of the sum
    torch.testing.assert_close(normed, rmsnorm_reference(x + res, norm.weight, 1e-5), **BF16_TOL)
    torch.testing.assert_close(norm(x), rmsnorm_reference(x, norm.weight, 1e-5), **BF16_TOL)

    rope = RotaryEmbedding(d, 8192, 500000.0, LLAMA3_SCALING).cuda()
    cs = rope.get_cos_sin(torch.randint(0, 8192, (t,), device="cuda"))
    qkv = randn(t, (hq + 2 * hkv) * d, dtype=dtype, device="cuda")
    qk = qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d)
    torch.testing.assert_close(rope.apply(qk, cs), rotary_reference(qk, cs, d), **BF16_TOL)

    gate_up = 3 * randn(t, 2 * inter, dtype=dtype, device="cuda")
    torch.testing.assert_close(SiluAndMul()(gate_up), silu_and_mul_reference(gate_up), **BF16_TOL)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_graph_capture_and_replay():
    """The three kernels captured in one CUDA graph replay the eager result on new inputs."""
    h, d = 1024, 128
    norm, rope, act = RMSNorm(h, 1e-5, torch.bfloat16).cuda(), RotaryEmbedding(d, 512, 1e4).cuda(), SiluAndMul()
    x = randn(4, h, dtype=torch.bfloat16, device="cuda")
    res = randn(4, h, dtype=torch.bfloat16, device="cuda", seed=1)
    pos = torch.arange(4, device="cuda")

    def step():
        n, r = norm(x, res)
        q = rope.apply(n.view(4, h // d, d), rope.get_cos_sin(pos))
        return act(q.reshape(4, h)), r

    torch.cuda.synchronize()
    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    x.copy_(randn(4, h, dtype=torch.bfloat16, device="cuda", seed=5))
    pos.copy_(torch.tensor([9, 100, 3, 511], device="cuda"))
    graph.replay()
    want = step()
    torch.testing.assert_close(out[0], want[0], atol=0, rtol=0)
    torch.testing.assert_close(out[1], want[1], atol=0, rtol=0)


# ------------------------------------------------------------------ whole models
LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 192, "num_hidden_layers": 2,
         "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 320,
         "vocab_size": 300, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_scaling": None}
DEEPSEEK = {"architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 300, "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "kv_lora_rank": 32,
            "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32, "max_position_embeddings": 256,
            "q_lora_rank": 24, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "first_k_dense_replace": 1, "rms_norm_eps": 1e-6}
MODELS = {"llama": LLAMA, "deepseek_interleaved": DEEPSEEK,
          "deepseek_neox": {**DEEPSEEK, "architectures": ["DeepseekV3ForCausalLM"], "rope_interleave": False,
                            "n_group": 2, "topk_group": 1}}


def build_model(hf: dict, dtype: torch.dtype, device: str):
    from hiserve.models.deepseek_v2 import DeepseekV2ForCausalLM
    from hiserve.models.llama import LlamaForCausalLM
    from hiserve.models.model_config import ModelConfig

    config = ModelConfig.from_hf_config(hf)
    cls = LlamaForCausalLM if hf["architectures"][0].startswith("Llama") else DeepseekV2ForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(config, dtype).eval()
    with torch.no_grad():  # every weight set (some layers allocate uninitialized ones)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # off 1, so the weight multiply is exercised
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif "embed" in name or "lm_head" in name or p.dim() < 2:
                p.normal_(0, 1)
            else:
                p.normal_(0, p.shape[-1] ** -0.5)
    return model, config


def prefill_then_decode(model, config, dtype, device) -> torch.Tensor:
    """Logits of a 2-request prefill (lengths 5 and 3) then one decode step: [4, vocab]."""
    from hiserve.layers.attention.torch_native import TorchNativeAttnBackend
    from hiserve.layers.forward_batch import ForwardBatch, ForwardMode
    from hiserve.mem_cache.allocator import ReqToTokenPool
    from hiserve.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    layers = config.num_hidden_layers
    if config.kv_lora_rank:
        kv = MLATokenToKVPool(64, 1, dtype, config.kv_lora_rank, config.qk_rope_head_dim, layers, device)
    else:
        kv = MHATokenToKVPool(64, 1, dtype, config.num_key_value_heads, config.head_dim, layers, device)
    req = ReqToTokenPool(2, 32, device)
    backend, gen = TorchNativeAttnBackend(), torch.Generator().manual_seed(1)
    out, lens, slot = [], [0, 0], 1

    def step(mode, new):
        nonlocal slot
        ids = torch.randint(0, config.vocab_size, (sum(new),), generator=gen)
        locs = torch.arange(slot, slot + sum(new))
        slot += sum(new)
        pos, off = [], 0
        for r, n in enumerate(new):
            req.req_to_token[r, lens[r]: lens[r] + n] = locs[off: off + n].to(device, req.req_to_token.dtype)
            pos.append(torch.arange(lens[r], lens[r] + n))
            off, lens[r] = off + n, lens[r] + n
        fb = ForwardBatch(
            forward_mode=mode, batch_size=2, input_ids=ids.to(device), positions=torch.cat(pos).to(device),
            out_cache_loc=locs.to(device), req_pool_indices=torch.tensor([0, 1], device=device),
            seq_lens=torch.tensor(lens, device=device), seq_lens_cpu=list(lens), extend_seq_lens_cpu=list(new),
            extend_prefix_lens_cpu=[a - b for a, b in zip(lens, new)], req_to_token_pool=req,
            token_to_kv_pool=kv, attn_backend=backend)
        backend.init_forward_metadata(fb)
        with torch.no_grad():
            out.append(model(fb).float())

    step(ForwardMode.EXTEND, [5, 3])
    step(ForwardMode.DECODE, [1, 1])
    return torch.cat(out)


MODEL_DTYPES = [torch.float32] if INTERPRET else [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("dtype", MODEL_DTYPES)
def test_model_logits_fused_vs_torch(name, dtype):
    """Same random model, fused ops vs the torch path. On CPU the fused side runs in the
    interpreter (dispatch forced); on CUDA it is the real dispatch."""
    model, config = build_model(MODELS[name], dtype, DEVICE)
    with _dispatch(False):
        want = prefill_then_decode(model, config, dtype, DEVICE)
    if INTERPRET:
        with _dispatch(True):
            got = prefill_then_decode(model, config, dtype, DEVICE)
    else:
        assert triton_ops.use_triton(torch.ones(1, device=DEVICE)), "fused ops disabled (HISERVE_FUSED_OPS=0?)"
        got = prefill_then_decode(model, config, dtype, DEVICE)
    assert want.shape == (4, config.vocab_size) and torch.isfinite(want).all()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    else:  # bf16: a last-bit difference in one layer may round the next differently
        rel = (got - want).norm() / want.norm()
        assert rel < 2e-2, f"relative logits error {rel:.3g}"
