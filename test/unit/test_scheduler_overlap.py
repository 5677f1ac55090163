"""Overlap scheduling on the CPU (`--enable-overlap-schedule`, the worker-thread path): the same
outputs as the synchronous loop on 72 mixed requests, in three pool settings, with the KV
integrity check after every iteration; and the worker's future-token and failure handling.

Tiny random-weight Llama (`--load-format dummy`) so every scenario runs in seconds.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from hiserve.engine.io_struct import AbortReq, BatchTokenIDOut, TokenizedGenerateReqInput
from hiserve.engine.sampling_params import SamplingParams
from hiserve.engine.scheduler import Scheduler
from hiserve.hardware import Platform
from hiserve.server_args import ServerArgs
from hiserve.testing.dummy_model import write_dummy_model

NUM_REQS = 72
ABORT_AFTER = 4  # tokens an aborted request streams before its abort arrives


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return write_dummy_model(str(tmp_path_factory.mktemp("overlap") / "tiny"), "tiny-llama")


def make(model_path: str, overlap: bool, **kw) -> Scheduler:
    args = ServerArgs(model_path=model_path, load_format="dummy", dtype="float32", device="cpu",
                      enable_cache_integrity_check=True, enable_overlap_schedule=overlap,
                      disable_overlap_schedule=not overlap, **kw).resolve()
    sched = Scheduler(args, None)
    assert sched.overlap_schedule == overlap
    kv_cache, kv_release = sched.kv.cache, sched.kv.release

    def cache(req, finished):  # a launched forward still reads the row and writes the slots
        assert not finished or req.num_inflight == 0, f"{req.rid}: KV released under a running forward"
        kv_cache(req, finished)

    def release(req):
        assert req.num_inflight == 0, f"{req.rid}: KV released under a running forward"
        kv_release(req)

    sched.kv.cache, sched.kv.release = cache, release
    return sched


def prompt(i: int) -> list[int]:
    """Prompts of 6..130 tokens; groups of four share a 24-token prefix (prefix-cache hits)."""
    shared = [7 + (i // 4) % 9 * 13 + k for k in range(24)]
    own = [(i * 37 + 11 * k) % 500 + 6 for k in range((i * 29) % 107)]
    return (shared + own)[: 6 + (i * 53) % 125]


def request(i: int, ref: dict | None) -> tuple[TokenizedGenerateReqInput, bool]:
    """Request i of the mix and whether it is aborted mid-stream. `ref`: the outputs of a
    plain run (stop conditions are taken from them, so that they really trigger)."""
    kind = i % 9
    sp = dict(max_new_tokens=8 + i % 17, temperature=0, ignore_eos=True)
    extra, abort = {}, False
    base = ref.get(f"r{i}", ([], None))[0] if ref else []
    if kind == 0:
        sp["max_new_tokens"] = 1
    elif kind == 1 and len(base) > 3:
        sp["stop_token_ids"] = [base[3]]  # ends at its 4th token
    elif kind == 2 and len(base) > 5:
        sp["stop"] = [f"w{base[5]}"] if base[5] >= 6 else None  # a stop string (the dummy vocab)
    elif kind == 3:
        extra = dict(return_logprob=True, top_logprobs_num=3, logprob_start_len=len(prompt(i)) - 4)
    elif kind == 4 and i < 20:  # two of them: while they run, every batch drains
        sp.update(repetition_penalty=1.3, frequency_penalty=0.2, min_new_tokens=3)
    elif kind == 5:
        abort, sp["max_new_tokens"] = True, 64
    elif kind == 6:
        sp.update(ignore_eos=False, max_new_tokens=40)  # may stop at the model's EOS
    elif kind == 7:
        sp["max_new_tokens"] = 90  # long: outgrows the admission's decode reserve (retraction)
    elif kind == 8 and i < 20:  # seeded sampling: its tokens depend only on (seed, position)
        sp.update(temperature=0.9, top_p=0.95, sampling_seed=1234 + i)
    elif kind == 8 and i < 30:
        sp["max_new_tokens"] = 0
    req = TokenizedGenerateReqInput(rid=f"r{i}", input_ids=prompt(i), sampling_params=SamplingParams(**sp),
                                    stream=i % 2 == 0 or abort, **extra)
    return req, abort


def run_mix(sched: Scheduler, ref: dict | None, max_steps: int = 20000) -> dict:
    """Submit the mix (n > 1: requests 60.. repeat the prompts of 0.. as siblings), step until
    idle, abort the marked requests once they have streamed ABORT_AFTER tokens."""
    aborts = set()
    for i in range(NUM_REQS):
        req, abort = request(i, ref)
        if i >= 60:
            req.input_ids = prompt(i - 60)
        sched.add_request(req)
        if abort:
            aborts.add(req.rid)
    outs: dict[str, list] = {}
    steps = 0
    while sched.has_work():
        sched.step()
        steps += 1
        assert steps < max_steps, "scheduler did not converge"
        for msg in sched.outbox:
            if not isinstance(msg, BatchTokenIDOut):
                continue
            for rid, ids, fin, n, lp in zip(msg.rids, msg.new_output_ids, msg.finished_reasons,
                                            msg.completion_tokens, msg.logprobs):
                ids_so_far, fins, _, lps = outs.get(rid, ([], [], 0, []))
                assert not fins, f"{rid}: output after its final reply"
                if lp is not None:  # output logprobs, and the prompt's (position, logprob) once
                    lps = lps + lp.output_token_logprobs + [(v or 0.0, -1 - t) for v, t in lp.input_token_logprobs or []]
                outs[rid] = (ids_so_far + ids, [fin] if fin else [], n, lps)
        sched.outbox.clear()
        for rid in list(aborts):
            if rid in outs and len(outs[rid][0]) >= ABORT_AFTER:
                sched.abort_request(AbortReq(rid=rid))
                aborts.discard(rid)
    return outs


def assert_no_leak(sched: Scheduler) -> None:
    sched.kv.check_integrity()
    assert sched.flush_cache()
    assert sched.kv.allocator.available_size() == sched.max_total_num_tokens
    assert sched.kv.rtt.available_size() == sched.model_runner.max_running_requests
    sched.kv.check_integrity()


SETTINGS = {
    "roomy": dict(max_total_tokens=16384, chunked_prefill_size=64),
    # Too small for the running requests' decode: retraction, with the host tier on.
    "retract-hicache": dict(max_total_tokens=320, chunked_prefill_size=64, enable_hierarchical_cache=True,
                            hicache_ratio=4.0, max_running_requests=64),
    "paged": dict(max_total_tokens=2048, page_size=4, chunked_prefill_size=-1, max_running_requests=16),
    "no-radix": dict(max_total_tokens=4096, chunked_prefill_size=48, disable_radix_cache=True),
}


def assert_same(got: dict, want: dict) -> None:
    """Identical tokens, finish reasons, usage counts and logprobs for every request."""
    assert set(got) == set(want) and len(got) == NUM_REQS
    for rid, (ids, fins, n, lps) in want.items():
        g_ids, g_fins, g_n, g_lps = got[rid]
        assert g_ids == ids, f"{rid}: {g_ids} != {ids}"
        assert g_fins == fins, rid
        assert g_n == n == len(ids), f"{rid}: usage counts {g_n} / {n} tokens for {len(ids)} streamed"
        assert [t for _, t in g_lps] == [t for _, t in lps]
        assert [v for v, _ in g_lps] == pytest.approx([v for v, _ in lps], abs=1e-4), rid


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_overlap_outputs_equal_sync(model_path, setting):
    """Each setting twice: without stop conditions (the reference that places them; the
    longest runs, where the small pool retracts), then with them; sync vs overlap each time."""
    kw = SETTINGS[setting]
    runs = {}
    for overlap in (False, True):
        sched = make(model_path, overlap=overlap, **kw)
        runs[overlap] = [sched, run_mix(sched, None)]
        assert_no_leak(sched)
    assert_same(runs[True][1], runs[False][1])
    ref = runs[False][1]
    for overlap in (False, True):
        sched = make(model_path, overlap=overlap, **kw)
        runs[overlap] += [sched, run_mix(sched, ref)]
        assert_no_leak(sched)
    plain, want, sched, got = runs[False][2], runs[False][3], runs[True][2], runs[True][3]
    assert_same(got, want)

    reasons = [fins[0]["type"] for _, fins, _, _ in want.values()]
    assert reasons.count("abort") == len([i for i in range(NUM_REQS) if i % 9 == 5])
    assert any(isinstance(f[0].get("matched"), str) for _, f, _, _ in want.values())  # a stop string hit
    assert any(isinstance(f[0].get("matched"), int) for _, f, _, _ in want.values())  # a stop token hit
    # The overlap path really ran: most batches overlapped, finished requests' extra tokens were
    # dropped and their KV released after the batch that held them.
    assert sched.num_overlapped_batches > 0.5 * plain._decode_steps, (sched.num_overlapped_batches,
                                                                        plain._decode_steps)
    assert sched.num_dropped_tokens > 0 and sched.num_deferred_releases > 0
    assert sched.num_drained_batches > 0  # penalties and chunked prompts drain
    if setting == "retract-hicache":
        (plain_ref, _, _, _), (ovl_ref, _, _, _) = runs[False], runs[True]
        assert plain_ref.stats.num_retracted_reqs > 0 and ovl_ref.stats.num_retracted_reqs > 0
        assert ovl_ref.kv.stats().backed_up_tokens_total > 0 and ovl_ref.kv.stats().loaded_back_tokens_total > 0


def test_aborts_mid_prompt_and_in_flight(model_path):
    """Overlap on: an abort while a chunked prompt's chunk runs, an abort while a request's
    prefill is in flight, and abort_all while decoding; every request gets one final abort
    reply, and no KV leaks (the integrity check runs every iteration)."""
    sched = make(model_path, overlap=True, max_total_tokens=4096, chunked_prefill_size=32)
    sp = dict(max_new_tokens=50, temperature=0, ignore_eos=True)
    sched.add_request(TokenizedGenerateReqInput(rid="long", input_ids=[(7 * k) % 500 + 6 for k in range(300)],
                                                sampling_params=SamplingParams(**sp), stream=True))
    sched.step()
    sched.step()
    assert sched.chunked_req is not None and sched._in_flight is not None
    sched.abort_request(AbortReq(rid="long"))  # its chunk is running
    sched.add_request(TokenizedGenerateReqInput(rid="short", input_ids=list(range(10, 40)),
                                                sampling_params=SamplingParams(**sp), stream=True))
    for _ in range(3):
        sched.step()
    sched.add_request(TokenizedGenerateReqInput(rid="late", input_ids=list(range(50, 70)),
                                                sampling_params=SamplingParams(**sp), stream=True))
    sched.step()  # launches late's prefill
    assert sched._in_flight is not None and sched._in_flight.forward_mode.is_extend()
    sched.abort_request(AbortReq(rid="late"))
    sched.step()
    sched.abort_request(AbortReq(rid="", abort_all=True))  # "short" is decoding
    while sched.has_work():
        sched.step()
    finals: dict[str, list] = {}
    for msg in sched.outbox:
        if isinstance(msg, BatchTokenIDOut):
            for rid, fin in zip(msg.rids, msg.finished_reasons):
                if fin is not None:
                    finals.setdefault(rid, []).append(fin)
    assert {rid: [f["type"] for f in fins] for rid, fins in finals.items()} == {
        "long": ["abort"], "short": ["abort"], "late": ["abort"]}
    assert sched.num_deferred_releases >= 2
    assert_no_leak(sched)


def test_future_ids_are_resolved_on_the_device(model_path):
    sched = make(model_path, overlap=True, max_total_tokens=1024)
    worker = sched.overlap_worker
    with torch.inference_mode():  # as in the worker thread
        worker.future_ids[5:8] = torch.tensor([41, 42, 43])
        ids = torch.tensor([-6, 17, -8, 0, -7])
        assert worker._resolve_future_ids(ids).tolist() == [41, 17, 43, 0, 42]
    # Contiguous ranges; a batch that would run past the end starts again at 0.
    n = worker.num_slots // 3
    starts = [worker.reserve_slots(n) for _ in range(4)]
    assert starts == [0, n, 2 * n, 0]
    with pytest.raises(ValueError):
        worker.reserve_slots(n + 1)


def test_worker_failure_reaches_the_scheduler(model_path):
    sched = make(model_path, overlap=True, max_total_tokens=1024)

    def broken(batch):
        raise RuntimeError("kernel exploded")

    sched.model_runner.forward = broken
    sched.add_request(TokenizedGenerateReqInput(
        rid="x", input_ids=list(range(10, 30)), sampling_params=SamplingParams(max_new_tokens=4, temperature=0)))
    sched.step()  # launches the prefill
    with pytest.raises(RuntimeError, match="forward worker failed: RuntimeError: kernel exploded"):
        sched.step()


def test_server_args_overlap_defaults(model_path):
    def resolve(platform: Platform, **kw) -> ServerArgs:
        return ServerArgs(model_path=model_path, load_format="dummy", dtype="float32", **kw).resolve(platform)

    cpu, cuda = Platform("cpu"), Platform("cuda", (9, 0), fa3_importable=False)
    assert resolve(cpu).disable_overlap_schedule  # off on the CPU by default
    assert not resolve(cpu, enable_overlap_schedule=True).disable_overlap_schedule
    assert not resolve(cuda).disable_overlap_schedule  # on for CUDA by default
    assert resolve(cuda, disable_overlap_schedule=True).disable_overlap_schedule
    with pytest.raises(ValueError, match="contradict"):
        resolve(cpu, enable_overlap_schedule=True, disable_overlap_schedule=True)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert parser.parse_args(["--enable-overlap-schedule"]).enable_overlap_schedule
    assert parser.parse_args(["--disable-overlap-schedule"]).disable_overlap_schedule
