"""A burst of requests becomes one prefill batch: the API process stamps each request it sends with
how many others it is still tokenizing (`api_pending`), and an idle scheduler waits for those
(at most _COALESCE_MS) before it forms a batch; a busy one never waits, nor does an idle one
told nothing is pending."""

from __future__ import annotations

import asyncio
import threading
import time
import types

import pytest
import zmq

from api_app import make_tm
from hiserve.engine import scheduler as scheduler_mod
from hiserve.engine.errors import BadRequestError
from hiserve.engine.io_struct import TokenizedGenerateReqInput
from hiserve.engine.sampling_params import SamplingParams
from hiserve.engine.scheduler import Scheduler


def _req(rid: str, pending: int) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(rid, [1, 2], SamplingParams(max_new_tokens=1), api_pending=pending)


def _sockets():
    ctx = zmq.Context.instance()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    return pull, push


def test_idle_scheduler_waits_for_pending_requests_only():
    pull, push = _sockets()
    sched = types.SimpleNamespace(recv_from_api=pull)  # _recv_from_api reads only this socket
    try:
        # idle, one more pending: the second request, sent 5 ms later, joins the first
        push.send_pyobj(_req("a", 1))
        threading.Timer(0.005, lambda: push.send_pyobj(_req("b", 0))).start()
        assert [m.rid for m in Scheduler._recv_from_api(sched, block=True)] == ["a", "b"]
        # busy (block=False): what is there, no wait
        push.send_pyobj(_req("c", 1))
        time.sleep(0.02)
        assert [m.rid for m in Scheduler._recv_from_api(sched, block=False)] == ["c"]
        # idle, nothing pending: no wait either
        push.send_pyobj(_req("d", 0))
        threading.Timer(0.01, lambda: push.send_pyobj(_req("e", 0))).start()
        assert [m.rid for m in Scheduler._recv_from_api(sched, block=True)] == ["d"]
        assert [m.rid for m in Scheduler._recv_from_api(sched, block=True)] == ["e"]
        # a pending request that never comes (it failed validation): the wait is bounded
        push.send_pyobj(_req("f", 1))
        start = time.monotonic()
        assert [m.rid for m in Scheduler._recv_from_api(sched, block=True)] == ["f"]
        assert time.monotonic() - start < 1.0 and scheduler_mod._COALESCE_MS <= 50
    finally:
        pull.close(0)
        push.close(0)


class _GatedTokenizer:
    """encode("slow") blocks until `gate` is set; any other text encodes at once."""

    chat_template = None

    def __init__(self):
        self.gate = threading.Event()

    def get_vocab(self) -> dict[str, int]:
        return {"a": 0}

    def encode(self, text: str) -> list[int]:
        if text == "slow":
            self.gate.wait(5)
        return [0]


def test_api_stamps_requests_it_is_still_tokenizing():
    tm = make_tm()
    tok = _GatedTokenizer()
    tm.tokenizer = tok
    sent = []
    tm._send = sent.append

    async def scenario():
        slow = asyncio.create_task(tm.tokenize_many(["slow"]))
        await asyncio.sleep(0.02)
        assert tm.tokenizing == 1  # "slow" is in the tokenizer pool
        assert await tm.tokenize_many(["fast"]) == [[0]]
        gen = tm.generate([(None, TokenizedGenerateReqInput("r1", [0], SamplingParams(max_new_tokens=1)))])
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.02)
        assert [m.api_pending for m in sent if isinstance(m, TokenizedGenerateReqInput)] == [1]
        first.cancel()
        tok.gate.set()
        assert await slow == [[0]]
        assert tm.tokenizing == 0
        with pytest.raises(BadRequestError):
            await tm.tokenize_many(["x" * 10 ** 7])  # refused before tokenizing: counts nothing
        assert tm.tokenizing == 0

    try:
        asyncio.run(scenario())
    finally:
        tm._send_sock.close(0)
