"""The FastAPI app: native and control routes, API-key check, and the one place where errors
become responses.

Routes validate and convert the request, hand sequences to the TokenizerManager and
format what it yields: native `/generate` (cumulative text and output_ids), the OpenAI
routes (`hiserve.engine.openai_routes`, text deltas), and the control routes.
Every failure is an `ApiError` (or a pydantic validation error) mapped to a status and
the nested envelope `{"error": {"message", "type", "param", "code"}}` by the handlers in
`_install_error_handlers`; a client error is never a 5xx. Streaming requests are checked,
and their first output awaited, before the 200 headers go out, so a refused request is
a real 4xx; a failure after that is an in-stream `data: {"error": ...}` event
(`hiserve.engine.route_helpers`).
"""

from __future__ import annotations

import dataclasses
import hmac
import importlib.metadata
import logging
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Optional

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hiserve.engine import openai_routes
from hiserve.engine.errors import ApiError, BadRequestError, ErrorResponse
from hiserve.engine.http_limits import BodySizeLimitMiddleware, check_fanout
from hiserve.engine.incoming import IncomingMiddleware
from hiserve.engine.loads import legacy_load, load_entry
from hiserve.engine.logprobs_format import apply_logprob_options
from hiserve.engine.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from hiserve.engine.openapi import install_openapi
from hiserve.engine.protocol import AbortReqInput, GenerateReqInput, SamplingParamsInput, param_from_loc
from hiserve.engine.req_state import ReqState
from hiserve.engine.route_helpers import (
    OrjsonRoute,
    collect_outputs,
    first_output,
    get_tm,
    json_response,
    param_names,
    sse_stream,
)
from hiserve.engine.tokenizer_manager import TokenizerManager
from hiserve.engine.validation_errors import describe_validation_errors

logger = logging.getLogger(__name__)

_HEALTH_GENERATE_TIMEOUT_S = 20.0
_FLUSH_TIMEOUT_MAX_S = 600.0

router = APIRouter(route_class=OrjsonRoute)


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
                       allow_methods=["*"], allow_headers=["*"])  # outside the above: 401s carry CORS headers
    app.add_middleware(IncomingMiddleware, counter=tm.incoming)  # outermost: counts from arrival
    app.include_router(router)
    if tm.server_args.enable_metrics:
        app.include_router(metrics_router)
    _install_error_handlers(app)
    install_openapi(app, api_key=bool(tm.server_args.api_key), vocab_size=tm.ready.vocab_size,
                    context_len=tm.context_len, max_input_len=tm.ready.max_req_input_len,
                    fanout_limit=tm.fanout_limit)
    return app


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
        return error_response(BadRequestError("Invalid request: " + describe_validation_errors(errors), param=param))

    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        err = ApiError(str(exc.detail))
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


# ====================================================================== native API


def _native_output(st: ReqState, with_index: bool) -> dict[str, Any]:
    out = {"text": st.text, "output_ids": st.output_ids, "meta_info": st.meta_info()}
    if with_index:
        out["index"] = st.index
    return out


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(obj: GenerateReqInput, request: Request) -> Response:
    tm = get_tm(request)
    with param_names({"input_ids": "text"} if obj.text is not None else {}):
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
        first = await first_output(gen, request)
        return StreamingResponse(sse_stream(first, gen, lambda st: [_native_output(st, many)]),
                                 media_type="text/event-stream")
    states = await collect_outputs(tm.generate(subreqs, request))
    outs = [_native_output(st, many) for st in states]
    return json_response(outs if many else outs[0])


# Included here, not in create_app, so the routes (and /openapi.json) keep their order:
# /generate, the OpenAI routes, then the control routes.
router.include_router(openai_routes.router)


# ====================================================================== health, info, control


@router.get("/health")
async def health(request: Request) -> Response:
    """200 once warmed up while the scheduler process lives; no generation (see /health_generate)."""
    return Response(status_code=200 if get_tm(request).is_healthy else 503)


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    tm = get_tm(request)
    ok = tm.is_healthy and await tm.health_check(_HEALTH_GENERATE_TIMEOUT_S)
    return Response(status_code=200 if ok else 503)


@router.get("/get_model_info")
@router.get("/model_info")
async def get_model_info(request: Request) -> Response:
    tm = get_tm(request)
    args = tm.server_args
    return json_response({"model_path": args.model_path, "tokenizer_path": args.tokenizer_path,
                          "served_model_name": tm.model_name, "is_generation": True,
                          "preferred_sampling_params": None, "weight_version": "default",
                          "context_length": tm.context_len})


@router.get("/get_server_info")
@router.get("/server_info")
async def get_server_info(request: Request) -> Response:
    tm = get_tm(request)
    state = await tm.get_internal_state()
    # Slots a new request could use: free ones plus those only the prefix cache holds.
    state.setdefault("available_tokens", state.get("available_size", 0) + state.get("evictable_size", 0))
    state.setdefault("last_gen_throughput", tm.metrics.last_gen_throughput)
    args = dataclasses.asdict(tm.server_args)
    if args.get("api_key"):
        args["api_key"] = "<redacted>"
    ready = tm.ready
    return json_response({**args, "max_total_num_tokens": ready.max_total_num_tokens,
                          "max_req_input_len": ready.max_req_input_len, "context_len": ready.context_len,
                          "internal_states": [state], "version": _version()})


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request, timeout: float = Query(0.0, ge=0, le=_FLUSH_TIMEOUT_MAX_S)) -> Response:
    """Empty the prefix cache (device and host); 400 while requests run (`timeout` s: wait for idle)."""
    out = await get_tm(request).flush_cache(timeout)
    if out.success:
        return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details. (When there "
                                 "are running or waiting requests, the operation will not be performed.)\n")
    return PlainTextResponse(out.message or "Cache not flushed: the server is busy.", status_code=400)


@router.post("/abort_request")
async def abort_request(obj: AbortReqInput, request: Request) -> Response:
    get_tm(request).abort_request(obj.rid, obj.abort_all)
    return Response(status_code=200)


@router.get("/v1/loads")
async def v1_loads(request: Request, dp_rank: Optional[int] = Query(None)) -> Response:
    """Load of each data-parallel rank (one here: 0), SGLang's `/v1/loads` shape (see `loads`)."""
    tm = get_tm(request)
    entry = load_entry(await tm.get_internal_state(), tm.metrics.last_cache_hit_rate)
    entries = [entry] if dp_rank is None or dp_rank == entry["dp_rank"] else []
    return json_response({"timestamp": time.time(), "version": _version(), "loads": entries})


@router.get("/get_load")
async def get_load(request: Request) -> Response:
    """Legacy load report read by sglang-router's power_of_two policy (see `loads`)."""
    tm = get_tm(request)
    entry = load_entry(await tm.get_internal_state(), tm.metrics.last_cache_hit_rate)
    return json_response([legacy_load(entry)])


# Mounted by create_app only with --enable-metrics (SGLang serves /metrics only then).
metrics_router = APIRouter()


@metrics_router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(get_tm(request).metrics.render(), media_type=METRICS_CONTENT_TYPE)


@router.get("/version")
async def version() -> Response:
    return json_response({"version": _version()})
