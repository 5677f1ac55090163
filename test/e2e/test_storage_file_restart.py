"""The `file` storage tier end to end: a restart on the same directory serves prefixes from L3.

Server A (hierarchical cache, `--hicache-storage-backend file` in a temp directory, small
pools, `--enable-cache-integrity-check`) runs a few multi-turn conversations (greedy,
ignore_eos); its pages are written through to the directory. /flush_cache waits for the
storage worker, then A is stopped. Server B starts on the same directory with empty device
and host pools and runs the same conversations: every output is identical, and each
conversation's prompts report `cached_tokens_details.storage` > 0 (prefetched L3 → host at
queue entry, loaded back to the device at admission), counted in `cached_tokens`, in
/metrics (`sglang:cached_tokens_total{cache_source="storage"}`, `sglang:prefetched_tokens_total`)
and in /get_server_info's storage state.
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from server import kill, popen_launch_server

PAGE_SIZE = 16
NUM_CONVERSATIONS = 3
NUM_ROUNDS = 3
QUESTION_TOKENS = 96
OUTPUT_TOKENS = 8


def _args(storage_dir: str) -> list:
    extra = {"file_storage_path": storage_dir, "prefetch_threshold": 32}
    return ["--max-total-tokens", 1024, "--page-size", PAGE_SIZE, "--enable-hierarchical-cache",
            "--hicache-ratio", 2, "--hicache-storage-backend", "file",
            "--hicache-storage-backend-extra-config", json.dumps(extra), "--enable-cache-integrity-check", "--enable-metrics"]


def _question(conv: int, rnd: int) -> list[int]:
    return np.random.default_rng([4321, conv, rnd]).integers(1000, 30000, size=QUESTION_TOKENS).tolist()


def _conversations(base_url: str) -> list[list[dict]]:
    """Round-robin, one request at a time; results[conv][round] = {output_ids, meta_info}."""
    history: list[list[int]] = [[] for _ in range(NUM_CONVERSATIONS)]
    results: list[list[dict]] = [[] for _ in range(NUM_CONVERSATIONS)]
    with httpx.Client(base_url=base_url, timeout=300) as client:
        for rnd in range(NUM_ROUNDS):
            for conv in range(NUM_CONVERSATIONS):
                ids = history[conv] + _question(conv, rnd)
                r = client.post("/generate", json={"input_ids": ids, "sampling_params": {
                    "max_new_tokens": OUTPUT_TOKENS, "temperature": 0, "ignore_eos": True}})
                assert r.status_code == 200, r.text
                out = r.json()
                history[conv] = ids + out["output_ids"]
                results[conv].append({"output_ids": out["output_ids"], "meta_info": out["meta_info"]})
    return results


def _info(base_url: str) -> dict:
    return httpx.get(base_url + "/get_server_info", timeout=30).json()


def _metrics(base_url: str, name: str) -> dict[str, float]:
    """Samples of one metric, keyed by their label text."""
    out = {}
    for line in httpx.get(base_url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            labels, value = line[len(name):].rsplit(" ", 1)
            out[labels] = float(value)
    return out


def _run_server(storage_dir: str) -> tuple[list[list[dict]], dict, dict]:
    """Start a server on `storage_dir`, run the conversations, flush (which waits for the
    storage worker), and return (results, server info after the run, metrics)."""
    proc, url = popen_launch_server(_args(storage_dir))
    try:
        info = _info(url)
        assert info["enable_cache_integrity_check"] is True
        assert info["hicache_storage_backend"] == "file"
        results = _conversations(url)
        r = httpx.post(url + "/flush_cache", timeout=120)
        assert r.status_code == 200, r.text
        state = _info(url)["internal_states"][0]
        metrics = {name: _metrics(url, name) for name in (
            "sglang:cached_tokens_total", "sglang:prefetched_tokens_total", "sglang:backuped_tokens_total",
            "sglang:storage_failures_total")}
        return results, state, metrics
    finally:
        kill(proc)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple:
    storage_dir = str(tmp_path_factory.mktemp("hicache_storage"))
    first = _run_server(storage_dir)
    second = _run_server(storage_dir)  # a restart: empty device and host pools
    return first, second


def test_restart_outputs_identical(runs):
    (a, _, _), (b, _, _) = runs
    for conv, (ra, rb) in enumerate(zip(a, b)):
        for rnd, (x, y) in enumerate(zip(ra, rb)):
            assert x["output_ids"] == y["output_ids"], (conv, rnd)
            assert x["meta_info"]["prompt_tokens"] == y["meta_info"]["prompt_tokens"]


def test_first_server_writes_through_and_second_hits_storage(runs):
    (a, state_a, metrics_a), (b, state_b, metrics_b) = runs
    for conv in a:
        for r in conv:
            assert r["meta_info"]["cached_tokens_details"]["storage"] == 0
    assert state_a["storage"]["backend"] == "file"
    assert state_a["storage"]["backuped_tokens_total"] > 0
    assert state_a["storage"]["ops_in_flight"] == 0 and state_a["storage"]["prefetch_ops"] == 0
    for conv in b:
        details = [r["meta_info"]["cached_tokens_details"] for r in conv]
        assert details[0]["storage"] >= QUESTION_TOKENS - 2 * PAGE_SIZE, details
        for r in conv:
            m, d = r["meta_info"], r["meta_info"]["cached_tokens_details"]
            assert m["cached_tokens"] == d["device"] + d["host"] + d["storage"]
    storage_b = sum(r["meta_info"]["cached_tokens_details"]["storage"] for conv in b for r in conv)
    assert state_b["storage"]["prefetched_tokens_total"] >= storage_b > 0
    cached = metrics_b["sglang:cached_tokens_total"]
    assert sum(v for k, v in cached.items() if 'cache_source="storage"' in k) == storage_b
    assert sum(metrics_b["sglang:prefetched_tokens_total"].values()) >= storage_b
    # Everything B computed was already stored by A except its new outputs' pages.
    assert sum(metrics_a["sglang:backuped_tokens_total"].values()) > sum(
        metrics_b["sglang:backuped_tokens_total"].values())
    assert not metrics_a["sglang:storage_failures_total"] and not metrics_b["sglang:storage_failures_total"]
