"""Logprobs, logit_bias and grammar masks in the scheduler, against a float32 transformers forward.

Prompt logprobs come from the prefill (also after a prefix-cache hit and across chunked
prefill); output logprobs from the sampling step; both must equal log_softmax of an HF
forward of the same tokens.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from hiserve.engine.io_struct import BatchTokenIDOut, TokenizedGenerateReqInput
from hiserve.engine.sampling_params import SamplingParams
from hiserve.engine.scheduler import Scheduler
from hiserve.server_args import ServerArgs

ATOL = 2e-3  # float32 hiserve vs float32 transformers, same dequantized GGUF weights


def make_scheduler(**kwargs) -> Scheduler:
    return Scheduler(ServerArgs(dtype="float32", device="cpu", **kwargs).resolve(), None)


@pytest.fixture(scope="module")
def sched() -> Scheduler:
    return make_scheduler(max_total_tokens=4096, chunked_prefill_size=8)


@pytest.fixture(scope="module")
def hf_model(sched):
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(sched.server_args.model_path)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] log_softmax of the logits at every position."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def run(sched: Scheduler, req: TokenizedGenerateReqInput) -> dict:
    sched.add_request(req)
    for _ in range(2000):
        if not (sched.waiting_queue or sched.running or sched.chunked_req):
            break
        sched.step()
    out = {"ids": [], "in": [], "in_top": [], "out": [], "out_top": [], "finish": None, "cached": 0}
    for msg in sched.outbox:
        if not isinstance(msg, BatchTokenIDOut):
            continue
        for i, rid in enumerate(msg.rids):
            if rid != req.rid:
                continue
            out["ids"] += msg.new_output_ids[i]
            out["finish"] = msg.finished_reasons[i]
            out["cached"] = msg.cached_tokens_device[i]
            chunk = msg.logprobs[i]
            if chunk is not None:
                out["out"] += chunk.output_token_logprobs
                out["out_top"] += chunk.output_top_logprobs
                if chunk.input_token_logprobs is not None:
                    out["in"] = chunk.input_token_logprobs
                    out["in_top"] = chunk.input_top_logprobs
    sched.outbox.clear()
    return out


def greedy_req(rid: str, ids: list[int], start: int = -1, top: int = 0, max_new: int = 6,
               **sp) -> TokenizedGenerateReqInput:
    params = SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True, **sp)
    return TokenizedGenerateReqInput(rid, ids, params, return_logprob=True, logprob_start_len=start,
                                     top_logprobs_num=top)


def check_against_hf(hf_model, prompt: list[int], res: dict, start: int) -> None:
    full = prompt + res["ids"]
    ref = hf_logprobs(hf_model, full)
    # Prompt positions start..L-1; position 0 is None.
    assert [t for _, t in res["in"]] == prompt[start:]
    for pos, (lp, tok) in zip(range(start, len(prompt)), res["in"]):
        if pos == 0:
            assert lp is None
        else:
            assert abs(lp - ref[pos - 1, tok].item()) < ATOL, pos
    assert [t for _, t in res["out"]] == res["ids"]
    for k, (lp, tok) in enumerate(res["out"]):
        assert abs(lp - ref[len(prompt) - 1 + k, tok].item()) < ATOL, k


def test_prompt_and_output_logprobs_match_transformers(sched, hf_model):
    prompt = sched.tokenizer.encode("The quick brown fox jumps over the lazy dog because it was")
    res = run(sched, greedy_req("a", prompt, start=0, top=5))
    assert len(prompt) > 8  # spans several prefill chunks (chunked_prefill_size=8)
    check_against_hf(hf_model, prompt, res, start=0)
    # Greedy: the chosen token is the argmax of its top logprobs, which are sorted.
    for (lp, tok), top in zip(res["out"], res["out_top"]):
        assert len(top) == 5 and top[0][1] == tok and abs(top[0][0] - lp) < 1e-6
        assert [v for v, _ in top] == sorted((v for v, _ in top), reverse=True)
    assert len(res["in_top"]) == len(prompt) and res["in_top"][0] == []


def test_prefix_cache_hit_still_returns_prompt_logprobs(sched, hf_model):
    prompt = sched.tokenizer.encode("Once upon a time in a small village there lived an old baker who")
    first = run(sched, greedy_req("b1", prompt, max_new=2))  # output logprobs only; fills the cache
    assert first["in"] == [] and len(first["out"]) == 2
    again = run(sched, greedy_req("b2", prompt, start=5))
    # Tokens before position 4 still come from the cache; the rest is recomputed.
    assert 0 < again["cached"] <= 4
    check_against_hf(hf_model, prompt, again, start=5)


def test_sampled_logprobs_use_temperature(sched, hf_model):
    prompt = sched.tokenizer.encode("My favourite colour is")
    req = TokenizedGenerateReqInput("c", prompt, SamplingParams(max_new_tokens=3, temperature=0.5,
                                                                sampling_seed=7),
                                    return_logprob=True, top_logprobs_num=2)
    res = run(sched, req)
    ref = torch.log_softmax(hf_model(torch.tensor([prompt + res["ids"]])).logits[0].float() / 0.5, dim=-1)
    for k, (lp, tok) in enumerate(res["out"]):
        assert abs(lp - ref[len(prompt) - 1 + k, tok].item()) < ATOL


def test_logit_bias_forces_and_bans_tokens(sched):
    prompt = sched.tokenizer.encode("The capital of France is")
    base = run(sched, greedy_req("d0", prompt, max_new=3))["ids"]
    forced = run(sched, greedy_req("d1", prompt, max_new=3, logit_bias={1234: 100.0}))["ids"]
    assert forced == [1234, 1234, 1234]
    banned = run(sched, greedy_req("d2", prompt, max_new=3, logit_bias={base[0]: -100.0}))["ids"]
    assert banned[0] != base[0]


def test_json_schema_constrains_output(sched):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    prompt = sched.tokenizer.encode("Give me JSON:")
    res = run(sched, TokenizedGenerateReqInput(
        "e", prompt, SamplingParams(max_new_tokens=40, temperature=0, json_schema=json.dumps(schema))))
    assert res["finish"]["type"] == "stop"
    text = sched.tokenizer.decode(res["ids"], skip_special_tokens=True)
    obj = json.loads(text)
    assert set(obj) == {"n", "ok"} and 0 <= obj["n"] <= 9 and isinstance(obj["ok"], bool)


def test_integrity_after_all(sched):
    sched.kv.check_integrity()
    assert sched.flush_cache()
    assert sched.kv.allocator.available_size() == sched.max_total_num_tokens
    sched.kv.check_integrity()
