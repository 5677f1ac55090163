"""Structured output through xgrammar: response_format json_schema / json_object on chat, /generate's
json_schema, regex and ebnf; every output parses and validates; bad constraints are 400s."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

S = {"type": "string", "maxLength": 12}
I = {"type": "integer", "minimum": 0, "maximum": 100}


def obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": required if required is not None else list(props),
            "additionalProperties": False}


SCHEMAS = [
    obj({"name": S}),
    obj({"age": I}),
    obj({"ok": {"type": "boolean"}}),
    obj({"color": {"type": "string", "enum": ["red", "green", "blue"]}}),
    obj({"score": {"type": "number", "minimum": 0, "maximum": 1}}),
    obj({"temp": {"type": "integer", "minimum": -40, "maximum": 50}}),
    obj({"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}}),
    obj({"ids": {"type": "array", "items": I, "maxItems": 4}}),
    obj({"user": obj({"name": S, "age": I})}),
    obj({"a": obj({"b": obj({"c": {"type": "boolean"}})})}),
    obj({"city": S, "country": {"type": "string", "enum": ["France", "Spain", "Italy"]}}),
    obj({"items": {"type": "array", "items": obj({"sku": S, "qty": {"type": "integer", "minimum": 1,
                                                                      "maximum": 9}}), "maxItems": 2}}),
    obj({"level": {"enum": [1, 2, 3]}}),
    obj({"answer": {"type": "string", "enum": ["yes", "no"]}, "confidence": {"type": "number", "minimum": 0,
                                                                              "maximum": 1}}),
    obj({"point": obj({"x": I, "y": I})}),
    obj({"status": {"const": "done"}}),
    obj({"name": S, "nick": S}, required=["name"]),
    obj({"matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}, "maxItems": 2},
                    "maxItems": 2}}),
    obj({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]}}),
    obj({"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}),
    obj({"price": {"type": "number", "minimum": 1, "maximum": 99}, "currency": {"enum": ["EUR", "USD"]}}),
    obj({"book": obj({"title": S, "year": {"type": "integer", "minimum": 1800, "maximum": 2030},
                      "genres": {"type": "array", "items": {"enum": ["sf", "crime", "poetry"]}, "maxItems": 2}})}),
    obj({"flags": obj({"a": {"type": "boolean"}, "b": {"type": "boolean"}}), "count": I}),
    obj({"word": {"type": "string", "minLength": 2, "maxLength": 5}}),
]


class Pet(BaseModel):
    name: str = Field(max_length=10)
    species: Literal["cat", "dog", "fish"]
    legs: int = Field(ge=0, le=8)


@pytest.fixture(scope="module")
def client(base_url: str):
    with httpx.Client(base_url=base_url, timeout=1200) as c:
        yield c


@pytest.fixture(scope="module")
def oai(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=1200)


def _chat_schema(client: httpx.Client, schema: dict) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "Reply in JSON."}], "max_tokens": 100, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}}
    return client.post("/v1/chat/completions", json=body)


def _json_object(oai: openai.OpenAI, stream: bool) -> str:
    # Free-form JSON lets a small model ramble inside a string; asking for a tiny object keeps it short.
    kwargs = dict(model="m", messages=[{"role": "user", "content": 'Reply with exactly this JSON: {"a": 1}'}],
                  max_tokens=100, temperature=0, response_format={"type": "json_object"})
    if stream:
        return "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    return oai.chat.completions.create(**kwargs).choices[0].message.content


def _parse(oai: openai.OpenAI) -> Any:
    parse = oai.chat.completions.parse if hasattr(oai.chat.completions, "parse") else oai.beta.chat.completions.parse
    return parse(model="m", messages=[{"role": "user", "content": "Invent a pet."}], response_format=Pet,
                 max_tokens=60, temperature=0)


def _generate(client: httpx.Client, sp: dict) -> str:
    r = client.post("/generate", json={"text": "Answer:", "sampling_params": {"temperature": 0,
                                                                               "max_new_tokens": 40, **sp}})
    assert r.status_code == 200, r.text
    return r.json()["text"]


@pytest.fixture(scope="module")
def results(client: httpx.Client, oai: openai.OpenAI) -> dict:
    """Every constrained request of this module at once, so the scheduler decodes them as one batch."""
    jobs = {f"schema{i}": (_chat_schema, client, s) for i, s in enumerate(SCHEMAS)}
    jobs.update({"json_object": (_json_object, oai, False), "json_object_stream": (_json_object, oai, True),
                 "parse": (_parse, oai),
                 "regex": (_generate, client, {"regex": r"[0-9]{3}-[a-z]{2}"}),
                 "ebnf": (_generate, client, {"ebnf": 'root ::= "yes" | "no" | "maybe"'}),
                 "json_schema": (_generate, client, {"json_schema": json.dumps(obj({"n": I}))})})
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {k: pool.submit(fn, *a) for k, (fn, *a) in jobs.items()}
        return {k: f.result() for k, f in futures.items()}


def test_many_schemas_validate(results: dict):
    assert len(SCHEMAS) >= 20
    for i, schema in enumerate(SCHEMAS):
        r = results[f"schema{i}"]
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop", (schema, choice)
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)


@pytest.mark.parametrize("key", ["json_object", "json_object_stream"])
def test_json_object(results: dict, key: str):
    assert isinstance(json.loads(results[key]), dict)


def test_openai_parse_helper_returns_object(results: dict):
    pet = results["parse"].choices[0].message.parsed
    assert isinstance(pet, Pet) and 0 <= pet.legs <= 8


def test_generate_regex_ebnf_and_schema(results: dict):
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", results["regex"])
    assert results["ebnf"] in ("yes", "no", "maybe")
    jsonschema.validate(json.loads(results["json_schema"]), obj({"n": I}))


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(4000)}}}}},
     "response_format"),
    ("/generate", {"sampling_params": {"regex": "(unclosed"}}, "regex"),
    ("/generate", {"sampling_params": {"ebnf": "root ::= missing_rule"}}, "ebnf"),
    ("/generate", {"sampling_params": {"json_schema": "{not json"}}, "json_schema"),
    ("/generate", {"sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}, "regex"),
])
def test_invalid_constraints_are_400(client: httpx.Client, path: str, body: dict, param: str):
    if path == "/generate":
        body = {"text": "x", **body}
    else:
        body = {"messages": [{"role": "user", "content": "x"}], **body}
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert client.get("/health").status_code == 200
