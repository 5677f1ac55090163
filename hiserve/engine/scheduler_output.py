"""The scheduler's outgoing side: token batches for the API process, stats and log lines."""

from __future__ import annotations

import logging
import time
from typing import Any

from hiserve.engine.io_struct import BatchTokenIDOut, SchedulerStats
from hiserve.engine.logprobs import logprob_chunk
from hiserve.engine.schedule_batch import Req

logger = logging.getLogger("hiserve.engine.scheduler")

_HEARTBEAT_S = 1.0  # while busy, stats reach the API process at least this often (its /health reads them)
# Token batches carry the scheduler's stats at most this often: computing them here and setting a
# dozen Prometheus gauges in the API process cost ~0.1 ms a message, i.e. per token of a lone
# stream. Stats a batch skipped go out alone after the next step once this much time has passed
# (send_stats), and at once when the server goes idle or a control request asks; /metrics then
# lags by this, or by one step when a step (a long prefill) takes longer.
_STATS_INTERVAL_S = 0.05


class SchedulerOutputMixin:
    """Mixed into `Scheduler`; reads its queues, pools and `server_args`."""

    _drop_outputs = False  # TP ranks other than 0 compute outputs but never send them
    _last_emit_time = 0.0  # of the latest BatchTokenIDOut (monotonic s)
    _idle_stats_sent = False  # the stats of the current idle period have been sent
    _last_stats_time = 0.0  # when a BatchTokenIDOut last carried stats (monotonic s)
    _stats_owed = False  # a token batch went out without stats since they were last sent

    def _send_outputs(self, reqs: list[Req]) -> None:
        interval = self.server_args.stream_interval
        now = time.monotonic()
        fresh = now - self._last_stats_time >= _STATS_INTERVAL_S
        out = BatchTokenIDOut([], [], [], [], [], [], [], stats=self._update_stats() if fresh else None)
        for req in reqs:
            n_report = min(len(req.output_ids), req.max_new_tokens)
            pending = n_report - req.sent_offset
            if not req.finished:
                if not req.stream:
                    continue
                step = req.sampling_params.stream_interval or interval
                if pending < step and req.sent_offset > 0:
                    continue
            out.rids.append(req.rid)
            out.logprobs.append(logprob_chunk(req, req.sent_offset, n_report))
            out.new_output_ids.append(req.output_ids[req.sent_offset:n_report])
            req.sent_offset = n_report
            out.finished_reasons.append(req.finished_reason)
            req.finished_sent = req.finished
            out.prompt_tokens.append(len(req.origin_input_ids))
            out.completion_tokens.append(n_report)
            out.cached_tokens_device.append(req.kv.cached_tokens_device)
            out.cached_tokens_host.append(req.kv.cached_tokens_host)
            if self.kv.has_storage:
                out.cached_tokens_storage.append(req.kv.cached_tokens_storage)
        if out.rids:
            if fresh:
                self._last_stats_time = now
            self._stats_owed = not fresh
            self._emit(out)

    def send_stats(self, force: bool = False) -> None:
        """Send the current stats alone when they would otherwise go stale: on `force`, when the
        server has just gone idle (the last output's stats were taken before its request left
        the running batch), when a token batch went out without them over _STATS_INTERVAL_S
        ago, and once per heartbeat while busy (a liveness signal)."""
        idle = not (self.waiting_queue or self.running or self.chunked_req)
        now = time.monotonic()
        if not force:
            if idle and self._idle_stats_sent:
                return
            owed = self._stats_owed and now - self._last_stats_time >= _STATS_INTERVAL_S
            if not idle and not owed and now - self._last_emit_time < _HEARTBEAT_S:
                return
        self._emit(BatchTokenIDOut([], [], [], [], [], [], [], stats=self._update_stats()))
        self._last_stats_time, self._stats_owed = now, False
        self._idle_stats_sent = idle

    def _emit(self, msg: Any) -> None:
        if self._drop_outputs:
            return  # a TP rank other than 0: rank 0 sends the same outputs
        if isinstance(msg, BatchTokenIDOut):
            self._last_emit_time = time.monotonic()
            self._idle_stats_sent = False
        if self.send_to_api is None:
            self.outbox.append(msg)
        else:
            self.send_to_api.send_pyobj(msg)

    def _update_stats(self) -> SchedulerStats:
        s = self.stats
        s.num_running_reqs = len(self.running)
        s.num_queue_reqs = len(self.waiting_queue)
        kv = self.kv.stats()
        s.num_used_tokens = self.max_total_num_tokens - kv.available
        s.token_usage = s.num_used_tokens / self.max_total_num_tokens
        if self.kv.is_hierarchical:
            s.hicache_host_used_tokens = kv.host_used
            s.hicache_host_total_tokens = kv.host_total
            s.backed_up_tokens_total = kv.backed_up_tokens_total
            s.loaded_back_tokens_total = kv.loaded_back_tokens_total
        s.storage = self.kv.storage_metrics()
        return s

    def _log_prefill(self, reqs: list[Req], extend_lens: list[int]) -> None:
        cached = sum(r.kv.prefix_len for r in reqs)
        self._update_stats()
        logger.info("Prefill batch, #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
                    "#running-req: %d, #queue-req: %d", len(reqs), sum(extend_lens), cached,
                    self.stats.token_usage, len(self.running), len(self.waiting_queue))

    def _log_decode(self) -> None:
        now = time.monotonic()
        self.stats.gen_throughput = self._gen_tokens_since_log / max(1e-9, now - self._last_log_time)
        self._gen_tokens_since_log, self._last_log_time = 0, now
        self._update_stats()
        logger.info("Decode batch, #running-req: %d, #token: %d, token usage: %.2f, "
                    "gen throughput (token/s): %.2f, #queue-req: %d", len(self.running),
                    self.stats.num_used_tokens, self.stats.token_usage, self.stats.gen_throughput,
                    len(self.waiting_queue))
