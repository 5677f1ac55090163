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


# Keys whose mapping's own keys are the user's (a logit_bias token id or string), never tags.
_USER_KEYED = frozenset({"logit_bias"})


def _is_type_segment(part: Any, parent: Any = None) -> bool:
    """A union member's or validator's tag: a type name ('str', 'list[int]', a model's class
    name) rather than a request key (lower-case words), a list index (an int) or a key the
    user chose inside a mapping such as logit_bias (`parent`: the last key before `part`)."""
    if not isinstance(part, str) or not part or parent in _USER_KEYED:
        return False
    return part in _TYPE_SEGMENTS or "[" in part or part[0].isupper() or part.startswith(_TYPE_PREFIXES)


def _type_positions(loc: Sequence[Any]) -> list[int]:
    """Indices of the type segments of `loc`."""
    tags, parent = [], None
    for i, part in enumerate(loc):
        if _is_type_segment(part, parent):
            tags.append(i)
        else:
            parent = part
    return tags


def field_path(loc: Sequence[Any]) -> tuple[Any, ...]:
    """The request keys and list indices of a pydantic error location, without the leading
    'body' and without union-member tags: ("body", "text", "list[str]", 0) -> ("text", 0)."""
    tags = set(_type_positions(loc))
    start = 1 if loc and loc[0] in ("body", "query", "path", "header") else 0
    return tuple(p for i, p in enumerate(loc) if i >= start and i not in tags)


def _deepest_members(errors: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The errors that lie, at every union on their path, under that union's deepest-reaching
    member(s). A member is the location up to and including a type segment; the others failed
    sooner, on a type the user did not mean. The deepest error of all always stays."""
    members = [[(tuple(e["loc"][:i]), e["loc"][i]) for i in _type_positions(e["loc"])] for e in errors]
    reach: dict[tuple[tuple[Any, ...], Any], int] = {}  # member -> its deepest error
    for e, ms in zip(errors, members):
        for m in ms:
            reach[m] = max(reach.get(m, 0), len(e["loc"]))
    depth: dict[tuple[Any, ...], int] = {}  # union location -> its deepest member's reach
    for (union, _), r in reach.items():
        depth[union] = max(depth.get(union, 0), r)
    return [e for e, ms in zip(errors, members) if all(reach[m] == depth[m[0]] for m in ms)]


def describe_validation_errors(errors: Sequence[dict[str, Any]]) -> str:
    """One line per field at fault ("; "-joined, at most four), each with its distinct
    messages joined by "or".

    Args:
        errors: `RequestValidationError.errors()` / `ValidationError.errors()` dicts, each with
            "loc" (a tuple of str keys and int indices) and "msg".

    Returns:
        e.g. "text: Input should be a valid string or a valid list"; never empty when
        `errors` is not ("body: ..." for an error on the body itself).
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
