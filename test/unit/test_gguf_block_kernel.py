"""The JIT block kernel (`cpu_kernels.gguf_gemm`): a few rows times a weight in its GGUF blocks.

- On every ISA tier this CPU runs (AVX2 intrinsics, the portable loop): the weight it applies
  (an identity matrix through it) is gguf's own dequantization, bit for bit, for Q4_0, Q4_1 and
  Q8_0; products of 1..9 rows (its row tiles of 4 and every remainder) and strided or bf16 x
  agree with x @ W^T.
- Bad input raises ValueError naming what is wrong.
- `GGUFInt4Linear.use_block_kernel` switches a layer to it and frees the int4 copy; a layer
  whose shards mix types keeps no blocks. `GGUFBlockLinear` (the LM head) runs it below
  `dense_from_rows` and its dense weight from there. `setup_int4_dispatch` picks per shape the
  faster few-row kernel for all layers of it, and calibrates the head.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from hiserve.jit_kernel import cpu as cpu_kernels
from hiserve.layers.quantization import (GGUFBlockLinear, GGUFInt4Linear, GGUFQuantizedTensor,
                                         setup_int4_dispatch)
from hiserve.layers.quantization import int4_dispatch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

QTYPES = ("Q4_0", "Q4_1", "Q8_0")


@pytest.fixture(autouse=True)
def _kernels_built():
    """In the test, not at collection: building the module there would cost every run that
    deselects these tests (e.g. `-m cuda` on a GPU host) a compile."""
    if not cpu_kernels.can_use_cpu_kernels():
        pytest.skip("JIT CPU kernels do not build here")


def _tensor(qtype: str, n: int, k: int, seed: int = 0) -> tuple[GGUFQuantizedTensor, torch.Tensor]:
    """Random weights quantized by gguf, and gguf's dequantization of them (float32 [n, k])."""
    rng = np.random.default_rng(seed)
    w = (rng.normal(size=(n, k)) + rng.normal(size=(n, 1))).astype(np.float32)
    data = quantize(w, GGMLQuantizationType[qtype]).reshape(n, -1)
    ref = torch.from_numpy(np.array(dequantize(data, GGMLQuantizationType[qtype]))).reshape(n, k)
    return GGUFQuantizedTensor(qtype, data, (n, k)), ref


def _run(mod, x: torch.Tensor, blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    out = x.new_empty((x.shape[0], blocks.shape[0]))
    mod.gguf_gemm(x, blocks, out, cpu_kernels.GGUF_BLOCK_TYPES[qtype][0], 2)
    return out


@pytest.mark.parametrize("isa", cpu_kernels.runnable_isas())
@pytest.mark.parametrize("qtype", QTYPES)
def test_kernel_applies_ggufs_weights_exactly_on_every_tier(isa, qtype):
    mod = cpu_kernels.load_cpu_module(isa)
    t, ref = _tensor(qtype, 48, 96)
    blocks = torch.from_numpy(t.data)
    assert torch.equal(_run(mod, torch.eye(96), blocks, qtype).t(), ref)
    gen = torch.Generator().manual_seed(1)
    for rows in range(1, 10):  # row tiles of 4 and remainders 1, 2, 3
        x = torch.randn(rows, 96, generator=gen)
        torch.testing.assert_close(_run(mod, x, blocks, qtype), x @ ref.t(), rtol=1e-5, atol=1e-4)
    wide = torch.randn(5, 160, generator=gen)
    x = wide[:, 32:128]  # strided rows
    torch.testing.assert_close(_run(mod, x, blocks, qtype), x @ ref.t(), rtol=1e-5, atol=1e-4)
    xb = x.to(torch.bfloat16)  # bf16 in: float32 math, the output rounded once
    got = _run(mod, xb, blocks, qtype)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, (xb.float() @ ref.t()).to(torch.bfloat16), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("isa", cpu_kernels.runnable_isas())
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("k", (96, 160, 576))  # 3, 5, 18 blocks
def test_bf16_activations_apply_ggufs_weights_exactly(isa, qtype, k):
    """bf16 x (the default model dtype on CPUs with native bf16): a one-hot x must give gguf's
    d * q + m rounded once to bf16 on every tier (Q8_0 on the AVX-512 tiers scales q . x per
    block, where the AVX2 path forms d * q first), and random x must agree with x @ W^T."""
    mod = cpu_kernels.load_cpu_module(isa)
    t, ref = _tensor(qtype, 40, k)
    blocks = torch.from_numpy(t.data)
    assert torch.equal(_run(mod, torch.eye(k, dtype=torch.bfloat16), blocks, qtype).t(), ref.to(torch.bfloat16))
    gen = torch.Generator().manual_seed(2)
    for rows in (1, 2, 3, 4, 5, 9, 33):  # row tiles of 4, remainders, a second row block of 32
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        want = x.float() @ ref.t()
        got = _run(mod, x, blocks, qtype)
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=2e-2 * want.abs().max().item())
    wide = torch.randn(3, k + 64, generator=gen).to(torch.bfloat16)[:, 32:32 + k]  # strided rows
    torch.testing.assert_close(_run(mod, wide, blocks, qtype).float(), wide.float() @ ref.t(), rtol=1e-2, atol=0.5)


