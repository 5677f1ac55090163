"""One request cannot take the server down (issue 13, items 6-9).

A hostile set of requests (huge fan-out, huge sizes, deep nesting, invalid UTF-8) gets 400s
naming the parameter before any work, and leaves the server's memory where it was; bodies
over --max-request-body-bytes get 413 without being read whole; /health and a small
/generate answer while a 20 MB request is being refused; the metrics read 0 when idle; a
streaming client that leaves during a long prefill is aborted (and counted) at once; the
API key never reaches the log.
"""

from __future__ import annotations

import json
import re
import statistics
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from server import kill, popen_launch_server

KEY = "sk-limits-test-7f3a9c"
BODY_LIMIT = 4_000_000
MAX_RUNNING = 8
CHUNK = 128
AUTH = {"Authorization": f"Bearer {KEY}"}
SERVER_ARGS = ["--api-key", KEY, "--max-request-body-bytes", BODY_LIMIT, "--max-running-requests", MAX_RUNNING,
               "--chunked-prefill-size", CHUNK, "--enable-hierarchical-cache", "--hicache-ratio", 2,
               "--max-total-tokens", 16384, "--enable-metrics"]
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server():
    # One compute thread: the hammering test below shares a 2-core CI machine with the server,
    # and a two-thread OpenMP team ends each parallel region only when both threads get a
    # time slice: a one-token forward then took ~1.3 s now and then (3 of 24 probes, the rest
    # ~0.17 s; with one thread the worst of 24 was 0.13 s). These tests are about the API
    # process, not the scheduler's thread count.
    proc, url = popen_launch_server(SERVER_ARGS, env={"OMP_NUM_THREADS": "1"})
    yield proc, url
    kill(proc)


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server[1], timeout=120, headers=AUTH) as c:
        yield c


def _rss_mb(proc) -> float:
    """Resident memory of the server: the API process and its scheduler child."""
    p = psutil.Process(proc.pid)
    return sum(q.memory_info().rss for q in [p, *p.children(recursive=True)]) / 2**20


def _error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["code"] == status and err["message"]
    return err


def _metric(client: httpx.Client, name: str) -> float:
    text = client.get("/metrics").text
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def _nested(depth: int) -> bytes:
    return b'{"prompt": "Hi", "chat_template_kwargs": ' + b"[" * depth + b"]" * depth + b"}"


HOSTILE = [
    # (route, json body or raw bytes, expected param)
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 1_000_000}, "n"),
    ("/v1/completions", {"prompt": "Hi", "n": MAX_RUNNING + 1}, "n"),
    ("/v1/completions", {"prompt": "Hi", "best_of": 10**9, "n": 1}, "best_of"),
    ("/v1/completions", {"prompt": ["Hi"] * (MAX_RUNNING + 1)}, "prompt"),
    ("/v1/completions", {"prompt": ["Hi"] * 3, "n": 3}, "n"),
    ("/generate", {"text": ["Hi"] * 100_000}, "text"),
    ("/generate", {"input_ids": [[1, 2]] * 2, "sampling_params": {"n": MAX_RUNNING}}, "n"),
    ("/v1/completions", {"prompt": "Hi", "stop": ["x"] * 100_000}, "stop"),
    ("/generate", {"text": "Hi", "sampling_params": {"stop": [str(i) for i in range(33)]}}, "stop"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {str(i): 1.0 for i in range(100_000)}}, "logit_bias"),
    ("/generate", {"text": "Hi", "sampling_params": {"json_schema": "{" * 100_000}}, "json_schema"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 10**12}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 10**30}, "max_tokens"),
    ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 10**12}}, "max_new_tokens"),
    ("/v1/completions", {"prompt": "hello " * 40_000}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "é" * 200_000}]}, "messages"),
    ("/generate", {"text": "x" * 3_900_000}, "text"),
    ("/v1/completions", _nested(100_000), None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', None),
]


def _send(client: httpx.Client, route: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return client.post(route, content=body, headers={"content-type": "application/json"})
    return client.post(route, json=body)


def test_hostile_set_is_refused_and_memory_stays(server, client: httpx.Client):
    proc, _ = server
    # Warm every path once, so the baseline includes what any first request allocates.
    for _ in range(2):
        assert client.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}}).status_code == 200
        _send(client, *HOSTILE[-1][:2])
    before = _rss_mb(proc)
    for route, body, param in HOSTILE:
        err = _error(_send(client, route, body))
        assert err["param"] == param, (route, err)
    after = _rss_mb(proc)
    assert after <= before * 1.10, f"RSS grew from {before:.0f} MB to {after:.0f} MB"
    assert client.get("/health").status_code == 200


