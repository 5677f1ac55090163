"""Request bodies are parsed by orjson on every route (`route_helpers.OrjsonRoute`): syntax
errors are still a 400 naming the problem, schema errors a 400 naming the parameter, and the
stricter grammar (no NaN literal, json.loads would take it) shows orjson is the parser."""

from __future__ import annotations

import pytest
from api_app import make_app


@pytest.fixture
def client():
    tm, client = make_app()
    yield client
    tm._send_sock.close(linger=0)


# (path, body with a %s for a value of `param`, param); '"x"' is of the wrong type for it
ROUTES = [("/generate", '{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": %s}}', "max_new_tokens"),
          ("/v1/chat/completions", '{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": %s}',
           "max_tokens"),
          ("/v1/completions", '{"model": "m", "prompt": "hi", "max_tokens": %s}', "max_tokens")]


@pytest.mark.parametrize("path, template, param", ROUTES)
def test_body_syntax_and_schema_errors(client, path, template, param):
    headers = {"Content-Type": "application/json"}
    r = client.post(path, content=(template % "1.0")[:-3], headers=headers)  # cut short
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"], r.text
    r = client.post(path, content=template % "NaN", headers=headers)  # json.loads accepts NaN, orjson not
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"], r.text
    r = client.post(path, content=template % '"x"', headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
