"""Logprobs and logit_bias over HTTP: /generate meta_info, /v1/completions (echo), /v1/chat/completions,
streamed and not; the bounds of the new parameters are 400s naming them."""

from __future__ import annotations

import math

import httpx
import openai
import pytest
from server import stream_events

PROMPT = "The capital city of France is"


@pytest.fixture(scope="module")
def client(base_url: str):
    with httpx.Client(base_url=base_url, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def oai(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def native(client: httpx.Client) -> dict:
    r = client.post("/generate", json={"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 5},
                                       "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3,
                                       "return_text_in_logprobs": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_generate_meta_info_shapes(native: dict):
    meta = native["meta_info"]
    n_in = meta["prompt_tokens"]
    assert len(meta["input_token_logprobs"]) == n_in and len(meta["input_top_logprobs"]) == n_in
    assert meta["input_token_logprobs"][0][0] is None and meta["input_top_logprobs"][0] is None
    assert all(lp <= 0 for lp, _, _ in meta["input_token_logprobs"][1:])
    out = meta["output_token_logprobs"]
    assert [t for _, t, _ in out] == native["output_ids"]
    assert all(isinstance(text, str) for _, _, text in out)
    for (lp, tok, _), top in zip(out, meta["output_top_logprobs"]):
        assert len(top) == 3 and top[0][1] == tok and math.isclose(top[0][0], lp, abs_tol=1e-6)  # greedy = argmax


def test_generate_stream_logprobs_equal_non_stream(client: httpx.Client, native: dict):
    events = stream_events(client, "/generate", {
        "text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 5}, "stream": True,
        "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3, "return_text_in_logprobs": True})
    last = events[-2]["meta_info"]
    for key in ("input_token_logprobs", "output_token_logprobs", "output_top_logprobs"):
        got, want = last[key], native["meta_info"][key]
        assert len(got) == len(want)
        for g, w in zip(got, want):
            if key == "output_top_logprobs":
                g, w = g[0], w[0]
            assert g[1] == w[1] and (g[0] is w[0] is None or math.isclose(g[0], w[0], abs_tol=1e-4))


def test_completions_echo_matches_generate(oai: openai.OpenAI, native: dict):
    r = oai.completions.create(model="m", prompt=PROMPT, max_tokens=5, temperature=0, echo=True, logprobs=2)
    choice = r.choices[0]
    assert choice.text.startswith(PROMPT)
    lp = choice.logprobs
    meta = native["meta_info"]
    n_in = meta["prompt_tokens"]
    assert len(lp.tokens) == n_in + 5 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [x[0] for x in meta["input_token_logprobs"] + meta["output_token_logprobs"]]
    for g, w in zip(lp.token_logprobs[1:], want[1:]):
        assert math.isclose(g, w, abs_tol=1e-4)
    assert "".join(lp.tokens[n_in:]) == choice.text[len(PROMPT):]
    # The greedy token has the largest logprob of its position's top entries.
    for tok, top, val in zip(lp.tokens[n_in:], lp.top_logprobs[n_in:], lp.token_logprobs[n_in:]):
        assert max(top.values()) == pytest.approx(val) and top[tok] == pytest.approx(val)


def test_completions_stream_logprobs(oai: openai.OpenAI, native: dict):
    tokens, values = [], []
    for chunk in oai.completions.create(model="m", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=1,
                                        stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.tokens
            values += chunk.choices[0].logprobs.token_logprobs
    want = native["meta_info"]["output_token_logprobs"]
    assert len(values) == 5
    for g, (w, _, text) in zip(values, want):
        assert math.isclose(g, w, abs_tol=1e-4)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs(oai: openai.OpenAI, stream: bool):
    kwargs = dict(model="m", messages=[{"role": "user", "content": "Say hi"}], max_tokens=6, temperature=0,
                  logprobs=True, top_logprobs=4)
    if stream:
        content = []
        text = ""
        for chunk in oai.chat.completions.create(stream=True, **kwargs):
            if chunk.choices and chunk.choices[0].logprobs is not None:
                content += chunk.choices[0].logprobs.content
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
    else:
        r = oai.chat.completions.create(**kwargs)
        content, text = r.choices[0].logprobs.content, r.choices[0].message.content
    assert len(content) == 6
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 4
        assert item.top_logprobs[0].token == item.token  # greedy
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token
    assert "".join(i.token for i in content).startswith(text[:3])


def test_logit_bias_steers_tokens(client: httpx.Client, native: dict):
    first = native["output_ids"][0]
    r = client.post("/generate", json={"text": PROMPT, "sampling_params": {
        "temperature": 0, "max_new_tokens": 2, "logit_bias": {str(first): -100}}})
    assert r.status_code == 200 and r.json()["output_ids"][0] != first
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                                             "logit_bias": {"1234": 100}})
    assert r.status_code == 200


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"12": 100.5}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {str(i): 1 for i in range(1100)}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ("/generate", {"text": "x", "return_logprob": True, "top_logprobs_num": 50}, "top_logprobs_num"),
    ("/generate", {"text": "x", "return_logprob": True, "logprob_start_len": 100}, "logprob_start_len"),
    ("/generate", {"text": "x", "sampling_params": {"logit_bias": {"5": -101}}}, "logit_bias"),
])
def test_bad_parameters_are_400(client: httpx.Client, path: str, body: dict, param: str):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert client.get("/health").status_code == 200
