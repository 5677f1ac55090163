"""Architecture hyper-parameters of a causal LM, read from an HF `config.json`
or from GGUF metadata, in one normalized shape the models build from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

# GGUF `general.architecture` -> HF architecture class name.
GGUF_ARCH_TO_HF = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "deepseek2": "DeepseekV2ForCausalLM",
}


@dataclass
class ModelConfig:
    architecture: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # Normalized to carry a "rope_type" key ("linear", "llama3", "freq_factors", ...);
    # None means plain RoPE.
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048  # context length
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2-style bias on q/k/v projections
    hidden_act: str = "silu"
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    # MLA (DeepSeek-V2/V3); None for MHA/GQA models.
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None
    q_lora_rank: int | None = None
    # DeepSeek rope layout: True = interleaved pairs (x0,x1),(x2,x3)... (V2, and V3's
    # default `rope_interleave`); False = rotate-half halves.
    rope_interleave: bool = True
    # Mixture of experts (DeepSeek V2/V3); n_routed_experts None means every MLP is dense.
    n_routed_experts: int | None = None
    n_shared_experts: int = 0
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    first_k_dense_replace: int = 0  # layers [0, k) keep a dense MLP
    moe_layer_freq: int = 1  # MoE on layers i >= k with i % freq == 0
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False
    topk_method: str = "greedy"  # greedy | group_limited_greedy | noaux_tc
    scoring_func: str = "softmax"  # softmax | sigmoid
    n_group: int | None = None
    topk_group: int | None = None

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether decoder layer `layer_id`'s MLP is a mixture of experts."""
        return (
            bool(self.n_routed_experts)
            and layer_id >= self.first_k_dense_replace
            and layer_id % max(1, self.moe_layer_freq) == 0
        )

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> "ModelConfig":
        """Build from a parsed HF `config.json` (transformers 4.x or 5.x keys)."""
        archs = cfg.get("architectures") or []
        architecture = archs[0] if archs else _arch_from_model_type(cfg.get("model_type", "llama"))
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads

        # transformers 5 folds rope_theta and rope_scaling into "rope_parameters".
        rope_params = dict(cfg.get("rope_parameters") or {})
        rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        rope_scaling = cfg.get("rope_scaling") or (rope_params or None)

        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])

        default_bias = architecture.startswith("Qwen2")
        return cls(
            architecture=architecture,
            hidden_size=hidden,
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=normalize_rope_scaling(rope_scaling),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", default_bias)),
            hidden_act=cfg.get("hidden_act", "silu"),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            kv_lora_rank=cfg.get("kv_lora_rank"),
            qk_rope_head_dim=cfg.get("qk_rope_head_dim"),
            qk_nope_head_dim=cfg.get("qk_nope_head_dim"),
            v_head_dim=cfg.get("v_head_dim"),
            q_lora_rank=cfg.get("q_lora_rank"),
            **_moe_fields(cfg, architecture),
        )

    @classmethod
    def from_gguf_metadata(
        cls,
        meta: Mapping[str, Any],
        tensor_names: set[str] | None = None,
        rope_freq_factors: list[float] | None = None,
    ) -> "ModelConfig":
        """Build from GGUF key/value metadata (already decoded to Python values).

        `tensor_names` tells whether `output.weight` exists (absent = tied
        embeddings); `rope_freq_factors` is the content of a `rope_freqs.weight`
        tensor (llama.cpp's encoding of Llama-3 RoPE scaling), if any.
        """
        arch = meta["general.architecture"]
        if arch not in GGUF_ARCH_TO_HF:
            raise ValueError(f"unsupported GGUF architecture {arch!r}; known: {sorted(GGUF_ARCH_TO_HF)}")

        def get(key: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{key}", default)

        hidden = int(get("embedding_length"))
        num_heads = int(get("attention.head_count"))
        num_kv = get("attention.head_count_kv", num_heads)
        head_dim = int(get("attention.key_length", hidden // num_heads))
        vocab = get("vocab_size")
        if vocab is None:
            vocab = len(meta.get("tokenizer.ggml.tokens", []))

        rope_scaling = None
        scaling_type = get("rope.scaling.type")
        if rope_freq_factors is not None:
            rope_scaling = {"rope_type": "freq_factors", "freq_factors": list(rope_freq_factors)}
        elif scaling_type and scaling_type != "none":
            rope_scaling = {"rope_type": scaling_type, "factor": float(get("rope.scaling.factor", 1.0))}
            orig = get("rope.scaling.original_context_length")
            if orig is not None:
                rope_scaling["original_max_position_embeddings"] = int(orig)

        eos_ids = []
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            if meta.get(key) is not None and int(meta[key]) not in eos_ids:
                eos_ids.append(int(meta[key]))

        tied = tensor_names is not None and "output.weight" not in tensor_names
        has_bias = tensor_names is not None and "blk.0.attn_q.bias" in tensor_names
        return cls(
            architecture=GGUF_ARCH_TO_HF[arch],
            hidden_size=hidden,
            num_hidden_layers=int(get("block_count")),
            num_attention_heads=num_heads,
            num_key_value_heads=int(num_kv),
            head_dim=head_dim,
            intermediate_size=int(get("feed_forward_length")),
            vocab_size=int(vocab),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(get("context_length", 2048)),
            tie_word_embeddings=tied,
            attention_bias=has_bias,
            hidden_act="silu",
            eos_token_ids=eos_ids,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            kv_lora_rank=get("attention.kv_lora_rank"),
            q_lora_rank=get("attention.q_lora_rank"),
        )


def _moe_fields(cfg: Mapping[str, Any], architecture: str) -> dict:
    """DeepSeek rope-layout and mixture-of-experts keys of an HF config (defaults as DeepSeek's)."""
    is_v3 = architecture.startswith("DeepseekV3")
    out: dict[str, Any] = {"rope_interleave": bool(cfg.get("rope_interleave", True))}
    if not cfg.get("n_routed_experts"):
        return out

    def opt_int(key: str) -> int | None:
        return None if cfg.get(key) is None else int(cfg[key])

    out.update(
        n_routed_experts=int(cfg["n_routed_experts"]),
        n_shared_experts=int(cfg.get("n_shared_experts") or 0),
        num_experts_per_tok=opt_int("num_experts_per_tok"),
        moe_intermediate_size=opt_int("moe_intermediate_size"),
        first_k_dense_replace=int(cfg.get("first_k_dense_replace") or 0),
        moe_layer_freq=int(cfg.get("moe_layer_freq") or 1),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        topk_method=cfg.get("topk_method") or ("noaux_tc" if is_v3 else "greedy"),
        scoring_func=cfg.get("scoring_func") or ("sigmoid" if is_v3 else "softmax"),
        n_group=opt_int("n_group"),
        topk_group=opt_int("topk_group"),
    )
    return out


def normalize_rope_scaling(scaling: Mapping[str, Any] | None) -> dict | None:
    """Return a copy with a "rope_type" key, or None for plain RoPE."""
    if not scaling:
        return None
    out = dict(scaling)
    rope_type = out.get("rope_type") or out.get("type") or "default"
    out["rope_type"] = rope_type
    out.pop("type", None)
    out.pop("rope_theta", None)
    if rope_type == "default":
        return None
    return out


_MODEL_TYPE_TO_HF = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}


def _arch_from_model_type(model_type: str) -> str:
    if model_type not in _MODEL_TYPE_TO_HF:
        raise ValueError(f"config.json has no 'architectures' and unknown model_type {model_type!r}")
    return _MODEL_TYPE_TO_HF[model_type]
