"""DeepSeek-V2/V3 (MLA) model against transformers, on small random float32 models.

- MLA attention alone (expanded / absorbed / MQA-through-`forward` forms) vs a naive
  float64 attention over per-head keys and values up-projected from the latent.
- Whole models (dense; q LoRA + MoE; YaRN + group-limited routing; V3 sigmoid routing,
  both rope layouts) vs `transformers` logits: a full prefill, then prefix -> extend ->
  batched decode of ragged requests, with the real request/KV pools (MLA pool).
- An HF folder (config.json + model.safetensors) served by the real Scheduler: greedy
  tokens equal transformers' greedy continuation, including a radix-cache prefix hit.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from test_model_llama import MiniRunner

from hiserve.layers.attention.mla import MLAAttention, forward_mla_as_mqa
from hiserve.layers.attention.torch_native import TorchNativeAttnBackend
from hiserve.layers.attention.torch_native_mla import forward_mla
from hiserve.layers.forward_batch import ForwardMode
from hiserve.mem_cache.allocator import ReqToTokenPool, TokenToKVPoolAllocator
from hiserve.mem_cache.memory_pool import MLATokenToKVPool
from hiserve.models import loader
from hiserve.models.deepseek_v2 import DeepseekV2ForCausalLM
from hiserve.models.model_config import ModelConfig

R, ROPE, NOPE, V, HEADS = 32, 16, 32, 32, 4  # kv_lora_rank, qk_rope/nope_head_dim, v_head_dim


class MLAMiniRunner(MiniRunner):
    """The Llama test's harness (ForwardBatch construction) over an MLA pool."""

    def __init__(self, model, num_layers, dtype=torch.float32, pool_size=1024):
        self.model = model
        self.req_to_token_pool = ReqToTokenPool(16, 512, "cpu")
        self.kv_pool = MLATokenToKVPool(pool_size, 1, dtype, R, ROPE, num_layers, "cpu")
        self.allocator = TokenToKVPoolAllocator(pool_size, 1, "cpu", self.kv_pool)
        self.backend = TorchNativeAttnBackend()
        self.rows: dict[str, int] = {}
        self.lens: dict[str, int] = {}


# ------------------------------------------------------------ attention alone
def naive_mla(q_nope, q_rope, latent, k_rope, w_kv, scaling):
    """Last n positions of a context: q_* [n, H, .], latent [S, R], k_rope [S, ROPE]; float64 causal."""
    n, h = q_nope.shape[:2]
    s = latent.shape[0]
    kv = torch.einsum("sr,hdr->hsd", latent.double(), w_kv.double())  # [H, S, NOPE + V]
    k = torch.cat([kv[..., :NOPE], k_rope.double().expand(h, s, ROPE)], dim=-1)
    v = kv[..., NOPE:]
    q = torch.cat([q_nope, q_rope], dim=-1).double().transpose(0, 1)  # [H, n, NOPE + ROPE]
    scores = q @ k.transpose(1, 2) * scaling  # [H, n, S]
    pos = torch.arange(s - n, s).view(-1, 1)
    scores = scores.masked_fill(torch.arange(s).view(1, -1) > pos, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)  # [n, H, V]


def test_mla_attention_forms_match_naive():
    torch.manual_seed(0)
    kv_b = torch.nn.Linear(R, HEADS * (NOPE + V), bias=False)
    layer = MLAAttention(HEADS, NOPE, ROPE, V, R, 0.3, layer_id=1, kv_b_proj=kv_b)
    runner = MLAMiniRunner(None, 2, pool_size=256)
    names = ["a", "b", "c"]
    history = {n: ([], []) for n in names}  # per request: latent and k_rope chunks

    def run(mode, lens):
        fb = runner.make_batch(mode, names, [[0] * n for n in lens])
        runner.backend.init_forward_metadata(fb)
        t = sum(lens)
        q_nope, q_rope = torch.randn(t, HEADS, NOPE), torch.randn(t, HEADS, ROPE)
        latent, k_rope = torch.randn(t, R), torch.randn(t, ROPE)
        outs = {
            "native": layer(q_nope, q_rope, latent, k_rope, fb),  # dispatches to backend.forward_mla
            "extend_absorbed": forward_mla(runner.backend, q_nope, q_rope, latent, k_rope, layer, fb,
                                           extend_absorbed=True),
            "mqa": forward_mla_as_mqa(runner.backend, q_nope, q_rope, latent, k_rope, layer, fb),
        }
        # Only [latent | k_rope] is cached, at out_cache_loc.
        row = runner.kv_pool.get_key_buffer(1)[fb.out_cache_loc, 0]
        assert torch.equal(row, torch.cat([latent, k_rope], -1))
        off = 0
        for name, n in zip(names, lens):
            history[name][0].append(latent[off : off + n])
            history[name][1].append(k_rope[off : off + n])
            ref = naive_mla(q_nope[off : off + n], q_rope[off : off + n], torch.cat(history[name][0]),
                            torch.cat(history[name][1]), layer.w_kv, layer.scaling)
            for form, out in outs.items():
                assert out.shape == (t, HEADS * V)
                got = out[off : off + n].view(n, HEADS, V).double()
                torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5, msg=lambda m: f"{form}: {m}")
            off += n

    run(ForwardMode.EXTEND, [5, 1, 7])  # prefill
    run(ForwardMode.EXTEND, [3, 4, 2])  # extend on a cached prefix
    for _ in range(2):
        run(ForwardMode.DECODE, [1, 1, 1])  # ragged lengths


