"""Request models: strict types, parameter names in errors, and the mapping onto SamplingParams."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError

from hiserve.engine.errors import BadRequestError
from hiserve.engine.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateReqInput,
    SamplingParamsInput,
    param_from_loc,
)
from hiserve.engine.sampling_params import SamplingParams


def test_sampling_params_input_mirrors_the_engine():
    engine = {f.name for f in dataclasses.fields(SamplingParams) if f.init}
    assert engine <= set(SamplingParamsInput.model_fields)
    assert SamplingParamsInput().to_sampling_params() == SamplingParams()


def _param(model, body: dict) -> str:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    primary = max(info.value.errors(), key=lambda e: len(e["loc"]))
    return param_from_loc(("body", *primary["loc"]))


@pytest.mark.parametrize("model,body,param", [
    (CompletionRequest, {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    (CompletionRequest, {"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    (CompletionRequest, {"prompt": "x", "temperature": "0"}, "temperature"),
    (CompletionRequest, {"prompt": {"a": 1}}, "prompt"),
    (ChatCompletionRequest, {"messages": "hi"}, "messages"),
    (ChatCompletionRequest, {"messages": [{"role": 1}]}, "messages"),
    (ChatCompletionRequest, {"messages": [], "stream": "true"}, "stream"),
    (GenerateReqInput, {"text": "x", "sampling_params": {"top_k": "1"}}, "top_k"),
    (GenerateReqInput, {"text": "x", "sampling_params": [{"n": 1.0}]}, "n"),
])
def test_strict_types_name_the_parameter(model, body: dict, param: str):
    assert _param(model, body) == param


def test_openai_mapping():
    req = CompletionRequest.model_validate({"prompt": [1, 2], "max_tokens": 5, "min_tokens": 2, "seed": 9,
                                            "top_k": 4, "stop": "x", "temperature": 0})
    sp = req.to_sampling_params()
    assert (sp.max_new_tokens, sp.min_new_tokens, sp.sampling_seed, sp.top_k, sp.stop_strs) == (5, 2, 9, 4, ["x"])
    assert sp.is_greedy
    assert req.prompts() == [[1, 2]]
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    assert chat.to_sampling_params().max_new_tokens is None  # until the context limit


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": "x", "echo": True, "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "regex": "(a+"}, "regex"),
    ({"prompt": "x", "logit_bias": {"1": 200}}, "logit_bias"),
    ({"prompt": "x", "response_format": {"type": "json_schema"}}, "response_format"),
])
def test_completion_refusals(body: dict, param: str):
    req = CompletionRequest.model_validate(body)
    with pytest.raises(BadRequestError) as info:
        req.prompts()
        req.to_sampling_params()
    assert info.value.param == param


def test_chat_content_parts():
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None}]})
    assert [m["content"] for m in req.template_messages()] == ["a\nb", ""]
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    with pytest.raises(BadRequestError):
        req.template_messages()


def test_chat_roles_any_case_and_known_only():
    """OpenAI's roles in any case (lower-cased, as SGLang does) and Llama's "ipython"; others refused."""
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "System", "content": "s"}, {"role": "USER", "content": "u"}, {"role": "ipython", "content": "r"}]})
    assert [m.role for m in req.messages] == ["system", "user", "ipython"]
    with pytest.raises(ValidationError, match="role"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "wizard", "content": "x"}]})
