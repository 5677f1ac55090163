"""Request and response models of the HTTP API: native `/generate` and the OpenAI routes.

Requests validate strictly (pydantic strict mode): a string where a number is expected is
a 400 that names the parameter, never a silent coercion. Unknown top-level keys are
accepted and ignored, because benchmark clients send SGLang extras (`lora_path`,
`lora_path`, ...); a key that asks for a feature hiserve lacks (tools, structural_tag,
stop_regex, LoRA) is refused with a 400 rather than ignored. Logprobs, logit_bias and
structured output (`response_format`, `json_schema` / `regex` / `ebnf`) are checked by
`hiserve.engine.request_extras`.

Errors are the `ApiError` family of `hiserve.engine.errors`.
"""

from __future__ import annotations

import dataclasses
import time
import typing
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from hiserve.engine.errors import BadRequestError
from hiserve.engine.request_extras import (
    check_top_logprobs,
    constraint_fields,
    parse_logit_bias,
    response_format_schema,
)
from hiserve.engine.sampling_params import MAX_LOGIT_BIAS_ENTRIES, MAX_STOP_STRINGS, SamplingParams
from hiserve.engine.validation_errors import field_path


def param_from_loc(loc: tuple[Any, ...]) -> Optional[str]:
    """Name the request field a pydantic error location points at.

    `("body", "max_tokens")` -> "max_tokens"; inside `sampling_params` the inner key is the
    parameter (`("body", "sampling_params", "SamplingParamsInput", "top_k")` -> "top_k").
    """
    parts = [p for p in field_path(loc) if isinstance(p, str)]  # keys, without "body" and union tags
    if not parts:
        return None
    if parts[0] == "sampling_params":
        for p in parts[1:]:
            if p in SamplingParamsInput.model_fields:
                return p
    return parts[0]


# Size bounds of the request schemas (checked by pydantic, so before any work; in /openapi.json).
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat top_logprobs
MAX_GRAMMAR_CHARS = 65536  # json_schema / regex / ebnf source text


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


def _set(*names: str) -> dict[str, Any]:
    """JSON Schema: every one of `names` is present and not null."""
    return {"properties": {n: {"not": {"type": "null"}} for n in names}, "required": list(names)}


def exactly_one_of(*names: str) -> dict[str, Any]:
    """JSON Schema (for /openapi.json) of a rule the handler enforces: exactly one of `names`
    is set (present and not null)."""
    return {"oneOf": [_set(n) for n in names]}


def at_most_one_of(*names: str) -> dict[str, Any]:
    """JSON Schema of the rule: no two of `names` are set."""
    return {"not": {"anyOf": [_set(a, b) for i, a in enumerate(names) for b in names[i + 1:]]}}


# json_schema / regex / ebnf: constraint_fields refuses more than one.
_ONE_GRAMMAR = at_most_one_of("json_schema", "regex", "ebnf")

# Schema-only statements (json_schema_extra) of what a handler refuses with its own 400 message,
# so /openapi.json says it without the message turning into a generic validation error.
# Each is exactly the handler's rule: a looser schema misleads clients, a stricter one fails
# schemathesis's negative-data check. Size keywords apply only to their own JSON type.
_NULL_ONLY = {"type": "null"}  # refused when not None
_EMPTY = {"maxLength": 0, "maxItems": 0}  # refused when truthy: only "", [] or null pass
_FALSY = {"anyOf": [{"type": "null"}, {"const": False}, {"const": 0}, {"type": "string", "maxLength": 0},
                    {"type": "array", "maxItems": 0}, {"type": "object", "maxProperties": 0}]}
_POSITIVE = {"exclusiveMinimum": 0}  # `_positive_or_none`


# ================================================================== native /generate


