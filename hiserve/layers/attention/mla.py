"""Multi-head latent attention (MLA, DeepSeek-V2/V3): the model-side layer.

Per token the KV cache (`MLATokenToKVPool`) holds one row `[latent | k_rope]`:
the RMS-normed compressed KV (`kv_lora_rank` values) and the rotated, head-shared
rope key (`qk_rope_head_dim` values). Head h's full key and value come from the
latent through `kv_b_proj`, whose weight, seen as `[H, qk_nope_head_dim + v_head_dim,
kv_lora_rank]`, splits into W_UK[h] `[qk_nope, r]` and W_UV[h] `[v, r]`:

    k_h = [W_UK[h] @ latent | k_rope],   v_h = W_UV[h] @ latent

Two equal ways to attend:
- expanded: up-project every cached latent into per-head k_nope and v, then plain
  attention with key dim `qk_nope + qk_rope` (cheap for prefill: new tokens ≈ context);
- absorbed: fold W_UK into the query, `q_lat = q_nope @ W_UK[h]` (`[r]`), because
  `q_nope · (W_UK latent) = (q_nope W_UK) · latent`; attend with the whole cached row as
  a single shared key head of dim `r + rope` and the latent as the value (MQA), then
  fold W_UV into the output, `o_h = W_UV[h] @ o_lat` (cheap for decode: reads only
  the cache, never materializes per-head K/V).

A backend that implements `forward_mla(q_nope, q_rope, latent, k_rope, layer,
forward_batch, save_kv_cache)` chooses its own form (torch_native: see
`torch_native_mla.py`); any other backend gets the absorbed form through its plain
`forward`, as MQA over the MLA pool (`num_kv_heads = 1`, `head_dim = r + rope`,
`v_head_dim = r`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from hiserve.layers.forward_batch import ForwardBatch


class MLAAttention(nn.Module):
    """Per-layer MLA shapes and the up-projection weight views; the computation is the backend's.

    It also carries the attribute names of `RadixAttention` (`num_heads`, `num_kv_heads`,
    `head_dim`, `v_head_dim`, `scaling`, `layer_id`) describing the absorbed MQA form, so a
    backend's plain `forward` can run it.

    Args:
        kv_b_proj: the layer's `kv_b_proj` Linear (`[H*(qk_nope+v), r]`); only views of its
            weight are kept (no parameter is registered here), refreshed by `bind_weights`.
    """

    def __init__(
        self,
        num_heads: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        kv_lora_rank: int,
        scaling: float,
        layer_id: int,
        kv_b_proj: nn.Linear,
    ):
        super().__init__()
        self.num_heads = num_heads
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.mla_v_head_dim = v_head_dim  # per-head output width after W_UV
        self.kv_lora_rank = kv_lora_rank
        self.scaling = scaling
        self.layer_id = layer_id
        # The absorbed form seen as MQA over the cached rows.
        self.num_kv_heads = 1
        self.head_dim = kv_lora_rank + qk_rope_head_dim
        self.v_head_dim = kv_lora_rank
        self.bind_weights(kv_b_proj)

    def bind_weights(self, kv_b_proj: nn.Linear) -> None:
        """Take fresh views of `kv_b_proj.weight` (call again if the weight tensor is replaced)."""
        w = kv_b_proj.weight.detach()
        expected = (self.num_heads * (self.qk_nope_head_dim + self.mla_v_head_dim), self.kv_lora_rank)
        if tuple(w.shape) != expected:
            raise ValueError(f"kv_b_proj weight shape {tuple(w.shape)} != {expected}")
        self.w_kv = w.view(self.num_heads, self.qk_nope_head_dim + self.mla_v_head_dim, self.kv_lora_rank)

    @property
    def w_kc(self) -> torch.Tensor:
        """W_UK, `[H, qk_nope_head_dim, kv_lora_rank]` (a view)."""
        return self.w_kv[:, : self.qk_nope_head_dim]

    @property
    def w_vc(self) -> torch.Tensor:
        """W_UV, `[H, v_head_dim, kv_lora_rank]` (a view)."""
        return self.w_kv[:, self.qk_nope_head_dim :]

    def forward(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        k_rope: torch.Tensor,
        forward_batch: "ForwardBatch",
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """q_nope [T, H, qk_nope], q_rope [T, H, rope] (rotated), latent [T, r] (normed),
        k_rope [T, rope] (rotated) -> [T, H * v_head_dim]."""
        backend = forward_batch.attn_backend
        forward_mla = getattr(backend, "forward_mla", None)
        if forward_mla is not None:
            return forward_mla(q_nope, q_rope, latent, k_rope, self, forward_batch, save_kv_cache)
        return forward_mla_as_mqa(backend, q_nope, q_rope, latent, k_rope, self, forward_batch, save_kv_cache)

    def extra_repr(self) -> str:
        return (
            f"layer_id={self.layer_id}, num_heads={self.num_heads}, kv_lora_rank={self.kv_lora_rank}, "
            f"qk_nope_head_dim={self.qk_nope_head_dim}, qk_rope_head_dim={self.qk_rope_head_dim}, "
            f"v_head_dim={self.mla_v_head_dim}, scaling={self.scaling:.4g}"
        )


def absorb_q(q_nope: torch.Tensor, layer: MLAAttention) -> torch.Tensor:
    """q_nope [T, H, qk_nope] -> q_lat [T, H, r] = q_nope[:, h] @ W_UK[h]."""
    w_kc = layer.w_kc.to(q_nope.dtype)
    return torch.bmm(q_nope.transpose(0, 1), w_kc).transpose(0, 1)


def absorb_out(o_lat: torch.Tensor, layer: MLAAttention) -> torch.Tensor:
    """o_lat [T, H, r] -> [T, H * v_head_dim] = W_UV[h] @ o_lat[:, h]."""
    t = o_lat.shape[0]
    w_vc = layer.w_vc.to(o_lat.dtype)
    out = torch.bmm(o_lat.transpose(0, 1), w_vc.transpose(1, 2))  # [H, T, v]
    return out.transpose(0, 1).reshape(t, layer.num_heads * layer.mla_v_head_dim)


def save_mla_kv(layer: MLAAttention, forward_batch: "ForwardBatch", latent: torch.Tensor, k_rope: torch.Tensor) -> None:
    """Write the new tokens' rows `[latent | k_rope]` at `forward_batch.out_cache_loc`."""
    pool = forward_batch.token_to_kv_pool
    if not hasattr(pool, "set_mla_kv_buffer"):
        raise TypeError(f"MLA attention needs an MLA KV pool (MLATokenToKVPool), got {type(pool).__name__}")
    t = latent.shape[0]
    pool.set_mla_kv_buffer(
        layer.layer_id,
        forward_batch.out_cache_loc,
        latent.view(t, 1, layer.kv_lora_rank),
        k_rope.view(t, 1, layer.qk_rope_head_dim),
    )


def forward_mla_as_mqa(
    backend,
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latent: torch.Tensor,
    k_rope: torch.Tensor,
    layer: MLAAttention,
    forward_batch: "ForwardBatch",
    save_kv_cache: bool = True,
) -> torch.Tensor:
    """The absorbed form through a backend's plain `forward` (MQA over the MLA pool).

    The new rows `[latent | k_rope]` are the "k" the backend stores; the MLA pool's
    `set_kv_buffer` keeps the whole row and its value buffer is the latent part.
    """
    t, h = q_nope.shape[0], layer.num_heads
    q = torch.cat([absorb_q(q_nope, layer), q_rope.to(q_nope.dtype)], dim=-1).reshape(t, h * layer.head_dim)
    k = torch.cat([latent, k_rope], dim=-1)
    o_lat = backend.forward(q, k, latent, layer, forward_batch, save_kv_cache)  # [T, H * r]
    return absorb_out(o_lat.view(t, h, layer.kv_lora_rank), layer)
