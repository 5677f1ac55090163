"""The storage tier wired into the KV hierarchy, with the real `file` backend in a temp dir:
write-through to L3 after the host write's ack (stored pages are not written again), a
"restarted" hierarchy on the same directory prefetching a prefix back (L3 → host → device,
KV byte-identical), the three prefetch policies observed on a gated FileStorage, abort during
a prefetch, and failing backends (a miss and a recompute, counted). Every scenario ends with
the KV manager's integrity check (device pages, host slots incl. those prefetches hold)."""

from __future__ import annotations

import os
import time

import pytest
import torch

from hiserve.mem_cache.storage_controller import BackupOp, StorageConfig

from cache_driver import FakeReq
from hiradix_helpers import HiDriver, assert_everything_freed, kv_rows, read_kv
from storage_helpers import (GatedFileStorage, RaisingFileStorage, WriteGatedFileStorage, backend,
                             make_storage_kv, settle)

PROMPT = list(range(100, 141))  # 41 tokens: 10 full pages of the prefix fill_ids[:-1]


def _serve(kv, prompt=PROMPT) -> FakeReq:
    d = HiDriver(kv)
    req = d.run(FakeReq(list(prompt)), decode_steps=0)
    settle(kv)  # host write acked -> backup queued -> worker done
    kv.check_integrity()
    return req


def _all_freed(kv) -> None:
    settle(kv)  # backups of the last inserts pin their host pages until the worker is done
    assert_everything_freed(kv)


def _stored_nodes(kv) -> list:
    return [n for n in kv.prefix_cache._nodes() if n.storage_state == "stored"]


def _check_prefix_kv(kv, req: FakeReq, n_tokens: int) -> None:
    """The request's first n_tokens slots hold the KV its tokens 'compute'."""
    slots = kv.rtt.slots(req.kv.row, 0, n_tokens)
    for got, want in zip(read_kv(kv, slots), kv_rows(kv, req.origin_input_ids[:n_tokens])):
        assert torch.equal(got, want)


def test_write_through_after_host_ack(tmp_path):
    kv = make_storage_kv(tmp_path)
    d = HiDriver(kv)
    req = FakeReq(list(PROMPT))
    d.admit(req)
    d.prefill(req)
    # The insert started the host write; nothing reaches storage before its ack is polled.
    assert backend(kv).stats().pages_written == 0
    d.finish(req)
    settle(kv)
    stats = backend(kv).stats()
    assert stats.pages_written == 10 and stats.failures == {}
    assert sum(len(n.key) for n in _stored_nodes(kv)) == 40
    files = os.listdir(os.path.join(tmp_path, backend(kv).namespace))
    assert len(files) == 20  # K and V per page
    assert kv.prefix_cache.storage_stats.backuped_tokens_total == 40
    kv.check_integrity()
    _all_freed(kv)


def test_stored_pages_are_not_written_again(tmp_path):
    kv = make_storage_kv(tmp_path)
    _serve(kv)
    # A longer prompt sharing the prefix: only its new pages are written.
    _serve(kv, PROMPT + list(range(200, 208)))
    stats = backend(kv).stats()
    assert stats.pages_written == 12, stats
    # A second server on the same directory computing the same prompt skips every page.
    kv2 = make_storage_kv(tmp_path)
    _serve(kv2)
    s2 = backend(kv2).stats()
    assert s2.pages_written == 0 and kv2.prefix_cache.storage_stats.backuped_tokens_total == 0
    assert sum(len(n.key) for n in _stored_nodes(kv2)) == 40
    _all_freed(kv)
    _all_freed(kv2)


def _prefetched_admission(kv, prompt=PROMPT) -> FakeReq:
    d = HiDriver(kv)
    req = FakeReq(list(prompt))
    kv.start_prefetch(req)
    assert req.kv.prefetch is not None
    settle(kv)
    assert kv.prefetch_ready(req)
    d.admit(req)
    return req


