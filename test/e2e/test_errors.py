"""Every bad input gets a 4xx that names the parameter, and the server stays healthy after it."""

from __future__ import annotations

import httpx
import openai
import pytest

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def client(base_url: str):
    with httpx.Client(base_url=base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def context_len(client: httpx.Client) -> int:
    return client.get("/get_model_info").json()["context_length"]


def _assert_error(r: httpx.Response, param, status: int = 400, fragment: str = "") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert err["param"] == param, err
    assert err["code"] == status
    assert err["type"] in ("invalid_request_error", "BadRequestError")
    assert fragment in err["message"]
    return err


@pytest.fixture(autouse=True)
def still_healthy(client: httpx.Client):
    yield
    assert client.get("/health").status_code == 200


BAD_BODIES = [
    # (route, body, param)
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": -1}, "max_tokens"),
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": 1.5}, "max_tokens"),
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": "5"}, "max_tokens"),
    (CHAT, {"messages": MESSAGES, "max_tokens": -1}, "max_tokens"),
    (CHAT, {"messages": MESSAGES, "max_tokens": "5"}, "max_tokens"),
    (CHAT, {"messages": MESSAGES, "max_completion_tokens": -3}, "max_completion_tokens"),
    (COMPLETIONS, {"prompt": "Hi", "temperature": -0.5}, "temperature"),
    (CHAT, {"messages": MESSAGES, "temperature": -1}, "temperature"),
    (CHAT, {"messages": MESSAGES, "temperature": "hot"}, "temperature"),
    (COMPLETIONS, {"prompt": "Hi", "top_p": 0}, "top_p"),
    (CHAT, {"messages": MESSAGES, "top_p": 1.5}, "top_p"),
    (COMPLETIONS, {"prompt": "Hi", "top_k": 0}, "top_k"),
    (CHAT, {"messages": MESSAGES, "min_p": 2}, "min_p"),
    (CHAT, {"messages": MESSAGES, "n": 0}, "n"),
    (CHAT, {"messages": MESSAGES, "stream": "yes"}, "stream"),
    (CHAT, {"messages": "Hi"}, "messages"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": [{"content": "no role"}]}, "messages"),
    (CHAT, {}, "messages"),
    (COMPLETIONS, {"prompt": {"text": "Hi"}}, "prompt"),
    (COMPLETIONS, {"prompt": ""}, "prompt"),
    (COMPLETIONS, {"prompt": []}, "prompt"),
    (COMPLETIONS, {"prompt": [1, -5]}, "prompt"),
    (COMPLETIONS, {"prompt": "Hi", "stop": 3}, "stop"),
    (COMPLETIONS, {"prompt": "Hi", "logprobs": 21}, "logprobs"),
    ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": "5"}}, "max_new_tokens"),
    ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ("/generate", {"text": "Hi", "sampling_params": {"temperature": -1}}, "temperature"),
    ("/generate", {"text": "Hi", "sampling_params": {"top_p": 1.5}}, "top_p"),
    ("/generate", {"text": "Hi", "sampling_params": {"top_k": 0}}, "top_k"),
    ("/generate", {"text": "Hi", "sampling_params": [{"top_k": 0}]}, "top_k"),
    ("/generate", {"text": "Hi", "sampling_params": {"max_tokens": 5}}, "sampling_params"),
    ("/generate", {"text": 5}, "text"),
    ("/generate", {"sampling_params": {}}, "text"),
    ("/generate", {"text": "Hi", "input_ids": [1]}, "text"),
    ("/generate", {"input_ids": [1, 10 ** 9]}, "input_ids"),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
]


@pytest.mark.parametrize("route,body,param", BAD_BODIES,
                         ids=[f"{r}-{sorted(b)}-{p}" for r, b, p in BAD_BODIES])
def test_bad_body(client: httpx.Client, route: str, body: dict, param: str):
    _assert_error(client.post(route, json=body), param)


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT, "/generate"])
def test_invalid_json(client: httpx.Client, route: str):
    r = client.post(route, content=b'{"prompt": "Hi", ', headers={"content-type": "application/json"})
    _assert_error(r, None, fragment="JSON")


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_not_json_content_type(client: httpx.Client, route: str):
    r = client.post(route, content=b"prompt=Hi", headers={"content-type": "application/x-www-form-urlencoded"})
    _assert_error(r, None, fragment="application/json")


def test_streaming_request_is_refused_before_streaming(client: httpx.Client):
    """A bad streaming request is a real 400, not a 200 with an error event."""
    r = client.post(CHAT, json={"messages": MESSAGES, "stream": True, "temperature": -1})
    _assert_error(r, "temperature")
    r = client.post("/generate", json={"text": "Hi", "stream": True, "sampling_params": {"top_k": 0}})
    _assert_error(r, "top_k")


def test_prompt_plus_max_tokens_beyond_context(client: httpx.Client, context_len: int):
    fragment = f"Requested token count exceeds the model's maximum context length of {context_len} tokens"
    r = client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": context_len})
    _assert_error(r, "max_tokens", fragment=fragment)
    r = client.post(CHAT, json={"messages": MESSAGES, "max_completion_tokens": context_len})
    _assert_error(r, "max_completion_tokens", fragment=fragment)
    r = client.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": context_len}})
    _assert_error(r, "max_new_tokens", fragment=fragment)


def test_prompt_longer_than_context(client: httpx.Client, context_len: int):
    ids = [100] * (context_len + 1)
    for route, body, param in [(COMPLETIONS, {"prompt": ids, "max_tokens": 1}, "prompt"),
                               ("/generate", {"input_ids": ids}, "input_ids"),
                               (CHAT, {"messages": [{"role": "user", "content": "hi " * context_len}]}, "messages")]:
        err = _assert_error(client.post(route, json=body), param)
        assert "is longer than the model's context length" in err["message"]
        assert "maximum context length" in err["message"]


def test_unknown_model_is_404(client: httpx.Client):
    r = client.get("/v1/models/not-a-model")
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert err["type"] == "invalid_request_error"


def test_unknown_route_is_404(client: httpx.Client):
    r = client.get("/no/such/route")
    assert r.status_code == 404 and "error" in r.json()


def test_openai_client_sees_param(base_url: str):
    oai = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="any", messages=MESSAGES, max_tokens=-1)
    assert info.value.status_code == 400
    assert info.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model="any", prompt="Hi", top_p=1.5)
    assert info.value.param == "top_p"
