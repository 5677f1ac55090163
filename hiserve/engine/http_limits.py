"""Bounds a request must meet before the server does any work for it.

One hostile request must not take the server down (issue 13, items 6 and 7), so every
fan-out and size parameter is checked here, cheaply and before tokenization:

- the body size: `--max-request-body-bytes` (`BodySizeLimitMiddleware`: 413 from the
  `Content-Length` header, or as soon as the bytes received pass the limit, so an
  oversized body is never read whole);
- the fan-out of one HTTP request: prompts x `n` (and `best_of`) sequences, at most
  `--max-running-requests` (the most the scheduler can run at once; more would only
  queue behind each other and grow the API process's state);
- text too long for the context, refused from its UTF-8 length alone: no token of the
  vocabulary is longer than `max_token_bytes` bytes, so a text of B bytes has at least
  ceil(B / max_token_bytes) tokens, whatever the tokenizer does with it.

Each refusal is a `BadRequestError` naming the parameter.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional

from starlette.exceptions import HTTPException

from hiserve.engine.errors import ApiError, BadRequestError


def body_too_large(limit: int) -> ApiError:
    err = ApiError(f"The request body is larger than the server's limit of {limit} bytes "
                   f"(--max-request-body-bytes).")
    err.status_code = err.code = 413
    err.err_type = "invalid_request_error"
    return err


class BodySizeLimitMiddleware:
    """ASGI middleware: 413 for a body over `limit` bytes, before it is read whole.

    When a route reads its body, a declared `Content-Length` over the limit is refused before
    the first byte is read; otherwise the bytes are counted as they arrive and passing the
    limit refuses at once. The refusal is an HTTPException(413) raised out of `receive`,
    which FastAPI hands to the app's error handler (the usual envelope). Routes that read no
    body never answer 413.
    """

    def __init__(self, app: Any, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        received = int(declared) if declared.isdigit() and int(declared) > self.limit else 0

        async def counting_receive() -> dict:
            nonlocal received
            if received > self.limit:
                raise HTTPException(413, body_too_large(self.limit).message)
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise HTTPException(413, body_too_large(self.limit).message)
            return message

        await self.app(scope, counting_receive, send)


def check_fanout(ns: list[int], best_of: Optional[int], limit: int, prompt_param: str = "prompt") -> None:
    """Refuse a request that would start more than `limit` sequences.

    Args:
        ns: `n` (sequences) of each prompt of the request; a batch completion has several.
        best_of: candidates per prompt (>= n when given).
        limit: the server's fan-out limit (= --max-running-requests).
    Raises:
        BadRequestError: naming `n`, `best_of` or the prompt parameter.
    """
    for n in ns:
        if n < 1:
            raise BadRequestError(f"n must be at least 1, got {n}.", param="n")
        if n > limit:
            raise BadRequestError(f"n must be at most {limit} (--max-running-requests), got {n}.", param="n")
    if best_of is not None and not 1 <= best_of <= limit:
        raise BadRequestError(f"best_of must be in [1, {limit}] (--max-running-requests), got {best_of}.",
                              param="best_of")
    if len(ns) > limit:
        raise BadRequestError(f"A batch holds at most {limit} prompts (--max-running-requests), "
                              f"got {len(ns)}.", param=prompt_param)
    total = sum(max(n, best_of or 1) for n in ns)
    if total > limit:
        raise BadRequestError(f"{len(ns)} prompts with n={max(ns)} make {total} sequences; one request may "
                              f"start at most {limit} (--max-running-requests).", param="n")


def max_token_bytes(vocab: Iterable[str]) -> int:
    """An upper bound on the UTF-8 bytes of text one token can stand for.

    The raw token strings over-count (a byte-level 'Ġ' is 2 bytes for 1, sentencepiece's
    '▁' 3 for 1, a byte-fallback '<0x41>' 6 for 1), which keeps the bound safe.
    """
    return max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=1) or 1


def check_text_length(texts: Iterable[str], max_tokens: int, context_len: int, token_bytes: int,
                      param: str) -> None:
    """Refuse, without tokenizing, texts that cannot fit in `max_tokens` tokens.

    Raises:
        BadRequestError: naming `param`, when some text needs more than `max_tokens` tokens.
    """
    for text in texts:
        # len(str) <= UTF-8 bytes <= 4 * len(str): the cheap test first.
        if len(text) <= max_tokens:
            continue
        n_bytes = len(text.encode("utf-8", "surrogatepass"))
        at_least = math.ceil(n_bytes / token_bytes)
        if at_least > max_tokens:
            raise BadRequestError(
                f"The input ({len(text)} characters, at least {at_least} tokens) is longer than the "
                f"model's context length allows: this server takes at most {max_tokens} input tokens "
                f"(maximum context length {context_len} tokens).", param=param)
