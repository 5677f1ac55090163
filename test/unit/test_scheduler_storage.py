"""The scheduler with a `file` storage tier (real default model, CPU): a second scheduler on
the same directory (a restart: empty device and host pools) gets the prompt's prefix from
storage under the wait_complete policy and generates the same greedy tokens; a request
aborted in the queue while its prefetch runs leaves no host page behind."""

from __future__ import annotations

import json
import time

import pytest

from hiserve.engine.io_struct import AbortReq, BatchTokenIDOut

from test_scheduler import PROMPTS, assert_no_leak, chat_ids, collect_outputs, make_scheduler, run_all, submit


class _Watch:
    """run_all's step hook: naps while requests wait on storage; keeps the scheduler's outputs."""

    def __init__(self, sched) -> None:
        self.msgs: list[BatchTokenIDOut] = []
        emit = sched._emit

        def keep(msg) -> None:
            if isinstance(msg, BatchTokenIDOut) and msg.rids:
                self.msgs.append(msg)
            emit(msg)

        sched._emit = keep

    def __call__(self, sched, batch) -> None:
        if batch is None:
            time.sleep(0.002)  # held by its prefetch policy: let the storage worker run

    def storage_tokens(self, rid: str) -> list[int]:
        return [m.cached_tokens_storage[m.rids.index(rid)] for m in self.msgs if rid in m.rids]


def drive(sched, watch: _Watch) -> dict:
    """Run every request to completion: the synchronous loop step by step (run_all), or the
    overlap loop through `step()` (which naps itself while storage holds the queue)."""
    if not sched.overlap_schedule:
        return run_all(sched, on_step=watch)
    steps = 0
    while sched.has_work():
        sched.step()
        steps += 1
        assert steps < 20000, "scheduler did not converge"
    return collect_outputs(sched)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_restart_serves_the_prefix_from_storage_and_abort_in_queue_frees_it(tmp_path, overlap):
    extra = json.dumps({"file_storage_path": str(tmp_path), "prefetch_threshold": 16})
    common = dict(max_total_tokens=1024, page_size=16, chunked_prefill_size=-1,
                  enable_overlap_schedule=overlap, disable_overlap_schedule=not overlap,
                  enable_hierarchical_cache=True, hicache_ratio=2.0, hicache_storage_backend="file",
                  hicache_storage_backend_extra_config=extra)
    first = make_scheduler(**common)
    ids = chat_ids(first, " ".join(PROMPTS))
    assert len(ids) >= 64
    submit(first, "r", ids, max_new=8)
    watch = _Watch(first)
    out_first = drive(first, watch)["r"][0]
    assert set(watch.storage_tokens("r")) == {0}
    assert_no_leak(first)  # flush waits for the storage worker: every page is written
    assert first.internal_state()["storage"]["backuped_tokens_total"] >= len(ids) - 16
    first.model_runner.kv_hierarchy.close()

    second = make_scheduler(**common, hicache_storage_prefetch_policy="wait_complete")
    assert second.overlap_schedule == overlap
    submit(second, "r", ids, max_new=8)
    assert second.waiting_queue[0].kv.prefetch is not None  # started at queue entry
    watch = _Watch(second)
    out_second = drive(second, watch)["r"][0]
    assert out_second == out_first
    aligned = (len(ids) - 1) // 16 * 16
    assert set(watch.storage_tokens("r")) == {aligned}
    assert second.internal_state()["storage"]["prefetched_tokens_total"] == aligned

    assert_no_leak(second)  # flushes the tree; storage keeps the pages
    submit(second, "y", ids, max_new=8)
    assert second.waiting_queue[0].kv.prefetch is not None
    second.abort_request(AbortReq(rid="y"))
    assert not second.waiting_queue
    drive(second, _Watch(second))
    second.kv.prefix_cache.storage.wait_idle(10)
    second.check_cache_events()
    assert not second.kv.prefix_cache._prefetch_ops
    assert_no_leak(second)
    second.model_runner.kv_hierarchy.close()
