"""--api-key: every route but /health* and /metrics needs `Authorization: Bearer <key>`."""

from __future__ import annotations

import httpx
import openai
import pytest

KEY = "sk-hiserve-test"
SERVER_ARGS = ["--api-key", KEY, "--skip-server-warmup", "--enable-metrics"]


@pytest.fixture(scope="module")
def client(base_url: str):
    with httpx.Client(base_url=base_url, timeout=120) as c:
        yield c


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_missing_or_wrong_key_is_401(client: httpx.Client, headers: dict):
    for method, path in [("GET", "/v1/models"), ("POST", "/generate"), ("POST", "/v1/chat/completions"),
                         ("GET", "/get_server_info"), ("POST", "/flush_cache")]:
        r = client.request(method, path, headers=headers, json={})
        assert r.status_code == 401, (path, r.text)
        assert r.json() == {"error": "Unauthorized"}


def test_exempt_routes(client: httpx.Client):
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200


def test_right_key(client: httpx.Client, base_url: str):
    r = client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200
    oai = openai.OpenAI(base_url=base_url + "/v1", api_key=KEY, max_retries=0)
    out = oai.chat.completions.create(model="any", messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    assert out.usage.completion_tokens == 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base_url + "/v1", api_key="nope", max_retries=0).models.list()
