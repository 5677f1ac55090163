"""KVManager scheduling properties of issue 10 on CPU pools:

* load-back only for admitted requests (a request the admission budget refuses starts no
  load-back and evicts nothing);
* eviction with a write in flight parks the node's slots on a pending list until the
  write's ack, instead of freeing them (or waiting for the write);
* a chunked-prefill abort and a retraction leave every page owned exactly once, with and
  without the host tier, and a write never keeps a retracted request's pages locked.

On the CPU a write is complete when `write()` returns; `HeldAckController` holds its acks
back (`done()` is False until released, as a CUDA event would be) to see the in-flight states.
"""

from __future__ import annotations

import pytest
import torch

from hiserve.engine.schedule_batch import Req
from hiserve.engine.schedule_policy import AddResult, PrefillAdder
from hiserve.engine.sampling_params import SamplingParams
from hiserve.mem_cache.cache_controller import CacheAck, HiCacheController
from hiserve.mem_cache.hierarchy import KVSpec, build_kv_hierarchy
from hiserve.mem_cache.kv_manager import KVManager

from cache_driver import Driver, FakeReq
from hiradix_helpers import (
    POOL_SIZE,
    HiDriver,
    assert_consistent,
    assert_everything_freed,
    evict,
    evict_to_host,
    insert_fresh,
    kv_rows,
    make_kv,
    read_kv,
)