class _SamplingParamsInputBase(_Strict):
    """The keys of `sampling_params` that are not engine fields (see `SamplingParamsInput`)."""

    model_config = ConfigDict(strict=True, extra="forbid",  # a typo must not fall back to a default
                              json_schema_extra=_ONE_GRAMMAR)

    spaces_between_special_tokens: bool = Field(
        True, description="Accepted for SGLang clients. Hugging Face fast tokenizers (the only kind "
        "hiserve loads) ignore it, as they do in SGLang: special tokens are never space-separated.")
    custom_params: Optional[dict[str, Any]] = Field(
        None, description="Accepted and unused (there are no custom logit processors).")
    # Constrained decoding (xgrammar, at most one) and token biases: typed here as JSON
    # carries them (string keys), converted and checked by request_extras.
    json_schema: Optional[str] = Field(None, max_length=MAX_GRAMMAR_CHARS)
    regex: Optional[str] = Field(None, max_length=MAX_GRAMMAR_CHARS)
    ebnf: Optional[str] = Field(None, max_length=MAX_GRAMMAR_CHARS)
    logit_bias: Optional[dict[str, float]] = Field(None, max_length=MAX_LOGIT_BIAS_ENTRIES)
    # SGLang features hiserve does not implement: refused when set.
    structural_tag: Optional[str] = Field(None, max_length=MAX_GRAMMAR_CHARS, json_schema_extra=_NULL_ONLY)
    stop_regex: Union[str, list[str], None] = Field(None, json_schema_extra=_NULL_ONLY)

    def to_sampling_params(self) -> SamplingParams:
        for name in ("structural_tag", "stop_regex"):
            if getattr(self, name) is not None:
                raise BadRequestError(f"{name} is not supported by this server.", param=name)
        constraint = constraint_fields({"json_schema": self.json_schema, "regex": self.regex,
                                        "ebnf": self.ebnf})
        return SamplingParams(**self.model_dump(include=_ENGINE_SAMPLING_FIELDS), **constraint,
                              logit_bias=parse_logit_bias(self.logit_bias))


# Fields declared on the base (typed as JSON carries them) are converted by to_sampling_params.
_CONVERTED_FIELDS = {"json_schema", "regex", "ebnf", "logit_bias"}
_ENGINE_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams) if f.init} - _CONVERTED_FIELDS
# Engine fields whose request type is narrower than the dataclass annotation.
_SAMPLING_INPUT_TYPES: dict[str, Any] = {
    "stop": Union[str, Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)], None],
}


def _derive_sampling_params_input() -> type[_SamplingParamsInputBase]:
    """`SamplingParamsInput`: one field per `SamplingParams` init field, with its default and
    the bounds `SamplingParams.verify` enforces (`SCHEMA_BOUNDS`, shown in /openapi.json), so
    the request model's defaults cannot drift from the engine's."""
    hints = typing.get_type_hints(SamplingParams)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(SamplingParams):
        if not f.init or f.name in _CONVERTED_FIELDS:
            continue
        bounds = SamplingParams.SCHEMA_BOUNDS.get(f.name)
        fields[f.name] = (_SAMPLING_INPUT_TYPES.get(f.name, hints[f.name]),
                          Field(f.default, json_schema_extra=bounds))
    return create_model("SamplingParamsInput", __base__=_SamplingParamsInputBase,
                        __doc__="`sampling_params` of /generate, typed; converted to the engine's "
                        "`SamplingParams` (same names and defaults).", **fields)


SamplingParamsInput = _derive_sampling_params_input()


