"""The `mooncake` storage tier end to end: two servers share one Mooncake Store.

A real `mooncake_master` (loopback ports, HTTP metadata server; `test/unit/mooncake_fixture.py`)
and two hiserve servers A and B (float32, greedy, hierarchical cache, `--hicache-storage-backend
mooncake` pointed at it, each lending a small `global_segment_size` to the store,
`--hicache-storage-prefetch-policy wait_complete` so a storage hit is never cut short by a slow
machine, `--enable-cache-integrity-check`, `--enable-metrics`). One module, three phases, in order:

1. Shared prefixes: conversations run on A (written through to the store; A's /flush_cache waits
   for its storage worker), then the same conversations on B: every turn reports
   `cached_tokens_details.storage` > 0 (pages A computed, read over TCP from the segment they were
   placed in) and B's greedy outputs equal A's.
2. Master killed mid-run: both caches flushed, the same conversations run on A and B at once and
   the master is SIGKILLed after the first replies. Every request still succeeds with A's outputs
   (after the kill nothing comes from the store: a recompute), and each server counts
   `sglang:storage_failures_total{reason="unavailable"}` and reports the store disconnected.
3. Master restarted on the same ports (empty): both clients reconnect by themselves, and new
   conversations computed on A are storage hits on B again, with identical outputs.

Then behind sglang-router (cache_aware, the PyPI package unmodified) in front of A and B:
multi-turn conversations through it give the outputs each replica computes alone, and a
conversation whose first turn A computed continues on B with its prefix from the store. That
move is forced deterministically with the router's worker API: turn 1 is routed while A is the
router's only worker, then A leaves the pool (as a drained or scaled-in replica would) and B
joins, so cache_aware has exactly one candidate for turn 2 (no reliance on its tie-breaking).

Skipped only when the Mooncake wheel or its system library (libibverbs1) is missing.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from server import kill, popen_launch_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from mooncake_fixture import MooncakeMaster, mooncake_unavailable  # noqa: E402

SKIP = mooncake_unavailable()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")

PAGE_SIZE = 16
NUM_CONVERSATIONS = 2
NUM_ROUNDS = 3
QUESTION_TOKENS = 64
OUTPUT_TOKENS = 6
SEGMENT_BYTES = 96 * 1024**2  # each replica lends this much to the store (pages are ~23 KB/token)
RECONNECT_TIMEOUT_S = 60.0
KILL_AT = 3  # phase 2: the master dies before the 4th of the 12 requests


def replica_args(master: MooncakeMaster) -> list:
    extra = master.extra_config(global_segment_size=SEGMENT_BYTES, prefetch_threshold=PAGE_SIZE,
                                connect_retry_interval=0.5)
    return ["--max-total-tokens", 1024, "--page-size", PAGE_SIZE, "--enable-hierarchical-cache",
            "--hicache-ratio", 2, "--hicache-storage-backend", "mooncake",
            "--hicache-storage-prefetch-policy", "wait_complete",
            "--hicache-storage-backend-extra-config", json.dumps(extra),
            "--enable-cache-integrity-check", "--enable-metrics"]


def question(seed: int, conv: int, rnd: int) -> list[int]:
    return np.random.default_rng([seed, conv, rnd]).integers(1000, 30000, size=QUESTION_TOKENS).tolist()


def generate(client: httpx.Client, ids: list[int]) -> dict:
    r = client.post("/generate", json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": OUTPUT_TOKENS, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()


def conversations(url: str, seed: int, before_request=None) -> list[list[dict]]:
    """Round-robin over the conversations, one request at a time; results[conv][round] =
    {output_ids, meta_info, order} (`order`: what `before_request()` returned before it was sent)."""
    history: list[list[int]] = [[] for _ in range(NUM_CONVERSATIONS)]
    results: list[list[dict]] = [[] for _ in range(NUM_CONVERSATIONS)]
    with httpx.Client(base_url=url, timeout=300) as client:
        for rnd in range(NUM_ROUNDS):
            for conv in range(NUM_CONVERSATIONS):
                ids = history[conv] + question(seed, conv, rnd)
                order = before_request() if before_request else 0
                out = generate(client, ids)
                history[conv] = ids + out["output_ids"]
                results[conv].append({"output_ids": out["output_ids"], "meta_info": out["meta_info"],
                                      "order": order})
    return results


def flush(url: str) -> None:
    """/flush_cache: empties device and host pools after the storage worker is idle."""
    r = httpx.post(url + "/flush_cache", timeout=120)
    assert r.status_code == 200, r.text


def storage_state(url: str) -> dict:
    return httpx.get(url + "/get_server_info", timeout=30).json()["internal_states"][0]["storage"]


def failures(url: str) -> dict[str, float]:
    """sglang:storage_failures_total by reason."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("sglang:storage_failures_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('reason="', 1)[1].split('"', 1)[0]] = float(value)
    return out