def test_kernel_rejects_bad_input():
    t, _ = _tensor("Q4_1", 16, 64)
    blocks = torch.from_numpy(t.data)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="takes"):
        cpu_kernels.gguf_gemm(x, blocks, "Q6_K")
    with pytest.raises(ValueError, match="blocks rows must hold"):
        cpu_kernels.gguf_gemm(torch.randn(2, 96), blocks, "Q4_1")
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_kernels.gguf_gemm(x.half(), blocks, "Q4_1")
    with pytest.raises(ValueError, match="contiguous uint8"):
        cpu_kernels.gguf_gemm(x, blocks.view(torch.int8), "Q4_1")
    with pytest.raises(ValueError, match="contiguous rows"):
        cpu_kernels.gguf_gemm(x.t().contiguous().t(), blocks, "Q4_1")


def _int4_layer(qtypes=("Q4_1",), n: int = 64, k: int = 96, dtype=torch.float32, dense_copy: bool = True):
    layer = GGUFInt4Linear(k, n * len(qtypes), bias=False, dtype=dtype, dense_copy=dense_copy)
    refs = []
    for i, q in enumerate(qtypes):
        t, ref = _tensor(q, n, k, seed=i)
        layer.load_rows(i * n, t)
        refs.append(ref)
    layer.finalize()
    return layer, torch.cat(refs)


def test_int4_layer_switches_to_the_block_kernel():
    layer, ref = _int4_layer(("Q4_1", "Q4_1"))
    assert layer.gguf_blocks is not None and layer.packed_weight is not None
    layer.use_block_kernel(True)
    assert layer.packed_weight is None and layer.scales_and_zeros is None  # the int4 copy is freed
    assert torch.equal(layer.effective_weight(), ref)
    x = torch.randn(3, 96)
    torch.testing.assert_close(layer(x), x @ ref.t(), rtol=1e-5, atol=1e-4)
    mixed, _ = _int4_layer(("Q4_0", "Q4_1"))  # one kernel call cannot read two block types
    assert mixed.gguf_blocks is None
    with pytest.raises(ValueError, match="mixed types"):
        mixed.use_block_kernel(True)
    kept, _ = _int4_layer()
    kept.use_block_kernel(False)
    assert kept.gguf_blocks is None and kept.packed_weight is not None


