"""Rotary position embedding (RoPE), NeoX style (the rotate-half form HF Llama uses).

The first `rotary_dim` channels of each head are split in two halves (x1, x2)
and rotated by angle pos * inv_freq[i]:  (x1*cos - x2*sin, x2*cos + x1*sin).
The interleaved (GPT-J) form pairs channels (2i, 2i+1) instead; `rotary_reference` and the
CPU kernel take both, the models here use NeoX.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from hiserve.jit_kernel import cpu as cpu_kernels
from hiserve.layers import triton_ops


def compute_inv_freq(rotary_dim: int, base: float, rope_scaling: dict | None) -> torch.Tensor:
    """Per-pair inverse frequencies [rotary_dim // 2], float32, scaling applied."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    if not rope_scaling:
        return inv_freq
    rope_type = rope_scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    if rope_type == "freq_factors":  # llama.cpp's rope_freqs tensor: divide each frequency
        factors = torch.tensor(rope_scaling["freq_factors"], dtype=torch.float32)
        if factors.numel() != inv_freq.numel():
            raise ValueError(f"rope freq_factors has {factors.numel()} entries, expected {inv_freq.numel()}")
        return inv_freq / factors
    raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: linear, llama3, freq_factors)")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths are slowed by `factor`, short ones kept,
    and the band between is interpolated linearly in 1/wavelength."""
    factor = float(s["factor"])
    low_ff = float(s.get("low_freq_factor", 1.0))
    high_ff = float(s.get("high_freq_factor", 4.0))
    old_ctx = float(s.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = old_ctx / low_ff  # wavelengths above this are scaled fully
    high_freq_wavelen = old_ctx / high_ff  # wavelengths below this are untouched
    smooth = ((old_ctx / wavelen) - low_ff) / (high_ff - low_ff)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, blended)
    return torch.where(wavelen < high_freq_wavelen, inv_freq, out)


def rotary_reference(
    x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], rotary_dim: int, is_neox: bool = True
) -> torch.Tensor:
    """The torch form of `RotaryEmbedding.apply` (CPU fallback, and the fused kernels' reference):
    x [T, heads, head_dim], cos/sin [T, 1, rotary_dim // 2] float32 -> rotated copy, x's dtype.
    is_neox=False: the interleaved form (pairs 2i, 2i+1)."""
    cos, sin = cos_sin
    half = rotary_dim // 2
    xf = x.float()
    if not is_neox:
        x1, x2 = xf[..., 0:rotary_dim:2], xf[..., 1:rotary_dim:2]
        rot = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        return torch.cat([rot, xf[..., rotary_dim:]], dim=-1).to(x.dtype)
    x1 = xf[..., :half]
    x2 = xf[..., half:rotary_dim]
    parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    if rotary_dim < x.shape[-1]:
        parts.append(xf[..., rotary_dim:])
    return torch.cat(parts, dim=-1).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Holds a [max_position, rotary_dim] float32 cache: cos in the first half, sin in the second.

    Use `get_cos_sin(positions)` once per forward and `apply(x, cos_sin)` per layer.
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        rope_scaling: dict | None = None,
        rotary_dim: int | None = None,
    ):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        self.max_position = max_position
        inv_freq = compute_inv_freq(self.rotary_dim, base, rope_scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.to(t.device))
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def get_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin), each [T, 1, rotary_dim // 2] float32."""
        cs = self.cos_sin_cache.index_select(0, positions).unsqueeze(1)
        half = self.rotary_dim // 2
        return cs[..., :half], cs[..., half:]

    def apply(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [T, heads, head_dim] (any dtype) -> rotated copy, same dtype/shape.

        On CUDA one Triton kernel for all heads (q and k together when the caller passes
        them as one view); on the CPU one C++ pass (hiserve.jit_kernel.cpu.rotary) when it
        builds; elsewhere `rotary_reference`."""
        if triton_ops.use_triton(x):
            from hiserve.layers.triton_ops.rotary import rotary_embedding

            return rotary_embedding(x, cos_sin[0], cos_sin[1], self.rotary_dim)
        if (x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2] and cos_sin[0].stride(-1) == 1
                and cpu_kernels.use_cpu_kernels(x)):
            return cpu_kernels.rotary(x, cos_sin[0], cos_sin[1], self.rotary_dim)
        return rotary_reference(x, cos_sin, self.rotary_dim)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Convenience form: q [T, Hq*D], k [T, Hkv*D] -> rotated (q, k), same shapes."""
        cs = self.get_cos_sin(positions)
        t = q.shape[0]
        q_out = self.apply(q.view(t, -1, self.head_dim), cs).reshape(q.shape)
        k_out = self.apply(k.view(t, -1, self.head_dim), cs).reshape(k.shape)
        return q_out, k_out