def outputs(results: list[list[dict]]) -> list[list[list[int]]]:
    return [[r["output_ids"] for r in conv] for conv in results]


def storage_tokens(results: list[list[dict]]) -> list[list[int]]:
    return [[r["meta_info"]["cached_tokens_details"]["storage"] for r in conv] for conv in results]


@pytest.fixture(scope="module")
def cluster():
    master = MooncakeMaster().start()
    started = []
    try:
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(popen_launch_server, replica_args(master)) for _ in range(2)]
            for f in futures:
                started.append(f.result())
        yield master, [url for _, url in started]
    finally:
        for proc, _ in started:
            kill(proc)
        master.stop()


@pytest.fixture(scope="module")
def shared_run(cluster) -> dict:
    """Phase 1: the conversations on A, A flushed (its backups done), then on B."""
    _, (a, b) = cluster
    for url in (a, b):
        state = storage_state(url)
        assert state["backend"] == "mooncake" and state["connected"], state
    on_a = conversations(a, seed=1)
    flush(a)
    on_b = conversations(b, seed=1)
    return {"a": on_a, "b": on_b, "state_a": storage_state(a), "state_b": storage_state(b)}


def test_prefixes_computed_on_a_are_storage_hits_on_b(shared_run):
    assert outputs(shared_run["b"]) == outputs(shared_run["a"])
    assert all(s == 0 for conv in storage_tokens(shared_run["a"]) for s in conv)
    for conv, hits in enumerate(storage_tokens(shared_run["b"])):
        # Round 1: A stored the question's full pages (the last prompt token is never matched);
        # later rounds: the pages past what B's own tree holds (A's previous output + question).
        assert hits[0] >= QUESTION_TOKENS - PAGE_SIZE, (conv, hits)
        assert all(h >= QUESTION_TOKENS - 2 * PAGE_SIZE for h in hits[1:]), (conv, hits)
    for conv in shared_run["b"]:
        for r in conv:
            m, d = r["meta_info"], r["meta_info"]["cached_tokens_details"]
            assert m["cached_tokens"] == d["device"] + d["host"] + d["storage"]
    assert shared_run["state_a"]["backuped_tokens_total"] > 0 and shared_run["state_a"]["pages_written"] > 0
    assert shared_run["state_b"]["pages_read"] > 0 and not shared_run["state_b"]["failures"]


def test_master_killed_mid_run_requests_recompute(cluster, shared_run):
    master, (a, b) = cluster
    for url in (a, b):
        flush(url)
    sent = 0
    lock = threading.Lock()
    killed = threading.Event()

    def before_request() -> int:
        """Number the requests of both servers; kill the master before the KILL_AT-th (by
        then at least one has been answered: each server sends one request at a time)."""
        nonlocal sent
        with lock:
            if sent == KILL_AT:
                master.kill()
                killed.set()
            sent += 1
            return sent - 1

    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda url: conversations(url, seed=1, before_request=before_request), (a, b)))
    assert killed.is_set()
    want = outputs(shared_run["a"])
    for url, results in zip((a, b), runs):
        assert outputs(results) == want, url  # the same greedy tokens, stored prefix or not
        late = [r for conv in results for r in conv if r["order"] >= KILL_AT]
        assert late and all(r["meta_info"]["cached_tokens_details"]["storage"] == 0 for r in late)
        state = storage_state(url)
        assert not state["connected"], state
        assert failures(url).get("unavailable", 0) > 0, failures(url)
        assert httpx.get(url + "/health", timeout=30).status_code == 200


