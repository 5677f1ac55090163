"""The OpenAI routes: `/v1/completions`, `/v1/chat/completions` (text deltas when streaming)
and `/v1/models`.

Errors name the OpenAI parameters (`max_tokens`, `prompt`, `messages`, ...), not the native
ones the tokenizer manager checks. `http_server` includes this router between `/generate`
and the control routes.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Iterable, Optional

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from hiserve.engine.errors import BadRequestError, NotFoundError
from hiserve.engine.http_limits import check_fanout
from hiserve.engine.logprobs_format import (
    LogprobTracker,
    apply_logprob_options,
    chat_logprobs,
    chat_stream_logprobs,
    completion_choice_logprobs,
    completion_stream_logprobs,
)
from hiserve.engine.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatMessageOut,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    UsageInfo,
)
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

_OPENAI_PARAM_NAMES = {"input_ids": "prompt", "max_new_tokens": "max_tokens",
                       "min_new_tokens": "min_tokens", "sampling_seed": "seed"}

router = APIRouter(route_class=OrjsonRoute)


async def _require_json(request: Request) -> None:
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise BadRequestError("Unsupported Media Type: Only 'application/json' is allowed")


def _finish(st: ReqState) -> tuple[Optional[str], Any]:
    """OpenAI finish_reason and matched_stop of a sequence."""
    fr = st.finish_reason
    if fr is None:
        return None, None
    return fr["type"], fr.get("matched") if fr["type"] == "stop" else None


def _usage(states: Iterable[ReqState], n: int, cache_report: bool) -> UsageInfo:
    """Prompt (and, with `cache_report` (--enable-cache-report), cached) tokens once per prompt,
    completion tokens summed over choices."""
    prompt = cached = completion = 0
    for st in states:
        completion += st.completion_tokens
        if st.index % n == 0:
            prompt += st.prompt_tokens
            cached += st.cached_tokens
    details = PromptTokensDetails(cached_tokens=cached) if cache_report else None
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=details)


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
    tm = get_tm(request)
    with param_names(_OPENAI_PARAM_NAMES):
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
        first = await first_output(gen, request)
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
            return [chunk([], _usage(tracker.latest.values(), req.n, tm.server_args.enable_cache_report))] if req.include_usage else []

        return StreamingResponse(sse_stream(first, gen, render, tail), media_type="text/event-stream")

    states = await collect_outputs(tm.generate(subreqs, request))
    choices = []
    for st in states:
        prompt_text = echo_texts[st.index // req.n] if req.echo else ""
        choices.append(CompletionChoice(
            index=st.index, text=prompt_text + st.text, finish_reason=_finish(st)[0], matched_stop=_finish(st)[1],
            logprobs=completion_choice_logprobs(tm.tokenizer, st.logprobs, req.echo, len(prompt_text))))
    return json_response(CompletionResponse(id=rid, model=model, choices=choices,
                                            usage=_usage(states, req.n, tm.server_args.enable_cache_report)).model_dump())


@router.post("/v1/chat/completions", dependencies=[Depends(_require_json)])
async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
    tm = get_tm(request)
    names = {**_OPENAI_PARAM_NAMES, "input_ids": "messages", "max_new_tokens": req.max_tokens_param}
    with param_names(names):
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
        first = await first_output(gen, request)
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
                                                 usage=_usage(tracker.latest.values(), req.n, tm.server_args.enable_cache_report))]

        return StreamingResponse(sse_stream(first, gen, render, tail), media_type="text/event-stream")

    states = await collect_outputs(tm.generate(subreqs, request))
    choices = [ChatChoice(index=st.index, message=ChatMessageOut(content=st.text),
                          logprobs=(chat_logprobs(tm.tokenizer, *st.logprobs.output_entries(), top_n)
                                    if st.logprobs is not None else None),
                          finish_reason=_finish(st)[0], matched_stop=_finish(st)[1]) for st in states]
    return json_response(ChatCompletionResponse(id=rid, model=model, choices=choices,
                                                usage=_usage(states, req.n, tm.server_args.enable_cache_report)).model_dump())


def _model_card(tm: TokenizerManager) -> ModelCard:
    return ModelCard(id=tm.model_name, root=tm.model_name, max_model_len=tm.context_len)


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    return json_response(ModelList(data=[_model_card(get_tm(request))]).model_dump())


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> Response:
    tm = get_tm(request)
    if model_id != tm.model_name:
        raise NotFoundError(f"The model '{model_id}' does not exist", param="model", code="model_not_found")
    return json_response(_model_card(tm).model_dump())
