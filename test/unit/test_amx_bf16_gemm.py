"""The dense bf16 AMX GEMM (`cpu_amx.amx_bf16_pack` / `amx_bf16_gemm`) and `AmxLinear`.

- Everywhere: the packing puts W[32 s + 16 h + f, 32 kb + 2 r + p] at [s, kb, 512 h + 32 r + 2 f + p]
  (every element checked) and refuses weights it cannot take; `prepack_linear` keeps oneDNN where
  AMX is off.
- On an AMX CPU: products of 1..257 rows (one 16-row tile, two, full 32-row blocks, the tail
  under its own tile shape, several row chunks) and shapes with one strip or many agree with x @ W^T
  to bf16 rounding; every output element is written (NaN-filled outputs) under every thread grid
  (strips split, then rows too when strips are fewer than threads); an identity through it
  returns W bit for bit (each sum is one product of normal values); strided rows; a bias added in
  float32 before the one rounding (as oneDNN's); N-D input through `AmxLinear`; a Llama's
  projections and head after `pack_for_cpu`; bad input (ValueError in Python, RuntimeError from
  the C++ checks).
"""

from __future__ import annotations

import pytest
import torch

from hiserve.jit_kernel import cpu as cpu_kernels
from hiserve.jit_kernel.cpu_amx import amx_bf16_gemm, amx_bf16_pack, amx_bf16_packable
from hiserve.layers import linear as linear_mod
from hiserve.layers.linear import AmxLinear, PackedLinear, can_pack_for_cpu, prepack_linear


def _close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y (bf16) against float32 x @ W^T: within one bf16 rounding of the result plus the
    float32 summation-order difference."""
    ref = x.float() @ w.float().t()
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    torch.testing.assert_close(y.float(), ref, rtol=2 ** -7, atol=1e-3 * x.shape[1] ** 0.5)


def test_pack_layout_everywhere():
    n, k = 64, 96
    w = (torch.randn(n, k) * 10).bfloat16()
    p = amx_bf16_pack(w)
    assert p.shape == (n // 32, k // 32, 1024) and p.dtype == torch.bfloat16
    s, kb, h, r, f, q = torch.meshgrid(*(torch.arange(m) for m in (n // 32, k // 32, 2, 16, 16, 2)), indexing="ij")
    expected = w[32 * s + 16 * h + f, 32 * kb + 2 * r + q]  # [s, kb, h, r, f, q]
    assert torch.equal(p.view(n // 32, k // 32, 2, 16, 16, 2), expected)


@pytest.mark.parametrize("shape", [(48, 32), (32, 48), (32, 32, torch.float32)])
def test_pack_refuses(shape):
    dtype = shape[2] if len(shape) > 2 else torch.bfloat16
    w = torch.zeros(shape[0], shape[1], dtype=dtype)
    assert not amx_bf16_packable(w)
    with pytest.raises(ValueError, match="multiples of 32"):
        amx_bf16_pack(w)


@pytest.mark.parametrize("rows", [1, 7, 16, 17, 31, 32, 33, 64, 100, 200, 257])
@pytest.mark.parametrize("nk", [(32, 32), (64, 96), (960, 576), (576, 1536)])
def test_gemm_matches_matmul(amx, rows, nk):
    gen = torch.Generator().manual_seed(rows * 7 + nk[0])
    w = torch.randn(*nk, generator=gen).bfloat16()
    x = torch.randn(rows, nk[1], generator=gen).bfloat16()
    _close(amx_bf16_gemm(x, amx_bf16_pack(w)), x, w)


def test_many_row_chunks(amx):
    """K = 1536: 160 rows a chunk (512 KiB of x), so 700 rows take five chunks and a tail."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(64, 1536, generator=gen).bfloat16()
    x = torch.randn(700, 1536, generator=gen).bfloat16()
    _close(amx_bf16_gemm(x, amx_bf16_pack(w)), x, w)


def test_identity_gives_the_weight_exactly(amx):
    w = (torch.randn(96, 64) * 3).bfloat16()
    eye = torch.eye(64, dtype=torch.bfloat16)
    assert torch.equal(amx_bf16_gemm(eye, amx_bf16_pack(w)), w.t().contiguous())