def test_body_over_limit_is_413_before_it_is_read(client: httpx.Client):
    # Announced size: refused from the header.
    r = client.post("/generate", content=b"{" + b" " * BODY_LIMIT + b"}",
                    headers={"content-type": "application/json"})
    assert _error(r, 413)["message"].endswith("(--max-request-body-bytes).")

    # Unannounced size (chunked): refused once the bytes read pass the limit; the sender is
    # cut off long before it has sent 4x the limit.
    sent = 0

    def chunks():
        nonlocal sent
        yield b'{"text": "'
        for _ in range(4 * BODY_LIMIT // 65536):
            sent += 65536
            yield b"a" * 65536
        yield b'"}'

    try:
        r = client.post("/generate", content=chunks(), headers={"content-type": "application/json"})
        _error(r, 413)
    except httpx.HTTPError:
        pass  # the server may close the connection while we still send
    assert sent < 4 * BODY_LIMIT


def test_wrong_method_is_405_with_allow(client: httpx.Client):
    r = client.get("/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    r = client.delete("/generate")
    assert r.status_code == 405 and r.json()["error"]["code"] == 405
    assert set(r.headers["allow"].replace(" ", "").split(",")) == {"POST", "PUT"}


def _probe(client: httpx.Client, rounds: int = 7) -> tuple[float, list[float]]:
    """Worst latency of /health and every latency of a 1-token /generate over `rounds`
    tries (seconds)."""
    health, generate = 0.0, []
    for _ in range(rounds):
        t = time.monotonic()
        assert client.get("/health").status_code == 200
        health = max(health, time.monotonic() - t)
        t = time.monotonic()
        r = client.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 200
        generate.append(time.monotonic() - t)
    return health, generate


def test_server_answers_while_a_huge_request_is_refused(server, client: httpx.Client):
    """/health within 1 s, and a small /generate within 1 s of its idle latency (median) and
    never frozen (worst case), while 20 MB bodies and a 4 MB prompt are being refused (it was
    an 11 s freeze of the event loop). The generation's own time is measured idle first.

    Why a median as well as the worst case: the hammering client and the API process keep
    both cores of a 2-core CI machine busy, so one probe can lose its core for a while; a
    freeze shows in every probe."""
    _, idle = _probe(client)
    idle_generate = statistics.median(idle)
    big_streamed = b'{"text": "' + b"b" * 20_000_000 + b'"}'
    under_limit = json.dumps({"text": "word " * (BODY_LIMIT // 5 - 100)}).encode()
    stop = threading.Event()
    refused = []

    def hammer():
        with httpx.Client(base_url=server[1], timeout=120, headers=AUTH) as c:
            while not stop.is_set():
                for body in (big_streamed, under_limit):
                    parts = [body[i:i + (1 << 20)] for i in range(0, len(body), 1 << 20)]
                    try:
                        r = c.post("/generate", content=iter(parts), headers={"content-type": "application/json"})
                        refused.append(r.status_code)
                    except httpx.HTTPError:
                        refused.append(None)  # cut off while sending: refused too

    worker = threading.Thread(target=hammer)
    worker.start()
    try:
        time.sleep(0.5)
        health, generate = _probe(client)
    finally:
        stop.set()
        worker.join()
    assert set(refused) <= {413, 400, None} and 400 in refused, refused
    assert health < 1.0, f"/health took {health:.2f} s while huge requests were refused"
    shown = ", ".join(f"{g:.2f}" for g in generate)
    assert statistics.median(generate) < idle_generate + 1.0, \
        f"small /generates took {shown} s (idle median {idle_generate:.2f} s) while huge requests were refused"
    assert max(generate) < idle_generate + 5.0, f"a small /generate froze: {shown} s"


def test_metrics_read_zero_when_idle(client: httpx.Client):
    for i in range(3):
        r = client.post("/generate", json={"text": f"Count to {i}", "sampling_params": {"max_new_tokens": 8}})
        assert r.status_code == 200
    assert _metric(client, "sglang:hicache_host_total_tokens") > 0
    assert client.post("/flush_cache").status_code == 200
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:num_used_tokens",
                 "sglang:token_usage", "sglang:hicache_host_used_tokens"):
        assert _metric(client, name) == 0, name


def test_stream_disconnect_before_first_token_aborts_prefill(server, client: httpx.Client):
    """A client that leaves during a long chunked prefill is counted as aborted, and the scheduler
    stops the prefill at once instead of running every remaining chunk."""
    proc, url = server
    n_chunks = 60
    ids = [(i * 7919) % 30000 + 100 for i in range(CHUNK * n_chunks)]
    aborted = _metric(client, "sglang:num_aborted_requests_total")
    log = Path(proc.log_path)
    log_start = len(log.read_text(errors="replace"))
    with httpx.Client(base_url=url, headers=AUTH, timeout=httpx.Timeout(60, read=1.0)) as c:
        with pytest.raises(httpx.ReadTimeout):  # leaves after 1 s, long before the first token
            with c.stream("POST", "/generate", json={"input_ids": ids, "stream": True,
                                                     "sampling_params": {"max_new_tokens": 4}}) as r:
                r.read()
    deadline = time.monotonic() + 60
    while _metric(client, "sglang:num_aborted_requests_total") < aborted + 1:
        assert time.monotonic() < deadline, "the disconnect was not counted"
        time.sleep(0.2)
    while client.get("/get_server_info").json()["internal_states"][0]["num_running_reqs"]:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    time.sleep(1.0)
    prefills = log.read_text(errors="replace")[log_start:].count(f"#new-token: {CHUNK},")
    assert prefills < n_chunks, f"all {prefills} prefill chunks ran after the client left"


def test_api_key_is_never_logged(server, client: httpx.Client):
    assert client.get("/get_server_info").json()["api_key"] == "<redacted>"
    assert KEY not in Path(server[0].log_path).read_text(errors="replace")
