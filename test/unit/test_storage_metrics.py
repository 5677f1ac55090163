"""/metrics for the storage tier: cached tokens by `cache_source`, SGLang's storage metric
names (counters advanced to the scheduler's totals, each finished op observed once), failures
by reason; and meta_info's cached_tokens_details gaining "storage" only with a storage tier."""

from __future__ import annotations

from hiserve.engine.io_struct import SchedulerStats
from hiserve.engine.metrics import ServerMetrics


def _samples(m: ServerMetrics) -> dict[str, float]:
    out = {}
    for line in m.render().decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _storage(prefetched: int, recent: list, failures: dict) -> dict:
    return {"prefetched_tokens_total": prefetched, "backuped_tokens_total": 64,
            "prefetch_bytes_total": prefetched * 100, "backup_bytes_total": 6400,
            "failures": failures, "recent": recent, "prefetch_occupied_ratio": 0.25}


def test_storage_metrics_advance_by_difference_and_observe_each_op_once():
    m = ServerMetrics("m")
    ops = [(1, "backup", 4, 0.01, 6400), (2, "prefetch", 2, 0.02, 3200)]
    m.update_stats(SchedulerStats(storage=_storage(32, ops, {"io_error": 1})))
    m.update_stats(SchedulerStats(storage=_storage(48, ops + [(3, "prefetch", 1, 0.0, 1600)],
                                                   {"io_error": 1, "timeout": 2})))
    s = _samples(m)
    assert s['sglang:prefetched_tokens_total{model_name="m"}'] == 48
    assert s['sglang:backuped_tokens_total{model_name="m"}'] == 64
    assert s['sglang:storage_prefetch_bytes_total{model_name="m"}'] == 4800
    assert s['sglang:storage_failures_total{model_name="m",reason="io_error"}'] == 1
    assert s['sglang:storage_failures_total{model_name="m",reason="timeout"}'] == 2
    assert s['sglang:prefetch_pgs_count{model_name="m"}'] == 2  # ops 2 and 3, once each
    assert s['sglang:backup_pgs_sum{model_name="m"}'] == 4
    assert s['sglang:prefetch_bandwidth_count{model_name="m"}'] == 1  # a 0 s op has no bandwidth
    assert s['sglang:storage_backup_duration_seconds_count{model_name="m"}'] == 1
    assert s['sglang:prefetch_occupied_ratio{model_name="m"}'] == 0.25


def test_cached_tokens_by_cache_source():
    m = ServerMetrics("m")
    m.observe_finished(100, 5, 16, 32, 0.5, aborted=False, cached_storage=48)
    m.observe_finished(100, 5, 16, 0, 0.5, aborted=False)
    s = _samples(m)
    for source, want in (("device", 32), ("host", 32), ("storage", 48)):
        assert s[f'sglang:cached_tokens_total{{cache_source="{source}",model_name="m"}}'] == want
    assert s['sglang:cached_tokens_host_total{model_name="m"}'] == 32
    assert not any(k.startswith("sglang:prefetched_tokens_total{") for k in s)  # no storage tier


def test_cached_tokens_details_has_storage_only_with_a_storage_tier():
    from hiserve.engine.req_state import ReqState

    st = ReqState.__new__(ReqState)
    st.cached_device, st.cached_host, st.cached_storage = 16, 8, None
    assert st.cached_tokens_details() == {"device": 16, "host": 8} and st.cached_tokens == 24
    st.cached_storage = 32
    assert st.cached_tokens_details() == {"device": 16, "host": 8, "storage": 32} and st.cached_tokens == 56