def test_strided_rows_and_threads(amx):
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(45, 700, generator=gen).bfloat16()
    x = base[:, 50:626]  # rows 700 apart, each contiguous
    w = torch.randn(96, 576, generator=gen).bfloat16()
    p = amx_bf16_pack(w)
    y = amx_bf16_gemm(x, p)
    _close(y, x, w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(amx_bf16_gemm(x, p), y)  # a strip's sums do not depend on the split
    finally:
        torch.set_num_threads(threads)


def test_bad_input(amx):
    p = amx_bf16_pack(torch.randn(32, 64).bfloat16())
    with pytest.raises(ValueError, match="bfloat16"):
        amx_bf16_gemm(torch.randn(4, 64), p)
    with pytest.raises(ValueError, match="K = 32"):
        amx_bf16_gemm(torch.randn(4, 32).bfloat16(), p)
    with pytest.raises(ValueError, match="contiguous rows"):
        amx_bf16_gemm(torch.randn(64, 4).bfloat16().t(), p)
    with pytest.raises(ValueError, match="packed must be"):
        amx_bf16_gemm(torch.randn(4, 64).bfloat16(), p.float())
    with pytest.raises(ValueError, match="bias"):
        amx_bf16_gemm(torch.randn(4, 64).bfloat16(), p, torch.zeros(32, dtype=torch.bfloat16))
    module = cpu_kernels.load_cpu_module()
    x, out, nob = torch.randn(4, 64).bfloat16(), torch.empty(4, 32, dtype=torch.bfloat16), torch.empty(0)
    with pytest.raises(RuntimeError, match="packed"):
        module.amx_bf16_gemm(x, p.reshape(1, 4, 512), nob, out, 2)  # the C++ side checks what it indexes by
    with pytest.raises(RuntimeError, match="shapes disagree"):
        module.amx_bf16_gemm(x, p, nob, torch.empty(4, 64, dtype=torch.bfloat16), 2)
    with pytest.raises(RuntimeError, match="bias"):
        module.amx_bf16_gemm(x, p, torch.zeros(31), out, 2)


@pytest.mark.parametrize("threads", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("rows", [1, 20, 40, 200])
@pytest.mark.parametrize("n", [64, 576])
def test_thread_grid_writes_every_element(amx, threads, rows, n):
    """The raw binding with a thread count of its own (more threads than strips splits rows too),
    into an output filled with NaN: every element written, all agree with x @ W^T."""
    gen = torch.Generator().manual_seed(threads * 1000 + rows + n)
    w = torch.randn(n, 96, generator=gen).bfloat16()
    x = torch.randn(rows, 96, generator=gen).bfloat16()
    out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16)
    cpu_kernels.load_cpu_module().amx_bf16_gemm(x, amx_bf16_pack(w), torch.empty(0), out, threads)
    assert not out.isnan().any()
    _close(out, x, w)


def test_bias_is_added_before_the_rounding(amx):
    """With a bias 100x the products, adding it after rounding the sum to bf16 (twice rounded)
    matched the once-rounded float32 result for ~92% of outputs; added in float32 first, all
    but near-ties match (the summation order differs from torch's)."""
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(64, 96, generator=gen).bfloat16()
    b = (torch.randn(64, generator=gen) * 100).bfloat16()
    x = torch.randn(300, 96, generator=gen).bfloat16()
    y = AmxLinear(w, b)(x)
    once = (x.float() @ w.float().t() + b.float()).bfloat16()
    assert (y == once).float().mean() > 0.99


def test_choice_without_amx(monkeypatch):
    """On any CPU: where the AMX GEMM is unavailable, `prepack_linear` packs for oneDNN."""
    if not can_pack_for_cpu(torch.device("cpu"), torch.bfloat16):
        pytest.skip("no oneDNN bf16 pack on this CPU")
    monkeypatch.setattr(linear_mod, "amx_gemm_available", lambda: False)
    linear_mod._amx_dense_on.cache_clear()
    try:
        assert type(prepack_linear(torch.randn(64, 96).bfloat16(), None)) is PackedLinear
    finally:
        linear_mod._amx_dense_on.cache_clear()


def test_llama_projections_after_pack_for_cpu(amx):
    """A bf16 Llama (every projection and the tied head 32-aligned): `pack_for_cpu` gives each an
    `AmxLinear` whose output matches the unpacked weight's, 2-D and 3-D input."""
    from hiserve.models import llama as llama_mod
    from hiserve.models.model_config import ModelConfig

    cfg = ModelConfig.from_hf_config({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 128,
        "vocab_size": 96, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": True})
    torch.manual_seed(0)
    model = llama_mod.LlamaForCausalLM(cfg, torch.bfloat16).eval()
    with torch.no_grad():
        for prm in model.parameters():
            prm.normal_(0, 0.5)
    linears = {name: m.weight.detach().clone() for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    head = model.model.embed_tokens.weight.detach().clone()
    assert len(linears) == 8 and model.pack_for_cpu()
    modules = dict(model.named_modules())
    for name, w in linears.items():
        layer = modules[name]
        assert isinstance(layer, AmxLinear), name
        x = torch.randn(3, 5, w.shape[1]).bfloat16()
        y = layer(x)
        assert y.shape == (3, 5, w.shape[0])
        _close(y.reshape(15, -1), x.reshape(15, -1), w)
    assert isinstance(model.packed_lm_head, AmxLinear)
    x = torch.randn(7, 64).bfloat16()
    _close(model.packed_lm_head(x), x, head)


def test_amx_linear_and_choice(amx, monkeypatch):
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(64, 96, generator=gen).bfloat16()
    b = torch.randn(64, generator=gen).bfloat16()
    x = torch.randn(40, 96, generator=gen).bfloat16()
    layer = prepack_linear(w, b)
    assert isinstance(layer, AmxLinear) and layer.packed_weight.dtype == torch.bfloat16
    torch.testing.assert_close(layer(x).float(), (x.float() @ w.float().t() + b.float()), rtol=2 ** -7, atol=0.05)
    if can_pack_for_cpu(torch.device("cpu"), torch.bfloat16):  # oneDNN's form agrees to bf16 rounding
        torch.testing.assert_close(layer(x).float(), PackedLinear(w, b)(x).float(), rtol=2 ** -7, atol=0.05)
    assert not isinstance(prepack_linear(torch.randn(48, 96).bfloat16(), None), AmxLinear)  # N % 32 != 0
    monkeypatch.setenv("HISERVE_AMX_DENSE", "0")
    linear_mod._amx_dense_on.cache_clear()
    try:
        assert type(prepack_linear(w, None)) is PackedLinear
    finally:
        monkeypatch.delenv("HISERVE_AMX_DENSE")
        linear_mod._amx_dense_on.cache_clear()
