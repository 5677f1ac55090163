"""An honest /openapi.json: every status a route can answer, and the server's real bounds.

FastAPI documents 200 and a 422 that this server never sends (validation errors are 400).
`install_openapi` post-processes the generated document once:

- drops 422 and documents, per operation, the statuses its code path can produce, each
  with the OpenAI error envelope (`ErrorResponse`): 400 (body, query or JSON content-type
  problems), 401 (with --api-key, except /health* and /metrics), 404 (unknown model),
  413 (body over --max-request-body-bytes), 503 (scheduler gone, queue full, not warm);
- writes the limits known only at run time into the request schemas: token ids in
  [0, vocab), `n` / `best_of` / batch sizes up to the fan-out limit (--max-running-requests),
  token counts up to the context length.

Cross-field rules a JSON Schema cannot state (prompt tokens + max_tokens <= context length,
min_new_tokens <= max_new_tokens) are in the descriptions; they are still 400s.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from hiserve.engine.errors import ErrorResponse
from hiserve.engine.sampling_params import SamplingParams

# Routes that wait on the scheduler process, hence can answer 503.
_SCHEDULER_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions", "/get_server_info",
                     "/server_info", "/flush_cache", "/health", "/health_generate", "/v1/loads", "/get_load")
_AUTH_EXEMPT = ("/health", "/metrics")
_STREAMING_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")
_TOKEN_FIELDS = ("input_ids", "stop_token_ids", "prompt")
_FANOUT_FIELDS = ("n", "best_of")
# OpenAI names of SamplingParams fields, for their bounds.
_BOUNDED = {**{k: k for k in SamplingParams.SCHEMA_BOUNDS}, "min_tokens": "min_new_tokens"}
_CONTEXT_NOTE = ("Prompt tokens plus this value must not exceed the context length "
                 "(else 400 naming this parameter).")


def install_openapi(app: FastAPI, *, api_key: bool, vocab_size: int, context_len: int,
                    max_input_len: int, fanout_limit: int) -> None:
    """Replace `app.openapi` with a builder of the corrected document (built once, cached)."""

    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            with warnings.catch_warnings():  # a route with two methods: ids made unique below
                warnings.filterwarnings("ignore", "Duplicate Operation ID")
                doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                                  description=__doc__.split("\n\n")[0])
            _add_error_schema(doc)
            for path, ops in doc["paths"].items():
                for method, op in ops.items():
                    _document_statuses(path, method, op, api_key)
                    if len(ops) > 1:
                        op["operationId"] = f"{op['operationId'].rsplit('_', 1)[0]}_{method}"
            _apply_runtime_bounds(doc["components"]["schemas"], vocab_size, context_len, max_input_len,
                                  fanout_limit)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = build  # type: ignore[method-assign]


def _add_error_schema(doc: dict[str, Any]) -> None:
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    err = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(err.pop("$defs", {}))
    schemas["ErrorResponse"] = err
    schemas["Unauthorized"] = {"type": "object", "required": ["error"],
                               "properties": {"error": {"type": "string", "const": "Unauthorized"}}}


def _error(description: str, schema: str = "ErrorResponse") -> dict[str, Any]:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}}


def _document_statuses(path: str, method: str, op: dict[str, Any], api_key: bool) -> None:
    responses = op.setdefault("responses", {})
    responses.pop("422", None)
    has_body = "requestBody" in op
    if has_body or any(p.get("in") == "query" for p in op.get("parameters", [])):
        responses["400"] = _error("Invalid request; `error.param` names the parameter.")
    if has_body:
        responses["413"] = _error("Request body larger than --max-request-body-bytes.")
    if api_key and not path.startswith(_AUTH_EXEMPT):
        responses["401"] = _error("Missing or wrong 'Authorization: Bearer <key>'.", "Unauthorized")
    if path.startswith("/v1/models/"):
        responses["404"] = _error("No model of that name.")
    if path in _SCHEDULER_ROUTES:
        responses["503"] = _error("Not ready, the request queue is full, or the scheduler is gone.")
    if path in ("/health", "/health_generate"):
        responses["200"] = {"description": "Healthy (empty body)."}
        responses["503"] = {"description": "Not warmed up, scheduler gone, or (/health) stalled for "
                                           "--health-stall-timeout s with requests in flight (empty body)."}
    if path in _STREAMING_ROUTES:
        responses["200"]["content"] = {"application/json": {"schema": {}},
                                       "text/event-stream": {"schema": {}}}
        responses["200"]["description"] = "The answer; with `stream: true`, server-sent events ending in [DONE]."
    if path in ("/flush_cache", "/metrics"):
        responses["200"]["content"] = {"text/plain": {"schema": {"type": "string"}}}
    if path == "/abort_request":
        responses["200"] = {"description": "Abort sent (empty body)."}
    if path == "/flush_cache":
        responses["400"] = {"description": "Requests are running (or a bad `timeout`).",
                            "content": {"text/plain": {"schema": {"type": "string"}},
                                        "application/json": {"schema": {"$ref": "#/components/schemas/"
                                                                                 "ErrorResponse"}}}}


def _walk(node: Any, visit: Callable[[dict[str, Any]], None]) -> None:
    """Call `visit` on every schema object inside `node` (anyOf branches, items, ...)."""
    if isinstance(node, dict):
        visit(node)
        for value in node.values():
            _walk(value, visit)
    elif isinstance(node, list):
        for value in node:
            _walk(value, visit)


def _bound_typed(node: Any, types: tuple[str, ...], bounds: dict[str, Any]) -> None:
    def visit(schema: dict[str, Any]) -> None:
        if schema.get("type") in types:
            schema.update(bounds)
    _walk(node, visit)


def _bound_prompts(prop: dict[str, Any], max_batch: int, max_input_len: int) -> None:
    """A prompt is a non-empty string or 1..max_input_len token ids; a batch 1..max_batch prompts."""
    for branch in prop.get("anyOf", [prop]):
        kind, items = branch.get("type"), branch.get("items", {})
        if kind == "string":
            branch["minLength"] = 1
        elif kind == "array" and items.get("type") == "integer":
            branch.update(minItems=1, maxItems=max_input_len)
        elif kind == "array":
            branch.update(minItems=1, maxItems=max_batch)
            if items.get("type") == "array":
                items.update(minItems=1, maxItems=max_input_len)
            elif items.get("type") == "string":
                items["minLength"] = 1


def _apply_runtime_bounds(schemas: dict[str, Any], vocab_size: int, context_len: int, max_input_len: int,
                          fanout_limit: int) -> None:
    for model in schemas.values():
        props = model.get("properties", {})
        for name, prop in props.items():
            if name in _TOKEN_FIELDS:
                _bound_typed(prop, ("integer",), {"minimum": 0, "maximum": vocab_size - 1})
            if name in _FANOUT_FIELDS:
                _bound_typed(prop, ("integer",), {"minimum": 1, "maximum": fanout_limit})
            elif name in _BOUNDED:
                _bound_typed(prop, ("integer", "number"), SamplingParams.SCHEMA_BOUNDS[_BOUNDED[name]])
            if name in ("max_tokens", "max_new_tokens", "max_completion_tokens"):
                if name == "max_tokens" and "max_completion_tokens" in props:
                    _bound_typed(prop, ("integer",), {"minimum": 1})
                    prop["description"] = "Deprecated alias of max_completion_tokens, ignored when that is set."
                    continue
                low = 0 if name == "max_new_tokens" else 1
                _bound_typed(prop, ("integer",), {"minimum": low, "maximum": context_len - 1})
                prop["description"] = _CONTEXT_NOTE
        for name in ("text", "input_ids", "prompt"):
            if name in props:
                _bound_prompts(props[name], fanout_limit, max_input_len)
        for name, max_items in (("sampling_params", fanout_limit), ("rid", fanout_limit), ("messages", None)):
            prop = props.get(name, {})
            for branch in prop.get("anyOf", [prop]):
                if branch.get("type") == "array":
                    branch["minItems"] = 1
                    if max_items is not None:
                        branch["maxItems"] = max_items