class HeldAckController(HiCacheController):
    """A controller whose writes stay 'in flight' until `release()` (or a blocking wait)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.in_flight: list[CacheAck] = []
        self.waits = 0  # blocking waits (`synchronize`) on a write still in flight

    def write(self, device_indices, node_id):
        started = super().write(device_indices, node_id)
        if started is not None:
            ack = started[1]
            self.in_flight.append(ack)
            ack.done = lambda: all(a is not ack for a in self.in_flight)
            ack.synchronize = lambda: self._wait(ack)
        return started

    def _wait(self, ack: CacheAck) -> None:
        if any(a is ack for a in self.in_flight):
            self.waits += 1
        self.in_flight = [a for a in self.in_flight if a is not ack]

    def release(self) -> None:
        self.in_flight = []


def _engine_req(tokens: list[int], max_new_tokens: int) -> Req:
    req = Req("r", tokens, SamplingParams(max_new_tokens=max_new_tokens), False, max_new_tokens, set())
    req.init_next_round_input()
    return req


# ---- (a) load-back only for admitted requests ---------------------------------------------


def _host_hit_with_a_full_device(kv: KVManager) -> tuple[list[int], list[int]]:
    """A 32-token prefix on the host only, and 48 other tokens (evictable) on the device,
    so loading the prefix back would have to evict some of them."""
    hosted, other = list(range(1, 33)), list(range(500, 548))
    insert_fresh(kv, hosted)
    evict_to_host(kv)
    insert_fresh(kv, other)
    kv.poll()
    assert kv.allocator.available_size() == POOL_SIZE - 48
    return hosted, other


def test_refused_request_starts_no_load_back_and_evicts_nothing():
    kv = make_kv(page_size=4, load_back_threshold=1)
    cache = kv.prefix_cache
    hosted, other = _host_hit_with_a_full_device(kv)
    req = _engine_req(hosted + [99, 98], max_new_tokens=4)
    before = (cache.loaded_back_tokens_total, cache.total_size(), kv.allocator.available_size(),
              cache.evictable_size(), cache.host_used_size())

    # A running request's decode reserve leaves only a few tokens of budget.
    running = [_engine_req([7] * 8, max_new_tokens=POOL_SIZE - 4)]
    adder = PrefillAdder(kv, running, 1.0, 4096, None, 4, 8)
    assert adder.rem_total_tokens == 4
    m = kv.match(req)
    assert m.host_hit_length == 32 and kv.loadable_len(req) == 32
    assert adder.add_one_req(req) == AddResult.NO_TOKEN
    assert not adder.can_run and adder.rem_total_tokens == 4
    # Nothing happened to either tier: no load queued or done, no device node evicted.
    after = (cache.loaded_back_tokens_total, cache.total_size(), kv.allocator.available_size(),
             cache.evictable_size(), cache.host_used_size())
    assert after == before
    assert not kv.h.controller.load_queue and kv.start_loads() is None
    assert req.kv.row is None and req.kv.handle is None and cache.protected_size() == 0
    assert cache.match(hosted).host_hit_length == 32
    assert cache.match(other).device_len == 48
    assert_consistent(kv)

    # The same request with the budget to spare is admitted: then (and only then) its host
    # part is loaded back, evicting device nodes to make room.
    adder = PrefillAdder(kv, [], 1.0, 4096, None, 4, 8)
    kv.match(req)
    assert adder.add_one_req(req) == AddResult.CONTINUE
    assert cache.loaded_back_tokens_total == before[0] + 32 and req.kv.prefix_len == 32
    assert cache.match(other).device_len < 48
    kv.start_loads()
    for got, want in zip(read_kv(kv, kv.rtt.slots(req.kv.row, 0, 32)), kv_rows(kv, hosted)):
        assert torch.equal(got, want)
    kv.release(req)
    assert_consistent(kv)
    assert_everything_freed(kv)


def test_budget_refusal_through_lock_and_unlock_leaves_no_trace():
    """The manager-level view of a refusal: match + lock, then unlock (no admit)."""
    kv = make_kv(page_size=4, load_back_threshold=1)
    cache = kv.prefix_cache
    hosted, _ = _host_hit_with_a_full_device(kv)
    insert_fresh(kv, hosted[:8])  # the first two pages on the device again, below the host part
    kv.poll()
    req = FakeReq(hosted + [99])
    req.fill_ids = list(req.origin_input_ids)
    m = kv.match(req)
    assert m.device_len == 8 and m.host_hit_length == 24
    total, free, loaded = cache.total_size(), kv.allocator.available_size(), cache.loaded_back_tokens_total
    assert kv.lock(req) == 8  # its device prefix left the evictable pool
    assert cache.protected_size() == 8
    kv.check_integrity()
    assert kv.unlock(req) == 8
    assert cache.protected_size() == 0 and req.kv.handle is None
    assert (cache.total_size(), kv.allocator.available_size(), cache.loaded_back_tokens_total) == \
        (total, free, loaded)
    assert not kv.h.controller.load_queue
    assert_consistent(kv)
    assert_everything_freed(kv)


# ---- (b) eviction with a write in flight ---------------------------------------------------


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_evicting_a_node_mid_write_parks_its_slots_until_the_ack(policy):
    kv = make_kv(page_size=4, policy=policy, controller_cls=HeldAckController)
    cache, ctrl = kv.prefix_cache, kv.h.controller
    d = Driver(kv)
    d.run(FakeReq(list(range(1, 18))), decode_steps=0)  # 16 tokens cached
    node_slots = cache.match(list(range(1, 17))).device_indices
    assert len(node_slots) == 16
    if policy == "write_through":
        assert ctrl.in_flight  # written on insert, ack held back
    assert cache.protected_size() == 0 and cache.evictable_size() == 16  # writes lock nothing
    free0, room0 = kv.allocator.available_size(), kv.room()

    freed = evict(kv, 16)  # write_back: the write starts here
    assert len(freed) == 0 and ctrl.in_flight
    assert cache.pending_slots() == 16
    assert torch.equal(torch.sort(cache.pending_indices()).values, torch.sort(node_slots).values)
    assert kv.allocator.available_size() == free0  # not handed out while the copy may run
    assert kv.room() == room0  # but still counted as room
    assert cache.match(list(range(1, 17))).host_hit_length == 16  # host-only at once
    kv.check_integrity()
    kv.poll()  # acks still held: nothing released
    assert cache.pending_slots() == 16 and kv.allocator.available_size() == free0
    kv.check_integrity()

    ctrl.release()
    kv.poll()
    assert cache.pending_slots() == 0 and kv.allocator.available_size() == free0 + 16
    assert ctrl.waits == 0  # nobody waited for the write
    assert not cache._writing
    assert_consistent(kv)
    assert_everything_freed(kv)


def test_alloc_waits_for_pending_writes_only_when_short():
    kv = make_kv(page_size=4, controller_cls=HeldAckController)
    cache, ctrl = kv.prefix_cache, kv.h.controller
    d = HiDriver(kv)
    d.run(FakeReq(list(range(1, 34))), decode_steps=0)  # 32 tokens cached, writes held
    evict(kv, POOL_SIZE)
    assert cache.pending_slots() == 32 and kv.allocator.available_size() == 32
    assert kv.room() == POOL_SIZE
    kv.check_integrity()

    # A small request fits in the free slots: no wait.
    small = FakeReq(list(range(200, 209)))
    d.admit(small)
    d.prefill(small)
    assert ctrl.waits == 0 and cache.pending_slots() == 32
    d.finish(small)
    assert ctrl.waits == 0
    evict(kv, POOL_SIZE)  # its pages are in flight too now
    assert kv.allocator.available_size() < 48 <= kv.room()

    # A request needing more than the free slots: the manager evicts what it can, then
    # waits for the writes of the pending slots as a last resort.
    big = FakeReq(list(range(300, 349)))  # 48 tokens to compute
    d.admit(big)
    d.prefill(big)
    assert ctrl.waits > 0 and cache.pending_slots() == 0
    assert big.kv.kv_len == 49
    for got, want in zip(read_kv(kv, d.prefix(big)[:48]), kv_rows(kv, big.origin_input_ids[:48])):
        assert torch.equal(got, want)
    d.finish(big)
    ctrl.release()
    kv.poll()
    assert_consistent(kv)
    assert_everything_freed(kv)


# ---- (c) aborts and retraction, with and without the host tier -------------------------------


TIERS = ["radix", "hierarchical", "chunk"]


def _make_tier(tier: str, page_size: int = 4, num_tokens: int = 64) -> KVManager:
    spec = KVSpec(num_tokens=num_tokens, page_size=page_size, dtype=torch.float32,
                  device=torch.device("cpu"), layer_num=2, num_kv_heads=2, head_dim=4,
                  max_running_requests=8, max_context_len=256,
                  disable_radix_cache=tier == "chunk",
                  enable_hierarchical_cache=tier == "hierarchical", hicache_io_backend="direct")
    return KVManager(build_kv_hierarchy(spec))


def _all_pages_back(kv: KVManager) -> None:
    """Nothing locked or running; every page comes back after evicting everything."""
    kv.poll()
    kv.check_integrity()
    assert kv.prefix_cache.protected_size() == 0 and kv.rtt.available_size() == kv.rtt.size
    evict(kv, kv.allocator.size)
    assert kv.allocator.available_size() == kv.allocator.size
    kv.check_integrity()


@pytest.mark.parametrize("tier", TIERS)
def test_chunked_prefill_abort_leaves_integrity_clean(tier):
    kv = _make_tier(tier)
    d = Driver(kv)
    shared = list(range(1, 21))
    d.run(FakeReq(shared + [50]))
    if tier == "hierarchical":
        evict_to_host(kv)  # the next request loads the shared part back at admission
    req = FakeReq(shared + list(range(60, 90)))
    d.admit(req)
    if tier == "hierarchical":
        assert req.loaded == 20
    elif tier == "radix":
        assert req.kv.prefix_len == 20
    d.prefill(req, chunk=8, stop_after_chunks=2)
    assert req.kv.kv_len > req.kv.prefix_len - 8
    d.abort_chunked(req)  # checks integrity
    kv.poll()  # a load-back keeps its chain locked until the load's ack
    assert kv.prefix_cache.protected_size() == 0
    # The same prompt again completes, re-using whatever the aborted one cached.
    again = d.run(FakeReq(shared + list(range(60, 90))), chunk=8)
    if tier != "chunk":
        assert again.kv.cached_tokens_device + again.kv.cached_tokens_host >= 20
    _all_pages_back(kv)


def _serve_with_retraction(kv: KVManager, prompts: list[list[int]], max_new: int) -> tuple[int, dict]:
    """A decode loop on a tight pool: admit while the room covers a prompt (+2 pages),
    retract the newest request when a decode step does not fit. Returns the retraction
    count and each request's output ids."""
    P = kv.page_size
    d = Driver(kv)
    waiting = [FakeReq(p) for p in prompts]
    running: list[FakeReq] = []
    retractions = 0
    for _ in range(1000):
        if not waiting and not running:
            break
        while waiting:
            r = waiting[0]
            r.fill_ids = r.origin_input_ids + r.output_ids
            kv.match(r)
            kv.lock(r)
            need = len(r.fill_ids) - r.kv.prefix_len - kv.loadable_len(r) + 2 * P
            if kv.room() < need:
                kv.unlock(r)
                break
            waiting.pop(0)
            r.kv.match = None
            d.admit(r)
            d.prefill(r)
            running.append(r)
        while running and kv.room() < kv.decode_need(running):
            r = running.pop()
            d.retract(r)
            retractions += 1
            # A backed-up (write-through) prefix keeps no device page locked.
            assert kv.prefix_cache.protected_size() == sum(x.kv.cache_len for x in running)
            waiting.insert(0, r)
        if running:
            kv.alloc_decode(running)
            for r in running:
                r.output_ids.append(d.new_token())
            d.check()
        for r in [r for r in running if len(r.output_ids) >= max_new]:
            running.remove(r)
            d.finish(r)
    assert not waiting and not running
    return retractions, {i: len(r) for i, r in enumerate(prompts)}