def test_restart_prefetches_the_prefix_back_with_identical_kv(tmp_path):
    _serve(make_storage_kv(tmp_path))
    kv = make_storage_kv(tmp_path)  # empty device and host pools, same directory
    req = _prefetched_admission(kv)
    assert req.kv.storage_tokens == 40 and req.loaded == 40
    assert req.kv.cached_tokens_storage == 40 and req.kv.cached_tokens_host == 0
    _check_prefix_kv(kv, req, 40)
    assert kv.prefix_cache.storage_stats.prefetched_tokens_total == 40
    HiDriver(kv).prefill(req)
    HiDriver(kv).finish(req)
    settle(kv)
    assert backend(kv).stats().pages_written == 0  # prefetched pages are known to be stored
    _all_freed(kv)


def test_prefetch_below_threshold_or_with_nothing_stored_is_skipped(tmp_path):
    kv = make_storage_kv(tmp_path, threshold=64)
    req = FakeReq(list(PROMPT))
    kv.start_prefetch(req)
    assert req.kv.prefetch is None  # 40 tokens < 64
    kv = make_storage_kv(tmp_path)
    kv.start_prefetch(req)
    settle(kv)
    assert kv.prefetch_ready(req) and req.kv.storage_tokens == 0  # nothing stored: a miss
    kv.check_integrity()
    _all_freed(kv)


def _gated(tmp_path, policy, **kw):
    _serve(make_storage_kv(tmp_path))
    kv = make_storage_kv(tmp_path, policy=policy, backend_cls=GatedFileStorage, **kw)
    req = FakeReq(list(PROMPT))
    kv.start_prefetch(req)
    op = req.kv.prefetch
    settle(kv, until=lambda: op.phase == "fetch")  # 10 pages found, host slots taken
    kv.check_integrity()  # the op's 40 host slots are counted
    return kv, req, op


def _let_batches(kv, op, n: int) -> None:
    want = op.completed_pages + 2 * n
    for _ in range(n):
        backend(kv).permits.release()
    settle(kv, until=lambda: op.completed_pages >= want)


def test_best_effort_takes_what_arrived(tmp_path):
    kv, req, op = _gated(tmp_path, "best_effort")
    _let_batches(kv, op, 2)  # 2 batches of 2 pages
    assert kv.prefetch_ready(req)
    assert req.kv.storage_tokens == 16
    kv.check_integrity()  # the 24 slots still in the worker's hands are counted
    host = kv.prefix_cache.mem_pool_host
    before = host.available_size()
    for _ in range(5):
        backend(kv).permits.release()
    settle(kv)
    assert backend(kv).calls == 3  # cancelled: it stopped after the batch it was in
    assert host.available_size() == before + 24
    d = HiDriver(kv)
    d.admit(req)
    assert req.loaded == 16 and req.kv.cached_tokens_storage == 16
    _check_prefix_kv(kv, req, 16)
    d.prefill(req)
    d.finish(req)
    _all_freed(kv)


def test_wait_complete_holds_the_request_until_done(tmp_path):
    kv, req, op = _gated(tmp_path, "wait_complete", timeout_base=0.0, timeout_per_ki=0.0)
    _let_batches(kv, op, 4)
    assert not kv.prefetch_ready(req) and req.kv.prefetch is op
    backend(kv).permits.release()
    settle(kv)
    assert kv.prefetch_ready(req) and req.kv.storage_tokens == 40
    d = HiDriver(kv)
    d.admit(req)
    _check_prefix_kv(kv, req, 40)
    d.prefill(req)
    d.finish(req)
    _all_freed(kv)