# ------------------------------------------------------------ the whole model
BASE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_attention_heads=HEADS, kv_lora_rank=R,
    qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE, v_head_dim=V, max_position_embeddings=256,
    initializer_range=0.1, q_lora_rank=None,
)
MOE = dict(n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
           first_k_dense_replace=1)
VARIANTS = {
    "dense_tied": ("v2", dict(num_hidden_layers=2, first_k_dense_replace=2, tie_word_embeddings=True)),
    "qlora_moe": ("v2", dict(num_hidden_layers=3, q_lora_rank=24, **MOE)),
    "yarn_grouped": ("v2", dict(
        num_hidden_layers=2, **MOE, topk_method="group_limited_greedy", n_group=2, topk_group=1,
        routed_scaling_factor=1.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.8,
                         "beta_fast": 32, "beta_slow": 1})),
    "v3": ("v3", dict(num_hidden_layers=3, q_lora_rank=24, **MOE, n_group=2, topk_group=1,
                      norm_topk_prob=True, routed_scaling_factor=2.5)),
    "v3_neox": ("v3", dict(num_hidden_layers=2, **MOE, n_group=2, topk_group=1, rope_interleave=False)),
}


def build_hf(kind: str, overrides: dict, seed: int = 0):
    """A random transformers model; norms and V3's routing bias perturbed so they matter."""
    if kind == "v2":
        cfg = transformers.DeepseekV2Config(**{**BASE, **overrides})
        cls = transformers.DeepseekV2ForCausalLM
    else:
        cfg = transformers.DeepseekV3Config(**{**BASE, **overrides})
        cls = transformers.DeepseekV3ForCausalLM
    torch.manual_seed(seed)
    hf = cls(cfg).float().eval()
    with torch.no_grad():
        for name, t in hf.state_dict().items():
            if name.endswith("norm.weight"):
                t.add_(0.2 * torch.randn_like(t))
            elif name.endswith("e_score_correction_bias"):
                t.copy_(0.5 * torch.randn_like(t))
    return hf


def build_ours(hf) -> DeepseekV2ForCausalLM:
    config = ModelConfig.from_hf_config(hf.config.to_dict())
    model = DeepseekV2ForCausalLM(config, torch.float32)
    model.load_weights(hf.state_dict().items())
    return model.eval()


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request):
    kind, overrides = VARIANTS[request.param]
    hf = build_hf(kind, overrides)
    return hf, build_ours(hf)


def hf_last_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].float()


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor):
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    assert ours.argmax().item() == ref.argmax().item()


def test_config_from_hf():
    hf = build_hf("v3", VARIANTS["v3"][1])
    cfg = ModelConfig.from_hf_config(hf.config.to_dict())
    assert cfg.architecture == "DeepseekV3ForCausalLM"
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.q_lora_rank) == (
        R, ROPE, NOPE, V, 24)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group) == (4, 2, 2, 1)
    assert cfg.topk_method == "noaux_tc" and cfg.scoring_func == "sigmoid" and cfg.norm_topk_prob
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, True, True]
    ours = build_ours(hf)
    assert type(ours.model.layers[0].mlp).__name__ == "DeepseekV2MLP"
    assert type(ours.model.layers[1].mlp).__name__ == "DeepseekV2MoE"


def test_prefill_matches_transformers(pair):
    hf, model = pair
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (19,)).tolist()
    runner = MLAMiniRunner(model, model.config.num_hidden_layers)
    logits = runner.forward(ForwardMode.EXTEND, ["p"], [ids])
    assert logits.shape == (1, 256) and logits.dtype == torch.float32
    assert_logits_close(logits[0], hf_last_logits(hf, ids))


