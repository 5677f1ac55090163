"""Greedy agreement of a served model with transformers float32 on fixed chat prompts.

The reference is `transformers` in float32 on the same GGUF file (`gguf_file=`, which dequantizes
it), greedy, 32 new tokens. Every engine gets the same prompt token ids (the GGUF's chat template
applied by the same tokenizer) through `/v1/completions` with temperature 0, so no engine's own
templating enters the comparison. Both sides' texts are re-encoded with that tokenizer before the
comparison, so a decode/encode round trip changes neither side differently.

Figures per engine: first-token agreement (fraction of prompts whose first generated token equals
the reference's) and the common-prefix length of the 32 greedy tokens (mean and per prompt).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import httpx

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the ocean.",
    "Explain in one paragraph why the sky is blue.",
    "List three uses of a paperclip.",
    "What is 12 times 7? Answer with a short sentence.",
    "Give me a tip for learning a new language.",
]
MAX_NEW_TOKENS = 32


def load_tokenizer(gguf_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))


def prompt_ids(tokenizer) -> list[list[int]]:
    """Chat-templated token ids of CHAT_PROMPTS (generation prompt appended)."""
    out = []
    for text in CHAT_PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        out.append([int(t) for t in ids])
    return out


def reference_texts(gguf_path: str, cache_dir: Path | None = None) -> list[str]:
    """transformers float32 greedy continuations (MAX_NEW_TOKENS) of every chat prompt.

    With `cache_dir`, the texts are kept there keyed by the GGUF's size and mtime, the
    transformers and torch versions and the prompts, and reused while these are unchanged.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    st = os.stat(gguf_path)
    key = hashlib.sha256(json.dumps(["dense", gguf_path, st.st_size, st.st_mtime_ns, transformers.__version__,
                                     torch.__version__, CHAT_PROMPTS, MAX_NEW_TOKENS]).encode()).hexdigest()[:16]
    cache = cache_dir / f"reference_{key}.json" if cache_dir else None
    if cache is not None and cache.exists():
        return json.loads(cache.read_text())
    transformers.utils.logging.disable_progress_bar()

    tok = load_tokenizer(gguf_path)
    from gguf_to_hf import dequantize_kwargs

    # Dense float32 weights, the plain transformers path (not its packed-GGUF kernels).
    name = os.path.basename(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf_path), gguf_file=name,
                                                 dtype=torch.float32, **dequantize_kwargs(name))
    model.eval()
    texts = []
    with torch.inference_mode():
        for ids in prompt_ids(tok):
            inp = torch.tensor([ids])
            out = model.generate(inp, attention_mask=torch.ones_like(inp), do_sample=False,
                                 max_new_tokens=MAX_NEW_TOKENS, pad_token_id=tok.eos_token_id)
            texts.append(tok.decode(out[0, len(ids):], skip_special_tokens=True))
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(texts))
    return texts


def served_texts(base_url: str, model: str, ids_list: list[list[int]]) -> list[str]:
    """Greedy continuations from a server's /v1/completions, prompt given as token ids."""
    texts = []
    with httpx.Client(base_url=base_url, timeout=600) as c:
        for ids in ids_list:
            r = c.post("/v1/completions", json={"model": model, "prompt": ids, "max_tokens": MAX_NEW_TOKENS,
                                                "temperature": 0.0, "stream": False})
            r.raise_for_status()
            texts.append(r.json()["choices"][0]["text"])
    return texts


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(tokenizer, reference: list[str], served: list[str]) -> dict[str, Any]:
    """First-token agreement and common-prefix lengths (tokens, of MAX_NEW_TOKENS) of served vs reference."""
    per = []
    for ref, got in zip(reference, served):
        r = tokenizer.encode(ref, add_special_tokens=False)[:MAX_NEW_TOKENS]
        g = tokenizer.encode(got, add_special_tokens=False)[:MAX_NEW_TOKENS]
        prefix = common_prefix(r, g)
        per.append({"first_token_match": bool(r and g and r[0] == g[0]), "common_prefix_tokens": prefix,
                    "reference_tokens": len(r), "identical": r == g, "text": got})
    n = len(per)
    # A reference answer may end (EOS) before MAX_NEW_TOKENS: the fraction is of its own length.
    return {"prompts": n, "max_new_tokens": MAX_NEW_TOKENS,
            "first_token_agreement": sum(p["first_token_match"] for p in per) / n,
            "identical_outputs": sum(p["identical"] for p in per),
            "mean_common_prefix_tokens": sum(p["common_prefix_tokens"] for p in per) / n,
            "mean_common_prefix_fraction": sum(p["common_prefix_tokens"] / max(1, p["reference_tokens"])
                                               for p in per) / n,
            "min_common_prefix_tokens": min(p["common_prefix_tokens"] for p in per),
            "per_prompt": per}
