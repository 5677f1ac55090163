"""A refused request body's 400 speaks of the fields the user wrote, not of pydantic's union
members (hiserve.engine.validation_errors)."""

from __future__ import annotations

import pytest
from api_app import make_app

from hiserve.engine.validation_errors import describe_validation_errors, field_path


@pytest.fixture(scope="module")
def client():
    tm, c = make_app()
    yield c
    tm._send_sock.close()


@pytest.mark.parametrize("path,body,message,param", [
    ("/generate", {"text": 5}, "text: Input should be a valid string or a valid list", "text"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": "hot"}},
     "sampling_params.temperature: Input should be a valid number", "temperature"),
    ("/generate", {"text": "hi", "sampling_params": [{"top_k": "a"}]},
     "sampling_params.0.top_k: Input should be a valid integer", "top_k"),
    # The list-of-lists member reached index 1's second id: the flat-list member's complaint
    # about index 0 would mislead.
    ("/generate", {"input_ids": [[1], [2, "y"]]}, "input_ids.1.1: Input should be a valid integer", "input_ids"),
    # Nested unions (sampling_params: object or list; stop: string or list): each one keeps
    # only its deepest member, so "stop should be a valid string" is not said of a list.
    ("/generate", {"text": "hi", "sampling_params": {"stop": ["a", 1]}},
     "sampling_params.stop.1: Input should be a valid string", "stop"),
    # logit_bias keys are the user's, even when they look like type names.
    ("/generate", {"text": "hi", "sampling_params": {"logit_bias": {"Hello": "x", "str": "y"}}},
     "sampling_params.logit_bias.Hello: Input should be a valid number; "
     "sampling_params.logit_bias.str: Input should be a valid number", "logit_bias"),
    ("/v1/completions", {"model": "m", "prompt": 5.5}, "prompt: Input should be a valid string or a valid list",
     "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]},
     "messages.0.content: Input should be a valid string or a valid list", "messages"),
    # a role OpenAI does not define is refused, not rendered by the template in some form
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}]},
     "messages.1.role: Input should be 'system', 'developer', 'user', 'assistant', 'tool', 'function' or "
     "'ipython'",
     "messages"),
])
def test_union_errors_name_the_field(client, path, body, message, param):
    r = client.post(path, json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["message"] == "Invalid request: " + message
    assert err["param"] == param
    assert "[" not in err["message"]  # no "list[str]"-like member tags


def test_field_path_keeps_keys_and_indices():
    assert field_path(("body", "input_ids", "list[list[int]]", 1, 1)) == ("input_ids", 1, 1)
    assert field_path(("body", "sampling_params", "SamplingParamsInput", "top_k")) == ("sampling_params", "top_k")
    assert field_path(("body", "stop", "function-after[check(), str]")) == ("stop",)


def test_plain_errors_pass_through_at_most_four():
    errors = [{"loc": ("body", f"f{i}"), "msg": "Field required"} for i in range(6)]
    text = describe_validation_errors(errors)
    assert text == "; ".join(f"f{i}: Field required" for i in range(4))
    assert describe_validation_errors([{"loc": ("body",), "msg": "Input should be an object"}]) == \
        "body: Input should be an object"
