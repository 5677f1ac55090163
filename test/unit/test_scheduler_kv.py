"""The scheduler through the KV manager: retraction with and without the host tier, one
request's failing output update isolated from the rest of its batch, and a failed reply that
still gives finished requests' KV back (real model, CPU)."""

from __future__ import annotations

from typing import Any

from hiserve.engine.io_struct import TokenizedGenerateReqInput
from hiserve.engine.sampling_params import SamplingParams

from test_scheduler import PROMPTS, assert_no_leak, chat_ids, make_scheduler, run_all, submit


def test_retraction_with_host_tier_is_no_worse():
    """A pool too small for 6 decoding requests retracts; with the host tier under
    write_through the backed-up KV of a retracted request is evictable at once (its write
    takes no lock), so the host tier does not add retractions; outputs are identical."""
    results = {}
    for hicache in (False, True):
        sched = make_scheduler(max_total_tokens=192, chunked_prefill_size=-1,
                               enable_hierarchical_cache=hicache, hicache_ratio=4.0)
        for i, p in enumerate(PROMPTS):
            submit(sched, f"r{i}", chat_ids(sched, p))
        outs = run_all(sched)
        results[hicache] = (sched.stats.num_retracted_reqs, {k: v[0] for k, v in outs.items()})
        assert_no_leak(sched)
    (plain_n, plain_out), (hi_n, hi_out) = results[False], results[True]
    assert plain_n > 0
    assert hi_n <= plain_n, f"host tier retracted {hi_n} times, without it {plain_n}"
    assert hi_out == plain_out


class _RaisingTokenizer:
    """The real tokenizer, except that decode() raises (as a broken id would)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def decode(self, *args: Any, **kwargs: Any) -> str:
        raise ValueError("cannot decode this id")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_one_failing_update_ends_only_its_request():
    sched = make_scheduler(max_total_tokens=2048)
    sched.tokenizer = _RaisingTokenizer(sched.tokenizer)
    ids = chat_ids(sched, PROMPTS[0])
    # Only a request with stop strings decodes text in the scheduler: that one fails.
    bad = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True, stop=["zzz"])
    good = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    sched.add_request(TokenizedGenerateReqInput(rid="bad", input_ids=ids, sampling_params=bad))
    sched.add_request(TokenizedGenerateReqInput(rid="good", input_ids=ids, sampling_params=good))
    outs = run_all(sched)
    assert outs["bad"][1]["type"] == "abort" and outs["bad"][1]["status_code"] == 500
    assert "Internal error" in outs["bad"][1]["message"]
    assert outs["good"][1]["type"] == "length" and len(outs["good"][0]) == 8
    assert_no_leak(sched)


def test_a_failed_reply_still_caches_finished_prompts():
    """Finished prompts are cached after their replies are sent; when sending raises, the
    finished requests still give their KV back (row and slots), with the host tier on."""
    sched = make_scheduler(max_total_tokens=2048, enable_hierarchical_cache=True, hicache_ratio=4.0)
    sched.add_request(TokenizedGenerateReqInput(rid="one", input_ids=chat_ids(sched, PROMPTS[0]),
                                                sampling_params=SamplingParams(max_new_tokens=1, temperature=0)))

    def broken_send(reqs: list) -> None:
        raise ConnectionError("detokenizer gone")

    sched._send_outputs = broken_send
    try:
        while sched.has_work():
            sched.step()
    except ConnectionError:
        pass
    else:
        raise AssertionError("the reply's failure did not reach the loop")
    sched.kv.check_integrity()
    assert sched.kv.rtt.available_size() == sched.model_runner.max_running_requests  # the row came back
    del sched._send_outputs
    assert_no_leak(sched)
