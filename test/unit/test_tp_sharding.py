"""Tensor-parallel sharding at load time, in one process (no collectives run while building
and loading): each rank's dummy weights are the slices of TP=1's, and a checkpoint loaded
through the parallel layers' weight loaders gives the same slices (tiny Llama with one KV
head for two ranks, tiny MLA with MoE)."""

from __future__ import annotations

import pytest
import torch

from hiserve.distributed import parallel_state
from hiserve.distributed.parallel_state import TPGroup
from hiserve.models.loader import load_model
from hiserve.testing.dummy_model import write_dummy_model


@pytest.fixture(autouse=True)
def _restore_group():
    yield
    parallel_state._GROUP = TPGroup()


def _as_rank(rank: int, size: int = 2) -> None:
    parallel_state._GROUP = TPGroup(rank=rank, size=size)


def _build(path: str, rank: int | None) -> dict[str, torch.Tensor]:
    if rank is None:
        parallel_state._GROUP = TPGroup()
    else:
        _as_rank(rank)
    model, _ = load_model(path, torch.float32, "cpu", load_format="dummy", seed=3)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return write_dummy_model(str(tmp_path_factory.mktemp("tp_llama")), "tiny-llama")


@pytest.fixture(scope="module")
def tiny_mla(tmp_path_factory) -> str:
    return write_dummy_model(str(tmp_path_factory.mktemp("tp_mla")), "tiny-mla")


@pytest.mark.parametrize("rank", [0, 1])
def test_llama_dummy_shards_are_slices_of_tp1(tiny_llama, rank):
    full, part = _build(tiny_llama, None), _build(tiny_llama, rank)
    L = "model.layers.1"
    qkv = full[f"{L}.self_attn.qkv_proj.weight"]  # [q 128 | k 64 | v 64, 128]: 2 heads, 1 KV head
    want = torch.cat([qkv[rank * 64:(rank + 1) * 64], qkv[128:192], qkv[192:256]])  # KV head replicated
    assert torch.equal(part[f"{L}.self_attn.qkv_proj.weight"], want)
    o = full[f"{L}.self_attn.o_proj.weight"]
    assert torch.equal(part[f"{L}.self_attn.o_proj.weight"], o[:, rank * 64:(rank + 1) * 64])
    gu = full[f"{L}.mlp.gate_up_proj.weight"]  # [gate 256 | up 256, 128]
    assert torch.equal(part[f"{L}.mlp.gate_up_proj.weight"],
                       torch.cat([gu[rank * 128:(rank + 1) * 128], gu[256 + rank * 128:256 + (rank + 1) * 128]]))
    down = full[f"{L}.mlp.down_proj.weight"]
    assert torch.equal(part[f"{L}.mlp.down_proj.weight"], down[:, rank * 128:(rank + 1) * 128])
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(part[name], full[name][rank * 256:(rank + 1) * 256])
    assert torch.equal(part[f"{L}.input_layernorm.weight"], full[f"{L}.input_layernorm.weight"])


@pytest.mark.parametrize("rank", [0, 1])
def test_mla_dummy_shards_are_slices_of_tp1(tiny_mla, rank):
    full, part = _build(tiny_mla, None), _build(tiny_mla, rank)
    A = "model.layers.1.self_attn"
    # 4 heads: 2 per rank; q_b rows per head 32 (nope 16 + rope 16), kv_b rows per head 32 (nope 16 + v 16)
    assert torch.equal(part[f"{A}.q_b_proj.weight"], full[f"{A}.q_b_proj.weight"][rank * 64:(rank + 1) * 64])
    assert torch.equal(part[f"{A}.kv_b_proj.weight"], full[f"{A}.kv_b_proj.weight"][rank * 64:(rank + 1) * 64])
    assert torch.equal(part[f"{A}.o_proj.weight"], full[f"{A}.o_proj.weight"][:, rank * 32:(rank + 1) * 32])
    for name in ("q_a_proj.weight", "kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight"):  # the latent: whole
        assert torch.equal(part[f"{A}.{name}"], full[f"{A}.{name}"]), name
    E = "model.layers.1.mlp.experts"
    gu, down = full[f"{E}.gate_up_proj"], full[f"{E}.down_proj"]  # [4, 2*32, 64], [4, 64, 32]
    s = slice(rank * 16, (rank + 1) * 16)
    assert torch.equal(part[f"{E}.gate_up_proj"], torch.cat([gu[:, s], gu[:, 32:][:, s]], dim=1))
    assert torch.equal(part[f"{E}.down_proj"], down[:, :, s])
    assert torch.equal(part["model.layers.1.mlp.gate.weight"], full["model.layers.1.mlp.gate.weight"])


def _hf_llama(full: dict[str, torch.Tensor]):
    """TP=1 parameters under checkpoint names (q/k/v and gate/up separate)."""
    for name, t in full.items():
        if ".qkv_proj." in name:
            for frag, part in zip(("q_proj", "k_proj", "v_proj"), t.split([128, 64, 64])):
                yield name.replace("qkv_proj", frag), part
        elif ".gate_up_proj." in name:
            for frag, part in zip(("gate_proj", "up_proj"), t.chunk(2)):
                yield name.replace("gate_up_proj", frag), part
        else:
            yield name, t


def _hf_mla(full: dict[str, torch.Tensor]):
    """TP=1 parameters under checkpoint names: dense gate/up split, routed experts per expert."""
    for name, t in full.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2)
                yield name.replace("gate_up_proj", f"{e}.gate_proj.weight"), gate
                yield name.replace("gate_up_proj", f"{e}.up_proj.weight"), up
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                yield name.replace("down_proj", f"{e}.down_proj.weight"), t[e]
        elif ".gate_up_proj." in name:
            for frag, part in zip(("gate_proj", "up_proj"), t.chunk(2)):
                yield name.replace("gate_up_proj", frag), part
        else:
            yield name, t


@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-mla"])
def test_checkpoint_loads_as_the_same_slices(tiny_llama, tiny_mla, shape):
    """A TP=1 checkpoint loaded at rank 1 of 2 (real load path, weight loaders) equals rank 1's dummy shard."""
    path = tiny_llama if shape == "tiny-llama" else tiny_mla
    full = _build(path, None)
    want = _build(path, 1)
    model, _ = load_model(path, torch.float32, "cpu", load_format="dummy", seed=99)  # still rank 1
    for p in model.parameters():
        p.data.zero_()
    model.load_weights((_hf_llama if shape == "tiny-llama" else _hf_mla)(full))
    got = dict(model.named_parameters())
    for name, t in want.items():
        assert torch.equal(got[name], t), name


def test_heads_that_cannot_be_split_are_refused(tiny_mla):
    _as_rank(0, size=3)  # 4 heads over 3 ranks
    with pytest.raises(ValueError, match="4 attention heads cannot be split evenly over --tp-size 3"):
        load_model(tiny_mla, torch.float32, "cpu", load_format="dummy", seed=1)