def test_timeout_holds_then_takes_what_arrived(tmp_path):
    kv, req, op = _gated(tmp_path, "timeout", timeout_base=0.3, timeout_per_ki=0.0)
    _let_batches(kv, op, 2)
    assert not kv.prefetch_ready(req)
    budget = op.started + 0.3
    time.sleep(max(0.0, budget - time.monotonic()) + 0.01)
    assert kv.prefetch_ready(req) and req.kv.storage_tokens == 16
    for _ in range(5):
        backend(kv).permits.release()
    settle(kv)
    kv.check_integrity()
    d = HiDriver(kv)
    d.admit(req)
    assert req.loaded == 16
    _check_prefix_kv(kv, req, 16)
    d.prefill(req)
    d.finish(req)
    _all_freed(kv)


def test_timeout_budget_grows_with_the_prefix():
    from hiserve.mem_cache.storage_controller import PrefetchOp

    cfg = StorageConfig("timeout", 8, 1.0, 0.25)
    op = PrefetchOp(["k"] * 1024, [], 0, 4, started=100.0)  # 4096 tokens before batch_exists

    class C:  # only what prefetch_ready reads
        storage_config = cfg

    from hiserve.mem_cache.hiradix_storage import HiRadixStorageMixin
    ready = HiRadixStorageMixin.prefetch_ready
    assert not ready(C(), op, now=101.9)  # budget 1 + 0.25 * 4 = 2 s
    assert ready(C(), op, now=102.0)


def test_abort_during_prefetch_leaks_no_host_pages(tmp_path):
    kv, req, op = _gated(tmp_path, "wait_complete")
    _let_batches(kv, op, 1)
    kv.cancel_prefetch(req)
    assert req.kv.prefetch is None
    kv.check_integrity()  # slots still held by the op in the worker's hands
    for _ in range(5):
        backend(kv).permits.release()
    settle(kv)
    assert backend(kv).calls == 2
    assert not kv.prefix_cache._prefetch_ops
    _all_freed(kv)


def test_abort_before_batch_exists_returns(tmp_path):
    _serve(make_storage_kv(tmp_path))
    kv = make_storage_kv(tmp_path, policy="wait_complete")
    req = FakeReq(list(PROMPT))
    kv.start_prefetch(req)
    kv.cancel_prefetch(req)
    settle(kv)
    assert not kv.prefix_cache._prefetch_ops
    _all_freed(kv)


