"""A CPU server with overlap scheduling forced on (`--enable-overlap-schedule`: the forward runs in
the worker thread): the API, disconnect and structured-output suites run against it unchanged,
and its greedy outputs under concurrency equal the synchronous scheduler's, with usage counts
that never include a dropped extra token."""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import pytest
from test_api import *  # noqa: F401,F403 (the API suite's tests and fixtures, on this module's server)
from test_disconnect import (  # noqa: F401
    test_flush_refused_while_busy,
    test_non_stream_disconnect_frees_kv,
    test_openai_stream_disconnect_frees_kv,
    test_stream_disconnect_frees_kv,
)
from server import stream_events
from test_structured_output import (  # noqa: F401 (constrained requests: the drain path)
    results,
    test_generate_regex_ebnf_and_schema,
    test_json_object,
    test_many_schemas_validate,
)

from hiserve.engine.io_struct import BatchTokenIDOut, TokenizedGenerateReqInput
from hiserve.engine.sampling_params import SamplingParams
from hiserve.engine.scheduler import Scheduler
from hiserve.server_args import ServerArgs

SERVER_ARGS = ["--enable-overlap-schedule", "--max-total-tokens", "8192", "--enable-metrics", "--enable-cache-report"]
MAX_NEW = [1, 2, 5, 9, 16, 23, 3, 12, 1, 30, 7, 18]


def _prompt(i: int) -> list[int]:
    return [1000 + (37 * i + 11 * k) % 3000 for k in range(20 + 9 * i)]


def _sync_reference() -> dict[str, tuple[list[int], int]]:
    """The same requests through the synchronous scheduler in this process (same model, float32)."""
    args = ServerArgs(dtype="float32", device="cpu", max_total_tokens=8192, disable_overlap_schedule=True).resolve()
    sched = Scheduler(args, None)
    for i, n in enumerate(MAX_NEW):
        sp = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, stop=["."] if i % 3 == 0 else None)
        sched.add_request(TokenizedGenerateReqInput(rid=str(i), input_ids=_prompt(i), sampling_params=sp))
    while sched.has_work():
        sched.step()
    out: dict[str, tuple[list[int], int]] = {}
    for msg in sched.outbox:
        if isinstance(msg, BatchTokenIDOut):
            for rid, ids, n in zip(msg.rids, msg.new_output_ids, msg.completion_tokens):
                out[rid] = (out.get(rid, ([], 0))[0] + ids, n)
    return out


def _overlap_state(base_url: str) -> dict:
    return httpx.get(base_url + "/get_server_info", timeout=30).json()["internal_states"][0]


def test_concurrent_outputs_equal_sync_scheduler(base_url: str):
    def generate(i: int) -> dict:
        sp = {"max_new_tokens": MAX_NEW[i], "temperature": 0, "ignore_eos": True}
        if i % 3 == 0:
            sp["stop"] = ["."]
        r = httpx.post(base_url + "/generate", timeout=300, json={"input_ids": _prompt(i), "sampling_params": sp})
        assert r.status_code == 200, r.text
        return r.json()

    before = _overlap_state(base_url)
    assert before["overlap_schedule"] is True
    with cf.ThreadPoolExecutor(len(MAX_NEW)) as pool:
        got = list(pool.map(generate, range(len(MAX_NEW))))
    want = _sync_reference()
    for i, res in enumerate(got):
        ids, n = want[str(i)]
        assert res["output_ids"] == ids, i
        assert res["meta_info"]["completion_tokens"] == n == len(ids), i
    assert _overlap_state(base_url)["num_overlapped_batches"] > before["num_overlapped_batches"]


def test_stream_counts_no_extra_token(base_url: str):
    """A streamed request that ends by a stop string (its batch-mate decodes on, so an extra
    step was in flight): the streamed ids equal the non-streamed ones and the usage."""
    body = {"input_ids": _prompt(3), "sampling_params": {"max_new_tokens": 40, "temperature": 0, "stop": ["."]}}
    full = httpx.post(base_url + "/generate", json=body, timeout=300).json()
    ids: list[int] = []
    with httpx.Client(base_url=base_url, timeout=300) as c:
        for event in stream_events(c, "/generate", {**body, "stream": True}):
            if event != "[DONE]":
                ids = event["output_ids"]
                last = event
    assert ids == full["output_ids"]
    assert last["meta_info"]["completion_tokens"] == len(ids) == full["meta_info"]["completion_tokens"]
    assert last["meta_info"]["finish_reason"] == full["meta_info"]["finish_reason"]


@pytest.mark.parametrize("n", [3])
def test_n_siblings_identical(base_url: str, n: int):
    r = httpx.post(base_url + "/v1/completions", timeout=300, json={
        "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "n": n, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    texts = {c["text"] for c in body["choices"]}
    assert len(body["choices"]) == n and len(texts) == 1
    assert body["usage"]["completion_tokens"] == 12 * n
