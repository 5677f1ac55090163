"""A torch version of the part of FlashAttention-3's `flash_attn_with_kvcache` that the fa3
backend calls: paged K/V through a page table, varlen or batched queries, `qv`, causal.

It is the oracle that CUDA tests compare FA3 against, and what CPU tests run the fa3
backend with (FA3 itself needs a Hopper GPU). Slow (a loop over requests, float32 math);
never a serving path.
"""

from __future__ import annotations

import torch


def flash_attn_with_kvcache_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    qv: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Attention of each request's queries over its first `cache_seqlens[b]` cached tokens.

    Args:
        q: `[B, S, H, D]`, or `[T, H, D]` with `cu_seqlens_q` (varlen).
        k_cache: `[num_pages, page_size, Hkv, D]`, last dim contiguous; H % Hkv == 0 and
            query head h reads kv head `h // (H // Hkv)`.
        v_cache: `[num_pages, page_size, Hkv, Dv]`, last dim contiguous.
        qv: like q with last dim Dv: adds `qv · v` to each score (MLA's absorbed form).
        cache_seqlens: int32 `[B]`.
        page_table: int32 `[B, max_pages]`, contiguous: page ids of each request, in order.
        cu_seqlens_q: int32 `[B + 1]` query offsets (varlen); needs `max_seqlen_q`.
        softmax_scale: default `(D + Dv_of_qv) ** -0.5`.
        causal: bottom-right aligned: query i of S sees keys `<= i + L - S` (L = cache_seqlens[b]).
    Returns:
        q's dtype, `[B, S, H, Dv]` (or `[T, H, Dv]`).
    Raises:
        ValueError: an input breaks one of FA3's rules above.
    """
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must have a contiguous last dimension")
    if page_table is None or cache_seqlens is None:
        raise ValueError("this reference covers the paged form only (page_table and cache_seqlens)")
    if page_table.dtype != torch.int32 or not page_table.is_contiguous():
        raise ValueError(f"page_table must be contiguous int32, got {page_table.dtype}")
    if cache_seqlens.dtype != torch.int32:
        raise ValueError(f"cache_seqlens must be int32, got {cache_seqlens.dtype}")
    if q.dtype != k_cache.dtype or q.dtype != v_cache.dtype:
        raise ValueError(f"q, k_cache and v_cache dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if cu_seqlens_q is not None:
        if q.dim() != 3 or cu_seqlens_q.dtype != torch.int32 or max_seqlen_q is None:
            raise ValueError("varlen q is [T, H, D] with int32 cu_seqlens_q and max_seqlen_q")
        bounds = cu_seqlens_q.tolist()
        queries = [q[bounds[i]:bounds[i + 1]] for i in range(len(bounds) - 1)]
        qvs = None if qv is None else [qv[bounds[i]:bounds[i + 1]] for i in range(len(bounds) - 1)]
        if max(b - a for a, b in zip(bounds, bounds[1:])) > max_seqlen_q:
            raise ValueError("a request has more queries than max_seqlen_q")
    else:
        if q.dim() != 4:
            raise ValueError("q is [B, S, H, D] without cu_seqlens_q")
        queries, qvs = list(q), None if qv is None else list(qv)
    num_reqs = len(queries)
    if page_table.shape[0] != num_reqs or cache_seqlens.shape[0] != num_reqs:
        raise ValueError(f"{num_reqs} requests but page_table {tuple(page_table.shape)}, "
                         f"cache_seqlens {tuple(cache_seqlens.shape)}")
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if softmax_scale is None:
        softmax_scale = (q.shape[-1] + (0 if qv is None else qv.shape[-1])) ** -0.5

    outs = []
    for b, qb in enumerate(queries):
        seq_len = int(cache_seqlens[b])
        pages = page_table[b, : -(-seq_len // page_size)].long()
        group = qb.shape[1] // num_kv_heads
        k = k_cache[pages].flatten(0, 1)[:seq_len].float().repeat_interleave(group, dim=1)  # [L, H, D]
        v = v_cache[pages].flatten(0, 1)[:seq_len].float().repeat_interleave(group, dim=1)  # [L, H, Dv]
        scores = torch.einsum("shd,lhd->hsl", qb.float(), k)
        if qvs is not None:
            scores = scores + torch.einsum("shd,lhd->hsl", qvs[b].float(), v)
        scores = scores * softmax_scale
        if causal:
            n = qb.shape[0]
            allowed = torch.arange(seq_len, device=q.device).view(1, -1) <= (
                torch.arange(n, device=q.device).view(-1, 1) + seq_len - n)
            scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a fully masked row gives 0, as FA3 does
        outs.append(torch.einsum("hsl,lhd->shd", probs, v).to(q.dtype))
    return torch.cat(outs) if cu_seqlens_q is not None else torch.stack(outs)