class GenerateReqInput(_Strict):
    """Body of POST /generate. Exactly one of `text` / `input_ids`; a list makes a batch."""

    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra=exactly_one_of("text", "input_ids"))

    text: Union[str, list[str], None] = None
    input_ids: Union[list[int], list[list[int]], None] = None
    sampling_params: Union[SamplingParamsInput, list[SamplingParamsInput], None] = None
    stream: bool = False
    rid: Union[str, list[str], None] = None
    # Logprobs in meta_info (see hiserve.engine.logprobs for the definitions).
    return_logprob: Union[bool, list[bool], None] = None
    logprob_start_len: Union[int, list[int], None] = None
    top_logprobs_num: Union[int, list[int], None] = None
    return_text_in_logprobs: Optional[bool] = None
    # Accepted for client compatibility (bench_serving, bench_multiturn send them).
    lora_path: Union[str, list[Optional[str]], None] = Field(
        None, json_schema_extra={"maxLength": 0, "items": {"maxLength": 0}})  # refused when any path is set
    stream_options: Optional[dict[str, Any]] = None
    input_embeds: Optional[Any] = Field(None, json_schema_extra=_NULL_ONLY)
    image_data: Optional[Any] = Field(None, json_schema_extra=_FALSY)

    def check_supported(self) -> None:
        """Refuse the accepted-for-compatibility keys when they ask for something real."""
        if self.input_embeds is not None:
            raise BadRequestError("input_embeds is not supported by this server.", param="input_embeds")
        if self.image_data:
            raise BadRequestError("image_data is not supported by this server.", param="image_data")
        paths = self.lora_path if isinstance(self.lora_path, list) else [self.lora_path]
        if any(paths):
            raise BadRequestError("LoRA adapters are not supported by this server.", param="lora_path")


    def logprob_options(self, n_prompts: int) -> list[tuple[bool, int, int]]:
        """(return_logprob, logprob_start_len, top_logprobs_num) per prompt; a list field must
        have one entry per prompt."""
        def per_prompt(value: Any, default: Any, name: str) -> list[Any]:
            if isinstance(value, list):
                if len(value) != n_prompts:
                    raise BadRequestError(f"{name} has {len(value)} entries for {n_prompts} prompts.", param=name)
                return [default if v is None else v for v in value]
            return [default if value is None else value] * n_prompts

        out = []
        for ret, start, top in zip(per_prompt(self.return_logprob, False, "return_logprob"),
                                   per_prompt(self.logprob_start_len, -1, "logprob_start_len"),
                                   per_prompt(self.top_logprobs_num, 0, "top_logprobs_num")):
            if start < -1:
                raise BadRequestError(f"logprob_start_len must be -1 (output only) or a prompt position, "
                                      f"got {start}.", param="logprob_start_len")
            out.append((bool(ret), start, check_top_logprobs(top, "top_logprobs_num")))
        return out


class AbortReqInput(_Strict):
    """Body of POST /abort_request."""

    rid: str = ""
    abort_all: bool = False


# ================================================================== OpenAI requests


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # accepted; usage comes in the final chunk only


class _OpenAISampling(_Strict):
    """Sampling fields shared by /v1/completions and /v1/chat/completions (SGLang extras included)."""

    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra=_ONE_GRAMMAR)

    model: Optional[str] = None  # echoed back, never validated (clients pass the model path)
    n: int = 1
    stop: Union[str, Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)], None] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    seed: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = Field(None, max_length=MAX_LOGIT_BIAS_ENTRIES)
    user: Optional[str] = None
    # SGLang extras
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: int = 0
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    rid: Union[str, list[str], None] = None
    lora_path: Optional[str] = Field(None, json_schema_extra=_EMPTY)
    regex: Optional[str] = Field(None, max_length=MAX_GRAMMAR_CHARS)
    json_schema: Optional[str] = Field(None, max_length=MAX_GRAMMAR_CHARS)
    ebnf: Optional[str] = Field(None, max_length=MAX_GRAMMAR_CHARS)
    stop_regex: Union[str, list[str], None] = Field(None, json_schema_extra=_EMPTY)
    response_format: Optional[dict[str, Any]] = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _check_supported(self) -> None:
        for name in ("stop_regex", "lora_path"):
            if getattr(self, name):
                raise BadRequestError(f"{name} is not supported by this server.", param=name)

    def _constraint(self) -> dict[str, str]:
        """json_schema / regex / ebnf for SamplingParams, from response_format or the SGLang extras."""
        fields = constraint_fields({"json_schema": self.json_schema, "regex": self.regex, "ebnf": self.ebnf})
        schema = response_format_schema(self.response_format)
        if schema is not None:
            if fields:
                raise BadRequestError(f"response_format cannot be combined with {next(iter(fields))}.",
                                      param="response_format")
            fields = {"json_schema": schema}
        return fields

    def _sampling_params(self, max_new_tokens: Optional[int]) -> SamplingParams:
        def pick(value: Any, default: Any) -> Any:
            return default if value is None else value

        return SamplingParams(
            max_new_tokens=max_new_tokens, min_new_tokens=self.min_tokens,
            temperature=pick(self.temperature, 1.0), top_p=pick(self.top_p, 1.0),
            top_k=pick(self.top_k, -1), min_p=pick(self.min_p, 0.0),
            frequency_penalty=pick(self.frequency_penalty, 0.0),
            presence_penalty=pick(self.presence_penalty, 0.0),
            repetition_penalty=pick(self.repetition_penalty, 1.0),
            stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens, no_stop_trim=self.no_stop_trim,
            n=self.n, sampling_seed=self.seed, logit_bias=parse_logit_bias(self.logit_bias),
            **self._constraint())


