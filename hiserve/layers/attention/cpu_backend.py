"""`cpu_paged`: attention on the CPU that reads K/V in place from the device pool.

DECODE runs one C++ kernel (`hiserve/jit_kernel/csrc/cpu/paged_attention.h`) over the pool
through `req_to_token`: no per-request gathered copy, one pass over K/V per KV head for all its
query heads (GQA), and a flash-decoding split of long contexts across threads. When the kernel
runs the whole batch on the plain MHA pool with k/v in the pool's dtype, the same C++ call first
stores the new tokens' K/V into the pool (in place of `set_kv_buffer`'s two index_put_ per layer
and step); otherwise Python stores.

EXTEND is routed once per backend from the CPU's features and the pool (`extend_routing`,
logged once; the PAGED_EXTEND_MAX_NEW_TOKENS rule below holds for "amx" as for "sdpa"):

* "kernel": a bf16 pool on an AVX512-BF16 CPU without AMX. Every EXTEND request (a fresh prompt,
  a question after a cached system prompt, a chunk of chunked prefill) runs the same kernel,
  whose multi-query tiles put both products on `_mm512_dpbf16_ps`
  (`csrc/cpu/extend_avx512bf16.h`): 3.2-5.0x torch's SDPA on one thread of the EPYC
  (benchmark/cpu/bench_extend_attention_ab.py).
* "amx": a bf16 pool on an AMX CPU where the AMX kernels run, head dims a multiple of 32 up to 256.
  The same paths as "sdpa" below, each on the AMX flash-attention kernel
  (`cpu_amx_extend`, `csrc/cpu/amx_attention.h`): fresh prompts (adjacent ones in one varlen
  call), a chunk over a cached prefix read in place through its slots (no gathered copy, no
  mask tensor), and shared-prefix groups (the shared part and the members' own parts, one call
  each). On the 2-core AMX Xeon (SmolLM2 heads, one layer, benchmark/results/cpu_amx_attention.json)
  it took 0.50-0.64x SDPA's time for prompts and a question over a prefix, 0.80x for a group's
  shared part; in process, scenario (c)'s TTFT 183 -> 158 ms.
* "sdpa" otherwise: requests over a cached prefix with at most `PAGED_EXTEND_MAX_NEW_TOKENS` (4)
  new tokens take the kernel (its dpbf16 tiles on a bf16 pool where the build has AVX512-BF16,
  AMX CPUs included; else its fp32 loops); a fresh prompt attends only over its own new
  tokens, which are the k/v handed in, so it runs `F.scaled_dot_product_attention` (causal) on
  them directly; a longer chunk over a cached prefix gathers its context and runs masked SDPA
  as torch_native does, unless other requests of the batch share that prefix's slots: then the
  group runs one unmasked SDPA call over the shared prefix for all their queries and one small
  masked call each over the rest, merged by log-sum-exp (`cpu_prefix_split`: a shared system
  prompt read once for all of them). Before the AMX kernel, AMX CPUs took this routing rather
  than "kernel": SDPA's flash attention runs oneDNN's AMX tiles, a wider bf16 unit than the
  kernel's dpbf16 (session 19, in process: a 200-token prefill 62.7 ms on "kernel" against
  53.7, scenario (c)'s TTFT 363 against 208 ms); without native bf16 or with a float32 pool the
  kernel's loops are fp32 FMAs, where SDPA's GEMMs win from a few rows.
  `HISERVE_CPU_EXTEND_ATTENTION=kernel|sdpa|amx` overrides the choice (an A/B on a new CPU).

When the kernels cannot be built here (no compiler, no apache-tvm-ffi; one warning is
logged) or the pool's dtype is not float32/bfloat16, every pass runs `torch_native` (the
oracle this backend is tested against). MLA models always run torch_native's MLA path.
"""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hiserve.hardware import detect_cpu
from hiserve.jit_kernel import cpu as cpu_kernels
from hiserve.layers.attention import cpu_amx_extend as amx_extend
from hiserve.layers.attention import cpu_prefix_split as prefix_split
from hiserve.layers.attention.base import AttentionBackend, RadixAttention
from hiserve.layers.attention.torch_native import TorchNativeAttnBackend
from hiserve.layers.forward_batch import ForwardBatch
from hiserve.mem_cache.memory_pool import MHATokenToKVPool