def test_master_restarted_storage_hits_resume(cluster, shared_run):
    master, (a, b) = cluster
    if master.proc is None or master.proc.poll() is None:
        master.kill()  # runs alone: the restart below is what this test checks
    master.start()
    deadline = time.monotonic() + RECONNECT_TIMEOUT_S
    while not all(storage_state(url)["connected"] for url in (a, b)):
        assert time.monotonic() < deadline, [storage_state(url) for url in (a, b)]
        time.sleep(0.5)
    on_a = conversations(a, seed=2)  # new prefixes: the restarted master is empty
    flush(a)
    on_b = conversations(b, seed=2)
    assert outputs(on_b) == outputs(on_a)
    for conv, hits in enumerate(storage_tokens(on_b)):
        assert all(h >= QUESTION_TOKENS - 2 * PAGE_SIZE for h in hits), (conv, hits)


# ---------------------------------------------------------------- behind sglang-router (issue item 8)


@pytest.fixture(scope="module")
def router(cluster):
    """sglang-router (cache_aware) in front of A and B (they share the store)."""
    if importlib.util.find_spec("sglang_router") is None:
        pytest.skip("sglang-router is not installed (pip install '.[test]')")
    from test_router import start_router

    _, replicas = cluster
    proc, url = start_router(replicas)
    yield url
    kill(proc)


def requests_served(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("sglang:num_requests_total{"))


def router_workers(router_url: str) -> list[dict]:
    return httpx.get(router_url + "/workers", timeout=30).json()["workers"]


def set_router_workers(router_url: str, urls: list[str]) -> None:
    """Make the router's worker list exactly `urls` (its worker API: DELETE /workers/{id},
    POST /workers {"url"}) and wait until it lists them, healthy."""
    for w in router_workers(router_url):
        if w["url"] not in urls:
            r = httpx.delete(f"{router_url}/workers/{w['id']}", timeout=30)
            assert r.status_code < 300, r.text
    for url in urls:
        if url not in [w["url"] for w in router_workers(router_url)]:
            r = httpx.post(router_url + "/workers", json={"url": url}, timeout=30)
            assert r.status_code < 300, r.text
    deadline = time.monotonic() + 60
    while True:
        workers = router_workers(router_url)
        if sorted(w["url"] for w in workers) == sorted(urls) and all(w["is_healthy"] for w in workers):
            return
        assert time.monotonic() < deadline, workers
        time.sleep(0.2)


def test_router_multiturn_outputs_identical(cluster, router):
    """Conversations through the router (cache_aware, both replicas, input_ids on /generate)
    give the greedy outputs each replica computes alone; every request reaches a replica."""
    _, (a, b) = cluster
    before = requests_served(a) + requests_served(b)
    routed = conversations(router, seed=3)
    assert requests_served(a) + requests_served(b) - before == NUM_CONVERSATIONS * NUM_ROUNDS
    assert outputs(conversations(a, seed=3)) == outputs(routed)
    assert outputs(conversations(b, seed=3)) == outputs(routed)


def test_router_next_turn_on_other_replica_hits_storage(cluster, router):
    """Turn 1 of a conversation is routed while A is the router's only worker; A's pages are
    written through (A's /flush_cache waits for that); then A leaves the router's pool (as a
    drained or scaled-in replica does) and B joins, so turn 2 is routed to B, deterministically
    (cache_aware has one candidate; no reliance on its tie-breaking): B reports the prefix A
    computed as storage hits, and its output equals a recompute on A."""
    _, (a, b) = cluster
    turn1 = question(4, 0, 0)
    try:
        set_router_workers(router, [a])
        served = requests_served(a), requests_served(b)
        with httpx.Client(base_url=router, timeout=300) as client:
            first = generate(client, turn1)
        assert (requests_served(a) - served[0], requests_served(b) - served[1]) == (1, 0)
        flush(a)
        set_router_workers(router, [b])
        turn2 = turn1 + first["output_ids"] + question(4, 0, 1)
        served = requests_served(a), requests_served(b)
        with httpx.Client(base_url=router, timeout=300) as client:
            second = generate(client, turn2)
        assert (requests_served(a) - served[0], requests_served(b) - served[1]) == (0, 1)
    finally:
        set_router_workers(router, [a, b])
    details = second["meta_info"]["cached_tokens_details"]
    # A stored the full pages of turn 1's prompt and output; B held none of it.
    assert details["storage"] >= (len(turn1) + OUTPUT_TOKENS) // PAGE_SIZE * PAGE_SIZE - PAGE_SIZE, details
    assert details["device"] == details["host"] == 0, details
    flush(a)
    with httpx.Client(base_url=a, timeout=300) as client:
        assert generate(client, turn2)["output_ids"] == second["output_ids"]
