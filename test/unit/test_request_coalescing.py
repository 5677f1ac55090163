"""A burst of requests becomes one prefill batch: the API process stamps each request it sends with
how many other generate requests it has accepted and not yet sent (`api_pending`,
hiserve.engine.incoming), and an idle scheduler waits for those (at most _COALESCE_MS) before it
forms a batch; a busy one never waits, nor does an idle one told nothing is pending."""

from __future__ import annotations

import asyncio
import threading
import time
import types

import pytest
import zmq

from api_app import make_tm
from hiserve.engine import scheduler as scheduler_mod
from hiserve.engine.incoming import IncomingCounter, IncomingMiddleware
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


def test_idle_scheduler_waits_for_pending_requests_only(monkeypatch):
    # windows far above the test's 5-10 ms timers, so a busy machine cannot make it flaky
    monkeypatch.setattr(scheduler_mod, "_COALESCE_MS", 2000)
    monkeypatch.setattr(scheduler_mod, "_COALESCE_GAP_MS", 1000)
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
        # a pending request that never comes (it failed validation): the wait is bounded by the gap
        monkeypatch.setattr(scheduler_mod, "_COALESCE_GAP_MS", 30)
        push.send_pyobj(_req("f", 1))
        start = time.monotonic()
        assert [m.rid for m in Scheduler._recv_from_api(sched, block=True)] == ["f"]
        assert 0.025 < time.monotonic() - start < 1.0
        # ... and in all by the window, however often more are announced
        monkeypatch.setattr(scheduler_mod, "_COALESCE_MS", 60)
        for i in range(6):
            threading.Timer(0.02 * (i + 1), lambda i=i: push.send_pyobj(_req(f"g{i}", 1))).start()
        push.send_pyobj(_req("g", 1))
        start = time.monotonic()
        got = [m.rid for m in Scheduler._recv_from_api(sched, block=True)]
        assert got[0] == "g" and len(got) < 7 and time.monotonic() - start < 0.5
        time.sleep(0.2)
        Scheduler._recv_from_api(sched, block=False)  # drain the rest
        assert scheduler_mod._COALESCE_GAP_MS <= scheduler_mod._COALESCE_MS
    finally:
        pull.close(0)
        push.close(0)


def _scope(path: str = "/v1/chat/completions", method: str = "POST") -> dict:
    return {"type": "http", "method": method, "path": path, "headers": []}


async def _body(chunks=(b"{}",)):
    """An ASGI receive that yields the body in `chunks` (the last with more_body False)."""
    messages = [{"type": "http.request", "body": c, "more_body": i + 1 < len(chunks)} for i, c in enumerate(chunks)]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    return receive


def test_incoming_counts_from_body_to_hand_over():
    counter = IncomingCounter()
    seen = {}
    first_in, second_in = asyncio.Event(), asyncio.Event()

    async def app(scope, receive, send):
        name = scope["name"]
        if name == "stalled":  # its body never arrives: not counted
            seen["stalled"] = counter.value
            return
        while (await receive()).get("more_body"):
            seen.setdefault("while uploading", counter.value)
        if name == "a":
            first_in.set()
            await second_in.wait()  # "b" arrives while "a" is still parsing/tokenizing
            seen["a"] = counter.handed_over()
            seen["a again"] = counter.handed_over()  # a second send (n > 1) counts nothing more
        elif name == "b":
            second_in.set()
            await asyncio.sleep(0.01)
            seen["b"] = counter.handed_over()
        elif name == "bad":
            raise ValueError("refused before it was sent")
        else:
            seen["other"] = counter.value

    mw = IncomingMiddleware(app, counter)

    async def scenario():
        await asyncio.gather(mw({**_scope(), "name": "a"}, await _body((b"{", b"}")), None),
                             mw({**_scope("/generate", "PUT"), "name": "b"}, await _body(), None))
        assert seen == {"while uploading": 0, "a": 1, "a again": 1, "b": 0} and counter.value == 0
        with pytest.raises(ValueError):
            await mw({**_scope(), "name": "bad"}, await _body(), None)
        assert counter.value == 0  # counted off when its response ended
        await mw({**_scope(), "name": "stalled"}, await _body(), None)
        assert seen["stalled"] == 0 and counter.value == 0
        await mw({**_scope("/v1/models", "GET"), "name": "other"}, await _body(), None)
        assert seen["other"] == 0  # other routes are not counted
        assert counter.handed_over() == 0  # outside a counted request: nothing to mark

    asyncio.run(scenario())


def test_generate_stamps_the_count():
    tm = make_tm()
    sent = []
    tm._send = sent.append

    async def scenario():
        tm.incoming.value = 3  # three other requests accepted, not yet sent
        gen = tm.generate([(None, TokenizedGenerateReqInput("r1", [0], SamplingParams(max_new_tokens=1)))])
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.01)
        first.cancel()

    try:
        asyncio.run(scenario())
    finally:
        tm._send_sock.close(0)
    assert [m.api_pending for m in sent if isinstance(m, TokenizedGenerateReqInput)] == [3]