logger = logging.getLogger(__name__)
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# With the "sdpa" EXTEND routing, above this many new tokens a request over a cached prefix
# gathers its context and runs SDPA. The kernel's EXTEND path without the dpbf16 tiles is fp32
# vector loops per (query block, KV head); SDPA's flash attention runs GEMM micro-kernels, so the
# crossover sits at a few rows. Measured before the dpbf16 tiles existed, in process CPU time on one thread
# (SmolLM2 heads, bf16): SDPA 1.1x faster at 2 new tokens over 1000 cached, 1.3x at 4, 1.7x at
# 8, 2-3x from 16 to 128 (and over 2048 cached); the kernel stays ~4x faster for DECODE.
PAGED_EXTEND_MAX_NEW_TOKENS = 4
_TILE_MAX_DIM = 256  # extend_avx512bf16.h: kExtendMaxDim (head dims a multiple of 32)


def extend_override() -> str:
    """HISERVE_CPU_EXTEND_ATTENTION: "auto" (unset), "kernel", "sdpa" or "amx". Raises ValueError
    on another value (checked when the backend is built, so a typo stops the server at start)."""
    choice = os.environ.get("HISERVE_CPU_EXTEND_ATTENTION", "auto")
    if choice not in ("auto", "kernel", "sdpa", "amx"):
        raise ValueError(f"HISERVE_CPU_EXTEND_ATTENTION must be auto, kernel, sdpa or amx, got {choice!r}")
    return choice


def extend_routing(dtype: torch.dtype, head_dim: int) -> tuple[str, str]:
    """("kernel" | "sdpa" | "amx", why) for EXTEND requests over an MHA pool of `dtype` with this
    head dim (K and V alike) on this CPU (see the module docstring). `HISERVE_CPU_EXTEND_ATTENTION`
    = "kernel", "sdpa" or "amx" overrides "auto"; "kernel" where the dpbf16 tiles do not apply
    runs the kernel's portable loops (correct, slower); "amx" on a layer the AMX kernel does not
    take (not bf16, a head dim not a multiple of 32 up to 256) runs the "sdpa" paths.
    Raises ValueError on another value, or "amx" without a bf16 pool and the AMX kernels."""
    choice = extend_override()
    if choice == "amx" and not (dtype == torch.bfloat16 and cpu_kernels.amx_gemm_available()):
        raise ValueError("HISERVE_CPU_EXTEND_ATTENTION=amx needs a bfloat16 pool and the AMX kernels "
                         "(an AMX CPU, kernels built with the amx tier)")
    if choice != "auto":
        return choice, f"HISERVE_CPU_EXTEND_ATTENTION={choice}"
    cpu = detect_cpu()
    if cpu.isa not in ("avx512_bf16", "amx"):
        return "sdpa", f"kernel ISA {cpu.isa}: no AVX512-BF16 for the kernel's dpbf16 tiles"
    if dtype != torch.bfloat16:
        return "sdpa", f"{dtype} pool: the dpbf16 tiles read bf16"
    if head_dim % 32 or head_dim > _TILE_MAX_DIM:
        return "sdpa", f"head dim {head_dim}: the tiles take a multiple of 32, <= 256"
    if "amx_bf16" in cpu.features:
        if cpu_kernels.amx_gemm_available():
            return "amx", "AMX: the AMX flash-attention kernel (csrc/cpu/amx_attention.h)"
        return "sdpa", "AMX CPU without the AMX kernels: SDPA's flash attention runs oneDNN's AMX tiles"
    return "kernel", "AVX512-BF16 without AMX: the kernel's dpbf16 tiles (3.2-5.0x SDPA, one thread)"


@dataclass
class _PagedMetadata:
    """Kernel arguments of the requests it runs (all of a DECODE batch; the ones with a
    cached prefix of an EXTEND batch)."""

    req_pool_indices: torch.Tensor  # [B'] int64
    seq_lens: torch.Tensor  # [B'] int64
    q_starts: torch.Tensor  # [B' + 1] int64 offsets into the rows `q_rows` selects
    q_rows: torch.Tensor | None  # [T'] rows of q for these requests; None: all rows in order


