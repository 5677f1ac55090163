"""What a router reads from a replica, without a scheduler: /metrics only with --enable-metrics
(as SGLang), usage.prompt_tokens_details only with --enable-cache-report, and the load
reports (/v1/loads, /get_load) built from the scheduler's internal state."""

from __future__ import annotations

from types import SimpleNamespace

from api_app import make_app as _app

from hiserve.engine.http_server import create_app
from hiserve.engine.io_struct import SchedulerStats
from hiserve.engine.loads import legacy_load, load_entry
from hiserve.engine.openai_routes import _usage


def test_metrics_route_only_with_enable_metrics():
    tm, client = _app()
    assert client.get("/metrics").status_code == 404
    assert "/metrics" not in create_app(tm).openapi()["paths"]
    tm._send_sock.close(linger=0)
    tm, client = _app(enable_metrics=True)
    tm.metrics.update_stats(SchedulerStats(num_running_reqs=3, num_queue_reqs=2, token_usage=0.25))
    r = client.get("/metrics")
    assert r.status_code == 200
    lines = r.text.splitlines()
    for name, value in (("sglang:num_running_reqs", 3.0), ("sglang:num_queue_reqs", 2.0), ("sglang:token_usage", 0.25)):
        assert any(line.startswith(name + "{") and float(line.rsplit(" ", 1)[1]) == value for line in lines), name
    tm._send_sock.close(linger=0)


def test_cache_report_flag_gates_prompt_tokens_details():
    states = [SimpleNamespace(index=i, completion_tokens=4, prompt_tokens=10, cached_tokens=6) for i in range(2)]
    on = _usage(states, n=2, cache_report=True)
    assert (on.prompt_tokens, on.completion_tokens, on.prompt_tokens_details.cached_tokens) == (10, 8, 6)
    off = _usage(states, n=2, cache_report=False).model_dump()
    assert off["prompt_tokens_details"] is None and off["total_tokens"] == 18


def test_load_report_from_internal_state():
    state = {"max_total_num_tokens": 1000, "available_size": 600, "evictable_size": 100,
             "num_running_reqs": 2, "num_queue_reqs": 3, "num_waiting_tokens": 50,
             "max_running_requests": 8, "last_gen_throughput": 12.5}
    e = load_entry(state, cache_hit_rate=0.4)
    assert (e["dp_rank"], e["num_running_reqs"], e["num_waiting_reqs"]) == (0, 2, 3)
    assert (e["num_used_tokens"], e["num_total_tokens"], e["max_total_num_tokens"]) == (300, 350, 1000)
    assert e["token_usage"] == 0.3 and e["cache_hit_rate"] == 0.4 and e["gen_throughput"] == 12.5
    legacy = legacy_load(e)
    assert (legacy["num_reqs"], legacy["num_waiting_reqs"], legacy["num_tokens"], legacy["num_pending_tokens"]) == \
        (5, 3, 350, 50)
