"""The CPU kernels for RMSNorm (+ residual), rotary (NeoX, interleaved, partial) and SiLU-and-mul
against their torch forms in hiserve/layers, float32 and bfloat16, and the layers' dispatch to
them. The kernels round where the torch forms round, so bf16 results agree to within one bf16
rounding of the final value (the kernel multiplies in float32 and rounds once)."""

from __future__ import annotations

import pytest
import torch

from hiserve.jit_kernel import cpu as cpu_kernels
from hiserve.layers.activations import SiluAndMul, silu_and_mul_reference
from hiserve.layers.norms import RMSNorm, rmsnorm_reference
from hiserve.layers.rotary import RotaryEmbedding, rotary_reference

pytestmark = pytest.mark.skipif(not cpu_kernels.can_use_cpu_kernels(), reason="CPU kernels cannot be built here")
DTYPES = [torch.float32, torch.bfloat16]


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:  # one bf16 ulp (2^-8 relative) of the result
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=2 ** -7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_rmsnorm_and_fused_residual(dtype, tokens):
    torch.manual_seed(tokens)
    x, r = torch.randn(tokens, 576).to(dtype), torch.randn(tokens, 576).to(dtype)
    w = (1 + 0.1 * torch.randn(576)).to(dtype)
    assert_close(cpu_kernels.rmsnorm(x, w, 1e-5), rmsnorm_reference(x, w, 1e-5))
    out, res = cpu_kernels.rmsnorm(x, w, 1e-5, r)
    assert torch.equal(res, x + r)  # the residual sum rounds exactly as torch's add (no denormal sums here)
    assert_close(out, rmsnorm_reference(x + r, w, 1e-5))
    strided = torch.randn(tokens, 1000).to(dtype)[:, :576]  # a view with a row stride
    assert_close(cpu_kernels.rmsnorm(strided, w, 1e-5), rmsnorm_reference(strided, w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rotary_matches_reference(dtype, is_neox, rotary_dim):
    torch.manual_seed(rotary_dim)
    rope = RotaryEmbedding(64, 4096, 10000.0, rotary_dim=rotary_dim)
    positions = torch.randint(0, 4096, (37,))
    cos_sin = rope.get_cos_sin(positions)
    qkv = torch.randn(37, (9 + 3 + 3) * 64).to(dtype)
    qk = qkv[:, : 12 * 64].view(37, 12, 64)  # q and k heads of a fused QKV output, as llama.py passes
    got = cpu_kernels.rotary(qk, cos_sin[0], cos_sin[1], rotary_dim, is_neox)
    assert_close(got, rotary_reference(qk, cos_sin, rotary_dim, is_neox))
    if rotary_dim < 64:  # channels past rotary_dim are copied unchanged
        assert torch.equal(got[..., rotary_dim:], qk[..., rotary_dim:])


def test_interleaved_reference_is_neox_on_permuted_channels():
    """Pins the interleaved torch form itself: interleaving the channels turns it into NeoX."""
    rope = RotaryEmbedding(16, 64, 10000.0)
    cos_sin = rope.get_cos_sin(torch.arange(5))
    x = torch.randn(5, 2, 16)
    perm = torch.cat([torch.arange(0, 16, 2), torch.arange(1, 16, 2)])
    inter = rotary_reference(x, cos_sin, 16, is_neox=False)
    assert torch.allclose(inter[..., perm], rotary_reference(x[..., perm], cos_sin, 16), atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 64])
def test_silu_and_mul(dtype, tokens):
    x = (3 * torch.randn(tokens, 2 * 1536)).to(dtype)
    assert_close(cpu_kernels.silu_and_mul(x), silu_and_mul_reference(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_layers_dispatch_to_the_kernels(monkeypatch, dtype):
    """The layers call the kernels on CPU tensors in inference, and match their torch forms."""
    calls = []
    for name in ("rmsnorm", "rotary", "silu_and_mul"):
        fn = getattr(cpu_kernels, name)
        monkeypatch.setattr(cpu_kernels, name, lambda *a, _fn=fn, _n=name, **k: calls.append(_n) or _fn(*a, **k))
    norm = RMSNorm(64, dtype=dtype)
    x = torch.randn(3, 64).to(dtype)
    rope = RotaryEmbedding(16, 32, 10000.0)
    with torch.inference_mode():
        assert_close(norm(x), rmsnorm_reference(x, norm.weight, norm.eps))
        q = torch.randn(3, 4, 16).to(dtype)
        cs = rope.get_cos_sin(torch.arange(3))
        assert_close(rope.apply(q, cs), rotary_reference(q, cs, 16))
        assert_close(SiluAndMul()(x), silu_and_mul_reference(x))
    assert calls == ["rmsnorm", "rotary", "silu_and_mul"]
    with torch.enable_grad():  # autograd keeps the torch forms (the kernels have no backward)
        norm(x)
    assert calls == ["rmsnorm", "rotary", "silu_and_mul"]


@pytest.mark.parametrize("shape", [(16, 49152), (1, 1), (3, 7), (2, 33), (5, 100003)])
def test_argmax_matches_torch(shape):
    """Greedy sampling's kernel: random rows of every length around its 32-lane blocks."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[1]))
    assert torch.equal(cpu_kernels.argmax(x), x.argmax(-1))
    strided = torch.randn(shape[0], shape[1] + 5)[:, : shape[1]]  # rows apart, each contiguous
    assert torch.equal(cpu_kernels.argmax(strided), strided.argmax(-1))


def test_argmax_ties_infinities_and_nan_as_torch():
    x = torch.zeros(5, 1000)
    x[1, 5] = x[1, 900] = 1  # tie: the first
    x[2] = float("-inf")  # all -inf: index 0
    x[3, 10] = x[3, 20] = float("nan")  # NaN beats +inf, the first NaN
    x[3, 5] = float("inf")
    x[4, 999] = float("inf")  # in the tail past the last full block
    assert torch.equal(cpu_kernels.argmax(x), x.argmax(-1))
    assert cpu_kernels.argmax(x).tolist() == [0, 5, 0, 10, 999]
    with pytest.raises(ValueError, match="float32"):
        cpu_kernels.argmax(x.to(torch.bfloat16))


def assert_rounds_as(got: torch.Tensor, want: torch.Tensor) -> None:
    """assert_close, and in bf16 at most 1% of the elements off the reference's rounding (the
    kernels sum and take exp in another order, which moves a rare value across a rounding
    boundary; a wrong rounding rule, e.g. truncation or a missing intermediate rounding, moves
    far more), NaN where the reference has NaN."""
    assert torch.equal(got.isnan(), want.isnan())
    keep = ~want.isnan()
    assert_close(got[keep], want[keep])
    if want.dtype == torch.bfloat16:
        assert (got[keep] != want[keep]).float().mean().item() < 0.01


@pytest.mark.parametrize("isa", cpu_kernels.runnable_isas())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 100, 7])
def test_rmsnorm_and_silu_every_isa_tier(isa, dtype, hidden):
    """Each tier's own code (AVX-512: 16-lane rows with masked tails, rounding by VCVTNEPS2BF16
    where AVX512-BF16 has it, else by integer ops; AVX2: an 8-lane SiLU row, RMSNorm's scalar
    loop; baseline: the scalar loops) on widths with and without a tail, with a NaN in a row,
    on one thread and (64 x 576: above the kernels' grain size) on two."""
    mod = cpu_kernels.load_cpu_module(isa)
    torch.manual_seed(hidden)
    x, r = torch.randn(64, hidden).to(dtype), torch.randn(64, hidden).to(dtype)
    x[5, hidden // 2] = float("nan")  # its row's norm is NaN, as torch's
    w = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    out, res = torch.empty_like(x), torch.empty_like(x)
    g = (3 * torch.randn(64, 2 * hidden)).to(dtype)
    g[7, 0] = g[9, hidden] = float("nan")  # a NaN gate and a NaN up value
    for threads in (1, 2):
        mod.rmsnorm(x, r, w, out, res, True, 1e-5, threads)
        assert torch.equal(res.isnan(), (x + r).isnan()) and torch.equal(res.nan_to_num(), (x + r).nan_to_num())
        assert_rounds_as(out, rmsnorm_reference(x + r, w, 1e-5))
        mod.rmsnorm(x, x, w, out, out, False, 1e-5, threads)
        assert_rounds_as(out, rmsnorm_reference(x, w, 1e-5))
        s = torch.empty(64, hidden, dtype=dtype)
        mod.silu_and_mul(g, s, threads)
        assert_rounds_as(s, silu_and_mul_reference(g))
