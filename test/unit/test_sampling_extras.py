"""logit_bias, grammar bitmask and logprobs in the sampler; checks of the new request fields (no model)."""

from __future__ import annotations

import json

import pytest
import torch

from hiserve.engine.errors import BadRequestError
from hiserve.engine.request_extras import (
    check_top_logprobs,
    constraint_fields,
    parse_logit_bias,
    response_format_schema,
)
from hiserve.engine.sampler import Sampler, SamplingBatchInfo, unpack_bitmask
from hiserve.engine.sampling_params import SamplingParams

V = 70  # not a multiple of 32: the bitmask has padding bits


def info_for(*params: SamplingParams) -> SamplingBatchInfo:
    return SamplingBatchInfo.from_reqs(list(params), [([1, 2], [3])] * len(params), V, "cpu")


def test_logit_bias_and_logprobs_of_the_sampling_distribution():
    torch.manual_seed(0)
    logits = torch.randn(2, V)
    params = [SamplingParams(temperature=0, logit_bias={5: 100.0}),
              SamplingParams(temperature=0.5, logit_bias={7: -100.0, 8: 3.0}, sampling_seed=1)]
    info = info_for(*params)
    ids, lp = Sampler().sample_and_logprobs(logits, info, torch.tensor([0, 1]))
    assert ids[0].item() == 5
    biased = logits.clone()
    biased[0, 5] += 100
    biased[1, 7] -= 100
    biased[1, 8] += 3
    want = torch.stack([torch.log_softmax(biased[0], -1), torch.log_softmax(biased[1] / 0.5, -1)])
    assert torch.allclose(lp, want, atol=1e-5)
    assert ids[1].item() != 7


def test_bitmask_unpack_and_mask_forbids_tokens():
    mask = torch.zeros(1, 3, dtype=torch.int32)  # 96 bits >= V
    allowed = [3, 40, 69]
    for t in allowed:
        mask[0, t // 32] |= 1 << (t % 32)
    bits = unpack_bitmask(mask, V)
    assert bits.shape == (1, V) and bits[0].nonzero().view(-1).tolist() == allowed
    # A mask narrower than the logits forbids the extra columns.
    assert unpack_bitmask(mask[:, :1], V)[0].nonzero().view(-1).tolist() == [3]
    info = info_for(SamplingParams(temperature=0))
    info.vocab_mask = mask
    logits = torch.zeros(1, V)
    logits[0, 10] = 50.0  # the favourite is forbidden
    ids, lp = Sampler().sample_and_logprobs(logits, info, torch.tensor([0]))
    assert ids.item() in allowed
    assert torch.isinf(lp[0, 10]) and torch.isclose(lp[0, allowed].exp().sum(), torch.tensor(1.0))


def test_grammar_wins_over_min_new_tokens():
    """A mask allowing only EOS while min_new_tokens bans it must not give a NaN distribution."""
    eos = 2
    info = SamplingBatchInfo.from_reqs([SamplingParams(temperature=0.7, min_new_tokens=5)], [([1], [3])], V, "cpu",
                                       eos_token_ids=[eos])
    mask = torch.zeros(1, 3, dtype=torch.int32)
    mask[0, 0] = 1 << eos
    info.vocab_mask = mask
    ids, lp = Sampler().sample_and_logprobs(torch.randn(1, V), info, torch.tensor([0]))
    assert ids.item() == eos and not torch.isnan(lp).any()


def test_sign_bit_of_a_bitmask_word():
    mask = torch.tensor([[-(2 ** 31), 0, 0]], dtype=torch.int32)  # only bit 31 set
    assert unpack_bitmask(mask, V)[0].nonzero().view(-1).tolist() == [31]


def test_sampling_params_verify_logit_bias():
    SamplingParams(logit_bias={1: 100.0}).verify(V)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={V: 1.0}).verify(V)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: -100.5}).verify(V)
    with pytest.raises(ValueError, match="exclusive"):
        SamplingParams(regex="a", ebnf='root ::= "a"').verify(V)


@pytest.mark.parametrize("bias", [{"x": 1}, {"1": 101}, {"1": True}, {str(i): 0 for i in range(1025)}])
def test_parse_logit_bias_rejects(bias):
    with pytest.raises(BadRequestError) as e:
        parse_logit_bias(bias)
    assert e.value.param == "logit_bias"


def test_parse_logit_bias_and_top_logprobs():
    assert parse_logit_bias({"12": -3, "7": 2.5}) == {12: -3.0, 7: 2.5}
    assert parse_logit_bias(None) is None
    assert check_top_logprobs(None, "top_logprobs") == 0 and check_top_logprobs(20, "x") == 20
    with pytest.raises(BadRequestError):
        check_top_logprobs(21, "top_logprobs")


def test_response_format_mapping():
    assert response_format_schema(None) is None
    assert response_format_schema({"type": "text"}) is None
    assert json.loads(response_format_schema({"type": "json_object"})) == {"type": "object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert json.loads(response_format_schema(rf)) == schema
    for bad in ({"type": "xml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"name": "x"}},
                {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}):
        with pytest.raises(BadRequestError) as e:
            response_format_schema(bad)
        assert e.value.param == "response_format"


def test_constraint_fields():
    assert constraint_fields({"json_schema": None, "regex": "[a-z]+", "ebnf": None}) == {"regex": "[a-z]+"}
    with pytest.raises(BadRequestError) as e:
        constraint_fields({"regex": "(", "json_schema": None, "ebnf": None})
    assert e.value.param == "regex"
    with pytest.raises(BadRequestError):
        constraint_fields({"regex": "a", "ebnf": 'root ::= "a"', "json_schema": None})