@dataclass
class _Metadata:
    paged: _PagedMetadata | None
    # out_cache_loc when the kernel may store the new K/V itself (decided once per batch: it runs
    # the whole batch, on the plain MHA pool, with contiguous int64 CPU slots); else None
    store_loc: torch.Tensor | None
    fresh: list[tuple[int, int]]  # (q_start, q_end) of EXTEND requests without a cached prefix
    # (q_start, q_end, context slots [seq_len] int64, causal mask [n, seq_len] or None on the
    # "amx" routing, whose kernel reads the slots causally) of long chunks over a cached prefix
    # that shares it with no other request of the batch (or every such chunk where this torch
    # lacks the flash op the "sdpa" routing's `groups` run on)
    gathered: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]
    # long chunks over a cached prefix that other requests of the batch share, grouped by their
    # shared leading slots (cpu_prefix_split)
    groups: list[prefix_split.PrefixGroup]
    # the "amx" routing's plans of `fresh` (adjacent prompts merged) and of `groups`
    amx_fresh: list[amx_extend.FreshRun] = field(default_factory=list)
    amx_groups: list[amx_extend.GroupPlan] = field(default_factory=list)


def _causal_mask(n: int, s: int) -> torch.Tensor:
    """[n, s] bool: query i (the i-th of the last n of s positions) sees keys j <= s - n + i."""
    return torch.arange(s).view(1, -1) <= torch.arange(s - n, s).view(-1, 1)