def test_block_linear_dispatches_by_rows():
    t, ref = _tensor("Q8_0", 64, 96)
    dense = ref.clone()
    head = GGUFBlockLinear(t, dense)
    assert head.dense_weight is dense  # the model's own weight, shared, not copied
    head.dense_from_rows = 4
    used = []
    block, full = head._matmul, head._dense_matmul
    head._matmul = lambda x: used.append("block") or block(x)
    head._dense_matmul = lambda x: used.append("dense") or full(x)
    for rows, want in ((1, "block"), (3, "block"), (4, "dense"), (9, "dense")):
        used.clear()
        x = torch.randn(rows, 96)
        torch.testing.assert_close(head(x), x @ ref.t(), rtol=1e-5, atol=1e-4)
        assert used == [want], rows
    with pytest.raises(ValueError, match="reads"):
        GGUFBlockLinear(GGUFQuantizedTensor("Q6_K", t.data, t.shape), dense)
    with pytest.raises(ValueError, match="disagree"):
        GGUFBlockLinear(t, dense[:32])


def test_block_linear_takes_the_packed_head_after_a_tied_parameter():
    """`pack_for_cpu` swaps the oneDNN-packed head in for the tied embedding (a Parameter):
    nn.Module refused that once the Parameter was registered under the head, so `make serve`
    failed at start on every CPU that packs bf16 (AMX, AVX512-BF16)."""
    from hiserve.layers.linear import PackedLinear

    t, ref = _tensor("Q8_0", 64, 96)
    embedding = nn.Parameter(ref.clone(), requires_grad=False)
    head = GGUFBlockLinear(t, embedding)
    assert head.dense_weight is embedding
    assert not list(head.parameters())  # the model owns the embedding, the head only uses it
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this PyTorch build has no oneDNN (mkldnn): nothing to pack")
    packed = PackedLinear(ref.clone(), None)  # float32: oneDNN packs it on every x86 tier
    head.set_dense_weight(packed)
    assert head.dense_weight is packed and head.dtype == torch.float32
    head.dense_from_rows = 1
    x = torch.randn(5, 96)
    torch.testing.assert_close(head(x), x @ ref.t(), rtol=1e-4, atol=1e-3)
    with pytest.raises(ValueError, match="disagree"):
        head.set_dense_weight(ref[:32])


def test_setup_picks_one_few_row_kernel_per_shape_and_calibrates_the_head(monkeypatch):
    layers = [_int4_layer(n=64, k=96)[0] for _ in range(3)] + [_int4_layer(n=32, k=64)[0]]
    head = GGUFBlockLinear(*_tensor("Q8_0", 128, 96))
    model = nn.ModuleList([*layers, head])
    report = setup_int4_dispatch(model)
    assert set(report.block_kernel) == {(64, 96), (32, 64)}
    for shape, (chosen, block_us, int4_us) in report.block_kernel.items():
        assert chosen == (block_us <= int4_us)
        for layer in layers:
            if (layer.out_features, layer.in_features) == shape:  # the whole shape follows one choice
                assert (layer.gguf_blocks is not None) == chosen and (layer.packed_weight is None) == chosen
    assert report.head is not None
    crossover, timings = report.head
    if crossover == 1:  # dense won at one row: the blocks are freed
        assert head.gguf_blocks is None and head.dense_from_rows == 0
    else:  # rows past the last timed take the dense weight
        assert timings and head.dense_from_rows == (crossover if crossover is not None else 65)
    assert "LM head: " in report.describe()
    # Forced choices: each kernel wins once.
    for block_wins in (True, False):
        group = [_int4_layer()[0] for _ in range(2)]
        monkeypatch.setattr(int4_dispatch, "_medians_us", lambda *a, **k: (1.0, 2.0) if block_wins else (2.0, 1.0))
        assert int4_dispatch.choose_few_row_kernel(group)[0] is block_wins
        assert all((m.gguf_blocks is not None) == block_wins for m in group)


def test_head_whose_dense_weight_wins_at_one_row_frees_its_blocks(monkeypatch):
    head = GGUFBlockLinear(*_tensor("Q8_0", 64, 96))
    monkeypatch.setattr(int4_dispatch, "_medians_us", lambda *a, **k: (2.0, 1.0))  # dense always faster
    report = setup_int4_dispatch(nn.ModuleList([head]))
    assert report.head[0] == 1 and head.gguf_blocks is None and head.dense_from_rows == 0
    assert "LM head: dense" in report.describe()
    x = torch.randn(2, 96)
    torch.testing.assert_close(head(x), x @ head.dense_weight.t())