@pytest.mark.parametrize("tier", TIERS)
def test_retraction_and_readmission_leave_integrity_clean(tier):
    kv = _make_tier(tier)
    prompts = [list(range(100 * i + 1, 100 * i + 13)) for i in range(3)]  # 12 tokens each
    retractions, _ = _serve_with_retraction(kv, prompts, max_new=20)  # 3 x 32 tokens > 64
    assert retractions > 0
    _all_pages_back(kv)


def test_retraction_count_is_the_same_with_and_without_the_host_tier():
    """Writes no longer lock: the host tier must not cost extra retractions, not even while
    every write is still in flight (held acks: evicted pages wait on the pending list)."""
    prompts = [list(range(100 * i + 1, 100 * i + 13)) for i in range(3)]
    counts = {}
    for tier in ("radix", "hierarchical", "held"):
        kv = (make_kv(page_size=4, controller_cls=HeldAckController) if tier == "held"
              else _make_tier(tier))
        counts[tier], _ = _serve_with_retraction(kv, prompts, max_new=20)
        if tier == "held":
            assert kv.h.controller.in_flight or kv.h.controller.waits
            kv.h.controller.release()
        _all_pages_back(kv)
    assert counts["radix"] > 0
    assert counts["hierarchical"] == counts["held"] == counts["radix"], counts


def test_retracted_request_readmitted_from_the_host_tier():
    """Retract mid-decode, push its cached KV to the host, re-admit: the load-back serves it."""
    kv = make_kv(page_size=4, load_back_threshold=1)
    d = HiDriver(kv)
    req = FakeReq(list(range(1, 18)))
    d.admit(req)
    d.prefill(req)
    d.decode(req, 4)
    d.retract(req)  # 17 + 5 - 1 = 21 tokens with KV: 20 cached, the tail page freed
    assert kv.prefix_cache.protected_size() == 0 and kv.prefix_cache.evictable_size() == 20
    evict_to_host(kv)
    d.admit(req)
    assert req.loaded == 20 and req.kv.prefix_len == 20
    for got, want in zip(read_kv(kv, d.prefix(req)), kv_rows(kv, (req.origin_input_ids + req.output_ids)[:20])):
        assert torch.equal(got, want)
    d.prefill(req)
    d.decode(req, 2)
    d.finish(req)
    assert_consistent(kv)
    assert_everything_freed(kv)
