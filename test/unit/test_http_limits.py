"""Request bounds checked before any work, the torch-free tokenizer, and an honest /openapi.json."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest

from hiserve.engine.errors import BadRequestError
from hiserve.engine.http_limits import check_fanout, check_text_length, max_token_bytes
from hiserve.engine.protocol import SamplingParamsInput
from hiserve.engine.sampling_params import SamplingParams


@pytest.mark.parametrize("ns,best_of,param", [
    ([1_000_000], None, "n"), ([0], None, "n"), ([1] * 9, None, "prompt"), ([3, 3, 3], None, "n"),
    ([1], 10**9, "best_of"), ([2, 2, 2], 3, "n"),
])
def test_fanout_refused(ns, best_of, param):
    with pytest.raises(BadRequestError) as info:
        check_fanout(ns, best_of, limit=8)
    assert info.value.param == param


def test_fanout_accepted_up_to_the_limit():
    check_fanout([2, 2, 4], None, limit=8)
    check_fanout([1] * 8, 1, limit=8)


def test_text_length_refused_without_tokenizing():
    check_text_length(["a" * 999], max_tokens=100, context_len=128, token_bytes=10, param="prompt")
    with pytest.raises(BadRequestError) as info:  # 1001 bytes need at least 101 tokens of <= 10 bytes
        check_text_length(["a" * 1001], max_tokens=100, context_len=128, token_bytes=10, param="prompt")
    assert info.value.param == "prompt" and "context length" in info.value.message
    with pytest.raises(BadRequestError):  # counted in UTF-8 bytes, not characters
        check_text_length(["é" * 501], max_tokens=100, context_len=128, token_bytes=10, param="prompt")


def test_max_token_bytes_bounds_every_token():
    assert max_token_bytes(["a", "ĠĠ", "<0x41>", "東京"]) == 6


def test_sampling_params_input_has_the_engine_defaults():
    """Derived from the dataclass: every engine field, same default, bounds in the schema."""
    engine = SamplingParams()
    for name, f in SamplingParamsInput.model_fields.items():
        if hasattr(engine, name) and name != "stop_strs":
            assert f.default == getattr(engine, name), name
    schema = SamplingParamsInput.model_json_schema()
    assert schema["properties"]["top_p"]["exclusiveMinimum"] == 0
    assert SamplingParamsInput().to_sampling_params() == engine


def test_tokenizer_spec_rebuilds_the_same_tokenizer_without_torch_or_gguf(tmp_path):
    from hiserve.engine.tokenizer_spec import tokenizer_spec
    from hiserve.models.loader import get_tokenizer, resolve_model_path

    tok = get_tokenizer(resolve_model_path(None))
    (tmp_path / "spec.pkl").write_bytes(pickle.dumps(tokenizer_spec(tok)))
    messages = [{"role": "user", "content": "Hi é🙂"}, {"role": "assistant", "content": "Hello"}]
    text = "The capital city of France is é🙂"
    expected = [tok.encode(text), tok.decode(tok.encode(text), skip_special_tokens=False),
                tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False),
                tok.apply_chat_template(messages, continue_final_message=True, add_generation_prompt=False,
                                        tokenize=True, return_dict=False)]
    (tmp_path / "expected.pkl").write_bytes(pickle.dumps(expected))
    code = f"""
import pickle, sys
from hiserve.engine.tokenizer_spec import build_tokenizer
tok = build_tokenizer(pickle.load(open({str(tmp_path / 'spec.pkl')!r}, 'rb')))
messages = {messages!r}
text = {text!r}
got = [tok.encode(text), tok.decode(tok.encode(text), skip_special_tokens=False),
       tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False),
       tok.apply_chat_template(messages, continue_final_message=True, add_generation_prompt=False,
                               tokenize=True, return_dict=False)]
assert got == pickle.load(open({str(tmp_path / 'expected.pkl')!r}, 'rb')), got
assert 'torch' not in sys.modules and 'gguf' not in sys.modules, 'imported torch or gguf'
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


def test_tiny_repetition_penalty_is_refused_not_a_sampler_crash():
    """1e-300 is 0.0 in float32: positive logits / 0 = inf, and torch.multinomial raised on the
    NaN probabilities inside the scheduler process (the schemathesis run found it)."""
    import torch

    from hiserve.engine.sampler import Sampler, SamplingBatchInfo

    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=1e-300).verify()
    lowest = SamplingParams(repetition_penalty=0.01)
    lowest.verify()
    info = SamplingBatchInfo.from_reqs([lowest], [([1, 2, 3], [4])], 16, "cpu")
    assert 0 <= int(Sampler().sample(torch.randn(1, 16) + 5, info)[0]) < 16