def test_prefix_extend_then_batched_decode_matches_transformers(pair):
    hf, model = pair
    torch.manual_seed(2)
    prompts = {n: torch.randint(0, 256, (k,)).tolist() for n, k in (("a", 14), ("b", 9), ("c", 4))}
    names = list(prompts)
    runner = MLAMiniRunner(model, model.config.num_hidden_layers)
    cut = {"a": 8, "b": 3, "c": 1}
    runner.forward(ForwardMode.EXTEND, names, [prompts[n][: cut[n]] for n in names])
    logits = runner.forward(ForwardMode.EXTEND, names, [prompts[n][cut[n] :] for n in names])
    seqs = {n: list(prompts[n]) for n in names}
    for i, n in enumerate(names):
        assert_logits_close(logits[i], hf_last_logits(hf, seqs[n]))
    for _ in range(3):  # greedy decode, all requests in one batch
        next_ids = logits.argmax(-1).tolist()
        for n, t in zip(names, next_ids):
            seqs[n].append(t)
        logits = runner.forward(ForwardMode.DECODE, names, [[t] for t in next_ids])
        for i, n in enumerate(names):
            assert_logits_close(logits[i], hf_last_logits(hf, seqs[n]))
    # One request leaves; the others, reordered, keep decoding correctly.
    next_ids = logits.argmax(-1).tolist()
    seqs["c"].append(next_ids[2])
    seqs["a"].append(next_ids[0])
    logits = runner.forward(ForwardMode.DECODE, ["c", "a"], [[next_ids[2]], [next_ids[0]]])
    assert_logits_close(logits[0], hf_last_logits(hf, seqs["c"]))
    assert_logits_close(logits[1], hf_last_logits(hf, seqs["a"]))


# ---------------------------------------------------------------- serving
def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    ids, out = list(ids), []
    for _ in range(n):
        out.append(int(hf_last_logits(hf, ids).argmax()))
        ids.append(out[-1])
    return out


def test_engine_serves_hf_folder(tmp_path):
    from test_scheduler import run_all, submit

    from hiserve.engine.scheduler import Scheduler
    from hiserve.server_args import ServerArgs

    tokenizer_path = loader.default_model_path()
    assert tokenizer_path is not None, loader.DEFAULT_MODEL_INSTALL
    hf = build_hf("v2", VARIANTS["qlora_moe"][1], seed=3)
    hf.save_pretrained(tmp_path)  # routed experts saved one by one (checkpoint layout)

    # The loader's HF-folder path gives the same weights as the in-memory state dict.
    model, config = loader.load_model(str(tmp_path), torch.float32, "cpu")
    reference = build_ours(hf).state_dict()
    assert config.architecture == "DeepseekV2ForCausalLM" and config.n_routed_experts == 4
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, reference[name]), name

    args = ServerArgs(model_path=str(tmp_path), tokenizer_path=tokenizer_path, dtype="float32", device="cpu",
                      max_total_tokens=1024, max_running_requests=8, chunked_prefill_size=-1).resolve()
    sched = Scheduler(args, None)
    assert isinstance(sched.model_runner.token_to_kv_pool, MLATokenToKVPool)
    torch.manual_seed(4)
    first = torch.randint(3, 256, (12,)).tolist()
    prompts = {"r0": first, "r1": first[:8] + torch.randint(3, 256, (5,)).tolist(),  # shares a cached prefix
               "r2": torch.randint(3, 256, (6,)).tolist()}
    submit(sched, "r0", prompts["r0"], max_new=6)
    outs = run_all(sched)
    submit(sched, "r1", prompts["r1"], max_new=6)
    submit(sched, "r2", prompts["r2"], max_new=6)
    prefix_lens, decode_sizes = [], []

    def on_step(_, batch):
        if batch is not None and batch.forward_mode.is_extend():
            prefix_lens.extend(batch.extend_prefix_lens_cpu)
        elif batch is not None:
            decode_sizes.append(batch.batch_size)

    outs.update(run_all(sched, on_step))
    assert max(prefix_lens) >= 8, prefix_lens  # r1 extends r0's cached prefix
    assert max(decode_sizes) == 2  # r1 and r2 decode in one batch
    for rid, ids in prompts.items():
        assert outs[rid][0] == hf_greedy(hf, ids, 6), rid
    sched.kv.check_integrity()
    assert sched.flush_cache()
    assert sched.kv.allocator.available_size() == sched.max_total_num_tokens


def test_bfloat16_close_to_float32():
    hf = build_hf("v2", VARIANTS["qlora_moe"][1])
    config = ModelConfig.from_hf_config(hf.config.to_dict())
    torch.manual_seed(5)
    ids = torch.randint(0, 256, (12,)).tolist()
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = DeepseekV2ForCausalLM(config, dtype)
        model.load_weights((n, t.to(dtype)) for n, t in hf.state_dict().items())
        runner = MLAMiniRunner(model, config.num_hidden_layers, dtype)
        runner.forward(ForwardMode.EXTEND, ["p"], [ids[:-4]])
        runner.forward(ForwardMode.EXTEND, ["p"], [ids[-4:-1]])
        out[dtype] = runner.forward(ForwardMode.DECODE, ["p"], [ids[-1:]])[0]
    assert out[torch.bfloat16].dtype == torch.float32
    cos = torch.nn.functional.cosine_similarity(out[torch.bfloat16], out[torch.float32], dim=0).item()
    assert cos > 0.99, cos
