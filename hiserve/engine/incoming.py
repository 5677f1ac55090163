"""How many generate requests the API process has accepted but not yet handed to the scheduler.

Each request the API process sends carries that count (`TokenizedGenerateReqInput.api_pending`):
an idle scheduler then waits for the others before it forms a prefill batch
(`Scheduler._recv_from_api`). Why: a burst of requests (clients that all got their answers in
one step and ask again at once) reaches the scheduler over ~2 ms each (HTTP parsing, chat
template, tokenization), and without the hint the first one's prefill starts alone and the
rest queue behind it. Counted from the ASGI app's entry, so a request still being parsed is
known when the first of the burst is sent.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

GENERATE_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions"})

# This request's cell: [True] once it was handed to the scheduler (or None outside a counted request)
_CELL: ContextVar[list[bool] | None] = ContextVar("hiserve_incoming_cell", default=None)


class IncomingCounter:
    """The count, shared by the middleware and the TokenizerManager (one event loop: no lock)."""

    def __init__(self) -> None:
        self.value = 0

    def handed_over(self) -> int:
        """Mark the current request as sent (once; later calls do nothing) and return how many
        other accepted requests are still on their way."""
        cell = _CELL.get()
        if cell is not None and not cell[0]:
            cell[0] = True
            self.value -= 1
        return self.value


class IncomingMiddleware:
    """Pure ASGI middleware: a POST to a generate route counts from its arrival until it is
    handed over (`IncomingCounter.handed_over`) or, failing that, until its response ends."""

    def __init__(self, app: Any, counter: IncomingCounter):
        self.app = app
        self.counter = counter

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in GENERATE_PATHS:
            await self.app(scope, receive, send)
            return
        cell = [False]
        token = _CELL.set(cell)
        self.counter.value += 1
        try:
            await self.app(scope, receive, send)
        finally:
            if not cell[0]:
                cell[0] = True
                self.counter.value -= 1
            _CELL.reset(token)
