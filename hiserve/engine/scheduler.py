"""The scheduler process: receive → schedule → run → process results → cache events, every iteration.

Tensor parallelism (`--tp-size N`): one scheduler process per rank, each with its own model
shard and KV hierarchy. Rank 0 receives from the API process and broadcasts every
iteration's messages (a pickled list on the gloo CPU group, as SGLang does); every rank then
runs the same deterministic loop on the same inputs, so each makes the same batches, slot
and page choices and runs the same forward (sampled tokens are broadcast from rank 0).
Only rank 0 sends outputs. See `hiserve/distributed/` and the TP notes in
`hiserve/mem_cache/README.md` for where ranks could diverge and how they are kept together.

Continuous batching: a prefill (extend) pass admits waiting requests whenever the budgets
allow, otherwise the running requests decode one token each. Long prompts are split into
chunks (chunked prefill); when the device pool cannot hold the next decode step, running
requests are retracted back to the waiting queue (their KV goes to the radix cache).
"""

from __future__ import annotations

import logging
import signal
import time
import traceback
from typing import Any, Optional

import torch
import zmq

from hiserve.distributed import broadcast_pyobj, get_tp_group, init_tp_group
from hiserve.engine.io_struct import (
    AbortReq,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    SchedulerReady,
    SchedulerStats,
    TokenizedGenerateReqInput,
)
from hiserve.engine.logprobs import init_req_logprobs, request_options
from hiserve.engine.model_runner import ModelRunner
from hiserve.engine.schedule_batch import Req, ScheduleBatch
from hiserve.engine.sample_result import SampleResult
from hiserve.engine.scheduler_output import SchedulerOutputMixin
from hiserve.engine.scheduler_overlap import STORAGE_NAP_S, OverlapSchedulerMixin
from hiserve.engine.scheduler_results import SchedulerResultsMixin
from hiserve.engine.signals import exit_on_sigterm
from hiserve.engine.schedule_policy import AddResult, PrefillAdder, order_waiting_queue
from hiserve.engine.tokenizer_spec import tokenizer_spec
from hiserve.layers.forward_batch import ForwardMode
from hiserve.mem_cache.kv_manager import KVManager
from hiserve.models.loader import get_tokenizer
from hiserve.server_args import PortArgs, ServerArgs

logger = logging.getLogger(__name__)

_INIT_NEW_TOKEN_RATIO = 0.7
_IDLE_POLL_MS = 50
# How long an idle scheduler waits for requests the API process says are on their way (~2 ms
# each for a 1000-token chat prompt): bounds the wait where one of them fails validation.
_COALESCE_MS = 20
# ... and at most this long for the next one of them: a request the API process counted but then
# refused (validation) or that is slow to tokenize does not hold the batch for the whole window.
_COALESCE_GAP_MS = 5
# A waiting request whose uncached part begins with this many tokens that a request in the
# same prefill batch computes waits one round, then hits them in the radix cache.
_IN_BATCH_PREFIX_MIN = 32


