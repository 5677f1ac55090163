"""Pure metric logic of benchmark/bench_serving.py (no server)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmark" / "bench_serving.py"
_spec = importlib.util.spec_from_file_location("bench_serving", _PATH)
bs = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("bench_serving", bs)  # dataclasses look their module up
_spec.loader.exec_module(bs)


def words(text: str) -> int:
    return len(text.split())


def chat_chunk(content=None, usage=None, role=False):
    delta = {}
    if role:
        delta["role"] = "assistant"
    if content is not None:
        delta["content"] = content
    return {"choices": [{"index": 0, "delta": delta}], "usage": usage}


def test_tpot_and_spread():
    assert bs.tpot(1.0, 0.1, 10) == pytest.approx(0.1)
    assert bs.tpot(1.0, 0.1, 1) is None
    assert bs.spread_itls([0.0, 0.3, 0.4], [5, 3, 1]) == pytest.approx([0.1, 0.1, 0.1, 0.1])


def test_tracker_counts_from_final_usage_and_splits_multi_token_chunks():
    t = bs.StreamTracker("openai-chat", start=10.0)
    t.feed(10.0, chat_chunk("", role=True))  # empty role chunk is not the first token
    t.feed(10.5, chat_chunk("a b"))
    t.feed(10.7, chat_chunk("c"))
    t.feed(11.1, chat_chunk("d e"))
    t.feed(11.2, {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 5,
                                           "prompt_tokens_details": {"cached_tokens": 4}}})
    out = t.finish(11.5, prompt_len=7, count_tokens=words)
    assert out.success and out.ttft == pytest.approx(0.5)
    assert out.output_len == 5 and out.prompt_len == 9 and out.cached_tokens == 4
    assert out.itls == pytest.approx([0.2, 0.2, 0.2])  # 0.4 s gap over the 2 tokens of "d e"
    assert out.tpot == pytest.approx((1.5 - 0.5) / 4)


def test_tracker_uses_running_usage_when_reported():
    t = bs.StreamTracker("openai", start=0.0)
    for time_, text, running in ((0.2, "x", 1), (0.5, "yz", 4), (0.6, "w", 5)):
        t.feed(time_, {"choices": [{"index": 0, "text": text}],
                       "usage": {"prompt_tokens": 3, "completion_tokens": running}})
    out = t.finish(0.7, prompt_len=3, count_tokens=words)
    assert out.output_len == 5 and out.cached_tokens is None
    assert out.itls == pytest.approx([0.1, 0.1, 0.1, 0.1])  # "yz" carried 3 tokens


def test_tracker_errors():
    t = bs.StreamTracker("openai-chat", start=0.0)
    with pytest.raises(RuntimeError, match="boom"):
        t.feed(0.1, {"error": {"message": "boom"}})
    assert not bs.StreamTracker("openai-chat", 0.0).finish(1.0, 3, words).success


def test_compute_metrics():
    outs = [bs.RequestOutput(success=True, prompt_len=10, output_len=3, ttft=0.1, latency=0.5,
                             itls=[0.2, 0.2], cached_tokens=5),
            bs.RequestOutput(success=True, prompt_len=30, output_len=1, ttft=0.3, latency=0.3,
                             itls=[], cached_tokens=None),
            bs.RequestOutput(error="HTTP 500")]
    m = bs.compute_metrics(outs, duration=2.0)
    assert m["completed"] == 2 and m["failed"] == 1 and m["errors"] == ["HTTP 500"]
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 2.0
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_itl_ms"] == pytest.approx(200.0)
    assert m["mean_tpot_ms"] == pytest.approx(200.0)  # only the 3-token request has a TPOT
    assert m["total_cached_tokens"] == 5 and m["cache_hit_rate"] == pytest.approx(5 / 40)
    assert m["p99_ttft_ms"] == pytest.approx(100 + 0.99 * 200)
    assert bs.compute_metrics([], 1.0)["mean_ttft_ms"] is None
