"""An API app without a scheduler, for tests of what the HTTP layer answers by itself."""

from __future__ import annotations

from fastapi.testclient import TestClient

from hiserve.engine.http_server import create_app
from hiserve.engine.io_struct import SchedulerReady
from hiserve.engine.tokenizer_manager import TokenizerManager
from hiserve.server_args import PortArgs, ServerArgs


class StubTokenizer:
    """A two-entry vocabulary, no chat template: enough for routes that fail before tokenizing."""

    chat_template = None

    def get_vocab(self) -> dict[str, int]:
        return {"a": 0, "abcd": 1}


def make_tm(ready: SchedulerReady | None = None, **flags) -> TokenizerManager:
    """A TokenizerManager on `ServerArgs(**flags)`; close its `_send_sock` when done."""
    ready = ready or SchedulerReady(4096, 1000, 1024, 512, [2])
    return TokenizerManager(ServerArgs(**flags), PortArgs.init_new(), ready, tokenizer=StubTokenizer())


def make_app(**flags) -> tuple[TokenizerManager, TestClient]:
    """(tm, a TestClient of its app); no lifespan, so nothing reaches a scheduler."""
    tm = make_tm(**flags)
    return tm, TestClient(create_app(tm))