class Scheduler(OverlapSchedulerMixin, SchedulerResultsMixin, SchedulerOutputMixin):
    """Owns the running batch, the waiting queue and the model runner; asks the KV manager
    (`self.kv`, the only door to the KV hierarchy) for prefixes and slots. With overlap
    scheduling (on unless `--disable-overlap-schedule`, see ServerArgs) `step` runs the
    overlapped iteration of `hiserve.engine.scheduler_overlap`."""

    def __init__(self, server_args: ServerArgs, port_args: Optional[PortArgs]):
        self.server_args = server_args
        self.tp = get_tp_group()
        self._drop_outputs = not self.tp.is_first  # only rank 0 answers the API process
        self.page_size = server_args.page_size
        self.model_runner = ModelRunner(server_args)
        self.device = self.model_runner.device
        self.tokenizer = get_tokenizer(server_args.tokenizer_path)
        self.context_len = self.model_runner.context_len
        self.max_total_num_tokens = self.model_runner.max_total_num_tokens
        self.max_req_input_len = min(self.context_len - 1, self.max_total_num_tokens - 1) - 5
        self.eos_token_ids = set(self.model_runner.model_config.eos_token_ids)
        self.kv = KVManager(self.model_runner.kv_hierarchy,
                            debug_checks=server_args.enable_cache_integrity_check)

        self.waiting_queue: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Optional[Req] = None
        self.new_token_ratio = _INIT_NEW_TOKEN_RATIO
        self.stats = SchedulerStats()
        self._decode_steps = 0
        self._gen_tokens_since_log = 0
        self._last_log_time = time.monotonic()

        if not server_args.disable_overlap_schedule:
            self.init_overlap()

        self.outbox: list[Any] = []  # messages for the API process when no socket (tests)
        self.send_to_api = None
        if port_args is not None and self.tp.is_first:
            ctx = zmq.Context(2)
            self.recv_from_api = ctx.socket(zmq.PULL)
            self.recv_from_api.bind(port_args.scheduler_input_ipc_name)
            self.send_to_api = ctx.socket(zmq.PUSH)
            self.send_to_api.connect(port_args.tokenizer_ipc_name)

    def ready_message(self) -> SchedulerReady:
        return SchedulerReady(max_total_num_tokens=self.max_total_num_tokens,
                              max_req_input_len=self.max_req_input_len, context_len=self.context_len,
                              vocab_size=self.model_runner.vocab_size,
                              eos_token_ids=sorted(self.eos_token_ids),
                              max_running_requests=self.model_runner.max_running_requests,
                              tokenizer_spec=tokenizer_spec(self.tokenizer))

    # ================================================================== loop
    def has_work(self) -> bool:
        """Requests waiting, running, mid-prompt, or a launched batch not yet processed."""
        return bool(self.waiting_queue or self.running or self.chunked_req or self._in_flight)

    def event_loop(self) -> None:
        while True:
            for msg in self._recv_requests(block=not self.has_work()):
                self._handle(msg)
            self.step()
            self.send_stats()

    def step(self) -> None:
        """One iteration: run a batch if there is one, then process cache events."""
        if self.overlap_schedule:
            self.step_overlap()
            return
        batch = self.get_next_batch_to_run()
        if batch is not None:
            self.run_batch(batch)
        elif self.kv.storage_busy():
            time.sleep(STORAGE_NAP_S)  # requests wait on storage: let its worker run
        self.check_cache_events()

    def check_cache_events(self) -> None:
        """The KV hierarchy's transfer acknowledgements (every iteration, decode-only too)."""
        self.kv.poll()

    def _recv_requests(self, block: bool) -> list[Any]:
        """This iteration's messages: rank 0 reads the API socket (waiting up to
        _IDLE_POLL_MS when `block`), and under TP broadcasts them to every rank."""
        msgs = self._recv_from_api(block) if self.tp.is_first else []
        return broadcast_pyobj(msgs) if self.tp.size > 1 else msgs

    def _recv_from_api(self, block: bool) -> list[Any]:
        """Every waiting message. An idle scheduler (`block`) whose latest request says the API
        process has accepted others it has not sent yet (`api_pending`, hiserve.engine.incoming)
        waits for them, at most _COALESCE_MS in all and _COALESCE_GAP_MS for each: a burst of
        requests (clients that all got their answers in one step) is then one prefill batch, not a
        lone first request whose prefill the others queue behind."""
        msgs = []
        if block and not self.recv_from_api.poll(_IDLE_POLL_MS):
            return msgs
        deadline = time.monotonic() + _COALESCE_MS / 1e3
        while True:
            try:
                msgs.append(self.recv_from_api.recv_pyobj(zmq.NOBLOCK))
                continue
            except zmq.ZMQError:
                pass
            pending = getattr(msgs[-1], "api_pending", 0) if msgs else 0
            wait = min(deadline - time.monotonic(), _COALESCE_GAP_MS / 1e3)
            if not (block and pending > 0 and wait > 0 and self.recv_from_api.poll(wait * 1e3)):
                return msgs

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, TokenizedGenerateReqInput):
            self.add_request(msg)
        elif isinstance(msg, AbortReq):
            self.abort_request(msg)
        elif isinstance(msg, FlushCacheReq):
            ok = self.flush_cache()
            self.send_stats(force=True)  # before the reply, so /metrics is current when it returns
            self._emit(FlushCacheReqOutput(
                success=ok, message="Cache flushed." if ok else
                "Cache not flushed: there are running or waiting requests."))
        elif isinstance(msg, GetInternalStateReq):
            self.send_stats(force=True)  # the load routes read the stats beside the state
            self._emit(GetInternalStateReqOutput(state=self.internal_state()))
        else:
            logger.error("unknown message %r", type(msg))

    # ================================================================== requests
    def add_request(self, recv: TokenizedGenerateReqInput) -> Req:
        sp = recv.sampling_params
        n_in = len(recv.input_ids)
        # A request must fit alone in the device pool, or retraction could never make room for it.
        room = min(self.context_len, self.max_total_num_tokens - self.page_size) - n_in
        max_new = room if sp.max_new_tokens is None else min(sp.max_new_tokens, room)
        req = Req(recv.rid, list(recv.input_ids), sp, recv.stream, max_new, self.eos_token_ids)
        init_req_logprobs(req, *request_options(recv))
        error = None
        if n_in == 0:
            error = "The input is empty."
        elif n_in > self.max_req_input_len:
            error = (f"Input length ({n_in} tokens) exceeds the maximum allowed length "
                     f"({self.max_req_input_len} tokens).")
        elif max(recv.input_ids) >= self.model_runner.vocab_size or min(recv.input_ids) < 0:
            error = f"input_ids must be in [0, {self.model_runner.vocab_size})."
        elif (self.server_args.max_queued_requests is not None
              and len(self.waiting_queue) >= self.server_args.max_queued_requests):
            req.abort("The request queue is full.", status_code=503)
        if error is not None:
            req.abort(error, status_code=400)
        if req.finished:
            self._send_outputs([req])
            return req
        self.waiting_queue.append(req)
        self.kv.start_prefetch(req)  # storage pages arrive while it waits in the queue
        return req

    def abort_request(self, recv: AbortReq) -> None:
        keep = []
        for req in self.waiting_queue:
            if recv.abort_all or req.rid == recv.rid:
                req.finished_reason = {"type": "abort", "message": "Abort in waiting queue"}
                self.kv.cancel_prefetch(req)
                self._send_outputs([req])
            else:
                keep.append(req)
        self.waiting_queue = keep
        # Running requests finish at the next result processing, which frees their KV.
        for req in self.running + ([self.chunked_req] if self.chunked_req else []):
            if recv.abort_all or req.rid == recv.rid:
                req.abort("Aborted by AbortReq.")
        if self.chunked_req is not None and self.chunked_req.finished:
            self._free_req_kv(self.chunked_req, cache=False)
            self._send_outputs([self.chunked_req])
            self.chunked_req = None
        self._reap_finished_running()

    def flush_cache(self) -> bool:
        if self.has_work() or not self.kv.flush_cache():
            return False
        self.new_token_ratio = _INIT_NEW_TOKEN_RATIO
        return True

    def internal_state(self) -> dict[str, Any]:
        kv = self.kv.stats()
        state = {
            "max_total_num_tokens": self.max_total_num_tokens,
            "max_req_input_len": self.max_req_input_len,
            "available_size": kv.available,
            "evictable_size": kv.evictable,
            "protected_size": kv.protected,
            "pending_size": kv.pending,
            "num_free_req_slots": self.kv.rtt.available_size(),
            "max_running_requests": self.model_runner.max_running_requests,
            "num_running_reqs": len(self.running),
            "num_queue_reqs": len(self.waiting_queue),
            "num_waiting_tokens": sum(len(r.origin_input_ids) for r in self.waiting_queue),
            "last_gen_throughput": self.stats.gen_throughput,
            "overlap_schedule": self.overlap_schedule,
            "num_overlapped_batches": self.num_overlapped_batches,
            "memory_usage": {"token_capacity": self.max_total_num_tokens},
        }
        if self.kv.is_hierarchical:
            state["host_total_size"] = kv.host_total
            state["host_available_size"] = kv.host_total - kv.host_used
            state["host_used_size"] = kv.host_used
        storage = self.kv.storage_state()
        if storage is not None:
            state["storage"] = storage
        return state

    # ================================================================== scheduling
    def get_next_batch_to_run(self) -> Optional[ScheduleBatch]:
        batch = self.get_new_batch_prefill()
        if batch is not None:
            return batch
        if self.running:
            return self.prepare_decode()
        return None

    def get_new_batch_prefill(self) -> Optional[ScheduleBatch]:
        if not self.waiting_queue and self.chunked_req is None:
            return None
        running_now = len(self.running) + (1 if self.chunked_req else 0)
        max_new_reqs = min(self.model_runner.max_running_requests - running_now,
                           self.kv.rtt.available_size() + (1 if self.chunked_req else 0))
        if max_new_reqs <= 0 and self.chunked_req is None:
            return None
        adder = PrefillAdder(self.kv, self.running, self.new_token_ratio,
                             self.server_args.max_prefill_tokens, self.server_args.chunked_prefill_size,
                             self.page_size, max(max_new_reqs, 1))
        if self.chunked_req is not None:
            adder.add_chunked_req(self.chunked_req)
        order_waiting_queue(self.server_args.schedule_policy, self.waiting_queue, self.kv)
        for req in self.waiting_queue:
            if adder.new_chunked_req is not None:
                break
            if not self.kv.prefetch_ready(req):
                continue  # its prefetch policy holds it in the queue this round
            req.init_next_round_input()
            self.kv.match(req, req.prefix_match_len())
            if self._shares_uncached_prefix(req, adder.can_run):
                continue  # next round it hits the prefix this batch inserts, instead of recomputing it
            if adder.add_one_req(req) != AddResult.CONTINUE:
                if req in adder.can_run:
                    continue
                break
        if not adder.can_run:
            return None
        admitted = {id(r) for r in adder.can_run}
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in admitted]
        self.chunked_req = adder.new_chunked_req
        return self.prepare_extend(adder.can_run)

    def _shares_uncached_prefix(self, req: Req, admitted: list[Req]) -> bool:
        """Whether `req`'s uncached tokens start with a run of at least _IN_BATCH_PREFIX_MIN
        tokens that a request already in this batch computes (SGLang defers such requests too)."""
        if not self.kv.shares_prefixes or not admitted:
            return False
        start = req.kv.prefix_len + self.kv.loadable_len(req)
        for other in admitted:
            a, b = req.fill_ids, other.fill_ids
            end = min(len(a), len(b), start + _IN_BATCH_PREFIX_MIN)
            if end - start == _IN_BATCH_PREFIX_MIN and a[start:end] == b[start:end]:
                return True
        return False

    def _to_device(self, *values: list[int] | torch.Tensor) -> list[torch.Tensor]:
        """Each of `values` as int64 on the model's device. On CUDA they travel as one pinned
        buffer in one non-blocking copy (the host does not wait; each copy costs a pinned
        allocation and a launch, more than these few bytes) and come back as views of it."""
        parts = [torch.as_tensor(v, dtype=torch.int64) for v in values]
        if self.device.type == "cpu":
            return parts
        flat = torch.cat(parts).pin_memory().to(self.device, non_blocking=True)
        return list(flat.split([p.numel() for p in parts]))

    def prepare_extend(self, reqs: list[Req]) -> ScheduleBatch:
        prefix_lens = [r.kv.prefix_len for r in reqs]
        seq_lens = [len(r.fill_ids) for r in reqs]
        extend_lens = [s - p for s, p in zip(seq_lens, prefix_lens)]
        out_cache_loc = self.kv.alloc_extend(reqs)
        input_ids, positions = [], []
        for req, p, s in zip(reqs, prefix_lens, seq_lens):
            input_ids.extend(req.fill_ids[p:s])
            positions.extend(range(p, s))
        ids_d, pos_d, loc_d, rows_d, lens_d = self._to_device(
            input_ids, positions, out_cache_loc, [r.kv.row for r in reqs], seq_lens)
        batch = ScheduleBatch(
            reqs=reqs, forward_mode=ForwardMode.EXTEND, input_ids=ids_d, positions=pos_d,
            out_cache_loc=loc_d, req_pool_indices=rows_d, seq_lens=lens_d, seq_lens_cpu=seq_lens,
            extend_seq_lens_cpu=extend_lens, extend_prefix_lens_cpu=prefix_lens,
            chunked_req=self.chunked_req, load_ticket=self.kv.start_loads(self._in_flight_fence))
        self._log_prefill(reqs, extend_lens)
        return batch

    def prepare_decode(self) -> Optional[ScheduleBatch]:
        self._retract_until_fits()
        reqs = self._decode_reqs()
        if not reqs:
            return None
        # KV of output token i is written when it is fed back: position seqlen - 1. A token still
        # in flight (overlap) counts in the length, and its id comes from the future buffer.
        seq_lens = [r.seqlen + r.num_pending_tokens for r in reqs]
        input_ids = [-(r.future_slot + 1) if r.num_pending_tokens else r.output_ids[-1] for r in reqs]
        out_cache_loc = self.kv.alloc_decode(reqs)
        ids_d, pos_d, loc_d, rows_d, lens_d = self._to_device(
            input_ids, [s - 1 for s in seq_lens], out_cache_loc, [r.kv.row for r in reqs], seq_lens)
        return ScheduleBatch(
            reqs=reqs, forward_mode=ForwardMode.DECODE, input_ids=ids_d, positions=pos_d,
            out_cache_loc=loc_d, req_pool_indices=rows_d, seq_lens=lens_d, seq_lens_cpu=seq_lens,
            extend_seq_lens_cpu=[1] * len(reqs), extend_prefix_lens_cpu=[s - 1 for s in seq_lens],
            has_future_ids=any(r.num_pending_tokens for r in reqs))

    def _decode_reqs(self) -> list[Req]:
        """The running requests the next decode step serves: all, except (overlap only) one
        whose token in flight is certain to end it by length (it would decode for nothing)."""
        def ends(r: Req) -> bool:
            n = len(r.output_ids) + r.num_pending_tokens
            return r.num_pending_tokens > 0 and (n >= r.max_new_tokens or r.seqlen + 1 >= self.context_len)
        return [r for r in self.running if not ends(r)]

    def _retract_until_fits(self) -> None:
        """Move running requests back to the waiting queue until one decode step fits."""
        if self.kv.room() < self.kv.decode_need(self._decode_reqs()):
            self._drain_in_flight()  # overlap: retract only with no forward in flight
        retracted = []
        while self.running and self.kv.room() < self.kv.decode_need(self._decode_reqs()):
            req = self.running.pop()  # the most recently admitted loses its place
            assert req.num_inflight == 0, "retracting a request a running forward still holds"
            retracted.append(req)
            # Its KV goes into the prefix cache (unlocked), so readmission re-uses what survives.
            self.kv.cache(req, finished=True)
        if retracted:
            self.stats.num_retracted_reqs += len(retracted)
            self.waiting_queue = retracted[::-1] + self.waiting_queue
            self.new_token_ratio = _INIT_NEW_TOKEN_RATIO
            logger.info("Retracted %d requests; #running-req: %d", len(retracted), len(self.running))

    # ================================================================== run + results
    def run_batch(self, batch: ScheduleBatch) -> None:
        """Synchronous: forward, sample, read back, process."""
        logits = self.model_runner.forward(batch)
        if batch.forward_mode.is_extend():
            self.process_prefill_result(batch, logits)
        else:
            self.process_decode_result(batch, logits)

    def _sample(self, batch: ScheduleBatch, logits: torch.Tensor) -> Optional[SampleResult]:
        reqs = batch.sampled_reqs
        if not reqs:
            return None
        return self.model_runner.sample(logits, reqs, self.eos_token_ids, batch.sampled_rows())

    def process_prefill_result(self, batch: ScheduleBatch, logits: torch.Tensor) -> None:
        self.process_prefill_tokens(batch, self._sample(batch, logits))

    def process_decode_result(self, batch: ScheduleBatch, logits: torch.Tensor) -> None:
        self.process_decode_tokens(batch, self._sample(batch, logits))


