"""The FastAPI app: routes, API-key check, and the one place where errors become responses.

Routes validate and convert the request, hand sequences to the TokenizerManager and
format what it yields: native `/generate` (cumulative text and output_ids), OpenAI
`/v1/completions` and `/v1/chat/completions` (text deltas), and the control routes.
Every failure is an `ApiError` (or a pydantic validation error) mapped to a status and
the nested envelope `{"error": {"message", "type", "param", "code"}}` by the handlers in
`_install_error_handlers`; a client error is never a 5xx. Streaming requests are checked,
and their first output awaited, before the 200 headers go out, so a refused request is
a real 4xx; a failure after that is an in-stream `data: {"error": ...}` event.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import importlib.metadata
import logging
import time
import uuid
from contextlib import asynccontextmanager, contextmanager
from typing import Any, AsyncIterator, Callable, Iterable, Iterator, Optional

import orjson
from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from hiserve.engine.logprobs_format import (
    LogprobTracker,
    apply_logprob_options,
    chat_logprobs,
    chat_stream_logprobs,
    completion_choice_logprobs,
    completion_stream_logprobs,
)
from hiserve.engine.http_limits import BodySizeLimitMiddleware, body_error_message, check_fanout
from hiserve.engine.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from hiserve.engine.openapi import install_openapi
from hiserve.engine.protocol import (
    AbortReqInput,
    ApiError,
    BadRequestError,
    ChatChoice,
    ClientDisconnectedError,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatMessageOut,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    ErrorResponse,
    GenerateReqInput,
    ModelCard,
    ModelList,
    NotFoundError,
    PromptTokensDetails,
    SamplingParamsInput,
    UsageInfo,
    error_for_status,
    param_from_loc,
)
from hiserve.engine.tokenizer_manager import ReqState, TokenizerManager, wait_disconnected

logger = logging.getLogger(__name__)

_HEALTH_GENERATE_TIMEOUT_S = 20.0
_FLUSH_TIMEOUT_MAX_S = 600.0
_SSE_DONE = b"data: [DONE]\n\n"
_OPENAI_PARAM_NAMES = {"input_ids": "prompt", "max_new_tokens": "max_tokens",
                       "min_new_tokens": "min_tokens", "sampling_seed": "seed"}

router = APIRouter()


def create_app(tm: TokenizerManager) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tm.start()
        yield
        await tm.close()

    app = FastAPI(title="hiserve", lifespan=lifespan)
    app.state.tm = tm
    app.add_middleware(BodySizeLimitMiddleware, limit=tm.server_args.max_request_body_bytes)
    if tm.server_args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=tm.server_args.api_key)
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_credentials=True,
                       allow_methods=["*"], allow_headers=["*"])  # outermost: 401s carry CORS headers
    app.include_router(router)
    _install_error_handlers(app)
    install_openapi(app, api_key=bool(tm.server_args.api_key), vocab_size=tm.ready.vocab_size,
                    context_len=tm.context_len, max_input_len=tm.ready.max_req_input_len,
                    fanout_limit=tm.fanout_limit)
    return app


def _tm(request: Request) -> TokenizerManager:
    return request.app.state.tm


def _version() -> str:
    try:
        return importlib.metadata.version("hiserve")
    except importlib.metadata.PackageNotFoundError:
        return "dev"


# ====================================================================== errors


def error_response(err: ApiError) -> Response:
    return JSONResponse(ErrorResponse.of(err).model_dump(), status_code=err.status_code)


def _install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: ApiError) -> Response:
        return error_response(exc)

    async def on_validation_error(request: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        if any(e["type"] == "json_invalid" for e in errors):
            detail = errors[0].get("ctx", {}).get("error", "")
            return error_response(BadRequestError(f"The request body is not valid JSON: {detail}"))
        if errors[0]["loc"] == ("body",) and "json" not in request.headers.get("content-type", ""):
            return error_response(BadRequestError(
                "The request body must be a JSON object sent with 'Content-Type: application/json'."))
        # The deepest location names the parameter best (inside unions and nested objects).
        primary = max(errors, key=lambda e: len(e["loc"]))
        param = param_from_loc(primary["loc"])
        lines = [f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in errors[:4]]
        return error_response(BadRequestError("Invalid request: " + "; ".join(lines), param=param))

    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        message = str(exc.detail)
        if exc.status_code == 400:  # the body parser failed on something other than JSON syntax
            message = body_error_message(exc.__cause__) or message
        err = ApiError(message)
        err.status_code = err.code = exc.status_code
        err.err_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        response = error_response(err)
        response.headers.update(exc.headers or {})  # e.g. 405's Allow
        return response

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("internal error on %s %s", request.method, request.url.path)
        return error_response(ApiError(f"Internal server error: {type(exc).__name__}: {exc}"))

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)


@contextmanager
def _param_names(renames: dict[str, str]) -> Iterator[None]:
    """Report errors under the route's own parameter names (max_new_tokens -> max_tokens)."""
    try:
        yield
    except ApiError as e:
        e.param = renames.get(e.param, e.param)
        raise


