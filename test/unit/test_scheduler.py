"""Scheduler admission, chunked prefill, retraction and abort, on the real default model (CPU)."""

from __future__ import annotations

import pytest

from hiserve.engine.io_struct import AbortReq, BatchTokenIDOut, TokenizedGenerateReqInput
from hiserve.engine.sampling_params import SamplingParams
from hiserve.engine.scheduler import Scheduler
from hiserve.layers.forward_batch import ForwardMode
from hiserve.server_args import ServerArgs

PROMPTS = [
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "List three prime numbers.",
    "Why is the sky blue? Answer briefly.",
    "Translate 'good morning' into Spanish.",
    "What is two plus two?",
]


def make_scheduler(**kwargs) -> Scheduler:
    args = ServerArgs(dtype="float32", device="cpu", enable_cache_integrity_check=True, **kwargs).resolve()
    return Scheduler(args, None)


def chat_ids(sched: Scheduler, text: str) -> list[int]:
    ids = sched.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                              add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def submit(sched: Scheduler, rid: str, ids: list[int], max_new: int = 24) -> None:
    sp = SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True)
    sched.add_request(TokenizedGenerateReqInput(rid=rid, input_ids=ids, sampling_params=sp))


def run_all(sched: Scheduler, on_step=None, max_steps: int = 5000) -> dict[str, tuple[list[int], dict]]:
    steps = 0
    while sched.waiting_queue or sched.running or sched.chunked_req:
        batch = sched.get_next_batch_to_run()
        if on_step is not None:
            on_step(sched, batch)
        if batch is not None:
            sched.run_batch(batch)
        sched.check_cache_events()  # with the integrity check on, verifies every iteration
        steps += 1
        assert steps < max_steps, "scheduler did not converge"
    return collect_outputs(sched)


def collect_outputs(sched: Scheduler) -> dict[str, tuple[list[int], dict]]:
    """Each request's streamed token ids and finish reason, from the scheduler's outbox (cleared)."""
    outs: dict[str, tuple[list[int], dict]] = {}
    for msg in sched.outbox:
        if not isinstance(msg, BatchTokenIDOut):
            continue
        for rid, ids, fin in zip(msg.rids, msg.new_output_ids, msg.finished_reasons):
            prev = outs.get(rid, ([], None))[0]
            outs[rid] = (prev + ids, fin)
    sched.outbox.clear()
    return outs


def assert_no_leak(sched: Scheduler) -> None:
    sched.kv.check_integrity()
    assert sched.flush_cache()
    assert sched.kv.allocator.available_size() == sched.max_total_num_tokens
    assert sched.kv.rtt.available_size() == sched.model_runner.max_running_requests
    sched.kv.check_integrity()


@pytest.fixture(scope="module")
def reference_outputs():
    """Each prompt alone, no chunking, roomy pool: the outputs every other setting must equal."""
    sched = make_scheduler(max_total_tokens=8192, chunked_prefill_size=-1)
    result = {}
    for i, p in enumerate(PROMPTS):
        submit(sched, f"r{i}", chat_ids(sched, p))
        result.update(run_all(sched))
    assert_no_leak(sched)
    return result


def test_chunked_prefill_and_admission_limits(reference_outputs):
    sched = make_scheduler(max_total_tokens=8192, chunked_prefill_size=16, max_running_requests=3)
    seen_extend_tokens, max_running = [], [0]

    def on_step(s, batch):
        max_running[0] = max(max_running[0], len(s.running) + (batch.batch_size if batch and
                                                                 batch.forward_mode.is_extend() else 0))
        if batch is not None and batch.forward_mode.is_extend():
            seen_extend_tokens.append(sum(batch.extend_seq_lens_cpu))

    for i, p in enumerate(PROMPTS):
        submit(sched, f"r{i}", chat_ids(sched, p))
    outs = run_all(sched, on_step)
    assert max(seen_extend_tokens) <= 16  # every prefill pass respects the chunk size
    assert max_running[0] <= 3
    for rid, (ids, fin) in reference_outputs.items():
        assert outs[rid][0] == ids, rid
        assert outs[rid][1]["type"] == "length"
    assert_no_leak(sched)


def test_retraction_under_memory_pressure(reference_outputs):
    # 6 requests x (~40 prompt + 24 output) tokens cannot all decode in 192 slots.
    sched = make_scheduler(max_total_tokens=192, chunked_prefill_size=-1)
    for i, p in enumerate(PROMPTS):
        submit(sched, f"r{i}", chat_ids(sched, p))
    outs = run_all(sched)
    assert sched.stats.num_retracted_reqs > 0
    for rid, (ids, _) in reference_outputs.items():
        assert outs[rid][0] == ids, rid
    assert_no_leak(sched)


def test_prefix_reuse_and_abort():
    sched = make_scheduler(max_total_tokens=4096, page_size=4)
    ids = chat_ids(sched, PROMPTS[0])
    submit(sched, "a", ids, max_new=4)
    run_all(sched)
    submit(sched, "b", ids, max_new=4)
    batch = sched.get_next_batch_to_run()
    assert batch.forward_mode == ForwardMode.EXTEND
    # Page-aligned hit that leaves at least the last token to recompute.
    expect = (len(ids) - 1) // 4 * 4
    assert batch.extend_prefix_lens_cpu == [expect]
    sched.run_batch(batch)
    run_all(sched)

    # Abort one request in the waiting queue and one while it decodes.
    submit(sched, "queued", ids, max_new=50)
    submit(sched, "running", chat_ids(sched, PROMPTS[1]), max_new=50)
    sched.abort_request(AbortReq(rid="queued"))
    for _ in range(3):
        sched.step()
    sched.abort_request(AbortReq(rid="running"))
    outs = run_all(sched)
    assert outs["queued"][1] == {"type": "abort", "message": "Abort in waiting queue"}
    assert outs["running"][1]["type"] == "abort"
    assert_no_leak(sched)


def test_bad_input_is_refused_with_a_reply():
    sched = make_scheduler(max_total_tokens=512)
    submit(sched, "long", [1] * 600)
    submit(sched, "vocab", [10**9])
    outs = run_all(sched)
    assert outs["long"][1]["type"] == "abort" and outs["long"][1]["status_code"] == 400
    assert "exceeds the maximum allowed length" in outs["long"][1]["message"]
    assert outs["vocab"][1]["status_code"] == 400
