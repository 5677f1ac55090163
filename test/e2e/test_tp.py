"""Tensor parallelism end to end on the CPU: 2 ranks joined by gloo on tiny dummy models.

Greedy float32 outputs of `--tp-size 2` must equal `--tp-size 1` (the dummy weights of each
rank are slices of TP=1's), for a tiny Llama (2 query heads, 1 KV head: the KV head is
replicated) and a tiny MLA + MoE model, with and without the host tier. The workload is a set of
multi-turn conversations run one request at a time over a small device pool, so later turns
hit their prefix on the device (TP=1/TP=2 alike) or, with `--enable-hierarchical-cache`, on the
host (load-back, checked in `meta_info.cached_tokens_details`). Every server runs with
`--enable-cache-integrity-check`: each rank checks its hierarchy every iteration and the
ranks compare their states (a failure kills the rank, which stops the server); each scenario
ends with the server alive, a concurrent burst served, and /flush_cache leaving every slot
free. One test SIGKILLs rank 1 and checks the server exits with a clear error in bounded time;
one serves the real default GGUF model at TP 3 (its 9 heads do not split in 2) against an
in-process TP=1 scheduler.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from hiserve.testing.dummy_model import write_dummy_model
from server import kill, popen_launch_server

PAGE_SIZE = 16
COMMON = ["--load-format", "dummy", "--page-size", PAGE_SIZE, "--max-total-tokens", 384,
          "--enable-cache-integrity-check", "--attention-backend", "torch_native"]
HICACHE = ["--enable-hierarchical-cache", "--hicache-ratio", 4]
NUM_CONVERSATIONS, NUM_ROUNDS, QUESTION_TOKENS, OUTPUT_TOKENS = 4, 3, 48, 8
# Conversations end near 3 * (48 + 8) = 168 tokens, ~670 together: about twice the device pool.
EXIT_BOUND_S = 30.0


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp_models")
    return {s: write_dummy_model(str(root / s), s) for s in ("tiny-llama", "tiny-mla")}


def _question(conv: int, rnd: int) -> list[int]:
    return np.random.default_rng([77, conv, rnd]).integers(6, 512, size=QUESTION_TOKENS).tolist()


def _generate(client: httpx.Client, ids: list[int]) -> dict:
    r = client.post("/generate", json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": OUTPUT_TOKENS, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()


def run_scenario(base_url: str) -> tuple[list[list[int]], dict[str, int]]:
    """The conversations one request at a time (outputs in order, and the cached-token sums
    per source), then a concurrent burst (outputs not compared: batch shapes differ), then
    /flush_cache, which must leave every device and host slot free."""
    outputs, cached = [], {"device": 0, "host": 0, "storage": 0}
    history: list[list[int]] = [[] for _ in range(NUM_CONVERSATIONS)]
    with httpx.Client(base_url=base_url, timeout=300) as client:
        for rnd in range(NUM_ROUNDS):
            for conv in range(NUM_CONVERSATIONS):
                ids = history[conv] + _question(conv, rnd)
                out = _generate(client, ids)
                history[conv] = ids + out["output_ids"]
                outputs.append(out["output_ids"])
                details = out["meta_info"].get("cached_tokens_details") or {}
                for k in cached:
                    cached[k] += details.get(k, 0)
        with ThreadPoolExecutor(8) as pool:
            burst = list(pool.map(lambda h: _generate(client, h[-100:] + [7, 8, 9]), history * 2))
        assert all(len(b["output_ids"]) == OUTPUT_TOKENS for b in burst)
        assert client.post("/flush_cache").status_code == 200
        state = client.get("/get_server_info").json()["internal_states"][0]
        assert state["available_size"] == state["max_total_num_tokens"]
        assert state.get("host_used_size", 0) == 0
    return outputs, cached


def _serve_and_run(model: str, extra: list, passes: int = 1) -> tuple[list[list[int]], dict[str, int], str]:
    """Serve, run the scenario `passes` times (each ends with /flush_cache: the later passes
    start from an empty device and host, with whatever a storage tier kept); the outputs of
    every pass must be the same; returns them, the cached-token sums of the last pass, the log."""
    proc, url = popen_launch_server([*COMMON, "--model-path", model, *extra])
    try:
        outputs, cached = run_scenario(url)
        for _ in range(passes - 1):
            again, cached = run_scenario(url)
            assert again == outputs
        assert proc.poll() is None, "the server exited during the scenario"
    finally:
        kill(proc)
    log = open(proc.log_path).read()
    assert "Traceback" not in log, log[-4000:]
    return outputs, cached, log


@pytest.fixture(scope="module")
def llama_tp1(models):
    return _serve_and_run(models["tiny-llama"], ["--tp-size", 1])


def test_llama_tp2_equals_tp1(models, llama_tp1):
    outputs, cached, log = _serve_and_run(models["tiny-llama"], ["--tp-size", 2])
    assert "TP rank 1/2" in log
    assert cached["device"] > 0  # later turns hit their prefix
    assert outputs == llama_tp1[0]


def test_llama_tp2_with_host_tier_equals_tp1(models, llama_tp1):
    outputs, cached, _ = _serve_and_run(models["tiny-llama"], ["--tp-size", 2, *HICACHE])
    assert cached["host"] > 0, cached  # pages evicted from the device came back from the host
    assert outputs == llama_tp1[0]


@pytest.fixture(scope="module")
def mla_tp1(models):
    return _serve_and_run(models["tiny-mla"], ["--tp-size", 1])


def test_mla_tp2_with_host_tier_and_overlap_equals_tp1(models, mla_tp1):
    outputs, cached, _ = _serve_and_run(models["tiny-mla"], ["--tp-size", 2, *HICACHE, "--enable-overlap-schedule"])
    assert cached["host"] > 0, cached
    assert outputs == mla_tp1[0]


def _storage_args(folder, policy: str) -> list:
    return [*HICACHE, "--hicache-storage-backend", "file", "--hicache-storage-prefetch-policy", policy,
            "--hicache-storage-backend-extra-config",
            json.dumps({"file_storage_path": str(folder), "prefetch_threshold": 32})]


def test_llama_tp2_with_storage_tier_equals_tp1(models, llama_tp1, tmp_path):
    """Pass 2 starts after /flush_cache: its prefixes come back from storage. MHA: one
    namespace per rank (each rank stores its own heads)."""
    args = ["--tp-size", 2, *_storage_args(tmp_path, "wait_complete")]
    outputs, cached, _ = _serve_and_run(models["tiny-llama"], args, passes=2)
    assert cached["storage"] > 0, cached
    assert outputs == llama_tp1[0]
    assert len(os.listdir(tmp_path)) == 2, os.listdir(tmp_path)


def test_mla_tp2_with_storage_tier_equals_tp1(models, mla_tp1, tmp_path):
    """MLA: one namespace for both ranks, written by rank 0 only; `timeout` policy (ranks
    agree on each verdict)."""
    outputs, cached, _ = _serve_and_run(models["tiny-mla"], ["--tp-size", 2, *_storage_args(tmp_path, "timeout")],
                                        passes=2)
    assert cached["storage"] > 0, cached
    assert outputs == mla_tp1[0]
    assert len(os.listdir(tmp_path)) == 1, os.listdir(tmp_path)


def test_killed_rank_stops_the_server(models):
    proc, url = popen_launch_server([*COMMON, "--model-path", models["tiny-llama"], "--tp-size", 2, *HICACHE])
    try:
        log = open(proc.log_path).read()
        pid = int(re.search(r"TP rank 1/2 \(pid (\d+)\)", log).group(1))
        with httpx.Client(base_url=url, timeout=60) as client:
            _generate(client, _question(0, 0))
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        code = proc.wait(EXIT_BOUND_S)
        waited = time.monotonic() - start
    finally:
        kill(proc)
    log = open(proc.log_path).read()
    assert code == 1, log[-3000:]
    assert waited < EXIT_BOUND_S
    assert "scheduler TP rank 1 (exit code -9)" in log, log[-3000:]
    assert "cannot serve without every rank: stopping the server" in log


def _in_process_greedy(prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """TP=1 greedy outputs of the default model from a Scheduler in this process (float32)."""
    from hiserve.engine.io_struct import BatchTokenIDOut, TokenizedGenerateReqInput
    from hiserve.engine.sampling_params import SamplingParams
    from hiserve.engine.scheduler import Scheduler
    from hiserve.server_args import ServerArgs

    sched = Scheduler(ServerArgs(dtype="float32", device="cpu").resolve(), None)
    for i, ids in enumerate(prompts):
        sp = SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True)
        sched.add_request(TokenizedGenerateReqInput(rid=str(i), input_ids=ids, sampling_params=sp))
        while sched.waiting_queue or sched.running or sched.chunked_req:
            batch = sched.get_next_batch_to_run()
            if batch is not None:
                sched.run_batch(batch)
            sched.check_cache_events()
    outs: dict[str, list[int]] = {}
    for msg in sched.outbox:
        if isinstance(msg, BatchTokenIDOut):
            for rid, new in zip(msg.rids, msg.new_output_ids):
                outs[rid] = outs.get(rid, []) + list(new)
    return [outs[str(i)] for i in range(len(prompts))]


def test_default_gguf_model_tp3_equals_tp1():
    """The real default checkpoint (GGUF, 9 heads / 3 KV heads: TP 3, not 2), dequantized and
    sliced at load time (`--quantization` unset becomes none at TP > 1), greedy float32."""
    prompts = [[1, 504, 3458, 314, 4649, 314, 253, 2671, 30], [1, 8866, 1296, 5954, 2302, 42]]
    ref = _in_process_greedy(prompts, OUTPUT_TOKENS)
    proc, url = popen_launch_server(["--tp-size", 3, "--enable-cache-integrity-check"])
    try:
        with httpx.Client(base_url=url, timeout=300) as client:
            got = [_generate(client, ids)["output_ids"] for ids in prompts]
    finally:
        kill(proc)
    log = open(proc.log_path).read()
    assert "--quantization not given -> none (--tp-size 3" in log
    assert got == ref