def _rejection(st: ReqState) -> Optional[ApiError]:
    """The error of a sequence the scheduler refused (an abort that carries an HTTP status)."""
    fr = st.finish_reason
    if fr is not None and fr["type"] == "abort" and fr.get("status_code"):
        return error_for_status(fr["status_code"], fr.get("message", "The request was refused."))
    return None


class ApiKeyMiddleware:
    """401 `{"error": "Unauthorized"}` unless `Authorization: Bearer <key>`; /health* and /metrics exempt."""

    def __init__(self, app: Any, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if (scope["type"] == "http" and scope["method"] != "OPTIONS"
                and not scope["path"].startswith(("/health", "/metrics"))):
            auth = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(auth, self.expected):
                await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _require_json(request: Request) -> None:
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise BadRequestError("Unsupported Media Type: Only 'application/json' is allowed")


# ====================================================================== streaming helpers


def _json(obj: Any) -> Response:
    return Response(orjson.dumps(obj), media_type="application/json")


def _sse_event(obj: Any) -> bytes:
    body = obj.model_dump_json().encode() if isinstance(obj, BaseModel) else orjson.dumps(obj)
    return b"data: " + body + b"\n\n"


async def _first_output(gen: AsyncIterator[ReqState], request: Request) -> ReqState:
    """Await the first output before the 200 headers, so a refusal is still an HTTP error.

    A client that leaves meanwhile (a long prefill) is noticed at once: the generator is
    closed, which sends the abort to the scheduler before its next iteration.
    """
    gone = asyncio.ensure_future(wait_disconnected(request))
    first = asyncio.ensure_future(gen.__anext__())
    try:
        await asyncio.wait([first, gone], return_when=asyncio.FIRST_COMPLETED)
        if not first.done():
            raise ClientDisconnectedError("The client disconnected before the first output.")
        st = first.result()
        err = _rejection(st)
        if err is not None:
            raise err
        return st
    except BaseException:
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await gen.aclose()
        raise
    finally:
        gone.cancel()


async def _collect(gen: AsyncIterator[ReqState]) -> list[ReqState]:
    states = sorted([st async for st in gen], key=lambda st: st.index)
    for st in states:
        err = _rejection(st)
        if err is not None:
            raise err
    return states


async def _sse(first: ReqState, gen: AsyncIterator[ReqState], render: Callable[[ReqState], Iterable[Any]],
               tail: Callable[[], Iterable[Any]] = tuple) -> AsyncIterator[bytes]:
    """Server-sent events: render(state) per update, tail() after the last, then [DONE].

    Cancellation (client gone) propagates into `gen`, whose cleanup aborts the request.
    """
    try:
        st: Optional[ReqState] = first
        while st is not None:
            err = _rejection(st)
            if err is not None:
                yield _sse_event(ErrorResponse.of(err))
                break
            for chunk in render(st):
                yield _sse_event(chunk)
            st = await anext(gen, None)
        else:
            for chunk in tail():
                yield _sse_event(chunk)
    except ApiError as e:
        yield _sse_event(ErrorResponse.of(e))
    finally:
        await gen.aclose()
    yield _SSE_DONE


# ====================================================================== native API


def _native_output(st: ReqState, with_index: bool) -> dict[str, Any]:
    out = {"text": st.text, "output_ids": st.output_ids, "meta_info": st.meta_info()}
    if with_index:
        out["index"] = st.index
    return out


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(obj: GenerateReqInput, request: Request) -> Response:
    tm = _tm(request)
    with _param_names({"input_ids": "text"} if obj.text is not None else {}):
        obj.check_supported()
        if (obj.text is None) == (obj.input_ids is None):
            raise BadRequestError("Either text or input_ids should be provided (exactly one).", param="text")
        prompt_param = "text" if obj.text is not None else "input_ids"
        if obj.text is not None:
            batched = isinstance(obj.text, list)
            texts = obj.text if batched else [obj.text]
        else:
            batched = bool(obj.input_ids) and isinstance(obj.input_ids[0], list)
            texts = obj.input_ids if batched else [obj.input_ids]
        if not texts:
            raise BadRequestError("The batch is empty.", param=prompt_param)
        sp_in = obj.sampling_params
        if isinstance(sp_in, list):
            if len(sp_in) != len(texts):
                raise BadRequestError(f"sampling_params has {len(sp_in)} entries for {len(texts)} prompts.",
                                      param="sampling_params")
            params = [p.to_sampling_params() for p in sp_in]
        else:
            params = [(sp_in or SamplingParamsInput()).to_sampling_params() for _ in texts]
        check_fanout([p.n for p in params], None, tm.fanout_limit, prompt_param)
        prompts = await tm.tokenize_many(texts, param="text") if obj.text is not None else texts
        subreqs = tm.make_requests(prompts, params, obj.rid, obj.stream)
        apply_logprob_options(subreqs, obj.logprob_options(len(prompts)), [p.n for p in params],
                              bool(obj.return_text_in_logprobs))
    many = batched or len(subreqs) > 1
    if obj.stream:
        gen = tm.generate(subreqs)
        first = await _first_output(gen, request)
        return StreamingResponse(_sse(first, gen, lambda st: [_native_output(st, many)]),
                                 media_type="text/event-stream")
    states = await _collect(tm.generate(subreqs, request))
    outs = [_native_output(st, many) for st in states]
    return _json(outs if many else outs[0])


# ====================================================================== OpenAI API


def _finish(st: ReqState) -> tuple[Optional[str], Any]:
    """OpenAI finish_reason and matched_stop of a sequence."""
    fr = st.finish_reason
    if fr is None:
        return None, None
    return fr["type"], fr.get("matched") if fr["type"] == "stop" else None


def _usage(states: Iterable[ReqState], n: int) -> UsageInfo:
    """Prompt (and cached) tokens once per prompt, completion tokens summed over choices."""
    prompt = cached = completion = 0
    for st in states:
        completion += st.completion_tokens
        if st.index % n == 0:
            prompt += st.prompt_tokens
            cached += st.cached_tokens
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


class _DeltaTracker:
    """Per choice: the text already sent, the latest state; turns cumulative text into deltas."""

    def __init__(self) -> None:
        self.sent: dict[int, int] = {}
        self.latest: dict[int, ReqState] = {}

    def delta(self, st: ReqState) -> str:
        text = st.text
        out = text[self.sent.get(st.index, 0):]
        self.sent[st.index] = len(text)
        self.latest[st.index] = st
        return out


@router.post("/v1/completions", dependencies=[Depends(_require_json)])
async def completions(req: CompletionRequest, request: Request) -> Response:
    tm = _tm(request)
    with _param_names(_OPENAI_PARAM_NAMES):
        raw_prompts = req.prompts()
        check_fanout([req.n] * len(raw_prompts), req.best_of, tm.fanout_limit, "prompt")
        params = [req.to_sampling_params() for _ in raw_prompts]
        texts = [p for p in raw_prompts if isinstance(p, str)]
        encoded = iter(await tm.tokenize_many(texts))
        prompts = [next(encoded) if isinstance(p, str) else p for p in raw_prompts]
        subreqs = tm.make_requests(prompts, params, req.rid, req.stream)
        want = req.logprobs is not None
        apply_logprob_options(subreqs, [(want, 0 if req.echo and want else -1, req.logprobs or 0)] * len(prompts),
                              [req.n] * len(prompts))
    rid = req.rid if isinstance(req.rid, str) else f"cmpl-{uuid.uuid4().hex}"
    model = req.model or tm.model_name
    echo_texts = ([p if isinstance(p, str) else tm.tokenizer.decode(p) for p in raw_prompts]
                  if req.echo else None)

    if req.stream:
        gen = tm.generate(subreqs)
        first = await _first_output(gen, request)
        created = int(time.time())
        tracker = _DeltaTracker()
        lp_tracker = LogprobTracker()

        def chunk(choices: list[CompletionChoice], usage: Optional[UsageInfo] = None) -> CompletionStreamResponse:
            return CompletionStreamResponse(id=rid, created=created, model=model, choices=choices, usage=usage)

        def render(st: ReqState) -> list[Any]:
            first_chunk = st.index not in tracker.sent
            text = tracker.delta(st)
            echo_now = req.echo and first_chunk
            if echo_now:
                text = echo_texts[st.index // req.n] + text
            logprobs = completion_stream_logprobs(tm.tokenizer, st.logprobs, lp_tracker, st.index, echo_now)
            if not text and not st.finished and logprobs is None:
                return []
            reason, matched = _finish(st)
            return [chunk([CompletionChoice(index=st.index, text=text, logprobs=logprobs, finish_reason=reason,
                                            matched_stop=matched)])]

        def tail() -> list[Any]:
            return [chunk([], _usage(tracker.latest.values(), req.n))] if req.include_usage else []

        return StreamingResponse(_sse(first, gen, render, tail), media_type="text/event-stream")

    states = await _collect(tm.generate(subreqs, request))
    choices = []
    for st in states:
        prompt_text = echo_texts[st.index // req.n] if req.echo else ""
        choices.append(CompletionChoice(
            index=st.index, text=prompt_text + st.text, finish_reason=_finish(st)[0], matched_stop=_finish(st)[1],
            logprobs=completion_choice_logprobs(tm.tokenizer, st.logprobs, req.echo, len(prompt_text))))
    return _json(CompletionResponse(id=rid, model=model, choices=choices,
                                    usage=_usage(states, req.n)).model_dump())


@router.post("/v1/chat/completions", dependencies=[Depends(_require_json)])
async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
    tm = _tm(request)
    names = {**_OPENAI_PARAM_NAMES, "input_ids": "messages", "max_new_tokens": req.max_tokens_param}
    with _param_names(names):
        sp = req.to_sampling_params()
        check_fanout([req.n], None, tm.fanout_limit, "messages")
        ids = await tm.apply_chat_template_async(req.template_messages(), req.chat_template_kwargs,
                                                 req.continue_final_message)
        subreqs = tm.make_requests([ids], [sp], req.rid, req.stream)
        apply_logprob_options(subreqs, [(req.logprobs, -1, req.top_logprobs or 0)], [req.n])
    rid = req.rid if isinstance(req.rid, str) else f"chatcmpl-{uuid.uuid4().hex}"
    top_n = req.top_logprobs or 0
    model = req.model or tm.model_name
    if req.stream:
        gen = tm.generate(subreqs)
        first = await _first_output(gen, request)
        created = int(time.time())
        tracker = _DeltaTracker()
        lp_tracker = LogprobTracker()

        def chunk(index: int, delta: dict[str, str], st: Optional[ReqState] = None,
                  logprobs: Optional[dict[str, Any]] = None) -> ChatCompletionStreamResponse:
            reason, matched = _finish(st) if st is not None else (None, None)
            choice = ChatStreamChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=reason,
                                      matched_stop=matched)
            return ChatCompletionStreamResponse(id=rid, created=created, model=model, choices=[choice])

        def render(st: ReqState) -> list[Any]:
            out = []
            if st.index not in tracker.sent:
                out.append(chunk(st.index, {"role": "assistant", "content": ""}))
            text = tracker.delta(st)
            logprobs = (chat_stream_logprobs(tm.tokenizer, st.logprobs, lp_tracker, st.index, top_n)
                        if text or st.finished else None)
            if text:
                out.append(chunk(st.index, {"content": text}, logprobs=logprobs))
                logprobs = None
            if st.finished:
                out.append(chunk(st.index, {}, st, logprobs=logprobs))
            return out

        def tail() -> list[Any]:
            if not req.include_usage:
                return []
            return [ChatCompletionStreamResponse(id=rid, created=created, model=model, choices=[],
                                                 usage=_usage(tracker.latest.values(), req.n))]

        return StreamingResponse(_sse(first, gen, render, tail), media_type="text/event-stream")

    states = await _collect(tm.generate(subreqs, request))
    choices = [ChatChoice(index=st.index, message=ChatMessageOut(content=st.text),
                          logprobs=(chat_logprobs(tm.tokenizer, *st.logprobs.output_entries(), top_n)
                                    if st.logprobs is not None else None),
                          finish_reason=_finish(st)[0], matched_stop=_finish(st)[1]) for st in states]
    return _json(ChatCompletionResponse(id=rid, model=model, choices=choices,
                                        usage=_usage(states, req.n)).model_dump())


def _model_card(tm: TokenizerManager) -> ModelCard:
    return ModelCard(id=tm.model_name, root=tm.model_name, max_model_len=tm.context_len)


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    return _json(ModelList(data=[_model_card(_tm(request))]).model_dump())


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> Response:
    tm = _tm(request)
    if model_id != tm.model_name:
        raise NotFoundError(f"The model '{model_id}' does not exist", param="model", code="model_not_found")
    return _json(_model_card(tm).model_dump())


# ====================================================================== health, info, control


@router.get("/health")
async def health(request: Request) -> Response:
    """200 once warmed up while the scheduler process lives; no generation (see /health_generate)."""
    return Response(status_code=200 if _tm(request).is_healthy else 503)


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    tm = _tm(request)
    ok = tm.is_healthy and await tm.health_check(_HEALTH_GENERATE_TIMEOUT_S)
    return Response(status_code=200 if ok else 503)


@router.get("/get_model_info")
@router.get("/model_info")
async def get_model_info(request: Request) -> Response:
    tm = _tm(request)
    args = tm.server_args
    return _json({"model_path": args.model_path, "tokenizer_path": args.tokenizer_path,
                  "served_model_name": tm.model_name, "is_generation": True,
                  "preferred_sampling_params": None, "weight_version": "default",
                  "context_length": tm.context_len})


@router.get("/get_server_info")
@router.get("/server_info")
async def get_server_info(request: Request) -> Response:
    tm = _tm(request)
    state = await tm.get_internal_state()
    # Slots a new request could use: free ones plus those only the prefix cache holds.
    state.setdefault("available_tokens", state.get("available_size", 0) + state.get("evictable_size", 0))
    state.setdefault("last_gen_throughput", tm.metrics.last_gen_throughput)
    args = dataclasses.asdict(tm.server_args)
    if args.get("api_key"):
        args["api_key"] = "<redacted>"
    ready = tm.ready
    return _json({**args, "max_total_num_tokens": ready.max_total_num_tokens,
                  "max_req_input_len": ready.max_req_input_len, "context_len": ready.context_len,
                  "internal_states": [state], "version": _version()})


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request, timeout: float = Query(0.0, ge=0, le=_FLUSH_TIMEOUT_MAX_S)) -> Response:
    """Empty the prefix cache (device and host); 400 while requests run (`timeout` s: wait for idle)."""
    out = await _tm(request).flush_cache(timeout)
    if out.success:
        return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details. (When there "
                                 "are running or waiting requests, the operation will not be performed.)\n")
    return PlainTextResponse(out.message or "Cache not flushed: the server is busy.", status_code=400)


@router.post("/abort_request")
async def abort_request(obj: AbortReqInput, request: Request) -> Response:
    _tm(request).abort_request(obj.rid, obj.abort_all)
    return Response(status_code=200)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_tm(request).metrics.render(), media_type=METRICS_CONTENT_TYPE)


@router.get("/version")
async def version() -> Response:
    return _json({"version": _version()})
