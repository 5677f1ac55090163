"""The text of a 400 for a request body pydantic refused, in the request's own words.

pydantic reports a value that fits no member of a union (`text: str | list[str]`) once per
member, with the member's type as a location segment ("text.str", "text.list[str]"). A
user sent neither type and wants to hear one thing about the field they wrote:

    text: Input should be a valid string or a valid list
    sampling_params.temperature: Input should be a valid number

This module drops those type segments, and where one member got further into the value than
the others (an object whose field is wrong), keeps only that deeper complaint: the shallower
"should be a valid list" of the other members is noise then.
"""

from __future__ import annotations

from typing import Any, Sequence

# Location segments pydantic adds for union members and validators, not request keys.
_TYPE_SEGMENTS = frozenset({"str", "int", "float", "bool", "none", "dict", "list", "bytes"})
_TYPE_PREFIXES = ("function-", "tagged-union", "lax-", "json-or-python", "constrained-", "nullable")
_MAX_LINES = 4


def _is_type_segment(part: Any) -> bool:
    """A union member's or validator's tag: a type name ('str', 'list[int]', a model's class
    name) rather than a request key (lower-case words) or a list index (an int)."""
    if not isinstance(part, str) or not part:
        return False
    return part in _TYPE_SEGMENTS or "[" in part or part[0].isupper() or part.startswith(_TYPE_PREFIXES)


def field_path(loc: Sequence[Any]) -> tuple[Any, ...]:
    """The request keys and list indices of a pydantic error location, without the leading
    'body' and without union-member tags: ("body", "text", "list[str]", 0) -> ("text", 0)."""
    parts = list(loc[1:]) if loc and loc[0] in ("body", "query", "path", "header") else list(loc)
    return tuple(p for p in parts if not _is_type_segment(p))


def _deepest_members(errors: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The errors of each union's deepest-reaching member(s): a member is the location up to
    and including its first type segment; the others failed sooner, on a type the user did
    not mean."""
    def member(loc: Sequence[Any]) -> tuple[tuple[Any, ...], Any] | None:
        i = next((i for i, p in enumerate(loc) if _is_type_segment(p)), None)
        return None if i is None else (tuple(loc[:i]), loc[i])

    depth: dict[tuple[Any, ...], int] = {}  # union location -> deepest error under it
    for e in errors:
        if (m := member(e["loc"])) is not None:
            depth[m[0]] = max(depth.get(m[0], 0), len(e["loc"]))
    reach: dict[tuple[tuple[Any, ...], Any], int] = {}  # member -> its deepest error
    for e in errors:
        if (m := member(e["loc"])) is not None:
            reach[m] = max(reach.get(m, 0), len(e["loc"]))
    return [e for e in errors if (m := member(e["loc"])) is None or reach[m] == depth[m[0]]]


def describe_validation_errors(errors: Sequence[dict[str, Any]]) -> str:
    """One line per field at fault ("; "-joined, at most four), each with its distinct
    messages joined by "or".

    Args:
        errors: `RequestValidationError.errors()` / `ValidationError.errors()` dicts, each with
            "loc" (a tuple of str keys and int indices) and "msg".
    """
    messages: dict[tuple[Any, ...], list[str]] = {}
    for err in _deepest_members(errors):
        msgs = messages.setdefault(field_path(err["loc"]), [])
        if err["msg"] not in msgs:
            msgs.append(err["msg"])
    lines = []
    for path, msgs in list(messages.items())[:_MAX_LINES]:
        lead = "Input should be "
        rest = [m.removeprefix(lead) for m in msgs[1:]] if msgs[0].startswith(lead) else msgs[1:]
        text = " or ".join([msgs[0], *rest])
        lines.append(f"{'.'.join(str(p) for p in path) or 'body'}: {text}")
    return "; ".join(lines)
