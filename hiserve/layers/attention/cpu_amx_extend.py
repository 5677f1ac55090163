"""EXTEND attention of the "amx" routing (cpu_backend): the three SDPA paths of the "sdpa"
routing, each on the AMX flash-attention kernel (`hiserve/jit_kernel/csrc/cpu/amx_attention.h`).

* a fresh prompt: causal attention over its own new k/v, as handed in;
* a chunk over a cached prefix that it shares with no other request of the batch: causal
  (bottom-right aligned) over its context read in place from the pool through its slots, no
  gathered copy and no mask tensor;
* a group of requests over a shared prefix (`cpu_prefix_split.PrefixGroup`): one unmasked call
  over the shared slots for all the members' queries, one causal call per member over its own
  slots, both with their log-sum-exps, merged as `cpu_prefix_split.attend_group` does.

Every call needs q, k/v and the pool in bfloat16 and one head dim, a multiple of 32 up to 256
(`usable`); the caller keeps the SDPA paths otherwise.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from hiserve.jit_kernel.cpu_amx import amx_flash_attention
from hiserve.layers.attention.cpu_prefix_split import PrefixGroup


def usable(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, num_heads: int) -> bool:
    """Whether this layer's tensors fit the kernel: bf16 q [T, Hq * D] and pool, K, V and q of one
    head dim, a multiple of 32 and at most 256."""
    d = k_buf.shape[-1]
    return (q.dtype == k_buf.dtype == v_buf.dtype == torch.bfloat16 and v_buf.shape[-1] == d
            and q.shape[-1] == num_heads * d and d % 32 == 0 and d <= 256)


@dataclass
class FreshRun:
    """Fresh prompts on consecutive q rows [start, end), as one varlen call: cu [B + 1] int64
    offsets of each prompt's rows (its keys are the same rows of the new k/v)."""

    start: int
    end: int
    cu: torch.Tensor


def plan_fresh(fresh: list[tuple[int, int]]) -> list[FreshRun]:
    """Merge the fresh prompts' (q_start, q_end) ranges, in batch order, into runs of adjacent ones."""
    runs: list[list[int]] = []
    for start, end in fresh:
        if runs and runs[-1][-1] == start:
            runs[-1].append(end)
        else:
            runs.append([start, end])
    return [FreshRun(r[0], r[-1], torch.tensor([x - r[0] for x in r], dtype=torch.int64)) for r in runs]


@dataclass
class GroupPlan:
    """A PrefixGroup's members' own parts as one varlen call: their own slots end to end, and
    the offsets of their queries (in group.rows order) and of their own keys."""

    group: PrefixGroup
    own_slots: torch.Tensor  # [sum T_i] int64
    cu_q: torch.Tensor  # [members + 1] int64
    cu_k: torch.Tensor  # [members + 1] int64

    @staticmethod
    def of(group: PrefixGroup) -> GroupPlan:
        """The plan of `group` (made once per batch, used by every layer)."""
        ns = [m.rows.numel() for m in group.members]
        ts = [m.own_slots.numel() for m in group.members]
        return GroupPlan(group, torch.cat([m.own_slots for m in group.members]),
                         torch.tensor([0, *itertools.accumulate(ns)], dtype=torch.int64),
                         torch.tensor([0, *itertools.accumulate(ts)], dtype=torch.int64))


def fresh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, run: FreshRun, num_heads: int, scale: float,
          out: torch.Tensor) -> None:
    """Causal attention of a run of fresh prompts, each over its own new tokens, into out.

    q [T, Hq * D], k/v [T, Hkv * D] (rows may be strided, each contiguous), out [T, Hq * D]
    contiguous rows; all bf16; the run's rows are written. Raises ValueError / RuntimeError from
    the kernel's checks."""
    d = q.shape[1] // num_heads
    s, e = run.start, run.end
    amx_flash_attention(q[s:e].view(e - s, num_heads, d), k[s:e].view(e - s, -1, d), v[s:e].view(e - s, -1, d),
                        scale, True, cu_q=run.cu, cu_k=run.cu, out=out[s:e].view(e - s, num_heads, d))


def over_slots(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor, num_heads: int,
               scale: float, out: torch.Tensor) -> None:
    """Causal attention of a chunk's n queries over its context: the pool rows at `slots` [S]
    int64 (S >= n; the last n are the chunk's own), read in place. q/out [n, Hq * D], k_buf/v_buf
    [pool, Hkv, D]; bf16. Raises as `fresh`."""
    n, d = q.shape[0], k_buf.shape[2]
    amx_flash_attention(q.view(n, num_heads, d), k_buf, v_buf, scale, True, slots=slots,
                        out=out.view(n, num_heads, d))


def attend_group(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, plan: GroupPlan, num_heads: int,
                 scale: float, out: torch.Tensor) -> None:
    """Write the group's attention into out[group.rows] (see the module docstring).

    q/out [T, Hq * D] bf16 (out with contiguous rows), k_buf/v_buf [pool, Hkv, D] bf16. The merge
    weights the own part by sigmoid(lse_own - lse_shared), as `cpu_prefix_split.attend_group`.
    Raises as `fresh`."""
    group = plan.group
    d, n_all = k_buf.shape[2], group.rows.numel()
    r0 = int(group.rows[0])
    qg = q[r0 : r0 + n_all] if group.contiguous else q.index_select(0, group.rows)
    qg = qg.view(n_all, num_heads, d)
    o_shared, lse_shared = amx_flash_attention(qg, k_buf, v_buf, scale, False, slots=group.shared_slots,
                                               with_lse=True)
    o_own, lse_own = amx_flash_attention(qg, k_buf, v_buf, scale, True, slots=plan.own_slots, cu_q=plan.cu_q,
                                         cu_k=plan.cu_k, with_lse=True)
    # [Hq, N] -> [N, Hq, 1]: each output row's weight of its own part, rounded once to bf16
    w_own = torch.sigmoid(lse_own - lse_shared).t().unsqueeze(-1).to(o_shared.dtype)
    if group.contiguous:
        torch.lerp(o_shared, o_own, w_own, out=out[r0 : r0 + n_all].view(n_all, num_heads, d))
    else:
        out[group.rows] = torch.lerp(o_shared, o_own, w_own).view(n_all, num_heads * d)
