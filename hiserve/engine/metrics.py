"""Prometheus metrics of the API process, under SGLang's names so existing dashboards work.

Gauges mirror the scheduler's `SchedulerStats` (sent with every output batch); counters
and latency histograms are updated here as requests progress. Every series carries the
label `model_name`. The registry is private, so two servers in one process (tests) do
not collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from hiserve.engine.io_struct import SchedulerStats

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 15.0, 20.0, 25.0, 30.0, 40.0, 60.0, 80.0, 120.0, 200.0, 400.0)
_ITL_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.15,
                0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.0, 4.0, 6.0, 8.0)
_E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0,
                100.0, 150.0, 200.0, 300.0, 400.0, 600.0, 1200.0, 1800.0, 2400.0)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        # From the scheduler.
        self.num_running_reqs = gauge("sglang:num_running_reqs", "Requests in the running batch.")
        self.num_queue_reqs = gauge("sglang:num_queue_reqs", "Requests in the waiting queue.")
        self.num_used_tokens = gauge("sglang:num_used_tokens", "KV slots in use.")
        self.token_usage = gauge("sglang:token_usage", "Used / total KV slots (0-1).")
        self.gen_throughput = gauge("sglang:gen_throughput", "Decode tokens/s over the last log interval.")
        self.cache_hit_rate = gauge("sglang:cache_hit_rate",
                                    "Cached / (cached + new) prompt tokens of the latest prefill batch.")
        self.num_retracted_reqs = gauge("sglang:num_retracted_reqs", "Requests retracted so far.")
        self.hicache_host_used_tokens = gauge("sglang:hicache_host_used_tokens", "Host KV slots in use.")
        self.hicache_host_total_tokens = gauge("sglang:hicache_host_total_tokens", "Host KV slots in all.")
        self.hicache_backup_tokens = counter("sglang:hicache_backup_tokens_total",
                                             "Tokens written back from device to host.")
        self.load_back_tokens = counter("sglang:load_back_tokens_total",
                                        "Tokens loaded back from host to device.")
        # Per request.
        self.prompt_tokens = counter("sglang:prompt_tokens_total", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("sglang:generation_tokens_total", "Generated tokens.")
        self.cached_tokens = counter("sglang:cached_tokens_total", "Prompt tokens served from the cache.")
        self.cached_tokens_device = counter("sglang:cached_tokens_device_total",
                                            "Prompt tokens served from the device cache.")
        self.cached_tokens_host = counter("sglang:cached_tokens_host_total",
                                          "Prompt tokens served from the host cache.")
        self.num_requests = counter("sglang:num_requests_total", "Finished requests.")
        self.num_aborted_requests = counter("sglang:num_aborted_requests_total", "Aborted requests.")
        self.ttft = histogram("sglang:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = histogram("sglang:inter_token_latency_seconds", "Time between output tokens.",
                             _ITL_BUCKETS)
        self.e2e = histogram("sglang:e2e_request_latency_seconds", "Request latency, receipt to finish.",
                             _E2E_BUCKETS)
        self._backed_up_seen = 0
        self._loaded_back_seen = 0
        self.last_gen_throughput = 0.0
        self.last_cache_hit_rate = 0.0

    def update_stats(self, s: SchedulerStats) -> None:
        self.num_running_reqs.set(s.num_running_reqs)
        self.num_queue_reqs.set(s.num_queue_reqs)
        self.num_used_tokens.set(s.num_used_tokens)
        self.token_usage.set(s.token_usage)
        self.gen_throughput.set(s.gen_throughput)
        self.last_gen_throughput = s.gen_throughput
        self.cache_hit_rate.set(s.cache_hit_rate)
        self.last_cache_hit_rate = s.cache_hit_rate
        self.num_retracted_reqs.set(s.num_retracted_reqs)
        self.hicache_host_used_tokens.set(s.hicache_host_used_tokens)
        self.hicache_host_total_tokens.set(s.hicache_host_total_tokens)
        # The scheduler reports running totals; counters advance by the difference.
        if s.backed_up_tokens_total > self._backed_up_seen:
            self.hicache_backup_tokens.inc(s.backed_up_tokens_total - self._backed_up_seen)
            self._backed_up_seen = s.backed_up_tokens_total
        if s.loaded_back_tokens_total > self._loaded_back_seen:
            self.load_back_tokens.inc(s.loaded_back_tokens_total - self._loaded_back_seen)
            self._loaded_back_seen = s.loaded_back_tokens_total

    def observe_finished(self, prompt_tokens: int, completion_tokens: int, cached_device: int,
                         cached_host: int, e2e_latency: float, aborted: bool) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.cached_tokens.inc(cached_device + cached_host)
        self.cached_tokens_device.inc(cached_device)
        self.cached_tokens_host.inc(cached_host)
        self.num_requests.inc()
        if aborted:
            self.num_aborted_requests.inc()
        self.e2e.observe(e2e_latency)

    def render(self) -> bytes:
        return generate_latest(self.registry)
