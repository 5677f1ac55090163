"""How many generate requests the API process has accepted but not yet handed to the scheduler.

Each request the API process sends carries that count (`TokenizedGenerateReqInput.api_pending`):
an idle scheduler then waits for the others before it forms a prefill batch
(`Scheduler._recv_from_api`). Why: a burst of requests (clients that all got their answers in
one step and ask again at once) reaches the scheduler over ~2 ms each (HTTP parsing, chat
template, tokenization), and without the hint the first one's prefill starts alone and the
rest queue behind it. Counted from the moment its body has arrived (not from the connection: a
client that uploads slowly, or stalls, must not hold the scheduler), so a request still being
parsed, templated or tokenized is known when the first of the burst is sent.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

GENERATE_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions"})

# This request's cell: [False] while it is counted, [True] before its body is complete and once it
# was handed to the scheduler (None outside a generate request)
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
    """Pure ASGI middleware: a POST (or PUT) to a generate route counts from the last message of
    its body until it is handed over (`IncomingCounter.handed_over`) or, failing that, until its
    response ends."""

    def __init__(self, app: Any, counter: IncomingCounter):
        self.app = app
        self.counter = counter

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if (scope["type"] != "http" or scope.get("method") not in ("POST", "PUT")
                or scope.get("path") not in GENERATE_PATHS):
            await self.app(scope, receive, send)
            return
        cell = [True]  # "not counted" until the body is complete
        counter = self.counter

        async def counting_receive() -> dict:
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False) and cell[0]:
                cell[0] = False
                counter.value += 1
            return message

        token = _CELL.set(cell)
        try:
            await self.app(scope, counting_receive, send)
        finally:
            if not cell[0]:
                cell[0] = True
                counter.value -= 1
            _CELL.reset(token)
