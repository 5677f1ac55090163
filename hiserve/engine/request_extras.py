"""Checks and conversions of the request fields for logprobs, logit_bias and structured output.

Kept apart from `protocol` so the pydantic models only call these. Every failure is a
`BadRequestError` (400) naming the parameter as the client spelled it.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from hiserve.engine.errors import BadRequestError
from hiserve.engine.grammar import KINDS, validate_constraint
from hiserve.engine.sampling_params import MAX_LOGIT_BIAS_ENTRIES

MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat top_logprobs; used for every route


def parse_logit_bias(bias: Optional[dict[str, float]], param: str = "logit_bias") -> Optional[dict[int, float]]:
    """`{"token id as a string": bias}` -> {int id: float bias}; range of ids is checked later
    against the vocabulary (SamplingParams.verify).

    Raises:
        BadRequestError: too many entries, a key that is not an integer, a bias outside [-100, 100].
    """
    if not bias:
        return None
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise BadRequestError(f"{param} accepts at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(bias)}.",
                              param=param)
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise BadRequestError(f"{param} keys must be token ids (integers), got {key!r}.", param=param) from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise BadRequestError(f"{param} values must be numbers in [-100, 100], got {value!r} for "
                                  f"token {key}.", param=param)
        out[token] = float(value)
    return out


def check_top_logprobs(value: Optional[int], param: str) -> int:
    """A top-logprobs count in [0, MAX_TOP_LOGPROBS] (None -> 0)."""
    if value is None:
        return 0
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise BadRequestError(f"{param} must be in [0, {MAX_TOP_LOGPROBS}], got {value}.", param=param)
    return value


def check_constraint(kind: str, source: Any, param: Optional[str] = None) -> str:
    """Validate a json_schema / regex / ebnf string (xgrammar parses it); returns it."""
    param = param or kind
    if not isinstance(source, str):
        raise BadRequestError(f"{param} must be a string.", param=param)
    try:
        validate_constraint(kind, source)
    except ValueError as e:
        raise BadRequestError(str(e), param=param) from e
    return source


def constraint_fields(values: dict[str, Optional[str]]) -> dict[str, str]:
    """The set ones of json_schema / regex / ebnf, validated; at most one may be set."""
    present = {k: v for k, v in values.items() if k in KINDS and v is not None}
    if len(present) > 1:
        raise BadRequestError(f"Only one of json_schema, regex and ebnf may be set, got {sorted(present)}.",
                              param=sorted(present)[1])
    return {k: check_constraint(k, v) for k, v in present.items()}


def response_format_schema(response_format: Optional[dict[str, Any]]) -> Optional[str]:
    """The JSON schema string an OpenAI `response_format` asks for, or None for plain text.

    `{"type": "json_object"}` -> any JSON object (`{"type": "object"}`, as SGLang maps it);
    `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` -> that schema.

    Raises:
        BadRequestError (param `response_format`): unknown type, missing or invalid schema.
    """
    if not response_format:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return '{"type": "object"}'
    if kind != "json_schema":
        raise BadRequestError(f"response_format type must be 'text', 'json_object' or 'json_schema', "
                              f"got {kind!r}.", param="response_format")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise BadRequestError("response_format of type 'json_schema' needs a 'json_schema' object.",
                              param="response_format")
    schema = spec.get("schema", spec.get("schema_"))
    if not isinstance(schema, dict):
        raise BadRequestError("response_format.json_schema.schema must be a JSON schema object.",
                              param="response_format")
    source = json.dumps(schema)
    return check_constraint("json_schema", source, param="response_format")
