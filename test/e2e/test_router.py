"""sglang-router (the PyPI package, unmodified) in front of two hiserve replicas.

The test starts two replicas (`--enable-metrics --enable-cache-report`, as SGLang replicas
behind a router run) and `python -m sglang_router.launch_router --worker-urls A B --policy
cache_aware`, then checks that:
  * the router registers both replicas (it reads /health, /model_info, /server_info) and
    serves /health, /v1/models, /v1/completions, /v1/chat/completions and /generate;
  * multi-turn conversations through the router give the same greedy outputs (float32) as a
    replica computing every turn from scratch (its prefix cache flushed before each request),
    and from the second turn on hit the prefix cache of the replica that served the first
    (cache_aware keeps a conversation on one replica);
  * every routed request is served by one of the replicas (their sglang:num_requests_total
    grows by exactly the requests sent), and the router's own load report (/get_loads) is
    built from the replicas' /get_load.
Replicas without a shared storage tier here; test_storage_mooncake_replicas.py puts the router in
front of two replicas sharing one Mooncake Store (it reuses `start_router`). Skipped only when
sglang-router is not installed.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from server import find_free_port, kill, popen_launch_server

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None,
                                reason="sglang-router is not installed (pip install '.[test]')")

REPLICA_ARGS = ["--enable-metrics", "--enable-cache-report", "--max-total-tokens", 8192]
ROUTER_START_TIMEOUT = 120.0
CONVERSATIONS = [
    ["What is the capital of France?", "And of Italy?", "Which of the two is larger?"],
    ["Name a prime number.", "Name a bigger one.", "Is their sum even?"],
    ["Tell me a colour.", "Another one, please.", "Mix them: what do you get?"],
]
MAX_TOKENS = 10


def start_router(worker_urls: list[str]) -> tuple[subprocess.Popen, str]:
    """Run the router on free ports; wait until it lists every worker healthy."""
    port, prom_port = find_free_port(), find_free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
           "--worker-urls", *worker_urls, "--policy", "cache_aware",
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom_port), "--log-level", "warn"]
    log = tempfile.NamedTemporaryFile(prefix="sglang_router_", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    proc.log_path = log.name
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ROUTER_START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited with {proc.returncode}:\n{Path(log.name).read_text()[-3000:]}")
        try:
            workers = httpx.get(url + "/workers", timeout=5).json()["workers"]
            if len(workers) == len(worker_urls) and all(w["is_healthy"] for w in workers):
                return proc, url
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    kill(proc)
    raise TimeoutError(f"router did not register {worker_urls}:\n{Path(log.name).read_text()[-3000:]}")


@pytest.fixture(scope="module")
def replicas():
    with ThreadPoolExecutor(2) as pool:
        started = list(pool.map(lambda _: popen_launch_server(REPLICA_ARGS), range(2)))
    yield [url for _, url in started]
    for proc, _ in started:
        kill(proc)


ROUTER_LOG: dict[str, str] = {}  # router url -> its log file


@pytest.fixture(scope="module")
def router(replicas):
    proc, url = start_router(replicas)
    ROUTER_LOG[url] = proc.log_path
    yield url
    kill(proc)


def chat(url: str, messages: list[dict], flush: bool = False) -> dict:
    with httpx.Client(base_url=url, timeout=120) as c:
        if flush:
            assert c.post("/flush_cache").status_code == 200
        r = c.post("/v1/chat/completions", json={"model": "default", "messages": messages,
                                                 "max_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def requests_served(replicas: list[str]) -> list[float]:
    out = []
    for url in replicas:
        text = httpx.get(url + "/metrics", timeout=30).text
        out.append(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("sglang:num_requests_total{")))
    return out


def test_router_registers_replicas_and_serves_info_routes(router, replicas):
    assert httpx.get(router + "/health", timeout=30).status_code == 200
    models = httpx.get(router + "/v1/models", timeout=30).json()["data"]
    direct = httpx.get(replicas[0] + "/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in models] == [direct[0]["id"]]
    workers = httpx.get(router + "/workers", timeout=30).json()["workers"]
    assert sorted(w["url"] for w in workers) == sorted(replicas)


def test_multiturn_through_router_matches_recompute(router, replicas):
    before = requests_served(replicas)
    sent = 0
    for questions in CONVERSATIONS:
        messages: list[dict] = []
        previous_prompt = 0
        for turn, question in enumerate(questions):
            messages.append({"role": "user", "content": question})
            routed = chat(router, messages)
            sent += 1
            reference = chat(replicas[0], messages, flush=True)
            answer = routed["choices"][0]["message"]["content"]
            assert answer == reference["choices"][0]["message"]["content"], (questions, turn)
            usage = routed["usage"]
            # The previous turn's whole prompt is a prefix of this one: cache_aware sent this turn
            # to the replica holding it (a replica that had not seen the conversation would share
            # only the chat template's first tokens with it).
            assert usage["prompt_tokens_details"]["cached_tokens"] >= previous_prompt, (questions, turn, usage)
            previous_prompt = usage["prompt_tokens"]
            messages.append({"role": "assistant", "content": answer})
    after = requests_served(replicas)
    # The references are replica 0's own requests: 1 per routed one.
    assert sum(after) - sum(before) == 2 * sent, (before, after)


def test_completions_and_generate_through_router(router, replicas):
    prompt = "The three largest cities of Germany are"
    body = {"model": "default", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    routed = httpx.post(router + "/v1/completions", json=body, timeout=120).json()
    direct = httpx.post(replicas[1] + "/v1/completions", json=body, timeout=120).json()
    assert routed["choices"][0]["text"] == direct["choices"][0]["text"]
    native = {"text": prompt, "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0}}
    routed = httpx.post(router + "/generate", json=native, timeout=120).json()
    direct = httpx.post(replicas[1] + "/generate", json=native, timeout=120).json()
    assert routed["output_ids"] == direct["output_ids"] and routed["text"] == direct["text"]


def test_router_reads_replica_loads(router, replicas):
    """The router's /get_loads asks each replica's /get_load (num_tokens): a replica busy
    with a long request reports a load, an idle one 0."""
    body = {"text": "Count from one to a thousand:", "sampling_params": {
        "max_new_tokens": 150, "temperature": 0, "ignore_eos": True}}
    with ThreadPoolExecutor(1) as pool:
        busy = pool.submit(httpx.post, replicas[0] + "/generate", json=body, timeout=300)
        deadline = time.monotonic() + 60
        loads = {}
        while time.monotonic() < deadline and not busy.done():
            report = httpx.get(router + "/get_loads", timeout=30).json()
            loads = {w["worker"]: w["load"] for w in report["workers"]}
            if loads.get(replicas[0], 0) > 0:
                break
            time.sleep(0.2)
        assert busy.result().status_code == 200
    assert set(loads) == set(replicas)
    assert loads[replicas[0]] > 0 and loads[replicas[1]] == 0, loads
    for url in replicas:
        own = httpx.get(url + "/v1/loads", timeout=30).json()["loads"]
        assert len(own) == 1 and own[0]["dp_rank"] == 0 and own[0]["max_total_num_tokens"] > 0


def test_router_log_has_no_errors(router):
    """Nothing the replicas answered made the router log an error (its only warnings: it cannot
    load a tokenizer from a GGUF path, which it needs for none of these routes)."""
    errors = [line for line in Path(ROUTER_LOG[router]).read_text(errors="replace").splitlines() if " ERROR " in line]
    assert not errors, errors[:5]
