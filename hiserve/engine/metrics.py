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
        self.model_name = model_name
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
        self._init_cache_source_metrics(labels)
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
        self._update_storage_stats(s.storage)

    def observe_finished(self, prompt_tokens: int, completion_tokens: int, cached_device: int,
                         cached_host: int, e2e_latency: float, aborted: bool, cached_storage: int = 0) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self._observe_cached(cached_device, cached_host, cached_storage)
        self.cached_tokens_device.inc(cached_device)
        self.cached_tokens_host.inc(cached_host)
        self.num_requests.inc()
        if aborted:
            self.num_aborted_requests.inc()
        self.e2e.observe(e2e_latency)

    # ---- cached tokens by tier, and the storage tier (L3) -------------------------------------

    def _init_cache_source_metrics(self, labels: list[str]) -> None:
        """`sglang:cached_tokens_total` by `cache_source` (device, host, storage; SGLang's label)
        and SGLang's storage metrics (StorageMetricsCollector's names), plus hiserve's bytes,
        durations and failures by reason. Storage series appear once a storage tier reports."""
        reg, name = self.registry, labels
        self.cached_tokens = Counter("sglang:cached_tokens_total", "Prompt tokens served from the cache, "
                                     "by the tier they came from.", name + ["cache_source"], registry=reg)
        self._storage_seen: dict[str, float] = {}
        self._storage_seq = 0
        io, bw = (1, 5, 10, 50, 100), (0.1, 0.5, 1, 5, 10, 50, 100)
        secs = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0)
        self.storage_counters = {
            "prefetched_tokens_total": Counter("sglang:prefetched_tokens_total",
                                               "Prompt tokens prefetched from storage into the tree.", name, registry=reg),
            "backuped_tokens_total": Counter("sglang:backuped_tokens_total",
                                             "Tokens written to storage (pages already there not counted).",
                                             name, registry=reg),
            "prefetch_bytes_total": Counter("sglang:storage_prefetch_bytes_total",
                                            "Bytes read from storage for prefetched tokens.", name, registry=reg),
            "backup_bytes_total": Counter("sglang:storage_backup_bytes_total", "Bytes written to storage.",
                                          name, registry=reg)}
        self.storage_failures = Counter("sglang:storage_failures_total", "Storage failures (each a miss), by reason.",
                                        name + ["reason"], registry=reg)
        hist = {"pgs": ("sglang:{}_pgs", "Histogram of {} pages of batches.", io),
                "bandwidth": ("sglang:{}_bandwidth", "Histogram of {} bandwidth in GB/s.", bw),
                "seconds": ("sglang:storage_{}_duration_seconds", "Storage {} op duration in seconds.", secs)}
        self.storage_hist = {(kind, h): Histogram(n.format(kind), d.format(kind), name, buckets=b, registry=reg)
                             for kind in ("prefetch", "backup") for h, (n, d, b) in hist.items()}
        self.prefetch_occupied_ratio = Gauge("sglang:prefetch_occupied_ratio", "Host slots prefetches hold / "
                                             "their cap (half the host pool).", name, registry=reg)

    def _observe_cached(self, device: int, host: int, storage: int) -> None:
        for source, n in (("device", device), ("host", host), ("storage", storage)):
            self.cached_tokens.labels(self.model_name, source).inc(n)

    def _update_storage_stats(self, storage: dict | None) -> None:
        """Advance the storage counters to the scheduler's totals; observe each new op once."""
        if not storage:
            return
        m = self.model_name
        for key, counter in self.storage_counters.items():
            seen = self._storage_seen.get(key, 0)
            if storage[key] > seen:
                counter.labels(m).inc(storage[key] - seen)
                self._storage_seen[key] = storage[key]
        for reason, n in storage["failures"].items():
            seen = self._storage_seen.get("failures:" + reason, 0)
            if n > seen:
                self.storage_failures.labels(m, reason).inc(n - seen)
                self._storage_seen["failures:" + reason] = n
        for seq, kind, pages, seconds, nbytes in storage["recent"]:
            if seq <= self._storage_seq:
                continue
            self._storage_seq = seq
            self.storage_hist[(kind, "pgs")].labels(m).observe(pages)
            self.storage_hist[(kind, "seconds")].labels(m).observe(seconds)
            if seconds > 0 and nbytes:
                self.storage_hist[(kind, "bandwidth")].labels(m).observe(nbytes / seconds / 1e9)
        self.prefetch_occupied_ratio.labels(m).set(storage["prefetch_occupied_ratio"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
