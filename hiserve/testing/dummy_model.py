"""Model folders for `--load-format dummy`: a config.json and a self-contained tokenizer, no weights.

`write_dummy_model(folder, shape)` writes everything the server reads from a model folder
except the weights, which `--load-format dummy` generates on the device at start-up:

- `config.json` in Hugging Face form (the architecture and its hyper-parameters);
- `generation_config.json` with the eos id;
- a tokenizer built with the `tokenizers` library: a WordLevel vocabulary that covers every
  id (`<unk>`, `<s>`, `</s>`, three role markers, then `w6` .. `w{V-1}`), split on
  whitespace, decoded by joining tokens with spaces (the library's default), `<s>` added in
  front of encoded text, and a small chat template. So any id a random model generates
  detokenizes, and the decoded text of ids without special tokens encodes back to the same
  ids: text prompts, the chat API and streaming all work unchanged.

Shapes: `llama3-8b` (Llama-3-8B), `deepseek-mla` (a DeepSeek-V2-style MLA + MoE model with
V2-Lite's attention shape and a few small layers), `tiny-llama` (CPU tests, and GPU smoke
runs) and `tiny-mla` (CPU tests).
"""

from __future__ import annotations

import json
import os
from typing import Any

UNK, BOS, EOS = "<unk>", "<s>", "</s>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (UNK, BOS, EOS, *ROLE_TOKENS)
BOS_ID, EOS_ID = 1, 2

# Role marker, message, then the assistant marker when a reply is wanted; words in the
# content that are not `w<id>` become <unk>, which is fine for a random model.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_COMMON: dict[str, Any] = {
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 128256, "rope_theta": 500000.0, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
    },
    # V2-Lite's attention (16 heads, kv_lora_rank 512, rope 64, nope 128, v 128, no q LoRA),
    # 6 layers: the first dense, the rest MoE with 16 small routed experts (top 4) + 1 shared.
    "deepseek-mla": {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 6,
        "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 32000,
        "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
        "q_lora_rank": None, "rope_theta": 10000.0, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6, "n_routed_experts": 16, "num_experts_per_tok": 4,
        "n_shared_experts": 1, "moe_intermediate_size": 1024, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "topk_method": "greedy", "scoring_func": "softmax",
        "norm_topk_prob": False, "routed_scaling_factor": 1.0,
    },
    # Head dim 64 and 128-byte KV rows: small enough for CPU tests, and shapes the GPU
    # attention and KV-transfer kernels accept (the compute-sanitizer smoke run uses it).
    "tiny-llama": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
        "vocab_size": 512, "rope_theta": 10000.0, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
    },
    "tiny-mla": {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 512,
        "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
        "q_lora_rank": 48, "rope_theta": 10000.0, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "topk_method": "greedy", "scoring_func": "softmax",
        "norm_topk_prob": False, "routed_scaling_factor": 1.0,
    },
}


def hf_config(shape: str) -> dict[str, Any]:
    """The config.json dict of `shape`.

    Raises:
        ValueError: unknown shape.
    """
    if shape not in SHAPES:
        raise ValueError(f"unknown dummy model shape {shape!r}; known: {sorted(SHAPES)}")
    return {**_COMMON, **SHAPES[shape]}


def vocab_words(vocab_size: int) -> list[str]:
    """The token of every id: the special tokens first, then `w<id>`.

    Raises:
        ValueError: `vocab_size` leaves no room for ordinary words.
    """
    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} must exceed the {len(SPECIAL_TOKENS)} special tokens")
    return [*SPECIAL_TOKENS, *(f"w{i}" for i in range(len(SPECIAL_TOKENS), vocab_size))]


def write_tokenizer(folder: str, vocab_size: int, model_max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json for a
    WordLevel tokenizer over `vocab_words(vocab_size)` (one token per id, no merges)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(vocab_words(vocab_size))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Special tokens match before splitting, so "<|user|>" stays one token inside text.
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, BOS_ID)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, unk_token=UNK,
        additional_special_tokens=list(ROLE_TOKENS), model_max_length=model_max_length,
        chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(folder)


def write_dummy_model(folder: str, shape: str) -> str:
    """Write a dummy model folder for `shape` (see SHAPES) and return its path.

    The folder is created if needed; existing files of the same names are replaced. Serve it
    with `--model-path <folder> --load-format dummy`.

    Raises:
        ValueError: unknown shape.
    """
    config = hf_config(shape)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": BOS_ID, "eos_token_id": EOS_ID}, f, indent=1)
    write_tokenizer(folder, config["vocab_size"], config["max_position_embeddings"])
    return folder


def word_ids_text(ids: list[int]) -> str:
    """The text whose encoding (without special tokens) is `ids`; ids must be ordinary words
    (>= len(SPECIAL_TOKENS))."""
    if any(i < len(SPECIAL_TOKENS) for i in ids):
        raise ValueError("word_ids_text takes ordinary word ids only (no special tokens)")
    return " ".join(f"w{i}" for i in ids)
