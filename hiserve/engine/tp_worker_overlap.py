"""The forward worker of overlap scheduling: one thread (and, on CUDA, one stream) that runs
the launched batches' forward and sampling in launch order, while the scheduler's thread
prepares the next batch and processes the previous one's results.

Design (the idea of SGLang's `TpModelWorkerClient`, written for hiserve):

- **Future token ids.** A decode batch is prepared before the previous batch's tokens are
  known on the host. A request whose token is still in flight gets the input id
  `-(slot + 1)`; the worker writes every batch's sampled tokens into `future_ids[slot]`
  and, before the next forward, replaces negative ids by a gather from that buffer on the
  device. No host round trip sits between two forwards.
- **Ordering.** On CUDA the scheduler's thread stages each batch's inputs (H2D copies,
  `req_to_token` writes, sampling tensors) on its own current stream and records `ready`;
  the worker's stream waits for `ready`, then runs forward → sample → future write →
  non-blocking copy of the results into pinned memory → `done` event. The worker never
  blocks on the GPU, so the next batch is queued while this one runs. On the CPU the same
  thread path runs the work synchronously in the worker.
- **Reading results.** `ForwardResult.wait()` waits until the worker has queued everything
  and the `done` event has completed, then returns the host `SampleResult`.
- **Slots** are handed out in contiguous ranges from a ring of `3 * max_rows + 2`: a range
  is rewritten only by a batch launched at least two batches later, after the batch that
  reads it has run (the worker runs batches in order).
"""

from __future__ import annotations

import logging
import queue
import threading
from contextlib import nullcontext
from typing import Any, Optional

import torch

from hiserve.engine.sample_result import SampleOutput, SampleResult, SamplingPlan
from hiserve.engine.schedule_batch import ScheduleBatch

logger = logging.getLogger(__name__)


class ForwardResult:
    """The outcome of one launched batch, filled in by the worker thread."""

    def __init__(self) -> None:
        self._queued = threading.Event()  # the worker has queued (CPU: finished) all of the work
        self._forward_queued = threading.Event()  # ... its forward at least (set before _queued)
        self._done_event: Optional[torch.cuda.Event] = None
        self._host: Optional[SampleOutput] = None
        self._logprob_rows: list[int] = []
        self._error: Optional[BaseException] = None
        # Tensors staged on the scheduler's stream that the worker's stream reads: held until
        # the batch has run, so the caching allocator cannot hand their memory out earlier.
        self._keep: list[Any] = []

    def _set(self, host: Optional[SampleOutput], logprob_rows: list[int],
             done_event: Optional[torch.cuda.Event]) -> None:
        self._host, self._logprob_rows, self._done_event = host, logprob_rows, done_event
        self._queued.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._queued.set()
        self._forward_queued.set()

    def wait_forward_queued(self) -> None:
        """Block until the worker has queued this batch's forward (or failed; `fence` and
        `wait` raise the error). Blocking here hands the GIL to the worker."""
        self._forward_queued.wait()

    def fence(self) -> Optional[torch.cuda.Event]:
        """Block until the worker has queued this batch (CPU: finished it); returns the CUDA
        event recorded after its forward and sampling (None on the CPU). Raises what the
        worker raised."""
        self._queued.wait()
        if self._error is not None:
            raise RuntimeError(f"the forward worker failed: {type(self._error).__name__}: "
                               f"{self._error}") from self._error
        return self._done_event

    def wait(self) -> Optional[SampleResult]:
        """Block until the batch has run and its results are on the host; returns them
        (None for a batch that samples nothing: a lone chunk of a long prompt)."""
        event = self.fence()
        if event is not None:
            event.synchronize()
        self._keep = []
        if self._host is None:
            return None
        return SampleResult(self._host, self._logprob_rows)


class OverlapWorker:
    """Runs launched batches in order on a worker thread.

    Args:
        model_runner: the rank's ModelRunner (forward, `sample_on_device`).
        max_rows: the most requests one batch samples (the running-request limit).
    """

    def __init__(self, model_runner: Any, max_rows: int) -> None:
        self.runner = model_runner
        self.device = torch.device(model_runner.device)
        self.is_cuda = self.device.type == "cuda"
        self.num_slots = 3 * max_rows + 2
        with torch.inference_mode():
            self.future_ids = torch.zeros(self.num_slots, dtype=torch.int64, device=self.device)
        self._next_slot = 0
        self.stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        self._queue: queue.Queue = queue.Queue()
        self.num_launched = 0
        self._thread = threading.Thread(target=self._loop, name="hiserve-forward", daemon=True)
        self._thread.start()

    def reserve_slots(self, n: int) -> int:
        """The first of `n` contiguous future-buffer slots for a batch's sampled tokens."""
        if n > self.num_slots // 3:
            raise ValueError(f"a batch samples {n} tokens; the future buffer holds batches of "
                             f"at most {self.num_slots // 3}")
        if self._next_slot + n > self.num_slots:
            self._next_slot = 0
        start = self._next_slot
        self._next_slot += n
        return start

    def launch(self, batch: ScheduleBatch, plan: Optional[SamplingPlan], slot_start: int) -> ForwardResult:
        """Queue `batch` (inputs already staged on the calling thread's stream) for forward
        and sampling; its sampled tokens go to slots `slot_start ..`. Returns at once."""
        ready = None
        if self.is_cuda:
            ready = torch.cuda.Event()
            ready.record()  # on the scheduler thread's current stream, after the staged inputs
        result = ForwardResult()
        result._keep = [plan, batch.input_ids]
        self.num_launched += 1
        self._queue.put((batch, plan, slot_start, ready, result))
        return result

    def _loop(self) -> None:
        ctx = torch.cuda.stream(self.stream) if self.is_cuda else nullcontext()
        with ctx, torch.inference_mode():
            while True:
                batch, plan, slot_start, ready, result = self._queue.get()
                try:
                    if ready is not None:
                        self.stream.wait_event(ready)
                    self._run(batch, plan, slot_start, result)
                except BaseException as e:  # handed to the scheduler thread, which raises it
                    logger.exception("forward worker: batch failed")
                    result._fail(e)

    def _resolve_future_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Replace each `-(slot + 1)` by `future_ids[slot]` (on the device, no sync)."""
        slots = (-input_ids - 1).clamp_(min=0)
        return torch.where(input_ids < 0, self.future_ids.index_select(0, slots), input_ids)

    def _run(self, batch: ScheduleBatch, plan: Optional[SamplingPlan], slot_start: int,
             result: ForwardResult) -> None:
        if batch.has_future_ids:
            batch.input_ids = self._resolve_future_ids(batch.input_ids)
        logits = self.runner.forward(batch)
        result._forward_queued.set()
        host, rows = None, []
        if plan is not None:
            out = self.runner.sample_on_device(logits, batch.sampled_reqs, plan)
            n = out.next_ids.shape[0]
            self.future_ids[slot_start:slot_start + n] = out.next_ids
            host, rows = out.to_host(non_blocking=self.is_cuda), plan.logprob_rows
        done = None
        if self.is_cuda:
            done = torch.cuda.Event()
            done.record(self.stream)
        result._set(host, rows, done)
