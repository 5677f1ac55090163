"""Which backend runs a pass (CPU): the hybrid prefill/decode backend, the model runner's
backend and CUDA-graph wiring, and the CUDA-graph batch-size grid."""

from __future__ import annotations

import json

import pytest
import torch
from test_model_llama import MiniRunner

from hiserve.engine.cuda_graph_runner import capture_batch_sizes
from hiserve.engine.model_runner import ModelRunner
from hiserve.hardware import Platform
from hiserve.layers.attention.base import RadixAttention
from hiserve.layers.attention.cpu_backend import CpuPagedAttnBackend
from hiserve.layers.attention.hybrid_backend import HybridAttnBackend
from hiserve.layers.attention.mla import MLAAttention
from hiserve.layers.attention.torch_native import TorchNativeAttnBackend
from hiserve.layers.forward_batch import ForwardMode
from hiserve.mem_cache.allocator import ReqToTokenPool, TokenToKVPoolAllocator
from hiserve.mem_cache.memory_pool import MLATokenToKVPool
from hiserve.models.llama import LlamaForCausalLM
from hiserve.models.model_config import ModelConfig
from hiserve.server_args import ServerArgs


class NoForwardMLA(TorchNativeAttnBackend):
    """A backend with only the plain `forward` (as the MQA route for MLA expects)."""

    forward_mla = None


def test_hybrid_runs_each_pass_on_one_side():
    torch.manual_seed(0)
    hq, hkv, d = 4, 2, 16
    layer = RadixAttention(hq, d, d**-0.5, hkv, layer_id=0)
    runner = MiniRunner(None, hkv, d, 1, torch.float32, pool_size=256)
    prefill, decode = TorchNativeAttnBackend(), TorchNativeAttnBackend()
    runner.backend = HybridAttnBackend(prefill, decode)
    assert runner.backend.supports_cuda_graph is False

    for mode, lens, used, unused in [(ForwardMode.EXTEND, [5, 3], prefill, decode),
                                     (ForwardMode.DECODE, [1, 1], decode, prefill)]:
        fb = runner.make_batch(mode, ["a", "b"], [[0] * n for n in lens])
        for b in (prefill, decode):
            b._extend = b._decode = None
        runner.backend.init_forward_metadata(fb)
        assert (used._decode if mode.is_decode() else used._extend) is not None
        assert unused._extend is None and unused._decode is None
        t = sum(lens)
        q, k, v = torch.randn(t, hq * d), torch.randn(t, hkv * d), torch.randn(t, hkv * d)
        out = layer(q, k, v, fb)  # through the hybrid
        torch.testing.assert_close(out, used.forward(q, k, v, layer, fb, save_kv_cache=False), rtol=0, atol=0)


def test_hybrid_mla_uses_the_mqa_route_for_a_backend_without_forward_mla():
    torch.manual_seed(0)
    r, rope, nope, v_dim, heads = 32, 16, 32, 32, 4
    layer = MLAAttention(heads, nope, rope, v_dim, r, 0.3, layer_id=0,
                         kv_b_proj=torch.nn.Linear(r, heads * (nope + v_dim), bias=False))
    runner = MiniRunner(None, 1, 16, 1, torch.float32, pool_size=256)
    runner.req_to_token_pool = ReqToTokenPool(16, 512, "cpu")
    runner.kv_pool = MLATokenToKVPool(256, 1, torch.float32, r, rope, 1, "cpu")
    runner.allocator = TokenToKVPoolAllocator(256, 1, "cpu", runner.kv_pool)
    reference = TorchNativeAttnBackend()
    hybrid = HybridAttnBackend(TorchNativeAttnBackend(), NoForwardMLA())
    for mode, lens in [(ForwardMode.EXTEND, [6, 2]), (ForwardMode.DECODE, [1, 1])]:
        runner.backend = hybrid
        fb = runner.make_batch(mode, ["a", "b"], [[0] * n for n in lens])
        t = sum(lens)
        q_nope, q_rope = torch.randn(t, heads, nope), torch.randn(t, heads, rope)
        latent, k_rope = torch.randn(t, r), torch.randn(t, rope)
        hybrid.init_forward_metadata(fb)
        out = layer(q_nope, q_rope, latent, k_rope, fb)
        reference.init_forward_metadata(fb)
        expected = reference.forward_mla(q_nope, q_rope, latent, k_rope, layer, fb, save_kv_cache=False)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("max_bs, expected", [
    (1, [1]),
    (3, [1, 2, 3]),
    (8, [1, 2, 4, 8]),
    (20, [1, 2, 4, 8, 16, 20]),
    (160, [1, 2, 4, 8, *range(16, 129, 8), 144, 160]),
    (170, [1, 2, 4, 8, *range(16, 129, 8), 144, 160, 170]),
])
def test_capture_batch_sizes(max_bs, expected):
    assert capture_batch_sizes(max_bs) == expected


def test_capture_batch_sizes_rejects_zero():
    with pytest.raises(ValueError):
        capture_batch_sizes(0)


def test_model_runner_on_cpu_has_no_graphs(tmp_path):
    hf = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 1,
          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100,
          "max_position_embeddings": 256}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    config = ModelConfig.from_hf_config(hf)
    args = ServerArgs(model_path=str(tmp_path), dtype="float32", max_total_tokens=256,
                      max_running_requests=4).resolve(platform=Platform("cpu"))
    runner = ModelRunner(args, model=(LlamaForCausalLM(config, torch.float32), config))
    assert isinstance(runner.attn_backend, CpuPagedAttnBackend)  # the CPU default
    assert runner.cuda_graph_runner is None
    assert runner.req_to_token_pool.padding_row == 4
