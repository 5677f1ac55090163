"""The HTTP API end to end: native /generate, the OpenAI routes, info routes, metrics, stops."""

from __future__ import annotations

import httpx
import openai
import pytest
from server import stream_events

# /metrics and usage.prompt_tokens_details are opt-in, as in SGLang.
SERVER_ARGS = ["--enable-metrics", "--enable-cache-report"]

PROMPT = "The capital city of France is"
GREEDY = {"temperature": 0, "max_new_tokens": 8}


@pytest.fixture(scope="module")
def client(base_url: str):
    with httpx.Client(base_url=base_url, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def oai(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client: httpx.Client) -> str:
    return client.get("/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def greedy(client: httpx.Client) -> dict:
    """The non-streaming greedy answer to PROMPT, the reference for the streaming tests."""
    r = client.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    return r.json()


# ---------------------------------------------------------------- /generate


def test_generate_non_stream(greedy: dict):
    meta = greedy["meta_info"]
    assert isinstance(greedy["text"], str) and greedy["text"]
    assert len(greedy["output_ids"]) == 8
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["completion_tokens"] == 8
    assert meta["prompt_tokens"] > 0
    assert meta["cached_tokens"] == meta["cached_tokens_details"]["device"] + meta["cached_tokens_details"]["host"]
    assert meta["weight_version"] == "default"
    assert meta["e2e_latency"] > 0
    assert meta["id"]


def test_generate_stream_matches_non_stream(client: httpx.Client, greedy: dict):
    events = stream_events(client, "/generate", {"text": PROMPT, "sampling_params": GREEDY, "stream": True})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks and all(c["meta_info"]["prompt_tokens"] == greedy["meta_info"]["prompt_tokens"] for c in chunks)
    prev_text, prev_ids = "", []
    for c in chunks:  # cumulative text and output_ids
        assert c["text"].startswith(prev_text)
        assert c["output_ids"][:len(prev_ids)] == prev_ids
        assert c["meta_info"]["completion_tokens"] == len(c["output_ids"])
        prev_text, prev_ids = c["text"], c["output_ids"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert chunks[-1]["text"] == greedy["text"]
    assert chunks[-1]["output_ids"] == greedy["output_ids"]


@pytest.fixture(scope="module")
def prompt_ids(client: httpx.Client) -> list[int]:
    from hiserve.models.loader import get_tokenizer

    return get_tokenizer(client.get("/get_model_info").json()["tokenizer_path"]).encode(PROMPT)


def test_generate_input_ids(client: httpx.Client, greedy: dict, prompt_ids: list[int]):
    r = client.post("/generate", json={"input_ids": prompt_ids, "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == greedy["output_ids"]
    assert r.json()["text"] == greedy["text"]
    r = client.post("/generate", json={"input_ids": [prompt_ids], "sampling_params": {"max_new_tokens": 0}})
    assert r.status_code == 200, r.text
    (out,) = r.json()  # a batch of one is a list
    assert out["meta_info"]["completion_tokens"] == 0 and out["text"] == ""


def test_generate_batch_and_n(client: httpx.Client, greedy: dict):
    r = client.post("/generate", json={"text": [PROMPT, "Hello"], "sampling_params": {"temperature": 0, "max_new_tokens": 2}})
    assert r.status_code == 200, r.text
    outs = r.json()
    assert isinstance(outs, list) and len(outs) == 2
    assert outs[0]["output_ids"] == greedy["output_ids"][:2]
    r = client.post("/generate", json={"text": PROMPT, "sampling_params": {"n": 2, "max_new_tokens": 2,
                                                                            "temperature": 0.8, "sampling_seed": 7}})
    assert r.status_code == 200, r.text
    outs = r.json()
    assert [o["index"] for o in outs] == [0, 1]
    assert all(len(o["output_ids"]) == 2 for o in outs)
    assert outs[0]["meta_info"]["id"] != outs[1]["meta_info"]["id"]


# ---------------------------------------------------------------- OpenAI


def test_completions(oai: openai.OpenAI, model: str, greedy: dict):
    r = oai.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.object == "text_completion"
    assert r.model == model
    assert r.choices[0].text == greedy["text"]
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8
    assert r.usage.prompt_tokens == greedy["meta_info"]["prompt_tokens"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_completions_stream(oai: openai.OpenAI, model: str, greedy: dict):
    chunks = list(oai.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    content = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in content) == greedy["text"]
    assert [c.choices[0].finish_reason for c in content][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 8
    # Without include_usage, no chunk without choices (bench_serving indexes choices[0]).
    plain = list(oai.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0, stream=True))
    assert all(c.choices for c in plain)


def test_chat(oai: openai.OpenAI, model: str):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = oai.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens > 10  # the chat template adds tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0

    chunks = list(oai.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == msg.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == r.choices[0].finish_reason
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again

    plain = list(oai.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0,
                                             stream=True))
    assert all(c.choices for c in plain)


def test_chat_n2(oai: openai.OpenAI, model: str):
    r = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                    n=2, temperature=0.7, seed=3)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens <= 4
    r = oai.completions.create(model=model, prompt=PROMPT, max_tokens=2, n=2, temperature=0.7)
    assert sorted(c.index for c in r.choices) == [0, 1]


# ---------------------------------------------------------------- stop strings


def _stop_string(greedy: dict) -> tuple[str, int]:
    """A stop string from the middle of the greedy text whose first occurrence is at `pos`."""
    text = greedy["text"]
    for pos in range(3, len(text) - 3):
        s = text[pos:pos + 3]
        if s.strip() and text.find(s) == pos:
            return s, pos
    # The greedy text is deterministic; if it has no such substring the test premise is broken.
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_string(client: httpx.Client, greedy: dict):
    stop, pos = _stop_string(greedy)
    sp = {**GREEDY, "stop": [stop]}
    out = client.post("/generate", json={"text": PROMPT, "sampling_params": sp}).json()
    assert out["text"] == greedy["text"][:pos]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}

    events = stream_events(client, "/generate", {"text": PROMPT, "sampling_params": sp, "stream": True})
    texts = [e["text"] for e in events[:-1]]
    assert all(stop not in t for t in texts)
    assert texts[-1] == greedy["text"][:pos]

    kept = client.post("/generate", json={"text": PROMPT, "sampling_params": {**sp, "no_stop_trim": True}}).json()
    assert kept["text"].startswith(greedy["text"][:pos] + stop)


def test_stop_string_openai(oai: openai.OpenAI, model: str, client: httpx.Client, greedy: dict):
    stop, pos = _stop_string(greedy)
    r = oai.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop])
    assert r.choices[0].text == greedy["text"][:pos]
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["matched_stop"] == stop
    chunks = list(oai.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop],
                                         stream=True))
    streamed = "".join(c.choices[0].text for c in chunks)
    assert streamed == greedy["text"][:pos]


