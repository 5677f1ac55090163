"""The API process's side of a request: tokenize, send to the scheduler, detokenize, stream.

    handler ── make_requests() ──> TokenizedGenerateReqInput ──ZMQ PUSH──> scheduler
       ^                                                                      │
       └── generate() yields ReqState <── _drain (event-loop reader) <──ZMQ PULL───┘
                                           BatchTokenIDOut: new ids per request

An event-loop reader on the PULL socket's file descriptor receives every scheduler message
and updates the matching `ReqState` (incremental detokenization, stop-string hold-back,
metrics), then wakes the handler through the state's event. (A reader, not a task awaiting
zmq.asyncio's recv: that path built and chained futures for every message, ~15% of this
process's CPU per streamed token at concurrency 1.) Handlers never touch ZMQ; they iterate `generate()`.
Leaving that iteration early (client gone, stream cancelled) aborts what is unfinished,
so the scheduler frees its KV.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import pickle
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Optional, Union

import zmq

from hiserve.engine.errors import BadRequestError, ClientDisconnectedError, ServiceUnavailableError
from hiserve.engine.http_limits import check_text_length, max_token_bytes
from hiserve.engine.incoming import IncomingCounter
from hiserve.engine.io_struct import (
    AbortReq,
    BatchTokenIDOut,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    SchedulerReady,
    TokenizedGenerateReqInput,
)
from hiserve.engine.metrics import ServerMetrics
from hiserve.engine.req_state import ReqState
from hiserve.engine.sampling_params import SamplingParams
from hiserve.engine.tokenizer_spec import build_tokenizer
from hiserve.server_args import PortArgs, ServerArgs

logger = logging.getLogger(__name__)

_RPC_TIMEOUT_S = 30.0
_TOKENIZE_THREADS = 2  # tokenization and chat templates run here, never in the event loop
_DEFAULT_FANOUT_LIMIT = 256  # the scheduler's default --max-running-requests
_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)} | {"stop"}


SubRequest = tuple[str, TokenizedGenerateReqInput]  # (rid the client knows, one sequence)


class TokenizerManager:
    def __init__(self, server_args: ServerArgs, port_args: PortArgs, ready: SchedulerReady,
                 tokenizer: Any = None):
        self.server_args = server_args
        self.port_args = port_args
        self.ready = ready
        self.context_len = ready.context_len
        self.tokenizer = tokenizer if tokenizer is not None else _load_tokenizer(server_args, ready)
        self.model_name = server_args.served_model_name
        self.metrics = ServerMetrics(self.model_name)
        self.max_token_bytes = max_token_bytes(self.tokenizer.get_vocab())
        # One HTTP request starts at most this many sequences (prompts x n): what can run at once.
        self.fanout_limit = (getattr(ready, "max_running_requests", 0) or server_args.max_running_requests
                             or _DEFAULT_FANOUT_LIMIT)
        self._tokenize_pool = ThreadPoolExecutor(_TOKENIZE_THREADS, thread_name_prefix="hiserve-tokenize")
        # generate requests accepted by the app, not yet sent (the scheduler's batching hint)
        self.incoming = IncomingCounter()

        # Sends never block (no high-water mark), so an abort can be sent from a cancelled task.
        self._send_ctx = zmq.Context()
        self._send_sock = self._send_ctx.socket(zmq.PUSH)
        self._send_sock.setsockopt(zmq.SNDHWM, 0)
        self._send_sock.connect(port_args.scheduler_input_ipc_name)
        self._recv_ctx: Optional[zmq.Context] = None
        self._recv_sock: Optional[zmq.Socket] = None
        self._recv_fd: Optional[int] = None  # registered with the event loop while started

        self.rid_to_state: dict[str, ReqState] = {}
        self._rpc_waiters: dict[type, asyncio.Future] = {}
        self._rpc_lock: Optional[asyncio.Lock] = None
        self.is_warm = False  # set after the warm-up request (or at once with --skip-server-warmup)
        self.dead_reason: Optional[str] = None  # set when the scheduler process is gone
        self.last_recv_time = 0.0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Bind the receive socket and read it from the server's event loop (call inside it)."""
        if self._recv_fd is not None:
            return
        self._recv_ctx = zmq.Context()
        self._recv_sock = self._recv_ctx.socket(zmq.PULL)
        self._recv_sock.bind(self.port_args.tokenizer_ipc_name)
        self._rpc_lock = asyncio.Lock()
        loop = asyncio.get_running_loop()
        self._recv_fd = self._recv_sock.getsockopt(zmq.FD)
        loop.add_reader(self._recv_fd, self._drain)
        loop.call_soon(self._drain)  # the FD signals edges: read what came before the reader

    async def close(self) -> None:
        if self._recv_fd is not None:
            asyncio.get_running_loop().remove_reader(self._recv_fd)
            self._recv_fd = None
        if self._recv_sock is not None:
            self._recv_sock.close(linger=0)
            self._recv_ctx.term()
            self._recv_sock = None
        self._send_sock.close(linger=0)
        self._send_ctx.term()
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def is_healthy(self) -> bool:
        return self.is_warm and self.dead_reason is None and not self.is_stalled()

    def is_stalled(self, now: Optional[float] = None) -> bool:
        """Whether requests are waiting on a scheduler that has sent nothing for
        `--health-stall-timeout` s (while busy it reports at least once a second)."""
        if not self.rid_to_state:
            return False
        now = time.monotonic() if now is None else now
        timeout = self.server_args.health_stall_timeout
        oldest = min(st.created for st in self.rid_to_state.values())
        return now - max(self.last_recv_time, oldest) > timeout

    def scheduler_died(self, reason: str) -> None:
        """Fail everything in flight and refuse new work: nothing waits on a dead scheduler."""
        if self.dead_reason is not None:
            return
        logger.error("%s; failing %d in-flight requests", reason, len(self.rid_to_state))
        self.dead_reason = reason
        now = time.monotonic()
        for st in self.rid_to_state.values():
            st.update([], {"type": "abort", "message": reason, "status_code": 503, "err_type": None}, now)
            st.dirty = True
            st.event.set()
        self.rid_to_state.clear()
        for fut in self._rpc_waiters.values():
            if not fut.done():
                fut.set_exception(ServiceUnavailableError(reason))

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise ServiceUnavailableError(f"The server cannot take requests: {self.dead_reason}")

    def _send(self, msg: Any) -> None:
        self._send_sock.send_pyobj(msg)

    # ------------------------------------------------------------------ tokenization
    async def tokenize_many(self, texts: list[str], param: str = "prompt") -> list[list[int]]:
        """Token ids of each text, computed in the tokenizer thread pool (the event loop keeps
        serving); a text too long for any prompt is refused from its length, untokenized.

        Raises:
            BadRequestError: a text is too long, or the tokenizer refuses it.
        """
        check_text_length(texts, self.ready.max_req_input_len, self.context_len, self.max_token_bytes, param)
        loop = asyncio.get_running_loop()
        return [await loop.run_in_executor(self._tokenize_pool, self.tokenize, t, param) for t in texts]

    async def apply_chat_template_async(self, messages: list[dict[str, Any]],
                                        template_kwargs: Optional[dict[str, Any]],
                                        continue_final_message: bool = False) -> list[int]:
        """`apply_chat_template` in the tokenizer thread pool, after the cheap length check."""
        text = "".join(m["content"] for m in messages if isinstance(m.get("content"), str))
        check_text_length([text], self.ready.max_req_input_len, self.context_len, self.max_token_bytes,
                          "messages")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize_pool, self.apply_chat_template, messages,
                                          template_kwargs, continue_final_message)

    def tokenize(self, text: str, param: str = "prompt") -> list[int]:
        """Token ids of `text`; raises BadRequestError (400) for text the tokenizer refuses
        (e.g. lone surrogates)."""
        try:
            return self.tokenizer.encode(text)
        except (TypeError, ValueError) as e:
            raise BadRequestError(f"The text cannot be tokenized: {e}", param=param) from e

    def apply_chat_template(self, messages: list[dict[str, Any]], template_kwargs: Optional[dict[str, Any]],
                            continue_final_message: bool = False) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise BadRequestError("The model's tokenizer has no chat template; use /v1/completions.",
                                  param="messages")
        try:
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=not continue_final_message,
                continue_final_message=continue_final_message, tokenize=True, return_dict=False,
                **(template_kwargs or {}))
        except Exception as e:  # jinja errors, bad roles, clashing kwargs: the request's fault
            raise BadRequestError(f"Applying the chat template failed: {e}", param="messages") from e
        return list(ids)

    # ------------------------------------------------------------------ validation
    def make_requests(self, prompts: list[list[int]], params: list[SamplingParams],
                      rids: Union[str, list[str], None], stream: bool) -> list[SubRequest]:
        """Check each prompt against the limits and expand n > 1 into n sequences.

        Errors name native parameters (`input_ids`, `max_new_tokens`, ...); the OpenAI
        routes rename them. Output order is prompt-major: sequence j of prompt i is i*n + j.
        """
        self._check_alive()
        if isinstance(rids, list) and len(rids) != len(prompts):
            raise BadRequestError(f"rid has {len(rids)} entries for {len(prompts)} prompts.", param="rid")
        out: list[SubRequest] = []
        for i, (ids, sp) in enumerate(zip(prompts, params)):
            self._check_prompt(ids)
            try:
                sp.verify(self.ready.vocab_size)
            except ValueError as e:
                word = str(e).split(" ", 1)[0]
                raise BadRequestError(str(e), param=word if word in _SAMPLING_FIELDS else None) from e
            if sp.max_new_tokens is None:
                sp.max_new_tokens = self.context_len - len(ids)
            elif len(ids) + sp.max_new_tokens > self.context_len:
                total = len(ids) + sp.max_new_tokens
                raise BadRequestError(
                    f"Requested token count exceeds the model's maximum context length of "
                    f"{self.context_len} tokens. You requested a total of {total} tokens: {len(ids)} "
                    f"tokens from the input messages and {sp.max_new_tokens} tokens for the "
                    f"completion. Please reduce the number of tokens in the input messages or the "
                    f"completion to fit within the limit.", param="max_new_tokens")
            if isinstance(rids, list):
                base = rids[i]
            elif isinstance(rids, str):
                base = rids if len(prompts) == 1 else f"{rids}-{i}"
            else:
                base = uuid.uuid4().hex
            for j in range(sp.n):
                seed = sp.sampling_seed
                if seed is not None and sp.n > 1:
                    seed += j
                sub = dataclasses.replace(sp, n=1, sampling_seed=seed)
                rid = base if sp.n == 1 else f"{base}-{j}"
                out.append((base, TokenizedGenerateReqInput(rid, ids, sub, stream)))
        return out

    def _check_prompt(self, ids: list[int]) -> None:
        n, ctx = len(ids), self.context_len
        if n == 0:
            raise BadRequestError("The input is empty.", param="input_ids")
        if n >= ctx:
            raise BadRequestError(
                f"The input ({n} tokens) is longer than the model's context length ({ctx} tokens). "
                f"This model's maximum context length is {ctx} tokens.", param="input_ids")
        if n > self.ready.max_req_input_len:
            raise BadRequestError(
                f"Input length ({n} tokens) exceeds the maximum allowed length "
                f"({self.ready.max_req_input_len} tokens) of this server; the model's maximum "
                f"context length is {ctx} tokens.", param="input_ids")
        vocab = self.ready.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise BadRequestError(f"input_ids must be token ids in [0, {vocab}).", param="input_ids")

    # ------------------------------------------------------------------ generation
    async def generate(self, subreqs: list[SubRequest], request: Any = None,
                       log_metrics: bool = True) -> AsyncIterator[ReqState]:
        """Submit the sequences and yield each one's state whenever it changes.

        Streaming sequences are yielded per scheduler update, the others once, finished.
        With `request` (a Starlette Request; non-streaming only) a disconnect raises
        ClientDisconnectedError as soon as the server sees it. However the iteration ends,
        unfinished sequences are aborted (and counted as aborted requests).
        """
        self._check_alive()
        seen: set[str] = set()
        for _, req in subreqs:
            if req.rid in self.rid_to_state or req.rid in seen:
                raise BadRequestError(f"A request with rid {req.rid!r} is already running.", param="rid")
            seen.add(req.rid)
        event = asyncio.Event()
        states = []
        for index, (parent, req) in enumerate(subreqs):
            st = ReqState(req, parent, index, self.tokenizer, event, log_metrics)
            self.rid_to_state[req.rid] = st
            states.append(st)
            req.api_pending = self.incoming.handed_over()
            self._send(req)
        remaining = len(states)
        gone = None if request is None else asyncio.ensure_future(wait_disconnected(request))
        try:
            while remaining:
                if gone is None:
                    await event.wait()
                else:
                    woke = asyncio.ensure_future(event.wait())
                    await asyncio.wait([woke, gone], return_when=asyncio.FIRST_COMPLETED)
                    woke.cancel()
                    if gone.done() and not event.is_set():
                        raise ClientDisconnectedError("The client disconnected.")
                event.clear()
                for st in states:
                    if st.dirty and (st.stream or st.finished):
                        st.dirty = False
                        if st.finished:
                            remaining -= 1
                        yield st
        finally:
            if gone is not None:
                gone.cancel()
            now = time.monotonic()
            for st in states:
                if not st.finished and self.rid_to_state.pop(st.rid, None) is not None:
                    self._send(AbortReq(rid=st.rid))
                    if st.log_metrics:
                        self.metrics.observe_finished(st.prompt_tokens, st.completion_tokens, st.cached_device,
                                                      st.cached_host, now - st.created, aborted=True,
                                                      cached_storage=st.cached_storage or 0)

    def _drain(self) -> None:
        """Handle every message waiting on the PULL socket. Its FD only signals that the
        socket's state changed (edge-triggered), so read until EVENTS shows no more input."""
        sock = self._recv_sock
        while sock is not None and sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.last_recv_time = time.monotonic()
            try:
                msg = pickle.loads(frame)
                if isinstance(msg, BatchTokenIDOut):
                    self._on_batch_out(msg)
                elif isinstance(msg, (FlushCacheReqOutput, GetInternalStateReqOutput)):
                    fut = self._rpc_waiters.pop(type(msg), None)
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
                else:
                    logger.error("unexpected message from the scheduler: %r", type(msg))
            except Exception:  # one bad message must not stop every request's output
                logger.exception("failed to process a scheduler message")

    def _on_batch_out(self, out: BatchTokenIDOut) -> None:
        now = self.last_recv_time
        if out.stats is not None:
            self.metrics.update_stats(out.stats)
        for i, rid in enumerate(out.rids):
            st = self.rid_to_state.get(rid)
            if st is None:  # aborted here already
                continue
            try:
                self._apply_output(st, out, i, now)
            except Exception as e:  # one request's bad update must not stall the others
                logger.exception("request %s: processing its output failed", rid)
                self._fail(rid, st, out.finished_reasons[i] is None, now,
                           f"Internal error while processing the output: {type(e).__name__}: {e}")

    def _apply_output(self, st: ReqState, out: BatchTokenIDOut, i: int, now: float) -> None:
        new_ids = out.new_output_ids[i]
        if new_ids and st.log_metrics:
            if st.first_token_at is None:
                self.metrics.ttft.observe(now - st.created)
            else:
                self.metrics.itl.observe((now - st.last_token_at) / len(new_ids))
        st.prompt_tokens = out.prompt_tokens[i]
        st.completion_tokens = out.completion_tokens[i]
        st.cached_device = out.cached_tokens_device[i]
        st.cached_host = out.cached_tokens_host[i]
        if out.cached_tokens_storage:
            st.cached_storage = out.cached_tokens_storage[i]
        if st.logprobs is not None and out.logprobs:
            st.logprobs.add(out.logprobs[i])
        st.update(new_ids, out.finished_reasons[i], now)
        st.dirty = True
        if st.finished:
            del self.rid_to_state[out.rids[i]]
            if st.log_metrics:
                self.metrics.observe_finished(
                    st.prompt_tokens, st.completion_tokens, st.cached_device, st.cached_host,
                    now - st.created, aborted=st.finish_reason["type"] == "abort",
                    cached_storage=st.cached_storage or 0)
        if st.stream or st.finished:
            st.event.set()

    def _fail(self, rid: str, st: ReqState, still_running: bool, now: float, message: str) -> None:
        """End one request with a 500 error object (and stop it in the scheduler)."""
        st.finish_reason = {"type": "abort", "message": message, "status_code": 500,
                            "err_type": "InternalServerError"}
        st.final_text = st.detok.text
        st.finished_at = now
        st.dirty = True
        self.rid_to_state.pop(rid, None)
        if still_running:
            self._send(AbortReq(rid=rid))
        st.event.set()

    # ------------------------------------------------------------------ control
    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """Abort by rid (all n sequences of it) or everything; each finishes with type "abort"."""
        if abort_all:
            self._send(AbortReq(abort_all=True))
            return
        rids = [st.rid for st in self.rid_to_state.values() if rid in (st.rid, st.parent_rid)]
        for r in rids or [rid]:
            self._send(AbortReq(rid=r))

    async def _rpc(self, msg: Any, reply_type: type, timeout: float = _RPC_TIMEOUT_S) -> Any:
        self._check_alive()
        async with self._rpc_lock:
            fut = asyncio.get_running_loop().create_future()
            self._rpc_waiters[reply_type] = fut
            self._send(msg)
            try:
                return await asyncio.wait_for(fut, timeout)
            except asyncio.TimeoutError:
                raise ServiceUnavailableError("The scheduler did not answer in time.") from None
            finally:
                self._rpc_waiters.pop(reply_type, None)

    async def flush_cache(self, timeout: float = 0.0) -> FlushCacheReqOutput:
        """Empty the prefix cache; with `timeout`, keep trying that long for the server to go idle."""
        deadline = time.monotonic() + timeout
        while True:
            out = await self._rpc(FlushCacheReq(), FlushCacheReqOutput)
            if out.success or time.monotonic() >= deadline:
                return out
            await asyncio.sleep(0.1)

    async def get_internal_state(self) -> dict[str, Any]:
        out = await self._rpc(GetInternalStateReq(), GetInternalStateReqOutput)
        return out.state

    async def health_check(self, timeout: float) -> bool:
        """Run a 1-token generation; healthy as soon as the scheduler sends anything at all.

        On a busy server the probe may wait in the queue, but other requests' output
        already shows the loop is alive, so it answers in well under a second either way.
        """
        start = time.monotonic()
        sp = SamplingParams(max_new_tokens=1, temperature=0.0)
        req = TokenizedGenerateReqInput(f"HEALTH_CHECK_{uuid.uuid4().hex}", [0], sp)
        gen = self.generate([(req.rid, req)], log_metrics=False)

        async def first() -> ReqState:
            return await gen.__anext__()

        probe = asyncio.ensure_future(first())
        try:
            while not probe.done() and self.last_recv_time <= start:
                if time.monotonic() - start > timeout:
                    return False
                await asyncio.sleep(0.05)
            if probe.done() and probe.exception() is not None:
                return False
            return self.dead_reason is None
        finally:
            probe.cancel()
            await asyncio.gather(probe, return_exceptions=True)
            await gen.aclose()


def _load_tokenizer(server_args: ServerArgs, ready: SchedulerReady) -> Any:
    """The scheduler's tokenizer, rebuilt from the spec it sent (no torch, no gguf: this
    process never loads a tokenizer from --tokenizer-path itself).

    Raises:
        ValueError: `ready` carries no tokenizer spec.
    """
    if ready.tokenizer_spec is None:
        raise ValueError(f"the scheduler sent no tokenizer spec for {server_args.tokenizer_path}; "
                         f"the API process builds its tokenizer only from one")
    return build_tokenizer(ready.tokenizer_spec)


async def wait_disconnected(request: Any) -> None:
    """Return when the client of `request` (a Starlette Request whose body was read) goes away.

    After the body, the ASGI server's next receive() message is `http.disconnect`, delivered
    as soon as the connection closes: no polling delay between a client leaving and its abort.
    """
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
