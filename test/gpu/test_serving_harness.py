"""The serving harness's own logic (no server): workloads, comparisons, log scan, pool check."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from serving_harness import Result, Workload, agreement, identical, log_errors, pools_free  # noqa: E402

W = Workload(num_conversations=3, num_turns=3, first_question_tokens=20, question_tokens=5, reply_tokens=3,
             output_tokens=4, vocab_size=100)


def test_prompts_are_fixed_and_extend_the_previous_turn():
    for conv in range(3):
        for turn in range(1, 3):
            prev, cur = W.prompt(conv, turn - 1), W.prompt(conv, turn)
            assert cur[:len(prev)] == prev and len(cur) == W.prompt_tokens(turn)
    assert W.prompt(0, 2) == W.prompt(0, 2) and W.prompt(0, 0) != W.prompt(1, 0)
    assert min(min(W.prompt(c, 2)) for c in range(3)) >= 6  # no special tokens
    assert W.working_set_tokens() == 3 * (20 + 2 * 8 + 4)


def _res(ids):
    return Result(True, ids, {})


def test_identical_and_agreement():
    a = {(0, 0): _res([1, 2, 3, 4]), (0, 1): _res([5, 6, 7, 8])}
    b = {(0, 0): _res([1, 2, 3, 4]), (0, 1): _res([5, 6, 9, 9])}
    assert identical(a, a)["identical"] == 2
    same = identical(a, b)
    assert same["identical"] == 1 and same["first_differences"] == [[0, 1]]
    agr = agreement(a, b)
    assert agr["first_token_agreement"] == 1.0 and agr["mean_prefix_fraction"] == (1.0 + 0.5) / 2
    c = {(0, 0): _res([9, 2, 3, 4]), (0, 1): Result(False, [], {}, "boom")}
    agr = agreement(a, c)
    assert agr["first_token_agreement"] == 0.0 and agr["mean_prefix_fraction"] == 0.0


def test_log_errors(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("INFO ready\nDecode batch ...\n")
    assert log_errors(str(log)) == []
    log.write_text("INFO ready\nRuntimeError: CUDA error: an illegal memory access was encountered\n"
                   "Traceback (most recent call last):\n")
    assert len(log_errors(str(log))) == 2


def test_pools_free():
    state = {"available_size": 10, "max_total_num_tokens": 10, "evictable_size": 0, "protected_size": 0}
    assert pools_free(state)
    assert not pools_free({**state, "available_size": 9})
    host = {**state, "host_total_size": 40, "host_available_size": 40, "host_used_size": 0}
    assert pools_free(host)
    assert not pools_free({**host, "host_available_size": 32, "host_used_size": 8})