def test_unusable_directory_is_a_counted_miss_and_the_request_recomputes(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    kv = make_storage_kv(blocker)
    req = _serve(kv)
    assert req.output_ids  # served
    state = kv.storage_state()
    assert sum(state["failures"].values()) >= 1, state
    assert not _stored_nodes(kv)
    kv2 = make_storage_kv(blocker)
    again = FakeReq(list(PROMPT))
    kv2.start_prefetch(again)
    settle(kv2)
    assert kv2.prefetch_ready(again) and again.kv.storage_tokens == 0
    HiDriver(kv2).run(again, decode_steps=0)  # recomputed
    assert again.kv.cached_tokens_storage == 0
    _all_freed(kv)
    _all_freed(kv2)


def test_a_raising_backend_is_counted_and_never_breaks_serving(tmp_path):
    kv = make_storage_kv(tmp_path, backend_cls=RaisingFileStorage)
    _serve(kv)
    assert kv.storage_state()["failures"] == {"worker_error": 1}  # the backup
    assert not _stored_nodes(kv)
    kv2 = make_storage_kv(tmp_path, backend_cls=RaisingFileStorage)
    req = FakeReq(list(PROMPT))
    kv2.start_prefetch(req)
    settle(kv2)
    assert kv2.prefetch_ready(req) and req.kv.storage_tokens == 0
    assert kv2.storage_state()["failures"] == {"worker_error": 1}  # the batch_exists
    HiDriver(kv2).run(req, decode_steps=0)
    _all_freed(kv)
    _all_freed(kv2)


def test_worker_runs_ops_in_order_and_closes(tmp_path):
    kv = make_storage_kv(tmp_path)
    storage = kv.prefix_cache.storage
    op = BackupOp([], [])
    storage.submit(op)
    assert storage.wait_idle(5)
    assert storage.poll() == [op] and storage.in_flight() == 0
    kv.h.close()
    assert not storage._thread.is_alive()
    with pytest.raises(RuntimeError):
        storage.submit(BackupOp([], []))
    kv.h.close()  # idempotent


def test_host_eviction_skips_pages_a_backup_still_reads(tmp_path):
    kv = make_storage_kv(tmp_path, backend_cls=WriteGatedFileStorage)
    d = HiDriver(kv)
    req = d.run(FakeReq(list(PROMPT)), decode_steps=0)
    assert req.kv.row is None
    kv.poll()  # host write acked: the backup is queued and its nodes pinned
    cache = kv.prefix_cache
    assert cache.storage.in_flight() == 1
    kv.evict(cache.total_size())  # device -> host only
    assert cache.evict_host(cache.host_total_size()) == 0  # pinned by the backup
    kv.check_integrity()
    backend(kv).permits.release()
    settle(kv)
    assert cache.evict_host(cache.host_total_size()) == 40
    _all_freed(kv)


def test_close_at_exit_finishes_the_running_op_and_hands_queued_ones_back(tmp_path):
    import threading

    kv = make_storage_kv(tmp_path, backend_cls=WriteGatedFileStorage)
    storage, ns = kv.prefix_cache.storage, kv.prefix_cache.storage_namespace
    first, second = BackupOp([f"{ns}/aa"], [0]), BackupOp([f"{ns}/bb"], [1])
    storage.submit(first)
    storage.submit(second)
    time.sleep(0.1)  # the worker is inside first's batch_set_from, waiting for its permit
    closer = threading.Thread(target=storage.close, kwargs={"run_queued": False, "timeout": 10})
    closer.start()
    time.sleep(0.05)
    backend(kv).permits.release()
    closer.join(10)
    assert not storage._thread.is_alive()
    assert storage.poll() == [first, second] and storage.in_flight() == 0
    assert first.stored_pages == 1 and first.error is None
    assert second.stored_pages == 0 and second.error == "storage closed"


def _path_keys(kv, tokens: list[int]) -> list[str]:
    """The page keys the tree holds along `tokens` (root first)."""
    cache, node, keys = kv.prefix_cache, kv.prefix_cache.root_node, []
    while tokens:
        node = node.children[cache._child_key(tokens)]
        keys += node.storage_keys
        tokens = tokens[len(node.key):]
    return keys


@pytest.mark.parametrize("in_flight", [False, True])
def test_keys_states_and_pins_survive_node_splits(tmp_path, in_flight):
    from hiserve.mem_cache.storage.keys import page_keys

    kv = make_storage_kv(tmp_path, backend_cls=WriteGatedFileStorage)
    cache, ns = kv.prefix_cache, kv.prefix_cache.storage_namespace
    d = HiDriver(kv)
    d.run(FakeReq(list(PROMPT)), decode_steps=0)
    kv.poll()  # the backup of the 40-token node is queued (and waits for its permit)
    if not in_flight:
        backend(kv).permits.release()
        settle(kv)
        assert [n.storage_state for n in cache._nodes()] == ["stored"]
    other = PROMPT[:20] + list(range(500, 521))  # shares 5 pages, then diverges: a split
    d.run(FakeReq(other), decode_steps=0)
    kv.check_integrity()
    for tokens in (PROMPT[:40], other[:40]):
        assert _path_keys(kv, tokens) == page_keys(tokens, 4, ns)
    halves = [n for n in cache._nodes() if n.key[:4] == PROMPT[:4] or n.key[:4] == PROMPT[20:24]]
    assert len(halves) == 2 and len({n.storage_state for n in halves}) == 1
    if in_flight:
        assert all(n.storage_ops for n in halves)  # the upper half joined the pin
    for _ in range(3):
        backend(kv).permits.release()
    settle(kv)
    assert all(n.storage_state == "stored" for n in cache._nodes())
    assert backend(kv).stats().pages_written == 15
    _all_freed(kv)
