"""HiRadixCache on CUDA (streams, events, per-layer waits) and through the real Scheduler with
the host tier; the state-machine cases on CPU pools are in test_hiradix_cache.py."""

from __future__ import annotations

import pytest
import torch

from hiserve.mem_cache.hiradix_cache import HiRadixCache

from hiradix_helpers import (
    LAYERS,
    make_kv,
    pool_of,
    read_kv,
    insert_fresh,
    assert_consistent,
    assert_everything_freed,
    evict_to_host,
)


# ---- CUDA: streams, events, per-layer waits ---------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout,io_backend", [("layer_first", "direct"), ("page_first", "kernel")])
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
@pytest.mark.parametrize("kind", ["MHA", "MLA"])
def test_cuda_write_evict_load_back_round_trip(policy, kind, layout, io_backend):
    kv = make_kv(page_size=4, policy=policy, kind=kind, layout=layout, device="cuda",
                 io_backend=io_backend)
    cache = kv.prefix_cache
    ctrl = cache.cache_controller
    pool = pool_of(kv)
    assert ctrl.is_cuda and pool.layer_transfer_counter is None
    key = list(range(10, 42))  # 8 pages
    slots = insert_fresh(kv, key)  # KV written on the compute stream, then (write_through) backed up
    assert slots.device.type == "cpu"  # the allocator's slots stay on the host
    original = read_kv(kv, slots)
    torch.cuda.synchronize()
    kv.poll()
    assert cache.protected_size() == 0 and not ctrl.ack_write_queue
    evict_to_host(kv)  # write_back: written here; freed slots wait for the write's ack
    torch.cuda.synchronize()
    kv.poll()  # the finished write releases any slots parked on the pending list
    assert cache.pending_slots() == 0
    kv.check_integrity()
    for buf in pool.buffers():
        buf.fill_(-1.0)  # reuses the freed slots: must not reach the host copy
    m = cache.match(key + [1])
    assert m.host_hit_length == 32
    loaded = kv.allocator.alloc(32)
    cache.load_back(m.host_handle, loaded)
    ticket = kv.start_loads()
    assert ticket is not None and len(ticket.layer_events) == LAYERS
    # Attention reads layer by layer through the accessors, which wait on each layer's event
    # only while the consuming batch's ticket is installed.
    pool.register_layer_transfer_counter(ticket)
    idx = loaded.cuda()
    got = []
    for layer in range(LAYERS):
        if kind == "MHA":
            got += [pool.get_key_buffer(layer)[idx].clone(), pool.get_value_buffer(layer)[idx].clone()]
        else:
            got.append(pool.get_key_buffer(layer)[idx].clone())
    pool.register_layer_transfer_counter(None)
    want = original if kind == "MLA" else [original[i] for l in range(LAYERS) for i in (l, LAYERS + l)]
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    torch.cuda.synchronize()
    kv.poll()
    assert cache.protected_size() == 0 and not ctrl.ack_load_queue
    assert_consistent(kv)
    assert_everything_freed(kv)


# ---- through the real scheduler ----------------------------------------------------------


def _drive(sched) -> dict:
    from hiserve.engine.io_struct import BatchTokenIDOut

    steps = 0
    while sched.waiting_queue or sched.running or sched.chunked_req:
        sched.step()
        steps += 1
        assert steps < 3000, "scheduler did not converge"
    outs = {}
    for msg in sched.outbox:
        if isinstance(msg, BatchTokenIDOut):
            for rid, ids, fin, host in zip(msg.rids, msg.new_output_ids, msg.finished_reasons,
                                           msg.cached_tokens_host):
                prev = outs.get(rid, ([], None, 0))[0]
                outs[rid] = (prev + ids, fin, host)
    sched.outbox.clear()
    return outs


def _multi_turn(sched, turns: int, max_new: int, conversations: int) -> dict:
    """Conversations in turns; turn t+1 = turn t's prompt + its answer + a follow-up question.

    All but the last turn run one request at a time, so older conversations are the least
    recently used when a newer one needs room; the last turn runs all at once (batched
    load-backs, and retraction when they do not fit).
    """
    from hiserve.engine.io_struct import TokenizedGenerateReqInput
    from hiserve.engine.sampling_params import SamplingParams

    questions = ["What is the capital of France?", "Write one sentence about the sea.",
                 "List three prime numbers.", "Why is the sky blue? Answer briefly."]
    tok = sched.tokenizer
    prompts = []
    for q in questions[:conversations]:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                      tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    follow_up = list(tok.encode(" Tell me more, please."))
    outs = {}
    for t in range(turns):
        for i, p in enumerate(prompts):
            sp = SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True)
            sched.add_request(TokenizedGenerateReqInput(rid=f"c{i}t{t}", input_ids=p, sampling_params=sp))
            if t < turns - 1:
                outs.update(_drive(sched))
        outs.update(_drive(sched))
        for i in range(len(prompts)):
            prompts[i] = prompts[i] + outs[f"c{i}t{t}"][0] + follow_up
    return outs


def test_scheduler_multi_turn_with_host_tier_matches_plain_cache():
    from hiserve.engine.scheduler import Scheduler
    from hiserve.server_args import ServerArgs

    # 96 device slots hold about two conversations: the third pushes the oldest to the host.
    def make(**kw):
        return Scheduler(ServerArgs(dtype="float32", device="cpu", max_total_tokens=96, page_size=4,
                                    **kw).resolve(), None)

    plain = make()
    expected = _multi_turn(plain, turns=3, max_new=4, conversations=3)
    plain.kv.check_integrity()
    assert plain.flush_cache()

    sched = make(enable_hierarchical_cache=True)
    assert isinstance(sched.kv.prefix_cache, HiRadixCache) and sched.kv.is_hierarchical
    got = _multi_turn(sched, turns=3, max_new=4, conversations=3)
    sched.kv.check_integrity()
    assert {rid: v[0] for rid, v in got.items()} == {rid: v[0] for rid, v in expected.items()}
    stats = sched.kv.stats()
    host_pool = sched.kv.h.host_pool
    assert stats.backed_up_tokens_total > 0 and stats.loaded_back_tokens_total > 0
    assert stats.host_total == host_pool.size
    assert 0 < stats.host_used <= stats.host_total
    # Later turns were served from the host tier; the plain cache never reports host tokens.
    host_served = {rid: v[2] for rid, v in got.items() if v[2] > 0}
    assert host_served and all(not rid.endswith("t0") for rid in host_served)
    assert all(v[2] == 0 for v in expected.values())

    assert sched.kv.prefix_cache.protected_size() == 0
    assert sched.flush_cache()
    sched.kv.check_integrity()
    assert sched.kv.allocator.available_size() == sched.max_total_num_tokens
    assert host_pool.available_size() == host_pool.size
    assert sched.kv.rtt.available_size() == sched.model_runner.max_running_requests
    assert sched.kv.stats().host_used == 0