def _positive_or_none(value: Optional[int], name: str) -> Optional[int]:
    if value is not None and value <= 0:
        raise BadRequestError(f"{name} must be positive, got {value}.", param=name)
    return value


class CompletionRequest(_OpenAISampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(16, json_schema_extra=_POSITIVE)
    echo: bool = False
    logprobs: Optional[int] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = Field(None, json_schema_extra=_EMPTY)

    def to_sampling_params(self) -> SamplingParams:
        self._check_supported()
        check_top_logprobs(self.logprobs, "logprobs")
        if self.best_of is not None and self.best_of not in (1, self.n):
            raise BadRequestError("best_of must equal n (no best-of sampling).", param="best_of")
        if self.suffix:
            raise BadRequestError("suffix is not supported by this server.", param="suffix")
        return self._sampling_params(_positive_or_none(self.max_tokens, "max_tokens"))

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompt as a batch: each entry a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            batch = [p]
        else:
            batch = list(p)
        if not batch or any(len(x) == 0 for x in batch):
            raise BadRequestError("Prompt cannot be empty", param="prompt")
        return batch


class ChatMessage(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")  # name, tool_call_id, ... pass to the template

    # OpenAI's roles, any case (SGLang lower-cases them too), and "ipython" (Llama 3.1's tool
    # results): another is a 400 naming messages.N.role, not a prompt the template renders in
    # some form. (vLLM takes any string; SGLang refuses other roles, as here.)
    role: Literal["system", "developer", "user", "assistant", "tool", "function", "ipython"]

    @field_validator("role", mode="before")
    @classmethod
    def _lower_role(cls, v: Any) -> Any:
        return v.lower() if isinstance(v, str) else v
    content: Union[str, list[dict[str, Any]], None] = None


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1})
    max_tokens: Optional[int] = Field(None, json_schema_extra=_POSITIVE)  # deprecated alias of max_completion_tokens
    max_completion_tokens: Optional[int] = Field(None, json_schema_extra=_POSITIVE)
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[dict[str, Any]]] = Field(None, json_schema_extra=_EMPTY)
    tool_choice: Union[str, dict[str, Any], None] = None
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    separate_reasoning: bool = True  # accepted; there is no reasoning parser

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def to_sampling_params(self) -> SamplingParams:
        self._check_supported()
        if not self.messages:
            raise BadRequestError("Messages cannot be empty.", param="messages")
        check_top_logprobs(self.top_logprobs, "top_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise BadRequestError("top_logprobs requires logprobs to be true.", param="top_logprobs")
        if self.tools:
            raise BadRequestError("tools are not supported by this server.", param="tools")
        _positive_or_none(self.max_tokens, "max_tokens")  # checked even when max_completion_tokens wins
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(_positive_or_none(limit, self.max_tokens_param))

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template wants them: content a string, text parts joined."""
        out = []
        for i, m in enumerate(self.messages):
            msg = m.model_dump()
            content = m.content
            if isinstance(content, list):
                texts = []
                for part in content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise BadRequestError(f"messages[{i}]: only text content parts are supported.",
                                              param="messages")
                    texts.append(part["text"])
                content = "\n".join(texts)
            msg["content"] = content if content is not None else ""
            out.append(msg)
        return out


# ================================================================== OpenAI responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None  # set with --enable-cache-report


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[dict[str, Any]] = None
    finish_reason: Optional[str] = None
    matched_stop: Union[int, str, None] = None


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    metadata: dict[str, str] = Field(default_factory=lambda: {"weight_version": "default"})


class CompletionStreamResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: Optional[str] = None
    reasoning_content: None = None
    tool_calls: None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: Optional[dict[str, Any]] = None
    finish_reason: Optional[str] = None
    matched_stop: Union[int, str, None] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    metadata: dict[str, str] = Field(default_factory=lambda: {"weight_version": "default"})


class ChatStreamChoice(BaseModel):
    index: int
    delta: dict[str, str]  # {"role", "content"} first, then {"content"}, then {} with finish_reason
    logprobs: Optional[dict[str, Any]] = None
    finish_reason: Optional[str] = None
    matched_stop: Union[int, str, None] = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[UsageInfo] = None


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "hiserve"
    root: str
    parent: None = None
    max_model_len: int


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]
