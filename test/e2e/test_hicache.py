"""Hierarchical cache end to end: multi-turn conversations that outgrow the device pool.

The module's server runs with `--enable-hierarchical-cache` and a small device pool; a set
of conversations (each round = the whole conversation so far + a new question, greedy,
ignore_eos) is run round-robin, so by the later rounds a conversation's earlier context has
been evicted from the device and only the host copy is left. The same conversations go to a
second server without the hierarchical cache (same pool, float32 on both); greedy outputs
must be identical, later rounds must report host hits, and after /flush_cache no device or
host slot may remain in use.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from server import kill, popen_launch_server

POOL_TOKENS = 2048
PAGE_SIZE = 16
COMMON_ARGS = ["--max-total-tokens", POOL_TOKENS, "--page-size", PAGE_SIZE]
SERVER_ARGS = [*COMMON_ARGS, "--enable-hierarchical-cache", "--hicache-ratio", 4, "--enable-metrics"]

NUM_CONVERSATIONS = 6
NUM_ROUNDS = 4
QUESTION_TOKENS = 150
OUTPUT_TOKENS = 16
# Each conversation ends near NUM_ROUNDS * (QUESTION_TOKENS + OUTPUT_TOKENS) = 664 tokens;
# all of them together (~4000) are about twice the device pool and fit the host pool (8192).


def _question(conv: int, rnd: int) -> list[int]:
    rng = np.random.default_rng([1234, conv, rnd])
    return rng.integers(1000, 30000, size=QUESTION_TOKENS).tolist()


def _generate(client: httpx.Client, ids: list[int]) -> dict:
    r = client.post("/generate", json={
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": OUTPUT_TOKENS, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["output_ids"]) == OUTPUT_TOKENS
    return out


def run_conversations(base_url: str, num_rounds: int = NUM_ROUNDS) -> list[list[dict]]:
    """Round-robin over the conversations, one request at a time (deterministic batches).

    Returns results[conv][round] = {"output_ids", "meta_info"}.
    """
    history: list[list[int]] = [[] for _ in range(NUM_CONVERSATIONS)]
    results: list[list[dict]] = [[] for _ in range(NUM_CONVERSATIONS)]
    with httpx.Client(base_url=base_url, timeout=300) as client:
        assert client.post("/flush_cache").status_code == 200
        for rnd in range(num_rounds):
            for conv in range(NUM_CONVERSATIONS):
                ids = history[conv] + _question(conv, rnd)
                out = _generate(client, ids)
                history[conv] = ids + out["output_ids"]
                results[conv].append({"output_ids": out["output_ids"], "meta_info": out["meta_info"]})
    return results


def _state(base_url: str) -> dict:
    return httpx.get(base_url + "/get_server_info", timeout=30).json()["internal_states"][0]


def _metric(base_url: str, name: str) -> float:
    text = httpx.get(base_url + "/metrics", timeout=30).text
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    assert seen, f"metric {name} not exported"
    return total


@pytest.fixture(scope="module")
def hicache_results(base_url: str) -> list[list[dict]]:
    return run_conversations(base_url)


@pytest.fixture(scope="module")
def baseline_results(hicache_results) -> list[list[dict]]:
    """The same conversations on a server without the hierarchical cache (started here,
    after the hicache run, so only one server computes at a time)."""
    proc, url = popen_launch_server(COMMON_ARGS)
    try:
        assert "host_total_size" not in _state(url)
        return run_conversations(url)
    finally:
        kill(proc)


def test_server_reports_host_pool(base_url):
    state = _state(base_url)
    assert state["max_total_num_tokens"] == POOL_TOKENS
    assert state["host_total_size"] >= 4 * POOL_TOKENS
    assert 0 <= state["host_available_size"] <= state["host_total_size"]


def test_later_rounds_hit_the_host(hicache_results):
    metas = [[r["meta_info"] for r in conv] for conv in hicache_results]
    for conv in metas:
        first = conv[0]
        assert first["cached_tokens_details"]["host"] == 0
        for m in conv:
            d = m["cached_tokens_details"]
            assert m["cached_tokens"] == d["device"] + d["host"]
            assert m["cached_tokens"] < m["prompt_tokens"]
    host_hits = [m["cached_tokens_details"]["host"] for conv in metas for m in conv[1:]]
    assert sum(1 for h in host_hits if h > 0) >= NUM_CONVERSATIONS // 2, host_hits
    # A host hit brings back (most of) the previous round's context: at least a few pages.
    assert max(host_hits) >= QUESTION_TOKENS, host_hits
    # In the last round each conversation's context (~500 tokens) was pushed out by the five
    # others (~2500 tokens > pool), so its prefix must come back from somewhere: nearly the
    # whole previous prompt + output is reported cached, on device or host.
    for conv in metas:
        last, prev = conv[-1], conv[-2]
        reusable = prev["prompt_tokens"] + OUTPUT_TOKENS - 1
        assert last["cached_tokens"] >= reusable - PAGE_SIZE, (last, prev)


def test_outputs_match_server_without_hicache(hicache_results, baseline_results):
    for conv, (ours, ref) in enumerate(zip(hicache_results, baseline_results)):
        for rnd, (a, b) in enumerate(zip(ours, ref)):
            assert a["meta_info"]["prompt_tokens"] == b["meta_info"]["prompt_tokens"]
            assert a["output_ids"] == b["output_ids"], (conv, rnd)
    # The baseline never has a host tier, and it loses evicted prefixes: it caches less.
    base_cached = sum(r["meta_info"]["cached_tokens"] for conv in baseline_results for r in conv)
    hi_cached = sum(r["meta_info"]["cached_tokens"] for conv in hicache_results for r in conv)
    assert all(r["meta_info"]["cached_tokens_details"]["host"] == 0
               for conv in baseline_results for r in conv)
    assert hi_cached > base_cached


def test_metrics_count_host_hits(base_url, hicache_results):
    host_total = sum(r["meta_info"]["cached_tokens_details"]["host"] for conv in hicache_results for r in conv)
    assert _metric(base_url, "sglang:cached_tokens_host_total") >= host_total > 0
    assert _metric(base_url, "sglang:hicache_host_total_tokens") >= 4 * POOL_TOKENS


def test_flush_frees_device_and_host(base_url, hicache_results):
    r = httpx.post(base_url + "/flush_cache", timeout=60)
    assert r.status_code == 200, r.text
    state = _state(base_url)
    assert state["available_size"] == state["max_total_num_tokens"], state
    assert state["evictable_size"] == 0 and state["protected_size"] == 0, state
    assert state["host_available_size"] == state["host_total_size"], state
    assert state["host_used_size"] == 0, state
    # Still serves correctly after the flush (the conversations' first round again).
    again = run_conversations(base_url, num_rounds=1)
    for conv in range(NUM_CONVERSATIONS):
        assert again[conv][0]["output_ids"] == hicache_results[conv][0]["output_ids"]
