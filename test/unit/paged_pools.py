"""Test harness: device pools with requests whose pages are scattered over the pool, and the
ForwardBatches a scheduler would build for them (used by the fa3 backend tests, CPU and CUDA);
inputs, a float64 reference and a per-row check for the paged CPU kernel called directly."""

from __future__ import annotations

import torch

from hiserve.layers.forward_batch import ForwardBatch, ForwardMode
from hiserve.mem_cache.allocator import ReqToTokenPool
from hiserve.mem_cache.memory_pool import KVCache


class Pools:
    """`req_to_token_pool` (with a padding row) + `token_to_kv_pool`, and per-request pages
    taken in a shuffled order: position j of a request lives at `page * P + j % P` of its
    (j // P)-th page, the allocator's invariant. Pass it where a backend wants a model runner."""

    def __init__(self, kv_pool: KVCache, max_reqs: int = 24, max_context: int = 2048, seed: int = 0):
        self.page_size = kv_pool.page_size
        self.device = kv_pool.device
        self.token_to_kv_pool = kv_pool
        self.req_to_token_pool = ReqToTokenPool(max_reqs, max_context, self.device, padding_row=True)
        gen = torch.Generator().manual_seed(seed)
        num_pages = kv_pool.size // self.page_size
        self.free_pages = (torch.randperm(num_pages, generator=gen) + 1).tolist()  # page 0 is padding
        self.rows: dict[str, int] = {}
        self.pages: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def _slot(self, name: str, pos: int) -> int:
        pages = self.pages[name]
        while len(pages) <= pos // self.page_size:
            pages.append(self.free_pages.pop())
        return pages[pos // self.page_size] * self.page_size + pos % self.page_size

    def share_prefix(self, name: str, parent: str, length: int) -> None:
        """Start request `name` on `parent`'s first `length` tokens (whole pages), as a radix
        cache hit does: the same pool slots, its own req_to_token row."""
        assert length % self.page_size == 0 and length <= self.lens[parent]
        self.rows[name] = self.req_to_token_pool.alloc(1)[0]
        self.pages[name] = self.pages[parent][: length // self.page_size]
        self.lens[name] = length
        src = self.req_to_token_pool.req_to_token[self.rows[parent], :length]
        self.req_to_token_pool.req_to_token[self.rows[name], :length] = src

    def batch(self, mode: ForwardMode, new_lens: dict[str, int], backend) -> ForwardBatch:
        """Append `new_lens[name]` tokens to each named request (new names start empty)."""
        out_cache_loc, positions, prefix, seq = [], [], [], []
        for name, n in new_lens.items():
            if name not in self.rows:
                self.rows[name] = self.req_to_token_pool.alloc(1)[0]
                self.pages[name], self.lens[name] = [], 0
            p = self.lens[name]
            slots = [self._slot(name, j) for j in range(p, p + n)]
            self.req_to_token_pool.req_to_token[self.rows[name], p : p + n] = torch.tensor(slots, dtype=torch.int32)
            out_cache_loc += slots
            positions += range(p, p + n)
            prefix.append(p)
            seq.append(p + n)
            self.lens[name] = p + n
        dev, t = self.device, len(out_cache_loc)
        return ForwardBatch(
            forward_mode=mode, batch_size=len(new_lens), input_ids=torch.zeros(t, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            out_cache_loc=torch.tensor(out_cache_loc, dtype=torch.int64, device=dev),
            req_pool_indices=torch.tensor([self.rows[n] for n in new_lens], dtype=torch.int64, device=dev),
            seq_lens=torch.tensor(seq, dtype=torch.int64, device=dev), seq_lens_cpu=seq,
            extend_seq_lens_cpu=list(new_lens.values()), extend_prefix_lens_cpu=prefix,
            req_to_token_pool=self.req_to_token_pool, token_to_kv_pool=self.token_to_kv_pool,
            attn_backend=backend)


def assert_close_rel(out: torch.Tensor, ref: torch.Tensor, tol: float = 2e-2) -> None:
    """Max abs error within `tol` of the reference's largest magnitude (bf16: 2e-2 is ~2 ulps)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape, out.dtype, ref.dtype)
    err = (out.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    assert err <= tol * scale + 1e-3, f"max abs error {err:.4g} vs reference scale {scale:.4g}"


def extend_inputs(dtype: torch.dtype, *, group: int, head_dim: int, requests: list[tuple[int, int]], hkv: int = 2,
                  seed: int = 0) -> tuple:
    """One batch straight for the paged kernel: request b = (prefix_b, n_b) has prefix_b + n_b
    context tokens on shuffled pool slots (page size 1), its n_b new tokens the last of them
    (a DECODE batch: n_b = 1 for every b). Returns q [T, hq * d], k, v [slots, hkv, d],
    req_to_token (int32), req_pool_indices, seq_lens, extend starts (cumulative n_b; these three
    int64), hq."""
    gen = torch.Generator().manual_seed(seed)
    hq, total = hkv * group, sum(p + n for p, n in requests)
    k = torch.randn(total + 5, hkv, head_dim, generator=gen).to(dtype)
    v = torch.randn(total + 5, hkv, head_dim, generator=gen).to(dtype)
    r2t = torch.zeros(len(requests), max(p + n for p, n in requests), dtype=torch.int32)
    slots, used = torch.randperm(total + 5, generator=gen)[:total].to(torch.int32), 0
    for i, (p, n) in enumerate(requests):
        r2t[i, :p + n] = slots[used:used + p + n]
        used += p + n
    news = [n for _, n in requests]
    q = torch.randn(sum(news), hq * head_dim, generator=gen).to(dtype)
    lens = torch.tensor([p + n for p, n in requests], dtype=torch.int64)
    starts = torch.tensor([0] + news, dtype=torch.int64).cumsum(0)
    return q, k, v, r2t, torch.arange(len(requests), dtype=torch.int64), lens, starts, hq


def decode_inputs(dtype: torch.dtype, *, group: int, head_dim: int, contexts: list[int], hkv: int = 2,
                  seed: int = 0) -> tuple:
    """`extend_inputs` of one new token per request over contexts[b] - 1 cached ones."""
    return extend_inputs(dtype, group=group, head_dim=head_dim, requests=[(n - 1, 1) for n in contexts],
                         hkv=hkv, seed=seed)


def extend_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, r2t: torch.Tensor, lens: torch.Tensor,
                     starts: torch.Tensor, hq: int, scale: float) -> torch.Tensor:
    """float64 causal softmax(q k^T scale) v: query i of request b (of n) sees its first
    len_b - n + i + 1 keys. Returns [T, hq * d] in q's dtype."""
    hkv, d = k.shape[1], k.shape[2]
    out = torch.empty(q.shape[0], hq, d, dtype=torch.float64)
    for b, total in enumerate(lens.tolist()):
        s0, s1 = int(starts[b]), int(starts[b + 1])
        n, slots = s1 - s0, r2t[b, :total].long()
        kk = k[slots].double().repeat_interleave(hq // hkv, dim=1)  # [total, hq, d]
        vv = v[slots].double().repeat_interleave(hq // hkv, dim=1)
        scores = torch.einsum("ihd,jhd->hij", q[s0:s1].double().view(n, hq, d), kk) * scale
        visible = torch.arange(total).view(1, -1) <= torch.arange(total - n, total).view(-1, 1)  # [n, total]
        p = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[s0:s1] = torch.einsum("hij,jhd->ihd", p, vv)
    return out.view(q.shape[0], hq * d).to(q.dtype)


def assert_close_per_row(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """Each output row against its own scale: a long context's output is a mean of many V
    rows (small), a one-key context's a raw V row (large); one batch-wide scale would let a
    wrong long-context row pass under the short one's magnitude."""
    for i in range(want.shape[0]):
        assert_close_rel(got[i], want[i], tol)
