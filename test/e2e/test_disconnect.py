"""A client that goes away mid-request gets its request aborted, and the KV pool comes back."""

from __future__ import annotations

import time

import httpx
import pytest

LONG = {"max_new_tokens": 2000, "ignore_eos": True}


@pytest.fixture(scope="module")
def client(base_url: str):
    with httpx.Client(base_url=base_url, timeout=120) as c:
        yield c


def _kv_state(client: httpx.Client) -> dict:
    return client.get("/get_server_info").json()["internal_states"][0]


def _wait_until_kv_free(client: httpx.Client, timeout: float = 30.0) -> dict:
    """Poll until no request holds KV: every slot is free or only held by the prefix cache."""
    deadline = time.monotonic() + timeout
    while True:
        state = _kv_state(client)
        if state["available_tokens"] == state["max_total_num_tokens"]:
            return state
        assert time.monotonic() < deadline, f"KV still held {timeout} s after the disconnect: {state}"
        time.sleep(0.5)


def _assert_flush_frees_everything(client: httpx.Client) -> None:
    r = client.post("/flush_cache")
    assert r.status_code == 200, r.text
    state = _kv_state(client)
    assert state["available_size"] == state["max_total_num_tokens"]


def test_stream_disconnect_frees_kv(client: httpx.Client):
    body = {"text": "Tell me a long story about a dragon.", "stream": True, "sampling_params": LONG}
    with client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen += 1
                if seen == 2:
                    break  # leaving the block closes the connection mid-stream
    state = _wait_until_kv_free(client)
    assert state.get("num_running_reqs", 0) == 0
    _assert_flush_frees_everything(client)


def test_openai_stream_disconnect_frees_kv(client: httpx.Client):
    body = {"messages": [{"role": "user", "content": "Count to one thousand."}], "stream": True,
            "max_tokens": 2000, "ignore_eos": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if '"content":"' in line and '"role"' not in line:
                break
    _wait_until_kv_free(client)
    _assert_flush_frees_everything(client)


def test_non_stream_disconnect_frees_kv(client: httpx.Client):
    body = {"text": "Write an essay about the sea.", "sampling_params": LONG}
    with pytest.raises(httpx.ReadTimeout):
        client.post("/generate", json=body, timeout=3.0)
    _wait_until_kv_free(client)
    _assert_flush_frees_everything(client)


def test_flush_refused_while_busy(client: httpx.Client):
    body = {"text": "Hello", "stream": True, "sampling_params": LONG}
    with client.stream("POST", "/generate", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                assert client.post("/flush_cache").status_code == 400
                break
    _wait_until_kv_free(client)
    assert client.get("/flush_cache").status_code == 200