def test_without_cpu_kernels_no_blocks_are_kept(monkeypatch):
    """Where the kernels cannot build, no layer stages the file's blocks (no second copy)."""
    monkeypatch.setattr(cpu_kernels, "can_use_cpu_kernels", lambda: False)
    layer, ref = _int4_layer()
    assert layer.gguf_blocks is None
    report = setup_int4_dispatch(nn.ModuleList([layer]))
    assert report.block_kernel == {} and layer.gguf_blocks is None and layer.packed_weight is not None


def test_use_block_kernel_refuses_what_it_cannot_do():
    layer = GGUFInt4Linear(96, 64, bias=False, dtype=torch.float32)
    with pytest.raises(ValueError, match="before finalize"):
        layer.use_block_kernel(True)
    layer, _ = _int4_layer()
    layer.use_block_kernel(True)
    with pytest.raises(ValueError, match="int4 copy was freed"):
        layer.use_block_kernel(False)


@pytest.mark.parametrize("isa", cpu_kernels.runnable_isas())
def test_special_fp16_scales_on_every_tier(isa):
    """Scales gguf's quantizer rarely writes: subnormal, -0, the largest fp16 (65504), negative:
    the portable tier's bit-level fp16 conversion and F16C's agree with gguf's dequantizer."""
    scales = np.array([2.0**-24, 3 * 2.0**-20, -0.0, 65504.0, -0.5, 1.0], dtype=np.float16)
    rng = np.random.default_rng(3)
    for qtype, size in (("Q4_0", 18), ("Q4_1", 20), ("Q8_0", 34)):
        raw = rng.integers(0, 256, size=(len(scales), 2, size), dtype=np.uint8)
        raw[:, :, 0:2] = scales.view(np.uint8).reshape(-1, 1, 2)
        if qtype == "Q4_1":
            raw[:, :, 2:4] = np.array([-0.25], dtype=np.float16).view(np.uint8).reshape(1, 1, 2)
        data = raw.reshape(len(scales), -1)
        ref = torch.from_numpy(np.array(dequantize(data, GGMLQuantizationType[qtype]))).reshape(len(scales), 64)
        got = _run(cpu_kernels.load_cpu_module(isa), torch.eye(64), torch.from_numpy(data), qtype).t()
        assert torch.equal(got, ref), (isa, qtype)


def test_pack_for_cpu_keeps_the_gguf_head_on_the_packed_weight(monkeypatch):
    """The crash `make serve` hit at start on AMX / AVX512-BF16 CPUs, on any CPU: a tied Llama
    with a Q8_0 block head, then `pack_for_cpu` (forced here, float32, which oneDNN packs on
    every x86 tier): the head's many-row calls must take the packed copy and agree with it."""
    from hiserve.models import llama as llama_mod
    from hiserve.models.model_config import ModelConfig

    cfg = ModelConfig.from_hf_config({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 128,
        "vocab_size": 96, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": True})
    model = llama_mod.LlamaForCausalLM(cfg, torch.float32).eval()
    assert model.lm_head is None
    t, ref = _tensor("Q8_0", 96, 64)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(ref)
    model.set_gguf_head(t)
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this PyTorch build has no oneDNN (mkldnn): nothing to pack")
    monkeypatch.setattr(llama_mod, "can_pack_for_cpu", lambda device, dtype: True)
    assert model.pack_for_cpu()
    head = model.lm_head_weight
    assert head is model.gguf_head and head.dense_weight is model.packed_lm_head
    head.dense_from_rows = 4
    for rows in (1, 6):  # block kernel, then the packed dense weight
        x = torch.randn(rows, 64)
        torch.testing.assert_close(head(x), x @ ref.t(), rtol=1e-4, atol=1e-3)
