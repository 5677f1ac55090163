"""Overlap scheduling: the scheduler prepares batch N+1 and processes the results of batch N
while the forward of N+1 runs (`OverlapWorker`, a thread with its own CUDA stream).

One iteration (`step_overlap`), with batch N in flight:

    drain N first if it must be (below)
    prepare N+1    decode inputs of requests whose token N has not returned yet are
                   future ids, resolved on the device; KV lengths count that token
    launch N+1     the prefill's requests join the running batch now, so N+2 decodes them;
                   with nothing in flight (an idle device) wait until the worker has queued
                   N+1's forward, so this thread's bookkeeping does not hold the GIL first
    process N      wait for N's tokens (pinned host copy + event), append, check stops,
                   stream, cache / free KV
    poll the KV hierarchy (transfer acks), as every iteration

Semantics kept equal to the synchronous loop:
- **Extra tokens.** A request that N finishes may already be in N+1. Its N+1 token is
  dropped (`Scheduler._take_token`), never streamed nor counted, and its KV release waits
  until no launched forward holds it (`Req.num_inflight`), because that forward reads its
  `req_to_token` row and writes the extra token's slot; the release then frees that slot
  with the rest. A request whose token in flight is certain to end it by length is left
  out of N+1 altogether.
- **Drains** (process N before preparing N+1, the synchronous order) when the next step
  needs host state that N's result changes: a chunked prompt (its next chunk starts where
  N's cache insert leaves it), a request whose sampling reads its token history (repetition,
  frequency or presence penalty, unmet min_new_tokens, a seed: the step's generator mixes
  in the output length) or a grammar (the next mask needs the matcher advanced by N's
  token); and before a retraction (which releases KV that N may be using). SGLang instead
  keeps penalty state on the device and lets the worker wait for the grammar update; a
  drain costs those batches their overlap but is exact by construction.
- **Hierarchical cache.** Load tickets ride with the consuming batch as before; a load-back
  issued while N runs is ordered after N (`KVManager.start_loads(fence)`), since slots
  freed meanwhile may still be read by N. Write-backs are issued at result processing,
  after the producing forward has completed (the host waited for its event).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

from hiserve.engine.schedule_batch import Req, ScheduleBatch
from hiserve.engine.tp_worker_overlap import OverlapWorker

logger = logging.getLogger("hiserve.engine.scheduler")

# Idle while a storage prefetch holds queued requests: a 1 ms nap instead of a spin that
# would starve the storage worker thread of the GIL.
STORAGE_NAP_S = 0.001


def samples_from_history(req: Req) -> bool:
    """Whether sampling `req`'s next token reads host state that its previous token changes
    (so that token must be processed before the next batch is prepared)."""
    sp = req.sampling_params
    return bool(sp.grammar_key is not None or sp.repetition_penalty != 1.0 or sp.frequency_penalty
                or sp.presence_penalty or sp.min_new_tokens > len(req.output_ids)
                or (sp.sampling_seed is not None and not sp.is_greedy))


class OverlapSchedulerMixin:
    """Mixed into `Scheduler` (reads its queues, KV manager and model runner)."""

    overlap_schedule = False
    overlap_worker: Optional[OverlapWorker] = None
    _in_flight: Optional[ScheduleBatch] = None  # launched, results not processed yet
    num_overlapped_batches = 0  # launched while the previous batch was still in flight
    num_drained_batches = 0  # processed before the next batch was prepared
    num_dropped_tokens = 0  # extra tokens of requests that had finished before their batch returned
    num_deferred_releases = 0  # KV releases that waited for a launched forward

    def init_overlap(self) -> None:
        """Start the forward worker (called when overlap scheduling is on)."""
        self.overlap_schedule = True
        self.overlap_worker = OverlapWorker(self.model_runner, self.model_runner.max_running_requests)
        logger.info("Overlap scheduling on: batch N+1 is prepared while batch N runs")

    def step_overlap(self) -> None:
        """One overlapped iteration (see the module docstring)."""
        if self._in_flight is not None and self._must_drain(self._in_flight):
            self._drain_in_flight()
        batch = self.get_next_batch_to_run()
        prev, self._in_flight = self._in_flight, None
        if batch is not None:
            self._launch(batch)
            self._in_flight = batch
            if prev is not None:
                self.num_overlapped_batches += 1
            elif self.overlap_worker.is_cuda:
                # The device is idle: let the worker queue this forward before doing anything
                # else. The worker needs the GIL to launch it, and this thread would otherwise
                # keep it for its bookkeeping (acks, stats, the next batch) until it blocks: in a
                # profiled lone request on an H200 host the GPU sat idle ~3 ms there.
                batch.result.wait_forward_queued()
        if prev is not None:
            self._process_in_flight(prev)
        elif batch is None and self.kv.storage_busy():
            time.sleep(STORAGE_NAP_S)  # requests wait on storage: let its worker thread run
        self.check_cache_events()

    def _must_drain(self, batch: ScheduleBatch) -> bool:
        if batch.chunked_req is not None:
            return True
        return any(samples_from_history(r) for r in batch.sampled_reqs if not r.finished)

    def _drain_in_flight(self) -> bool:
        """Process the batch in flight now, if any; True when there was one."""
        batch, self._in_flight = self._in_flight, None
        if batch is None:
            return False
        self.num_drained_batches += 1
        self._process_in_flight(batch)
        return True

    def _in_flight_fence(self) -> Any:
        """For `KVManager.start_loads`: the CUDA event after the forward in flight (None when
        there is none; on the CPU this waits until that forward has finished)."""
        if self._in_flight is None:
            return None
        return self._in_flight.result.fence()

    def _launch(self, batch: ScheduleBatch) -> None:
        """Stage what the worker must not read from requests, mark the requests in flight,
        and hand the batch to the worker."""
        runner = self.model_runner
        runner.prepare_input_logprobs(batch)
        grammar = runner.grammar_backend(batch.reqs)
        if grammar is not None:
            grammar.start_fill(batch.reqs)  # matchers are created (or fail) on this thread
        batch.grammar_started = True
        reqs = batch.sampled_reqs
        plan = runner.plan_sampling(reqs, self.eos_token_ids, batch.sampled_rows()) if reqs else None
        start = self.overlap_worker.reserve_slots(len(reqs))
        for j, req in enumerate(reqs):
            req.future_slot = start + j
            req.num_pending_tokens += 1
        for req in batch.reqs:
            req.num_inflight += 1
        if batch.forward_mode.is_extend():
            self.running.extend(r for r in reqs if not r.finished)
        batch.result = self.overlap_worker.launch(batch, plan, start)

    def _process_in_flight(self, batch: ScheduleBatch) -> None:
        """Wait for `batch`'s tokens, process them, then release the KV of requests that
        finished while it ran and that no other launched forward holds."""
        result = batch.result.wait()
        batch.result = None
        for req in batch.reqs:
            req.num_inflight -= 1
        for req in batch.sampled_reqs:
            req.num_pending_tokens -= 1
        if batch.forward_mode.is_extend():
            self.process_prefill_tokens(batch, result)
        else:
            self.process_decode_tokens(batch, result)
        for req in batch.reqs:
            if req.num_inflight == 0 and req.release_pending is not None:
                cache, req.release_pending = req.release_pending, None
                self._free_req_kv(req, cache)