class CpuPagedAttnBackend(AttentionBackend):
    """See the module docstring. Construction arguments (a model runner) are optional."""

    def __init__(self, runner=None):
        self._oracle = TorchNativeAttnBackend(runner)
        cfg = getattr(runner, "model_config", None)
        self._mla = bool(getattr(cfg, "kv_lora_rank", None))
        self._meta: _Metadata | None = None
        self._arange_cache: dict[int, torch.Tensor] = {}
        # The kernel stores the new K/V itself when it runs the whole batch (saves two
        # index_put_ and their Python per layer and step); False: set_kv_buffer first (A/B).
        self.fuse_kv_store = True
        # "kernel" | "sdpa" | "amx" (extend_routing), decided from the pool at the first batch unless set.
        self.extend_route: str | None = None
        extend_override()  # a bad HISERVE_CPU_EXTEND_ATTENTION fails here, at start

    def _kernel_ok(self, forward_batch: ForwardBatch) -> bool:
        pool = forward_batch.token_to_kv_pool
        return (not self._mla and getattr(pool, "dtype", None) in _KERNEL_DTYPES
                and forward_batch.req_to_token_pool.req_to_token.dtype == torch.int32
                and forward_batch.req_to_token_pool.req_to_token.device.type == "cpu"
                and cpu_kernels.can_use_cpu_kernels())

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        if not self._kernel_ok(forward_batch):
            self._meta = None
            self._oracle.init_forward_metadata(forward_batch)
            return
        idx = forward_batch.req_pool_indices.to("cpu", torch.int64)
        lens = forward_batch.seq_lens.to("cpu", torch.int64)
        if forward_batch.forward_mode.is_decode():
            b = len(forward_batch.seq_lens_cpu)
            starts = self._arange_cache.get(b)
            if starts is None:
                starts = self._arange_cache.setdefault(b, torch.arange(b + 1, dtype=torch.int64))
        elif self._extend_route(forward_batch.token_to_kv_pool) == "kernel":
            starts = torch.tensor([0, *itertools.accumulate(forward_batch.extend_seq_lens_cpu)], dtype=torch.int64)
        else:
            self._meta = self._split_extend(forward_batch, idx, lens)
            return
        # The kernel runs the whole batch (DECODE, or EXTEND on the "kernel" routing).
        self._meta = _Metadata(_PagedMetadata(idx, lens, starts, None), self._store_loc(forward_batch), [], [], [])

    def _split_extend(self, forward_batch: ForwardBatch, idx: torch.Tensor, lens: torch.Tensor) -> _Metadata:
        """The "sdpa" and "amx" EXTEND routings' plan: a fresh prompt attends over its own k/v, a
        long chunk over a cached prefix over its context slots or, with others on the same cached
        prefix, through the split and shared calls, and a few tokens over a prefix through the
        paged kernel."""
        fresh, chunks, cached, rows, starts, q = [], [], [], [], [0], 0
        req_to_token = forward_batch.req_to_token_pool.req_to_token
        for i, (n, prefix) in enumerate(zip(forward_batch.extend_seq_lens_cpu, forward_batch.extend_prefix_lens_cpu)):
            if prefix == 0:
                fresh.append((q, q + n))
            elif n > PAGED_EXTEND_MAX_NEW_TOKENS:
                chunks.append((q, q + n, prefix, req_to_token[int(idx[i]), : prefix + n].long()))
            else:
                cached.append(i)
                rows.append(torch.arange(q, q + n))
                starts.append(starts[-1] + n)
            q += n
        paged = None
        if cached:
            sel = torch.tensor(cached, dtype=torch.int64)
            q_rows = None if not fresh and not chunks else torch.cat(rows)
            paged = _PagedMetadata(idx[sel], lens[sel], torch.tensor(starts, dtype=torch.int64), q_rows)
        paged_all = paged is not None and paged.q_rows is None
        store_loc = self._store_loc(forward_batch) if paged_all else None
        # groups only where the flash op exists: a layer the AMX kernel does not take runs them on it
        groups, alone = prefix_split.plan_groups(chunks) if prefix_split.available() else ([], chunks)
        amx = self.extend_route == "amx"  # the kernel reads the slots causally: no mask
        gathered = [(start, end, slots, None if amx else _causal_mask(end - start, slots.numel()))
                    for start, end, _, slots in alone]
        if not amx:
            return _Metadata(paged, store_loc, fresh, gathered, groups)
        return _Metadata(paged, store_loc, fresh, gathered, groups, amx_extend.plan_fresh(fresh),
                         [amx_extend.GroupPlan.of(g) for g in groups])

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        meta = self._meta
        if meta is None:
            return self._oracle.forward(q, k, v, layer, forward_batch, save_kv_cache)
        t, pool = q.shape[0], forward_batch.token_to_kv_pool
        paged_all = meta.paged is not None and meta.paged.q_rows is None  # DECODE, or every request paged
        if save_kv_cache and meta.store_loc is not None and k.dtype == v.dtype == pool.dtype:
            # get_*_buffer first: they wait for a layer's load-back, which must land before
            # the kernel writes the new rows over it.
            k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
            qk = q if q.dtype == k_buf.dtype else q.to(k_buf.dtype)
            return self._paged(qk, k_buf, v_buf, layer, forward_batch, meta.paged,
                               (k, v, meta.store_loc)).to(q.dtype)
        if save_kv_cache:
            pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc,
                               k.view(t, layer.num_kv_heads, layer.head_dim),
                               v.view(t, layer.num_kv_heads, layer.v_head_dim))
        k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        qk = q if q.dtype == k_buf.dtype else q.to(k_buf.dtype)
        if paged_all:
            return self._paged(qk, k_buf, v_buf, layer, forward_batch, meta.paged).to(q.dtype)
        out = q.new_empty((t, layer.num_heads * layer.v_head_dim))
        amx = self.extend_route == "amx" and k.dtype == torch.bfloat16
        if amx and amx_extend.usable(q, k_buf, v_buf, layer.num_heads):
            self._amx_extend(q, k, v, k_buf, v_buf, layer, meta, out)
        else:
            self._sdpa_extend(q, k, v, k_buf, v_buf, layer, meta, out)
        if meta.paged is not None:
            rows = meta.paged.q_rows
            out[rows] = self._paged(qk[rows], k_buf, v_buf, layer, forward_batch, meta.paged).to(q.dtype)
        return out

    def _sdpa_extend(self, q, k, v, k_buf, v_buf, layer: RadixAttention, meta: _Metadata, out: torch.Tensor) -> None:
        """The "sdpa" routing's fresh prompts, groups and lone chunks over a prefix (module docstring)."""
        for start, end in meta.fresh:
            out[start:end] = self._fresh(q[start:end], k[start:end], v[start:end], layer)
        for group in meta.groups:
            prefix_split.attend_group(q, k_buf, v_buf, group, layer.num_heads, layer.scaling, out)
        for start, end, slots, mask in meta.gathered:
            if mask is None:  # planned for the "amx" routing, run here on other dtypes
                mask = _causal_mask(end - start, slots.numel())
            out[start:end] = self._attend(q[start:end], k_buf.index_select(0, slots).flatten(1),
                                          v_buf.index_select(0, slots).flatten(1), layer, mask)

    @staticmethod
    def _amx_extend(q, k, v, k_buf, v_buf, layer: RadixAttention, meta: _Metadata, out: torch.Tensor) -> None:
        """The same three paths on the AMX flash-attention kernel (cpu_amx_extend)."""
        hq, scale = layer.num_heads, layer.scaling
        for run in meta.amx_fresh:
            amx_extend.fresh(q, k, v, run, hq, scale, out)
        for plan in meta.amx_groups:
            amx_extend.attend_group(q, k_buf, v_buf, plan, hq, scale, out)
        for start, end, slots, _ in meta.gathered:
            amx_extend.over_slots(q[start:end], k_buf, v_buf, slots, hq, scale, out[start:end])

    def forward_mla(self, *args, **kwargs) -> torch.Tensor:
        """MLA runs torch_native's path (see `TorchNativeAttnBackend.forward_mla`)."""
        return self._oracle.forward_mla(*args, **kwargs)

    def decode_kernel_args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """For the pass `init_forward_metadata` last prepared: (req_pool_indices [B], seq_lens
        [B], q_starts [B + 1], out_cache_loc [T]) of `cpu_kernels.paged_attention`, when each
        layer's attention is exactly that one call over the whole batch with the fused K/V store
        (as `forward` then makes it); else None (the pass needs `forward`'s other paths).
        A caller that makes the call itself (`hiserve.models.cpu_decode_loop`) must pass k/v
        in the pool's dtype."""
        meta = self._meta
        if meta is None or meta.paged is None or meta.paged.q_rows is not None or meta.store_loc is None:
            return None
        p = meta.paged
        return p.req_pool_indices, p.seq_lens, p.q_starts, meta.store_loc

    def _extend_route(self, pool) -> str:
        if self.extend_route is None:
            self.extend_route, why = extend_routing(pool.dtype, pool.head_dim)
            logger.info("CPU EXTEND attention: %s (%s)", self.extend_route, why)
        return self.extend_route

    def _store_loc(self, forward_batch: ForwardBatch) -> torch.Tensor | None:
        """out_cache_loc if the kernel may store this batch's new K/V (in place of
        `set_kv_buffer`): the plain MHA pool exactly (a subclass may store differently) and
        contiguous int64 CPU slots. Per layer only k/v's dtype is then checked (the kernel copies
        rows, it does not cast); their layout is the wrapper's one validation."""
        loc = forward_batch.out_cache_loc
        if (self.fuse_kv_store and type(forward_batch.token_to_kv_pool) is MHATokenToKVPool
                and loc.dtype == torch.int64 and loc.is_cpu and loc.is_contiguous()):
            return loc
        return None

    @staticmethod
    def _paged(q, k_buf, v_buf, layer: RadixAttention, forward_batch: ForwardBatch, m: _PagedMetadata,
               store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
        """The kernel over m's requests; store: (k_new, v_new, out_cache_loc) written first."""
        k_new, v_new, loc = store if store is not None else (None, None, None)
        return cpu_kernels.paged_attention(
            q, k_buf, v_buf, forward_batch.req_to_token_pool.req_to_token, m.req_pool_indices, m.seq_lens,
            m.q_starts, layer.num_heads, layer.scaling, k_new, v_new, loc)

    @staticmethod
    def _fresh(q, k, v, layer: RadixAttention) -> torch.Tensor:
        """Causal attention of a request's new tokens over themselves: q [n, Hq*D], k/v [n, Hkv*D]."""
        return CpuPagedAttnBackend._attend(q, k, v, layer, None)

    @staticmethod
    def _attend(q, k, v, layer: RadixAttention, mask: torch.Tensor | None) -> torch.Tensor:
        """SDPA of q [n, Hq*D] over k/v [S, Hkv*D] ([S, Hkv*Dv]); mask [n, S] bool, or None
        for causal with S == n."""
        n, s, hq, hkv = q.shape[0], k.shape[0], layer.num_heads, layer.num_kv_heads
        o = F.scaled_dot_product_attention(
            q.reshape(n, hq, layer.head_dim).transpose(0, 1).unsqueeze(0),
            k.reshape(s, hkv, layer.head_dim).transpose(0, 1).unsqueeze(0).to(q.dtype),
            v.reshape(s, hkv, layer.v_head_dim).transpose(0, 1).unsqueeze(0).to(q.dtype),
            attn_mask=mask, is_causal=mask is None, scale=layer.scaling, enable_gqa=hq != hkv)  # [1, Hq, n, Dv]
        return o[0].transpose(0, 1).reshape(n, hq * layer.v_head_dim)
