"""The scheduler's stats read 0 once it is idle and its cache flushed (they used to keep busy values)."""

from __future__ import annotations

from test_scheduler import make_scheduler, run_all, submit

from hiserve.engine.io_struct import BatchTokenIDOut, FlushCacheReq, FlushCacheReqOutput


def _stats_messages(sched) -> list:
    return [m.stats for m in sched.outbox if isinstance(m, BatchTokenIDOut) and not m.rids]


def test_idle_and_flushed_stats_read_zero():
    sched = make_scheduler(max_total_tokens=4096, max_running_requests=4)
    for i in range(3):
        submit(sched, f"r{i}", [10 + i, 20, 30, 40], max_new=6)
    sched.send_stats()  # busy: a heartbeat at most once a second
    run_all(sched)  # clears the outbox
    sched.send_stats()  # just went idle: one stats message, as the last output's were taken while busy
    sched.send_stats()  # still idle, nothing new: no second message
    idle = _stats_messages(sched)
    assert len(idle) == 1 and idle[0].num_running_reqs == 0 and idle[0].num_queue_reqs == 0
    assert idle[0].token_usage > 0  # the prefix cache still holds the finished requests' KV

    sched.outbox.clear()
    sched._handle(FlushCacheReq())
    stats, reply = sched.outbox
    assert isinstance(reply, FlushCacheReqOutput) and reply.success
    assert stats.stats.num_used_tokens == 0 and stats.stats.token_usage == 0
    assert stats.stats.num_running_reqs == 0 and stats.stats.hicache_host_used_tokens == 0