# ---------------------------------------------------------------- models, info, metrics


def test_models(client: httpx.Client, oai: openai.OpenAI, model: str):
    data = client.get("/v1/models").json()
    assert data["object"] == "list"
    card = data["data"][0]
    assert card["object"] == "model" and card["max_model_len"] > 0
    assert oai.models.retrieve(model).id == model
    r = client.get("/v1/models/no-such-model")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("no-such-model")


def test_model_and_server_info(client: httpx.Client, model: str):
    info = client.get("/get_model_info").json()
    assert info["model_path"] and info["is_generation"] is True
    assert info["served_model_name"] == model
    server = client.get("/get_server_info").json()
    assert server["port"] > 0 and server["max_total_num_tokens"] > 0
    state = server["internal_states"][0]
    assert state["max_total_num_tokens"] == server["max_total_num_tokens"]
    assert 0 <= state["available_tokens"] <= state["max_total_num_tokens"]
    assert "version" in server
    assert client.get("/version").json()["version"]


def test_health(client: httpx.Client):
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200


def test_metrics(client: httpx.Client, greedy: dict):
    stream_events(client, "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 2}, "stream": True})
    r = client.get("/metrics")
    assert r.status_code == 200
    text = r.text
    for name in ["num_running_reqs", "num_queue_reqs", "num_used_tokens", "token_usage", "gen_throughput",
                 "cache_hit_rate", "prompt_tokens_total", "generation_tokens_total", "cached_tokens_total",
                 "num_requests_total", "time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds", "cached_tokens_device_total", "cached_tokens_host_total",
                 "hicache_backup_tokens_total", "load_back_tokens_total", "hicache_host_used_tokens",
                 "hicache_host_total_tokens"]:
        assert f"sglang:{name}" in text, name
    for suffix in ("_sum{", "_count{", "_bucket{"):
        assert suffix in text
    assert 'model_name="' in text
    requests = [line for line in text.splitlines() if line.startswith("sglang:num_requests_total{")]
    assert float(requests[0].rsplit(" ", 1)[1]) >= 2


def test_abort_request(client: httpx.Client):
    body = {"text": PROMPT, "rid": "abort-me", "stream": True,
            "sampling_params": {"max_new_tokens": 512, "ignore_eos": True}}
    with client.stream("POST", "/generate", json=body) as r:
        last = None
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            last = line
            if '"completion_tokens":1,' in line:
                assert client.post("/abort_request", json={"rid": "abort-me"}).status_code == 200
    assert '"type":"abort"' in last
