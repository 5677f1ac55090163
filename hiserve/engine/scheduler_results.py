"""The scheduler's result processing: sampled tokens into requests, stop checks, streaming,
and giving finished requests' KV back (`Scheduler` mixes this in; the synchronous loop and
the overlap loop both use it).
"""

from __future__ import annotations

import logging
from typing import Optional

from hiserve.engine.logprobs import record_input_logprobs
from hiserve.engine.sample_result import SampleResult
from hiserve.engine.schedule_batch import Req, ScheduleBatch

logger = logging.getLogger("hiserve.engine.scheduler")

_MIN_NEW_TOKEN_RATIO = 0.1
_NEW_TOKEN_RATIO_DECAY = 0.001


class SchedulerResultsMixin:
    """Mixed into `Scheduler`; reads and updates its running batch, KV manager and stats."""

    def _take_token(self, req: Req, row: int, result: SampleResult) -> bool:
        """Record row `row` of `result` on `req`: its token, logprobs and grammar step. False
        (nothing recorded) for a request that finished while the pass ran (overlap: a stop,
        length or abort seen after this batch was launched): that extra token is dropped."""
        if req.finished:
            self.num_dropped_tokens += 1
            return False
        tok = result.next_ids[row]
        req.output_ids.append(tok)
        result.record_logprobs(req, row)
        if req.grammar is not None and not req.grammar.is_terminated():
            if not req.grammar.accept_token(tok):
                logger.warning("grammar rejected sampled token %d of request %s", tok, req.rid)
        return True

    def process_prefill_tokens(self, batch: ScheduleBatch, result: Optional[SampleResult]) -> None:
        record_input_logprobs(batch)
        hit = sum(batch.extend_prefix_lens_cpu)
        self.stats.cache_hit_rate = hit / max(1, hit + sum(batch.extend_seq_lens_cpu))
        taken, done = [], []
        for row, req in enumerate(batch.sampled_reqs):
            if not self._take_token(req, row, result):
                if not req.finished_sent:  # ended without a token (its grammar failed to compile)
                    taken.append(req)
                done.append(req)
                continue
            taken.append(req)
            if req.max_new_tokens == 0:
                req.finished_reason = {"type": "length", "length": 0}
            else:
                self._check_finished(req)
            if req.finished:
                done.append(req)
            else:
                # Insert the prompt now, so requests arriving meanwhile share it.
                self.kv.cache(req, finished=False)
                if not self.overlap_schedule:
                    self.running.append(req)  # (overlap: it joined the running batch at launch)
        if self.overlap_schedule:
            self.running = [r for r in self.running if not r.finished]
        req = batch.chunked_req
        if req is not None and not req.finished:
            self.kv.cache(req, finished=False)
            req.fill_ids = req.origin_input_ids + req.output_ids
        try:
            self._send_outputs(taken)
        finally:
            # After the replies: caching a finished prompt (a tree insert, and with a host
            # tier the start of its write-through) is then off the path of its answer, which
            # matters most for a one-token follow-up on a cached prefix.
            for req in done:
                self._free_req_kv(req, cache=True)

    def process_decode_tokens(self, batch: ScheduleBatch, result: SampleResult) -> None:
        taken = [req for row, req in enumerate(batch.reqs) if self._take_token(req, row, result)]
        for req in taken:
            self._check_finished(req)
        self._gen_tokens_since_log += len(taken)
        self._decode_steps += 1
        self.new_token_ratio = max(_MIN_NEW_TOKEN_RATIO, self.new_token_ratio - _NEW_TOKEN_RATIO_DECAY)
        self._send_outputs(taken)  # (a request dropped here was answered when it finished)
        self._reap_finished_running()
        if self._decode_steps % self.server_args.decode_log_interval == 0:
            self._log_decode()

    def _check_finished(self, req: Req) -> None:
        """`req.check_finished`, isolated: if it raises (a stop-string decode of a bad id,
        say), only this request ends, with a 500 error; the batch's others go on."""
        try:
            req.check_finished(self.tokenizer, self.context_len)
        except Exception as e:  # any failure of one request's update is that request's alone
            logger.exception("request %s: checking its stop conditions failed", req.rid)
            req.abort(f"Internal error while processing the output: {type(e).__name__}: {e}",
                      status_code=500)

    def _free_req_kv(self, req: Req, cache: bool) -> None:
        """A finished (`cache`) or abandoned request gives its KV back: into the prefix cache,
        or freed uncached. While a launched forward still holds the request (overlap) that
        forward reads its row and writes its slots, so the release waits for its result."""
        if req.num_inflight > 0:
            self.num_deferred_releases += req.release_pending is None
            req.release_pending = cache
            return
        if req.kv.row is None:
            return
        if cache:
            self.kv.cache(req, finished=True)
        else:
            self.kv.release(req)

    def _reap_finished_running(self) -> None:
        still = []
        for req in self.running:
            if req.finished:
                self._free_req_kv(req, cache=True)
                if not req.finished_sent:  # an abort: its reply goes now
                    self._send_outputs([req])
            else:
                still.append(req)
        self.running = still
