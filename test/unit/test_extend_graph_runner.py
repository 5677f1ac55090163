"""The extend-graph runner's own work on CPU: its static buffers, the padding request, the
static FA3 metadata and the last-token index give the eager pass's logits and K/V, and
leave every other request's K/V alone. (No graph on CPU: `capture=False` runs the model on
the very buffers a captured graph reads. test/jit/test_cuda_graph_runner.py replays real
graphs with FA3 on a Hopper GPU.)
"""

from __future__ import annotations

import pytest
import torch
from paged_pools import Pools

from hiserve.engine.extend_graph_runner import ExtendGraphRunner, extend_graph_buckets
from hiserve.layers.attention.fa3_reference import flash_attn_with_kvcache_reference
from hiserve.layers.attention.flashattention_backend import FlashAttentionBackend
from hiserve.layers.attention.torch_native import TorchNativeAttnBackend
from hiserve.layers.forward_batch import ForwardMode
from hiserve.mem_cache.memory_pool import MHATokenToKVPool
from hiserve.models.llama import LlamaForCausalLM
from hiserve.models.model_config import ModelConfig

DTYPE = torch.bfloat16
HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256,
             "vocab_size": 300, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5}
MAX_TOKENS = 40  # buckets 8, 16, 32, 40


def test_buckets():
    assert extend_graph_buckets(256) == [8, 16, 32, 64, 128, 256]
    assert extend_graph_buckets(40) == [8, 16, 32, 40]
    assert extend_graph_buckets(8) == [8] and extend_graph_buckets(3) == [3]
    with pytest.raises(ValueError, match="max_tokens"):
        extend_graph_buckets(0)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(ModelConfig.from_hf_config(HF_CONFIG), DTYPE).eval()


def setup(model, page_size: int):
    pools = Pools(MHATokenToKVPool(2048, page_size, DTYPE, 2, 32, 2, "cpu"), max_context=1024)
    fa3 = FlashAttentionBackend(pools, kernel=flash_attn_with_kvcache_reference)
    runner = ExtendGraphRunner(model, fa3, pools.req_to_token_pool, pools.token_to_kv_pool, MAX_TOKENS,
                               capture=False)
    return pools, fa3, runner


def eager(model, backend, fb) -> torch.Tensor:
    with torch.inference_mode():
        backend.init_forward_metadata(fb)
        return model.forward(fb)


def batch(pools, fa3, new_lens, gen):
    fb = pools.batch(ForwardMode.EXTEND, new_lens, fa3)
    fb.input_ids = torch.randint(0, HF_CONFIG["vocab_size"], (fb.num_tokens,), generator=gen)
    return fb


@pytest.mark.parametrize("page_size", [1, 16])
def test_padded_static_pass_gives_the_eager_logits_and_kv(model, page_size):
    pools, fa3, runner = setup(model, page_size)
    gen = torch.Generator().manual_seed(page_size)
    eager(model, fa3, batch(pools, fa3, {"a": 37, "b": 20, "c": 5}, gen))  # prefixes
    kv = pools.token_to_kv_pool
    # Growing, then shrinking within a graph (40 then 33 in the 40-bucket; 2 after): rows a
    # longer pass used are padding again and must write the padding page, not old slots.
    for name, t in [("a", 1), ("b", 7), ("a", 8), ("c", 9), ("b", 16), ("a", 31), ("c", 40), ("a", 33),
                    ("b", 2)]:
        fb = batch(pools, fa3, {name: t}, gen)
        assert runner.can_run(fb)
        before = [kv.k_buffer[i].clone() for i in range(2)]
        with torch.inference_mode():
            got = runner.replay(fb).clone()
        got_k = kv.k_buffer[1][fb.out_cache_loc].clone()
        want = eager(model, fa3, fb)  # rewrites the same K/V, then attends as a fresh batch would
        assert got.shape == (1, HF_CONFIG["vocab_size"]) and got.dtype == torch.float32
        # bf16: the padded pass has other GEMM shapes than the eager one
        torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2, msg=lambda m: f"{name} +{t}: {m}")
        torch.testing.assert_close(got_k, kv.k_buffer[1][fb.out_cache_loc], rtol=2e-2, atol=2e-2)
        # The padding request wrote the padding page only: every other row is as it was.
        kept = torch.ones(kv.k_buffer[1].shape[0], dtype=torch.bool)
        kept[fb.out_cache_loc] = False
        kept[:page_size] = False
        for layer in range(2):
            assert torch.equal(kv.k_buffer[layer][kept], before[layer][kept]), f"layer {layer}: K outside the pass changed"


def test_greedy_tokens_equal_torch_native(model):
    """The padded pass against a different backend (torch_native) on the same pools: the
    argmax of each extend's last logits agrees."""
    pools, fa3, runner = setup(model, 16)
    ref = TorchNativeAttnBackend()
    gen = torch.Generator().manual_seed(3)
    eager(model, fa3, batch(pools, fa3, {"a": 50}, gen))
    for t in (3, 12, 25):
        fb = batch(pools, fa3, {"a": t}, gen)
        with torch.inference_mode():
            got = runner.replay(fb).clone()
            ref.init_forward_metadata(fb)
            fb.attn_backend = ref
            want = model.forward(fb)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()


def test_what_runs_eagerly(model):
    pools, fa3, runner = setup(model, 1)
    gen = torch.Generator().manual_seed(2)
    assert not runner.can_run(batch(pools, fa3, {"a": 5, "b": 3}, gen))  # two requests
    assert not runner.can_run(batch(pools, fa3, {"a": MAX_TOKENS + 1}, gen))  # too long
    assert runner.can_run(batch(pools, fa3, {"a": MAX_TOKENS}, gen))
    fb = batch(pools, fa3, {"a": 4}, gen)
    fb.input_logprob_rows = torch.tensor([0, 1])
    assert not runner.can_run(fb)  # prompt logprobs: rows vary per pass
    fb = pools.batch(ForwardMode.DECODE, {"a": 1}, fa3)
    assert not runner.can_run(fb)


def test_refusals(model):
    pools = Pools(MHATokenToKVPool(256, 1, DTYPE, 2, 32, 2, "cpu"))
    fa3 = FlashAttentionBackend(pools, kernel=flash_attn_with_kvcache_reference)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        ExtendGraphRunner(model, fa3, pools.req_to_token_pool, pools.token_to_kv_pool, 16)
    with pytest.raises(ValueError, match="cannot capture EXTEND"):
        ExtendGraphRunner(model, TorchNativeAttnBackend(), pools.req_to_token_pool, pools.token_to_kv_pool, 16,
                          capture=False)
    runner = ExtendGraphRunner(model, fa3, pools.req_to_token_pool, pools.token_to_kv_pool, 16, capture=False)
    with pytest.raises(ValueError, match="does not fit"):
        fa3.init_forward_metadata_replay_extend_graph(9, runner.req_pool_indices[:1], runner.seq_lens[:1], 9, 9)
