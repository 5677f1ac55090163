"""Dummy model folders (`hiserve.testing.dummy_model`) and `--load-format dummy` weights, on CPU."""

from __future__ import annotations

import argparse

import pytest
import torch
from transformers import AutoTokenizer

from hiserve.models.dummy_weights import dummy_std
from hiserve.models.loader import get_model_class, load_model
from hiserve.models.model_config import ModelConfig
from hiserve.server_args import ServerArgs
from hiserve.testing.dummy_model import (
    BOS_ID,
    EOS_ID,
    SHAPES,
    SPECIAL_TOKENS,
    hf_config,
    word_ids_text,
    write_dummy_model,
)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return write_dummy_model(str(tmp_path_factory.mktemp("tiny_llama")), "tiny-llama")


def test_tokenizer_covers_every_id_and_round_trips(tiny_llama):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    vocab = hf_config("tiny-llama")["vocab_size"]
    assert len(tok) == vocab
    assert (tok.bos_token_id, tok.eos_token_id) == (BOS_ID, EOS_ID)
    ids = list(range(len(SPECIAL_TOKENS), vocab))
    text = tok.decode(ids)
    assert text == word_ids_text(ids)
    assert tok.encode(text, add_special_tokens=False) == ids
    assert tok.encode("w10 w11") == [BOS_ID, 10, 11]  # bos in front, as the server encodes prompts
    assert tok.decode([BOS_ID, 10, EOS_ID], skip_special_tokens=True) == "w10"
    assert tok.encode("not-a-word", add_special_tokens=False) == [tok.unk_token_id]


def test_chat_template(tiny_llama):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    ids = tok.apply_chat_template([{"role": "system", "content": "w9"}, {"role": "user", "content": "w7 w8"}],
                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    roles = tok.convert_tokens_to_ids(["<|system|>", "<|user|>", "<|assistant|>"])
    assert list(ids) == [BOS_ID, roles[0], 9, roles[1], 7, 8, roles[2]]


def test_unknown_shape():
    with pytest.raises(ValueError, match="unknown dummy model shape"):
        hf_config("llama-1t")


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_shape_builds(shape):
    """The real shapes' configs parse and build (on the meta device: no memory)."""
    cfg = ModelConfig.from_hf_config(hf_config(shape))
    with torch.device("meta"):
        model = get_model_class(cfg.architecture)(cfg, torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    if shape == "llama3-8b":
        assert 8.0e9 < params < 8.1e9, params  # Llama-3-8B: 8.03 B
    for name, p in model.named_parameters():
        std = dummy_std(name, tuple(p.shape))
        assert std is None or 0 < std <= 1.0, (name, std)


def test_dummy_weights_are_seeded_and_finite(tmp_path):
    for shape in ("tiny-llama", "tiny-mla"):
        path = write_dummy_model(str(tmp_path / shape), shape)
        a, cfg = load_model(path, torch.float32, "cpu", load_format="dummy", seed=1)
        b, _ = load_model(path, torch.float32, "cpu", load_format="dummy", seed=1)
        c, _ = load_model(path, torch.float32, "cpu", load_format="dummy", seed=2)
        pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
        for name, p in pa.items():
            assert torch.equal(p, pb[name]), name
            assert torch.isfinite(p).all(), name
            if p.dim() >= 2:
                assert not torch.equal(p, pc[name]), name
                assert p.float().std() > 0, name
            elif "norm" in name:
                assert torch.equal(p, torch.ones_like(p)), name
        assert hasattr(a.model.layers[0].mlp if shape == "tiny-llama" else a.model.layers[1].mlp,
                       "gate_up_proj" if shape == "tiny-llama" else "experts")


def test_load_format_default_seed_follows_manual_seed(tiny_llama):
    torch.manual_seed(5)
    a, _ = load_model(tiny_llama, torch.float32, "cpu", load_format="dummy")
    torch.manual_seed(5)
    b, _ = load_model(tiny_llama, torch.float32, "cpu", load_format="dummy")
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)


def test_unknown_load_format(tiny_llama):
    with pytest.raises(ValueError, match="unknown load format"):
        load_model(tiny_llama, torch.float32, "cpu", load_format="pt")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(tiny_llama, torch.float32, "cpu")  # auto: a dummy folder has no weights


def test_cli_flag():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(["--load-format", "dummy"]))
    assert args.load_format == "dummy"
    assert ServerArgs().load_format == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--load-format", "npz"])


@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-mla"])
def test_served_logits_are_finite_and_spread(tmp_path, shape):
    """Through the real Scheduler/ModelRunner (`--load-format dummy`): a prefill's logits are
    finite, O(1) and not flat, and greedy decoding does not collapse onto one token."""
    from hiserve.engine.io_struct import TokenizedGenerateReqInput
    from hiserve.engine.sampling_params import SamplingParams
    from hiserve.engine.scheduler import Scheduler

    path = write_dummy_model(str(tmp_path / shape), shape)
    sched = Scheduler(ServerArgs(model_path=path, load_format="dummy", dtype="float32", device="cpu").resolve(),
                      None)
    sp = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    sched.add_request(TokenizedGenerateReqInput(rid="r", input_ids=list(range(10, 90)), sampling_params=sp))
    batch = sched.get_next_batch_to_run()
    logits = sched.model_runner.forward(batch)
    assert torch.isfinite(logits).all()
    assert 0.1 < logits.std().item() < 10.0, logits.std()
    sched.process_prefill_result(batch, logits)
    while sched.running:
        sched.step()
    (req_out,) = {id(r): r for r in [batch.reqs[0]]}.values()
    assert len(req_out.output_ids) == 16
    assert len(set(req_out.output_ids)) > 4, req_out.output_ids
