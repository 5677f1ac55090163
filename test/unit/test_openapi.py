"""/openapi.json documents every status each route can answer, never 422, and the run-time bounds."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from api_app import make_tm

from hiserve.engine.http_server import create_app
from hiserve.engine.io_struct import SchedulerReady


@pytest.fixture(scope="module")
def doc() -> dict:
    ready = SchedulerReady(4096, 1000, 1024, 512, [2], max_running_requests=8)
    tm = make_tm(ready, api_key="k", max_request_body_bytes=1000)
    try:
        yield create_app(tm).openapi()
    finally:
        tm._send_sock.close(linger=0)


def test_statuses_documented(doc: dict):
    ops = {(m, p): op for p, item in doc["paths"].items() for m, op in item.items()}
    for (method, path), op in ops.items():
        codes = set(op["responses"])
        assert "422" not in codes, path
        if path.startswith(("/health", "/metrics")):
            assert "401" not in codes
        else:
            assert "401" in codes, path
        if "requestBody" in op:
            assert {"400", "413"} <= codes, path
    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        assert {"200", "400", "401", "413", "503"} <= set(ops[("post", path)]["responses"])
    assert "404" in ops[("get", "/v1/models/{model_id}")]["responses"]
    ids = [op["operationId"] for op in ops.values()]
    assert len(ids) == len(set(ids))


def test_runtime_bounds_in_request_schemas(doc: dict):
    s = doc["components"]["schemas"]
    assert s["ChatCompletionRequest"]["properties"]["n"]["maximum"] == 8
    prompt = s["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    ids = next(b for b in prompt if b.get("type") == "array" and b["items"].get("type") == "integer")
    assert ids["items"]["maximum"] == 511 and ids["maxItems"] == 1000
    assert s["SamplingParamsInput"]["properties"]["top_k"]["not"] == {"const": 0}


def test_wrong_method_405_with_allow_and_413_without_reading():
    ready = SchedulerReady(4096, 1000, 1024, 512, [2], max_running_requests=8)
    tm = make_tm(ready, max_request_body_bytes=1000)
    client = TestClient(create_app(tm))  # no lifespan: nothing here reaches the scheduler
    r = client.delete("/generate")
    assert r.status_code == 405 and set(r.headers["allow"].replace(" ", "").split(",")) == {"POST", "PUT"}
    assert r.json()["error"]["code"] == 405
    r = client.post("/v1/completions", content=b"{" + b" " * 2000 + b"}", headers={"content-type": "application/json"})
    assert r.status_code == 413 and "--max-request-body-bytes" in r.json()["error"]["message"]
    r = client.post("/v1/completions", content=b'{"prompt": "\xff"}', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "UTF-8" in r.json()["error"]["message"]
    r = client.post("/v1/completions", content=b"[" * 400 + b"]" * 400, headers={"content-type": "application/json"})
    assert r.status_code == 400
    tm._send_sock.close(linger=0)


def _validator(doc: dict, name: str):
    """A JSON Schema validator of component `name`, resolving $refs within the document."""
    import jsonschema

    schema = {**doc["components"]["schemas"][name], "components": doc["components"]}  # $refs: #/components/...
    return jsonschema.Draft202012Validator(schema)


@pytest.mark.parametrize("name,bad,good", [
    ("GenerateReqInput", [{"text": "0", "input_ids": [[0]]}, {}, {"text": None}],
     [{"text": "hi"}, {"input_ids": [1, 2]}, {"text": None, "input_ids": [1]}]),
    ("CompletionRequest", [{"prompt": "a", "regex": "", "json_schema": ""}, {"prompt": "a", "regex": "x", "ebnf": "y"}],
     [{"prompt": "a", "regex": "x"}, {"prompt": "a", "regex": None, "ebnf": "y"}]),
    ("ChatCompletionRequest", [{"messages": [{"role": "user"}], "json_schema": "{}", "ebnf": "x"}],
     [{"messages": [{"role": "user"}], "json_schema": "{}"}]),
    ("SamplingParamsInput", [{"regex": "a", "json_schema": "{}"}], [{"regex": "a"}, {}]),
    # Features refused with their own 400 message: the schema says which values pass.
    ("GenerateReqInput", [{"text": "a", "lora_path": "x"}, {"text": "a", "lora_path": [None, "x"]},
                          {"text": "a", "input_ids": None, "input_embeds": [0.5]}, {"text": "a", "image_data": "img"}],
     [{"text": "a", "lora_path": [None, ""]}, {"text": "a", "lora_path": ""}, {"text": "a", "image_data": ""},
      {"text": "a", "image_data": []}, {"text": "a", "input_embeds": None}]),
    ("SamplingParamsInput", [{"stop_regex": "x"}, {"stop_regex": []}, {"structural_tag": ""}], [{"stop_regex": None}]),
    ("ChatCompletionRequest", [{"messages": []}, {"messages": [{"role": "user"}], "tools": [{}]},
                               {"messages": [{"role": "user"}], "max_tokens": 0},
                               {"messages": [{"role": "user"}], "max_completion_tokens": -1}],
     [{"messages": [{"role": "user"}], "tools": [], "max_tokens": 1, "max_completion_tokens": None}]),
    ("CompletionRequest", [{"prompt": "a", "suffix": "b"}, {"prompt": "a", "stop_regex": ["x"]},
                           {"prompt": "a", "max_tokens": 0}, {"prompt": "a", "lora_path": "x"}],
     [{"prompt": "a", "suffix": "", "stop_regex": [], "lora_path": None, "max_tokens": 5}]),
])
def test_mutual_exclusions_are_in_the_schema(doc: dict, name: str, bad: list, good: list):
    """Rules the handlers enforce across fields (exactly one prompt field; at most one grammar)
    are stated in /openapi.json, so a schema-valid request is not refused for them."""
    v = _validator(doc, name)
    assert not any(v.is_valid(b) for b in bad), [b for b in bad if v.is_valid(b)]
    assert all(v.is_valid(g) for g in good), [list(v.iter_errors(g)) for g in good if not v.is_valid(g)]