def _die_with_parent() -> None:
    """Ask Linux to kill this process when the API process dies, even by SIGKILL: an orphaned
    scheduler would otherwise hold the model and the KV pool forever."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        logger.warning("cannot tie the scheduler's life to its parent on this platform")


def run_scheduler_process(server_args: ServerArgs, port_args: PortArgs, pipe_writer: Any, tp_rank: int = 0,
                          dist_init_addr: Optional[str] = None) -> None:
    """Entry point of the scheduler process of TP rank `tp_rank`: join the other ranks at
    `dist_init_addr` (TP > 1), build, report readiness (or the error), loop. A collective
    that fails (a rank died or hung past --dist-timeout) ends the process with the error."""
    tag = "scheduler" if server_args.tp_size == 1 else f"scheduler TP{tp_rank}"
    logging.basicConfig(level=server_args.log_level.upper(), format=f"[%(asctime)s {tag}] %(message)s")
    _die_with_parent()
    try:
        if server_args.tp_size > 1:
            device = torch.device("cuda", tp_rank) if server_args.device == "cuda" else torch.device("cpu")
            init_tp_group(server_args.tp_size, tp_rank, dist_init_addr, device, server_args.dist_timeout)
        scheduler = Scheduler(server_args, port_args if tp_rank == 0 else None)
    except Exception as e:  # reported to the launcher, which exits with it
        pipe_writer.send(f"scheduler failed to start: {type(e).__name__}: {e}\n{traceback.format_exc()}")
        return
    pipe_writer.send(scheduler.ready_message())
    # SIGTERM (the launcher stopping us) leaves through SystemExit so the storage worker is
    # stopped cleanly: the op it is running finishes, queued backups are dropped.
    exit_on_sigterm()
    try:
        scheduler.event_loop()
    finally:
        scheduler.model_runner.kv_hierarchy.close(run_queued=False)
